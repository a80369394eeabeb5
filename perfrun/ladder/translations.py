"""perfrun's keys in the words of other trainers: one row per key, with its Hugging Face
``Trainer``, Lightning and plain-PyTorch forms, as data.

A form is one of three things. :class:`Arg`: a keyword argument of a real constructor or
call (``TrainingArguments``, ``from_pretrained``, ``lightning.Trainer``, ``torch.optim.AdamW``,
``DataLoader``, ``torch.compile``, ``torch.autocast``, ``torch.amp.GradScaler``); the tests
read those signatures from the installed packages, so a row that names an argument they do
not have fails there. :class:`Code`: lines to copy where the trainer has no argument for the
knob (a backend switch, a block wrapper). :class:`Missing`: the trainer has no equivalent,
and says why. Each form may carry a ``scope`` note: where the trainer's knob acts on
something else than perfrun's did (the whole model, the model's own checkpointing).

Every value comes from a recorded configuration (a flat ``dict`` of dotted keys), which is
data: :func:`perfrun.ladder.recorded.check` refuses a value that is not of its key's type or
choices before any of it is written into code, and strings reach code only through ``repr``.
:mod:`perfrun.ladder.translate` renders these rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Config = Mapping[str, Any]  # a run's configuration as flat dotted keys (perfrun.ladder.verdict.flat)

#: the trainers perfrun speaks for, in the order the report shows them
#: the constructors or calls an Arg names, per trainer (the tests introspect each)
TARGETS = {
    "hf": ("TrainingArguments", "from_pretrained"),
    "lightning": ("Trainer", "AdamW", "DataLoader", "torch.compile"),
    "torch": ("AdamW", "DataLoader", "torch.compile", "autocast", "GradScaler"),
}


class Expr(str):
    """A value that is code (``torch.bfloat16``), written as is; only the rows below make one,
    from a fixed table, never from a recorded string."""


def _always(c: Config) -> bool:
    return True


@dataclass(frozen=True)
class Arg:
    """A keyword argument of ``target`` (see TARGETS) with its value for a configuration."""

    target: str
    name: str
    value: Callable[[Config], Any]
    when: Callable[[Config], bool] = _always  # written only where this holds
    scope: str = ""  # where the trainer's knob acts on something else than perfrun's


@dataclass(frozen=True)
class Code:
    """Lines to copy where no argument exists, into ``section``: module (definitions at the top),
    setup (switches set once), model (acts on the model), compile (last on the model), train
    (around trainer.train or trainer.fit)."""

    section: str
    lines: Callable[[Config], list[str]]
    when: Callable[[Config], bool] = _always
    scope: str = ""


@dataclass(frozen=True)
class Missing:
    """The trainer has no equivalent: said as a comment where the knob is on."""

    why: str
    when: Callable[[Config], bool] = _always


Form = Arg | Code | Missing


@dataclass(frozen=True)
class Translation:
    """One perfrun key and its forms in each trainer."""

    key: str
    hf: tuple[Form, ...] = ()
    lightning: tuple[Form, ...] = ()
    torch: tuple[Form, ...] = ()
    #: whether the key's value turns its knob on (the comments name the knobs that are on)
    on: Callable[[Config], bool] = field(default=_always)

    def forms(self, trainer: str) -> tuple[Form, ...]:
        return {"hf": self.hf, "lightning": self.lightning, "torch": self.torch}[trainer]


# --------------------------------------------------------------------------- values


def _v(key: str) -> Callable[[Config], Any]:
    return lambda c: c[key]


def _is(key: str, *values: Any) -> Callable[[Config], bool]:
    return lambda c: c.get(key) in values


def _cuda(c: Config) -> bool:
    return c.get("device_type") == "cuda"


def _compiled(c: Config) -> bool:
    return bool(c.get("compile"))


def _every_k(c: Config) -> int:
    """The blocks perfrun checkpointed: every k-th (0: none)."""
    return 0 if c.get("checkpointing.name") == "none" else int(c.get("checkpointing.every_k") or 0)


AUTOCAST = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp8": "torch.bfloat16"}
LIGHTNING_PRECISION = {"none": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "fp8": "bf16-mixed"}
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}
PERFRUN_LOOP = "measured in perfrun's loop on perfrun's model"


def _tf32(c: Config) -> list[str]:
    return ["torch.backends.cuda.matmul.allow_tf32 = True", "torch.backends.cudnn.allow_tf32 = True"]


def _checkpoint_blocks(c: Config) -> list[str]:
    k = _every_k(c)
    chosen = "model.blocks" if k == 1 else f"model.blocks[{k - 1}::{k}]"
    return [f"for block in {chosen}:  # your model's repeated blocks (perfrun: its `blocks` ModuleList)",
            "    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)"]


def _fp8(c: Config) -> list[str]:
    return ["from torchao.float8 import Float8LinearConfig, convert_to_float8_training",
            f"convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name({c['precision.recipe']!r}))"]


def _sdpa(c: Config) -> list[str]:
    return ["# in your model's attention: y = F.scaled_dot_product_attention(q, k, v, is_causal=True)"]


def _sdpa_backend(c: Config) -> list[str]:
    return ["from torch.nn.attention import SDPBackend, sdpa_kernel",
            f"attention_kernel = functools.partial(sdpa_kernel, SDPBackend.{SDPA_BACKENDS[c['sdpa_backend']]})"
            "  # entered around each forward"]


def _chunked(c: Config) -> list[str]:
    return ["def lm_loss(hidden, head_weight, targets):  # call it in your model's forward, on the last hidden states",
            "    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=" + repr(int(c["loss.chunk_size"])) + ")",
            "    return F.linear_cross_entropy(hidden.flatten(0, -2), head_weight, targets.flatten(), options=options)"]


def _compile_blocks(c: Config) -> list[str]:
    return ["for block in model.blocks:  # compile_options.scope=blocks: each block's forward on its own",
            "    block.forward = torch.compile(block.forward, **compile_kwargs)"]


def _compile_model(c: Config) -> list[str]:
    return ["model = torch.compile(model, **compile_kwargs)"]


def _schedule(c: Config) -> list[str]:
    return ["def lr_factor(step, warmup=" + repr(int(c["optim.warmup_steps"])) + ", total="
            + repr(int(c["max_steps"])) + ", floor=" + repr(float(c["optim.min_lr_ratio"])) + "):",
            "    if step < warmup:",
            "        return (step + 1) / warmup",
            "    progress = min(1.0, (step - warmup) / max(1, total - warmup))",
            "    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))"]


HF_COMPILE = ("Hugging Face compiles the whole model it is given (perfrun compiled "
              "compile_options.scope's module, with its fullgraph and dynamic options)")
HF_CHECKPOINT = ("the model's own gradient checkpointing (gradient_checkpointing_enable), on every layer it "
                 "chooses; perfrun wrapped every k-th of its blocks in torch.utils.checkpoint")
HF_ATTENTION = "the model's own attention code for that implementation; perfrun measured its GPT's"

def _betas(c: Config) -> tuple[Any, Any]:
    """AdamW's ``betas``: Lightning's and PyTorch's one argument for perfrun's two keys."""
    return c["optim.beta1"], c["optim.beta2"]


ROWS: tuple[Translation, ...] = (
    Translation(
        "precision.name",
        hf=(Arg("TrainingArguments", "bf16", lambda c: True, when=_is("precision.name", "bf16", "fp8")),
            Arg("TrainingArguments", "fp16", lambda c: True, when=_is("precision.name", "fp16"))),
        lightning=(Arg("Trainer", "precision", lambda c: LIGHTNING_PRECISION[c["precision.name"]]),),
        torch=(Arg("autocast", "enabled", lambda c: c["precision.name"] != "none"),
               Arg("autocast", "dtype", lambda c: Expr(AUTOCAST[c["precision.name"]]),
                   when=_is("precision.name", "bf16", "fp16", "fp8")),
               Arg("GradScaler", "enabled", lambda c: c["precision.name"] == "fp16")),
        on=lambda c: c.get("precision.name") != "none",
    ),
    Translation(
        "precision.recipe",  # fp8: torchao's float8 training of the Linear layers
        hf=(Code("model", _fp8, when=_is("precision.name", "fp8"),
                 scope="before the Trainer is built; TrainingArguments has no FP8 of torchao's"),),
        lightning=(Code("model", _fp8, when=_is("precision.name", "fp8"),
                        scope="in configure_model; Lightning's precision='transformer-engine' is another library"),),
        torch=(Code("model", _fp8, when=_is("precision.name", "fp8")),),
        on=_is("precision.name", "fp8"),
    ),
    Translation(
        "precision.tf32",
        hf=(Arg("TrainingArguments", "tf32", _v("precision.tf32"), when=lambda c: bool(c.get("precision.tf32"))),),
        lightning=(Code("setup", _tf32, when=lambda c: bool(c.get("precision.tf32"))),),
        torch=(Code("setup", _tf32, when=lambda c: bool(c.get("precision.tf32"))),),
        on=lambda c: bool(c.get("precision.tf32")),
    ),
    Translation(
        "cudnn_benchmark",
        hf=(Code("setup", lambda c: ["torch.backends.cudnn.benchmark = True"], when=_is("cudnn_benchmark", True)),),
        lightning=(Arg("Trainer", "benchmark", _v("cudnn_benchmark")),),
        torch=(Code("setup", lambda c: ["torch.backends.cudnn.benchmark = True"], when=_is("cudnn_benchmark", True)),),
        on=_is("cudnn_benchmark", True),
    ),
    Translation(
        "attention",
        hf=(Arg("from_pretrained", "attn_implementation", _v("attention"), scope=HF_ATTENTION),),
        lightning=(Code("model", _sdpa, when=_is("attention", "sdpa")),),
        torch=(Code("model", _sdpa, when=_is("attention", "sdpa")),),
        on=_is("attention", "sdpa"),
    ),
    Translation(
        "sdpa_backend",
        hf=(Code("train", _sdpa_backend, when=lambda c: c.get("sdpa_backend") != "auto",
                 scope="entered around trainer.train(), evaluation included; perfrun entered it around each "
                 "training forward"),),
        lightning=(Code("train", _sdpa_backend, when=lambda c: c.get("sdpa_backend") != "auto",
                        scope="entered around trainer.fit(), validation included; perfrun entered it around each "
                        "training forward"),),
        torch=(Code("module", _sdpa_backend, when=lambda c: c.get("sdpa_backend") != "auto"),
               Code("module", lambda c: ["attention_kernel = contextlib.nullcontext  # sdpa_backend=auto: SDPA picks"],
                    when=_is("sdpa_backend", "auto"))),
        on=lambda c: c.get("sdpa_backend") != "auto",
    ),
    Translation(
        "compile",
        hf=(Arg("TrainingArguments", "torch_compile", _v("compile"), when=_compiled, scope=HF_COMPILE),),
        lightning=(Code("compile", _compile_model,
                        when=lambda c: _compiled(c) and c.get("compile_options.scope") != "blocks"),),
        torch=(Code("compile", _compile_model,
                    when=lambda c: _compiled(c) and c.get("compile_options.scope") != "blocks"),),
        on=_compiled,
    ),
    Translation(
        "compile_options.mode",
        hf=(Arg("TrainingArguments", "torch_compile_mode", _v("compile_options.mode"),
                when=lambda c: _compiled(c) and c.get("compile_options.mode") != "default"),),
        lightning=(Arg("torch.compile", "mode", _v("compile_options.mode"),
                       when=lambda c: _compiled(c) and c.get("compile_options.mode") != "default"),),
        torch=(Arg("torch.compile", "mode", _v("compile_options.mode"),
                   when=lambda c: _compiled(c) and c.get("compile_options.mode") != "default"),),
        on=lambda c: _compiled(c) and c.get("compile_options.mode") != "default",
    ),
    Translation(
        "compile_options.scope",
        hf=(Missing(HF_COMPILE, when=_is("compile_options.scope", "blocks")),),
        lightning=(Code("compile", _compile_blocks, when=lambda c: _compiled(c) and c.get("compile_options.scope") == "blocks"),),
        torch=(Code("compile", _compile_blocks, when=lambda c: _compiled(c) and c.get("compile_options.scope") == "blocks"),),
        on=lambda c: _compiled(c) and c.get("compile_options.scope") == "blocks",
    ),
    Translation(
        "compile_options.fullgraph",
        hf=(Missing("TrainingArguments passes torch.compile a backend and a mode only"),),
        lightning=(Arg("torch.compile", "fullgraph", _v("compile_options.fullgraph"), when=_compiled),),
        torch=(Arg("torch.compile", "fullgraph", _v("compile_options.fullgraph"), when=_compiled),),
        on=lambda c: _compiled(c) and bool(c.get("compile_options.fullgraph")),
    ),
    Translation(
        "compile_options.dynamic",
        hf=(Missing("TrainingArguments passes torch.compile a backend and a mode only (dynamic stays torch's "
                    "default: a shape that changes compiles again, as dynamic)"),),
        lightning=(Arg("torch.compile", "dynamic", _v("compile_options.dynamic"), when=_compiled),),
        torch=(Arg("torch.compile", "dynamic", _v("compile_options.dynamic"), when=_compiled),),
        on=lambda c: _compiled(c) and c.get("compile_options.dynamic") is not False,
    ),
    Translation(
        "checkpointing.name",
        hf=(Arg("TrainingArguments", "gradient_checkpointing", lambda c: True, when=lambda c: _every_k(c) > 0,
                scope=HF_CHECKPOINT),
            Arg("TrainingArguments", "gradient_checkpointing_kwargs", lambda c: {"use_reentrant": False},
                when=lambda c: _every_k(c) > 0)),
        lightning=(Code("model", _checkpoint_blocks, when=lambda c: _every_k(c) > 0),),
        torch=(Code("model", _checkpoint_blocks, when=lambda c: _every_k(c) > 0),),
        on=lambda c: _every_k(c) > 0,
    ),
    Translation(
        "checkpointing.every_k",
        hf=(Missing("gradient_checkpointing checkpoints every layer the model checkpoints; no every k-th",
                    when=lambda c: _every_k(c) > 1),),
        lightning=(),  # the block wrapper of checkpointing.name takes every k-th
        torch=(),
        on=lambda c: _every_k(c) > 1,
    ),
    Translation(
        "optim.fused",
        hf=(Arg("TrainingArguments", "optim", lambda c: "adamw_torch_fused" if c["fused_adamw"] else "adamw_torch"),),
        lightning=(Arg("AdamW", "fused", lambda c: bool(c["fused_adamw"])),),
        torch=(Arg("AdamW", "fused", lambda c: bool(c["fused_adamw"])),),
        on=lambda c: bool(c.get("fused_adamw")),
    ),
    Translation(
        "optim.lr",
        hf=(Arg("TrainingArguments", "learning_rate", _v("optim.lr")),),
        lightning=(Arg("AdamW", "lr", _v("optim.lr")),), torch=(Arg("AdamW", "lr", _v("optim.lr")),),
        on=lambda c: False,
    ),
    Translation(
        "optim.weight_decay",
        hf=(Arg("TrainingArguments", "weight_decay", _v("optim.weight_decay"),
                scope="Hugging Face decays every weight but biases and norms; perfrun, every 2-D weight"),),
        lightning=(Arg("AdamW", "weight_decay", _v("optim.weight_decay")),),
        torch=(Arg("AdamW", "weight_decay", _v("optim.weight_decay")),),
        on=lambda c: False,
    ),
    Translation(
        "optim.beta1",
        hf=(Arg("TrainingArguments", "adam_beta1", _v("optim.beta1")),),
        lightning=(Arg("AdamW", "betas", _betas),),
        torch=(Arg("AdamW", "betas", _betas),),
        on=lambda c: False,
    ),
    Translation(
        "optim.beta2",
        hf=(Arg("TrainingArguments", "adam_beta2", _v("optim.beta2")),),
        lightning=(Arg("AdamW", "betas", _betas),),
        torch=(Arg("AdamW", "betas", _betas),),
        on=lambda c: False,
    ),
    Translation(
        "optim.eps",
        hf=(Arg("TrainingArguments", "adam_epsilon", _v("optim.eps")),),
        lightning=(Arg("AdamW", "eps", _v("optim.eps")),), torch=(Arg("AdamW", "eps", _v("optim.eps")),),
        on=lambda c: False,
    ),
    Translation(
        "optim.grad_clip",
        hf=(Arg("TrainingArguments", "max_grad_norm", _v("optim.grad_clip")),),
        lightning=(Arg("Trainer", "gradient_clip_val", lambda c: c["optim.grad_clip"] or None),),
        torch=(Code("module", lambda c: [f"clip = {float(c['optim.grad_clip'])!r}  # optim.grad_clip (0: none)"]),),
        on=lambda c: False,
    ),
    Translation(
        "optim.warmup_steps",
        hf=(Arg("TrainingArguments", "warmup_steps", _v("optim.warmup_steps")),),
        lightning=(Code("module", _schedule),), torch=(Code("module", _schedule),),
        on=lambda c: False,
    ),
    Translation(
        "optim.min_lr_ratio",
        hf=(Arg("TrainingArguments", "lr_scheduler_type", lambda c: "cosine_with_min_lr"),
            Arg("TrainingArguments", "lr_scheduler_kwargs", lambda c: {"min_lr_rate": c["optim.min_lr_ratio"]})),
        lightning=(), torch=(),  # in the schedule of optim.warmup_steps
        on=lambda c: False,
    ),
    Translation(
        "max_steps",
        hf=(Arg("TrainingArguments", "max_steps", _v("max_steps")),),
        lightning=(Arg("Trainer", "max_steps", _v("max_steps")),),
        torch=(),  # the loop's own count
        on=lambda c: False,
    ),
    Translation(
        "seed",
        hf=(Arg("TrainingArguments", "seed", _v("seed")),),
        lightning=(Code("setup", lambda c: [f"lightning.seed_everything({int(c['seed'])!r})"]),),
        torch=(Code("setup", lambda c: [f"torch.manual_seed({int(c['seed'])!r})"]),),
        on=lambda c: False,
    ),
    Translation(
        "dataloader.batch_size",
        hf=(Arg("TrainingArguments", "per_device_train_batch_size", _v("batch_size")),),
        lightning=(Arg("DataLoader", "batch_size", _v("batch_size")),),
        torch=(Arg("DataLoader", "batch_size", _v("batch_size")),),
        on=lambda c: False,
    ),
    Translation(
        "dataloader.num_workers",
        hf=(Arg("TrainingArguments", "dataloader_num_workers", _v("dataloader.num_workers")),),
        lightning=(Arg("DataLoader", "num_workers", _v("dataloader.num_workers")),),
        torch=(Arg("DataLoader", "num_workers", _v("dataloader.num_workers")),),
        on=lambda c: bool(c.get("dataloader.num_workers")),
    ),
    Translation(
        "dataloader.pin_memory",
        # pinned memory acts on CUDA alone (perfrun's too): a CPU run's translation leaves it out
        hf=(Arg("TrainingArguments", "dataloader_pin_memory", _v("dataloader.pin_memory"), when=_cuda),),
        lightning=(Arg("DataLoader", "pin_memory", _v("dataloader.pin_memory"), when=_cuda),),
        torch=(Arg("DataLoader", "pin_memory", _v("dataloader.pin_memory"), when=_cuda),),
        on=lambda c: bool(c.get("dataloader.pin_memory")) and _cuda(c),
    ),
    Translation(
        "dataloader.persistent_workers",
        hf=(Arg("TrainingArguments", "dataloader_persistent_workers", _v("dataloader.persistent_workers"),
                when=lambda c: bool(c.get("dataloader.num_workers"))),),
        lightning=(Arg("DataLoader", "persistent_workers", _v("dataloader.persistent_workers"),
                       when=lambda c: bool(c.get("dataloader.num_workers"))),),
        torch=(Arg("DataLoader", "persistent_workers", _v("dataloader.persistent_workers"),
                   when=lambda c: bool(c.get("dataloader.num_workers"))),),
        on=lambda c: bool(c.get("dataloader.persistent_workers")) and bool(c.get("dataloader.num_workers")),
    ),
    Translation(
        "dataloader.prefetch_factor",
        hf=(Arg("TrainingArguments", "dataloader_prefetch_factor", _v("dataloader.prefetch_factor"),
                when=lambda c: bool(c.get("dataloader.num_workers")) and c.get("dataloader.prefetch_factor") is not None),),
        lightning=(Arg("DataLoader", "prefetch_factor", _v("dataloader.prefetch_factor"),
                       when=lambda c: bool(c.get("dataloader.num_workers")) and c.get("dataloader.prefetch_factor") is not None),),
        torch=(Arg("DataLoader", "prefetch_factor", _v("dataloader.prefetch_factor"),
                   when=lambda c: bool(c.get("dataloader.num_workers")) and c.get("dataloader.prefetch_factor") is not None),),
        on=lambda c: bool(c.get("dataloader.num_workers")) and c.get("dataloader.prefetch_factor") is not None,
    ),
    Translation(
        "dataloader.device_input",
        hf=(Missing("the Trainer copies each batch to the GPU when the step takes it; perfrun copied batch k+1 on a "
                    "side stream while step k ran", when=_cuda),),
        lightning=(Missing("Lightning copies each batch to the GPU when the step takes it; perfrun copied batch k+1 "
                           "on a side stream while step k ran", when=_cuda),),
        torch=(Missing("perfrun's side-stream copy of batch k+1 while step k runs (perfrun/data/device_prefetch.py) "
                       "is not a torch call; this loop copies with non_blocking=True from pinned memory", when=_cuda),),
        on=lambda c: bool(c.get("dataloader.device_input")) and _cuda(c),
    ),
    Translation(
        "accumulation.steps",
        hf=(Arg("TrainingArguments", "gradient_accumulation_steps", _v("accumulation.steps")),),
        lightning=(Arg("Trainer", "accumulate_grad_batches", _v("accumulation.steps")),),
        torch=(Code("module", lambda c: [f"accumulation = {int(c['accumulation.steps'])!r}  # micro-batches per step"]),),
        on=lambda c: int(c.get("accumulation.steps") or 1) > 1,
    ),
    Translation(
        "loss.name",
        hf=(Missing("the model's forward computes its own loss from all the logits at once; torch's chunked "
                    "F.linear_cross_entropy in your model's forward is the nearest", when=_is("loss.name", "chunked")),),
        lightning=(Code("module", _chunked, when=_is("loss.name", "chunked"),
                        scope="torch's chunked F.linear_cross_entropy falls back to eager under "
                        "torch.compile, perfrun's own chunked loss compiles whole"),),
        torch=(Code("module", _chunked, when=_is("loss.name", "chunked"),
                    scope="torch's chunked F.linear_cross_entropy falls back to eager under torch.compile; perfrun's "
                    "own chunked loss (perfrun/models/losses.py) compiles whole"),),
        on=_is("loss.name", "chunked"),
    ),
    Translation(
        "distributed",
        hf=(Missing("launch the script with torchrun (DDP); FSDP through TrainingArguments' fsdp and fsdp_config",
                    when=lambda c: c.get("distributed") != "none"),),
        lightning=(Arg("Trainer", "strategy", _v("distributed"), when=lambda c: c.get("distributed") != "none"),),
        torch=(Missing("wrap the model in DistributedDataParallel or fully_shard and launch with torchrun",
                       when=lambda c: c.get("distributed") != "none"),),
        on=lambda c: c.get("distributed") != "none",
    ),
    Translation(
        "nproc",
        hf=(Missing("one process per GPU is torchrun's --nproc_per_node, not an argument",
                    when=lambda c: int(c.get("nproc") or 1) > 1),),
        lightning=(Arg("Trainer", "devices", _v("nproc")),),
        torch=(Missing("one process per GPU is torchrun's --nproc_per_node", when=lambda c: int(c.get("nproc") or 1) > 1),),
        on=lambda c: False,
    ),
    Translation(
        "device",
        hf=(Arg("TrainingArguments", "use_cpu", lambda c: True, when=lambda c: c.get("device_type") == "cpu"),),
        lightning=(Arg("Trainer", "accelerator", lambda c: "gpu" if _cuda(c) else "cpu"),),
        torch=(),  # the snippet's DEVICE
        on=lambda c: False,
    ),
)
