"""A scriptable stand-in for the ``pynvml`` module (nvidia-ml-py) for tests without a GPU.

It implements the same function names, signatures, constants and exception classes as
the real module for every call perfrun makes; ``test_telemetry.py`` checks that against
the installed ``pynvml`` so this fake cannot drift from the real API.

Values on a :class:`FakeGpu` can be a constant, a list (one element per call, the last
one repeated), a callable, or an exception class/instance to raise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

# --- constants, with nvml.h's values -------------------------------------------------

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_GRAPHICS = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_PCIE_UTIL_TX_BYTES = 0
NVML_PCIE_UTIL_RX_BYTES = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_FEATURE_DISABLED = 0
NVML_FEATURE_ENABLED = 1
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1

nvmlClocksEventReasonNone = 0x0
nvmlClocksEventReasonGpuIdle = 0x1
nvmlClocksEventReasonApplicationsClocksSetting = 0x2
nvmlClocksEventReasonUserDefinedClocks = 0x2
nvmlClocksEventReasonSwPowerCap = 0x4
nvmlClocksEventReasonHwSlowdown = 0x8
nvmlClocksEventReasonSyncBoost = 0x10
nvmlClocksEventReasonSwThermalSlowdown = 0x20
nvmlClocksEventReasonHwThermalSlowdown = 0x40
nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
nvmlClocksEventReasonDisplayClockSetting = 0x100
nvmlClocksEventReasonAll = 0x1FF
nvmlClocksThrottleReasonGpuIdle = 0x1
nvmlClocksThrottleReasonSwPowerCap = 0x4
nvmlClocksThrottleReasonHwSlowdown = 0x8


# --- exceptions, shaped like pynvml's --------------------------------------------------


class NVMLError(Exception):
    """Like pynvml: ``NVMLError(code)`` becomes the subclass for that code."""

    _valClassMapping: dict[int, type] = {}

    def __new__(cls, value: int = NVML_ERROR_UNKNOWN) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int = NVML_ERROR_UNKNOWN) -> None:
        super().__init__(value)

    def __str__(self) -> str:
        return {
            NVML_ERROR_NOT_SUPPORTED: "Not Supported",
            NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
            NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
            NVML_ERROR_GPU_IS_LOST: "GPU is lost",
            NVML_ERROR_UNINITIALIZED: "Uninitialized",
        }.get(self.value, f"NVML Error with code {self.value}")


def _sub(name: str, code: int) -> type:
    cls = type(name, (NVMLError,), {"__new__": lambda typ, value=code: NVMLError.__new__(typ, value)})
    NVMLError._valClassMapping[code] = cls
    return cls


NVMLError_Uninitialized = _sub("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_NotSupported = _sub("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _sub("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_NotFound = _sub("NVMLError_NotFound", NVML_ERROR_NOT_FOUND)
NVMLError_LibraryNotFound = _sub("NVMLError_LibraryNotFound", NVML_ERROR_LIBRARY_NOT_FOUND)
NVMLError_GpuIsLost = _sub("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)


# --- the scripted devices ----------------------------------------------------------------


@dataclass
class FakeGpu:
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    name: str = "NVIDIA H100 80GB HBM3"
    util: Any = 50
    mem_util: Any = 20
    mem_used_mib: Any = 1024
    mem_total_mib: float = 81559
    power_mw: Any = 300_000
    power_limit_mw: Any = 700_000
    power_default_limit_mw: Any = 700_000
    temp_c: Any = 40
    sm_clock: Any = 1980
    mem_clock: Any = 2619
    sm_clock_max: Any = 1980
    mem_clock_max: Any = 2619
    reasons: Any = 0  # clock-event reason bitmask
    energy_mj: Any = 0
    cc: Any = (9, 0)
    persistence: Any = 1
    ecc_mode: Any = (1, 1)
    ecc: dict[tuple[int, int], Any] = field(default_factory=dict)  # (error type, counter) -> count
    pcie_gen: Any = 5
    pcie_gen_max: Any = 5
    pcie_width: Any = 16
    pcie_width_max: Any = 16
    pcie_tx_kbs: Any = 1000
    pcie_rx_kbs: Any = 2000
    mig: Any = (0, 0)
    processes: Any = field(default_factory=list)  # list of (pid, used bytes), not a per-call sequence
    mig_slices: list[FakeGpu] = field(default_factory=list)  # shown when mig == (1, ...)
    calls: dict[str, int] = field(default_factory=dict)

    def value(self, attr: str, *, sequence: bool = True) -> Any:
        """The scripted value; ``sequence=False`` for fields whose value is itself a list."""
        self.calls[attr] = self.calls.get(attr, 0) + 1
        v = getattr(self, attr)
        if isinstance(v, type) and issubclass(v, BaseException):
            raise v()
        if isinstance(v, BaseException):
            raise v
        if callable(v):
            return v()
        if sequence and isinstance(v, list):
            i = self.calls[attr] - 1
            return v[min(i, len(v) - 1)]
        return v


class FakeNvml:
    """An object that quacks like the ``pynvml`` module; pass it as ``nvml_module=``."""

    # constants and exception classes, visible as module attributes
    _names = {k: v for k, v in globals().items() if k.startswith(("NVML", "nvmlClocks"))}

    def __init__(self, gpus: list[FakeGpu] | None = None, *, init_error: Any = None) -> None:
        for k, v in self._names.items():
            setattr(self, k, v)
        self.gpus = list(gpus or [])
        self.init_error = init_error
        self.init_calls = 0
        self.shutdown_calls = 0
        self.initialised = False

    def _gpu(self, handle: Any) -> FakeGpu:
        if not self.initialised:
            raise NVMLError_Uninitialized()
        if not isinstance(handle, FakeGpu):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle

    # -- library --------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error() if isinstance(self.init_error, type) else self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.00.00"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12080

    # -- devices ----------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialised:
            raise NVMLError_Uninitialized()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if not self.initialised:
            raise NVMLError_Uninitialized()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._gpu(handle).uuid

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._gpu(handle).name

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        g = self._gpu(handle)
        return SimpleNamespace(gpu=g.value("util"), memory=g.value("mem_util"))

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        g = self._gpu(handle)
        used = g.value("mem_used_mib") * 2**20
        total = g.mem_total_mib * 2**20
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._gpu(handle).value("power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._gpu(handle).value("power_limit_mw")

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: Any) -> int:
        return self._gpu(handle).value("power_default_limit_mw")

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        return self._gpu(handle).value("temp_c")

    def nvmlDeviceGetClockInfo(self, handle: Any, type: int) -> int:  # noqa: A002 - pynvml's name
        return self._gpu(handle).value("sm_clock" if type == NVML_CLOCK_SM else "mem_clock")

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, type: int) -> int:  # noqa: A002
        return self._gpu(handle).value("sm_clock_max" if type == NVML_CLOCK_SM else "mem_clock_max")

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        return self._gpu(handle).value("reasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any) -> int:
        return self._gpu(handle).value("reasons")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return self._gpu(handle).value("energy_mj")

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        return self._gpu(handle).value("cc")

    def nvmlDeviceGetPersistenceMode(self, handle: Any) -> int:
        return self._gpu(handle).value("persistence")

    def nvmlDeviceGetEccMode(self, handle: Any) -> list[int]:
        return list(self._gpu(handle).value("ecc_mode"))

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, errorType: int, counterType: int) -> int:  # noqa: N803
        g = self._gpu(handle)
        return g.ecc.get((errorType, counterType), 0)

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._gpu(handle).value("pcie_gen")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self._gpu(handle).value("pcie_gen_max")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._gpu(handle).value("pcie_width")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self._gpu(handle).value("pcie_width_max")

    def nvmlDeviceGetPcieThroughput(self, device: Any, counter: int) -> int:
        g = self._gpu(device)
        return g.value("pcie_tx_kbs" if counter == NVML_PCIE_UTIL_TX_BYTES else "pcie_rx_kbs")

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        return list(self._gpu(device).value("mig"))

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        return len(self._gpu(device).mig_slices)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> FakeGpu:
        slices = self._gpu(device).mig_slices
        if not 0 <= index < len(slices):
            raise NVMLError_NotFound()
        return slices[index]

    def nvmlDeviceIsMigDeviceHandle(self, device: Any) -> int:
        g = self._gpu(device)
        return int(any(g is s for parent in self.gpus for s in parent.mig_slices))

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        g = self._gpu(handle)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in g.value("processes", sequence=False)]


#: Public names the fake shares with pynvml (the drift test compares these).
def api_names() -> list[str]:
    return sorted(n for n in dir(FakeNvml([])) if n.startswith(("nvml", "NVML")))
