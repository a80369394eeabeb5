"""The measured ladder (``perfrun train -m +sweep=ablation``): what each knob buys on top of
the ones below it, what the top loses without each, the memory trade-offs apart, and the one
line to paste.

Each job says where it stands in its configuration's ``ablation`` block (conf/ablation/:
``rung``, ``kind`` = ladder | without | alternative | tradeoff | seed, ``step``, ``knob``,
``acts_on``, ``why``); the jobs of a rung are its repeats. A rung's figure is the median over
its completed repeats that had the machine to themselves, with the min-max spread; a job
marked contended (summary.json ``contention``) is shown but never counted, and a rung with no
other job is not ranked. An effect whose ranges overlap is "no measurable effect (±x %)"
(:mod:`perfrun.report.noise`). A rung whose knob cannot act on the device (``acts_on: cuda``
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
from itertools import pairwise
from pathlib import Path
from typing import Any

from perfrun.report.memory_plot import add_savings, rung_breakdown
from perfrun.report.metrics_file import train_records
from perfrun.report.noise import Effect, Spread, effect, spread
from perfrun.report.rows import Report, Row
from perfrun.summary import read_summary

DEFAULT_LOSS_WINDOW = 0.2
LOSS_FACTOR = 3.0
LOSS_CEILING = 0.05
#: keys a rung's configuration differs in that are not the knob (the line to paste leaves them out)
NOT_KNOBS = ("ablation", "seed", "repeat")
#: knobs that act on CUDA alone: a line to paste for another device leaves them out
CUDA_ONLY = ("precision.tf32", "dataloader.pin_memory", "dataloader.device_input")


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


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for k, v in node.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return {k.rstrip("."): v for k, v in out.items()}


def _spelt(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


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

    def counted(self, rung: str) -> list[Row]:
        """The repeats a rung's figure is made of: completed and not contended."""
        return [r for r in self.by_rung.get(rung, []) if r.status == "completed" and not r.contended]

    def meta(self, rung: str) -> dict[str, Any]:
        return self.by_rung[rung][0].ablation

    def applicable(self, rung: str) -> bool:
        """Whether the rung's knob acts on the sweep's device: its jobs were not skipped (the
        job decides, perfrun/device_conditions.py: rung_applies), and, for a sweep whose jobs ran
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
            self._configs[rung] = {k: v for k, v in _flat(cfg).items() if k.split(".")[0] not in NOT_KNOBS}
        return self._configs[rung]


def _entry(rs: _Rungs, rung: str, against: Spread | None = None, base: Spread | None = None) -> dict[str, Any]:
    """One rung's line: figures, spread, its effect against ``against`` and the baseline."""
    meta, rows = rs.meta(rung), rs.by_rung[rung]
    tps = rs.tps(rung)
    counted = rs.counted(rung)
    e_below = effect(tps, against) if against is not None else Effect(None, None, None)
    e_base = effect(tps, base) if base is not None else Effect(None, None, None)
    out = {
        "rung": rung, "kind": meta.get("kind"), "step": meta.get("step"), "knob": meta.get("knob") or None,
        "why": meta.get("why"), "jobs": [r.job for r in rows], "n": tps.n,
        "contended": sum(1 for r in rows if r.contended), "failed": sum(1 for r in rows if r.status not in ("completed", "skipped")),
        "applicable": rs.applicable(rung),
        "tokens_per_s": tps.median, "tokens_per_s_min": tps.lo, "tokens_per_s_max": tps.hi, "spread_pct": tps.half_pct,
        "vs_below": e_below.ratio, "vs_below_noise_pct": e_below.noise_pct, "vs_below_measurable": e_below.measurable,
        "vs_baseline": e_base.ratio, "vs_baseline_noise_pct": e_base.noise_pct,
        "vs_baseline_measurable": e_base.measurable,
        "peak_mem_mib": _median([r.peak_mem_mib for r in counted]),
        "memory_breakdown": rung_breakdown([rs.summary(r) for r in counted]),
        "first_step_s": _median([r.first_step_s for r in counted]),
        **rs.loss(rung),
    }
    if not out["applicable"]:  # not measured: no figure of it stands in the tables
        out.update(peak_mem_mib=None, first_step_s=None, loss=None, loss_rel_diff=None, loss_steps=None)
    if rung == "naive":
        out.update(vs_baseline=None, vs_baseline_noise_pct=None, vs_baseline_measurable=None)
    out["verdict"] = _verdict(rs, rung, out, e_below)
    return out


