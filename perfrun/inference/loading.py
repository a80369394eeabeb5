"""A checkpoint into a model ready for inference: found, loaded, checked, rebuilt.

Loading goes through :mod:`perfrun.checkpoint.files` (its ``load`` and ``load_model_weights``),
which decides what a file may contain; this module only rebuilds the model (GPT or Llama,
by its recorded ``model.family``) that the checkpoint describes, checks that its weights are finite (a run that diverged leaves
NaN weights that would sample garbage without a word), and knows the checkpoint's
tokenizer: ``data.tokenizer`` in its config, ``byte`` when the key is absent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from perfrun.checkpoint import files as checkpoint
from perfrun.config import ConfigError
from perfrun.console import first_line
from perfrun.data.tokenizers import BYTE_VOCAB, Tokenizer, load_tokenizer
from perfrun.model_schema import ModelConfig
from perfrun.models.gpt import GPT, GPTConfig
from perfrun.models.hf import HFCausalLM, build_hf
from perfrun.models.llama import Llama, LlamaConfig

BYTE_SOURCES = ("pysource", "text")  # data= sources whose tokens are bytes unless a tokenizer is named


@dataclass
class Loaded:
    """A checkpoint's model, rebuilt in eval mode, and what inference needs to know of it."""

    model: GPT | Llama | HFCausalLM
    path: Path
    step: int
    vocab_size: int  # the real vocabulary: logits above it are padding, never sampled
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def data(self) -> dict[str, Any]:
        return self.config.get("data", {}) or {}

    @property
    def folder_tokenizer(self) -> Path | None:
        """model=hf: the folder's tokenizer.json, where it has one."""
        m = self.config.get("model", {}) or {}
        found = Path(str(m.get("path"))).expanduser() / "tokenizer.json" if m.get("family") == "hf" else None
        return found if found is not None and found.is_file() else None

    @property
    def tokenizer_spec(self) -> str:
        """The run's data.tokenizer; for model=hf trained without one, the folder's tokenizer.json."""
        given = self.data.get("tokenizer")
        if not given and self.folder_tokenizer is not None:
            return str(self.folder_tokenizer)
        return str(given or "byte")

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the model was trained with; refused with one line when its
        vocabulary is not the model's (text could not be turned into its ids or back)."""
        spec = self.tokenizer_spec
        try:
            tok = load_tokenizer(spec)
        except ConfigError as e:
            raise ConfigError(f"checkpoint={self.path} records data.tokenizer={spec}, which perfrun cannot load "
                              f"here ({e})") from None
        own = self.folder_tokenizer is not None and spec == str(self.folder_tokenizer)
        if (tok.vocab_size != self.vocab_size and not own) or tok.vocab_size > self.model.config.vocab_size:
            what = self.data.get("name", "?")
            kind = "bytes" if spec == "byte" else f"the {tok.vocab_size} of tokenizer {spec}"
            raise ConfigError(
                f"checkpoint={self.path} was trained on data={what} with a vocabulary of {self.vocab_size} token ids, "
                f"not {kind}; perfrun generate needs the model's own tokenizer (train with data=pysource or "
                "data=text), or export it (perfrun export format=safetensors) and sample with that vocabulary's tokenizer"
            )
        return tok


def resolve_checkpoint(spec: Path) -> Path:
    """A step_*.pt file or sharded step_* folder, or a run folder / checkpoints folder (its newest checkpoint)."""
    if checkpoint.is_sharded(spec):
        return spec
    if spec.is_dir():
        found = checkpoint.list_checkpoints(spec) or checkpoint.list_checkpoints(spec / "checkpoints")
        if not found:
            raise ConfigError(f"checkpoint={spec}: the folder holds no step_*.pt checkpoint; give a "
                              "checkpoint file or a run folder with a checkpoints/ folder")
        return found[-1]
    if not spec.is_file():
        raise ConfigError(f"checkpoint={spec}: no such file; give a step_*.pt written by perfrun train "
                          "(in <run dir>/checkpoints/) or a run folder")
    return spec


