"""``perfrun gpu-check``: diagnose this machine and measure what it can do, before training.

Two halves, kept apart so the verdict can be tested with fake data:

* gathering (impure): facts from the environment, NVML, torch and psutil, and
  pre-flight measurements, into one plain dict (the ``--json`` document);
* :func:`evaluate` (pure): facts -> :class:`Check` (ok/warn/fail/skip, each warn or
  fail with a sentence saying what to do), and :func:`exit_code`: 1 when any check
  fails, else 0 (warnings don't fail).

NVML facts are read before torch touches CUDA, so this process's own CUDA context
cannot show up as "another process holding memory".
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import shutil
import sys
import sysconfig
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from perfrun.console import first_line

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
_STATUSES = (OK, WARN, FAIL, SKIP)

#: Below this much free disk where outputs go, a run may die writing a checkpoint.
DISK_FAIL_GIB = 1.0
DISK_WARN_GIB = 5.0
#: DataLoader workers pass batches through /dev/shm; Docker's default is 64 MiB.
SHM_WARN_GIB = 1.0
RAM_WARN_GIB = 2.0
#: Memory used on an idle GPU by processes we cannot see (another container), as a share.
HIDDEN_MEM_WARN_SHARE = 0.10
#: A measured matmul below this share of the datasheet peak means something holds it back.
PEAK_WARN_SHARE = 0.40
#: Pinned host-to-device copies below this share of the PCIe link's rate.
H2D_WARN_SHARE = 0.50
#: Per-lane PCIe throughput in GB/s after encoding, by generation.
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


@dataclass
class Check:
    """One line of the verdict."""

    section: str
    name: str
    status: str
    detail: str
    fix: str | None = None

    def __post_init__(self) -> None:
        if self.status not in _STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {_STATUSES}")
        if self.status in (WARN, FAIL) and not self.fix:
            raise ValueError(f"check {self.name!r} is {self.status} without a fix")


def exit_code(checks: list[Check]) -> int:
    """1 when any check failed, else 0: warnings inform, failures stop a script."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def counts(checks: list[Check]) -> dict[str, int]:
    return {s: sum(1 for c in checks if c.status == s) for s in _STATUSES}


# =============================================================================
# Evaluation: pure functions of the facts dict
# =============================================================================


def _fmt(v: Any, spec: str = ".1f", unit: str = "") -> str:
    if v is None:
        return "N/A"
    try:
        return f"{v:{spec}}{unit}"
    except (TypeError, ValueError):
        return f"{v}{unit}"


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = []
    for p in str(text).split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


def software_checks(sw: dict[str, Any]) -> list[Check]:
    S = "software"
    out = [
        Check(
            S, "versions", OK,
            f"Python {sw.get('python')}, torch {sw.get('torch')} (CUDA {sw.get('torch_cuda') or 'none'}, "
            f"cuDNN {sw.get('cudnn') or 'none'}, NCCL {sw.get('nccl') or 'none'}), driver {sw.get('driver') or 'N/A'}, "
            f"Hydra {sw.get('hydra')}, OmegaConf {sw.get('omegaconf')}",
        )
    ]
    runtime, driver = _version_tuple(sw.get("torch_cuda")), _version_tuple(sw.get("cuda_driver"))
    if runtime and driver:
        if driver[0] < runtime[0]:
            out.append(Check(
                S, "cuda driver", FAIL,
                f"the driver supports CUDA {sw.get('cuda_driver')} but torch was built for CUDA {sw.get('torch_cuda')}",
                f"update the NVIDIA driver to one for CUDA {runtime[0]}.x, or install a torch built for CUDA "
                f"{sw.get('cuda_driver')} or older",
            ))
        elif driver < runtime:
            out.append(Check(
                S, "cuda driver", WARN,
                f"driver CUDA {sw.get('cuda_driver')} is older than torch's CUDA {sw.get('torch_cuda')} "
                "(minor-version compatibility; PTX JIT and some kernels may fail)",
                f"update the NVIDIA driver to one for CUDA {sw.get('torch_cuda')} or newer",
            ))
        else:
            out.append(Check(S, "cuda driver", OK, f"driver CUDA {sw.get('cuda_driver')} >= torch CUDA {sw.get('torch_cuda')}"))
    out.append(pynvml_check(sw.get("pynvml") or {}))
    out.extend(compiler_checks(sw.get("compilers") or {}, gpu=bool(sw.get("torch_cuda"))))
    return out


def pynvml_check(prov: dict[str, Any]) -> Check:
    """Which distribution provides the imported ``pynvml`` module.

    The ``pynvml`` distribution (before 12.0) shipped its own, stale copy of the
    module and shadows ``nvidia-ml-py``'s, NVIDIA's official bindings.
    """
    S = "software"
    fix = "pip uninstall pynvml && pip install nvidia-ml-py"
    installed = prov.get("installed") or {}
    if not prov.get("importable"):
        return Check(S, "pynvml", WARN, "the pynvml module is not importable: GPU telemetry is off", "pip install nvidia-ml-py")
    provider = (prov.get("provider") or "").lower().replace("_", "-")
    if provider == "pynvml":
        return Check(
            S, "pynvml", WARN,
            f"`import pynvml` loads the deprecated pynvml distribution ({installed.get('pynvml', '?')}), "
            "not NVIDIA's nvidia-ml-py",
            fix,
        )
    old = _version_tuple(installed.get("pynvml"))
    if provider != "nvidia-ml-py" and old is not None and old < (12,):
        return Check(
            S, "pynvml", WARN,
            f"the deprecated pynvml {installed['pynvml']} is installed and may shadow nvidia-ml-py",
            fix,
        )
    if provider == "nvidia-ml-py":
        return Check(S, "pynvml", OK, f"pynvml from nvidia-ml-py {installed.get('nvidia-ml-py', '?')}")
    return Check(S, "pynvml", OK, f"pynvml from {prov.get('provider') or 'an unknown source'} ({prov.get('file')})")


