"""``perfrun export``: a checkpoint as ONNX (verified in onnxruntime), as safetensors in
Hugging Face's GPT-2 or Llama layout (loadable by transformers' ``from_pretrained``),
or measured as dynamic int8 against float (``format=int8-report``).

A Hydra app over :class:`ExportConfig` (``perfrun export --help`` lists every key); the
formats are written by :mod:`perfrun.inference.onnx_export`,
:mod:`perfrun.models.hf_layout` and :mod:`perfrun.inference.int8`.
Needs: ``pip install 'perfrun[export]'`` (onnx, onnxscript, onnxruntime, safetensors), and
``perfrun[int8]`` (torchao) for the int8 report.
"""

from __future__ import annotations

import errno
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from perfrun.checkpoint.atomic import write_json
from perfrun.commands.hydra_app import HydraCommand
from perfrun.config import ConfigError
from perfrun.console import error, stderr_console
from perfrun.inference.loading import load_model
from perfrun.inference.onnx_export import DEFAULT_ATOL, OnnxMismatch, export_onnx
from perfrun.models.hf import HFCausalLM, export_hf
from perfrun.models.hf_layout import export_safetensors

FORMATS = ("onnx", "safetensors", "int8-report")


@dataclass
class Int8ReportOptions:
    """``format=int8-report``: how much to measure."""

    val_batches: int = field(default=4, metadata={"help": "int8-report: batches of the val split for the loss"})
    batch_size: int = field(default=4, metadata={"help": "int8-report: sequences per val batch"})
    gen_tokens: int = field(default=64, metadata={"help": "int8-report: tokens generated to time each model"})
    include_head: bool = field(default=False, metadata={
        "help": "int8-report: quantise lm_head too (it is tied to the embedding, so this unties it)"})
    json: bool = field(default=False, metadata={"help": "int8-report: print the report as JSON"})


@dataclass
class ExportDataConfig:
    """The user's own code for ``format=int8-report`` of a ``data=custom`` checkpoint: typed
    here, since a class a checkpoint records is never imported."""

    target: str | None = field(default=None, metadata={
        "help": "int8-report of a checkpoint trained on data=custom: your Dataset class (pkg.module.Class or "
                "path/to/file.py:Class), built with the checkpoint's data.args to rebuild its val split"})


@dataclass
class ExportConfig:
    """What one ``perfrun export`` asks for; :meth:`validate` checks what the types cannot."""

    checkpoint: str | None = field(default=None, metadata={
        "help": "a step_*.pt file, a sharded step_* folder, or a run folder (its newest checkpoint); required"})
    format: str | None = field(default=None, metadata={"help": f"{', '.join(FORMATS)}; required"})
    out: str | None = field(default=None, metadata={
        "help": "onnx: the file; safetensors: the folder; int8-report: a JSON file of the report (null: printed only); "
                "null: <run dir>/export/step_N.onnx or step_N-hf/"})
    atol: float = field(default=DEFAULT_ATOL, metadata={
        "help": "onnx: the largest absolute logit difference onnxruntime vs PyTorch that is accepted"})
    opset: int = field(default=18, metadata={"help": "onnx: the opset version"})
    int8: Int8ReportOptions = field(default_factory=Int8ReportOptions)
    data: ExportDataConfig = field(default_factory=ExportDataConfig)

    def validate(self) -> None:
        if not self.checkpoint:
            raise ConfigError("checkpoint=PATH is required; perfrun export --help lists the keys")
        if self.format not in FORMATS:
            raise ConfigError(f"format={self.format or ''} is not an option; choose one of {', '.join(FORMATS)}")
        if not self.atol > 0:
            raise ConfigError(f"atol={self.atol} must be > 0; e.g. atol={DEFAULT_ATOL}")
        for key in ("val_batches", "batch_size", "gen_tokens"):
            if getattr(self.int8, key) < 1:
                raise ConfigError(f"int8.{key}={getattr(self.int8, key)} must be >= 1")


def default_out(ckpt: Path, fmt: str) -> Path:
    """<run dir>/export/step_NNNNNNN.onnx or .../step_NNNNNNN-hf/ beside the checkpoints folder."""
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run_dir / "export" / (f"{ckpt.stem}.onnx" if fmt == "onnx" else f"{ckpt.stem}-hf")


