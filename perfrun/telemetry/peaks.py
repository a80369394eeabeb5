"""Peak matmul throughput: one datasheet table, and measured peaks with a small cache.

MFU needs a denominator. The datasheet figure is what the vendor promises (dense, i.e.
without 2:4 sparsity, the number every MFU in the literature divides by); the measured
figure is what a large matmul actually reaches on this machine, today, at its power
limit and clocks. perfrun shows both and labels each. ``perfrun gpu-check`` measures and
caches; ``train mfu.peak=measured`` reads the cache, measuring once if it is empty.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from perfrun.checkpoint.atomic import atomic_write
from perfrun.devices import synchronize

# --- the datasheet table ----------------------------------------------------------------


@dataclass(frozen=True)
class PeakEntry:
    """Dense peak TFLOPS per dtype for one GPU model; ``None`` where the GPU has no such path."""

    key: str
    pattern: str  # regex searched (case-insensitive) in the device name torch/NVML report
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float | None
    source: str
    note: str = ""


# Order matters: the first pattern that matches wins, so variants come before the family.
# fp16/bf16 are tensor-core figures with FP32 accumulate (what PyTorch uses); fp32 is
# the non-tensor CUDA-core figure.
PEAKS: tuple[PeakEntry, ...] = (
    PeakEntry("H200 NVL", r"\bH200\s+NVL\b", 835.5, 835.5, 417.5, 60.0, "NVIDIA H200 NVL datasheet (dense = sparse / 2)"),
    PeakEntry("H200 SXM", r"\bH200\b", 989.5, 989.5, 494.5, 67.0, "NVIDIA H200 SXM datasheet (dense = sparse / 2)"),
    PeakEntry("H100 NVL", r"\bH100\s+NVL\b", 835.5, 835.5, 417.5, 60.0, "NVIDIA H100 NVL datasheet, per GPU (dense = sparse / 2)"),
    PeakEntry("H100 PCIe", r"\bH100\b.*\bPCIe\b", 756.5, 756.5, 378.0, 51.0, "NVIDIA H100 PCIe datasheet (dense = sparse / 2)"),
    PeakEntry("H100 SXM", r"\bH100\b", 989.5, 989.5, 494.5, 67.0, "NVIDIA H100 SXM5 datasheet (dense = sparse / 2)"),
    PeakEntry("A100 PCIe", r"\bA100\b.*\bPCIe\b", 312.0, 312.0, 156.0, 19.5, "NVIDIA A100 PCIe datasheet (dense)"),
    PeakEntry("A100 SXM", r"\bA100\b", 312.0, 312.0, 156.0, 19.5, "NVIDIA A100 SXM4 datasheet (dense)"),
    PeakEntry(
        "A10G", r"\bA10G\b", None, None, None, None, "none",
        "NVIDIA publishes no datasheet for the A10G (an AWS-only part); use mfu.peak=measured",
    ),
    PeakEntry("A10", r"\bA10\b", 125.0, 125.0, 62.5, 31.2, "NVIDIA A10 datasheet (dense)"),
    PeakEntry("L40S", r"\bL40S\b", 362.05, 362.05, 183.0, 91.6, "NVIDIA L40S datasheet (dense)"),
    PeakEntry("L4", r"\bL4\b", 121.0, 121.0, 60.0, 30.3, "NVIDIA L4 datasheet (dense = sparse / 2)"),
    PeakEntry(
        "RTX 4090", r"\bRTX\s+4090\b(?!\s*D)", 165.2, 165.2, 82.6, 82.6,
        "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090 (dense, FP32 accumulate)",
    ),
    PeakEntry(
        "RTX 3090", r"\bRTX\s+3090\b(?!\s*Ti)", 71.0, 71.0, 35.6, 35.6,
        "NVIDIA Ampere GA102 whitepaper, RTX 3090 (dense, FP32 accumulate)",
    ),
    PeakEntry(
        "V100 PCIe", r"\bV100\b.*\bPCIE\b", None, 112.0, None, 14.0, "NVIDIA V100 datasheet (PCIe)",
        "Volta has no bf16 or TF32 tensor cores",
    ),
    PeakEntry(
        "V100 SXM2", r"\bV100\b", None, 125.0, None, 15.7, "NVIDIA V100 datasheet (SXM2)",
        "Volta has no bf16 or TF32 tensor cores",
    ),
    PeakEntry(
        "T4", r"\bT4\b", None, 65.0, None, 8.1, "NVIDIA T4 datasheet",
        "Turing has no bf16 or TF32 tensor cores",
    ),
)

_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "tf32": "tf32",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}


def dtype_key(dtype: torch.dtype | str) -> str:
    """``bf16``/``fp16``/``tf32``/``fp32`` from a torch dtype or any common spelling."""
    key = _DTYPE_ALIASES.get(str(dtype).lower())
    if key is None:
        raise ValueError(f"no peak figures for dtype {dtype!r}; use one of bf16, fp16, tf32, fp32")
    return key


def find_entry(device_name: str) -> PeakEntry | None:
    for entry in PEAKS:
        if re.search(entry.pattern, device_name, flags=re.IGNORECASE):
            return entry
    return None


#: Where a device has no datasheet figure, how to get an MFU all the same.
MEASURE_HINT = "for an MFU figure, run `perfrun gpu-check` to measure this machine's peak, then train with mfu.peak=measured"


def datasheet_peak_tflops(device_name: str, dtype_name: str) -> tuple[float | None, str]:
    """(dense datasheet TFLOPS, source) or (None, why there is none and how to get an MFU
    figure anyway: the note is what a run prints where its MFU would be)."""
    key = dtype_key(dtype_name)
    entry = find_entry(device_name)
    if entry is None:
        return None, f"no datasheet entry for {device_name!r}; {MEASURE_HINT}"
    value = getattr(entry, key)
    if value is None:
        why = entry.note or f"the datasheet lists no {key} figure"
        hint = "" if "mfu.peak=measured" in why else f"; {MEASURE_HINT}"
        return None, f"no {key} datasheet figure for {entry.key}: {why}{hint}"
    return value, f"datasheet: {entry.source}"


# --- measurement -----------------------------------------------------------------------


def _tf32_state() -> tuple[str, Any]:
    """Read the CUDA matmul TF32 setting through whichever API the process already uses.

    torch >= 2.9 raises if the legacy (allow_tf32) and new (fp32_precision) APIs are mixed.
    """
    m = torch.backends.cuda.matmul
    try:
        return "legacy", bool(m.allow_tf32)
    except RuntimeError:
        return "new", m.fp32_precision


def tf32_enabled() -> bool:
    api, value = _tf32_state()
    return bool(value) if api == "legacy" else value == "tf32"


@contextlib.contextmanager
def tf32(enabled: bool | None) -> Iterator[None]:
    """Force CUDA matmul TF32 on/off inside the block and restore it after (None: leave it)."""
    if enabled is None:
        yield
        return
    m = torch.backends.cuda.matmul
    api, before = _tf32_state()
    try:
        if api == "legacy":
            m.allow_tf32 = enabled
        else:
            m.fp32_precision = "tf32" if enabled else "ieee"
        yield
    finally:
        if api == "legacy":
            m.allow_tf32 = before
        else:
            m.fp32_precision = before


@dataclass
class MatmulResult:
    """How a matmul peak was measured, so the figure can be printed with its method."""

    tflops: float
    size: int
    repeats: int
    inner: int
    dtype: str
    device: str
    tflops_range: tuple[float, float] | None = None  # the slowest and the fastest repeat
    interleaved_with: tuple[str, ...] = ()  # the dtypes whose repeats alternated with these

    def method(self) -> str:
        timer = "CUDA events" if self.device.startswith("cuda") else "perf_counter"
        together = f", interleaved with {', '.join(self.interleaved_with)}" if self.interleaved_with else ""
        return (
            f"{self.size}x{self.size} {self.dtype} matmul, median of {self.repeats} repeats of "
            f"{self.inner}{together}, {timer}, after warm-up"
        )


def _time_once(fn: Any, device: torch.device, inner: int) -> float:
    """Seconds for ``inner`` calls: CUDA events on a GPU (no host overhead), perf_counter on CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return time.perf_counter() - t0