def compiler_checks(comp: dict[str, Any], *, gpu: bool) -> list[Check]:
    """torch.compile needs a C++ compiler (inductor's CPU code); on GPU Triton also builds a
    small C launcher against Python.h."""
    S = "software"
    out = []
    if comp.get("cxx"):
        out.append(Check(S, "c++ compiler", OK, f"{comp['cxx']} (for torch.compile)"))
    else:
        out.append(Check(
            S, "c++ compiler", WARN, "no C++ compiler found (g++, c++, clang++ or $CXX): torch.compile will fail",
            "install one (apt install g++ / build-essential) or train with compile=false",
        ))
    if gpu:
        if not comp.get("cc"):
            out.append(Check(
                S, "c compiler", WARN, "no C compiler found: Triton cannot build its launcher, torch.compile on GPU fails",
                "install gcc (apt install build-essential) or train with compile=false",
            ))
        if comp.get("python_h") is False:
            out.append(Check(
                S, "python headers", WARN, "Python.h is missing: Triton cannot build its launcher",
                f"install the Python {platform.python_version()[:4]} development headers (apt install python3-dev) "
                "or train with compile=false",
            ))
    return out


def host_checks(host: dict[str, Any]) -> list[Check]:
    S = "host"
    out = [Check(
        S, "cpu", OK,
        f"{host.get('cpu_model')}: {host.get('cpu_physical_cores')} cores / {host.get('cpu_logical_cores')} threads "
        f"({host.get('cpu_usable_cores')} usable), RAM {_fmt(host.get('ram_total_gib'))} GiB",
    )]
    avail = host.get("ram_available_gib")
    if avail is not None and avail < RAM_WARN_GIB:
        out.append(Check(
            S, "ram", WARN, f"only {avail:.1f} GiB RAM available",
            "close other programs, or use fewer DataLoader workers (dataloader.num_workers)",
        ))
    free, where = host.get("disk_free_gib"), host.get("output_dir")
    if free is None:
        out.append(Check(S, "disk", SKIP, f"cannot read free space of {where}"))
    elif free < DISK_FAIL_GIB:
        out.append(Check(
            S, "disk", FAIL, f"{free:.2f} GiB free in {where}: outputs and checkpoints will not fit",
            "free space there, or run from a directory on a disk with room (outputs go under the current directory)",
        ))
    elif free < DISK_WARN_GIB:
        out.append(Check(
            S, "disk", WARN, f"{free:.1f} GiB free in {where}",
            "free space there, or run from a directory on a disk with room",
        ))
    else:
        out.append(Check(S, "disk", OK, f"{free:.0f} GiB free in {where}"))
    shm = host.get("shm_total_gib")
    shm_fix = "give the container more (docker run --shm-size=8g, or --ipc=host) or train with dataloader.num_workers=0"
    if shm is None:
        out.append(Check(S, "/dev/shm", WARN, "no /dev/shm: DataLoader workers pass batches through shared memory", shm_fix))
    elif shm < SHM_WARN_GIB:
        out.append(Check(S, "/dev/shm", WARN, f"/dev/shm is only {shm * 1024:.0f} MiB: DataLoader workers may crash (bus error)", shm_fix))
    else:
        out.append(Check(S, "/dev/shm", OK, f"{shm:.1f} GiB"))
    return out


def visibility_checks(report: dict[str, Any]) -> list[Check]:
    """Is a CUDA device visible to torch, and is the one asked for there?"""
    S = "cuda"
    cuda = report.get("cuda") or {}
    n_torch, n_nvml = cuda.get("torch_device_count", 0), cuda.get("nvml_device_count", 0)
    sw = report.get("software") or {}
    requested = report.get("device_index")
    if n_torch == 0:
        if n_nvml:
            return [Check(
                S, "cuda device", FAIL,
                f"NVML sees {n_nvml} GPU(s) but torch cannot use them (torch {sw.get('torch')}, "
                f"CUDA {sw.get('torch_cuda') or 'none'}: {cuda.get('torch_error') or 'not a CUDA build'})",
                "install a CUDA build of torch that matches the driver (pytorch.org, 'Get started'), "
                "and check CUDA_VISIBLE_DEVICES",
            )]
        return [Check(
            S, "cuda device", WARN,
            f"no CUDA device is visible (torch CUDA {sw.get('torch_cuda') or 'none'}; "
            f"CUDA_VISIBLE_DEVICES={cuda.get('cuda_visible_devices')!r}); only the CPU side was checked",
            "on a GPU machine: check `nvidia-smi`, CUDA_VISIBLE_DEVICES and that torch is a CUDA build "
            "(torch.version.cuda is not None)",
        )]
    if requested is not None and not 0 <= requested < n_torch:
        return [Check(
            S, "cuda device", FAIL, f"--device {requested} does not exist: torch sees {n_torch} device(s)",
            f"pick --device between 0 and {n_torch - 1} (check CUDA_VISIBLE_DEVICES)",
        )]
    return [Check(S, "cuda device", OK, f"{n_torch} CUDA device(s) visible to torch, {n_nvml} to NVML")]


