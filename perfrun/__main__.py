"""``python -m perfrun`` and the ``perfrun`` console script: one entry, wherever the
dispatcher lives."""

import gc
import sys

from perfrun.commands.dispatch import main as dispatch


def main() -> int:
    """The command's exit code. On the way out the heap is frozen: the interpreter's last
    full collection would otherwise walk every object torch, dynamo and Hydra made, only to
    free memory the system takes back at exit anyway."""
    try:
        return dispatch()
    finally:
        gc.freeze()


if __name__ == "__main__":
    # the program's name, as the console script has it: Hydra's shell-completion script
    # (perfrun train -sc install=bash) names the command it completes after sys.argv[0]
    sys.argv[0] = "perfrun"
    raise SystemExit(main())
