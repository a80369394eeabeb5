"""Atomic, safe-to-load training checkpoints and what exact resume needs from them.

A checkpoint holds only tensors, numbers, strings, lists and dicts, so it loads with
``torch.load(weights_only=True)``: a checkpoint from a stranger cannot run code. It is
written to a temporary file in the same folder, flushed and fsynced, then renamed over
the final name, so a crash (even ``kill -9``) mid-write never leaves a half file where
a good one was; the folder is fsynced too, so the rename itself survives a power cut.
"""

from __future__ import annotations

import errno
import os
import random
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from perfrun import __version__
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


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(folder: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write ``step_NNNNNNN.pt`` atomically into ``folder``; keep the newest ``keep_last``."""
    folder = Path(folder)
    final = folder / f"step_{step:07d}.pt"
    payload = {"format": FORMAT, "perfrun_version": __version__, "step": step, **state}
    tmp: str | None = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        tmp = None
        _fsync_dir(folder)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise CheckpointWriteError(
            f"could not save the checkpoint for step {step} in {folder}: {why}; free space or set "
            "checkpoint.dir to a writable folder (the previous checkpoint is intact)"
        ) from None
    for old in list_checkpoints(folder)[:-keep_last]:
        old.unlink(missing_ok=True)
    return final


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


def resolve(spec: str, run_dir: Path | None, ckpt_dir: Path | None) -> Path | None:
    """``resume=auto``: the newest checkpoint in this run's folder, else in the newest sibling
    run under the same outputs/ tree; None when there is none (the run starts fresh and
    says so). Any other value is a checkpoint file or a folder of them."""
    if spec != "auto":
        p = Path(spec).expanduser()
        if p.is_dir():
            found = list_checkpoints(p) or list_checkpoints(p / "checkpoints")
            if not found:
                raise ConfigError(f"resume={spec}: the folder holds no step_*.pt checkpoint; give a checkpoint file or resume=auto")
            return found[-1]
        return p
    if ckpt_dir is not None and (found := list_checkpoints(ckpt_dir)):
        return found[-1]
    if run_dir is None:
        return None
    outputs = run_dir.parent.parent  # outputs/DATE/TIME -> outputs
    candidates = [p for p in outputs.glob("*/*/checkpoints/step_*.pt") if _NAME.match(p.name)]
    if not candidates:
        return None
    return max(candidates, key=lambda p: (p.stat().st_mtime, p.name))


def check_shape(ckpt: dict[str, Any], shape: dict[str, int], path: Path) -> None:
    saved = ckpt.get("model_shape", {})
    diff = [f"{k} {saved.get(k)} vs {shape[k]}" for k in SHAPE_KEYS if saved.get(k) != shape[k]]
    if diff:
        raise ConfigError(
            f"resume={path} was made with another model shape ({', '.join(diff)}: checkpoint vs this run); "
            "resume with the same model settings, or start fresh without resume"
        )