def calibrate(fn: Any, device: torch.device, *, warmup_s: float, target_s: float) -> int:
    """Warm ``fn`` up for at least ``warmup_s`` (clocks ramp, caches fill, cuBLAS picks its
    kernel), then return how many calls make one timed repeat last ``target_s``, so that
    the timer's resolution and launch gaps are negligible."""
    fn()
    synchronize(device)
    t_end = time.perf_counter() + warmup_s
    one = _time_once(fn, device, 1)
    while time.perf_counter() < t_end:
        one = _time_once(fn, device, 1)
    return max(1, min(1000, round(target_s / max(one, 1e-7))))


def time_op(fn: Any, device: torch.device, *, repeats: int, warmup_s: float, target_s: float) -> tuple[float, int]:
    """(median seconds per call, calls per repeat) for ``fn`` on ``device``, after
    :func:`calibrate`."""
    inner = calibrate(fn, device, warmup_s=warmup_s, target_s=target_s)
    times = [_time_once(fn, device, inner) / inner for _ in range(max(1, repeats))]
    return statistics.median(times), inner


def _default_size(device: torch.device, dtype: torch.dtype) -> int:
    """GPU: big enough to saturate the tensor cores. CPU: grow until one matmul takes ~5 ms.

    CPU speeds differ by 100x between dtypes (bf16 without AVX512-BF16/AMX is emulated),
    so a fixed size would either take minutes or measure only overhead.
    """
    if device.type == "cuda":
        return 8192
    n = 256
    while n < 2048:
        a = torch.randn(n, n, dtype=dtype)
        a @ a  # the first call pays for thread-pool start and packing-buffer allocation
        t0 = time.perf_counter()
        a @ a
        if time.perf_counter() - t0 > 0.005:
            break
        n *= 2
    return n


