"""The C heap a CPU step allocates its tensors from: glibc's thresholds fixed at the values
its own dynamic rule moves toward, so that a step reuses the memory the last step freed
instead of handing it back to the kernel and faulting it in again, page by page.

glibc serves an allocation above its mmap threshold with a fresh mapping, and trims the top
of its heap when more than its trim threshold lies free there; both start low (128 KiB) and
rise only as chunks of the right size happen to be freed, so how many pages a step faults in
depends on what the process did before the loop. Counted by ``scripts/bench_train.py
--calls`` (see BENCHMARKS.md): a 4x256 GPT step faulted in several times the pages of the
same step in a plain loop's process, and the kernel time of those faults was the step's gap.
Fixed, the heap keeps what a step frees (up to the trim threshold) and the count no longer
depends on the process's history.

The thresholds are the process's: ``runtime.malloc=fixed`` sets them for a CPU job and puts
glibc's starting values back at its end (:mod:`perfrun.loop.runtime`). glibc has no call
that gives its dynamic rule back once mallopt has set the mmap threshold, so after a fixed
job the values are the starting ones but stay where they are. A run's summary says what was
set (``runtime.heap``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

# mallopt's parameter numbers (glibc's malloc.h) and the largest mmap threshold its dynamic
# rule reaches on a 64-bit machine (DEFAULT_MMAP_THRESHOLD_MAX); the dynamic trim threshold
# is twice the mmap threshold.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")

START_THRESHOLD = 128 * 2**10  # both thresholds as glibc starts a process (DEFAULT_MMAP_THRESHOLD_MIN)
# Whether this process ever set the thresholds: any mallopt of them turns glibc's dynamic rule
# off for good, which a later job of the process (a sweep's next job, a library caller's next
# run) says.
_fixed_before = False


def fix_thresholds() -> dict[str, Any]:
    """Fix glibc's mmap and trim thresholds; return what was done and why, for summary.json.
    Left alone where the user chose: another allocator preloaded, or glibc's ``MALLOC_*``
    settings in the environment; and where the C library is not glibc."""
    preload = os.environ.get("LD_PRELOAD", "")
    other = next((a for a in _OTHER_ALLOCATORS if a in preload), None)
    if other:
        return {"set": False, "why": f"{other} is preloaded (LD_PRELOAD): its own caching applies"}
    chosen = [k for k in _USER_SETTINGS if k in os.environ]
    if chosen:
        return {"set": False, "why": f"glibc's settings are in the environment ({', '.join(chosen)})"}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return {"set": False, "why": "the C library is not glibc"}
    version.restype = ctypes.c_char_p
    if not _set(libc, MMAP_THRESHOLD, TRIM_THRESHOLD):
        return {"set": False, "why": "glibc's mallopt refused the thresholds"}
    return {"set": True, "allocator": f"glibc {version().decode()}",
            "mmap_threshold_mib": MMAP_THRESHOLD // 2**20, "trim_threshold_mib": TRIM_THRESHOLD // 2**20}


def restore_thresholds() -> None:
    """glibc's starting values back (after :func:`fix_thresholds` set them)."""
    _set(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), START_THRESHOLD, START_THRESHOLD)


def lasting_change() -> str | None:
    """What an earlier job left of the thresholds in this process, or None."""
    if not _fixed_before:
        return None
    return (f"an earlier job of this process fixed glibc's thresholds: they are back at glibc's starting "
            f"{START_THRESHOLD // 2**10} KiB but no longer rise by themselves")


def _set(libc: ctypes.CDLL, mmap_threshold: int, trim_threshold: int) -> bool:
    global _fixed_before
    done = libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and libc.mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    _fixed_before = _fixed_before or done
    return done
