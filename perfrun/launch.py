"""``python -m perfrun.launch TORCHRUN_ARGS``: torchrun (``torch.distributed.run``), whose
failures read as the ranks' own one-line errors and exit code.

torchrun itself reports a failed rank with a page (ChildFailedError, its traceback and
an error table) after the rank has already printed its one line; this wrapper keeps the
rank's line and code and drops the page. Everything else is torchrun's own code.
"""

from __future__ import annotations

import logging
import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str] | None = None) -> int:
    for name in ("torch.distributed", "torch.distributed.run"):  # its OMP_NUM_THREADS banner
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its failure page
    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:  # killed by a signal before it could say why
            name = signal.Signals(-failure.exitcode).name
            print(f"perfrun: error: rank {rank} was killed by {name}", file=sys.stderr)
            return 128 - failure.exitcode
        return failure.exitcode
    except SignalException as e:  # torchrun was stopped; it has forwarded the signal to the ranks
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
