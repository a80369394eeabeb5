"""``python -m perfrun`` and the ``perfrun`` console script: one entry, wherever the
dispatcher lives."""

import sys

from perfrun.commands.dispatch import main

if __name__ == "__main__":
    # the program's name, as the console script has it: Hydra's shell-completion script
    # (perfrun train -sc install=bash) names the command it completes after sys.argv[0]
    sys.argv[0] = "perfrun"
    raise SystemExit(main())
