"""The measured ladder (``perfrun train -m +sweep=ablation``): what each knob buys on top of
the ones below it, what the top loses without each, the memory trade-offs apart, and the one
line to paste.

Each job says where it stands in its configuration's ``ablation`` block (conf/ablation/:
``rung``, ``kind`` = ladder | without | alternative | tradeoff | seed, ``step``, ``knob``,
``acts_on``, ``why``); the jobs of a rung are its repeats. A rung's figure is the median over
its completed repeats that had the machine to themselves, with the min-max spread; a job
marked contended (summary.json ``contention``), or whose contention is unknown, is shown but
never counted, a repeat far off
its rung's others is named as an outlier and not counted (:func:`perfrun.report.noise.outliers`),
and a rung with no other job is not ranked. An effect whose ranges overlap is "no measurable
effect (±x %)"; a rung run once is judged against the machine's noise measured in the same
sweep (:meth:`_Rungs._machine_noise`; :mod:`perfrun.report.noise`). What to recommend from
these figures is :mod:`perfrun.ladder.verdict`. A rung whose knob cannot act on the device (``acts_on: cuda``
on a CPU) is "not applicable", with the reason, and is not measured.

**Loss parity, calibrated.** Each job's loss is the mean train loss over the last
``loss_window`` of the logged steps (:func:`loss_parity`), compared with the naive trainer's
at the same steps. The yardstick is the gap between the naive trainer and the same with
another seed (``naive_seed``): a knob is flagged when its gap exceeds ``LOSS_FACTOR`` times
the seed gap, or the ceiling ``LOSS_CEILING`` whatever the seeds did (a noisy pair of seeds
must not hide a knob that costs a twentieth of the loss). Without a seed pair, the ceiling
alone decides.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from perfrun.ladder.memory_plot import add_savings, rung_breakdown
from perfrun.ladder.verdict import against_reference, flat, recommend, verdict_line
from perfrun.report.metrics_file import train_records
from perfrun.report.noise import OUTLIER_RATIO, Effect, Spread, effect, outliers, spread
from perfrun.report.reading import load
from perfrun.report.rows import HOW_RUN, Report, Row, finite
from perfrun.summary import read_summary

DEFAULT_LOSS_WINDOW = 0.2
LOSS_FACTOR = 3.0
LOSS_CEILING = 0.05
#: keys a rung's configuration differs in that are not the knob (the line to paste leaves them out)
NOT_KNOBS = ("ablation", "seed", "repeat", *HOW_RUN)


def train_losses(job: Path) -> dict[int, float]:
    """step -> train loss from metrics.jsonl, as the run that ended sees it (rows a resume
    trained again are dropped)."""
    return {int(r["step"]): float(r["loss"]) for r in train_records(job) if isinstance(r.get("loss"), (int, float))}


def loss_parity(knob: dict[int, float], base: dict[int, float], window: float) -> dict[str, Any]:
    """Relative difference of the tail-mean train loss over the last ``window`` of the common
    logged steps (at least one record), and the largest difference at any common step."""
    common = sorted(set(knob) & set(base))
    if not common:
        return {"steps": [], "rel_diff": None, "max_rel_diff": None}
    k = max(1, math.ceil(window * len(common)))
    tail = common[-k:]
    mean_knob = sum(knob[s] for s in tail) / k
    mean_base = sum(base[s] for s in tail) / k
    rel = (mean_knob - mean_base) / abs(mean_base) if mean_base else None
    diffs = [abs(knob[s] - base[s]) / abs(base[s]) for s in common if base[s]]
    return {"steps": [tail[0], tail[-1]], "records": k, "loss": mean_knob, "baseline_loss": mean_base,
            "rel_diff": rel, "max_rel_diff": max(diffs) if diffs else None}


def _median(values: list[Any]) -> float | None:
    return spread(values).median


class _Rungs:
    """The jobs of one ladder sweep, by rung, with what each needs from the job dirs."""

    def __init__(self, report: Report, rows: list[Row], window: float) -> None:
        self.report, self.window = report, window
        self.by_rung: dict[str, list[Row]] = {}
        self._configs: dict[str, dict[str, Any]] = {}
        for r in rows:
            self.by_rung.setdefault(r.ablation["rung"], []).append(r)
        self.device = next((r.device_type for r in rows if r.device_type), None)
        # the loss curve does not depend on who else used the machine: a contended naive job's
        # losses are as good a baseline as any (its speed is what is not counted)
        base = [r for r in self.by_rung.get("naive", []) if r.status == "completed"]
        self.base_curve = train_losses(report.paths[base[0].job]) if base else {}
        self.outliers: dict[str, float] = {}  # job -> the median of its rung's repeats
        for jobs in self.by_rung.values():
            quiet = [r for r in jobs if r.status == "completed" and r.quiet and finite(r.tokens_per_s)]
            mid = _median([r.tokens_per_s for r in quiet])
            self.outliers.update({quiet[i].job: mid for i in outliers([r.tokens_per_s for r in quiet])})
        self.floor, self.floor_source = self._machine_noise()

    def counted(self, rung: str) -> list[Row]:
        """The repeats a rung's figure is made of: completed, measured to have had the machine
        (neither contended nor unknown), not an outlier."""
        return [r for r in self.by_rung.get(rung, []) if r.status == "completed" and r.quiet
                and r.job not in self.outliers]

    def completed(self, rung: str) -> list[Row]:
        """The repeats that ran to the end, contended or not: what memory figures read (one
        step's memory does not depend on what else the machine ran; repeat 0 takes the breakdown)."""
        return [r for r in self.by_rung.get(rung, []) if r.status == "completed"]

    def _machine_noise(self) -> tuple[float | None, str]:
        """The machine's noise (± % of a median) measured in this sweep: the naive trainer's
        uncontended jobs (naive and naive_seed run the same speed), else the widest spread of
        any rung's repeats (a calibration pair), else not measured."""
        pooled = spread(r.tokens_per_s for rung in ("naive", "naive_seed") for r in self.counted(rung))
        if pooled.n >= 2:
            return pooled.half_pct, f"the naive trainer's {pooled.n} uncontended jobs (naive, naive_seed)"
        pairs = {rung: spread(r.tokens_per_s for r in self.counted(rung)) for rung in self.by_rung}
        pairs = {rung: sp for rung, sp in pairs.items() if sp.n >= 2 and sp.half_pct is not None}
        if pairs:
            rung = max(pairs, key=lambda k: pairs[k].half_pct)  # type: ignore[arg-type,return-value]
            return pairs[rung].half_pct, (f"the widest spread of a rung's repeats ({rung}, {pairs[rung].n} jobs; "
                                          "fewer than two uncontended naive jobs)")
        return None, ("not measured: fewer than two uncontended jobs of any one configuration, so a single "
                      "run's effect is unknown (ablation.repeats=2 or more on a quiet machine measures it)")

    def meta(self, rung: str) -> dict[str, Any]:
        return self.by_rung[rung][0].ablation

    def applicable(self, rung: str) -> bool:
        """Whether the rung's knob acts on the sweep's device: its jobs were not skipped (the
        ladder's own code decides, perfrun/ladder/rungs.py), and, for a sweep whose jobs ran
        every rung, ``acts_on`` names the device (fp8: a CUDA device whose jobs ran)."""
        rows = self.by_rung.get(rung, [])
        if rows and all(r.status == "skipped" for r in rows):
            return False
        acts_on = self.meta(rung).get("acts_on", "any")
        return acts_on in ("any", "", None) or acts_on == self.device or (acts_on == "fp8" and self.device == "cuda")

    def tps(self, rung: str) -> Spread:
        return spread(r.tokens_per_s for r in self.counted(rung)) if rung in self.by_rung and self.applicable(rung) \
            else Spread(0, None, None, None)

    def loss(self, rung: str) -> dict[str, Any]:
        gaps = [loss_parity(train_losses(self.report.paths[r.job]), self.base_curve, self.window)
                for r in self.by_rung.get(rung, []) if r.status == "completed"]
        gaps = [g for g in gaps if g["rel_diff"] is not None]
        return {"loss": _median([g["loss"] for g in gaps]), "loss_rel_diff": _median([g["rel_diff"] for g in gaps]),
                "loss_steps": gaps[0]["steps"] if gaps else None}

    def summary(self, row: Row) -> dict[str, Any]:
        try:
            return dict(read_summary(self.report.paths[row.job]))
        except (OSError, ValueError):
            return {}

    def config(self, rung: str) -> dict[str, Any]:
        """The rung's configuration as flat keys (from its first job's summary.json, read once)."""
        if rung not in self._configs:
            cfg = self.summary(self.by_rung[rung][0]).get("config") or {}
            self._configs[rung] = {k: v for k, v in flat(cfg).items() if k.split(".")[0] not in NOT_KNOBS}
        return self._configs[rung]


def _entry(rs: _Rungs, rung: str, against: Spread | None = None, base: Spread | None = None) -> dict[str, Any]:
    """One rung's line: figures, spread, its effect against ``against`` and the baseline."""
    meta, rows = rs.meta(rung), rs.by_rung[rung]
    tps = rs.tps(rung)
    counted = rs.counted(rung)
    e_below = effect(tps, against, rs.floor) if against is not None else Effect(None, None, None)
    e_base = effect(tps, base, rs.floor) if base is not None else Effect(None, None, None)
    out = {
        "rung": rung, "kind": meta.get("kind"), "step": meta.get("step"), "knob": meta.get("knob") or None,
        "why": meta.get("why"), "jobs": [r.job for r in rows], "n": tps.n,
        "contended": sum(1 for r in rows if r.contended), "unknown": sum(1 for r in rows if r.machine_unknown),
        "failed": sum(1 for r in rows if r.status not in ("completed", "skipped", "stopped")),
        "outliers": [r.job for r in rows if r.job in rs.outliers],
        "applicable": rs.applicable(rung),
        "tokens_per_s": tps.median, "tokens_per_s_min": tps.lo, "tokens_per_s_max": tps.hi, "spread_pct": tps.half_pct,
        "vs_below": e_below.ratio, "vs_below_noise_pct": e_below.noise_pct, "vs_below_measurable": e_below.measurable,
        "vs_below_single": e_below.single,
        "vs_baseline": e_base.ratio, "vs_baseline_noise_pct": e_base.noise_pct,
        "vs_baseline_measurable": e_base.measurable, "vs_baseline_single": e_base.single,
        "peak_mem_mib": _median([r.peak_mem_mib for r in counted]),
        "memory_breakdown": rung_breakdown([rs.summary(r) for r in rs.completed(rung)]),
        "first_step_s": _median([r.first_step_s for r in counted]),
        **rs.loss(rung),
    }
    if not out["applicable"]:  # not measured: no figure of it stands in the tables
        out.update(peak_mem_mib=None, first_step_s=None, loss=None, loss_rel_diff=None, loss_steps=None)
    if rung == "naive":
        out.update(vs_baseline=None, vs_baseline_noise_pct=None, vs_baseline_measurable=None, vs_baseline_single=False)
    out["verdict"] = _verdict(rs, rung, out, e_below)
    return out


def _verdict(rs: _Rungs, rung: str, e: dict[str, Any], eff: Effect) -> str:
    if not e["applicable"]:  # the skipped jobs' own reason (the device's or the model's), else the device's
        skipped = next((r.reason for r in rs.by_rung.get(rung, []) if r.status == "skipped" and r.reason), None)
        return skipped or f"not applicable on {rs.device}: {e['why']}"
    if e["n"] == 0:
        if e["contended"] or e["unknown"]:
            return "not ranked: " + "; ".join(
                ([f"{e['contended']} job(s) shared the machine (contended)"] if e["contended"] else [])
                + ([f"whether {e['unknown']} job(s) had the machine is unknown"] if e["unknown"] else []))
        if e["outliers"]:
            return f"not ranked: its only job(s) ({', '.join(e['outliers'])}) were outliers"
        return "not measured: no completed job"
    if eff.ratio is not None:
        return eff.text()
    if rung == "naive":
        return "the baseline"
    return ("the top rung was not measured: nothing to compare with" if e["kind"] == "without"
            else "no rung below it was measured: nothing to compare with")


def _parity(entries: list[dict[str, Any]], seed_gap: float | None) -> tuple[float, str]:
    """Each entry's parity against the calibrated tolerance; returns the tolerance and its rule."""
    tol = LOSS_CEILING if seed_gap is None else min(LOSS_FACTOR * seed_gap, LOSS_CEILING)
    rule = (f"loss parity: mean train loss over the last logged steps against the naive trainer's; flagged over "
            f"{LOSS_FACTOR:g}x the seed-to-seed gap"
            + (f" ({seed_gap:.2%})" if seed_gap is not None else " (not measured: no naive_seed job)")
            + f", at most {LOSS_CEILING:.0%}: tolerance ±{tol:.2%}")
    for e in entries:
        rel = e.get("loss_rel_diff")
        e["parity"] = "n/a" if rel is None else "ok" if abs(rel) <= tol else "FLAGGED"
    return tol, rule


def _tradeoffs(rs: _Rungs, top: str | None) -> list[dict[str, Any]]:
    """Per memory setting: peak memory and tokens/s at the sweep's batch, and the largest
    batch that fits with the tokens/s at it (the largest_batch* jobs)."""
    settings: dict[str, dict[str, Any]] = {}
    for rung, rows in rs.by_rung.items():
        meta = rows[0].ablation
        if meta.get("kind") != "tradeoff":
            continue
        auto = rung.startswith("largest_batch")
        line = settings.setdefault(meta.get("knob") or rung, {"setting": meta.get("knob") or rung})
        tps = rs.tps(rung)
        if auto:
            # the batch that fits is a memory figure: a job that shared the machine found it too
            batches = [(rs.summary(r).get("batch_size_auto") or {}).get("batch_size") for r in rs.completed(rung)]
            line.update(largest_batch_job=rung, largest_batch=_median(batches), tokens_per_s_at_largest=tps.median,
                        spread_pct_at_largest=tps.half_pct)
        else:
            line.update(rung=rung, tokens_per_s=tps.median, spread_pct=tps.half_pct, n=tps.n,
                        peak_mem_mib=_median([r.peak_mem_mib for r in rs.counted(rung)]),
                        memory_breakdown=rung_breakdown([rs.summary(r) for r in rs.completed(rung)]))
    if top is not None and "checkpointing=none" in settings:
        t = rs.tps(top)
        settings["checkpointing=none"].update(rung=top, tokens_per_s=t.median, spread_pct=t.half_pct, n=t.n,
                                              peak_mem_mib=_median([r.peak_mem_mib for r in rs.counted(top)]),
                                              memory_breakdown=rung_breakdown([rs.summary(r) for r in rs.completed(top)]))
    add_savings(list(settings.values()))  # the category each memory knob freed (memory_verdict)
    return list(settings.values())


def ladders(report: Report, *, loss_window: float = DEFAULT_LOSS_WINDOW) -> list[dict[str, Any]]:
    """Per root that ran ``+ablation=...`` jobs: the ladder, leave-one-out, alternatives,
    trade-offs, loss parity and the recommendation (the keys of sweep_summary.json)."""
    out = []
    for root in dict.fromkeys(r.root for r in report.rows):
        rows = [r for r in report.rows if r.root == root and r.ablation.get("rung")]
        if rows:
            out.append(_one_ladder(report, root, rows, loss_window))
    return out


def _model(rs: _Rungs, rows: list[Row]) -> dict[str, Any]:
    """Which model the ladder measured, from its first completed job (a run written before
    the counted FLOPs used the formula)."""
    for row in rows:
        s = rs.summary(row)
        if s.get("status") == "completed":
            m = (s.get("config") or {}).get("model") or {}
            return {"name": m.get("name", "?"), "target": m.get("target"), "path": m.get("path"),
                    "class": s.get("model_class"),
                    "params": s.get("params"), "flops_per_token": s.get("flops_per_token"),
                    "flops_per_token_source": s.get("flops_per_token_source", "formula")}
    return {}


def _one_ladder(report: Report, root: str, rows: list[Row], window: float) -> dict[str, Any]:
    rs = _Rungs(report, rows, window)
    kinds = {rung: rs.meta(rung).get("kind") for rung in rs.by_rung}
    steps = sorted((r for r, k in kinds.items() if k == "ladder"), key=lambda r: rs.meta(r).get("step", 0))
    base = rs.tps("naive") if "naive" in rs.by_rung else None
    ladder, below = [], None
    for rung in steps:
        ladder.append(_entry(rs, rung, below, base))
        if rs.applicable(rung) and rs.tps(rung).median is not None:
            below = rs.tps(rung)
    top = next((e["rung"] for e in reversed(ladder) if e["applicable"]), None)
    top_tps = rs.tps(top) if top else None
    step_of = {e["step"]: e["rung"] for e in ladder if e["applicable"]}
    alternatives = []
    for rung in (r for r, k in kinds.items() if k == "alternative"):
        under = max((s for s in step_of if s < rs.meta(rung).get("step", 0)), default=None)
        alternatives.append(_entry(rs, rung, rs.tps(step_of[under]) if under is not None else None, base))
    without = [_entry(rs, rung, top_tps, base) for rung, k in kinds.items() if k == "without"]
    seed = rs.loss("naive_seed") if "naive_seed" in rs.by_rung else {}
    seed_gap = abs(seed["loss_rel_diff"]) if seed.get("loss_rel_diff") is not None else None
    tol, rule = _parity(ladder + alternatives + without, seed_gap)
    recommended = recommend(rs, ladder, [*alternatives, *without])
    against_reference(rs, ladder + alternatives + without, recommended.get("reference"))
    first = rows[0]
    contended = [r for r in rows if r.contended]
    unknown = [r for r in rows if r.machine_unknown]
    return {
        "root": root, "device": rs.device, "device_name": first.device_name, "software": first.software,
        "peak_mem_source": first.peak_mem_source, "loss_window": window, "loss_tolerance": tol, "loss_rule": rule,
        "seed_gap": seed_gap, "machine_noise_pct": rs.floor, "machine_noise_source": rs.floor_source,
        "contended_jobs": [r.job for r in contended], "unknown_contention_jobs": [r.job for r in unknown],
        "outliers": _outliers(rs),
        "top": top, "ladder": ladder, "alternatives": alternatives, "leave_one_out": without,
        "tradeoffs": _tradeoffs(rs, top), "recommended": recommended, "model": _model(rs, rows),
        "verdict": verdict_line(recommended, ladder[0]["peak_mem_mib"] if ladder else None),
        "notes": _notes(rs, rows, contended, unknown),
    }


def _outliers(rs: _Rungs) -> list[dict[str, Any]]:
    """The repeats left out as outliers: job, rung, its tokens/s and its rung's median."""
    return [{"job": r.job, "rung": rung, "tokens_per_s": r.tokens_per_s, "rung_median": rs.outliers[r.job]}
            for rung, jobs in rs.by_rung.items() for r in jobs if r.job in rs.outliers]


def _notes(rs: _Rungs, rows: list[Row], contended: list[Row], unknown: list[Row]) -> list[str]:
    """The lines under the ladder's tables: who shared the machine (or may have), the
    outliers, the noise."""
    notes = [f"{len(contended)} of {len(rows)} jobs shared the machine and are not counted (jobs "
             f"{', '.join(r.job for r in contended)}); the first: {'; '.join(contended[0].contention)}"] if contended else []
    notes += [f"{len(unknown)} of {len(rows)} jobs have no contention figures, so whether they had the machine is "
              f"unknown: flagged and not counted (jobs {', '.join(r.job for r in unknown)})"] if unknown else []
    notes += [f"job {o['job']} ({o['rung']}): {o['tokens_per_s']:,.0f} tokens/s is an outlier, more than "
              f"{OUTLIER_RATIO:g}× off its rung's median {o['rung_median']:,.0f}; not counted" for o in _outliers(rs)]
    if "naive" not in rs.by_rung:
        notes.append("no naive job (+ablation=naive): no speed-up over the baseline and no loss parity")
    noise = f"±{rs.floor:.1f}% from {rs.floor_source}" if rs.floor is not None else rs.floor_source
    notes.append(f"machine noise: {noise}")
    return notes


def read_sweep(paths: Sequence[Path | str], *, loss_window: float = DEFAULT_LOSS_WINDOW) -> Report:
    """The report of ``paths`` (:func:`perfrun.report.load`) with any ladder among its jobs."""
    report = load(paths)
    report.ladders = ladders(report, loss_window=loss_window)
    return report