def gpu_checks(g: dict[str, Any]) -> list[Check]:
    """Every check on one GPU's facts (NVML + torch); N/A facts give ``skip``."""
    label = f"gpu {g.get('torch_index', g.get('nvml_index'))}"
    i = g.get("nvml_index", 0)
    out = [Check(
        label, "identity", OK,
        f"{g.get('name')} [{g.get('uuid')}], compute capability {g.get('compute_capability') or 'N/A'}, "
        f"{_fmt(g.get('memory_total_mib'), ',.0f')} MiB",
    )]
    if not g.get("nvml"):
        out.append(Check(label, "nvml", SKIP, f"NVML unavailable ({g.get('nvml_error')}): no driver-level facts"))
        return out

    out.append(Check(
        label, "clocks", OK,
        f"SM {_fmt(g.get('sm_clock_mhz'), '.0f')}/{_fmt(g.get('sm_clock_max_mhz'), '.0f')} MHz, "
        f"memory {_fmt(g.get('mem_clock_mhz'), '.0f')}/{_fmt(g.get('mem_clock_max_mhz'), '.0f')} MHz (current/max), "
        f"{_fmt(g.get('temp_c'), '.0f')} C, {_fmt(g.get('power_w'), '.0f')} W",
    ))

    limit, default = g.get("power_limit_w"), g.get("power_default_limit_w")
    if limit is None:
        out.append(Check(label, "power limit", SKIP, "N/A"))
    elif default and limit < 0.95 * default:
        out.append(Check(
            label, "power limit", WARN, f"power limit {limit:.0f} W is below the default {default:.0f} W: clocks will cap early",
            f"sudo nvidia-smi -i {i} -pl {default:.0f}",
        ))
    else:
        out.append(Check(label, "power limit", OK, f"{limit:.0f} W" + (f" (default {default:.0f} W)" if default else "")))

    pm = g.get("persistence_mode")
    if pm is None:
        out.append(Check(label, "persistence mode", SKIP, "N/A on this GPU/OS"))
    elif not pm:
        out.append(Check(
            label, "persistence mode", WARN, "off: the driver unloads when idle, so each run's first CUDA call is slow",
            f"sudo nvidia-smi -i {i} -pm 1 (or enable the nvidia-persistenced service)",
        ))
    else:
        out.append(Check(label, "persistence mode", OK, "on"))

    out.append(_ecc_check(label, i, g))
    out.append(_pcie_check(label, g))

    mig = g.get("mig_mode")
    if mig is None:
        out.append(Check(label, "mig", SKIP, "MIG not supported"))
    elif mig:
        out.append(Check(
            label, "mig", WARN,
            "MIG is enabled: torch sees a slice, and utilisation/power telemetry is N/A on slices",
            f"for the whole GPU: sudo nvidia-smi -i {i} -mig 0 (with no processes running), then reset the GPU",
        ))
    else:
        out.append(Check(label, "mig", OK, "disabled"))

    out.append(_throttle_check(label, g))
    out.append(_process_check(label, g))
    return out


def _ecc_check(label: str, i: int, g: dict[str, Any]) -> Check:
    mode = g.get("ecc_mode")
    if mode is None:
        return Check(label, "ecc", SKIP, "ECC not supported (typical of consumer GPUs)")
    vol_unc = g.get("ecc_volatile_uncorrected") or 0
    vol_cor = g.get("ecc_volatile_corrected") or 0
    agg_unc = g.get("ecc_aggregate_uncorrected") or 0
    counts_text = f"volatile uncorrected {vol_unc}, corrected {vol_cor}; lifetime uncorrected {agg_unc}"
    if vol_unc > 0:
        return Check(
            label, "ecc", FAIL, f"uncorrected ECC errors since the driver loaded ({counts_text}): results may be wrong",
            f"stop work on this GPU and reset it (sudo nvidia-smi -i {i} -r) or reboot; if errors return, "
            "report the GPU to your provider",
        )
    if vol_cor > 0 or agg_unc > 0:
        return Check(
            label, "ecc", WARN, f"ECC errors recorded ({counts_text})",
            "watch `nvidia-smi -q -d ECC`; if counts grow, reset the GPU and report it to your provider",
        )
    return Check(label, "ecc", OK, f"{'on' if mode else 'off'}; {counts_text}")


def _pcie_check(label: str, g: dict[str, Any]) -> Check:
    gen, gen_max = g.get("pcie_gen"), g.get("pcie_gen_max")
    width, width_max = g.get("pcie_width"), g.get("pcie_width_max")
    if None in (gen, gen_max, width, width_max):
        return Check(label, "pcie link", SKIP, "PCIe link N/A")
    text = f"Gen{gen} x{width} (max Gen{gen_max} x{width_max})"
    below = gen < gen_max or width < width_max
    if not below:
        return Check(label, "pcie link", OK, text + (" under load" if g.get("pcie_under_load") else ""))
    if not g.get("pcie_under_load"):
        return Check(label, "pcie link", OK, text + " at idle; GPUs lower the link speed when idle to save power")
    return Check(
        label, "pcie link", WARN, text + " while copying: host-to-device transfers are slower than the slot allows",
        "reseat the GPU or move it to a full x16 slot of its generation; check the BIOS PCIe settings and risers "
        "(`nvidia-smi -q -d PCIE`)",
    )


