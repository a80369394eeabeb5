"""Atomic, safe-to-load training checkpoints and what exact resume needs from them.

A checkpoint holds only tensors, numbers, strings, lists and dicts, so it loads with
``torch.load(weights_only=True)``: a checkpoint from a stranger cannot run code. It is
written through :func:`perfrun.atomic.atomic_write`: a crash (even ``kill -9``) mid-write
never leaves a half file where a good one was.
"""

from __future__ import annotations

import errno
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from perfrun import __version__
from perfrun.atomic import atomic_write
from perfrun.config import ConfigError

FORMAT = 1
_NAME = re.compile(r"^step_(\d+)\.pt$")
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")


class CheckpointWriteError(RuntimeError):
    """Saving failed (disk full, unwritable folder); the previous checkpoint is intact."""


def capture_rng() -> dict[str, Any]:
    """Every random generator a step can draw from, as plain tensors and numbers."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(saved)


def save(folder: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write ``step_NNNNNNN.pt`` atomically into ``folder``; keep the newest ``keep_last``."""
    folder = Path(folder)
    final = folder / f"step_{step:07d}.pt"
    payload = {"format": FORMAT, "perfrun_version": __version__, "step": step, **state}
    try:
        atomic_write(final, lambda f: torch.save(payload, f))
    except OSError as e:
        why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        previous = list_checkpoints(folder)
        kept = f"the previous checkpoint {previous[-1].name} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointWriteError(
            f"could not save the checkpoint for step {step} in {folder}: {why}; free space or set "
            f"checkpoint.dir to a writable folder ({kept})"
        ) from None
    for old in list_checkpoints(folder)[:-keep_last]:
        old.unlink(missing_ok=True)
    return final


def check_writable(folder: Path) -> None:
    """Fail at setup, not after hours of training, when checkpoints cannot be written."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ConfigError(
            f"checkpoint.dir={folder} is not writable ({e.strerror or e}); set checkpoint.dir to a writable folder"
        ) from None


def list_checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in ``folder``, oldest first (temporary files are ignored)."""
    if not Path(folder).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(folder).iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load(path: Path) -> dict[str, Any]:
    """Load onto the CPU (so resuming cannot run the GPU out of memory), code-free."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"resume={path}: no such checkpoint file; give a step_*.pt file, a folder of them, or resume=auto")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"resume={path} is not a readable perfrun checkpoint (truncated, corrupt or another kind of file: "
            f"{first[:120]}); pick another step_*.pt from that folder"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT or "model" not in ckpt:
        raise ConfigError(f"resume={path} is not a perfrun checkpoint (format {FORMAT}); pick a step_*.pt that perfrun wrote")
    return ckpt


def resolve(spec: str, ckpt_dir: Path | None) -> Path | None:
    """``resume=auto``: the newest checkpoint in this run's checkpoint folder (a run
    started again with the same ``hydra.run.dir``, or ``checkpoint.dir``); None when there
    is none, and the run starts fresh and says so. It never looks into other runs: a
    sweep's job must not pick up a sibling's weights. Any other value is a checkpoint
    file or a folder of them."""
    if spec != "auto":
        p = Path(spec).expanduser()
        if p.is_dir():
            found = list_checkpoints(p) or list_checkpoints(p / "checkpoints")
            if not found:
                raise ConfigError(f"resume={spec}: the folder holds no step_*.pt checkpoint; give a checkpoint file or resume=auto")
            return found[-1]
        return p
    found = list_checkpoints(ckpt_dir) if ckpt_dir is not None else []
    return found[-1] if found else None


# What must match for a resume to continue the same run exactly.
RESUME_KEYS = ("seed", "data.name", "data.path", "data.seq_len", "dataloader.batch_size", "accumulation.steps")


def _dotted(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree if tree != {} else None


def check_compatible(ckpt: dict[str, Any], shape: dict[str, int], config: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another model shape, or of another data order (seed, data,
    batch size, accumulation): resuming it could not continue the same run."""
    check_shape(ckpt, shape, path)
    saved = ckpt.get("config", {})
    diff = [f"{k}={_dotted(saved, k)} vs {_dotted(config, k)}" for k in RESUME_KEYS
            if _dotted(saved, k) != _dotted(config, k)]
    if diff:
        raise ConfigError(
            f"resume={path} was made with other settings ({', '.join(diff)}: checkpoint vs this run); "
            "resume with the checkpoint's values so that the data order continues exactly"
        )


def check_shape(ckpt: dict[str, Any], shape: dict[str, int], path: Path) -> None:
    saved = ckpt.get("model_shape", {})
    diff = [f"{k} {saved.get(k)} vs {shape[k]}" for k in SHAPE_KEYS if saved.get(k) != shape[k]]
    if diff:
        raise ConfigError(
            f"resume={path} was made with another model shape ({', '.join(diff)}: checkpoint vs this run); "
            "resume with the same model settings, or start fresh without resume"
        )