@dataclass
class _Matmul:
    """One square matmul ready to time: its operands live in the closure."""

    fn: Callable[[], Any]
    dtype: str
    size: int
    tf32: bool | None  # a CUDA fp32 matmul's forced TF32 setting (None: as it is)

    def context(self) -> contextlib.AbstractContextManager[None]:
        return tf32(self.tf32)


def _matmul(device: torch.device, dtype: torch.dtype, size: int | None, allow_tf32: bool | None) -> _Matmul:
    size = _default_size(device, dtype) if size is None else size
    # generated on the device: an 8192² randn on the host takes seconds; the values don't matter
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    cuda_fp32 = dtype == torch.float32 and device.type == "cuda"
    op = _Matmul(lambda: torch.mm(a, b, out=out), dtype_key(dtype), size, allow_tf32 if cuda_fp32 else None)
    if cuda_fp32:
        with op.context():
            op.dtype = "tf32" if tf32_enabled() else "fp32"
    return op


def measure_matmuls(
    device: torch.device,
    plans: list[tuple[torch.dtype, bool | None]],
    *,
    size: int | None = None,
    repeats: int = 5,
    warmup_s: float | None = None,
    target_s: float | None = None,
) -> list[MatmulResult]:
    """Several square matmuls (dtype, forced TF32 or None), measured together: after each
    one's warm-up, their timed repeats alternate, one of each in turn, so that a change in
    the machine's load hits every dtype alike and the ratios between them hold. Each result
    has its median and the range of its repeats."""
    device = torch.device(device)
    warmup_s = (0.3 if device.type == "cuda" else 0.1) if warmup_s is None else warmup_s
    target_s = 0.05 if target_s is None else target_s
    ops = [_matmul(device, dtype, size, tf) for dtype, tf in plans]
    inners = []
    for op in ops:
        with op.context():
            inners.append(calibrate(op.fn, device, warmup_s=warmup_s, target_s=target_s))
    times: list[list[float]] = [[] for _ in ops]
    for _ in range(max(1, repeats)):
        for op, inner, per_call in zip(ops, inners, times, strict=True):
            with op.context():
                per_call.append(_time_once(op.fn, device, inner) / inner)
    results = []
    for op, inner, per_call in zip(ops, inners, times, strict=True):
        tera = 2.0 * op.size**3 / 1e12
        results.append(MatmulResult(
            tera / statistics.median(per_call), op.size, repeats, inner, op.dtype, str(device),
            (tera / max(per_call), tera / min(per_call)), tuple(o.dtype for o in ops if o is not op),
        ))
    return results


def measure_matmul(
    device: torch.device,
    dtype: torch.dtype,
    *,
    size: int | None = None,
    repeats: int = 5,
    allow_tf32: bool | None = None,
    warmup_s: float | None = None,
    target_s: float | None = None,
) -> MatmulResult:
    """Measure a square matmul's throughput; see :func:`measure_matmul_tflops`."""
    (result,) = measure_matmuls(device, [(dtype, allow_tf32)], size=size, repeats=repeats,
                                warmup_s=warmup_s, target_s=target_s)
    return result


