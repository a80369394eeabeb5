"""Training-state checkpoints as a component of the loop: when to save, who writes, in which
layout, and resume.

The state is gathered from named parts, each :class:`~perfrun.checkpoint.stateful.Stateful`
(``state_dict()`` / ``load_state_dict()``) and saved under its name: the model and optimizer,
the schedule, the loss scale, the data position, the tokens seen (:data:`PARTS`); beside them
every random generator (each rank's), the model's shape and the config. The checkpointer knows
none of the loop's or the knobs' classes. One process and DDP save one file that rank 0 writes
(every rank holds the same weights); FSDP saves a folder into which every rank writes its
shards. The file formats are in :mod:`perfrun.checkpoint.files`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from perfrun import distributed
from perfrun.checkpoint import files as checkpoint_files
from perfrun.checkpoint.files import capture_rng, restore_rng
from perfrun.checkpoint.resume_search import RunSearch, find_run
from perfrun.checkpoint.run_lock import remove_temp_files
from perfrun.checkpoint.stateful import Stateful
from perfrun.config import CheckpointSaveConfig, ConfigError
from perfrun.console import first_line
from perfrun.summary import RunSummary

log = logging.getLogger("perfrun")


@dataclass
class Start:
    """Where the loop starts: step 0 for a fresh run, the checkpoint's step on resume (the
    parts hold the rest: the data position, the tokens seen)."""

    step: int = 0
    checkpoint: str | None = None


# The parts a checkpoint holds, by their entry in the file, and what a user calls each one.
PARTS = {"model": "model weights", "optimizer": "optimizer state", "scheduler": "learning-rate schedule",
         "scaler": "loss scale", "data": "data position", "tokens": "count of tokens seen"}


def checkpoint_folder(configured: str | None, run_dir: Path | None) -> Path | None:
    """``checkpoint.dir``, else ``<run dir>/checkpoints``; None (no checkpoints) without either."""
    if configured:
        return Path(configured)
    return run_dir / "checkpoints" if run_dir else None


def model_shape(model: torch.nn.Module) -> dict[str, Any]:
    """The shape a checkpoint records and resume checks: perfrun's families' config fields;
    a model without them (model=custom) has None there and its parameter count instead."""
    c = getattr(model, "config", None)
    shape: dict[str, Any] = {k: getattr(c, k, None) for k in checkpoint_files.SHAPE_KEYS}
    for k in checkpoint_files.ARCH_KEYS:
        if hasattr(c, k):
            value = getattr(c, k)
            shape[k] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    if c is None:
        shape["params"] = sum(p.numel() for p in model.parameters())
    return shape


class Checkpointer:
    """Saves on its cadence (``every_n_steps``, at the end, on a graceful stop) and resumes.

    Every rank calls every method: saving and resuming are collectives under several ranks.
    """

    def __init__(self, cfg_checkpoint: CheckpointSaveConfig, folder: Path | None, parts: Mapping[str, Stateful],
                 record: Callable[[dict[str, Any]], None], *,
                 sharded: bool, all_finite: Callable[[], bool], paused: Callable[[], AbstractContextManager[Any]],
                 config: dict[str, Any], seed: int, max_steps: int, search: RunSearch | None = None) -> None:
        """``parts``: every entry of :data:`PARTS`; ``parts["model"]`` is the plain model and
        ``parts["optimizer"]`` its optimizer (FSDP's ``sharded`` state saves them by rank).
        ``all_finite``: may this state be saved (no rank's last step was inf or NaN);
        ``paused``: the step timer's pause around a save; ``record``: where each save is
        written down (the run's metrics.jsonl)."""
        missing = [name for name in PARTS if not isinstance(parts.get(name), Stateful)]
        if missing:
            raise TypeError(f"the checkpointer needs a state_dict/load_state_dict part for each of {missing}")
        self.every, self.at_end, self.keep_last = cfg_checkpoint.every_n_steps, cfg_checkpoint.at_end, cfg_checkpoint.keep_last
        self.folder, self.parts, self.record = folder, dict(parts), record
        self.model: torch.nn.Module = parts["model"]  # type: ignore[assignment]
        self.optimizer: torch.optim.Optimizer = parts["optimizer"]  # type: ignore[assignment]
        self.sharded, self.all_finite, self.paused = sharded, all_finite, paused
        self.config, self.seed, self.max_steps, self.search = config, seed, max_steps, search
        self.saved: list[str] = []
        self.time_s = 0.0
        if folder is not None and distributed.rank() == 0:
            checkpoint_files.check_writable(folder)  # fail at setup, not after hours of training
            remove_temp_files(folder)  # a save killed mid-write; the job's lock keeps others out

    # -- saving ------------------------------------------------------------------------

    def maybe_save(self, step: int) -> None:
        """Every ``checkpoint.every_n_steps`` steps; the last step is saved by :meth:`save_at_end`."""
        if self.every and step % self.every == 0 and step != self.max_steps:
            self.save(step)

    def save_at_end(self, step: int) -> None:
        if self.at_end:
            self.save(step)

    def save(self, step: int) -> None:
        """Save the state after ``step``, unless a rank's last step was not finite."""
        if self.folder is None:
            return
        if not self.all_finite():
            log.warning(f"step {step}: not saving a checkpoint of a non-finite state; the last good one stays")
            return
        with self.paused():
            t = time.perf_counter()
            path = self._write(step, self._state())
            seconds = time.perf_counter() - t
            self.saved.append(str(path))
            self.time_s += seconds
            self.record({"kind": "checkpoint", "step": step, "path": str(path), "save_s": seconds})

    def _state(self) -> dict[str, Any]:
        """Every part's state but the model's and optimizer's, the random generators and
        what a resume checks against (the model's shape, the config)."""
        world = distributed.world_size()
        rng = capture_rng()
        rng_ranks = distributed.gather_to_rank0(rng)  # each rank draws its own dropout masks
        state = {name: part.state_dict() for name, part in self.parts.items() if name not in ("model", "optimizer")}
        return {**state, "rng": rng, "rng_ranks": rng_ranks if world > 1 else None, "world_size": world,
                "model_shape": model_shape(self.model), "config": self.config}

    def _write(self, step: int, state: dict[str, Any]) -> Path:
        """Sharded (FSDP): every rank writes its shards. Otherwise rank 0 writes one file and
        every rank waits for it, so that none runs ahead of the file or misses its failure."""
        model, optimizer = self.model, self.optimizer
        if self.sharded:
            return checkpoint_files.save_sharded(self.folder, step, model, optimizer, state, self.keep_last)
        path, error = None, None
        if distributed.rank() == 0:
            state.update(model=model.state_dict(), optimizer=optimizer.state_dict())
            try:
                path = checkpoint_files.save(self.folder, step, state, self.keep_last)
            except checkpoint_files.CheckpointWriteError as e:
                error = str(e)
        path, error = distributed.from_rank0((path, error))  # a barrier
        if error is not None:
            raise checkpoint_files.CheckpointWriteError(error)
        return path

    def with_last_good(self, message: str) -> str:
        """``message`` and where the run can be continued from."""
        return message + (f"; the last good checkpoint is {self.saved[-1]}" if self.saved else "")

    def summary(self) -> RunSummary:
        return {"checkpoint_time_s": self.time_s, "checkpoints": self.saved}

    # -- resuming ----------------------------------------------------------------------

    def resume(self, spec: str | None) -> Start:
        """``resume=auto|PATH``: load the checkpoint into the parts on every rank and say
        where the loop starts; a fresh start without ``spec`` (or with ``auto`` and none)."""
        if not spec:
            return Start()
        path = self._find(str(spec))
        if path is None:
            log.warning(f"resume=auto: no checkpoint in {self.folder}; starting from step 0 "
                        "(to continue a run, start it with the same hydra.run.dir or checkpoint.dir)")
            return Start()
        ckpt = self._load_on_every_rank(path)
        for warning in checkpoint_files.check_compatible(ckpt, model_shape(self.model), self.config,
                                                         path, distributed.world_size()):
            log.warning(warning)
        problem = None
        try:
            start = self._restore(ckpt, path)
        except ConfigError as e:
            problem = str(e)
        if distributed.any_rank(problem is not None):  # every rank stops, with the reason where it is known
            raise ConfigError(problem or f"resume={path}: another rank could not load this checkpoint")
        log.info(f"resumed from {path} at step {start.step}")
        if start.step >= self.max_steps:
            raise ConfigError(f"resume={path} is at step {start.step}, already at max_steps={self.max_steps}; "
                              f"raise max_steps to train further")
        return start

    def _find(self, spec: str) -> Path | None:
        """Rank 0 picks the checkpoint (``auto``: the newest) and every rank takes that one,
        so ranks never resume from different steps."""
        found, error = None, None
        if distributed.rank() == 0:
            try:
                if spec == "auto" and self.folder is not None:
                    checkpoint_files.recover_interrupted_saves(self.folder)  # a sharded save cut between its renames
                found = checkpoint_files.resolve(spec, self.folder)
                if found is None and spec == "auto" and self.search is not None:
                    found = self._search()
            except ConfigError as e:
                error = str(e)
        found, error = distributed.from_rank0((found, error))
        if error is not None:
            raise ConfigError(error)
        return found

    def _search(self) -> Path | None:
        """resume=auto from a folder with no checkpoint: the run of this configuration under
        the outputs folder (a sweep's job continues the same job of an earlier sweep)."""
        found = find_run(self.search, self.max_steps)
        if found is None:
            return None
        log.info(f"resume=auto: continuing the run in {found.run_dir} from step {found.step}")
        return found.checkpoint

    @staticmethod
    def _load_on_every_rank(path: Path) -> dict[str, Any]:
        """Each rank reads the checkpoint; if one cannot (a folder not shared between nodes),
        all stop with the reason instead of waiting for each other."""
        ckpt, problem = None, None
        try:
            ckpt = checkpoint_files.load(path)
        except ConfigError as e:
            problem = str(e)
        if distributed.any_rank(problem is not None):
            raise ConfigError(problem or f"resume={path}: another rank cannot read this checkpoint; put checkpoints "
                              "on a filesystem that every node sees (checkpoint.dir=/shared/...)")
        return ckpt

    def _restore(self, ckpt: dict[str, Any], path: Path) -> Start:
        """Load a checkpoint's state into the freshly built parts, each under its name.

        On as many ranks as it was saved from, every rank gets its own random state back and
        the run continues bit for bit. On another number of ranks (a sharded checkpoint
        reshards; a single file loads anywhere) the weights, optimizer, schedule and data
        position carry over (the global batch is checked to be the same), but the random
        streams are reseeded. An entry the file lacks (older files have no ``tokens``) is
        given to its part as None.
        """
        if ckpt.get("sharded_path"):
            checkpoint_files.load_sharded_into(Path(ckpt["sharded_path"]), self.model, self.optimizer)
        elif self.sharded:
            raise ConfigError(f"resume={path} is a single-file checkpoint (distributed=none or ddp) and distributed=fsdp "
                              "reads sharded ones; resume it with distributed=ddp (any number of ranks), or start fresh")
        for name, part in self.parts.items():
            if name in ("model", "optimizer") and ckpt.get("sharded_path"):
                continue
            with _loading(path, PARTS.get(name, name)):
                part.load_state_dict(ckpt.get(name))
                if isinstance(part, torch.optim.lr_scheduler.LRScheduler):
                    _check_schedule(part)
        with _loading(path, "random generators"):
            self._restore_rng(ckpt, path)
        return Start(step=int(ckpt["step"]), checkpoint=str(path))

    def _restore_rng(self, ckpt: dict[str, Any], path: Path) -> None:
        """Each rank's random state, or a reseed on another number of ranks."""
        data = ckpt["data"]
        rank, world, saved_world = distributed.rank(), distributed.world_size(), checkpoint_files.saved_world(ckpt)
        if saved_world == world:
            ranks = ckpt.get("rng_ranks")
            restore_rng(ranks[rank] if ranks else ckpt["rng"])
        else:
            restore_rng(ckpt["rng"])
            distributed.seed_rank(self.seed + int(ckpt["step"]), rank)
            log.warning(f"resume={path} was saved by {saved_world} rank(s) and continues on {world}, with the same "
                        f"global batch and data order (from sample {data['consumed']} of epoch {data['epoch']}); the random "
                        "streams (dropout) are reseeded per rank and sums run in another order, so not bit for bit")


def _check_schedule(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """A schedule that loaded but cannot compute the next step's rate fails now, not at step 1."""
    if not isinstance(scheduler.last_epoch, int) or scheduler.last_epoch < 0:
        raise ValueError(f"last_epoch {scheduler.last_epoch!r}")
    # torchao's optimizers (optim=adamw8bit|adamw4bit) keep each rate as a 0-d tensor
    if not all(isinstance(lr, float) or (isinstance(lr, torch.Tensor) and lr.dim() == 0 and lr.is_floating_point())
               for lr in scheduler.get_last_lr()):
        raise ValueError(f"learning rates {scheduler.get_last_lr()!r}")
    with warnings.catch_warnings():  # "use get_last_lr()": this call only tries the next step's
        warnings.simplefilter("ignore")
        scheduler.get_lr()


@contextmanager
def _loading(path: Path, part: str) -> Iterator[None]:
    """A part of a checkpoint that does not load into this run: one line naming the part."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged or foreign state fails in as many ways as torch has
        raise ConfigError(
            f"resume={path}: its {part} cannot be loaded into this run ({type(e).__name__}: "
            f"{first_line(' '.join(str(e).split()), 160)}); "
            "the checkpoint is damaged or was made by another program: pick another checkpoint or start without resume"
        ) from None
