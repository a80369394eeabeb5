"""The configuration schema: one dataclass per Hydra group, registered in the ConfigStore.

Hydra merges the YAML under ``conf/`` onto these dataclasses, so a wrong type or an
unknown key fails at composition, before any work. What a type cannot say (a batch
size below one, a sequence longer than the model) is checked by :func:`perfrun.validate.validate`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hydra.core.config_store import ConfigStore

from perfrun import device_conditions as resolvers
from perfrun.model_schema import ModelConfig

if TYPE_CHECKING:
    from omegaconf import DictConfig


Piece = TypeVar("Piece")


class ConfigError(ValueError):
    """A user's configuration mistake: reported as one line, never as a traceback."""


@dataclass
class PrecisionConfig:
    """Autocast dtype. ``none`` trains in fp32; ``tf32`` lets fp32 matmuls use TF32 on CUDA."""

    name: str = "none"  # none | bf16 | fp16 | fp8
    dtype: str = "float32"  # float32 | bfloat16 | float16
    tf32: bool = False
    recipe: str = "tensorwise"  # fp8: tensorwise | rowwise scales (perfrun/knobs/fp8.py)


LOSSES = ("standard", "chunked")  # the loss group's options (perfrun/models/losses.py)


@dataclass
class LossConfig:
    """The ``loss`` group: ``standard`` (all logits at once) or ``chunked`` (perfrun/models/losses.py)."""

    name: str = "standard"  # standard | chunked
    # chunked: rows (tokens) per chunk; one chunk's fp32 logits take chunk_size x vocab x 4 bytes
    # (GPT-2, 2048 rows: 412 MB, against 3.3 GB for all 16 x 1024 rows at once)
    chunk_size: int = 2048


@dataclass
class ActivationCheckpointingConfig:
    """Activation checkpointing: recompute a block's activations in backward to save memory."""

    name: str = "none"  # none | full | selective
    every_k: int = 0  # checkpoint every k-th block; 1 = every block, 0 = none


@dataclass
class DataLoaderConfig:
    # An int >= 1, or "auto": the largest batch that fits (perfrun/memory/batch_size.py). OmegaConf
    # has no Union type, hence Any; validate() checks it.
    batch_size: Any = 8
    max_batch_size: int | None = None  # auto: never choose more than this
    batch_margin: float = 0.1  # auto: choose this fraction below the largest batch that fit
    memory_budget_mib: float | None = None  # auto: tensor memory allowed (needed on the CPU)
    num_workers: int = 0
    pin_memory: bool = True  # only takes effect on CUDA
    # CUDA: host batches copied one step ahead on a side stream, data=synthetic drawn on the
    # device (perfrun/loop/step.py: BatchStream); false: each batch copied when the step takes it
    device_input: bool = True
    persistent_workers: bool = False
    prefetch_factor: int | None = None  # torch's default (2) when workers > 0


@dataclass
class AccumulationConfig:
    steps: int = 1  # micro-batches per optimizer step


@dataclass
class DataConfig:
    name: str = "pysource"  # pysource | text | memmap | synthetic
    path: str | None = None  # text and memmap: a file or a folder
    seq_len: int | None = None  # None: the model's block_size
    vocab_size: int | None = None  # memmap and synthetic; byte-level data is 256
    val_fraction: float = 0.1
    cache_dir: str | None = None  # None: $PERFRUN_CACHE or ~/.cache/perfrun
    tokenizer: str | None = None  # byte | tiktoken:gpt2 | a tokenizer.json (perfrun/data/tokenizers.py); memmap: from meta.json
    target: str | None = None  # custom: your Dataset class (pkg.module.Class or file.py:Class), built with args
    args: dict[str, Any] = field(default_factory=dict)


OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit")  # the optim group's options (perfrun/optim/low_bit.py)


@dataclass
class OptimConfig:
    """The ``optim`` group: AdamW with its moments in fp32, 8 or 4 bits (torchao's AdamW8bit /
    AdamW4bit: 2 or 1 bytes a parameter for both moments instead of 8)."""

    name: str = "adamw"  # adamw | adamw8bit | adamw4bit
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    fused: str = "auto"  # auto | true | false
    # each parameter stepped in its post-accumulate-grad hook, its gradient freed at once: the
    # gradients never exist all at once (perfrun/knobs/optim_in_backward.py)
    in_backward: bool = False


