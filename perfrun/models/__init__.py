"""The models perfrun trains: GPT-2's architecture (gpt.py), the Llama family (llama.py), the
model group's schema (schema.py), the language-model loss, pretrained weights from a Hugging
Face folder.
May import config and console; never loop/, knobs/, checkpoint/ or commands/."""
