"""One trial of ``perfrun tune``: a short run of the real trainer (:func:`perfrun.loop.run.run`,
progress off) in its own dir under the tune dir; its figure is the median tokens/s over the
steps after ``tune.warmup``, so compile time and the first allocations stay out."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from perfrun.tune.search import Candidate, TrialResult

if TYPE_CHECKING:
    from perfrun.config import TrainConfig

# A trial measures; it keeps no checkpoint unless the command line sets one of these keys.
NO_CHECKPOINTS = {"checkpoint.at_end": "false", "checkpoint.every_n_steps": "0"}


class TrainTrial:
    """``trial(candidate)``: a short run of the trainer in ``out_dir/N``; see the module doc."""

    def __init__(self, overrides: Sequence[str], out_dir: Path, steps: int, warmup: int,
                 no_checkpoints: Sequence[str] = ()) -> None:
        self.overrides = list(overrides)
        self.out_dir = out_dir
        self.settings = [f"max_steps={steps}", f"timing_warmup_steps={warmup}", f"log_every={steps}",
                         "eval_every=0", "eval_batches=1", "progress=off", f"monitor.every_n_steps={steps}",
                         "memory.breakdown=true", *no_checkpoints]
        self.count = 0

    def compose(self, candidate: Candidate) -> TrainConfig:
        """The trial's configuration, composed once and typed (ConfigError for a key perfrun lacks)."""
        from hydra import compose, initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra

        from perfrun.config import config_dir, register_configs, typed

        overrides = [*self.overrides, *candidate.overrides(), *self.settings]
        if GlobalHydra.instance().is_initialized():  # inside the tune's Hydra app, which searches conf/
            return typed(compose("train", overrides=overrides))
        register_configs()
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="tune"):
            return typed(compose("train", overrides=overrides))

    def __call__(self, candidate: Candidate) -> TrialResult:
        from perfrun.config import ConfigError
        from perfrun.loop.run import RunFailed, run

        run_dir = self.out_dir / str(self.count)
        self.count += 1
        t0 = time.perf_counter()
        try:
            cfg = self.compose(candidate)
            s = run(cfg, run_dir, overrides=[*self.overrides, *candidate.overrides(), *self.settings])
        except (ConfigError, RunFailed) as e:
            status = "oom" if "out of memory" in str(e) else "failed"
            return TrialResult(candidate, status, reason=str(e), run_dir=str(run_dir),
                               seconds=time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - one broken point (an inductor crash, say) must not end the search
            first = (str(e).strip().splitlines() or [""])[0]
            return TrialResult(candidate, "failed", reason=f"{type(e).__name__}: {first}", run_dir=str(run_dir),
                               seconds=time.perf_counter() - t0)
        tps = s.get("tokens_per_s_median")
        return TrialResult(
            candidate, "completed" if tps is not None else "failed", tokens_per_s=tps,
            peak_mem_mib=s.get("peak_mem_mib"), step_time_ms=s.get("step_time_ms_median"),
            first_step_s=s.get("first_step_s"), run_dir=str(run_dir), seconds=time.perf_counter() - t0,
            contended=(s.get("contention") or {}).get("contended"),
            reason=None if tps is not None else "no steady step was timed; raise tune.steps (--steps) above tune.warmup",
        )