@dataclass
class OffloadConfig:
    """The ``offload`` group (CUDA only): activations saved for the backward kept in pinned host
    memory, or the optimizer's state and step on the host (perfrun/knobs/offload.py)."""

    name: str = "none"  # none | activations | optimizer


@dataclass
class CompileOptions:
    # default | max-autotune-no-cudagraphs | reduce-overhead | max-autotune (the last two: CUDA graphs)
    mode: str = "default"
    scope: str = "model"  # model | blocks: the whole module, or each block's forward (perfrun/knobs/compilation.py)
    fullgraph: bool = False
    dynamic: bool | None = False
    backend: str = "inductor"  # inductor | aot_eager: torch.compile's backend (aot_eager: dynamo's graphs, no kernels)


@dataclass
class FsdpOptions:
    """``distributed=fsdp`` settings (perfrun/knobs/fsdp.py)."""

    # True: free each block's gathered weights after its forward and gather them again for
    # the backward (ZeRO-3: least memory); false: keep them to the backward (ZeRO-2 style:
    # one all-gather fewer per block, the full weights held through the step)
    reshard_after_forward: bool = True
    # false (torchtitan's default): the last block and the root, where the backward starts, keep theirs
    reshard_last_block: bool = False
    forward_prefetch: int = 0  # blocks whose all-gather each block issues ahead; 0: FSDP2's implicit one
    backward_prefetch: int = 0  # the same in the backward, towards the first block


@dataclass
class MonitorConfig:
    every_n_steps: int = 10  # NVML and host telemetry; 0 turns it off
    sample_interval_s: float = 0.1  # background sampler period
    pcie: bool = False  # PCIe throughput: each NVML call counts over a 20 ms window (NVML's docs)


@dataclass
class MemoryConfig:
    """Where the memory goes (perfrun/memory/breakdown.py) and whether it will fit
    (perfrun/memory/): the tracked step of a run, the estimate said before step 1."""

    breakdown: bool = False  # one step after the warm-up runs under torch's memory tracker
    estimate: bool | None = None  # the estimate in the log's first lines; null: on CUDA, on the CPU where it may not fit
    size: str | None = None  # the memory to fit into, e.g. 80GiB; null: the visible GPU's


@dataclass
class MfuConfig:
    peak: str = "datasheet"  # datasheet | measured | a number in TFLOPS


@dataclass
class CheckpointSaveConfig:
    """Training-state checkpoints: when they are saved, how many are kept, where."""

    every_n_steps: int = 0  # 0: only at the end (and on a graceful stop)
    at_end: bool = True
    keep_last: int = 2
    dir: str | None = None  # None: <run dir>/checkpoints


@dataclass
class GuardConfig:
    max_bad_steps: int = 3  # stop after this many consecutive non-finite steps


@dataclass
class ProfilerConfig:
    start_step: int = 10  # steps skipped before the profiler warms up (steady state)
    warmup: int = 2
    active: int = 3  # steps recorded
    record_shapes: bool = True
    profile_memory: bool = False
    snapshot_entries: int = 100000  # allocator events kept by memory_snapshot=true


@dataclass
class LoggerConfig:
    """The experiment logger (perfrun/telemetry/loggers.py); metrics.jsonl is written either way."""

    name: str = "none"  # none | tensorboard | wandb | mlflow
    project: str = "perfrun"  # W&B's project; MLflow's experiment outside a sweep
    group: str | None = None  # None: a sweep's jobs share their sweep dir as group (MLflow: experiment)
    run_name: str | None = None  # None: the run dir's date/time, or a sweep job's number and overrides
    # None: <run dir>/tensorboard, <run dir>/wandb, or an MLflow file store in <sweep or run dir>/mlruns;
    # for MLflow also a tracking URI (sqlite:///..., http://...)
    dir: str | None = None
    mode: str = "auto"  # W&B: auto (online when this machine is logged in, else offline) | online | offline


