"""Every fact and measurement gpu-check reports, in one plain dict (the ``--json``
document), gathered in the order that keeps NVML's view clean: NVML is read before
torch first touches CUDA, so this process's own CUDA context cannot show up as
"another process holding memory" on the GPU it checks.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import perfrun
from perfrun.console import first_line
from perfrun.gpucheck import load
from perfrun.gpucheck.facts import nvml_gpu_facts, software_facts, torch_gpu_facts
from perfrun.gpucheck.measure import capability_facts, measurement_facts
from perfrun.telemetry import nvml as nvml_mod
from perfrun.telemetry.host import host_facts


def _torch_gpus(session: Any, nvml_facts: dict[str, dict[str, Any]], indices: list[int],
                handles: dict[int, Any]) -> list[dict[str, Any]]:
    """torch's view of each GPU asked for, merged with NVML's for the device of the same
    UUID (a MIG slice borrows its parent's link, ECC and clocks); ``handles`` gets each
    matched device's NVML handle."""
    parents = [d for d in session.devices() if not d.is_mig] if session.available else []
    gpus = []
    for i in indices:
        facts = torch_gpu_facts(i)
        dev = session.match_uuid(facts["uuid"]) if session.available and facts.get("uuid") else None
        if dev is None:
            gpus.append({**facts, "nvml": False, "nvml_error": session.error or "no NVML device with this UUID"})
            continue
        handles[i] = dev.handle
        base = nvml_facts[dev.uuid]
        if dev.is_mig:  # a slice answers little; the parent GPU has the link, ECC, clocks
            parent = next((d for d in parents if d.index == dev.index), None)
            if parent is not None:
                base = {**nvml_facts[parent.uuid], **{k: v for k, v in base.items() if v is not None}}
        merged = {**base, **{k: v for k, v in facts.items() if v is not None}}
        merged["name"] = facts["name"]
        merged["uuid"] = base.get("uuid") or facts["uuid"]  # NVML's GPU-... form, as nvidia-smi prints it
        gpus.append(merged)
    return gpus


def gather(device_index: int | None, *, quick: bool, nvml_module: Any = None) -> dict[str, Any]:
    """Every fact and measurement, in the order that keeps NVML's view clean."""
    t0 = time.perf_counter()
    session = nvml_mod.get_session(nvml_module)
    nvml = session if session.available else None
    nvml_devices = [d for d in session.devices() if not d.is_mig] if nvml else []
    nvml_mig = [d for d in session.devices() if d.is_mig] if nvml else []
    nvml_facts = {d.uuid: nvml_gpu_facts(session, d) for d in nvml_devices + nvml_mig}

    report: dict[str, Any] = {
        "perfrun_version": perfrun.__version__,
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
    handles: dict[int, Any] = {}
    if n_torch:
        indices = [device_index] if device_index is not None else list(range(n_torch))
        gpus = _torch_gpus(session, nvml_facts, [i for i in indices if 0 <= i < n_torch], handles)
    else:  # torch can't see them; report what NVML can
        gpus = [nvml_facts[d.uuid] for d in nvml_devices]
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
        first = load.before(nvml, handles.get(target_index))  # the machine's load before and during
        with load.LoadWatch("during", nvml, handles.get(target_index)) as during:
            report["measurements"] = measurement_facts(
                device, quick=quick, gpu=gpu, nvml=nvml, nvml_handle=handles.get(target_index),
                runs={dt: bool(report["capabilities"].get(dt)) for dt in ("bf16", "fp16")},
            )
        report["load"] = [first, during.result]
    report["gather_s"] = round(time.perf_counter() - t0, 2)
    return report