def _verdict(rs: _Rungs, rung: str, e: dict[str, Any], eff: Effect) -> str:
    if not e["applicable"]:
        return f"not applicable on {rs.device}: {e['why']}"
    if e["n"] == 0:
        if e["contended"]:
            return f"not ranked: all {e['contended']} job(s) shared the machine (contended)"
        return "not measured: no completed job"
    return eff.text() if eff.ratio is not None else "the baseline"


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
            batches = [(rs.summary(r).get("batch_size_auto") or {}).get("batch_size") for r in rs.counted(rung)]
            line.update(largest_batch_job=rung, largest_batch=_median(batches), tokens_per_s_at_largest=tps.median,
                        spread_pct_at_largest=tps.half_pct)
        else:
            line.update(rung=rung, tokens_per_s=tps.median, spread_pct=tps.half_pct, n=tps.n,
                        peak_mem_mib=_median([r.peak_mem_mib for r in rs.counted(rung)]),
                        memory_breakdown=rung_breakdown([rs.summary(r) for r in rs.counted(rung)]))
    if top is not None and "checkpointing=none" in settings:
        t = rs.tps(top)
        settings["checkpointing=none"].update(rung=top, tokens_per_s=t.median, spread_pct=t.half_pct, n=t.n,
                                              peak_mem_mib=_median([r.peak_mem_mib for r in rs.counted(top)]),
                                              memory_breakdown=rung_breakdown([rs.summary(r) for r in rs.counted(top)]))
    add_savings(list(settings.values()))  # the category each memory knob freed (memory_verdict)
    return list(settings.values())


def _knob_keys(configs: list[dict[str, Any]]) -> list[str]:
    """The configuration keys the measured jobs differ in: the knobs, in the first's order."""
    keys = dict.fromkeys(k for c in configs for k in c)
    return [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]


def _line_to_paste(config: dict[str, Any], keys: list[str]) -> str:
    """``perfrun train KEY=VALUE ...``: the knobs where ``config`` differs from perfrun's
    defaults, so that the line runs exactly the configuration that was measured."""
    from omegaconf import OmegaConf

    from perfrun.config import TrainConfig

    defaults = _flat(OmegaConf.to_container(OmegaConf.structured(TrainConfig)))
    changed = [f"{k}={_spelt(config.get(k))}" for k in keys if config.get(k) != defaults.get(k)]
    return " ".join(["perfrun train", *changed])


def _recommend(rs: _Rungs, ladder: list[dict[str, Any]], others: list[dict[str, Any]]) -> dict[str, Any]:
    """The configuration to run: one that was measured (a rung, an alternative or a top
    without one knob) and within loss parity. The fastest median wins, but among the jobs
    whose range overlaps the fastest's (no measurable difference) the one with the fewest
    knobs on (counted from the naive trainer) is chosen; so the naive trainer itself when
    nothing beat it outside the noise. Its figures are its own."""
    measured = [e for e in (*ladder, *others) if e["applicable"] and e["n"] and e.get("parity") != "FLAGGED"]
    climbed = [e for e in ladder if e["step"] and e["applicable"]]
    if not measured:
        unranked = all(e["n"] == 0 and e["contended"] for e in ladder if e["applicable"])
        return {"knobs": [], "dropped": [e["rung"] for e in climbed], "line": "perfrun train",
                "why": "no rung can be ranked: every job shared the machine (contended); rerun on a quiet machine"
                if unranked else "no job was measured (no completed, uncontended job within loss parity)"}
    configs = {e["rung"]: rs.config(e["rung"]) for e in measured}
    naive = configs.get("naive") or (rs.config("naive") if "naive" in rs.by_rung else {})
    keys = [k for k in _knob_keys([naive, *configs.values()]) if rs.device == "cuda" or k not in CUDA_ONLY]
    best = max(measured, key=lambda e: e["tokens_per_s"])
    tied = [e for e in measured if e is best or effect(rs.tps(e["rung"]), rs.tps(best["rung"])).measurable is not True]
    chosen = min(tied, key=lambda e: (sum(configs[e["rung"]].get(k) != naive.get(k) for k in keys), -e["tokens_per_s"]))
    config = configs[chosen["rung"]]
    on = [e["rung"] for below, e in pairwise(ladder) if e in climbed and _has(config, rs, below["rung"], e["rung"])]
    return {
        "knobs": on, "dropped": [e["rung"] for e in climbed if e["rung"] not in on],
        "line": _line_to_paste(config, keys), "measured_as": chosen["rung"], "measured_exactly": True,
        "fastest": best["rung"], "speedup": chosen["vs_baseline"], "noise_pct": chosen["vs_baseline_noise_pct"],
        "measurable": chosen["vs_baseline_measurable"], "peak_mem_mib": chosen["peak_mem_mib"],
        "parity": chosen.get("parity"), "loss_rel_diff": chosen.get("loss_rel_diff"),
        "fastest_vs_naive": Effect(best["vs_baseline"], best["vs_baseline_noise_pct"],
                                   best["vs_baseline_measurable"]).text() if best["rung"] != "naive" else None,
    }


