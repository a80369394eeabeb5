"""What gpu-check runs on the device: capability probes (which dtypes, SDPA kernels and
torch.compile actually work) and measurements (matmul throughput per precision, copy
bandwidths). Timing and the matmul itself are :mod:`perfrun.telemetry.peaks`'s, the
same code that ``mfu.peak=measured`` uses, so the peak gpu-check caches is the peak MFU
divides by.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from perfrun.console import first_line
from perfrun.devices import synchronize
from perfrun.gpucheck.facts import try_read
from perfrun.telemetry import peaks

#: Per-lane PCIe throughput in GB/s after encoding, by generation.
PCIE_GBPS_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def sdpa_backends(device: Any) -> dict[str, dict[str, Any]]:
    """Run a tiny causal SDPA under each backend alone: available means it actually ran."""
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
                synchronize(device)
                ok = bool(torch.isfinite(y).all())
                out[name] = {"ok": ok} if ok else {"ok": False, "error": "non-finite output"}
            except Exception as exc:  # noqa: BLE001 - "No available kernel" is the answer
                why = next((str(w.message) for w in caught), None) or first_line(exc, 300)
                out[name] = {"ok": False, "error": first_line(why, 300)}
    return out


def compile_smoke(device: Any) -> dict[str, Any]:
    """Compile a tiny function with inductor, compare with eager, then reset dynamo's caches."""

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
    """Which precisions, SDPA kernels and torch.compile work here (each one run, not assumed)."""
    cap: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        cap["bf16"] = try_read(lambda: torch.cuda.is_bf16_supported(including_emulation=False))
        if cap["bf16"] is None:
            cap["bf16"] = try_read(lambda: torch.cuda.is_bf16_supported())
        cap["fp16"] = True
        cap["tf32"] = major >= 8
    else:
        def works(dt: Any) -> bool:
            a = torch.ones(8, 8, dtype=dt)
            return bool((a @ a).float().sum().item() == 512.0)

        cap["bf16"] = try_read(lambda: works(torch.bfloat16), False)
        cap["fp16"] = try_read(lambda: works(torch.float16), False)
        cap["tf32"] = False
    cap["sdpa"] = sdpa_backends(device)
    cap["compile"] = {"skipped": "--quick"} if quick else compile_smoke(device)
    return cap


def _bandwidth(fn: Callable[[], Any], device: Any, nbytes: int, factor: float, *, repeats: int, what: str) -> dict[str, Any]:
    sec, inner = peaks.time_op(fn, device, repeats=repeats, warmup_s=0.1, target_s=0.05)
    return {
        "gb_s": factor * nbytes / sec / 1e9,
        "bytes": nbytes,
        "method": f"{what}, {nbytes / 2**20:.0f} MiB, median of {repeats} repeats of {inner}, CUDA events",
    }


def _matmul_entry(r: peaks.MatmulResult) -> dict[str, Any]:
    """A matmul's figure, how it was measured, and the range of its repeats."""
    return {"tflops": r.tflops, "method": r.method(), "tflops_range": list(r.tflops_range or ())}


def matmul_facts(device: Any, *, quick: bool, gpu_name: str, cache_key: str | None,
                 runs: dict[str, bool] | None = None) -> dict[str, Any]:
    """Matmul throughput per precision, cached under ``cache_key`` as measured peaks for
    ``mfu.peak=measured``.

    A GPU: bf16, fp16, TF32 and fp32, each against the datasheet. A CPU: fp32, and bf16
    and fp16 where they run (``runs``, from the capability probe), their repeats
    interleaved so that the verdict can say which precision is fastest here.
    """
    out: dict[str, Any] = {}
    if device.type == "cuda":
        size, repeats = (4096, 3) if quick else (8192, 5)
        for dt, torch_dtype, tf in (("bf16", torch.bfloat16, None), ("fp16", torch.float16, None),
                                    ("tf32", torch.float32, True), ("fp32", torch.float32, False)):
            try:
                r = peaks.measure_matmul(device, torch_dtype, size=size, repeats=repeats, allow_tf32=tf)
                sheet, source = peaks.datasheet_peak_tflops(gpu_name, dt)
                out[dt] = {**_matmul_entry(r), "datasheet_tflops": sheet, "datasheet_source": source}
                # quick GPU runs use small matrices that under-state the peak; don't cache them
                if cache_key and not quick:
                    try_read(lambda dt=dt, r=r: peaks.store_measured(cache_key, dt, r, by="perfrun gpu-check"))
            except Exception as exc:  # noqa: BLE001
                out[dt] = {"error": first_line(exc, 300)}
        return out
    plans = [("fp32", torch.float32)] + [(dt, t) for dt, t in (("bf16", torch.bfloat16), ("fp16", torch.float16))
                                         if (runs or {}).get(dt)]
    try:
        results = peaks.measure_matmuls(device, [(t, None) for _, t in plans], repeats=5)
    except Exception as exc:  # noqa: BLE001
        return {dt: {"error": first_line(exc, 300)} for dt, _ in plans}
    for (dt, _), r in zip(plans, results, strict=True):
        out[dt] = _matmul_entry(r)
        if cache_key:
            try_read(lambda dt=dt, r=r: peaks.store_measured(cache_key, dt, r, by="perfrun gpu-check"))
    return out


