"""Which configuration ``perfrun report PATH --as TRAINER`` translates, and what perfrun
measured each of its knobs to buy.

For a run: its recorded configuration. For a ladder: the verdict's configuration (the rung it
was measured as), or ``--rung NAME``'s. For a sweep without a ladder: its best job, where one
beats the rest outside the noise. Everything is read from the jobs' summary.json as data;
no recorded ``target`` is imported (:func:`perfrun.ladder.translations.check` refuses a value
perfrun does not write).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perfrun.ladder.recorded import check, default
from perfrun.ladder.verdict import CUDA_ONLY, flat
from perfrun.report.noise import Effect
from perfrun.report.rows import Report, ReportError, Row, finite, override_key
from perfrun.summary import read_summary

#: configuration keys that are no knob: left out of the perfrun train line and of the figures
NOT_KNOBS = ("ablation", "seed", "repeat", "hydra")


@dataclass
class Answer:
    """A configuration to translate, where it comes from, and what its knobs bought."""

    config: dict[str, Any]  # translations.check's keys
    source: str  # what it is, in words
    line: str  # the perfrun train line, each word quoted for a shell
    effects: dict[str, str] = field(default_factory=dict)  # key -> what perfrun measured it to buy
    headline: str | None = None  # the configuration's own figure against the naive trainer


def answer(report: Report, given: str, rung: str | None = None, ladder: dict[str, Any] | None = None) -> Answer:
    """The configuration ``--as`` translates for the directory ``given``: ``ladder``'s (the
    report's first where None) where it holds one, else its run or best job."""
    if ladder is not None or report.ladders:
        return _of_ladder(report, given, ladder or report.ladders[0], rung)
    if rung is not None:
        raise ReportError(f"--rung {rung}: {given} is not a ladder (perfrun train -m +sweep=ablation); drop --rung")
    if len(report.rows) == 1:
        row = report.rows[0]
        return _of_job(report, row, f"the run {given}", _run_line(row))
    best = next((r for r in report.rows if r.best), None)
    if best is None:
        raise ReportError(f"{given} is a sweep without a ladder and no job in it beats the others outside the noise; "
                          f"give one job's dir (e.g. {Path(given) / report.rows[0].job})")
    return _of_job(report, best, f"the best job ({best.job}) of the sweep {given}", _run_line(best))


def _summary(report: Report, row: Row) -> dict[str, Any]:
    try:
        s = dict(read_summary(report.paths[row.job]))
    except (OSError, ValueError) as e:
        raise ReportError(f"{row.job}: summary.json cannot be read ({e}); give a run whose summary.json is intact") from e
    if not isinstance(s.get("config"), dict):
        raise ReportError(f"{row.job}: summary.json records no configuration; give a run written by perfrun train")
    return s


