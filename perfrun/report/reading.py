"""Reading run, sweep and tune directories into a Report.

One source of truth: every row is read back from a job's ``summary.json`` through
:func:`perfrun.summary.read_summary`. A key that one job set on its command line and
another left at its default is shown with the value the other job ran with, read from its
composed configuration (Hydra's record of the group options in ``.hydra/hydra.yaml``, the
``config`` of its summary.json, or ``.hydra/config.yaml``), not as a blank.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfrun.report.noise import Spread, clear_winner, effect, spread
from perfrun.report.rows import Report, ReportError, Row, finite, how_run, override_key
from perfrun.summary import SUMMARY_FILE, read_summary, shape_problem


def _natural(path: Path) -> list[Any]:
    """Sort key: job 10 after job 9."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path.as_posix())]


def job_dirs(root: Path) -> list[Path]:
    """The job dirs under ``root``: those with a summary.json or a Hydra job record."""
    if (root / SUMMARY_FILE).is_file():
        return [root]
    found = {p.parent for p in root.rglob(SUMMARY_FILE)}
    found |= {p.parent.parent for p in root.rglob(".hydra/overrides.yaml")}
    found.discard(root)
    return sorted(found, key=lambda p: _natural(p.relative_to(root)))


def _yaml(path: Path) -> Any:
    """A YAML file Hydra wrote into a job dir, or None when it is absent or unreadable."""
    import yaml

    if not path.is_file():
        return None
    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _read_overrides(job: Path) -> list[str]:
    data = _yaml(job / ".hydra" / "overrides.yaml")
    return [str(o) for o in data] if isinstance(data, list) else []


def read_row(job: Path, label: str, root_label: str) -> Row:
    """One row from ``job/summary.json``; a missing or unreadable file becomes a row that says so."""
    empty = dict(tokens_per_s=None, mfu=None, peak_mem_mib=None, host_data_wait_pct=None,
                 final_train_loss=None, final_val_loss=None, first_step_s=None)
    if not (job / SUMMARY_FILE).is_file():
        return Row(label, root_label, _read_overrides(job), "missing",
                   "no summary.json: the job was killed before it could write one (see its train.log)", **empty)
    try:
        s = read_summary(job)
    except (OSError, ValueError) as e:
        return Row(label, root_label, _read_overrides(job), "unreadable", f"summary.json: {e}", **empty)
    problem = shape_problem(s)
    if problem is not None:  # not the shape perfrun writes (hand-edited, another tool's): said, not drawn
        return Row(label, root_label, _read_overrides(job), "unreadable",
                   f"{job / SUMMARY_FILE} is not a perfrun summary: {problem}", **empty)
    status = str(s.get("status", "unknown"))
    reason = s.get("reason")
    if status == "interrupted":  # stopped on a signal (Ctrl-C, SIGTERM): not a failure; resume=auto goes on
        status = "stopped"
    if status not in ("completed", "failed") and reason is None:
        reason = "the job stopped without finishing (interrupted or crashed; see its train.log)"
    env = s.get("environment") or {}
    config = s.get("config") if isinstance(s.get("config"), dict) else {}
    contention = s.get("contention") if isinstance(s.get("contention"), dict) else {}
    return Row(
        job=label, root=root_label, overrides=[str(o) for o in s.get("overrides") or _read_overrides(job)],
        status=status, reason=reason,
        tokens_per_s=s.get("tokens_per_s_median"), mfu=s.get("mfu_median"), peak_mem_mib=s.get("peak_mem_mib"),
        host_data_wait_pct=s.get("host_data_wait_pct", s.get("data_wait_pct")),
        final_train_loss=s.get("final_train_loss"),
        final_val_loss=s.get("final_val_loss"), first_step_s=s.get("first_step_s"),
        peak_mem_source=s.get("peak_mem_source"), device_name=env.get("device_name"),
        software=(f"torch {env['torch']}" + (f", CUDA {env['cuda']}" if env.get("cuda") else "")) if env.get("torch") else None,
        knobs=s.get("knobs") or {}, repeat=_int(config.get("repeat")), ablation=dict(config.get("ablation") or {}),
        contended=contention.get("contended"), contention=list(contention.get("evidence") or []),
        device_type=env.get("device_type") or _device_type(env), gpu_starved_pct=s.get("gpu_starved_pct"),
    )


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _device_type(env: dict[str, Any]) -> str | None:
    """cuda or cpu from the environment block (the device it ran on, as torch names it)."""
    device = str(env.get("device") or "")
    return device.split(":")[0] or None