def _throttle_check(label: str, g: dict[str, Any]) -> Check:
    from perfrun.telemetry.nvml import SLOWDOWN_REASONS

    reasons = g.get("throttle_reasons")
    if reasons is None:
        return Check(label, "throttling", SKIP, "clock-event reasons N/A")
    slow = [r for r in reasons if r in SLOWDOWN_REASONS]
    busy = bool(g.get("other_processes")) or (g.get("utilization_pct") or 0) >= 10
    if slow and not busy:
        return Check(
            label, "throttling", WARN, f"throttled at idle: {', '.join(slow)}",
            "check cooling, airflow and power cabling; `nvidia-smi -q -d PERFORMANCE` shows which limit is hit "
            "(sw_power_cap at idle means the power limit is set too low: `nvidia-smi -pl`)",
        )
    state = "busy" if busy else "idle"
    return Check(label, "throttling", OK, f"{state}; clock-event reasons now: {', '.join(reasons) or 'none'}")


def _process_check(label: str, g: dict[str, Any]) -> Check:
    others = g.get("other_processes")
    total = g.get("memory_total_mib")
    used = g.get("memory_used_mib")
    if others:
        listed = ", ".join(
            f"pid {p.get('pid')} ({p.get('name') or '?'}, {_fmt(p.get('used_mib'), ',.0f')} MiB)" for p in others[:5]
        )
        return Check(
            label, "other processes", WARN, f"{len(others)} other process(es) on this GPU: {listed}",
            "stop them, or pick a free GPU (--device N / CUDA_VISIBLE_DEVICES); shared GPUs give noisy measurements",
        )
    if others is not None and used is not None and total and used > HIDDEN_MEM_WARN_SHARE * total:
        return Check(
            label, "other processes", WARN,
            f"{used:,.0f} of {total:,.0f} MiB in use by processes not visible from here (another container?)",
            "find the owner with `nvidia-smi` on the host, or pick a free GPU (--device N / CUDA_VISIBLE_DEVICES)",
        )
    if others is None:
        return Check(label, "other processes", SKIP, "process list N/A")
    return Check(label, "other processes", OK, f"none; {_fmt(used, ',.0f')} MiB in use")


def capability_checks(cap: dict[str, Any]) -> list[Check]:
    S = "capabilities"
    out = []
    gpu = cap.get("device", "cpu").startswith("cuda")
    bf16 = cap.get("bf16")
    if bf16 is None:
        out.append(Check(S, "bf16", SKIP, "not tested"))
    elif bf16:
        out.append(Check(S, "bf16", OK, "supported" + ("" if gpu else " (CPU)")))
    else:
        out.append(Check(S, "bf16", WARN, "bf16 is not supported on this device", "train with precision=fp16 (loss scaling) or precision=none"))
    fp16 = cap.get("fp16")
    out.append(Check(S, "fp16", OK if fp16 else SKIP, "supported" if fp16 else "not tested"))
    tf32 = cap.get("tf32")
    if not gpu:
        out.append(Check(S, "tf32", SKIP, "TF32 is a CUDA tensor-core mode"))
    else:
        out.append(Check(S, "tf32", OK if tf32 else SKIP, "supported (compute capability >= 8.0)" if tf32 else "needs compute capability >= 8.0"))
    for name, res in (cap.get("sdpa") or {}).items():
        if res.get("ok"):
            out.append(Check(S, f"sdpa {name}", OK, "available"))
        elif name == "math":
            out.append(Check(
                S, "sdpa math", FAIL, f"the reference SDPA kernel failed: {res.get('error')}",
                "reinstall torch; attention=eager avoids SDPA meanwhile",
            ))
        else:
            out.append(Check(S, f"sdpa {name}", SKIP, f"not available here: {res.get('error')}"))
    comp = cap.get("compile") or {}
    if comp.get("skipped"):
        out.append(Check(S, "torch.compile", SKIP, comp.get("skipped")))
    elif comp.get("ok"):
        out.append(Check(S, "torch.compile", OK, f"smoke test compiled and matched eager in {_fmt(comp.get('seconds'), '.1f')} s"))
    elif comp:
        out.append(Check(
            S, "torch.compile", WARN, f"smoke test failed: {comp.get('error')}",
            "train with compile=false; fix the error above (often a missing compiler or Python headers)",
        ))
    return out


def measurement_checks(meas: dict[str, Any]) -> list[Check]:
    """Each measurement is ok with its figure; an error is a failure (the device misbehaves)."""
    S = "measurements"
    out = []
    gpu = meas.get("device", "cpu").startswith("cuda")
    unit, scale = ("TFLOPS", 1.0) if gpu else ("GFLOPS", 1000.0)
    for dt, m in (meas.get("matmul") or {}).items():
        if m.get("error"):
            out.append(Check(
                S, f"matmul {dt}", FAIL, f"failed: {m['error']}",
                "check the device with `nvidia-smi` and the driver/torch versions above",
            ))
            continue
        text = f"{m['tflops'] * scale:,.1f} {unit} ({m.get('method')})"
        sheet = m.get("datasheet_tflops")
        if sheet:
            share = m["tflops"] / sheet
            text += f"; {100 * share:.0f}% of the datasheet {sheet:g} TFLOPS"
            if share < PEAK_WARN_SHARE:
                out.append(Check(
                    S, f"matmul {dt}", WARN, text + ": far below what this GPU should reach",
                    "look for throttling, a low power limit or another process (checks above; "
                    "`nvidia-smi -q -d PERFORMANCE`)",
                ))
                continue
        out.append(Check(S, f"matmul {dt}", OK, text))
    mm = meas.get("matmul") or {}
    if not gpu and mm.get("bf16", {}).get("tflops") and mm.get("fp32", {}).get("tflops"):
        ratio = mm["bf16"]["tflops"] / mm["fp32"]["tflops"]
        if ratio < 0.5:
            out.append(Check(
                S, "cpu bf16", WARN, f"bf16 matmul runs at {ratio:.2f}x fp32 on this CPU (no native bf16 units)",
                "on this CPU train with precision=none; bf16 pays off on GPUs or CPUs with AVX512-BF16/AMX",
            ))
    for key, label in (("d2d_copy", "device copy"), ("h2d_pinned", "host->device pinned"), ("h2d_pageable", "host->device pageable")):
        m = meas.get(key)
        if not m:
            continue
        if m.get("error"):
            out.append(Check(S, label, FAIL, f"failed: {m['error']}", "check the device with `nvidia-smi`"))
            continue
        text = f"{m['gb_s']:,.1f} GB/s ({m.get('method')})"
        link = m.get("link_gb_s")
        if key == "h2d_pinned" and link:
            text += f"; link max {link:.1f} GB/s"
            if m["gb_s"] < H2D_WARN_SHARE * link:
                out.append(Check(
                    S, label, WARN, text + ": well below the PCIe link",
                    "check the PCIe link above (slot, riser, BIOS) and NUMA placement (run on the GPU's CPU socket)",
                ))
                continue
        out.append(Check(S, label, OK, text))
    return out


