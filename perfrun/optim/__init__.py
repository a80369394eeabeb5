"""The optimizer a run steps: AdamW and its schedule (:mod:`~perfrun.optim.adamw`), and
torchao's 8/4-bit AdamW with its checkpoint state as plain tensors (:mod:`~perfrun.optim.low_bit`).
The loop steps it and the memory estimate counts its state, so it sits below both."""