def copy_facts(device: Any, *, quick: bool, gpu: dict[str, Any] | None, nvml: Any = None,
               nvml_handle: Any = None) -> dict[str, Any]:
    """Device-to-device and host-to-device (pinned, pageable) copy bandwidths on a GPU.

    The PCIe link is read again while pinned copies are in flight, since an idle GPU drops
    its link to a low generation; the link's rate (``link_gb_s``) comes with the pinned figure.
    """
    out: dict[str, Any] = {}
    nbytes = (64 if quick else 256) * 2**20
    reps = 3 if quick else 5
    try:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        out["d2d_copy"] = _bandwidth(lambda: dst.copy_(src), device, nbytes, 2.0, repeats=reps,
                                     what="device-to-device copy, read + write bytes counted")
    except Exception as exc:  # noqa: BLE001
        out["d2d_copy"] = {"error": first_line(exc, 300)}
        dst = None
    for key, pinned in (("h2d_pinned", True), ("h2d_pageable", False)):
        try:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            host.fill_(1)
            target = dst if dst is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)
            out[key] = _bandwidth(lambda host=host, target=target, pinned=pinned: target.copy_(host, non_blocking=pinned),
                                  device, nbytes, 1.0, repeats=reps,
                                  what=f"host-to-device copy from {'pinned' if pinned else 'pageable'} memory")
            if pinned and nvml is not None and nvml_handle is not None and gpu is not None:
                # read the link while copies are in flight: idle GPUs drop to a low PCIe gen
                for _ in range(8):
                    target.copy_(host, non_blocking=True)
                gpu["pcie_gen"] = nvml.call("pcie", "nvmlDeviceGetCurrPcieLinkGeneration", nvml_handle, warn=False) or gpu.get("pcie_gen")
                gpu["pcie_width"] = nvml.call("pcie", "nvmlDeviceGetCurrPcieLinkWidth", nvml_handle, warn=False) or gpu.get("pcie_width")
                gpu["pcie_under_load"] = True
                synchronize(device)
            gen, width = (gpu or {}).get("pcie_gen_max"), (gpu or {}).get("pcie_width_max")
            if pinned and gen in PCIE_GBPS_PER_LANE and width:
                out[key]["link_gb_s"] = PCIE_GBPS_PER_LANE[gen] * width
        except Exception as exc:  # noqa: BLE001
            out[key] = {"error": first_line(exc, 300)}
    return out


def measurement_facts(
    device: Any, *, quick: bool, gpu: dict[str, Any] | None, nvml: Any = None, nvml_handle: Any = None,
    runs: dict[str, bool] | None = None,
) -> dict[str, Any]:
    """Matmul peaks (and, on a GPU, copy bandwidths), as the ``measurements`` facts."""
    name = (gpu or {}).get("name") or ""
    key = try_read(lambda: peaks.device_key(device))
    meas: dict[str, Any] = {
        "device": str(device),
        "matmul": matmul_facts(device, quick=quick, gpu_name=name, cache_key=key, runs=runs),
    }
    if key:
        meas["peaks_cache"] = str(peaks.cache_path())
    if device.type == "cuda":
        meas.update(copy_facts(device, quick=quick, gpu=gpu, nvml=nvml, nvml_handle=nvml_handle))
    return meas