def evaluate(report: dict[str, Any]) -> list[Check]:
    """Facts -> checks. Pure: tests feed it hand-written reports."""
    checks = software_checks(report.get("software") or {})
    checks += host_checks(report.get("host") or {})
    checks += visibility_checks(report)
    for g in report.get("gpus") or []:
        checks += gpu_checks(g)
    if report.get("capabilities"):
        checks += capability_checks(report["capabilities"])
    if report.get("measurements"):
        checks += measurement_checks(report["measurements"])
    return checks


# =============================================================================
# Gathering: the environment, NVML, torch
# =============================================================================


def _safe(fn: Callable[[], Any], default: Any = None) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a fact we cannot read is N/A
        return default


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def pynvml_provenance() -> dict[str, Any]:
    """Which installed distribution owns the file ``import pynvml`` would load."""
    spec = _safe(lambda: importlib.util.find_spec("pynvml"))
    installed = {n: v for n in ("pynvml", "nvidia-ml-py") if (v := _dist_version(n))}
    if spec is None or not spec.origin:
        return {"importable": False, "provider": None, "file": None, "installed": installed}
    origin = Path(spec.origin).resolve()
    provider = None
    candidates = _safe(lambda: md.packages_distributions().get("pynvml", []), []) or list(installed)
    for dist_name in dict.fromkeys(candidates):
        dist = _safe(lambda d=dist_name: md.distribution(d))
        if dist is None:
            continue
        for f in dist.files or []:
            if _safe(lambda dist=dist, f=f: Path(dist.locate_file(f)).resolve() == origin, False):
                provider = dist.metadata["Name"]
                break
        if provider:
            break
    return {"importable": True, "provider": provider, "file": str(origin), "installed": installed}


def compiler_facts() -> dict[str, Any]:
    cxx_env = os.environ.get("CXX")
    cxx = next((p for c in ([cxx_env] if cxx_env else []) + ["g++", "c++", "clang++"] if (p := shutil.which(c))), None)
    cc_env = os.environ.get("CC")
    cc = next((p for c in ([cc_env] if cc_env else []) + ["gcc", "cc", "clang"] if (p := shutil.which(c))), None)
    include = sysconfig.get_paths().get("include")
    return {"cxx": cxx, "cc": cc, "python_h": bool(include and (Path(include) / "Python.h").exists())}


def software_facts(nvml: Any) -> dict[str, Any]:
    import torch

    cuda_driver = None
    raw = nvml.call("cuda_driver", "nvmlSystemGetCudaDriverVersion", warn=False) if nvml else None
    if raw:
        cuda_driver = f"{int(raw) // 1000}.{(int(raw) % 1000) // 10}"
    nccl = _safe(lambda: torch.cuda.nccl.version()) if torch.version.cuda else None
    driver = nvml.call("driver", "nvmlSystemGetDriverVersion", warn=False) if nvml else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": _safe(lambda: torch.backends.cudnn.version()),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else (str(nccl) if nccl else None),
        "driver": driver.decode() if isinstance(driver, bytes) else driver,
        "cuda_driver": cuda_driver,
        "hydra": _dist_version("hydra-core"),
        "omegaconf": _dist_version("omegaconf"),
        "nvidia_ml_py": _dist_version("nvidia-ml-py"),
        "pynvml": pynvml_provenance(),
        "compilers": compiler_facts(),
        "platform": platform.platform(),
    }


