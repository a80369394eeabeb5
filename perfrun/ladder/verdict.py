"""The ladder's verdict: which measured configuration to run, and the line that says so.

Rules (tests/test_verdict.py holds the code to them over generated sweeps):

- only a measured configuration is recommended (a rung, an alternative or the top without one
  knob) that is within loss parity; its figures are its own;
- the fastest median wins; a configuration with fewer knobs replaces it only where the two are
  known to be within the noise (``measurable is False``): an effect that is unknown (single
  runs, the machine's noise not measured) is not a tie;
- the recommendation is never measurably slower than another measured, parity-ok
  configuration with the same or fewer knobs;
- a job counts only where it was measured to have had the machine (contended: no; unknown: no);
- with the naive trainer missing, contended, unknown or failed, the verdict says so, names what to
  rerun, and states its speed against the fastest uncontended entry instead of "n/a".
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from itertools import pairwise
from typing import Any, Protocol

from perfrun.console import hydra_quoted
from perfrun.report.noise import Effect, Spread, effect
from perfrun.report.rows import Row


class _Rungs(Protocol):
    """What the verdict reads of a ladder's jobs (perfrun.ladder.analysis._Rungs)."""

    by_rung: dict[str, list[Row]]
    outliers: dict[str, float]
    floor: float | None
    device: str | None

    def counted(self, rung: str) -> list[Row]: ...
    def tps(self, rung: str) -> Spread: ...
    def config(self, rung: str) -> dict[str, Any]: ...

#: knobs that act on CUDA alone: a line to paste for another device leaves them out
CUDA_ONLY = ("precision.tf32", "dataloader.pin_memory", "dataloader.device_input")
#: what to run again when the naive trainer could not be measured
RERUN_BASELINE = "perfrun train -m +sweep=ablation +ablation=naive,naive_seed"


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested configuration as dotted keys."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for k, v in node.items():
        out.update(flat(v, f"{prefix}{k}."))
    return {k.rstrip("."): v for k, v in out.items()}


def _spelt(v: Any) -> str:
    """``v`` as an override's value that composes back to it when the line is pasted: a
    string the override grammar would not read back as itself (a space, a comma, a quote)
    is quoted; ``true`` for a string key stays bare (the schema reads it as that option)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    text = str(v)
    return text if not isinstance(v, str) or _reads_back(text) else hydra_quoted(text)


def _reads_back(text: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_override(f"key={text}")
    except Exception:  # noqa: BLE001 - any parse error: the value needs quoting
        return False
    value = override.value()
    plain = value == text and "${" not in text  # an interpolation would be resolved, not kept
    return not override.is_sweep_override() and (plain or not isinstance(value, str | list | dict))


def _knob_keys(configs: list[dict[str, Any]]) -> list[str]:
    """The configuration keys the measured jobs differ in: the knobs, in the first's order."""
    keys = dict.fromkeys(k for c in configs for k in c)
    return [k for k in keys if len({repr(c.get(k)) for c in configs}) > 1]


def _line_to_paste(config: dict[str, Any], keys: list[str]) -> str:
    """``perfrun train KEY=VALUE ...``: the knobs where ``config`` differs from perfrun's
    defaults, so that the line runs exactly the configuration that was measured; each word
    quoted for the shell where it must be, as the line is pasted into one."""
    from perfrun.config import TrainConfig, as_dict

    defaults = flat(as_dict(TrainConfig()))  # the dataclasses' own defaults: no schema tree to build
    changed = [shlex.quote(f"{k}={_spelt(config.get(k))}") for k in keys if config.get(k) != defaults.get(k)]
    return " ".join(["perfrun train", *changed])


