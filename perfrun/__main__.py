"""``python -m perfrun`` and the ``perfrun`` console script: one entry, wherever the
dispatcher lives."""

from perfrun.commands.dispatch import main

if __name__ == "__main__":
    raise SystemExit(main())
