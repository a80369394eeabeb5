"""Every ``ablation.*`` key, and the ladder's size, checked when the sweep starts: one line,
exit 2, before the ladder's calibration or any job. The bounds in-process through the
validation functions (a configuration composed as ``perfrun train`` composes it); the
command itself, as a user runs it, for two of them."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import DictConfig

from perfrun.config import ConfigError
from perfrun.ladder.bounds import MAX_LADDER_JOBS, check_sweep, values_of
from perfrun.validate import check_ablation

from conftest import make_cfg, run_cli

BAD = [  # an override, and what its one line says
    ("ablation.repeats=0", "ablation.repeats=0 is outside 1 to 100"),
    ("ablation.repeats=100000", "ablation.repeats=100000 is outside 1 to 100"),
    ("ablation.tradeoff_repeats=-1", "ablation.tradeoff_repeats=-1 is outside 1 to 100"),
    ("ablation.tradeoff_repeats=101", "ablation.tradeoff_repeats=101 is outside 1 to 100"),
    ("ablation.budget_s=-1", "ablation.budget_s=-1.0 must be more than 0"),
    ("ablation.budget_s=0", "ablation.budget_s=0.0 must be more than 0"),
    ("ablation.budget_s=nan", "ablation.budget_s=nan must be more than 0"),
    ("ablation.budget_s=inf", "ablation.budget_s=inf must be more than 0"),
    ("ablation.budget_s=1e9", "at most 604800 seconds"),
    ("ablation.target_s=-5", "ablation.target_s=-5.0 must be more than 0"),
    ("ablation.target_s=0", "ablation.target_s=0.0 must be more than 0"),
    ("ablation.kind=bogus", "ablation.kind=bogus is not a kind of rung"),
    ("ablation.acts_on=tpu", "ablation.acts_on=tpu is not an option"),
    ("ablation.rung='a b'", "is not a rung's name"),
    ("ablation.step=-1", "ablation.step=-1 must be >= 0"),
]


@pytest.mark.parametrize("override, says", BAD, ids=[o for o, _ in BAD])
def test_each_ablation_key_is_bounded(override: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_ablation(make_cfg(override).ablation)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_defaults_and_sensible_values_pass() -> None:
    check_ablation(make_cfg().ablation)
    check_ablation(make_cfg("ablation.repeats=100", "ablation.tradeoff_repeats=1", "ablation.budget_s=0.5",
                            "ablation.target_s=604800", "ablation.budget_s=null").ablation)


def composed(*overrides: str) -> DictConfig:
    """The multirun's configuration as Hydra hands it to the sweep's callback (with ``hydra``)."""
    from hydra import compose, initialize_config_dir

    from perfrun.config import config_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
        return compose("train", overrides=["device=cpu", *overrides], return_hydra_config=True)


def test_the_default_ladder_passes_and_a_ladder_too_large_is_refused_with_its_size() -> None:
    check_sweep(composed("+sweep=ablation"))  # every rung x 5 repeats on a CPU
    large = composed("+sweep=ablation", "ablation.repeats=50")
    rungs = len(str(large.hydra.sweeper.params["+ablation"]).split(","))  # the rungs conf/sweep/ablation.yaml lists
    with pytest.raises(ConfigError) as e:
        check_sweep(large)
    line = str(e.value)
    assert line.startswith(f"the ladder would run {rungs * 50:,} jobs ({rungs} rungs x 50 repeats)")
    assert f"{MAX_LADDER_JOBS:,}" in line
    assert "lower ablation.repeats (now 50)" in line and "+ablation=naive,bf16" in line


def test_a_rungs_own_key_on_the_ladders_command_line_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"ablation.kind=ladder: ablation.kind is each rung's own"):
        check_sweep(composed("+sweep=ablation", "ablation.kind=ladder"))
    with pytest.raises(ConfigError, match=r"ablation.budget_s=-1.0 must be more than 0"):
        check_sweep(composed("+sweep=ablation", "ablation.budget_s=-1"))
    check_sweep(composed("ablation.kind=ladder"))  # not a ladder: a label of a plain sweep's jobs


def test_the_jobs_are_counted_without_listing_them() -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(
        ["repeat=range(0,100000)", "+ablation=naive,bf16,sdpa", "max_steps=3", "lr=range(0,1,0.25)",
         "seed=shuffle(range(0,5))", "model=glob(*)"])
    assert [values_of(o) for o in parsed] == [100000, 3, 1, 4, 5, None]


@pytest.mark.slow  # a real process each: the bounds themselves are checked in-process above
@pytest.mark.parametrize("override, says", [("ablation.budget_s=-1", "ablation.budget_s=-1.0 must be more than 0"),
                                            ("ablation.repeats=100000", "ablation.repeats=100000 is outside")])
def test_the_ladder_command_refuses_in_one_line_before_any_job(tmp_path: Path, override: str, says: str) -> None:
    """The real command: one line, exit 2, no sweep dir, no calibration (its folder would
    be made under the temporary directory, not here: nothing at all is written here)."""
    proc = run_cli("train", "-m", "+sweep=ablation", override, f"hydra.sweep.dir={tmp_path / 'sweep'}",
                   cwd=tmp_path, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("perfrun: error:") and says in lines[0], lines
    assert "Traceback" not in proc.stdout + proc.stderr and "calibrating" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []
