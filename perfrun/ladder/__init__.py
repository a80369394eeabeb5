"""The ladder: knobs added one at a time to a baseline, each rung measured against the one
below, and what a sweep leaves when it ends.

- :mod:`~perfrun.ladder.plan`: the rungs' steps and repeats planned within ``ablation.target_s``,
  calibrated on this machine before the first job
- :mod:`~perfrun.ladder.rungs`: one rung's job, skipped where its knob cannot act
- :mod:`~perfrun.ladder.jobs`: a sweep's jobs (already measured, stopped cleanly, the summary written)
- :mod:`~perfrun.ladder.callback`: the Hydra callback that writes the summary when a sweep ends
- :mod:`~perfrun.ladder.analysis`: the ladder's maths (each rung against the one below,
  leave-one-out, trade-offs, loss parity) read from the jobs' summaries
- :mod:`~perfrun.ladder.verdict`: what to recommend, outside the noise only
- :mod:`~perfrun.ladder.plot`, :mod:`~perfrun.ladder.memory_plot`: its figures
- :mod:`~perfrun.ladder.sweep_files`: the CSV, JSON and PNG a sweep leaves in its folder

A job's time budget itself is enforced by the training loop (:mod:`perfrun.loop.budget`); the
batch searches a sweep shares are :mod:`perfrun.memory.found_batches`.
"""
