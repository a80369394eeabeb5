"""The search space of ``perfrun tune``: tune's settings, or the default for each left null,
with each searched key the command line gave held fixed."""

from __future__ import annotations

from perfrun.config import CHOICES
from perfrun.tune.config import TuneConfig, TuneError, default_workers, override_value
from perfrun.tune.search import Space


def searched(tc: TuneConfig) -> Space:
    """The options to search: tune's settings, or the default for each left null."""
    for name in ("batch_sizes", "checkpointing", "compile", "workers"):
        if getattr(tc, name) == []:
            raise TuneError(f"tune.{name}=[] tries nothing; give at least one value, or null for the default")
    bad = [c for c in tc.checkpointing or [] if c not in CHOICES["checkpointing.name"]]
    if bad:
        raise TuneError(f"tune.checkpointing: {bad[0]} is not an option; choose from "
                        f"{', '.join(CHOICES['checkpointing.name'])}")
    if tc.workers is not None and min(tc.workers) < 0:
        raise TuneError(f"tune.workers={override_value(tc.workers)}: give whole numbers >= 0, e.g. [0,2]")
    quick = tc.quick
    return Space(
        checkpointing=tc.checkpointing or (["none"] if quick else ["none", "full"]),
        compile=tc.compile or ([False] if quick else [False, True]),
        num_workers=tc.workers or ([0] if quick else [0, default_workers()]),
        batch_sizes=tc.batch_sizes, start=tc.start, max_batch=tc.max_batch,
        patience=tc.patience, min_gain=tc.min_gain,
    )


def space_for(tc: TuneConfig, fixed: dict[str, str]) -> Space:
    """The search space, with each searched key the command line gave held fixed."""
    space = searched(tc)
    if "dataloader.batch_size" in fixed:
        b = fixed["dataloader.batch_size"]
        if not b.isdigit() or int(b) < 1:
            raise TuneError(f"dataloader.batch_size={b}: tune holds a given batch size fixed and needs a whole number >= 1 "
                            "(drop it to search batch sizes)")
        space.batch_sizes = [int(b)]
    if "checkpointing" in fixed:
        space.checkpointing = [fixed["checkpointing"]]
    if "compile" in fixed:
        if fixed["compile"].lower() not in ("true", "false"):
            raise TuneError(f"compile={fixed['compile']} must be true or false")
        space.compile = [fixed["compile"].lower() == "true"]
    if "dataloader.num_workers" in fixed:
        w = fixed["dataloader.num_workers"]
        if not w.isdigit():
            raise TuneError(f"dataloader.num_workers={w} must be a whole number >= 0")
        space.num_workers = [int(w)]
    if space.start < 1 or (space.max_batch is not None and space.max_batch < space.start):
        raise TuneError(f"--start {space.start} and --max-batch {space.max_batch}: need 1 <= start <= max-batch "
                        "(tune.start, tune.max_batch)")
    if space.batch_sizes is not None and min(space.batch_sizes) < 1:
        raise TuneError("--batch-sizes: every batch size must be >= 1 (tune.batch_sizes)")
    if space.patience < 1 or not space.min_gain >= 0:
        raise TuneError("--patience must be >= 1 and --min-gain >= 0 (tune.patience, tune.min_gain)")
    return space
