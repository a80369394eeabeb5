"""``python -m perfrun.gpucheck``: the same as ``perfrun gpu-check``."""

from perfrun.commands.gpu_check import main

raise SystemExit(main())
