"""``model=hf model.path=FOLDER``: any causal LM transformers' ``AutoModelForCausalLM`` knows,
from a Hugging Face folder, trained and measured like perfrun's own families.

The folder holds ``config.json`` and, where it has them, safetensors weights
(``model.safetensors``, or shards with ``model.safetensors.index.json``). ``model.init``:
``auto`` loads the weights where the folder has them and starts from the config's random
initialisation where it has none (the log says which); ``pretrained`` requires them;
``random`` ignores them. Nothing is downloaded (``local_files_only``) and no code from the
folder runs: a config with ``auto_map`` (a model that needs ``trust_remote_code``) is refused,
and so are pickled weights (``*.bin``, ``*.pt``), which ``torch.load`` could run code from.

:class:`HFCausalLM` wraps the transformers model so that it meets perfrun's contract
(:mod:`perfrun.models.contract`): its decoder layers are ``blocks`` (activation
checkpointing, per-block compile and FSDP2 wrap them), its ``lm_head`` and final hidden
states feed ``loss_fn`` (``loss=chunked`` swaps it) where the architecture's head is a plain
matmul, ``attention=sdpa|eager`` reaches the layers through transformers'
``attn_implementation``, and ``flops_per_token`` is a formula read off the config's shapes.
transformers is an extra: ``pip install -e ".[hf]"``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from perfrun.config import ConfigError
from perfrun.console import first_line
from perfrun.model_schema import ModelConfig
from perfrun.models.hf_layout import folder_config
from perfrun.models.losses import LossFn, standard_linear_cross_entropy

INSTALL = 'pip install -e ".[hf]"'
SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
INITS = ("auto", "pretrained", "random")
# the tokenizer files an export copies from the model's folder (JSON and plain text: no code)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
# transformers' attention implementations perfrun's attention= maps to
ATTENTION = {"sdpa": "sdpa", "eager": "eager"}
# config keys that change the logits after the head's matmul: the loss then goes through the
# architecture's own forward, and loss=chunked (a plain matmul + cross-entropy) cannot act
HEAD_CHANGERS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
# config keys of a mixture of experts: only the routed experts run, so 6 x parameters overcounts
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def transformers_module() -> Any:
    """transformers, or one line naming the command that installs it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model=hf needs the transformers package, which is not installed; {INSTALL}") from None
    return transformers


def read_config_json(folder: Path, shown: str) -> dict[str, Any]:
    """The folder's config.json as plain JSON (read before transformers sees the folder, so a
    config that names code to run is refused before anything imports it)."""
    raw = folder_config(folder, shown, wanted="a Hugging Face model folder (config.json, and model.safetensors for its weights)",
                        no_config="has no config.json; give a folder written by save_pretrained (or perfrun export "
                                  "format=safetensors)")
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ConfigError(f"{shown}: config.json has no model_type; give a folder written by save_pretrained")
    if raw.get("auto_map"):
        raise ConfigError(f"{shown}: config.json's auto_map names code in the folder ({raw['model_type']} needs "
                          "trust_remote_code), which perfrun never runs; use an architecture transformers ships, "
                          "or wrap your code as model=custom")
    return raw


def hf_config(folder: Path, shown: str, attention: str) -> Any:
    """transformers' config of the folder, its attention set to ``attention``; refused in one
    line where transformers does not know the architecture as a causal LM."""
    raw = read_config_json(folder, shown)
    tf = transformers_module()
    try:
        config = tf.AutoConfig.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"{shown}: transformers {tf.__version__} cannot read config.json (model_type "
                          f"{raw['model_type']}: {first_line(e)}); upgrade transformers or give another folder") from None
    if type(config) not in tf.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(f"{shown}: model_type {raw['model_type']} is not a causal LM transformers' "
                          "AutoModelForCausalLM builds; give a decoder LM's folder (Llama, Qwen2, Mistral, Gemma, GPT-2...)")
    return config


def weights_in(folder: Path, shown: str, init: str) -> Path | None:
    """The safetensors file (or shard index) to load, None for a random start; pickled weights
    and a missing file under init=pretrained refused in one line."""
    if init == "random":
        return None
    found = next((folder / name for name in SAFETENSORS if (folder / name).is_file()), None)
    if found is not None:
        return found
    pickled = sorted(p.name for pattern in PICKLED for p in folder.glob(pattern))
    if pickled:
        raise ConfigError(f"{shown} holds pickled weights ({', '.join(pickled[:3])}), which could run code when "
                          "loaded; convert them to safetensors (save_pretrained(folder, safe_serialization=True)), "
                          "or start from random weights with model.init=random")
    if init == "pretrained":
        raise ConfigError(f"{shown} has no model.safetensors (or its shard index) and model.init=pretrained asks for "
                          "its weights; give a folder with them, or model.init=random")
    return None


