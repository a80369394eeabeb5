"""NVML access for telemetry and gpu-check: one session per process, guarded reads.

Why a wrapper rather than bare ``pynvml`` calls:

* NVML is initialised once and handles are cached, so a sweep's jobs (run one after
  another in one process) reuse them; :func:`shutdown` is never called implicitly,
  because other code in the process may still hold handles.
* The torch device is matched to its NVML handle by UUID, never by index:
  ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` renumber torch's devices but
  not NVML's, so index 0 in torch may be index 3 in NVML.
* Every read is guarded: a field a GPU does not support (``NVMLError_NotSupported``),
  a MIG slice, a missing library, an old ``pynvml`` without the function -- the value
  is ``None`` ("N/A") and one warning line per field per process is logged.

The NVML module is injectable (``nvml_module=`` or the module attribute
:data:`NVML_MODULE`), so tests drive all of this with a fake.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("perfrun")

#: The NVML module to use when none is passed; ``None`` imports ``pynvml`` lazily.
NVML_MODULE: Any = None

_MIB = 1024 * 1024

# Clock-event (throttle) reason bits, as nvml.h defines them. Names come from the
# module's nvmlClocksEventReason*/nvmlClocksThrottleReason* constants where it has
# them (so a newer pynvml can name newer bits); this table fixes one canonical name
# where two constants share a bit (UserDefinedClocks == ApplicationsClocksSetting).
_CANONICAL_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}

#: Reasons that mean the clocks are held below what the workload asks for. Not in this
#: set: ``gpu_idle`` (nothing to run), ``applications_clocks_setting`` and
#: ``display_clock_setting`` (a configured clock, not a reaction to load).
SLOWDOWN_REASONS: frozenset[str] = frozenset(
    {
        "sw_power_cap",
        "hw_slowdown",
        "sync_boost",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
        "hw_power_brake_slowdown",
        "board_limit",
        "reliability",
    }
)

_REASON_PREFIXES = ("nvmlClocksEventReason", "nvmlClocksThrottleReason")

_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str) -> None:
    """Log ``message`` the first time ``key`` is seen in this process, then stay quiet."""
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(message)


def reset_warnings() -> None:
    """Forget which warnings were given (tests; a new process starts empty anyway)."""
    with _warned_lock:
        _warned.clear()


def _snake(camel: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


_reason_cache: dict[int, tuple[Any, dict[int, str]]] = {}


def reason_names(module: Any = None) -> dict[int, str]:
    """Bit -> name for every single-bit clock-event reason the module (or nvml.h) knows.

    Cached per module: the sampler decodes a mask ten times a second.
    """
    cached = _reason_cache.get(id(module))
    if cached is not None and cached[0] is module:
        return cached[1]
    names: dict[int, str] = {}
    if module is not None:
        for attr in dir(module):
            for prefix in _REASON_PREFIXES:
                if not attr.startswith(prefix):
                    continue
                value = getattr(module, attr)
                suffix = attr[len(prefix):]
                if not isinstance(value, int) or suffix in ("All", "None"):
                    continue
                if value <= 0 or value & (value - 1):  # only single bits
                    continue
                names.setdefault(value, _snake(suffix))
    names.update(_CANONICAL_REASONS)
    _reason_cache[id(module)] = (module, names)
    return names


def decode_reasons(mask: int | None, module: Any = None) -> list[str] | None:
    """The names of the bits set in a clock-event reason mask, lowest bit first.

    Unknown bits become ``unknown_0x...`` rather than disappearing.
    """
    if mask is None:
        return None
    table = reason_names(module)
    out: list[str] = []
    bit = 1
    remaining = int(mask)
    while remaining:
        if remaining & bit:
            out.append(table.get(bit, f"unknown_{bit:#x}"))
            remaining &= ~bit
        bit <<= 1
    return out


def is_slowdown(reasons: Iterable[str] | None) -> bool:
    """Whether any reason in the list holds clocks down (see :data:`SLOWDOWN_REASONS`)."""
    return any(r in SLOWDOWN_REASONS for r in reasons or ())


def normalize_uuid(value: Any) -> str:
    """A UUID as lowercase hex with dashes, without NVML's ``GPU-``/``MIG-`` prefix.

    torch prints ``58c1...-...``; NVML returns ``GPU-58c1...`` (bytes in old pynvml).
    """
    if isinstance(value, bytes | bytearray):
        if len(value) == 16:  # torch's raw uuid bytes
            h = value.hex()
            return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        value = value.decode("ascii", "replace")
    text = str(value).strip().strip("\0").lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


def torch_device_uuid(index: int) -> str | None:
    """The UUID torch reports for CUDA device ``index`` (tests replace this function)."""
    import torch

    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception as exc:  # noqa: BLE001 - an old torch, or no CUDA
        warn_once("torch-uuid", f"cannot read the UUID of cuda:{index} from torch ({exc}); GPU telemetry is N/A")
        return None


def ctypes_value(value: Any) -> Any:
    """pynvml returns ctypes scalars in a few places (nvmlDeviceIsMigDeviceHandle)."""
    return getattr(value, "value", value)


@dataclass
class NvmlDevice:
    """An NVML handle with the facts needed to say which GPU it is."""

    handle: Any
    index: int  # NVML's index (of the parent GPU for a MIG slice)
    uuid: str
    name: str | None
    is_mig: bool = False


class Nvml:
    """One NVML session: initialised once, handles cached, every read guarded."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.available = False
        self.error: str | None = None
        self._lock = threading.Lock()
        self._handles: dict[int, Any] = {}
        self._devices: list[NvmlDevice] | None = None
        self._init()

    def _init(self) -> None:
        if self.module is None:
            self.error = "pynvml is not installed (pip install nvidia-ml-py)"
            return
        try:
            self.module.nvmlInit()
            self.available = True
        except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.error = f"{type(exc).__name__}: {exc}"

    # -- guarded access -----------------------------------------------------------

    def call(self, field: str, fn_name: str | tuple[str, ...], *args: Any, warn: bool = True) -> Any:
        """``module.fn_name(*args)``, or ``None`` with one warning per ``field`` on any failure.

        ``fn_name`` may be a tuple of alternatives tried in order when the module lacks the
        first (nvmlDeviceGetCurrentClocksEventReasons replaced ...ThrottleReasons).
        """
        if not self.available:
            return None
        names = (fn_name,) if isinstance(fn_name, str) else fn_name
        fn: Callable[..., Any] | None = None
        for name in names:
            fn = getattr(self.module, name, None)
            if fn is not None:
                break
        if fn is None:
            if warn:
                warn_once(f"nvml:{field}", f"GPU telemetry: {field} is N/A (this pynvml has no {names[0]}; pip install -U nvidia-ml-py)")
            return None
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - NotSupported, NoPermission, GpuIsLost, ...
            if warn:
                warn_once(f"nvml:{field}", f"GPU telemetry: {field} is N/A ({_error_text(exc)}); reported as null")
            return None

    # -- devices --------------------------------------------------------------------

    def count(self) -> int:
        n = self.call("device_count", "nvmlDeviceGetCount")
        return int(n) if n is not None else 0

    def handle(self, index: int) -> Any:
        """NVML's handle for NVML index ``index`` (cached)."""
        with self._lock:
            if index not in self._handles:
                self._handles[index] = self.call(f"handle[{index}]", "nvmlDeviceGetHandleByIndex", index)
            return self._handles[index]

    def devices(self) -> list[NvmlDevice]:
        """Every GPU NVML sees, then every MIG slice of those with MIG enabled (cached)."""
        if self._devices is not None:
            return self._devices
        out: list[NvmlDevice] = []
        for i in range(self.count()):
            h = self.handle(i)
            if h is None:
                continue
            uuid = self.call("uuid", "nvmlDeviceGetUUID", h)
            name = self.call("name", "nvmlDeviceGetName", h)
            out.append(NvmlDevice(h, i, _text(uuid) or "", _text(name)))
        for parent in list(out):
            mig = self.call("mig_mode", "nvmlDeviceGetMigMode", parent.handle, warn=False)
            if not mig or ctypes_value(mig[0]) != 1:
                continue
            slots = self.call("mig_count", "nvmlDeviceGetMaxMigDeviceCount", parent.handle, warn=False) or 0
            for j in range(int(ctypes_value(slots))):
                h = self.call("mig_handle", "nvmlDeviceGetMigDeviceHandleByIndex", parent.handle, j, warn=False)
                if h is None:
                    continue
                uuid = self.call("mig_uuid", "nvmlDeviceGetUUID", h, warn=False)
                out.append(NvmlDevice(h, parent.index, _text(uuid) or "", parent.name, is_mig=True))
        self._devices = out
        return out

    def match_uuid(self, uuid: Any) -> NvmlDevice | None:
        """The NVML device (GPU or MIG slice) whose UUID equals ``uuid``, else ``None``."""
        want = normalize_uuid(uuid)
        for dev in self.devices():
            if dev.uuid and normalize_uuid(dev.uuid) == want:
                return dev
        return None

    def match_torch_device(self, index: int) -> NvmlDevice | None:
        """The NVML device behind torch's ``cuda:index``, matched by UUID."""
        if not self.available:
            warn_once("nvml:unavailable", f"NVML unavailable ({self.error}): GPU telemetry fields are N/A")
            return None
        uuid = torch_device_uuid(index)
        if uuid is None:
            return None
        dev = self.match_uuid(uuid)
        if dev is None:
            warn_once(
                f"nvml:nomatch:{index}",
                f"no NVML device has the UUID of cuda:{index} ({uuid}); GPU telemetry fields are N/A",
            )
        return dev

    # -- reads that need a little decoding --------------------------------------------

    def throttle_mask(self, handle: Any) -> int | None:
        value = self.call(
            "throttle_reasons",
            ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
            handle,
        )
        return None if value is None else int(ctypes_value(value))

    def throttle_reasons(self, handle: Any) -> list[str] | None:
        return decode_reasons(self.throttle_mask(handle), self.module)

    def other_processes(self, handle: Any, pids: set[int]) -> int | None:
        """Processes computing on the GPU that are not ``pids`` (this job's): contention."""
        procs = self.call("gpu_processes", "nvmlDeviceGetComputeRunningProcesses", handle)
        return None if procs is None else sum(1 for p in procs if int(p.pid) not in pids)

    def memory_mib(self, handle: Any) -> tuple[float | None, float | None]:
        """(used, total) MiB."""
        info = self.call("gpu_mem", "nvmlDeviceGetMemoryInfo", handle)
        if info is None:
            return None, None
        return info.used / _MIB, info.total / _MIB


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return value.decode("utf-8", "replace")
    return str(value)


