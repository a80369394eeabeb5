"""The models perfrun trains: GPT-2's architecture (gpt.py), the Llama family (llama.py), the
language-model loss, pretrained weights from a Hugging Face folder.
Imports only perfrun's root modules (config, console); never loop/, knobs/, checkpoint/ or commands/."""