def int8_report(cfg: ExportConfig) -> int:
    """Print the float-vs-int8 report; 1 when the int8 model's loss is not finite."""
    from perfrun.inference.int8 import int8_report as measure

    o = cfg.int8
    out = Path(cfg.out).expanduser() if cfg.out else None
    if out is not None and out.is_dir():
        raise ConfigError(f"out={out} is a folder; give the report's file name, such as out={out / 'int8-report.json'}")
    rep = measure(Path(cfg.checkpoint or "").expanduser(), val_batches=o.val_batches, batch_size=o.batch_size,
                  gen_tokens=o.gen_tokens, include_head=o.include_head, data_target=cfg.data.target)
    if o.json:
        print(json.dumps({**asdict(rep), "loss_rel_diff": rep.loss_rel_diff}, indent=1))
    else:
        print("\n".join(rep.lines()))
    if out is not None:  # the report as JSON, all or nothing
        write_json(out, {**asdict(rep), "loss_rel_diff": rep.loss_rel_diff})
        stderr_console().print(f"wrote {out} (the int8 report as JSON)", markup=False)
    return 0 if math.isfinite(rep.int8_val_loss) else 1


def write(cfg: ExportConfig) -> int:
    """ONNX or safetensors; 1 when the ONNX graph does not reproduce the model (nothing written)."""
    loaded = load_model(Path(cfg.checkpoint or "").expanduser(), "cpu")
    fmt = str(cfg.format)
    out = Path(cfg.out).expanduser() if cfg.out else default_out(loaded.path, fmt)
    console = stderr_console()
    if fmt == "onnx":
        if out.is_dir():
            raise ConfigError(f"out={out} is a folder; give a file name such as out={out / 'model.onnx'}")
        try:
            check = export_onnx(loaded.model, out, loaded.vocab_size, atol=cfg.atol, opset=cfg.opset)
        except OnnxMismatch as e:
            error(f"{e} (tolerance {e.check.atol:g}) on shapes {e.check.shapes}; nothing was written. "
                  "Try another opset=, or report it with the torch and onnxruntime versions")
            return 1
        console.print(f"wrote {out} ({out.stat().st_size:,} bytes; dynamic batch and seq <= "
                      f"{loaded.model.config.block_size}); onnxruntime vs PyTorch on {check.shapes}: "
                      f"max abs diff {check.max_abs_diff:.3g} (tolerance {check.atol:g})")
        return 0
    meta = {"perfrun_checkpoint": str(loaded.path), "perfrun_step": str(loaded.step)}
    if isinstance(loaded.model, HFCausalLM):  # model=hf: transformers writes its own layout
        folder = (loaded.config.get("model") or {}).get("path")
        files = export_hf(loaded.model, out, Path(str(folder)).expanduser() if folder else None, meta)
        console.print(f"wrote {out} ({', '.join(f.name for f in files)}): "
                      f"transformers.{loaded.model.architecture_class.__name__}.from_pretrained(folder)")
        return 0
    files = export_safetensors(loaded.model, out, loaded.vocab_size, meta)
    arch = json.loads(files[1].read_text())["architectures"][0]  # GPT2LMHeadModel or LlamaForCausalLM
    layout = "Llama" if arch.startswith("Llama") else "GPT-2"
    console.print(f"wrote {files[0]} and {files[1]} (Hugging Face {layout} layout: "
                  f"transformers.{arch}.from_pretrained(folder))")
    return 0


def run(cfg: ExportConfig) -> int:
    """The job: 0 written (and verified), 1 verification failed (nothing written), 2 a user's mistake."""
    try:
        cfg.validate()
        return int8_report(cfg) if cfg.format == "int8-report" else write(cfg)
    except ConfigError as e:
        error(str(e))
        return 2
    except OSError as e:
        if e.errno == errno.ENOSPC:
            error(f"cannot write the export to {e.filename or cfg.out or 'its default folder'}: the disk is full; "
                  "free space there or choose another out= on a disk with room")
        else:
            error(f"cannot write the export: {e.strerror or e} ({getattr(e, 'filename', '')}); choose a writable out=")
        return 2


COMMAND = HydraCommand("export", ExportConfig, run)


def main(argv: list[str]) -> int:
    """``perfrun export KEY=VALUE...``."""
    return COMMAND.main(argv)
