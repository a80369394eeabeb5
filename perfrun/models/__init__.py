"""The models perfrun trains: GPT-2's architecture (gpt.py), the Llama family (llama.py), the
language-model loss, pretrained weights and the Hugging Face layouts (pretrained.py, hf_layout.py).
Imports the root modules and checkpoint's atomic writes; never loop/, knobs/ or commands/."""
