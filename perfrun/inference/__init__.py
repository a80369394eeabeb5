"""The inference core under ``perfrun generate``, ``perfrun export`` and the int8 report.

- :mod:`~perfrun.inference.loading`: a checkpoint (file, sharded folder or run folder) into
  a GPT or Llama in eval mode, with its real vocabulary and its tokenizer;
- :mod:`~perfrun.inference.sampling`: greedy, temperature and top-k sampling whose random
  draws do not depend on the device, the batch or the path taken;
- :mod:`~perfrun.inference.generation`: the decode loop (static KV cache, optional compiled
  decode step, batches of prompts, per-sequence stopping), timed;
- :mod:`~perfrun.inference.int8`: dynamic int8 quantisation and its measured report;
- :mod:`~perfrun.inference.onnx_export`: the ONNX export (the Hugging Face layout is the
  models' own: :mod:`perfrun.models.hf_layout`).

Nothing here imports a command; the commands import from here.
"""
