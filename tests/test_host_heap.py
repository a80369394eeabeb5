"""The C heap a CPU run allocates from keeps what a step freed with ``runtime.malloc=fixed``
(perfrun/loop/host_heap.py), and gives it back again after the job: pages counted in a
fresh process, with the system's thresholds, with them fixed, and after the job."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from typing import Any

import pytest

from perfrun.loop import host_heap

# Tensors of 1 to 31 MiB, each filled and freed in turn, as a step's activations come and go;
# with glibc's thresholds as a fresh process has them, each new size is a fresh mapping
# faulted in page by page; with them fixed, the heap grows once and is reused; after the
# job, glibc's starting values are back and each size is a fresh mapping again. One fresh
# process counts all three, the system's thresholds first: the first pass leaves no heap
# behind to reuse (each of its tensors was a mapping of its own).
GROWING_TENSORS = """
import json, resource, torch
from perfrun.config import RuntimeConfig
from perfrun.loop.runtime import fixed_heap

def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for mib in range(1, 32):
        t = torch.empty(mib * 2**18, dtype=torch.float32).fill_(1.0)
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

torch.empty(1).fill_(0)  # torch's own first allocations, outside the count
system = faults()
with fixed_heap(RuntimeConfig(malloc="fixed"), "cpu") as done:
    fixed = faults()
with fixed_heap(RuntimeConfig(malloc="system"), "cpu") as later:  # a later job of the process says what is left
    after = faults()
print(json.dumps({"system": system, "fixed": fixed, "after": after, "done": done["heap"], "later": later["heap"]}))
"""

glibc = pytest.mark.skipif(sys.platform != "linux" or "libc" not in (ctypes.util.find_library("c") or ""),
                           reason="glibc's heap thresholds: Linux only")


def _faults() -> dict[str, Any]:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # no MALLOC_* or LD_PRELOAD from the caller
    out = subprocess.run([sys.executable, "-c", GROWING_TENSORS], env=env, capture_output=True, text=True,
                         check=True, cwd=str(host_heap.__file__).rsplit("/perfrun/", 1)[0])
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@glibc
def test_fixed_thresholds_fault_in_the_heap_once_and_are_undone_after_the_job():
    counted = _faults()
    done = counted["done"]
    assert done["set"] is True and done["allocator"].startswith("glibc")
    assert done["mmap_threshold_mib"] == 32 and done["trim_threshold_mib"] == 64
    # 496 MiB touched in all: a fresh mapping each time is ~127k pages; one heap of 31 MiB ~8k
    # (counted on a Xeon with glibc 2.36: 127,015 and 11,764 to 22,516 in eight processes)
    assert counted["system"] > 60_000, counted
    assert counted["fixed"] < counted["system"] / 4, counted
    assert counted["after"] > 4 * counted["fixed"], counted  # the job's thresholds are not the process's after it
    assert counted["later"]["set"] is False and "an earlier job of this process fixed" in counted["later"]["why"]


@pytest.mark.parametrize(("env", "why"), [
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc is preloaded"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
])
def test_the_users_allocator_choice_is_left_alone(monkeypatch, env, why):
    for k in ("LD_PRELOAD", *host_heap._USER_SETTINGS):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    done = host_heap.fix_thresholds()
    assert done["set"] is False and why in done["why"]