def measure_matmul_tflops(
    device: torch.device, dtype: torch.dtype, *, size: int | None = None, repeats: int = 5, allow_tf32: bool | None = None
) -> float:
    """Dense matmul TFLOPS of ``size``x``size`` @ ``size``x``size`` (2·n³ FLOPs per call).

    Warm-up first; CUDA events on a GPU, perf_counter on the CPU; the median of
    ``repeats``. For float32 on CUDA, TF32 follows the current setting unless
    ``allow_tf32`` forces it (restored afterwards).
    """
    return measure_matmul(device, dtype, size=size, repeats=repeats, allow_tf32=allow_tf32).tflops


# --- the cache of measured peaks -----------------------------------------------------------


def cache_path() -> Path:
    """``$PERFRUN_CACHE/peaks.json``, else ``~/.cache/perfrun/peaks.json``."""
    root = os.environ.get("PERFRUN_CACHE")
    base = Path(root) if root else Path.home() / ".cache" / "perfrun"
    return base / "peaks.json"


def device_key(device: torch.device) -> str:
    """Name + UUID for a GPU (two cards of one model differ), CPU model for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        return f"{props.name} [{uuid}]" if uuid is not None else props.name
    from perfrun.telemetry.host import cpu_model

    return f"cpu: {cpu_model()}"


def load_cache(path: Path | None = None) -> dict[str, Any]:
    path = path or cache_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"version": 1, "devices": {}}
    if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
        return {"version": 1, "devices": {}}
    return data


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An advisory lock so two processes' read-modify-write don't lose an entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: no lock, the rename is still atomic
        yield
        return
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def store_measured(key: str, dtype_name: str, result: MatmulResult, *, path: Path | None = None, by: str = "perfrun") -> None:
    """Record a measured peak under (device key, dtype)."""
    path = path or cache_path()
    with _locked(path):
        data = load_cache(path)
        data.setdefault("devices", {}).setdefault(key, {})[dtype_key(dtype_name)] = {
            "tflops": result.tflops,
            "method": result.method(),
            "measured_by": by,
            "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
        }
        data["version"] = 1
        atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def lookup_measured(key: str, dtype_name: str, *, path: Path | None = None) -> dict[str, Any] | None:
    return load_cache(path).get("devices", {}).get(key, {}).get(dtype_key(dtype_name))


class PeakUnavailable(LookupError):
    """No measured peak is cached and measuring was not allowed."""


def _resolve_dtype_name(device: torch.device, dtype: torch.dtype | str) -> str:
    """float32 on CUDA means TF32 when TF32 is on right now (the knob was applied)."""
    name = dtype_key(dtype)
    if name == "fp32" and torch.device(device).type == "cuda" and tf32_enabled():
        return "tf32"
    return name


def measured_peak_tflops(
    device: torch.device, dtype: torch.dtype | str, *, measure_if_missing: bool = True
) -> tuple[float, str]:
    """(TFLOPS, how it was obtained) for ``mfu.peak=measured``.

    Reads the cache that ``perfrun gpu-check`` fills; on a miss, measures now (and
    caches) unless ``measure_if_missing`` is False, then raises :class:`PeakUnavailable`.
    ``dtype`` may be ``"tf32"``; ``torch.float32`` on CUDA follows the current TF32 setting.
    """
    device = torch.device(device)
    name = _resolve_dtype_name(device, dtype)
    key = device_key(device)
    path = cache_path()
    hit = lookup_measured(key, name, path=path)
    if hit is not None and isinstance(hit.get("tflops"), int | float) and hit["tflops"] > 0:
        return float(hit["tflops"]), f"{hit.get('method', 'matmul')}, {hit.get('measured_by', '?')} {hit.get('measured_at', '')}, cached in {path}"
    if not measure_if_missing:
        raise PeakUnavailable(f"no measured {name} peak for {key} in {path}; run `perfrun gpu-check` first")
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name, torch.float32)
    tf = {"tf32": True, "fp32": False}.get(name) if device.type == "cuda" else None
    result = measure_matmul(device, torch_dtype, allow_tf32=tf)
    store_measured(key, name, result, path=path, by="perfrun train")
    return result.tflops, f"{result.method()}, measured now, cached in {path}"