@dataclass
class AblationConfig:
    """A job's place in the measured ladder (``+sweep=ablation``, conf/ablation/): read by
    perfrun report to build the ladder, leave-one-out and trade-off tables; training ignores it."""

    rung: str = ""  # the rung's name; "" outside the ladder
    kind: str = ""  # ladder | without | alternative | tradeoff | seed
    step: int = 0  # ladder: its place from the naive trainer (0) up
    knob: str = ""  # without: the knob turned off; alternative: the rung it stands in for
    acts_on: str = "any"  # any | cuda | fp8 (FP8 tensor cores): where the rung's knob can act
    why: str = ""  # what the knob does (and why it cannot act elsewhere)
    repeats: int = 3  # +sweep=ablation: jobs per rung (repeat=0..repeats-1, interleaved)
    tradeoff_repeats: int = 2  # a memory trade-off rung runs in repeats 0..tradeoff_repeats-1 only
    budget_s: float | None = None  # seconds a job trains (after warm-up + 10 steady steps); null: max_steps
    target_s: float | None = None  # +sweep=ablation: the ladder's wall-time aim, shared out as job budgets


@dataclass
class RuntimeConfig:
    """Process-wide settings a job makes for itself and undoes at its end (perfrun/loop/runtime.py).
    The defaults leave the process as its caller has it; ``perfrun train`` picks conf/runtime/."""

    gc: str = "default"  # default | freeze: what is alive before the job out of the collector's sight
    malloc: str = "system"  # system | fixed: glibc's heap thresholds fixed for a CPU job


