"""Facts about this machine for gpu-check: software versions, compilers, the pynvml in
use, and each GPU as NVML and torch see it. Read, never judged (that is :mod:`checks`);
a fact that cannot be read is ``None`` (N/A), never an exception.

NVML facts are read before torch touches CUDA (see :mod:`gather`), so this process's own
CUDA context cannot show up as "another process holding memory".
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from perfrun.telemetry.nvml import ctypes_value, decode_reasons


def try_read(fn: Callable[[], Any], default: Any = None) -> Any:
    """``fn()``, or ``default`` when it raises: a fact we cannot read is N/A."""
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
    spec = try_read(lambda: importlib.util.find_spec("pynvml"))
    installed = {n: v for n in ("pynvml", "nvidia-ml-py") if (v := _dist_version(n))}
    if spec is None or not spec.origin:
        return {"importable": False, "provider": None, "file": None, "installed": installed}
    origin = Path(spec.origin).resolve()
    provider = None
    candidates = try_read(lambda: md.packages_distributions().get("pynvml", []), []) or list(installed)
    for dist_name in dict.fromkeys(candidates):
        dist = try_read(lambda d=dist_name: md.distribution(d))
        if dist is None:
            continue
        for f in dist.files or []:
            if try_read(lambda dist=dist, f=f: Path(dist.locate_file(f)).resolve() == origin, False):
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
    nccl = try_read(lambda: torch.cuda.nccl.version()) if torch.version.cuda else None
    driver = nvml.call("driver", "nvmlSystemGetDriverVersion", warn=False) if nvml else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": try_read(lambda: torch.backends.cudnn.version()),
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
                "name": try_read(lambda pid=pid: psutil.Process(pid).name()),
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

