"""A sweep's ``ablation.*`` keys and a ladder's size, checked when the sweep starts, before
the ladder's calibration or any job: a mistake costs one line, not a calibration and then
the same failure once per job, and a repeat count in the hundreds of thousands is refused
before Hydra's sweeper lists its jobs one by one.

- every ``ablation.*`` key within its bounds (:func:`perfrun.validate.check_ablation`);
- none of a rung's own keys (its name, kind, place, knob, device, reason) typed on the
  command line of a ladder, where it would overwrite every rung's;
- a ladder of at most :data:`MAX_LADDER_JOBS` jobs, counted from the sweep's parameters
  without listing them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from perfrun.config import AblationConfig, ConfigError
from perfrun.validate import check_ablation

if TYPE_CHECKING:
    from hydra.core.override_parser.types import Override

#: The most jobs a ladder runs. They run one after another, each with its setup and warm-up,
#: and the ladder's time estimate and budgets share its target among them: the default
#: ladder is 145 jobs on a CPU and 87 on CUDA; several times that is a typo in
#: ``ablation.repeats`` or another sweep multiplied by the ladder.
MAX_LADDER_JOBS = 1000
#: The keys each rung's file (conf/ablation/) sets for itself.
RUNG_OWN = ("rung", "kind", "step", "knob", "acts_on", "why")
SHRINK = "run part of it (+ablation=naive,bf16,...)"


def check_sweep(config: DictConfig) -> None:
    """Raise ConfigError (one line) for a sweep whose ``ablation.*`` keys or ladder cannot run.

    ``config``: the multirun's configuration as Hydra's callbacks receive it (with ``hydra``)."""
    node = OmegaConf.select(config, "ablation")
    if node is not None:
        ablation = OmegaConf.to_object(node)
        if isinstance(ablation, AblationConfig):
            check_ablation(ablation)
    overrides = _overrides(config)
    if "ablation" not in {key.lstrip("+~") for key in overrides}:
        return
    for o in OmegaConf.select(config, "hydra.overrides.task") or []:
        key = str(o).split("=", 1)[0].lstrip("+~")
        if key.startswith("ablation.") and key.split(".", 1)[1] in RUNG_OWN:
            raise ConfigError(f"{o}: {key} is each rung's own (its file under conf/ablation/), and typed here it would "
                              f"be every rung's; remove it, and {SHRINK}")
    _check_size(config, overrides)


def _overrides(config: DictConfig) -> dict[str, Override]:
    """The sweep's overrides by key, the later of two with one key winning (as Hydra's basic
    sweeper takes them)."""
    from perfrun.ladder.plan import sweep_overrides

    return {o.get_key_element(): o for o in sweep_overrides(config)}


def values_of(o: Override) -> int | None:
    """How many values an override takes: 1, a choice's count, a range's length; None for a
    glob (its count depends on the config groups on disk)."""
    from hydra.core.override_parser.types import ChoiceSweep, RangeSweep

    if not o.is_sweep_override():
        return 1
    value = o.value()
    if isinstance(value, ChoiceSweep):
        return len(value.list)
    if isinstance(value, RangeSweep) and value.step:
        return max(0, math.ceil((value.stop - value.start) / value.step))
    return None


def _check_size(config: DictConfig, overrides: dict[str, Override]) -> None:
    counts = {key.lstrip("+~"): values_of(o) for key, o in overrides.items()}
    if any(n is None for n in counts.values()):  # a glob: list the jobs (the repeats are bounded)
        from perfrun.ladder.plan import sweep_jobs

        jobs = len(sweep_jobs(config))
    else:
        jobs = math.prod(n for n in counts.values() if n is not None)
    if jobs <= MAX_LADDER_JOBS:
        return
    rungs, repeats = counts.get("ablation"), counts.get("repeat") or 1
    others = jobs // max(1, (rungs or 1) * repeats)
    parts = "" if rungs is None else f" ({rungs} rungs x {repeats} repeats" + (
        f" x {others} values of the other swept keys)" if others > 1 else ")")
    target = OmegaConf.select(config, "ablation.target_s")
    share = f", and ablation.target_s={target:g} would leave each job {target / jobs:.2g} s" if target else ""
    raise ConfigError(f"the ladder would run {jobs:,} jobs{parts}, more than {MAX_LADDER_JOBS:,}: they run one "
                      f"after another{share}; lower ablation.repeats (now {repeats}), sweep fewer values, or {SHRINK}")
