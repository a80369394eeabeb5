"""Where a step's memory goes, by category and by module: the one place perfrun touches
torch's private memory tracker (``torch.distributed._tools.mem_tracker.MemTracker``, and
its FSDP2 flavour), so that a torch that moves it breaks here, loudly, and nowhere else.

The tracker is a ``TorchDispatchMode``: every storage an operator creates is counted
under one category (Parameter, Buffer, Gradient, Optstate, Activation, Temp) and the
module running at the time; the peak is the largest total seen and what made it up.
It counts the same bytes on fake tensors (:mod:`perfrun.memory.estimate`) as on real
ones. Known limits, said where they apply: under activation checkpointing the
recomputed activations are counted as Temp (the peak stays right); on CUDA the
allocator's rounding is counted (512 B blocks) but its reserve and cuBLAS/cuDNN
workspaces are not. Where the tracker is missing, :func:`tracker_missing` says why and
the caller falls back to the measured peak alone, marked so.
"""

from __future__ import annotations

import importlib
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

# the fixed order of the categories: tables, the log line and the plot's colours follow it
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp")
SHORT = {"Parameter": "par", "Buffer": "buf", "Gradient": "grad", "Optstate": "opt", "Activation": "act",
         "Temp": "tmp"}
TRACKER_MODULE = "torch.distributed._tools.mem_tracker"
FREED_GRADIENT = "Expected a tensor or a traceable wrapper-subclass of tensor, but got <class 'NoneType'>"
# the start of the warning torch gives when a compiled module runs under global module hooks
COMPILED_WITH_GLOBAL_HOOKS = r"Using `torch\.compile\(module\)` when there are global hooks"
FSDP_TRACKER_MODULE = "torch.distributed._tools.fsdp2_mem_tracker"
# FSDP2's categories, folded into the six above (sharded and gathered copies alike)
_FSDP_FOLD = {"Sharded Param": "Parameter", "Unsharded Param": "Parameter", "Sharded Grad": "Gradient",
              "Unsharded Grad": "Gradient", "All Gather": "Temp", "Reduce Scatter": "Temp", "OptState": "Optstate",
              "Inputs": "Activation",
              "Activation": "Activation", "Temp": "Temp", "Optstate": "Optstate", "Buffer": "Buffer",
              "Parameter": "Parameter", "Gradient": "Gradient", "Other": "Temp"}


def tracker_missing() -> str | None:
    """None when torch's tracker is importable and has the parts used here, else why not."""
    try:
        module = importlib.import_module(TRACKER_MODULE)
    except ImportError as e:
        return f"{TRACKER_MODULE} is missing from torch {torch.__version__} ({e})"
    for name in ("MemTracker",):
        if not hasattr(module, name):
            return f"{TRACKER_MODULE}.{name} is missing from torch {torch.__version__}"
    for method in ("track_external", "get_tracker_snapshot", "reset_mod_stats"):
        if not hasattr(module.MemTracker, method):
            return f"{TRACKER_MODULE}.MemTracker.{method} is missing from torch {torch.__version__}"
    return None


@dataclass
class ModuleMemory:
    """One module's share: its parameters and the activations its forward left for the backward."""

    name: str
    parameter_bytes: int
    activation_bytes: int

    @property
    def held(self) -> int:
        return self.parameter_bytes + self.activation_bytes


@dataclass
class Breakdown:
    """The bytes of each category at the peak, the modules holding most, and how they were
    counted. ``method`` says tracker or fallback; ``notes`` what the figures leave out."""

    categories: dict[str, int]  # CATEGORIES -> bytes at the peak; empty in the fallback
    peak_bytes: int  # the tracker's total at the peak (the fallback: the measured peak)
    modules: list[ModuleMemory] = field(default_factory=list)
    method: str = "torch MemTracker"
    device: str = "cpu"
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["categories_bytes"] = out.pop("categories")
        out["modules"] = [{**asdict(m), "held_bytes": m.held} for m in self.modules]
        return out


