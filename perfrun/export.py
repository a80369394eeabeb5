"""``perfrun export``: a checkpoint as ONNX (verified in onnxruntime) or as safetensors in
Hugging Face's GPT-2 layout (loadable by ``transformers.GPT2LMHeadModel.from_pretrained``).

ONNX: ``torch.onnx.export(..., dynamo=True)``, the exporter that is current in torch 2.9+
(the TorchScript one, ``dynamo=False``, warns that it is deprecated); it needs onnxscript.
Batch and sequence axes are dynamic (sequence up to ``block_size``: positions are learned).
The file is written to a temporary name, loaded in onnxruntime and compared with the
PyTorch model's logits on shapes other than the one it was traced with; only if the max
absolute difference is within ``atol`` is it renamed to its final name. Otherwise it is
deleted and the command exits 1: a bad export never lands where a user would pick it up.
The default atol, 1e-4, is on fp32 logits: both runtimes compute in fp32 and differ only
by the order of floating-point sums (about 1e-7 on the tiny model, growing with depth).

safetensors: the folder ``out`` gets ``model.safetensors`` and ``config.json``. GPT-2 in
``transformers`` keeps its projections in ``Conv1D``, which stores the weight as (in, out),
the transpose of ``nn.Linear``'s (out, in): c_attn, c_proj and c_fc weights are transposed.
``lm_head`` is tied to ``wte`` and is not written (``tie_word_embeddings=true``), as
transformers itself saves it. A model trained with ``model.bias=false`` gets zero biases,
which compute the same. Each file is written to a temporary name and renamed.

``format=int8-report`` measures dynamic int8 against float (see :mod:`perfrun.quantize`).
Needs: ``pip install 'perfrun[export]'`` (onnx, onnxscript, onnxruntime, safetensors).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from perfrun.config import ConfigError
from perfrun.model import GPT

USAGE = ("perfrun export checkpoint=PATH format=onnx|safetensors|int8-report [out=PATH] "
         "[atol=1e-4] [opset=18]")
FORMATS = ("onnx", "safetensors", "int8-report")
DEFAULT_ATOL = 1e-4
ONNX_LIMIT = 2**31 - 1  # protobuf's 2 GiB limit on one file
CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """A temporary path beside ``final``; renamed over it only if the block succeeds,
    deleted otherwise: readers see the old file or the complete new one, never half."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make the export private
        os.replace(tmp, final)
    finally:
        Path(tmp).unlink(missing_ok=True)


# --------------------------------------------------------------------------- Hugging Face layout


def hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """perfrun's weights under GPT-2's names in transformers (Conv1D weights transposed,
    lm_head left out: it is tied to wte)."""
    c = model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": sd["wte.weight"],
        "transformer.wpe.weight": sd["wpe.weight"],
    }

    def put(src: str, dst: str, *, transpose: bool = False, size: int | None = None) -> None:
        if src in sd:
            t = sd[src]
            out[dst] = t.t() if transpose else t
        else:  # model.bias=false: transformers always has biases; zeros compute the same
            out[dst] = torch.zeros(size or c.n_embd, dtype=sd["wte.weight"].dtype)

    for i in range(c.n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            put(p + ln + ".weight", h + ln + ".weight")
            put(p + ln + ".bias", h + ln + ".bias")
        for name in CONV1D:
            w = sd[p + name + ".weight"]
            put(p + name + ".weight", h + name + ".weight", transpose=True)
            put(p + name + ".bias", h + name + ".bias", size=w.size(0))
    put("ln_f.weight", "transformer.ln_f.weight")
    put("ln_f.bias", "transformer.ln_f.bias")
    return {k: v.contiguous() for k, v in out.items()}


def perfrun_state_dict(hf: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_state_dict` (with lm_head re-tied to wte)."""
    sd = {"wte.weight": hf["transformer.wte.weight"], "wpe.weight": hf["transformer.wpe.weight"],
          "ln_f.weight": hf["transformer.ln_f.weight"], "ln_f.bias": hf["transformer.ln_f.bias"]}
    for i in range(n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            for kind in ("weight", "bias"):
                sd[f"{p}{ln}.{kind}"] = hf[f"{h}{ln}.{kind}"]
        for name in CONV1D:
            sd[f"{p}{name}.weight"] = hf[f"{h}{name}.weight"].t().contiguous()
            sd[f"{p}{name}.bias"] = hf[f"{h}{name}.bias"]
    sd["lm_head.weight"] = sd["wte.weight"]
    return sd


def hf_config(model: GPT, vocab_size: int) -> dict[str, Any]:
    """GPT2Config's fields for this model. GELU(tanh) is GPT-2's ``gelu_new``; LayerNorm's
    eps is torch's default 1e-5, as in GPT-2. Byte-level models have no BOS/EOS token."""
    c = model.config
    byte_level = vocab_size <= 256
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.block_size,
        "n_ctx": c.block_size,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": None if byte_level else 50256,
        "eos_token_id": None if byte_level else 50256,
        "torch_dtype": "float32",
        "perfrun_real_vocab_size": vocab_size,
    }


def export_safetensors(model: GPT, out: Path, vocab_size: int, meta: dict[str, str]) -> list[Path]:
    """Write ``out/model.safetensors`` and ``out/config.json`` (each atomically)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise ConfigError("format=safetensors needs the safetensors package; pip install 'perfrun[export]'") from None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"out={out} is a file; format=safetensors writes a folder (model.safetensors + config.json)")
    files = [out / "model.safetensors", out / "config.json"]
    with atomic_path(files[0]) as tmp:
        save_file(hf_state_dict(model), str(tmp), metadata={"format": "pt", **meta})
    with atomic_path(files[1]) as tmp:
        tmp.write_text(json.dumps(hf_config(model, vocab_size), indent=2) + "\n")
    return files


# --------------------------------------------------------------------------- ONNX


class LogitsOnly(nn.Module):
    """The graph users want: token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]


@dataclass
class OnnxCheck:
    """onnxruntime vs PyTorch on a few shapes."""

    max_abs_diff: float
    atol: float
    shapes: list[tuple[int, int]]

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.atol


def verify_onnx(path: Path, model: GPT, vocab_size: int, atol: float, seed: int = 0) -> OnnxCheck:
    """Run the file in onnxruntime on shapes unlike the traced one (a dynamic axis that was
    silently fixed fails here) and compare logits with the PyTorch model."""
    import numpy as np
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    T = model.config.block_size
    shapes = sorted({(1, 1), (3, T), (2, max(1, T // 2 + 1))})
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.no_grad():
        for b, t in shapes:
            x = torch.randint(0, vocab_size, (b, t), generator=g)
            ref = model(x)[0].float().numpy()
            got = sess.run(None, {name: x.numpy()})[0]
            if got.shape != ref.shape:
                return OnnxCheck(float("inf"), atol, shapes)
            worst = max(worst, float(np.abs(got - ref).max()))
    return OnnxCheck(worst, atol, shapes)


def export_onnx(model: GPT, out: Path, vocab_size: int, *, atol: float = DEFAULT_ATOL, opset: int = 18) -> OnnxCheck:
    """Export with dynamic (batch, seq) axes, verify in onnxruntime, then rename into place."""
    import logging
    import warnings

    for mod in ("onnxscript", "onnxruntime", "onnx"):
        try:
            __import__(mod)
        except ImportError:
            raise ConfigError(f"format=onnx needs {mod}; pip install 'perfrun[export]'") from None
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if size > ONNX_LIMIT:
        raise ConfigError(f"the model's weights are {size / 2**30:.1f} GiB, over ONNX's 2 GiB single-file limit; "
                          "use format=safetensors")
    model = model.eval().float()
    T = model.config.block_size
    example = torch.randint(0, vocab_size, (2, min(T, 8)))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=T)
    check: OnnxCheck | None = None
    with atomic_path(out) as tmp:
        onnx_tmp = tmp.with_suffix(".onnx")  # onnx wants the suffix; same folder, still hidden
        try:
            quiet = logging.getLogger("torch.onnx")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    LogitsOnly(model), (example,), str(onnx_tmp), dynamo=True, external_data=False,
                    input_names=["idx"], output_names=["logits"], opset_version=opset,
                    dynamic_shapes={"idx": {0: batch, 1: seq}}, verbose=False,
                )
            quiet.setLevel(level)
            check = verify_onnx(onnx_tmp, model, vocab_size, atol)
            if not check.ok:
                raise _Mismatch(check)
            os.replace(onnx_tmp, tmp)
        finally:
            onnx_tmp.unlink(missing_ok=True)
    assert check is not None
    return check


class _Mismatch(Exception):
    def __init__(self, check: OnnxCheck) -> None:
        super().__init__("onnx mismatch")
        self.check = check


# --------------------------------------------------------------------------- command


def _default_out(ckpt: Path, fmt: str) -> Path:
    """<run dir>/export/step_NNNNNNN.onnx or .../step_NNNNNNN-hf/ beside the checkpoints folder."""
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run_dir / "export" / (f"{ckpt.stem}.onnx" if fmt == "onnx" else f"{ckpt.stem}-hf")


def main(argv: list[str]) -> int:
    """0 written (and verified), 1 verification failed (nothing written), 2 a user's mistake."""
    from rich.console import Console

    from perfrun.console import error as _error
    from perfrun.generate import _float, _int, load_model, parse_kv

    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE}")
        return 0
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        kv = parse_kv(argv, {"checkpoint", "format", "out", "atol", "opset"}, USAGE)
        if not kv.get("checkpoint"):
            raise ConfigError(f"checkpoint=PATH is required; usage: {USAGE}")
        fmt = kv.get("format", "")
        if fmt not in FORMATS:
            raise ConfigError(f"format={fmt} is not an option; choose one of {', '.join(FORMATS)}")
        if fmt == "int8-report":
            from perfrun.quantize import main as quantize_main

            if set(kv) - {"checkpoint", "format"}:
                raise ConfigError("format=int8-report takes only checkpoint=; python -m perfrun.quantize has its options")
            return quantize_main([f"checkpoint={kv['checkpoint']}"])
        atol = _float("atol", kv.get("atol", str(DEFAULT_ATOL)))
        if not atol > 0:
            raise ConfigError(f"atol={atol} must be > 0; e.g. atol={DEFAULT_ATOL}")
        opset = _int("opset", kv.get("opset", "18"))
        loaded = load_model(Path(kv["checkpoint"]).expanduser(), "cpu", byte_level=False)
        out = Path(kv["out"]).expanduser() if kv.get("out") else _default_out(loaded.path, fmt)
        if fmt == "onnx":
            if out.is_dir():
                raise ConfigError(f"out={out} is a folder; give a file name such as out={out / 'model.onnx'}")
            try:
                check = export_onnx(loaded.model, out, loaded.vocab_size, atol=atol, opset=opset)
            except _Mismatch as e:
                _error(f"the ONNX model's logits differ from PyTorch's by up to {e.check.max_abs_diff:.3g} "
                       f"(tolerance {e.check.atol:g}) on shapes {e.check.shapes}; nothing was written. "
                       "Try another opset=, or report it with the torch and onnxruntime versions")
                return 1
            console.print(f"wrote {out} ({out.stat().st_size:,} bytes; dynamic batch and seq <= "
                          f"{loaded.model.config.block_size}); onnxruntime vs PyTorch on {check.shapes}: "
                          f"max abs diff {check.max_abs_diff:.3g} (tolerance {check.atol:g})")
        else:
            meta = {"perfrun_checkpoint": str(loaded.path), "perfrun_step": str(loaded.step)}
            files = export_safetensors(loaded.model, out, loaded.vocab_size, meta)
            console.print(f"wrote {files[0]} and {files[1]} (Hugging Face GPT-2 layout: "
                          "transformers.GPT2LMHeadModel.from_pretrained(folder))")
    except ConfigError as e:
        _error(str(e))
        return 2
    except OSError as e:
        _error(f"cannot write the export: {e.strerror or e} ({getattr(e, 'filename', '')}); choose a writable out=")
        return 2
    return 0