def decoder_layers(lm: nn.Module, n_layer: int) -> nn.ModuleList | None:
    """The architecture's stack of decoder layers: the ModuleList of ``n_layer`` entries in its
    base model (``model.layers`` in Llama's layout, ``transformer.h`` in GPT-2's), a direct
    child first, else the one such list deeper down; None where there is no single one."""
    base = getattr(lm, "base_model", lm)
    for candidates in (base.children(), base.modules()):
        stacks = [m for m in candidates if isinstance(m, nn.ModuleList) and len(m) == n_layer]
        if len(stacks) == 1:
            return stacks[0]
    return None


@dataclass
class HFShape:
    """The shape a checkpoint records (perfrun.checkpoint.files.SHAPE_KEYS), the attention
    the layers use, and what the summary names: read from transformers' config."""

    architecture: str
    model_type: str
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    head_dim: int
    block_size: int  # the positions the architecture has (max_position_embeddings)
    vocab_size: int
    attention: str
    experts: bool

    @classmethod
    def of(cls, config: Any, attention: str) -> HFShape:
        get = config.get_text_config() if hasattr(config, "get_text_config") else config
        n_head = int(get.num_attention_heads)
        n_embd = int(get.hidden_size)
        head_dim = int(getattr(get, "head_dim", None) or n_embd // n_head)
        positions = getattr(get, "max_position_embeddings", None) or getattr(get, "n_positions", None) or 0
        arch = (config.architectures or [type(config).__name__.replace("Config", "ForCausalLM")])[0]
        return cls(arch, str(config.model_type), int(get.num_hidden_layers), n_head,
                   int(getattr(get, "num_key_value_heads", None) or n_head), n_embd, head_dim, int(positions),
                   int(get.vocab_size), attention, any(getattr(get, k, None) for k in EXPERT_KEYS))


class HFCausalLM(nn.Module):
    """A transformers causal LM behind perfrun's contract: ``forward(idx, targets)``,
    ``blocks``, ``lm_head`` + ``loss_fn`` where the head is a plain matmul, a FLOPs formula."""

    def __init__(self, lm: nn.Module, attention: str, weights: str | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.weights = weights  # the file the weights came from; None: the config's random initialisation
        self.config = HFShape.of(lm.config, attention)
        self.loss_fn: LossFn = standard_linear_cross_entropy
        self._plain_head = _plain_head(lm)

    @property
    def architecture_class(self) -> type:
        """transformers' class, which the summary and the report name."""
        return type(self.lm)

    @property
    def blocks(self) -> nn.ModuleList | None:
        """The decoder layers, the transformers model's own ModuleList (not registered twice:
        the state dict keeps transformers' names)."""
        return decoder_layers(self.lm, self.config.n_layer)

    @property
    def lm_head(self) -> nn.Linear | None:
        """The output head where the logits are ``hidden @ weight.T`` and nothing more."""
        return self.lm.get_output_embeddings() if self._plain_head else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor | None, Any]:
        """(logits, None) without targets; (None, loss) with them, the loss through ``loss_fn``
        on the final hidden states and the head's weight where the head is a plain matmul."""
        if self._plain_head:
            hidden = self.lm.base_model(input_ids=idx, use_cache=False).last_hidden_state
            head = self.lm.get_output_embeddings()
            if targets is None:
                return head(hidden), None
            return None, self.loss_fn(hidden, head.weight, targets)
        logits = self.lm(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits, None
        return None, nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.reshape(-1), ignore_index=-1)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters (tied ones once); the input and position embeddings (lookups, not
        matmuls) left out of the non-embedding count unless tied to the head."""
        total = sum(p.numel() for p in self.parameters())
        if not non_embedding:
            return total
        head = self.lm.get_output_embeddings()
        head_weight = getattr(head, "weight", None)
        lookups = {id(m.weight): m.weight.numel() for m in self.lm.modules()
                   if isinstance(m, nn.Embedding) and m.weight is not head_weight}
        return total - sum(lookups.values())

    def matmul_params(self) -> int:
        """The weights that multiply every token: each layer's projections and the head."""
        head = self.lm.get_output_embeddings()
        seen: set[int] = set()
        n = 0
        for m in [*self.lm.modules(), head]:
            w = getattr(m, "weight", None)
            if isinstance(m, nn.Embedding) and m is not head or not isinstance(w, torch.Tensor) or w.dim() != 2:
                continue
            if id(w) not in seen:
                seen.add(id(w))
                n += w.numel()
        return n

    def flops_per_token(self, seq_len: int) -> int | None:
        """Training FLOPs per token: 6 x the matmul weights + 12 x L x n_head x head_dim x T
        (the score and value matmuls, forward and backward, as perfrun's families count them).
        None for a mixture of experts, whose tokens run only their routed experts: counted then."""
        if self.config.experts:
            return None
        c = self.config
        return 6 * self.matmul_params() + 12 * c.n_layer * c.n_head * c.head_dim * seq_len


def _plain_head(lm: nn.Module) -> bool:
    head = lm.get_output_embeddings()
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    changed = [k for k in HEAD_CHANGERS if getattr(config, k, None) not in (None, 1, 1.0)]
    return isinstance(head, nn.Linear) and head.bias is None and not changed and \
        getattr(lm, "base_model", lm) is not lm


def build_hf(m: ModelConfig, vocab_size: int, attention: str) -> HFCausalLM:
    """The folder's model on the current default device, its weights loaded where asked
    (model.init); the data's ids must fit the folder's vocabulary."""
    folder = Path(str(m.path)).expanduser()
    shown = f"model.path={m.path}"
    config = hf_config(folder, shown, attention)
    shape = HFShape.of(config, attention)
    if vocab_size > shape.vocab_size:
        raise ConfigError(f"the data has {vocab_size} token ids but {shown} has a vocabulary of {shape.vocab_size}; "
                          "train it on data of its own tokenizer (data.tokenizer=FOLDER/tokenizer.json) or a smaller "
                          "data.vocab_size")
    if shape.block_size and m.block_size > shape.block_size:
        raise ConfigError(f"model.block_size={m.block_size} is longer than the {shape.block_size} positions of "
                          f"{shown}; set model.block_size<={shape.block_size}")
    tf = transformers_module()
    weights = weights_in(folder, shown, m.init)
    on_meta = torch.empty(0).device.type == "meta"
    implementation = ATTENTION[attention]
    bars = tf.utils.logging.is_progress_bar_enabled()
    tf.utils.logging.disable_progress_bar()  # transformers' loading bar would cut into perfrun's log
    try:
        if weights is None or on_meta:
            lm = tf.AutoModelForCausalLM.from_config(config, attn_implementation=implementation, dtype=torch.float32)
        else:
            lm = tf.AutoModelForCausalLM.from_pretrained(
                str(folder), config=config, attn_implementation=implementation, dtype=torch.float32,
                local_files_only=True, trust_remote_code=False, use_safetensors=True)
    finally:
        if bars:
            tf.utils.logging.enable_progress_bar()
    lm.train()
    return HFCausalLM(lm, attention, None if weights is None else str(weights))


def describe(model: HFCausalLM) -> str:
    """The log's line: the architecture, its shape and where its weights came from."""
    c = model.config
    start = f"weights from {model.weights}" if model.weights else "random initialisation from config.json"
    return (f"model=hf: {c.architecture} ({c.model_type}), {c.n_layer} layers, {c.n_embd} wide, {c.n_head} heads "
            f"({c.n_kv_head} key/value), vocabulary {c.vocab_size}, attention {c.attention}; {start}")


def export_hf(model: HFCausalLM, out: Path, folder: Path | None, meta: dict[str, str]) -> list[Path]:
    """The trained model as a Hugging Face folder (transformers' ``save_pretrained``,
    safetensors) with the source folder's tokenizer files: written into a new folder beside
    ``out`` and moved into it file by file, so a failed write leaves ``out`` as it was."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file; format=safetensors writes a folder (config.json + model.safetensors)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model.lm.save_pretrained(staging, safe_serialization=True, metadata={"format": "pt", **meta})
        for name in TOKENIZER_FILES:
            if folder is not None and (folder / name).is_file():
                shutil.copyfile(folder / name, staging / name)
        out.mkdir(exist_ok=True)
        written = []
        for f in sorted(staging.iterdir()):
            os.replace(f, out / f.name)
            written.append(out / f.name)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