def _error_text(exc: BaseException) -> str:
    name = type(exc).__name__
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - NVMLError.__str__ calls into the library
        text = ""
    return f"{name}: {text}" if text else name


_sessions: dict[int, Nvml] = {}
_sessions_lock = threading.Lock()


def _default_module() -> Any:
    if NVML_MODULE is not None:
        return NVML_MODULE
    try:
        import pynvml  # the nvidia-ml-py distribution; see gpucheck for the deprecated one
    except ImportError:
        return None
    return pynvml


def get_session(nvml_module: Any = None) -> Nvml:
    """The process-wide session for ``nvml_module`` (default: :data:`NVML_MODULE` or pynvml).

    Created, and NVML initialised, on first use only.
    """
    module = nvml_module if nvml_module is not None else _default_module()
    key = id(module)
    with _sessions_lock:
        session = _sessions.get(key)
        if session is None or session.module is not module:
            session = Nvml(module)
            _sessions[key] = session
        return session


def match_torch_device(index: int, *, nvml_module: Any = None) -> Any:
    """NVML handle of torch's ``cuda:index``, matched by UUID; ``None`` (with a warning) if none."""
    dev = get_session(nvml_module).match_torch_device(index)
    return None if dev is None else dev.handle


def shutdown() -> None:
    """Shut NVML down for every session this module opened. Only for a process's very end."""
    with _sessions_lock:
        for session in _sessions.values():
            if session.available:
                try:
                    session.module.nvmlShutdown()
                except Exception:  # noqa: BLE001
                    pass
        _sessions.clear()