def nvml_gpu_facts(nvml: Any, dev: Any) -> dict[str, Any]:
    """Driver-level facts for one NVML device; read before this process creates a CUDA context."""
    from perfrun.telemetry.nvml import ctypes_value, decode_reasons

    m, h = nvml.module, dev.handle

    def get(fn: str, *args: Any) -> Any:
        v = nvml.call(fn, fn, h, *args, warn=False)
        return ctypes_value(v) if v is not None else None

    def first(v: Any) -> Any:
        return ctypes_value(v[0]) if isinstance(v, list | tuple) and v else v

    mem = get("nvmlDeviceGetMemoryInfo")
    util = get("nvmlDeviceGetUtilizationRates")
    cc = get("nvmlDeviceGetCudaComputeCapability")
    mw = get("nvmlDeviceGetPowerUsage")
    limit = get("nvmlDeviceGetEnforcedPowerLimit")
    default = get("nvmlDeviceGetPowerManagementDefaultLimit")
    sm_id, mem_id = getattr(m, "NVML_CLOCK_SM", 1), getattr(m, "NVML_CLOCK_MEM", 2)
    unc, cor = getattr(m, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1), getattr(m, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)
    vol, agg = getattr(m, "NVML_VOLATILE_ECC", 0), getattr(m, "NVML_AGGREGATE_ECC", 1)
    ecc = first(get("nvmlDeviceGetEccMode"))
    mask = nvml.call("throttle_reasons", ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"), h, warn=False)
    procs = get("nvmlDeviceGetComputeRunningProcesses")
    others = None
    if procs is not None:
        others = []
        for p in procs:
            pid = getattr(p, "pid", None)
            if pid == os.getpid():
                continue
            used = getattr(p, "usedGpuMemory", None)
            others.append({
                "pid": pid,
                "name": _safe(lambda pid=pid: __import__("psutil").Process(pid).name()),
                "used_mib": None if used is None else used / 2**20,
            })
    mig = get("nvmlDeviceGetMigMode")
    return {
        "nvml": True,
        "nvml_index": dev.index,
        "is_mig_slice": dev.is_mig,
        "name": dev.name,
        "uuid": dev.uuid,
        "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
        "memory_total_mib": None if mem is None else mem.total / 2**20,
        "memory_used_mib": None if mem is None else mem.used / 2**20,
        "utilization_pct": None if util is None else util.gpu,
        "power_w": None if mw is None else mw / 1000,
        "power_limit_w": None if limit is None else limit / 1000,
        "power_default_limit_w": None if default is None else default / 1000,
        "temp_c": get("nvmlDeviceGetTemperature", getattr(m, "NVML_TEMPERATURE_GPU", 0)),
        "sm_clock_mhz": get("nvmlDeviceGetClockInfo", sm_id),
        "sm_clock_max_mhz": get("nvmlDeviceGetMaxClockInfo", sm_id),
        "mem_clock_mhz": get("nvmlDeviceGetClockInfo", mem_id),
        "mem_clock_max_mhz": get("nvmlDeviceGetMaxClockInfo", mem_id),
        "persistence_mode": None if (pm := get("nvmlDeviceGetPersistenceMode")) is None else bool(pm),
        "ecc_mode": None if ecc is None else bool(ecc),
        "ecc_volatile_uncorrected": get("nvmlDeviceGetTotalEccErrors", unc, vol) if ecc is not None else None,
        "ecc_volatile_corrected": get("nvmlDeviceGetTotalEccErrors", cor, vol) if ecc is not None else None,
        "ecc_aggregate_uncorrected": get("nvmlDeviceGetTotalEccErrors", unc, agg) if ecc is not None else None,
        "pcie_gen": get("nvmlDeviceGetCurrPcieLinkGeneration"),
        "pcie_gen_max": get("nvmlDeviceGetMaxPcieLinkGeneration"),
        "pcie_width": get("nvmlDeviceGetCurrPcieLinkWidth"),
        "pcie_width_max": get("nvmlDeviceGetMaxPcieLinkWidth"),
        "pcie_under_load": False,
        "mig_mode": None if mig is None else bool(first(mig)),
        "throttle_reasons": decode_reasons(None if mask is None else int(ctypes_value(mask)), m),
        "other_processes": others,
    }


def torch_gpu_facts(index: int) -> dict[str, Any]:
    import torch

    p = torch.cuda.get_device_properties(index)
    return {
        "torch_index": index,
        "name": p.name,
        "uuid": str(getattr(p, "uuid", "")) or None,
        "compute_capability": f"{p.major}.{p.minor}",
        "memory_total_mib": p.total_memory / 2**20,
        "multiprocessors": p.multi_processor_count,
    }


def sdpa_backends(device: Any) -> dict[str, dict[str, Any]]:
    """Run a tiny causal SDPA under each backend alone: available means it actually ran."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    q = torch.randn(1, 2, 64, 64, device=device, dtype=dtype)
    out: dict[str, dict[str, Any]] = {}
    for name, attr in (("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"),
                       ("cudnn", "CUDNN_ATTENTION"), ("math", "MATH")):
        backend = getattr(SDPBackend, attr, None)
        if backend is None:
            out[name] = {"ok": False, "error": "this torch has no such backend"}
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel([backend]):
                    y = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                ok = bool(torch.isfinite(y).all())
                out[name] = {"ok": ok} if ok else {"ok": False, "error": "non-finite output"}
            except Exception as exc:  # noqa: BLE001 - "No available kernel" is the answer
                why = next((str(w.message) for w in caught), None) or first_line(exc, 300)
                out[name] = {"ok": False, "error": first_line(why, 300)}
    return out


def compile_smoke(device: Any) -> dict[str, Any]:
    """Compile a tiny function with inductor, compare with eager, then reset dynamo's caches."""
    import torch

    def f(x: Any) -> Any:
        return torch.nn.functional.gelu(x) * 2.0 + x.sin()

    t0 = time.perf_counter()
    try:
        torch._dynamo.reset()
        x = torch.randn(64, 64, device=device)
        y = torch.compile(f)(x)
        ok = bool(torch.allclose(y, f(x), atol=1e-5, rtol=1e-4))
        res: dict[str, Any] = {"ok": ok, "seconds": time.perf_counter() - t0}
        if not ok:
            res["error"] = "compiled output differs from eager"
        return res
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": first_line(exc, 300), "seconds": time.perf_counter() - t0}
    finally:
        with contextlib.suppress(Exception):
            torch._dynamo.reset()


def capability_facts(device: Any, *, quick: bool) -> dict[str, Any]:
    import torch

    cap: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        cap["bf16"] = _safe(lambda: torch.cuda.is_bf16_supported(including_emulation=False))
        if cap["bf16"] is None:
            cap["bf16"] = _safe(lambda: torch.cuda.is_bf16_supported())
        cap["fp16"] = True
        cap["tf32"] = major >= 8
    else:
        def works(dt: Any) -> bool:
            a = torch.ones(8, 8, dtype=dt)
            return bool((a @ a).float().sum().item() == 512.0)

        cap["bf16"] = _safe(lambda: works(torch.bfloat16), False)
        cap["fp16"] = _safe(lambda: works(torch.float16), False)
        cap["tf32"] = False
    cap["sdpa"] = sdpa_backends(device)
    cap["compile"] = {"skipped": "--quick"} if quick else compile_smoke(device)
    return cap


def _bandwidth(fn: Callable[[], Any], device: Any, nbytes: int, factor: float, *, repeats: int, what: str) -> dict[str, Any]:
    from perfrun.telemetry.peaks import time_op

    sec, inner = time_op(fn, device, repeats=repeats, warmup_s=0.1, target_s=0.05)
    return {
        "gb_s": factor * nbytes / sec / 1e9,
        "bytes": nbytes,
        "method": f"{what}, {nbytes / 2**20:.0f} MiB, median of {repeats} repeats of {inner}, CUDA events",
    }


def measurement_facts(
    device: Any, *, quick: bool, gpu: dict[str, Any] | None, nvml: Any = None, nvml_handle: Any = None
) -> dict[str, Any]:
    """Matmul peaks (and, on a GPU, copy bandwidths); cached as measured peaks for MFU."""
    import torch

    from perfrun.telemetry import peaks

    meas: dict[str, Any] = {"device": str(device), "matmul": {}}
    key = _safe(lambda: peaks.device_key(device))
    name = (gpu or {}).get("name") or ""
    if device.type == "cuda":
        plans = [("bf16", torch.bfloat16, None), ("fp16", torch.float16, None),
                 ("tf32", torch.float32, True), ("fp32", torch.float32, False)]
        size, repeats = (4096, 3) if quick else (8192, 5)
    else:
        plans = [("fp32", torch.float32, None), ("bf16", torch.bfloat16, None)]
        size, repeats = None, 5
    for dt, torch_dtype, tf in plans:
        try:
            r = peaks.measure_matmul(device, torch_dtype, size=size, repeats=repeats, allow_tf32=tf)
            entry: dict[str, Any] = {"tflops": r.tflops, "method": r.method()}
            if device.type == "cuda":
                entry["datasheet_tflops"], entry["datasheet_source"] = peaks.datasheet_peak_tflops(name, dt)
            meas["matmul"][dt] = entry
            # quick GPU runs use small matrices that under-state the peak; don't cache them
            if key and (device.type != "cuda" or not quick):
                _safe(lambda dt=dt, r=r: peaks.store_measured(key, dt, r, by="perfrun gpu-check"))
        except Exception as exc:  # noqa: BLE001
            meas["matmul"][dt] = {"error": first_line(exc, 300)}
    if key:
        meas["peaks_cache"] = str(peaks.cache_path())
    if device.type != "cuda":
        return meas

    nbytes = (64 if quick else 256) * 2**20
    reps = 3 if quick else 5
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        meas["d2d_copy"] = _bandwidth(lambda: dst.copy_(src), device, nbytes, 2.0, repeats=reps,
                                      what="device-to-device copy, read + write bytes counted")
    except Exception as exc:  # noqa: BLE001
        meas["d2d_copy"] = {"error": first_line(exc, 300)}
        dst = None
    for key2, pinned in (("h2d_pinned", True), ("h2d_pageable", False)):
        try:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            host.fill_(1)
            target = dst if dst is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)
            meas[key2] = _bandwidth(lambda host=host, target=target, pinned=pinned: target.copy_(host, non_blocking=pinned),
                                    device, nbytes, 1.0, repeats=reps,
                                    what=f"host-to-device copy from {'pinned' if pinned else 'pageable'} memory")
            if pinned and nvml is not None and nvml_handle is not None and gpu is not None:
                # read the link while copies are in flight: idle GPUs drop to a low PCIe gen
                for _ in range(8):
                    target.copy_(host, non_blocking=True)
                gpu["pcie_gen"] = nvml.call("pcie", "nvmlDeviceGetCurrPcieLinkGeneration", nvml_handle, warn=False) or gpu.get("pcie_gen")
                gpu["pcie_width"] = nvml.call("pcie", "nvmlDeviceGetCurrPcieLinkWidth", nvml_handle, warn=False) or gpu.get("pcie_width")
                gpu["pcie_under_load"] = True
                torch.cuda.synchronize(device)
            gen, width = (gpu or {}).get("pcie_gen_max"), (gpu or {}).get("pcie_width_max")
            if pinned and gen in PCIE_GBPS_PER_LANE and width:
                meas[key2]["link_gb_s"] = PCIE_GBPS_PER_LANE[gen] * width
        except Exception as exc:  # noqa: BLE001
            meas[key2] = {"error": first_line(exc, 300)}
    return meas


