"""The verdict: facts in, :class:`Check` lines out. Pure functions of the facts dict
that gathering writes (the ``--json`` document), so tests feed them hand-written facts.

Every threshold a verdict turns on is named here (per-GPU ones in :mod:`gpu_checks`).
"""

from __future__ import annotations

import platform
from typing import Any

from perfrun.console import fmt
from perfrun.gpucheck.gpu_checks import gpu_checks
from perfrun.gpucheck.load import described
from perfrun.gpucheck.verdict import FAIL, NA, OK, SKIP, WARN, Check

#: Below this much free disk where outputs go, a run may die writing a checkpoint.
DISK_FAIL_GIB = 1.0
DISK_WARN_GIB = 5.0
#: DataLoader workers pass batches through /dev/shm; Docker's default is 64 MiB.
SHM_WARN_GIB = 1.0
RAM_WARN_GIB = 2.0
#: A measured matmul below this share of the datasheet peak means something holds it back.
PEAK_WARN_SHARE = 0.40
#: Pinned host-to-device copies below this share of the PCIe link's rate.
H2D_WARN_SHARE = 0.50
#: On a CPU, a precision's matmuls are faster (or slower) than fp32's only beyond this
#: factor, and only where their interleaved repeats do not overlap: closer than that is
#: within a CPU matmul's noise, and autocast's casts cost time a matmul does not show.
CPU_PRECISION_GAIN = 1.10
#: The ``precision=`` override that trains in each matmul precision.
PRECISION_OVERRIDE = {"fp32": "precision=none", "bf16": "precision=bf16", "fp16": "precision=fp16"}


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
        f"({host.get('cpu_usable_cores')} usable), RAM {fmt(host.get('ram_total_gib'), missing=NA)} GiB",
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
        out.append(Check(S, "torch.compile", OK, f"smoke test compiled and matched eager in {fmt(comp.get('seconds'), '.1f', missing=NA)} s"))
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
    precision = cpu_precision_check(meas)
    if precision is not None:
        out.append(precision)
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


def _tflops_range(m: dict[str, Any]) -> tuple[float, float] | None:
    r = m.get("tflops_range")
    return (r[0], r[1]) if isinstance(r, list | tuple) and len(r) == 2 else None


def _against_fp32(m: dict[str, Any], fp32: dict[str, Any], ratio: float) -> str:
    """faster, slower or even: beyond :data:`CPU_PRECISION_GAIN` either way and, where
    the repeats' ranges are known, with no repeat of one inside the other's range."""
    mine, base = _tflops_range(m), _tflops_range(fp32)
    above = below = True  # without ranges, the medians decide alone
    if mine is not None and base is not None:
        above, below = mine[0] > base[1], mine[1] < base[0]
    if ratio >= CPU_PRECISION_GAIN and above:
        return "faster"
    if ratio * CPU_PRECISION_GAIN <= 1 and below:
        return "slower"
    return "even"


def cpu_precision(meas: dict[str, Any]) -> dict[str, Any] | None:
    """On a CPU, which precision to train in: each measured matmul's median speed as a
    multiple of fp32's, whether it is measurably faster, slower or even (see
    :func:`_against_fp32`), and the precision recommended: the fastest of the measurably
    faster ones, else fp32, which needs no knob. None on a GPU, or when fp32 and at least
    one other precision were not both measured."""
    if str(meas.get("device", "cpu")).startswith("cuda"):
        return None
    matmul = meas.get("matmul") or {}
    fp32 = matmul.get("fp32") or {}
    if not fp32.get("tflops"):
        return None
    measured = {dt: m for dt, m in matmul.items() if dt in PRECISION_OVERRIDE and m.get("tflops")}
    if len(measured) < 2:
        return None
    speed = {dt: m["tflops"] / fp32["tflops"] for dt, m in measured.items()}
    verdict = {dt: _against_fp32(m, fp32, speed[dt]) for dt, m in measured.items() if dt != "fp32"}
    faster = [dt for dt, v in verdict.items() if v == "faster"]
    recommended = max(faster, key=lambda dt: speed[dt]) if faster else "fp32"
    return {
        "speed_vs_fp32": speed,
        "verdict_vs_fp32": verdict,
        "fastest": max(speed, key=lambda dt: speed[dt]),
        "recommended": recommended,
        "override": PRECISION_OVERRIDE[recommended],
        "rule": (f"faster or slower than fp32 when the median differs by {CPU_PRECISION_GAIN:.2f}x or more "
                 "and the interleaved repeats' ranges do not overlap; else even"),
    }


#: A matmul's speed is not a training step's: autocast also halves the activations' memory
#: traffic and adds casts, so the precision advice points to the measurement that settles it.
LADDER_HINT = "the ladder (perfrun train -m +sweep=ablation) times whole training steps"


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.01 else f"{ratio:.1g}x"


def cpu_precision_check(meas: dict[str, Any]) -> Check | None:
    """The precision advice as a line: a warning when bf16 or fp16 is measurably slower
    than fp32 here, since a user expects them to be faster (they are on GPUs, and on CPUs
    with AVX512-BF16 or AMX)."""
    advice = cpu_precision(meas)
    if advice is None:
        return None
    S = "measurements"
    speed, verdict, rec = advice["speed_vs_fp32"], advice["verdict_vs_fp32"], advice["recommended"]
    listed = "vs fp32: " + ", ".join(f"{dt} {_times(r)}" for dt, r in speed.items() if dt != "fp32")
    if rec != "fp32":
        return Check(S, "cpu precision", OK,
                     f"{rec} matmuls run at {_times(speed[rec])} fp32 on this CPU ({listed}): "
                     f"try {advice['override']} here; {LADDER_HINT}")
    head = ("fp32 is the fastest precision on this CPU" if advice["fastest"] == "fp32"
            else "no precision is measurably faster than fp32 on this CPU")
    slower = [dt for dt, v in verdict.items() if v == "slower"]
    if not slower:
        return Check(S, "cpu precision", OK, f"{head} ({listed}, within the noise): "
                     f"fp32 (precision=none, the default) for matmuls; {LADDER_HINT}")
    said = ", ".join(f"{dt} matmuls run at {_times(speed[dt])} fp32" for dt in slower)
    return Check(
        S, "cpu precision", WARN, f"{head}: {said}",
        "for matmuls, fp32 (precision=none, the default) on this CPU; bf16 and fp16 pay off "
        f"on GPUs and on CPUs with AVX512-BF16 or AMX; {LADDER_HINT}",
    )


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
        checks += busy_measurements(measurement_checks(report["measurements"]), report.get("load") or [])
    return checks


def busy_measurements(checks: list[Check], loads: list[dict[str, Any]]) -> list[Check]:
    """A figure measured while other processes held the machine is the neighbour's as much
    as this machine's: each ok measurement becomes a ``busy`` warning that says what ran."""
    said = described(loads)
    if not said:
        return checks
    return [Check(c.section, c.name, WARN, f"busy: {c.detail}, measured while {said}; a floor, not this machine's peak",
                  "rerun perfrun gpu-check when the machine is quiet (those processes finished)")
            if c.status == OK else c for c in checks]