class ModuleStack:
    """``with ModuleStack(model) as stack:`` keeps the names of the modules whose forward is
    running, by global forward hooks: after an operator failed, :meth:`active_modules` says
    where. Cheap enough for a step that is not tracked."""

    def __init__(self, model: nn.Module) -> None:
        self._names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        self._running: list[str] = []  # kept on an error

    def __enter__(self) -> ModuleStack:
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )

        def began(m: nn.Module, _args: Any) -> None:
            self._running.append(self._names.get(id(m), type(m).__name__))

        def ended(_m: nn.Module, _args: Any, _out: Any) -> None:  # returns None: the output stays
            if self._running:
                self._running.pop()

        self._hooks = [register_module_forward_pre_hook(began), register_module_forward_hook(ended)]
        # A compiled model warns that these global hooks fire once more for its wrapper: they
        # only keep a stack of names, so the extra push and pop are harmless, and the warning
        # (once per tracked step) would only alarm the reader of the console.
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message=COMPILED_WITH_GLOBAL_HOOKS, category=UserWarning)
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._hooks:
            h.remove()
        self._quiet.__exit__(*exc)

    def active_modules(self) -> list[str]:
        """The modules whose forward was running, innermost last."""
        return list(self._running)


class CategoryTracker:
    """``with CategoryTracker(model, optimizer): ...steps...`` then :meth:`breakdown`: the
    steps' peak by category and module (the step metrics' single peak figure is
    :class:`perfrun.telemetry.step_metrics.PeakMemory`).

    ``fsdp``: the model is sharded by FSDP2 (the tracker's FSDP flavour counts the
    gathered and the sharded copies). Entering fails with RuntimeError naming the missing
    piece when torch lacks the tracker; callers check :func:`tracker_missing` first.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, fsdp: bool = False) -> None:
        missing = tracker_missing()
        if missing is not None:
            raise RuntimeError(missing)
        self.model, self.fsdp = model, fsdp
        if fsdp:
            self._mt: Any = importlib.import_module(FSDP_TRACKER_MODULE).FSDPMemTracker(model, optimizer)
        else:
            self._mt = importlib.import_module(TRACKER_MODULE).MemTracker()
        self.quick_stats = _read_quickly(self._mt)  # before the tracker records anything
        if not fsdp:
            self._mt.track_external(model, *([optimizer] if optimizer is not None else []))

    def __enter__(self) -> CategoryTracker:
        self._stack = ModuleStack(self.model).__enter__()
        # optim.in_backward frees each gradient in its hook, before the tracker's own hook looks
        # for it: nothing to count, which the tracker warns about once per parameter
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message=FREED_GRADIENT, category=UserWarning)
        try:
            self._mt.__enter__()
        except BaseException:
            self._quiet.__exit__(None, None, None)
            self._stack.__exit__(None, None, None)  # no global hook outlives a tracker that did not start
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._mt.__exit__(*exc)
        self._quiet.__exit__(*exc)
        self._stack.__exit__(*exc)

    def new_step(self) -> None:
        """Forget the modules' figures of the steps so far (the peak stays the run's)."""
        self._mt.reset_mod_stats()

    def active_modules(self) -> list[str]:
        """The modules whose forward was running, innermost last: after an operator failed,
        where it failed."""
        stack = getattr(self, "_stack", None)
        return stack.active_modules() if stack is not None else []

    def breakdown(self, top: int = 10) -> Breakdown:
        """The peak by category and the ``top`` modules holding most, as counted so far."""
        snap = self._mt.get_tracker_snapshot("peak")
        if not snap:
            return Breakdown({c: 0 for c in CATEGORIES}, 0, method="torch MemTracker (saw no tensor)")
        device, counts = max(snap.items(), key=lambda kv: kv[1].get("Total", 0))
        categories = dict.fromkeys(CATEGORIES, 0)
        for key, value in counts.items():
            name = str(getattr(key, "value", key))
            if name != "Total":
                folded = _FSDP_FOLD.get(name, "Temp")
                categories[folded] += int(value)
        method = "torch FSDPMemTracker" if self.fsdp else "torch MemTracker"
        return Breakdown(categories, int(counts.get("Total", sum(categories.values()))),
                         self._modules(device, top), method, str(device))

    def _modules(self, device: torch.device, top: int) -> list[ModuleMemory]:
        """The units of :func:`module_units` ranked by parameters + activations left by
        their forward (Activation after its forward less before it, on its first call)."""
        stats = {s.mod_fqn: s for s in self._mt.memory_tracking.values()}
        root = type(self.model).__name__
        out = []
        for name in module_units(self.model):
            s = stats.get(f"{root}.{name}")
            if s is None:
                continue
            before = _first(s.snapshots, ("Pre-Forward", "Before Pre-Forward"), device)
            after = _first(s.snapshots, ("Post-Forward", "After Post-Forward"), device)
            act = max(0, _activation(after) - _activation(before))
            out.append(ModuleMemory(name, int(getattr(s, "parameter_mem", 0)), act))
        out.sort(key=lambda m: m.held, reverse=True)
        return out[:top]


class ModuleStats(WeakIdKeyDictionary):
    """The tracker's statistics by module, read the way the tracker reads them: after every
    operator it walks every module's entry (to raise the peaks of those running). torch's
    dictionary checks each key with a test meant for tensors, ``hasattr(key, "_fix_weakref")``,
    which on an ``nn.Module`` raises and catches an AttributeError: most of an estimate's time
    for a model of many modules (``scripts/bench_estimate.py``). Its keys here are modules, so
    a live key is all that is checked."""

    def values(self) -> list[Any]:  # type: ignore[override]
        return [value for ref, value in list(self.data.items()) if weakref.ref.__call__(ref) is not None]


def _read_quickly(mt: Any) -> bool:
    """Give the tracker a :class:`ModuleStats` before it records anything; False where this
    torch keeps its statistics otherwise (the figures are the same, only slower)."""
    if type(getattr(mt, "memory_tracking", None)) is not WeakIdKeyDictionary or len(mt.memory_tracking):
        return False
    mt.memory_tracking = ModuleStats()
    return True


def _first(snapshots: dict[Any, list[dict[Any, dict[Any, int]]]], states: tuple[str, ...],
           device: torch.device) -> dict[Any, int]:
    for key, snaps in snapshots.items():
        if str(getattr(key, "value", key)) in states and snaps:
            return snaps[0].get(device, {})
    return {}


def _activation(counts: dict[Any, int]) -> int:
    return sum(int(v) for k, v in counts.items() if str(getattr(k, "value", k)) == "Activation")


def module_units(model: nn.Module) -> Iterator[str]:
    """The modules a user reads memory by: each block of a repeated stack (the children of
    a ModuleList), and the leaves outside one (embeddings, final norm, output head);
    containers (ModuleDict, a plain wrapper) are looked into."""
    def walk(module: nn.Module, prefix: str) -> Iterator[str]:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, nn.ModuleList):
                yield from (f"{path}.{i}" for i, _ in enumerate(child))
            elif any(True for _ in child.children()):
                yield from walk(child, f"{path}.")
            else:
                yield path
    yield from walk(model, "")


@contextmanager
def fake_mode() -> Iterator[Any]:
    """torch's FakeTensorMode: tensors with shapes, dtypes and devices but no storage (from
    torch._subclasses: fake tensors have no public module)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        yield mode


@contextmanager
def unfaked(mode: Any) -> Iterator[None]:
    """Real tensors again for a moment inside ``fake_mode`` (FSDP2's device mesh is built
    from real ones); the fake tensors made so far stay fake."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    if mode is None:
        yield
        return
    with unset_fake_temporarily():
        yield


def data_dependent_op(e: BaseException) -> str | None:
    """The operator when ``e`` is fake tensors refusing an operation whose result depends
    on the data (``.item()``, ``nonzero``, a shape from values); None for anything else."""
    from torch._subclasses import fake_tensor as ft

    kinds = tuple(getattr(ft, n) for n in ("DataDependentOutputException", "DynamicOutputShapeException",
                                           "UnsupportedOperatorException") if hasattr(ft, n))
    if isinstance(e, kinds):
        return str(getattr(e, "func", None) or e).split("\n")[0]
    text = str(e)
    if "data-dependent" in text or "Data dependent" in text or "aten._local_scalar_dense" in text:
        return "aten._local_scalar_dense (.item() or a value read back)"
    return None
