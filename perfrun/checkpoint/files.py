"""Atomic, safe-to-load training checkpoints and what exact resume needs from them.

A checkpoint holds only tensors, numbers, strings, lists and dicts, so it loads with
``torch.load(weights_only=True)``: a checkpoint from a stranger cannot run code. It is
written through :func:`perfrun.checkpoint.atomic.atomic_write`: a crash (even ``kill -9``) mid-write
never leaves a half file where a good one was.

Two layouts: ``step_NNNNNNN.pt``, one file written by rank 0 (one process, DDP), and
``step_NNNNNNN/``, a ``torch.distributed.checkpoint`` folder that every FSDP rank writes
its shards into, beside a ``meta.pt`` with the rest of the state. The folder is written
under a temporary name and renamed when complete, so it is as all-or-nothing as the file,
and it loads onto any number of ranks (DCP reshards), or into one plain model.
"""

from __future__ import annotations

import errno
import random
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from perfrun import __version__, distributed
from perfrun.checkpoint import safe_loading as safe_checkpoint
from perfrun.checkpoint.atomic import atomic_write, fsync_dir
from perfrun.checkpoint.names import META, is_sharded, list_checkpoints  # noqa: F401 - part of this module's API
from perfrun.config import ConfigError
from perfrun.console import first_line

FORMAT = 1
_PARTIAL = re.compile(r"^\.step_\d+(\.replaced)?\.partial$")
SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")
# what else sets a family's weights or numerics apart (the Llama family's), recorded where the model has it
ARCH_KEYS = ("n_kv_head", "intermediate_size", "rope_theta", "rope_scaling", "norm_eps", "tie_embeddings")


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
    except (OSError, RuntimeError) as e:  # torch.save's writer says a full disk as RuntimeError
        raise _write_error(folder, step, e) from None
    _prune(folder, keep_last)
    return final


def _prune(folder: Path, keep_last: int) -> None:
    for old in list_checkpoints(folder)[:-keep_last]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def dcp_reason(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (else ``e``)."""
    failures = getattr(e, "failures", None)
    if failures:
        first = failures[min(failures)]
        return first[0] if isinstance(first, tuple) else first
    return e


def _write_error(folder: Path, step: int, e: BaseException) -> CheckpointWriteError:
    e = dcp_reason(e)
    errnos = [e.errno] if isinstance(e, OSError) else []
    why = "the disk is full" if errno.ENOSPC in errnos else (getattr(e, "strerror", None) or first_line(e, 200))
    if isinstance(e, RuntimeError) and "write failed" in str(e):  # torch.save's writer hides the errno
        why = f"the file could not be written ({_free(folder)} free on that disk)"
    previous = list_checkpoints(folder)
    kept = f"the previous checkpoint {previous[-1].name} is intact" if previous else "no earlier checkpoint exists"
    return CheckpointWriteError(
        f"could not save the checkpoint for step {step} in {folder}: {why}; free space or set "
        f"checkpoint.dir to a writable folder ({kept})"
    )


def _free(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB"
    except OSError:
        return "unknown space"


def save_sharded(folder: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: dict[str, Any], keep_last: int) -> Path:
    """Every rank writes its shards of the model and optimizer (``torch.distributed.checkpoint``)
    into ``.step_NNNNNNN.partial/``; rank 0 adds ``meta.pt`` (``state``: schedule, RNG, data
    position, config) and renames the folder to ``step_NNNNNNN/``. A collective: all ranks call it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = Path(folder)
    final = folder / f"step_{step:07d}"
    partial = folder / f".{final.name}.partial"
    problem: str | None = None
    if distributed.rank() == 0:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            recover_interrupted_saves(folder)
        except OSError as e:
            problem = str(_write_error(folder, step, e))
    problem = distributed.from_rank0(problem)
    if problem is not None:
        raise CheckpointWriteError(problem)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    try:
        with warnings.catch_warnings():  # DCP's "assuming the intent is to save in a single process"
            warnings.filterwarnings("ignore", message=".*in a single process.*")
            dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(partial))
    except (CheckpointException, OSError) as e:  # DCP gathers every rank's failure (a BaseException)
        raise _write_error(folder, step, e) from None
    payload = {"format": FORMAT, "perfrun_version": __version__, "step": step, "sharded": True, **state}
    if distributed.rank() == 0:
        try:
            atomic_write(partial / META, lambda f: torch.save(payload, f))
            if final.exists():  # the same step saved before: set it aside only once the new one is whole
                replaced = folder / f".{final.name}.replaced.partial"
                final.rename(replaced)
                partial.rename(final)
                shutil.rmtree(replaced)
            else:
                partial.rename(final)
            fsync_dir(folder)
            _prune(folder, keep_last)
        except (OSError, RuntimeError) as e:  # torch.save's writer says a full disk as RuntimeError
            problem = str(_write_error(folder, step, e))
    problem = distributed.from_rank0(problem)  # a barrier: no rank runs ahead of the folder
    if problem is not None:
        raise CheckpointWriteError(problem)
    return final


