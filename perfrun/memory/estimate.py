"""The memory a configuration will need, before anything runs: the run's model, knobs,
optimizer, loss and batch built under fake tensors (shapes and dtypes, no storage), the
optimizer's state created, then one optimizer step taken under torch's memory tracker (the
state is held throughout that step: its peak is the steady step's). The state is made by
the optimizer's own step on zero gradients, which allocates what a first training step's
would, without that step's forward and backward (under fake tensors, the costly part), where
every trainable parameter gets a gradient: perfrun's own models. A user's model may leave a
parameter without one, and so without state: its state is made by a first training step
(tests/test_estimate.py holds both equal to a training step's). The tracker counts the same
bytes, category by category, as it does on real tensors (tests/test_estimate.py holds it to
the measured breakdown within 2 %), so the estimate is exact where the tracker is; what it
cannot see is said in ``not_counted``, and the figures are always labelled an estimate.

What differs from the run, and is said: ``compile=true`` is estimated eager (compiled
code usually needs no more); DDP as one process (its gradient buckets, about the size
of the gradients, are not counted); fp16's loss scaler without its skip check (a value
read back, which fake tensors cannot do); on a machine without the GPU, CUDA's own parts
(the allocator's reserve and rounding, cuBLAS/cuDNN workspaces, the CUDA context).
FSDP2 over N ranks runs on one process with torch's fake process group. torchao's 8/4-bit
AdamW cannot make its state under fake tensors (its quantization map is read back as numbers):
the step is taken by fp32 AdamW and its state replaced by the low-bit layout's exact size
(:func:`perfrun.optim.low_bit.state_bytes`), said in ``not_counted``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from perfrun.config import TrainConfig
from perfrun.memory.tracker import (
    Breakdown,
    CategoryTracker,
    ModuleStack,
    data_dependent_op,
    fake_mode,
    tracker_missing,
    unfaked,
)

log = logging.getLogger("perfrun")


class EstimateError(RuntimeError):
    """The estimate cannot be made for this configuration: one line saying why."""


@dataclass
class Estimate:
    """The expected peak of one configuration, by category and by module; an estimate."""

    breakdown: Breakdown
    batch_size: int
    seq_len: int
    micro_steps: int
    world: int  # FSDP: ranks the state is sharded over (the figures are one rank's)
    target: str  # the device estimated for: cpu | cuda
    not_counted: list[str] = field(default_factory=list)
    seconds: float = 0.0
    measured: bool = False  # True only for fake=False: the same steps on real tensors

    @property
    def peak_bytes(self) -> int:
        return self.breakdown.peak_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "measurement" if self.measured else "estimate", "measured": self.measured,
                "method": ("real tensors + " if self.measured else "fake tensors + ") + self.breakdown.method,
                "batch_size": self.batch_size, "seq_len": self.seq_len, "micro_steps": self.micro_steps,
                "world": self.world, "target": self.target, "peak_bytes": self.peak_bytes,
                **{k: v for k, v in self.breakdown.to_dict().items() if k not in ("peak_bytes", "method")},
                "not_counted": self.not_counted, "seconds": round(self.seconds, 3)}


def variant(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """``cfg`` with dotted keys changed (``variant(cfg, **{"checkpointing.name": "full"})``),
    as a copy: ``cfg`` itself is never written. The typed tree is copied directly: a round
    trip through OmegaConf costs far more, and every estimate makes one."""
    out = copy.deepcopy(cfg)
    for dotted, value in changes.items():
        *parents, name = dotted.split(".")
        node = functools.reduce(getattr, parents, out)
        if name not in {f.name for f in dataclasses.fields(node)}:
            raise KeyError(f"{dotted}: {type(node).__name__} has no key {name!r}")
        setattr(node, name, value)
    return out


def target_device(cfg: TrainConfig) -> tuple[torch.device, str]:
    """Where the fake tensors live and what the estimate is for: a visible GPU is used as a
    fake CUDA device; without one, the CPU stands in for a CUDA target (said in not_counted)."""
    spec = str(cfg.device)
    wants_cuda = spec.startswith("cuda") or (spec == "auto" and torch.cuda.is_available())
    if wants_cuda and torch.cuda.is_available():
        return torch.device(spec if spec.startswith("cuda") else "cuda"), "cuda"
    return torch.device("cpu"), "cuda" if wants_cuda else "cpu"


def estimate(cfg: TrainConfig, vocab_size: int, *, batch_size: int | None = None, top: int = 10, fake: bool = True) -> Estimate:
    """The peak of a steady optimizer step of ``cfg`` at ``batch_size`` (default the config's),
    under fake tensors. Raises EstimateError with one line where it cannot. ``fake=False``
    takes the same steps on real tensors: a measurement (what the tests hold the estimate to)."""
    missing = tracker_missing()
    if missing is not None:
        raise EstimateError(f"the estimate needs torch's memory tracker: {missing}; the measured peak of a run "
                            "(perfrun train) is the way to know it with this torch")
    from perfrun.optim.low_bit import check as check_optimizer

    check_optimizer(cfg.optim, cfg.distributed)
    t0 = time.perf_counter()
    batch = int(batch_size if batch_size is not None else cfg.dataloader.batch_size)
    seq_len = int(cfg.data.seq_len or cfg.model.block_size)
    device, target = target_device(cfg)
    run_cfg, not_counted = _estimated_config(cfg, device, target)
    world = int(cfg.nproc) if cfg.distributed == "fsdp" else 1
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=[]))  # the run's random stream stays as it was
        if world > 1:
            stack.enter_context(fake_process_group(world))
        tracker, numels = stack.enter_context(_steps(run_cfg, device, vocab_size, batch, seq_len, fake))
        result = tracker.breakdown(top)
    if cfg.optim.name != run_cfg.optim.name:  # the low-bit state at its size: held through the step, so off the peak
        from perfrun.optim.low_bit import state_bytes

        smaller = state_bytes(run_cfg.optim.name, numels) - state_bytes(cfg.optim.name, numels)
        result.categories["Optstate"] = result.categories.get("Optstate", 0) - smaller
        result.peak_bytes -= smaller
    return Estimate(result, batch, seq_len, int(cfg.accumulation.steps), world, target, not_counted,
                    time.perf_counter() - t0, measured=not fake)


def _estimated_config(cfg: TrainConfig, device: torch.device, target: str) -> tuple[TrainConfig, list[str]]:
    """The configuration the fake steps run, and what that leaves out."""
    notes: list[str] = []
    changes: dict[str, Any] = {"model.init_from": None}
    if cfg.model.family == "hf":  # the folder's shapes; its weights are not needed to count bytes
        changes["model.init"] = "random"
    if cfg.compile:
        changes["compile"] = False
        notes.append("compile=true estimated eager (compiled code usually needs no more memory)")
    if cfg.distributed == "ddp":
        changes.update({"distributed": "none", "nproc": 1})
        notes.append("DDP's gradient buckets (about the gradients' size) and its process group")
    if target == "cuda":
        notes.append("the CUDA allocator's reserve and fragmentation, cuBLAS/cuDNN workspaces, the CUDA context")
        if device.type != "cuda":
            notes.append("made without a GPU: CPU kernels and autocast stand in for CUDA's "
                         "(the allocator's 512-byte rounding is not applied)")
    if cfg.optim.name != "adamw":  # torchao's low-bit state cannot be made under fake tensors
        changes["optim.name"] = "adamw"
        notes.append(f"optim={cfg.optim.name}: its state counted from torchao's layout (fake tensors cannot make it), "
                     "its step's temporaries as fp32 AdamW's")
    if cfg.precision.name == "fp16":
        notes.append("fp16's loss scaler check (a few bytes; fake tensors cannot read a value back)")
    return variant(cfg, **changes), notes


@contextmanager
def _steps(cfg: TrainConfig, device: torch.device, vocab_size: int, batch: int, seq_len: int,
           fake: bool) -> Iterator[tuple[CategoryTracker, list[int]]]:
    """Build everything under fake tensors, create the optimizer's state and run one optimizer
    step under the tracker; yield the tracker (its figures stay readable after the fake mode
    ends) and the trainable parameters' sizes."""
    from perfrun.knobs import apply_knobs
    from perfrun.optim.adamw import build_optimizer

    with ExitStack() as stack:
        stack.enter_context(_quiet_knob_logs())
        mode = stack.enter_context(fake_mode()) if fake else None
        model = _built(cfg, vocab_size, device, mode)
        with unfaked(mode):  # FSDP2 builds its device mesh from real tensors; the parameters stay fake
            plan = apply_knobs(cfg, device, model, stack)
        if plan.scaler.is_enabled():  # fp16: the scaler reads inf checks back, which fake tensors cannot
            plan.scaler = torch.amp.GradScaler(device.type, enabled=False)
        optimizer, _ = build_optimizer(plan.raw_model, cfg.optim, device)
        plan.attach(optimizer)  # the optimizer step in the backward: each gradient freed as it is stepped
        params = [p for p in plan.raw_model.parameters() if p.requires_grad]
        clip = float(cfg.optim.grad_clip) if cfg.optim.grad_clip > 0 else float("inf")
        if _trains_every_parameter(plan.raw_model):  # the state, untracked: the step below holds it throughout
            optimizer_state(optimizer, params)
        else:
            with ModuleStack(plan.raw_model) as first, _said_in_one_line(first):
                _fake_step(plan, optimizer, params, clip, batch, seq_len, vocab_size, device, None)
        # the steady step's peak, which no step of the run exceeds
        tracker = CategoryTracker(plan.raw_model, optimizer, fsdp=cfg.distributed == "fsdp")
        with tracker, _said_in_one_line(tracker):
            _fake_step(plan, optimizer, params, clip, batch, seq_len, vocab_size, device, tracker)
        yield tracker, [p.numel() for p in params]


def _built(cfg: TrainConfig, vocab_size: int, device: torch.device, mode: Any) -> torch.nn.Module:
    """The run's model with fake tensors on ``device`` (real ones where ``mode`` is None).

    A module made under fake tensors cannot be moved or cast: ``nn.Module._apply`` swaps each
    fake parameter (``torch.utils.swap_tensors``), which refuses one the fake mode's memo holds
    a weak reference to. perfrun's own builders never move their module; a user's (model=custom)
    may, as a transformers wrapper's ``.to(dtype)`` does, so it is built on the meta device,
    outside the fake mode, and its tensors are then replaced by fake ones on ``device``."""
    from perfrun.models.build import build_model

    if mode is None or cfg.model.family != "custom":
        with device:  # built where it runs, so that nothing moves it
            return build_model(cfg.model, vocab_size, cfg.attention)
    with unfaked(mode), torch.device("meta"):
        model = build_model(cfg.model, vocab_size, cfg.attention)
    return fake_tensors_on(model, device)


def fake_tensors_on(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` (built on the meta device) with each parameter and buffer replaced, in place,
    by an empty one of its shape and dtype on ``device``, made under the caller's fake mode.
    A tensor that several modules share (tied embeddings) stays one tensor: ``to_empty``
    would give each module its own (its ``_apply`` cannot swap a meta tensor for a fake one)."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        owned = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in owned:
            if id(tensor) not in made:
                empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)  # a meta input is not faked
                made[id(tensor)] = (torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                                    if isinstance(tensor, torch.nn.Parameter) else empty)
            setattr(module, name, made[id(tensor)])  # a buffer keeps its registration (persistent or not)
    return model


@contextmanager
def _said_in_one_line(watch: ModuleStack | CategoryTracker) -> Iterator[None]:
    """A failure of the step inside, as one line naming the module it ran in (read while
    ``watch`` still holds the modules that were running)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - said in one line, with the module it ran in
        raise _one_line(e, watch.active_modules()) from e


def _trains_every_parameter(model: torch.nn.Module) -> bool:
    """perfrun's own models give every trainable parameter a gradient in each step (FSDP2
    keeps the class among the sharded module's bases); a user's forward may leave one out."""
    from perfrun.models.flops import OWN_MODELS

    return any(cls.__module__ in OWN_MODELS for cls in type(model).__mro__)


def optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Create the optimizer's state as its first step does, by that step on zero gradients
    (the parameters move by weight decay alone; the gradients are dropped after)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _one_line(e: BaseException, modules: list[str]) -> EstimateError:
    """What failed under fake tensors, in one line: a data-dependent operation by name and
    the module it ran in."""
    op = data_dependent_op(e)
    if op is None:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return EstimateError(f"the estimate failed: {type(e).__name__}: {first}")
    where = modules[-1] if modules else "the training step (outside any module)"
    return EstimateError(f"the estimate cannot run {op} in {where} under fake tensors: its result depends on the "
                         "data; measure this configuration with perfrun train memory.breakdown=true")


def _fake_step(plan: Any, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], clip: float, batch: int,
               seq_len: int, vocab_size: int, device: torch.device, tracker: CategoryTracker | None) -> None:
    """One optimizer step as perfrun/loop/step.py takes it, on random fake tokens (the
    tracker's module figures start again at each micro-step: they are per forward)."""
    micro = plan.micro_steps
    for i in range(micro):
        if tracker is not None:
            tracker.new_step()
        x = torch.randint(0, vocab_size, (batch, seq_len), device=device)
        y = torch.randint(0, vocab_size, (batch, seq_len), device=device)
        with plan.micro_step_context(i, micro):
            with plan.forward_context():
                _, loss = plan.model(x, y)
                loss = loss / micro
            plan.backward(loss)
    plan.optimizer_step(optimizer, params, clip)
    optimizer.zero_grad(set_to_none=True)


@contextmanager
def _quiet_knob_logs() -> Iterator[None]:
    """The knobs' own info lines belong to a run, not to an estimate's fake build."""
    previous = log.level
    log.setLevel(max(previous, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(previous)


@contextmanager
def fake_process_group(world: int) -> Iterator[None]:
    """A process group of ``world`` ranks in this one process (torch's fake backend: its
    collectives return at once), so FSDP2 shards as it would over ``world`` GPUs."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise EstimateError("an FSDP estimate over nproc ranks runs in a plain process, not under torchrun; "
                            "run perfrun estimate on its own")
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # not public
    except ImportError as e:
        raise EstimateError(f"an FSDP estimate needs torch's fake process group, missing from torch "
                            f"{torch.__version__} ({e}); estimate with distributed=none and divide the "
                            "Parameter, Gradient and Optstate bytes by nproc") from None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