def gather(device_index: int | None, *, quick: bool, nvml_module: Any = None) -> dict[str, Any]:
    """Every fact and measurement, in the order that keeps NVML's view clean."""
    from perfrun.telemetry import nvml as nvml_mod
    from perfrun.telemetry.host import host_facts

    t0 = time.perf_counter()
    session = nvml_mod.get_session(nvml_module)
    nvml = session if session.available else None
    nvml_devices = [d for d in session.devices() if not d.is_mig] if nvml else []
    nvml_mig = [d for d in session.devices() if d.is_mig] if nvml else []
    nvml_facts = {d.uuid: nvml_gpu_facts(session, d) for d in nvml_devices + nvml_mig}

    import torch

    report: dict[str, Any] = {
        "perfrun_version": _safe(lambda: __import__("perfrun").__version__),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "device_index": device_index,
        "software": software_facts(nvml),
        "host": host_facts(Path.cwd()),
    }
    torch_error = None
    try:
        n_torch = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # noqa: BLE001
        n_torch, torch_error = 0, first_line(exc, 300)
    report["cuda"] = {
        "torch_device_count": n_torch,
        "nvml_device_count": len(nvml_devices),
        "nvml_error": None if nvml else session.error,
        "torch_error": torch_error,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    gpus: list[dict[str, Any]] = []
    handles: dict[int, Any] = {}
    if n_torch:
        indices = [device_index] if device_index is not None else list(range(n_torch))
        for i in indices:
            if not 0 <= i < n_torch:
                continue
            facts = torch_gpu_facts(i)
            dev = session.match_uuid(facts["uuid"]) if nvml and facts.get("uuid") else None
            if dev is not None:
                handles[i] = dev.handle
                base = nvml_facts[dev.uuid]
                if dev.is_mig:  # a slice answers little; the parent GPU has the link, ECC, clocks
                    parent = next((d for d in nvml_devices if d.index == dev.index), None)
                    if parent is not None:
                        base = {**nvml_facts[parent.uuid], **{k: v for k, v in base.items() if v is not None}}
                merged = {**base, **{k: v for k, v in facts.items() if v is not None}}
                merged["name"] = facts["name"]
                merged["uuid"] = base.get("uuid") or facts["uuid"]  # NVML's GPU-... form, as nvidia-smi prints it
                gpus.append(merged)
            else:
                gpus.append({**facts, "nvml": False, "nvml_error": session.error or "no NVML device with this UUID"})
    else:
        for d in nvml_devices:  # torch can't see them; report what NVML can
            gpus.append(nvml_facts[d.uuid])
    report["gpus"] = gpus

    target_index = device_index if device_index is not None else 0
    if n_torch and 0 <= target_index < n_torch:
        device = torch.device("cuda", target_index)
        gpu = next((g for g in gpus if g.get("torch_index") == target_index), None)
    elif n_torch:
        device, gpu = None, None  # --device out of range: visibility_checks fails it
    else:
        device, gpu = torch.device("cpu"), None
    if device is not None:
        report["capabilities"] = capability_facts(device, quick=quick)
        report["measurements"] = measurement_facts(
            device, quick=quick, gpu=gpu, nvml=nvml, nvml_handle=handles.get(target_index)
        )
    report["gather_s"] = round(time.perf_counter() - t0, 2)
    return report


# =============================================================================
# Output
# =============================================================================

_STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def render(report: dict[str, Any], checks: list[Check], console: Any) -> None:
    from rich.markup import escape
    from rich.table import Table

    sections: dict[str, list[Check]] = {}
    for c in checks:
        sections.setdefault(c.section, []).append(c)
    for section, items in sections.items():
        table = Table(title=section, title_justify="left", show_header=False, expand=False, box=None, padding=(0, 1))
        table.add_column("check", style="bold", no_wrap=True)
        table.add_column("status", no_wrap=True)
        table.add_column("detail", overflow="fold")
        for c in items:
            table.add_row(escape(c.name), f"[{_STYLE[c.status]}]{c.status}[/]", escape(c.detail))
        console.print(table)
        console.print()
    fixes = [c for c in checks if c.status in (WARN, FAIL)]
    if fixes:
        table = Table(title="what to do", title_justify="left", show_header=False, box=None, padding=(0, 1))
        table.add_column("status", no_wrap=True)
        table.add_column("check", no_wrap=True, style="bold")
        table.add_column("fix", overflow="fold")
        for c in fixes:
            table.add_row(f"[{_STYLE[c.status]}]{c.status}[/]", escape(f"{c.section}: {c.name}"), escape(c.fix or ""))
        console.print(table)
        console.print()
    n = counts(checks)
    verdict = "[bold red]FAIL[/]" if exit_code(checks) else "[bold green]PASS[/]"
    console.print(
        f"{verdict}: {n[OK]} ok, {n[WARN]} warning(s), {n[FAIL]} failure(s), {n[SKIP]} skipped "
        f"({report.get('gather_s', 0):.1f} s)"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="perfrun gpu-check",
        description="Diagnose this machine (software, GPUs, host) and measure matmul and copy throughput. "
        "Exit status 1 when a check fails; warnings do not fail.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document to stdout instead of the report")
    p.add_argument("--device", type=int, default=None, metavar="N", help="check and measure only CUDA device N (torch's numbering)")
    p.add_argument("--quick", action="store_true", help="smaller measurements and no torch.compile smoke test")
    return p


@contextlib.contextmanager
def _stdout_to_stderr(enabled: bool) -> Iterator[None]:
    """With --json, stdout carries only the document: anything else printed goes to stderr."""
    if not enabled:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def main(argv: list[str] | None = None, *, nvml_module: Any = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.device is not None and args.device < 0:
        print(f"perfrun gpu-check: --device {args.device} must be >= 0", file=sys.stderr)
        return 2
    with _stdout_to_stderr(args.json):
        report = gather(args.device, quick=args.quick, nvml_module=nvml_module)
        checks = evaluate(report)
    report["checks"] = [asdict(c) for c in checks]
    report["summary"] = counts(checks)
    report["exit_code"] = exit_code(checks)
    report["verdict"] = "fail" if report["exit_code"] else "pass"
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        from rich.console import Console

        render(report, checks, Console())
    return report["exit_code"]


if __name__ == "__main__":
    raise SystemExit(main())