def _has(config: dict[str, Any], rs: _Rungs, below: str, rung: str) -> bool:
    """Whether ``config`` holds what ``rung`` changed from the rung ``below`` it."""
    under, mine = rs.config(below), rs.config(rung)
    changed = {k: v for k, v in mine.items() if under.get(k) != v}
    return bool(changed) and all(config.get(k) == v for k, v in changed.items())


def verdict_line(rec: dict[str, Any], base_mem: float | None) -> str:
    """The sweep's last line: what to run, and what it bought."""
    if "measured_as" not in rec:
        return f"verdict: {rec['line']} (defaults): {rec.get('why', '')}"
    mem = f"{rec['peak_mem_mib']:,.0f} MiB" if rec.get("peak_mem_mib") is not None else "n/a"
    if base_mem and rec.get("peak_mem_mib") is not None:
        mem += f" ({rec['peak_mem_mib'] / base_mem:.2f}× the naive trainer's)"
    rel = rec.get("loss_rel_diff")
    loss = f"loss {rel:+.2%} ({rec.get('parity')})" if rel is not None else "loss parity n/a"
    if rec["measured_as"] == "naive":
        fastest = f" (the fastest, {rec['fastest']}: {rec['fastest_vs_naive']})" if rec.get("fastest_vs_naive") else ""
        return (f"verdict: {rec['line']}  # the naive trainer: no configuration measured here was faster outside "
                f"the noise{fastest}; peak memory {mem}")
    speed = Effect(rec["speedup"], rec["noise_pct"], rec["measurable"]).text()
    return (f"verdict: {rec['line']}  # {speed} the naive trainer's tokens/s (measured as {rec['measured_as']}), "
            f"peak memory {mem}, {loss}")


def ladders(report: Report, *, loss_window: float = DEFAULT_LOSS_WINDOW) -> list[dict[str, Any]]:
    """Per root that ran ``+ablation=...`` jobs: the ladder, leave-one-out, alternatives,
    trade-offs, loss parity and the recommendation (the keys of sweep_summary.json)."""
    out = []
    for root in dict.fromkeys(r.root for r in report.rows):
        rows = [r for r in report.rows if r.root == root and r.ablation.get("rung")]
        if rows:
            out.append(_one_ladder(report, root, rows, loss_window))
    return out


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
    for e in without:
        e["verdict"] = _verdict(rs, e["rung"], e, effect(rs.tps(e["rung"]), top_tps) if top_tps else Effect(None, None, None))
    seed = rs.loss("naive_seed") if "naive_seed" in rs.by_rung else {}
    seed_gap = abs(seed["loss_rel_diff"]) if seed.get("loss_rel_diff") is not None else None
    tol, rule = _parity(ladder + alternatives + without, seed_gap)
    recommended = _recommend(rs, ladder, [*alternatives, *without])
    first = rows[0]
    contended = [r for r in rows if r.contended]
    notes = [f"{len(contended)} of {len(rows)} jobs shared the machine and are not counted (jobs "
             f"{', '.join(r.job for r in contended)}); the first: {'; '.join(contended[0].contention)}"] if contended else []
    if "naive" not in rs.by_rung:
        notes.append("no naive job (+ablation=naive): no speed-up over the baseline and no loss parity")
    return {
        "root": root, "device": rs.device, "device_name": first.device_name, "software": first.software,
        "peak_mem_source": first.peak_mem_source, "loss_window": window, "loss_tolerance": tol, "loss_rule": rule,
        "seed_gap": seed_gap, "top": top, "ladder": ladder, "alternatives": alternatives, "leave_one_out": without,
        "tradeoffs": _tradeoffs(rs, top), "recommended": recommended,
        "verdict": verdict_line(recommended, ladder[0]["peak_mem_mib"] if ladder else None), "notes": notes,
    }