def baseline_state(rs: _Rungs) -> dict[str, Any]:
    """Whether the naive trainer's speed stands: ``state`` measured | missing | contended |
    outlier | failed, ``why`` in words, and ``rerun`` (the command) where it does not."""
    rows = rs.by_rung.get("naive", [])
    if rs.counted("naive"):
        return {"state": "measured", "why": None, "rerun": None}
    if not rows:
        state, why = "missing", "no naive job was run (+ablation=naive)"
    elif any(r.contended for r in rows):
        state, why = "contended", f"its {sum(1 for r in rows if r.contended)} job(s) shared the machine"
    elif any(r.machine_unknown for r in rows):
        state, why = "unknown", (f"whether its {sum(1 for r in rows if r.machine_unknown)} job(s) had the machine "
                                 "is unknown (no contention figures)")
    elif any(r.job in rs.outliers for r in rows):
        state, why = "outlier", "its jobs were outliers of one another"
    else:
        state, why = "failed", "no naive job completed"
    return {"state": state, "why": why, "rerun": RERUN_BASELINE}


def _never_slower(chosen: dict[str, Any], measured: list[dict[str, Any]], knobs: Callable[[dict[str, Any]], int],
                  eff: Callable[[dict[str, Any], dict[str, Any]], Effect]) -> dict[str, Any]:
    """``chosen``, or the fastest configuration with as many knobs or fewer that it is
    measurably slower than (repeated until none is; the median rises each time)."""
    while True:
        faster = [e for e in measured if e is not chosen and knobs(e) <= knobs(chosen)
                  and e["tokens_per_s"] > chosen["tokens_per_s"] and eff(chosen, e).measurable]
        if not faster:
            return chosen
        chosen = max(faster, key=lambda e: e["tokens_per_s"])


def _effect_keys(prefix: str, e: Effect) -> dict[str, Any]:
    return {prefix: e.ratio, f"{prefix}_noise_pct": e.noise_pct, f"{prefix}_measurable": e.measurable,
            f"{prefix}_single": e.single}


def recommend(rs: _Rungs, ladder: list[dict[str, Any]], others: list[dict[str, Any]]) -> dict[str, Any]:
    """The configuration to run (see the module's rules), with its figures and what they stand on."""
    measured = [e for e in (*ladder, *others) if e["applicable"] and e["n"] and e.get("parity") != "FLAGGED"]
    climbed = [e for e in ladder if e["step"] and e["applicable"]]
    base = baseline_state(rs)
    stands = {"baseline": base["state"], "baseline_why": base["why"], "rerun": base["rerun"],
              "machine_noise_pct": rs.floor}
    if not measured:
        unranked = all(e["n"] == 0 and (e["contended"] or e.get("unknown")) for e in ladder if e["applicable"])
        return {"knobs": [], "dropped": [e["rung"] for e in climbed], "line": "perfrun train", **stands,
                "why": "no rung can be ranked: every job shared the machine (contended)"
                + (" or was not measured for it (unknown)" if any(e.get("unknown") for e in ladder) else "")
                + "; rerun on a quiet machine"
                if unranked else "no job was measured (no completed, uncontended job within loss parity)"}
    configs = {e["rung"]: rs.config(e["rung"]) for e in measured}
    naive = configs.get("naive") or (rs.config("naive") if "naive" in rs.by_rung else {})
    keys = [k for k in _knob_keys([naive, *configs.values()]) if rs.device == "cuda" or k not in CUDA_ONLY]

    def knobs(e: dict[str, Any]) -> int:
        return sum(configs[e["rung"]].get(k) != naive.get(k) for k in keys)

    def eff(a: dict[str, Any], b: dict[str, Any]) -> Effect:
        return effect(rs.tps(a["rung"]), rs.tps(b["rung"]), rs.floor)

    best = max(measured, key=lambda e: e["tokens_per_s"])
    tied = [e for e in measured if e is best or eff(e, best).measurable is False]
    chosen = _never_slower(min(tied, key=lambda e: (knobs(e), -e["tokens_per_s"])), measured, knobs, eff)
    config = configs[chosen["rung"]]
    on = [e["rung"] for below, e in pairwise(ladder) if e in climbed and _has(config, rs, below["rung"], e["rung"])]
    out = {
        "knobs": on, "dropped": [e["rung"] for e in climbed if e["rung"] not in on],
        "line": _line_to_paste(config, keys), "measured_as": chosen["rung"], "measured_exactly": True,
        "fastest": best["rung"], "tokens_per_s": chosen["tokens_per_s"], "n": chosen["n"],
        "spread_pct": chosen["spread_pct"], "speedup": chosen["vs_baseline"],
        "noise_pct": chosen["vs_baseline_noise_pct"], "measurable": chosen["vs_baseline_measurable"],
        "single": chosen.get("vs_baseline_single", False), "peak_mem_mib": chosen["peak_mem_mib"],
        "parity": chosen.get("parity"), "loss_rel_diff": chosen.get("loss_rel_diff"),
        "fastest_vs_naive": Effect(best["vs_baseline"], best["vs_baseline_noise_pct"], best["vs_baseline_measurable"],
                                   best.get("vs_baseline_single", False)).text() if best["rung"] != "naive" else None,
        **stands,
    }
    if base["state"] != "measured":  # no baseline: the fastest uncontended entry is the reference
        out.update(reference=best["rung"], **_effect_keys("vs_reference", eff(chosen, best)))
    return out


