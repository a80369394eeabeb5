"""``perfrun gpu-check``: diagnose this machine and measure what it can do, before training.

Kept apart so that the verdict can be tested with fake data:

* :mod:`~perfrun.gpucheck.facts` and :mod:`~perfrun.gpucheck.measure` (impure) read
  the environment, NVML, torch and psutil and run the pre-flight probes and
  measurements; :mod:`~perfrun.gpucheck.gather` puts them, in an order that keeps
  NVML's view clean, into one plain dict (the ``--json`` document);
* :mod:`~perfrun.gpucheck.checks` (pure): facts -> :class:`~perfrun.gpucheck.verdict.Check`
  lines (ok/warn/fail/skip, each warn or fail with a sentence saying what to do);
  :func:`~perfrun.gpucheck.verdict.exit_code` is 1 when any check fails, else 0;
* :mod:`~perfrun.gpucheck.render` prints the verdict (rich) or the document (``--json``);
  :mod:`~perfrun.commands.gpu_check` is the argparse command.
"""
