"""``python -m perfrun.gpucheck``: the same as ``perfrun gpu-check``."""

from perfrun.gpucheck.command import main

raise SystemExit(main())