def _spelt(value: Any) -> str:
    """A configuration value as an override spells it: true, null, 8, bf16."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(_spelt(v) for v in value) + "]"
    return str(value)


_ABSENT = object()


def _dig(node: Any, key: str) -> Any:
    """``node["a"]["b"]`` for ``key`` ``a.b``; _ABSENT where a part is missing."""
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def effective_value(job: Path, key: str) -> str | None:
    """The value ``job`` ran with for ``key`` (a group's option or a dotted key); None when
    the job left no record of it (no summary config, no .hydra folder)."""
    choice = _dig(_yaml(job / ".hydra" / "hydra.yaml"), f"hydra.runtime.choices.{key}")
    if choice is not _ABSENT and choice is not None:
        return str(choice)
    try:
        config: Any = read_summary(job).get("config")
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict):
        config = _yaml(job / ".hydra" / "config.yaml")
    value = _dig(config, key)
    if isinstance(value, dict):  # a group's node: the option it was composed from names itself
        value = value.get("name", _ABSENT)
    return None if value is _ABSENT else _spelt(value)


def swept_keys(rows: Sequence[Row]) -> list[str]:
    """Override keys whose value is not the same in every row, in order of appearance
    (``resume`` and ``hydra.*`` left out: how a job was run, not what it measured)."""
    values: dict[str, set[str | None]] = {}
    parsed = [{k: v for k, v in map(override_key, r.overrides) if not how_run(k)} for r in rows]
    for p in parsed:
        for k in p:
            values.setdefault(k, set())
    for k in values:
        values[k] = {p.get(k) for p in parsed}
    return [k for k, v in values.items() if len(v) > 1]


def _fill_swept(rows: Sequence[Row], keys: list[str], dirs: dict[str, Path]) -> list[str]:
    """Each row's value of each swept key (the effective one where its command line did not
    set it); returns the keys whose values still differ between the rows."""
    for r in rows:
        parsed = dict(override_key(o) for o in r.overrides)
        r.swept = {k: r.root if k == "source" else parsed[k] if k in parsed else effective_value(dirs[r.job], k)
                   for k in keys}
    varying = [k for k in keys if k == "source" or len({r.swept[k] for r in rows}) > 1]
    for r in rows:
        r.swept = {k: r.swept[k] for k in varying}
    return varying


def _rows_of(given: Path | str, several: bool, dirs: dict[str, Path]) -> list[Row]:
    """The rows of one directory the user named; ``dirs`` gets each job's folder."""
    root = Path(given)
    if root.is_file() and root.name == SUMMARY_FILE:
        root = root.parent
    if not root.exists():
        raise ReportError(f"{given} does not exist; give a run, sweep or tune directory (e.g. outputs/multirun/DATE/TIME)")
    if not root.is_dir():
        raise ReportError(f"{given} is a file, not a run or sweep directory; give the directory that holds summary.json")
    jobs = job_dirs(root)
    if not jobs:
        raise ReportError(f"{given} holds no summary.json: it is not a perfrun run, sweep or tune directory")
    root_label = str(given) if several else ""  # one dir: nothing depends on how it was spelt
    rows = []
    for job in jobs:
        rel = job.relative_to(root).as_posix()
        label = root.name if rel == "." else rel
        if several:
            label = root_label if rel == "." else f"{root_label}/{rel}"
        rows.append(read_row(job, label, root_label))
        dirs[label] = job
    return rows


@dataclass
class Group:
    """The repeats of one configuration: jobs whose overrides differ only in ``repeat``."""

    overrides: list[str]
    jobs: list[str]
    tps: Spread  # over the completed jobs measured to have had the machine to themselves
    contended: int
    best: bool = False
    verdict: str = ""  # against the best group: an effect, or no measurable one
    unknown: int = 0  # completed jobs whose sharing of the machine is unknown (not counted)


def group_repeats(rows: Sequence[Row]) -> list[Group]:
    """Rows grouped by their overrides less ``repeat=...``, in order of first appearance."""
    by: dict[tuple[str, str, tuple[str, ...]], list[Row]] = {}
    for r in rows:
        key = tuple(o for o in r.overrides if override_key(o)[0] != "repeat")
        by.setdefault((r.root, r.device_name or "", key), []).append(r)
    return [Group(list(k[2]), [r.job for r in members],
                  spread(r.tokens_per_s for r in members if r.status == "completed" and r.quiet),
                  sum(1 for r in members if r.contended), unknown=sum(1 for r in members if r.machine_unknown))
            for k, members in by.items()]


def _rank(rows: list[Row], groups: list[Group]) -> str | None:
    """Each group against the fastest median; the best group (and its fastest job) is marked
    only where it beats every other outside the noise; contended jobs never count. Returns
    the best job's label."""
    measured = [g for g in groups if g.tps.median is not None]
    if not measured:
        return None
    fastest = max(measured, key=lambda g: g.tps.median)  # type: ignore[arg-type,return-value]
    winner = clear_winner({str(i): g.tps for i, g in enumerate(groups)})
    for g in measured:
        g.verdict = ("best" if winner is not None else "fastest median, inside the others' noise") if g is fastest \
            else effect(g.tps, fastest.tps).text()
    if winner is None:
        return None
    fastest.best = True
    members = [r for r in rows if r.job in fastest.jobs and r.status == "completed" and r.quiet
               and finite(r.tokens_per_s)]
    top = max(members, key=lambda r: r.tokens_per_s)  # type: ignore[arg-type,return-value]
    top.best = True
    return top.job


def load(paths: Sequence[Path | str]) -> Report:
    """Rows of every job under ``paths``, with the swept keys, the repeats grouped and the best
    (outside the noise). A ladder among them is read by :func:`perfrun.ladder.analysis.read_sweep`,
    which fills ``report.ladders``: the ladder builds on this package, not this package on it."""
    dirs: dict[str, Path] = {}
    rows = [row for given in paths for row in _rows_of(given, len(paths) > 1, dirs)]
    keys = swept_keys(rows)
    if len(paths) > 1 and len({r.root for r in rows}) > 1:
        keys = ["source", *keys]
    keys = [k for k in _fill_swept(rows, keys, dirs) if k != "repeat"]
    groups = group_repeats(rows)
    report = Report(rows, keys, _rank(rows, groups), paths=dirs)
    report.groups = groups
    return report
