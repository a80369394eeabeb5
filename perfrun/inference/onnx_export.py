"""A model as ONNX, checked in onnxruntime before it is kept.

``torch.onnx.export(..., dynamo=True)``, the exporter that is current in torch 2.9+ (the
TorchScript one, ``dynamo=False``, warns that it is deprecated); it needs onnxscript.
Batch and sequence axes are dynamic (sequence up to ``block_size``: positions are learned).
The file is written into a scratch folder beside the target, loaded in onnxruntime and
compared with the PyTorch model's logits on shapes other than the one it was traced with;
only if the max absolute difference is within ``atol`` is it copied to its final name
(all or nothing, :func:`perfrun.checkpoint.atomic.atomic_write`). Otherwise :class:`OnnxMismatch` is
raised and nothing is written: a bad export never lands where a user would pick it up.
The default atol, 1e-4, is on fp32 logits: both runtimes compute in fp32 and differ only
by the order of floating-point sums (about 1e-7 on the tiny model, growing with depth).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from perfrun.checkpoint.atomic import atomic_write
from perfrun.config import ConfigError
from perfrun.models.gpt import GPT

DEFAULT_ATOL = 1e-4
ONNX_LIMIT = 2**31 - 1  # protobuf's 2 GiB limit on one file


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


class OnnxMismatch(Exception):
    """The exported graph computes other logits than the model: nothing was written."""

    def __init__(self, check: OnnxCheck) -> None:
        super().__init__(f"the ONNX model's logits differ from PyTorch's by up to {check.max_abs_diff:.3g}")
        self.check = check


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


def _trace(model: GPT, path: Path, vocab_size: int, opset: int) -> None:
    """torch.onnx.export into ``path``, its progress chatter silenced."""
    T = model.config.block_size
    example = torch.randint(0, vocab_size, (2, min(T, 8)))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=T)
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                LogitsOnly(model), (example,), str(path), dynamo=True, external_data=False,
                input_names=["idx"], output_names=["logits"], opset_version=opset,
                dynamic_shapes={"idx": {0: batch, 1: seq}}, verbose=False,
            )
    finally:
        quiet.setLevel(level)


def export_onnx(model: GPT, out: Path, vocab_size: int, *, atol: float = DEFAULT_ATOL, opset: int = 18) -> OnnxCheck:
    """Export with dynamic (batch, seq) axes, verify in onnxruntime, then write ``out``."""
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
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent) as scratch:
        traced = Path(scratch) / "model.onnx"
        _trace(model, traced, vocab_size, opset)
        check = verify_onnx(traced, model, vocab_size, atol)
        if not check.ok:
            raise OnnxMismatch(check)
        with traced.open("rb") as src:
            atomic_write(out, lambda dst: shutil.copyfileobj(src, dst))
    return check