def against_reference(rs: _Rungs, entries: list[dict[str, Any]], reference: str | None) -> None:
    """Each entry's speed against ``reference`` (the fastest uncontended entry, where the
    naive trainer's speed does not stand); None everywhere where it does."""
    ref = rs.tps(reference) if reference else Spread(0, None, None, None)
    for e in entries:
        measured = e["applicable"] and reference is not None
        e.update(_effect_keys("vs_reference", effect(rs.tps(e["rung"]), ref, rs.floor) if measured
                              else Effect(None, None, None)))


def _has(config: dict[str, Any], rs: _Rungs, below: str, rung: str) -> bool:
    """Whether ``config`` holds what ``rung`` changed from the rung ``below`` it."""
    under, mine = rs.config(below), rs.config(rung)
    changed = {k: v for k, v in mine.items() if under.get(k) != v}
    return bool(changed) and all(config.get(k) == v for k, v in changed.items())


def verdict_line(rec: dict[str, Any], base_mem: float | None) -> str:
    """The sweep's last line: what to run, and what it bought; what follows the command is a
    shell comment, so the line after ``verdict: `` runs as pasted."""
    if "measured_as" not in rec:
        return f"verdict: {rec['line']}  # the defaults: {rec.get('why', '')}"  # after '  # ': a shell comment
    mem = f"{rec['peak_mem_mib']:,.0f} MiB" if rec.get("peak_mem_mib") is not None else "n/a"
    if base_mem and rec.get("peak_mem_mib") is not None:
        mem += f" ({rec['peak_mem_mib'] / base_mem:.2f}× the naive trainer's)"
    rel = rec.get("loss_rel_diff")
    loss = f"loss {rel:+.2%} ({rec.get('parity')})" if rel is not None else "loss parity n/a"
    if rec.get("baseline", "measured") != "measured":
        runs = "1 run" if rec["n"] < 2 else f"{rec['n']} runs, ±{rec['spread_pct']:.1f}%"
        if rec["measured_as"] == rec["reference"]:
            against = "the fastest uncontended entry"
        else:
            vs = Effect(rec["vs_reference"], rec["vs_reference_noise_pct"], rec["vs_reference_measurable"],
                        rec["vs_reference_single"])
            against = f"{vs.text()} the fastest uncontended entry ({rec['reference']})"
        return (f"verdict: {rec['line']}  # {rec['tokens_per_s']:,.0f} tokens/s ({runs}) measured as "
                f"{rec['measured_as']}, {against}; "
                f"no speed-up over the naive trainer: {rec['baseline_why']}; rerun: {rec['rerun']}; "
                f"peak memory {mem}, {loss}")
    if rec["measured_as"] == "naive":
        fastest = f" (the fastest, {rec['fastest']}: {rec['fastest_vs_naive']})" if rec.get("fastest_vs_naive") else ""
        return (f"verdict: {rec['line']}  # the naive trainer: no configuration measured here was faster outside "
                f"the noise{fastest}; peak memory {mem}")
    speed = Effect(rec["speedup"], rec["noise_pct"], rec["measurable"], rec.get("single", False)).text()
    return (f"verdict: {rec['line']}  # {speed} the naive trainer's tokens/s (measured as {rec['measured_as']}), "
            f"peak memory {mem}, {loss}")