@dataclass
class TrainConfig:
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    dataloader: DataLoaderConfig = field(default_factory=DataLoaderConfig)
    accumulation: AccumulationConfig = field(default_factory=AccumulationConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    compile: bool = False
    compile_options: CompileOptions = field(default_factory=CompileOptions)
    cudnn_benchmark: bool = False
    attention: str = "sdpa"  # sdpa | eager
    sdpa_backend: str = "auto"  # auto | flash | efficient | cudnn | math
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 1337
    max_steps: int = 600
    timing_warmup_steps: int = 5  # steps kept out of the summary's speed figures
    log_every: int = 10
    eval_every: int = 200  # 0: only at the end
    eval_batches: int = 10
    progress: str = "auto"  # auto | bar | plain | off
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    mfu: MfuConfig = field(default_factory=MfuConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    checkpoint: CheckpointSaveConfig = field(default_factory=CheckpointSaveConfig)
    resume: str | None = None  # auto | a checkpoint file or folder | null
    guard: GuardConfig = field(default_factory=GuardConfig)
    profile: bool = False  # torch.profiler over profiler.active steady-state steps
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    memory_snapshot: bool = False  # CUDA allocator history for pytorch.org/memory_viz
    distributed: str = "none"  # none | ddp | fsdp
    fsdp: FsdpOptions = field(default_factory=FsdpOptions)
    nproc: int = 1  # ddp, fsdp: processes on this machine; perfrun train starts torchrun for nproc > 1
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    repeat: int = 0  # which repeat of a sweep's measurement this job is; report groups repeats by it
    ablation: AblationConfig = field(default_factory=AblationConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


def config_dir() -> str:
    """Where the YAML lives: conf/ beside the package in a source checkout (so a checkout
    always runs its own YAML), else the copy installed inside the package."""
    checkout = Path(__file__).resolve().parent.parent / "conf"
    if (checkout / "train.yaml").is_file():
        return str(checkout)
    spec = importlib.util.find_spec("perfrun.conf")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(next(iter(spec.submodule_search_locations))).resolve())
    raise SystemExit("perfrun: error: the configuration (conf/train.yaml) is missing from this install; reinstall perfrun")


def register_configs() -> None:
    """Register the schema; train.yaml lists it first in its defaults, so every group's
    YAML is merged onto (and checked against) its typed field of TrainConfig."""
    from omegaconf import OmegaConf

    store = ConfigStore.instance()
    if "train_schema.yaml" not in store.repo:  # once per process: storing builds the schema's tree again
        store.store(name="train_schema", node=TrainConfig)
    resolvers.register()
    OmegaConf.register_new_resolver("perfrun_groups", group_listing, replace=True)  # the help's group list


# conf/ groups that ``perfrun train --help`` does not offer: +sweep=ablation picks their options
INTERNAL_GROUPS = ("ablation", "hydra")


def group_listing() -> str:
    """The ``group: option, ...`` lines of ``perfrun train --help`` (Hydra's own format),
    read from conf/ without the internal groups."""
    root = Path(config_dir())
    lines = []
    for group in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in INTERNAL_GROUPS):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        if options:
            lines.append(f"{group.name}: {', '.join(options)}")
    return "\n".join(lines)


CHOICES = {
    "precision.dtype": ("float32", "bfloat16", "float16"),
    "checkpointing.name": ("none", "full", "selective"),
    "data.name": ("pysource", "text", "memmap", "synthetic", "custom"),
    "optim.name": OPTIMIZERS,
    "offload.name": ("none", "activations", "optimizer"),
    "optim.fused": ("auto", "true", "false"),
    "compile_options.mode": ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"),
    "loss.name": LOSSES,
    "precision.recipe": ("tensorwise", "rowwise"),
    "compile_options.scope": ("model", "blocks"),
    "compile_options.backend": ("inductor", "aot_eager"),
    "attention": ("sdpa", "eager"),
    "sdpa_backend": ("auto", "flash", "efficient", "cudnn", "math"),
    "progress": ("auto", "bar", "plain", "off"),
    "distributed": ("none", "ddp", "fsdp"),
    "ablation.acts_on": resolvers.ACTS_ON,
    "runtime.gc": ("default", "freeze"),
    "runtime.malloc": ("system", "fixed"),
}


def typed(composed: DictConfig) -> TrainConfig:
    """The composed configuration (Hydra's DictConfig, its ``hydra`` node left out) as the
    schema's dataclasses, once, at the top of a job: every function after takes a typed
    piece of it. A key the schema lacks (``+key=value``) is refused here, where it is seen."""
    from omegaconf import OmegaConf

    unknown = [k for k in _unknown_keys(composed, TrainConfig()) if k != "hydra"]
    if unknown:
        raise ConfigError(
            f"{', '.join(unknown)}: not a key perfrun knows; remove it "
            "(perfrun train --cfg job lists the keys)"
        )
    if "hydra" in composed:  # composed with return_hydra_config: the job's part, as Hydra hands it to a job
        composed = OmegaConf.masked_copy(composed, [k for k in composed if k != "hydra"])
    made = OmegaConf.to_object(composed)  # the copy is a plain root whose values are the schema's dataclasses
    cfg = made if isinstance(made, TrainConfig) else TrainConfig(**made)
    for key, options in CHOICES.items():
        parent, _, leaf = key.rpartition(".")
        node = _get(cfg, parent) if parent else cfg
        setattr(node, leaf, as_option(getattr(node, leaf), options))
    return cfg


def as_option(value: Any, options: tuple[str, ...]) -> Any:
    """The option of a string key that ``value`` spells, as the option is written. Hydra's
    override grammar (and YAML) reads ``true``, ``false`` and numbers as such, and OmegaConf
    stores them in a string key as ``True``, ``False``, ``1.0``: the option typed is found
    again by what it means, so ``optim.fused=true`` is the option ``true``. Anything else is
    returned as it is (validate refuses it, listing the options)."""
    text = str(value)
    if text in options:
        return text
    if text in ("True", "False") and text.lower() in options:
        return text.lower()
    number = _as_number(text)
    same = [o for o in options if number is not None and _as_number(o) == number]
    return same[0] if same else value


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def as_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The configuration as plain containers: what summary.json and checkpoints record."""
    return dataclasses.asdict(cfg)


def from_record(piece: type[Piece], record: dict[str, Any]) -> Piece:
    """A configuration piece from its part of a recorded configuration (a checkpoint's),
    keeping the keys the schema has: a record written by an older or newer perfrun loads."""
    known = {f.name for f in dataclasses.fields(piece)}  # type: ignore[arg-type]
    return piece(**{k: v for k, v in record.items() if k in known})


def select(cfg: TrainConfig, dotted: str) -> Any:
    """The value at a dotted key (``model.n_layer``) of a typed configuration."""
    return _get(cfg, dotted)


def _get(root: object, dotted: str) -> Any:
    node: Any = root
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _unknown_keys(node: Any, schema: Any, prefix: str = "") -> list[str]:
    """Keys in ``node`` that the schema lacks (Hydra's ``+key=value`` can add them), read from
    ``schema``, a dataclass of it with its defaults: the fields are the keys, a field that is
    itself a dataclass a group of them (``model.args`` and ``data.args``, plain dicts, hold the
    user's own keys)."""
    from omegaconf import DictConfig

    unknown = []
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node.keys() if isinstance(node, DictConfig) else []:
        if key not in names:
            unknown.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(child := getattr(schema, key)):
            unknown += _unknown_keys(node[key], child, f"{prefix}{key}.")
    return unknown