def recover_interrupted_saves(folder: Path) -> None:
    """Finish or undo what a crash left of a sharded save (rank 0, before it saves or resumes).

    ``.step_N.partial/`` with ``meta.pt`` is a whole checkpoint cut off between writing and
    renaming: it becomes ``step_N/`` if that is missing. ``.step_N.replaced.partial/`` is the
    old ``step_N/``, set aside just before the new one took its name: it goes back if the new
    one never did. Anything else partial is a save cut short, and is removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    stale = sorted((p for p in folder.iterdir() if _PARTIAL.match(p.name)), key=lambda p: ".replaced" in p.name)
    for p in stale:  # the newer (.partial) before the older (.replaced.partial) of a step
        final = folder / p.name[1:].split(".")[0]
        if not final.exists() and (p / META).is_file():
            p.rename(final)
            fsync_dir(folder)
        else:
            shutil.rmtree(p, ignore_errors=True)


def load_sharded_into(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Read a sharded checkpoint into ``model`` (and ``optimizer``): FSDP on any number of
    ranks, DDP or one plain process alike (DCP reshards to whatever the model is now)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if optimizer is None:
        state = {"model": model.state_dict()}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
    with warnings.catch_warnings():  # DCP's "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*load in a single process.*")
        try:
            safe_checkpoint.dcp_load(state, path)
        except (CheckpointException, OSError, RuntimeError) as e:
            reason = dcp_reason(e)
            raise ConfigError(f"resume={path}: its shards cannot be read ({type(reason).__name__}: {first_line(reason)}); every "
                              "rank must see the whole folder (a shared filesystem); or pick another checkpoint") from None
    if optimizer is None:
        model.load_state_dict(state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


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


def load(path: Path) -> dict[str, Any]:
    """Load onto the CPU (so resuming cannot run the GPU out of memory), code-free."""
    path = Path(path)
    sharded = is_sharded(path)
    if not sharded and not path.is_file():
        raise ConfigError(f"resume={path}: no such checkpoint file; give a step_*.pt file, a folder of them, or resume=auto")
    try:
        ckpt = safe_checkpoint.load_pt(path / META if sharded else path)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same user-facing problem
        raise ConfigError(
            f"resume={path} is not a readable perfrun checkpoint (truncated, corrupt or another kind of file: "
            f"{first_line(e, 120)}); pick another step_*.pt from that folder"
        ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT or ("model" not in ckpt and not sharded):
        raise ConfigError(f"resume={path} is not a perfrun checkpoint (format {FORMAT}); pick a step_*.pt that perfrun wrote")
    _check_position(ckpt, path)
    if sharded:
        safe_checkpoint.verify_sharded(path)
        ckpt["sharded_path"] = str(path)
    return ckpt


def _check_position(ckpt: dict[str, Any], path: Path) -> None:
    """The step and data position are whole numbers >= 0: a loop cannot start anywhere else."""
    data = ckpt.get("data")
    fields = {"step": ckpt.get("step")}
    if isinstance(data, dict):
        fields.update({f"data.{k}": data.get(k) for k in ("epoch", "consumed")})
    else:
        fields["data"] = data
    bad = [f"{k}={v!r}" for k, v in fields.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if bad:
        raise ConfigError(f"resume={path} records an impossible position ({', '.join(bad)}: whole numbers >= 0 expected); "
                          "the checkpoint is damaged: pick another checkpoint or start without resume")


def load_model_weights(ckpt: dict[str, Any], model: torch.nn.Module) -> None:
    """The weights of a loaded checkpoint (either layout) into a plain model."""
    if ckpt.get("sharded_path"):
        load_sharded_into(Path(ckpt["sharded_path"]), model, None)
    else:
        model.load_state_dict(ckpt["model"])


def resolve(spec: str, ckpt_dir: Path | None) -> Path | None:
    """``resume=auto``: the newest checkpoint in this run's checkpoint folder (a run
    started again with the same ``hydra.run.dir``, or ``checkpoint.dir``); None when there
    is none, and the run starts fresh and says so. It never looks into other runs: a
    sweep's job must not pick up a sibling's weights. Any other value is a checkpoint
    file or a folder of them."""
    if spec != "auto":
        p = Path(spec).expanduser()
        if p.is_dir() and not is_sharded(p):
            found = list_checkpoints(p) or list_checkpoints(p / "checkpoints")
            if not found:
                raise ConfigError(f"resume={spec}: the folder holds no step_*.pt checkpoint; give a checkpoint file or resume=auto")
            return found[-1]
        return p
    found = list_checkpoints(ckpt_dir) if ckpt_dir is not None else []
    return found[-1] if found else None


# What must match for a resume to continue the same run exactly; and the global batch.
RESUME_KEYS = ("seed", "data.name", "data.path", "data.seq_len")


def _dotted(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part, {}) if isinstance(tree, dict) else {}
    return tree if tree != {} else None


def _global_batch(config: dict[str, Any], world: int) -> tuple[int, int, str]:
    """Sequences per optimizer step over all ranks, per micro-step over all ranks, and how."""
    b, a = int(_dotted(config, "dataloader.batch_size") or 0), int(_dotted(config, "accumulation.steps") or 1)
    return b * a * world, b * world, f"dataloader.batch_size={b} x accumulation.steps={a} x {world} rank(s)"


def saved_world(ckpt: dict[str, Any]) -> int:
    """How many ranks wrote the checkpoint. Checkpoints from before perfrun recorded it:
    within the first epoch the data position says (samples consumed / steps / per-rank
    batch); after it, the ``nproc`` the run was started with (1 under raw torchrun)."""
    if ckpt.get("world_size"):
        return int(ckpt["world_size"])
    config, data, step = ckpt.get("config", {}), ckpt.get("data", {}), int(ckpt.get("step", 0))
    per_rank = int(_dotted(config, "dataloader.batch_size") or 0) * int(_dotted(config, "accumulation.steps") or 1)
    consumed = int(data.get("consumed", 0))
    if data.get("epoch", 0) == 0 and step > 0 and per_rank > 0 and consumed % (step * per_rank) == 0:
        return max(1, consumed // (step * per_rank))
    return int(config.get("nproc") or 1)


def check_compatible(ckpt: dict[str, Any], shape: dict[str, Any], config: dict[str, Any], path: Path,
                     world: int = 1) -> list[str]:
    """Refuse a checkpoint of another model shape, of another data order (seed, data), or of
    another global batch: resuming it could not continue the same run. The global batch is
    what must match, not how it is split: 2 ranks x 4 continue as 1 process x 8, since the
    data order does not depend on the number of ranks (:class:`perfrun.data.ResumableSampler`).
    Returns the warnings for what is allowed but not exact."""
    saved = ckpt.get("config", {})
    check_targets(saved, config, path)
    check_shape(ckpt, shape, path)
    diff = [f"{k}={_dotted(saved, k)} vs {_dotted(config, k)}" for k in RESUME_KEYS
            if _dotted(saved, k) != _dotted(config, k)]
    if diff:
        raise ConfigError(
            f"resume={path} was made with other settings ({', '.join(diff)}: checkpoint vs this run); "
            "resume with the checkpoint's values so that the data order continues exactly"
        )
    (was, was_micro, was_how), (now, now_micro, now_how) = _global_batch(saved, saved_world(ckpt)), _global_batch(config, world)
    if was != now:
        per = int(_dotted(config, "accumulation.steps") or 1) * world
        fix = (f"set dataloader.batch_size={was // per}" if was % per == 0
               else "choose dataloader.batch_size and accumulation.steps whose product times the ranks is that")
        raise ConfigError(
            f"resume={path} was made with a global batch of {was} sequences per step ({was_how}) and this run "
            f"has {now} ({now_how}); keep the global batch so that the data order continues exactly: {fix}"
        )
    if was_micro != now_micro:
        return [f"resume={path}: the same global batch split another way ({was_how} then, {now_how} now): the data "
                f"order is the same until the end of this epoch, whose last partial batch is cut at a multiple of "
                f"{now_micro} sequences instead of {was_micro}, so later epochs see their samples shifted"]
    return []


USER_CODE_KEYS = ("model.target", "data.target")  # the user's own classes (perfrun/user_code.py)


def check_targets(saved: dict[str, Any], config: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint whose recorded class (``model.target``, ``data.target``) is not
    the one this run's command line names. The recorded one is never imported (no file names
    code that runs); the line gives the override that would name it."""
    for key in USER_CODE_KEYS:
        was, now = _dotted(saved, key), _dotted(config, key)
        if was is not None and was != now:
            group = key.split(".")[0]
            raise ConfigError(
                f"resume={path} was made with {key}={was} and this run has {key}={_spelt_null(now)}; perfrun never "
                f"imports a class that a file names: if that is your own class, give it on this command line: "
                f"{group}=custom {key}={was}"
            )


def _spelt_null(value: Any) -> str:
    return "null" if value is None else str(value)


def check_shape(ckpt: dict[str, Any], shape: dict[str, Any], path: Path) -> None:
    saved = ckpt.get("model_shape", {})
    keys = [*SHAPE_KEYS, *(k for k in ARCH_KEYS if k in shape or k in saved),
            *(["params"] if "params" in shape else [])]  # params: a custom model's only figure
    diff = [f"{k} {saved.get(k)} vs {shape.get(k)}" for k in keys if saved.get(k) != shape.get(k)]
    if diff:
        raise ConfigError(
            f"resume={path} was made with another model shape ({', '.join(diff)}: checkpoint vs this run); "
            "resume with the same model settings, or start fresh without resume"
        )
