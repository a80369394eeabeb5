"""The C heap a CPU run allocates from keeps what a step freed (perfrun/loop/host_heap.py):
pages counted, in fresh processes, with and without the thresholds fixed."""

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
# faulted in page by page; with them fixed, the heap grows once and is reused.
GROWING_TENSORS = """
import json, resource, sys, torch
if sys.argv[1] == "fixed":
    from perfrun.loop.host_heap import keep_freed_memory
    done = keep_freed_memory()
else:
    done = None
torch.empty(1).fill_(0)  # torch's own first allocations, outside the count
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for mib in range(1, 32):
    t = torch.empty(mib * 2**18, dtype=torch.float32).fill_(1.0)
    del t
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, "done": done}))
"""

glibc = pytest.mark.skipif(sys.platform != "linux" or "libc" not in (ctypes.util.find_library("c") or ""),
                           reason="glibc's heap thresholds: Linux only")


def _faults(mode: str) -> dict[str, Any]:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}  # no MALLOC_* or LD_PRELOAD from the caller
    out = subprocess.run([sys.executable, "-c", GROWING_TENSORS, mode], env=env, capture_output=True, text=True,
                         check=True, cwd=str(host_heap.__file__).rsplit("/perfrun/", 1)[0])
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_fixed_thresholds_fault_in_the_heap_once():
    system, fixed = _faults("system"), _faults("fixed")
    assert fixed["done"]["set"] is True and fixed["done"]["allocator"].startswith("glibc")
    assert fixed["done"]["mmap_threshold_mib"] == 32 and fixed["done"]["trim_threshold_mib"] == 64
    # 496 MiB touched in all: a fresh mapping each time is ~127k pages; one heap of 31 MiB ~8k
    assert system["faults"] > 60_000, system
    assert fixed["faults"] < system["faults"] / 4, (fixed, system)


@pytest.mark.parametrize(("env", "why"), [
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc is preloaded"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
])
def test_the_users_allocator_choice_is_left_alone(monkeypatch, env, why):
    for k in ("LD_PRELOAD", *host_heap._USER_SETTINGS):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    done = host_heap._fix_thresholds()
    assert done["set"] is False and why in done["why"]


def test_a_cpu_run_records_its_heap(one_process_run):
    _, summary = one_process_run
    heap = summary["host_heap"]
    assert heap is not None and isinstance(heap["set"], bool)
    assert heap == host_heap.keep_freed_memory()  # once per process: every later run reports the same