def _derived(s: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What setup resolved and summary.json keeps beside the configuration: fused AdamW, the
    device and the batch a batch_size=auto run found."""
    env = s.get("environment") if isinstance(s.get("environment"), dict) else {}
    device = str(env.get("device") or "cpu").split(":")[0]
    fused = s.get("fused_adamw")
    if not isinstance(fused, bool):  # older summaries: the configuration's choice
        choice = config.get("optim.fused", default("optim.fused"))
        fused = choice == "true" or (choice == "auto" and device in ("cpu", "cuda"))
    found = s.get("batch_size_auto") if isinstance(s.get("batch_size_auto"), dict) else {}
    batch = found.get("batch_size") if found else config.get("dataloader.batch_size", default("dataloader.batch_size"))
    return {"fused_adamw": fused, "device_type": device, "batch_size": batch}


def _checked(s: dict[str, Any], job: str) -> dict[str, Any]:
    config = flat(s["config"])
    try:
        return check({**config, **_derived(s, config)})
    except ValueError as e:
        raise ReportError(f"{job}: summary.json's configuration has {e} (changed by hand or by another "
                          "program); translate a run as perfrun wrote it") from e


def _of_job(report: Report, row: Row, source: str, line: str) -> Answer:
    s = _summary(report, row)
    tps = s.get("tokens_per_s_median")
    where = f" on {row.device_name}" if row.device_name else ""
    headline = f"{tps:,.0f} tokens/s (the median of its steady steps){where}" if finite(tps) else None
    return Answer(_checked(s, row.job), source, line, headline=headline)


def _run_line(row: Row) -> str:
    """The overrides the run was started with, quoted for a shell."""
    words = [o for o in row.overrides if override_key(o)[0] not in ("repeat", "hydra") and not o.startswith("hydra.")]
    return " ".join(["perfrun train", *map(shlex.quote, words)])


def _rung_rows(report: Report, ladder: dict[str, Any]) -> dict[str, list[Row]]:
    by: dict[str, list[Row]] = {}
    for r in report.rows:
        if r.root == ladder["root"] and r.ablation.get("rung"):
            by.setdefault(str(r.ablation["rung"]), []).append(r)
    return by


def _of_ladder(report: Report, given: str, ladder: dict[str, Any], rung: str | None) -> Answer:
    rec = ladder["recommended"]
    by_rung = _rung_rows(report, ladder)
    if rung is None:
        if "measured_as" not in rec:
            raise ReportError(f"{given}: the ladder recommends no measured configuration ({rec.get('why')}); "
                              f"give --rung NAME, one of: {', '.join(by_rung)}")
        rung = str(rec["measured_as"])
    if rung not in by_rung:
        raise ReportError(f"--rung {rung} is not a rung of {given}; its rungs: {', '.join(by_rung)}")
    rows = [r for r in by_rung[rung] if r.status == "completed"] or by_rung[rung]
    s = _summary(report, rows[0])
    config = _checked(s, rows[0].job)
    configs = {name: c for name, rs in by_rung.items() if (c := _first_config(report, rs)) is not None}
    configs[rung] = flat(s["config"])
    entries = {e["rung"]: e for part in ("ladder", "alternatives", "leave_one_out") for e in ladder[part]}
    verdict = rung == rec.get("measured_as")
    source = (f"the verdict of the ladder {given} (measured as its rung {rung})" if verdict
              else f"the rung {rung} of the ladder {given}")
    line = _quoted_line(configs[rung], _line_keys(rung, configs, rec["line"] if verdict else None, ladder.get("device")))
    e = entries.get(rung)
    headline = None
    if e is not None and e.get("vs_baseline") is not None:
        speed = Effect(e["vs_baseline"], e["vs_baseline_noise_pct"], e["vs_baseline_measurable"],
                       e.get("vs_baseline_single", False)).text()
        headline = f"{speed} the naive trainer's tokens/s ({e['n']} run(s) of {rung})"
    return Answer(config, source, line, _effects(ladder, configs, rung), headline)


def _first_config(report: Report, rows: list[Row]) -> dict[str, Any] | None:
    """A rung's configuration from the first of its jobs whose summary.json can be read (a
    killed job's missing file leaves the figures of the others standing)."""
    for row in rows:
        try:
            return flat(_summary(report, row)["config"])
        except ReportError:
            continue
    return None


def _quoted_line(config: dict[str, Any], keys: list[str]) -> str:
    """``perfrun train KEY=VALUE ...`` for ``keys``, every word quoted for a shell."""
    words = [f"{k}={spelt(config.get(k))}" for k in keys if k.split(".")[0] not in NOT_KNOBS]
    return " ".join(["perfrun train", *map(shlex.quote, words)])


def _line_keys(rung: str, configs: dict[str, dict[str, Any]], verdict_line: str | None, device: str | None) -> list[str]:
    """The keys of a rung's perfrun train line: the verdict's own where it is the verdict; else,
    as the verdict line chooses them, the keys the ladder's rungs differ in where this rung
    differs from perfrun's defaults (the CUDA-only ones on CUDA alone)."""
    from perfrun.config import TrainConfig, as_dict

    config = configs[rung]
    if verdict_line is not None:
        return [k for k in (override_key(w)[0] for w in verdict_line.split()[2:] if "=" in w) if k in config]
    defaults = flat(as_dict(TrainConfig()))
    varying = [k for k in dict.fromkeys(k for c in configs.values() for k in c)
               if len({repr(c.get(k)) for c in configs.values()}) > 1]
    return [k for k in varying if config.get(k) != defaults.get(k) and (device == "cuda" or k not in CUDA_ONLY)]


def _against_below(e: dict[str, Any]) -> str:
    """A rung's verdict, said against the rung below where it is an effect (not where it was not ranked)."""
    return f"{e['verdict']} on the rung below" if e.get("vs_below") is not None else e["verdict"]


def spelt(v: Any) -> str:
    """A value as an override spells it: true, null, 8, bf16."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _effects(ladder: dict[str, Any], configs: dict[str, dict[str, Any]], chosen: str) -> dict[str, str]:
    """Per key: what each rung that changed it measured, against the rung below it (the ladder,
    an alternative), the top rung without it (leave-one-out), and the memory trade-offs. A rung
    that set the key to another value than ``chosen``'s says which."""
    out: dict[str, list[str]] = {}
    mine = configs[chosen]

    def add(rung: str, against: str | None, text: str, same: str = "rung {rung}") -> None:
        if against is None or rung not in configs or against not in configs:
            return
        a, b = configs[rung], configs[against]
        for k in dict.fromkeys([*a, *b]):
            if a.get(k) != b.get(k) and k.split(".")[0] not in NOT_KNOBS:
                where = same.format(rung=rung) if a.get(k) == mine.get(k) else f"{k}={spelt(a.get(k))} (rung {rung})"
                out.setdefault(k, []).append(text.format(where=where))

    below = None
    applied = [e for e in ladder["ladder"] if e["applicable"]]
    for e in applied:
        if e["rung"] != "naive":
            add(e["rung"], below, f"{{where}}: {_against_below(e)}")
        below = e["rung"]
    for e in ladder["alternatives"]:
        base = max((x for x in applied if x["step"] < (e["step"] or 0)), key=lambda x: x["step"], default=None)
        add(e["rung"], base["rung"] if base else None, f"{{where}}, in place of {e.get('knob')}: {_against_below(e)}")
    top = ladder.get("top")
    for e in ladder["leave_one_out"]:
        if e["applicable"]:
            add(e["rung"], top, f"the top rung with {{where}}: {e['verdict']}", "this value (rung {rung})")
    for t in ladder["tradeoffs"]:
        if t.get("rung") and t.get("peak_mem_mib") is not None and t.get("rung") != top:
            words = f"peak memory {t['peak_mem_mib']:,.0f} MiB"
            if t.get("tokens_per_s") is not None:
                words += f" at {t['tokens_per_s']:,.0f} tokens/s"
            if t.get("largest_batch") is not None:
                words += f", largest batch {t['largest_batch']:g}"
            add(t["rung"], top, f"the top rung with {{where}}, a memory trade-off: {words}", "this value (rung {rung})")
    return {k: "; ".join(v) for k, v in out.items()}
