"""The ablation (``perfrun train -m +sweep=ablation``): each knob against the fp32 baseline.

**Loss parity.** Each knob's training-loss curve is compared with the fp32 baseline's at
the steps both logged. The figure judged is the relative difference of the mean train loss
over the tail of the run: the last ``--loss-window`` fraction (default 20 %) of the common
logged steps, at least one record, each record being itself the mean loss over
``log_every`` steps. Averaging over the tail keeps step-to-step noise out; comparing at the
end catches a knob that slowly derails training (fp16 overflow, lost gradients) rather than
the expected, harmless early-trajectory wiggle of changed rounding. The tolerance
(``--loss-tol``, default 2 %) is stated in the output, and each knob over it is flagged.
The largest relative difference at any common step is shown beside it, for information only.

Why 2 %: in the measured ablation of GPT-2 (124M) on an H100 (batch 8 x 1024 tokens, 100
steps; ``perfrun report --markdown`` of that sweep), the knobs that change only rounding
moved the tail mean by at most 0.81 % (bf16; fp16 0.62 %, all knobs 0.42 %, the others
under 0.03 %), while their per-step difference reached 8.7 % early on (fp16 over the
first ten steps, where its loss scaler skipped a step: the scale fell from 2^16 to 2^15),
which is why the tail and not the worst step is judged. 2 %
leaves those a margin of more than two, and still flags a knob that costs a fortieth of
the loss. On a tiny CPU model the same knobs stayed within 0.01 %.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from perfrun.report.metrics_file import train_records
from perfrun.report.rows import Report, Row, finite, override_key

ABLATION_KEY = "ablation"
BASELINE = "baseline"
DEFAULT_LOSS_TOL = 0.02
DEFAULT_LOSS_WINDOW = 0.2
KNOBS_OFF_IN_A_BASELINE = ("precision", "compile", "checkpointing", "cudnn_benchmark")


def train_losses(job: Path) -> dict[int, float]:
    """step -> train loss of the run that ended (:func:`perfrun.report.metrics_file.train_records`)."""
    return {r["step"]: float(r["loss"]) for r in train_records(job) if isinstance(r.get("loss"), (int, float))}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if finite(a) and finite(b) and b else None  # type: ignore[operator]


def loss_parity(knob: dict[int, float], base: dict[int, float], window: float) -> dict[str, Any]:
    """Relative difference of the tail-mean train loss (see the module doc), and the curve's max."""
    common = sorted(set(knob) & set(base))
    if not common:
        return {"steps": [], "rel_diff": None, "max_rel_diff": None}
    k = max(1, math.ceil(window * len(common)))
    tail = common[-k:]
    mean_knob = sum(knob[s] for s in tail) / k
    mean_base = sum(base[s] for s in tail) / k
    rel = (mean_knob - mean_base) / abs(mean_base) if mean_base else None
    diffs = [abs(knob[s] - base[s]) / abs(base[s]) for s in common if base[s]]
    return {
        "steps": [tail[0], tail[-1]], "records": k, "loss": mean_knob, "baseline_loss": mean_base,
        "rel_diff": rel, "max_rel_diff": max(diffs) if diffs else None,
    }


def _baseline_notes(base: Row | None) -> list[str]:
    """Why the ratios cannot be trusted (or computed) against this baseline, if they cannot."""
    if base is None or base.status != "completed":
        return ["no completed baseline job (+ablation=baseline), so no ratio or parity can be computed"]
    notes = []
    source = base.peak_mem_source or ""
    if source and not source.startswith("cuda"):
        notes.append(f"peak memory is {source}: the whole process, which keeps what earlier jobs of the sweep "
                     "left in its allocator, so memory ratios after the first job are upper bounds")
    on = {k: v for k, v in base.knobs.items() if k in KNOBS_OFF_IN_A_BASELINE and v not in ("none", False, None)}
    if on:
        notes.append("the baseline job is not a baseline: " + ", ".join(f"{k}={v}" for k, v in on.items())
                     + " (an override on the command line wins over the preset; drop it)")
    return notes


def _knob(r: Row, name: str | None, base: Row | None, base_curve: dict[int, float], report: Report,
          loss_tol: float, loss_window: float) -> dict[str, Any]:
    """One knob's line of the ablation: its figures, its ratios to the baseline, its parity."""
    done = r.status == "completed" and base is not None and base.status == "completed"
    parity = loss_parity(train_losses(report.paths[r.job]), base_curve, loss_window) if done else {}
    rel = parity.get("rel_diff")
    return {
        "knob": name, "job": r.job, "status": r.status,
        "tokens_per_s": r.tokens_per_s,
        "speedup": _ratio(r.tokens_per_s, base.tokens_per_s) if done else None,  # type: ignore[union-attr]
        "peak_mem_mib": r.peak_mem_mib,
        "mem_ratio": _ratio(r.peak_mem_mib, base.peak_mem_mib) if done else None,  # type: ignore[union-attr]
        "first_step_s": r.first_step_s,
        "loss": parity.get("loss"),
        "loss_rel_diff": rel,
        "loss_max_rel_diff": parity.get("max_rel_diff"),
        "loss_steps": parity.get("steps"),
        "loss_records": parity.get("records"),
        "parity": ("n/a" if rel is None else "ok" if abs(rel) <= loss_tol else "EXCEEDED"),
    }


def ablations(report: Report, *, loss_tol: float, loss_window: float) -> list[dict[str, Any]]:
    """Per root that ran ``+ablation=...`` jobs with a baseline: each knob against the baseline."""
    out = []
    for root in dict.fromkeys(r.root for r in report.rows):
        rows = [r for r in report.rows if r.root == root]
        named = {r.job: dict(override_key(o) for o in r.overrides).get(ABLATION_KEY) for r in rows}
        rows = [r for r in rows if named[r.job] is not None]
        if not rows:
            continue
        base = next((r for r in rows if named[r.job] == BASELINE), None)
        base_curve = train_losses(report.paths[base.job]) if base and base.status == "completed" else {}
        out.append({
            "root": root, "baseline": base.job if base else None, "loss_tol": loss_tol, "loss_window": loss_window,
            "device_name": base.device_name if base else None, "software": base.software if base else None,
            "peak_mem_source": base.peak_mem_source if base else None,
            "knobs": [_knob(r, named[r.job], base, base_curve, report, loss_tol, loss_window) for r in rows],
            "notes": _baseline_notes(base),
        })
    return out