def real_vocab(config: dict[str, Any], padded: int) -> int:
    """The vocabulary the model was trained on (the embedding holds it padded to 64)."""
    data = config.get("data", {}) or {}
    if data.get("name") in BYTE_SOURCES and str(data.get("tokenizer") or "byte") == "byte":
        return BYTE_VOCAB
    return int(data.get("vocab_size") or padded)


def _as_checkpoint_error(e: ConfigError, path: Path) -> ConfigError:
    """checkpoint.py words its errors for resume=; here the user typed checkpoint=."""
    return ConfigError(str(e).replace(f"resume={path}", f"checkpoint={path}"))


def build_model(shape: dict[str, Any], config: dict[str, Any], path: Path | str = "the checkpoint") -> GPT | Llama | HFCausalLM:
    """The model the checkpoint describes: its shape, and its family's fields from the model
    group it recorded (a checkpoint written before the Llama family is a GPT); model=hf:
    the architecture of its folder's config.json (the checkpoint's weights replace the
    folder's, so none are read there)."""
    mcfg = config.get("model", {}) or {}
    if mcfg.get("family") == "hf":
        m = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), mcfg, {"init": "random"}))
        return build_hf(m, int(shape["vocab_size"]), str(config.get("attention", "sdpa")))
    if mcfg.get("family") == "custom":  # its class is never imported: no file names code that runs
        raise ConfigError(f"checkpoint={path} holds a custom model (model.target={mcfg.get('target')}); perfrun never "
                          "imports a class that a file names, and generate and export rebuild only the decoder LMs "
                          "perfrun builds (model=tiny, gpt2*, llama*): load your own model with your own code")
    attention = str(config.get("attention", "sdpa"))
    if mcfg.get("family", "gpt") == "llama":
        m = OmegaConf.merge(OmegaConf.structured(ModelConfig), mcfg, {k: shape[k] for k in checkpoint.SHAPE_KEYS
                                                                        if k != "vocab_size"}, {"dropout": 0.0})
        return Llama(LlamaConfig.from_model(m, int(shape["vocab_size"]), attention))
    return GPT(GPTConfig(
        vocab_size=int(shape["vocab_size"]), block_size=int(shape["block_size"]), n_layer=int(shape["n_layer"]),
        n_head=int(shape["n_head"]), n_embd=int(shape["n_embd"]), dropout=0.0,
        bias=bool(mcfg.get("bias", True)), attention=attention,
    ))


def check_finite(model: torch.nn.Module, path: Path) -> None:
    """Refuse weights holding NaN or infinity, naming the first such tensor."""
    for name, p in model.state_dict().items():
        if p.is_floating_point() and not bool(torch.isfinite(p).all()):
            raise ConfigError(
                f"checkpoint={path}: its weights are not finite ({name} holds NaN or infinity), so the model "
                "would only produce garbage; the run diverged before this step: pick an earlier checkpoint"
            )


def load_model(spec: Path, device: torch.device | str = "cpu") -> Loaded:
    """Load on the CPU first (checkpoint.load), rebuild the model from ``model_shape``, check the
    weights, then move the model to ``device``."""
    path = resolve_checkpoint(spec)
    try:
        ckpt = checkpoint.load(path)
    except ConfigError as e:
        raise _as_checkpoint_error(e, path) from None
    shape = ckpt.get("model_shape") or {}
    missing = [k for k in checkpoint.SHAPE_KEYS if k not in shape]
    if missing:
        raise ConfigError(f"checkpoint={path} has no model shape ({', '.join(missing)} missing); "
                          "it was written by an older perfrun, retrain or pick a newer checkpoint")
    config = ckpt.get("config") or {}
    model = build_model(shape, config, path)
    try:
        checkpoint.load_model_weights(ckpt, model)
    except ConfigError as e:  # unreadable shards
        raise _as_checkpoint_error(e, path) from None
    except RuntimeError as e:
        raise ConfigError(f"checkpoint={path}: its weights do not fit the model it describes ({first_line(e)}); "
                          "the file is damaged or hand-edited, pick another checkpoint") from None
    check_finite(model, path)
    model.eval().to(device)
    return Loaded(model, path, int(ckpt.get("step", 0)), real_vocab(config, int(shape["vocab_size"])), config)
