"""perfrun report on run dirs written by hand (no training: fast): rows come from each
summary.json, CSV/JSON/HTML agree with them, one column specification gives the same
columns in every format (the ladder's maths: test_ladder.py), bad paths get one
line, and no matplotlib means one warning, not a crash. One test trains two tiny runs to
show the effective value of a key one of them left at its default."""

from __future__ import annotations

import csv
import html
import io
import json
import re
import sys
from pathlib import Path

import pytest
from test_ladder import plant_ladder

from perfrun import report
from perfrun.commands.report import main as report_main
from perfrun.commands.train import train_main
from perfrun.console import kept_logging
from perfrun.ladder import sweep_files
from perfrun.ladder.analysis import read_sweep
from perfrun.ladder.callback import SweepSummary
from perfrun.report.columns import LADDER_COLUMNS, run_columns, shown
from perfrun.report.render import sections

from conftest import TINY_MODEL


def make_job(
    job: Path, overrides: list[str], *, status: str = "completed", tps: float | None = 1000.0,
    mem: float | None = 100.0, losses: dict[int, float] | None = None, first_step: float = 0.5,
    knobs: dict | None = None, reason: str | None = None,
) -> dict:
    """A job dir as perfrun.loop.run.run leaves it: summary.json and metrics.jsonl."""
    job.mkdir(parents=True, exist_ok=True)
    losses = losses or {10: 3.0, 20: 2.5, 30: 2.2, 40: 2.0, 50: 1.9}
    s = {
        "status": status, "overrides": overrides, "tokens_per_s_median": tps if status == "completed" else None,
        "mfu_median": 0.25 if status == "completed" else None, "peak_mem_mib": mem, "data_wait_pct": 1.5,
        "final_train_loss": list(losses.values())[-1], "final_val_loss": 2.0, "first_step_s": first_step,
        "peak_mem_source": "cuda_max_memory_allocated", "environment": {"device_name": "Test GPU 9000"},
        "knobs": knobs or {"precision": "none", "compile": False, "checkpointing": "none", "cudnn_benchmark": False},
        "contention": {"contended": False, "evidence": []},  # every job of run() is assessed
    }
    if reason:
        s["reason"] = reason
    (job / "summary.json").write_text(json.dumps(s))
    lines = [json.dumps({"kind": "train", "step": k, "loss": v}) for k, v in losses.items()]
    (job / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return s


def make_sweep(root: Path) -> list[dict]:
    common = ["model.n_layer=2", "device=cpu"]
    return [
        make_job(root / "0", ["dataloader.batch_size=8", *common], tps=1000.0),
        make_job(root / "1", ["dataloader.batch_size=16", *common], tps=1800.0, mem=180.0),
        make_job(root / "2", ["dataloader.batch_size=32", *common], status="failed", tps=None, mem=None,
                 reason="out of memory on cuda:0"),
        make_job(root / "10", ["dataloader.batch_size=64", *common], tps=1500.0, mem=300.0),
    ]


def test_rows_come_from_each_summary(tmp_path: Path) -> None:
    summaries = make_sweep(tmp_path)
    r = read_sweep([tmp_path])
    assert [row.job for row in r.rows] == ["0", "1", "2", "10"]  # natural order, not 0, 1, 10, 2
    assert r.swept_keys == ["dataloader.batch_size"]  # the common overrides are not "swept"
    for row, s in zip(r.rows, summaries, strict=True):
        assert row.status == s["status"] and row.tokens_per_s == s["tokens_per_s_median"]
        assert row.peak_mem_mib == s["peak_mem_mib"] and row.final_train_loss == s["final_train_loss"]
        assert row.overrides == s["overrides"]
    assert r.best == "1" and [row.best for row in r.rows] == [False, True, False, False]
    assert r.rows[2].reason == "out of memory on cuda:0"


def test_csv_and_json_round_trip_exactly(tmp_path: Path) -> None:
    summaries = make_sweep(tmp_path)
    r = read_sweep([tmp_path])
    rows = list(csv.DictReader(io.StringIO(report.to_csv(r))))
    assert [row["dataloader.batch_size"] for row in rows] == ["8", "16", "32", "64"]
    for row, s in zip(rows, summaries, strict=True):
        expected = s["tokens_per_s_median"]
        assert (float(row["tokens_per_s"]) if row["tokens_per_s"] else None) == expected
        assert row["status"] == s["status"]
    data = json.loads(report.to_json(r))
    assert data["best"] == "1" and [x["tokens_per_s"] for x in data["rows"]] == [s["tokens_per_s_median"] for s in summaries]


def test_table_marks_the_best_and_lists_failures(tmp_path: Path) -> None:
    make_sweep(tmp_path)
    text = report.render_text(read_sweep([tmp_path]), width=200)
    best = [line for line in text.splitlines() if "★" in line and "│" in line]
    assert len(best) == 1 and "dataloader.batch_size=16" in best[0] and "1,800" in best[0]
    assert "2: failed: out of memory on cuda:0" in text
    assert "model.n_layer" not in text.split("┃ job")[1].split("★ best")[0]  # only the swept key per row


def test_missing_and_broken_summaries_become_rows(tmp_path: Path) -> None:
    make_job(tmp_path / "0", ["a=1"])
    (tmp_path / "1" / ".hydra").mkdir(parents=True)
    (tmp_path / "1" / ".hydra" / "overrides.yaml").write_text("- a=2\n")
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "summary.json").write_text('{"status": "compl')  # cut short
    r = read_sweep([tmp_path])
    assert [(row.job, row.status) for row in r.rows] == [("0", "completed"), ("1", "missing"), ("2", "unreadable")]
    assert r.rows[1].overrides == ["a=2"] and "killed" in (r.rows[1].reason or "")


def test_several_dirs_compare(tmp_path: Path) -> None:
    make_sweep(tmp_path / "a")
    make_job(tmp_path / "b", ["dataloader.batch_size=16", "precision=bf16"], tps=2500.0)
    r = read_sweep([tmp_path / "a", tmp_path / "b"])
    assert r.swept_keys[0] == "source" and len(r.rows) == 5
    assert r.best == str(tmp_path / "b")
    assert {row.swept["source"] for row in r.rows} == {str(tmp_path / "a"), str(tmp_path / "b")}


@pytest.mark.parametrize("make, words", [
    (lambda p: p / "nope", "does not exist"),
    (lambda p: (p / "f.txt").write_text("x") and p / "f.txt", "is a file"),
    (lambda p: p, "holds no summary.json"),
])
def test_bad_path_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], make, words: str) -> None:
    assert report_main([str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("perfrun: error: report:") and words in lines[0]


def test_bad_option_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_sweep(tmp_path)
    assert report_main([str(tmp_path), "--csv", "--json"]) == 2
    assert report_main([str(tmp_path), "--loss-tol", "-1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 2 and all(line.startswith("perfrun: error: report:") for line in err)


def test_csv_json_html_and_plot_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_sweep(tmp_path / "s")
    assert report_main([str(tmp_path / "s"), "--csv"]) == 0
    assert capsys.readouterr().out == report.to_csv(read_sweep([tmp_path / "s"]))
    assert report_main([str(tmp_path / "s"), "--json", "--html", str(tmp_path / "r.html"),
                        "--plot", str(tmp_path / "r.png")]) == 0
    assert json.loads(capsys.readouterr().out)["best"] == "1"
    page = (tmp_path / "r.html").read_text()
    assert "<table>" in page and "data:image/png;base64," in page and "1,800" in page
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_one_warning_and_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    make_sweep(tmp_path)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] or ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    sweep_files.write_sweep_summary(tmp_path)
    out, err = capsys.readouterr()
    assert (tmp_path / sweep_files.SWEEP_CSV).is_file() and (tmp_path / sweep_files.SWEEP_JSON).is_file()
    assert not (tmp_path / sweep_files.SWEEP_PNG).exists()
    warnings = [line for line in err.splitlines() if line.strip()]
    assert len(warnings) == 1 and 'pip install "perfrun[plot]"' in warnings[0]
    assert "★" in out


def test_sweep_callback_writes_and_never_raises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from omegaconf import OmegaConf

    make_sweep(tmp_path / "sweep")
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}}))
    assert (tmp_path / "sweep" / sweep_files.SWEEP_PNG).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "sweep" / sweep_files.SWEEP_JSON).read_text())["best"] == "1"
    capsys.readouterr()
    SweepSummary().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "empty")}}}))
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "no sweep summary" in err[0]


def headers(report_: report.Report) -> dict[str, list[list[str]]]:
    """Each table's column headings as each format writes them (the runs table first)."""
    text = report.render_text(report_, width=300)
    rich = [[h.strip() for h in line.split("┃")[1:-1]] for line in text.splitlines() if line.startswith("┃")]
    page = report.to_html(report_, None)
    htm = [[html.unescape(h) for h in re.findall(r"<th[^>]*>(.*?)</th>", t)] for t in page.split("<table>")[1:]]
    md_lines = report.to_markdown(report_).splitlines()
    md = [[h.strip() for h in md_lines[i].strip("|").split(" | ")] for i in range(len(md_lines) - 1)
          if md_lines[i + 1].startswith("| ---")]
    return {"rich": rich, "html": htm, "markdown": md, "csv": [next(csv.reader(io.StringIO(report.to_csv(report_))))]}


def test_one_column_spec_gives_the_same_columns_in_every_format(tmp_path: Path) -> None:
    plant_ladder(tmp_path)
    r = read_sweep([tmp_path])
    secs = sections(r)
    expected = [[c.header for c in shown(sec.columns, sec.rows, tables=True)] for sec in secs]
    assert [sec.title.split(" ")[0] for sec in secs] == ["perfrun:", "ladder", "alternatives",
                                                         "leave-one-out", "memory"]
    found = headers(r)
    for fmt in ("rich", "html", "markdown"):
        assert found[fmt] == expected, fmt
    runs = run_columns(r)
    csv_names = found["csv"][0]
    assert csv_names == [c.name for c in shown(runs, r.rows, tables=False)]
    table_names = [c.name for c in shown(runs, r.rows, tables=True)]
    assert [n for n in csv_names if n in table_names] == table_names  # the same columns, in the same order
    assert set(csv_names) - set(table_names) == {"ablation"}  # the swept key
    # each cell is formatted once: the ladder's bf16 line reads the same in all three tables
    ladder = next(sec for sec in secs if sec.title.startswith("ladder"))
    bf16 = [c.cell(next(e for e in ladder.rows if e["rung"] == "bf16")) for c in shown(LADDER_COLUMNS, ladder.rows,
                                                                                        tables=True)]
    assert bf16[2] == "1,500 ±2.3%" and bf16[3].startswith("1.50× (±")
    assert "| " + " | ".join(bf16) + " |" in report.to_markdown(r)
    opens = ["<td class='l'>" if c.justify == "left" else "<td>" for c in shown(LADDER_COLUMNS, ladder.rows, tables=True)]
    assert "".join(f"{o}{html.escape(v)}</td>" for o, v in zip(opens, bf16, strict=True)) in report.to_html(r, None)


def test_a_column_with_no_figure_in_any_row_is_left_out_of_every_format(tmp_path: Path) -> None:
    make_sweep(tmp_path)
    for job in ("0", "1", "2", "10"):  # a CPU sweep: no MFU anywhere
        path = tmp_path / job / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "mfu_median": None}))
    r = read_sweep([tmp_path])
    found = headers(r)
    assert all("MFU %" not in found[fmt][0] for fmt in ("rich", "html", "markdown"))
    assert "mfu" not in found["csv"][0] and "reason" in found["csv"][0]  # job 2 has a reason
    assert "tok/s" in found["rich"][0] and "tokens_per_s" in found["csv"][0]
    one = tmp_path / "1" / "summary.json"
    one.write_text(json.dumps({**json.loads(one.read_text()), "mfu_median": 0.5}))
    found = headers(read_sweep([tmp_path]))
    assert all("MFU %" in found[fmt][0] for fmt in ("rich", "html", "markdown")) and "mfu" in found["csv"][0]


def test_a_key_left_at_its_default_shows_its_effective_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """Two ad-hoc runs: the first set seed to its default, the second chose checkpointing=full."""
    quick = [*TINY_MODEL, "device=cpu", "progress=off", "monitor.every_n_steps=0", "eval_batches=1", "log_every=1"]
    monkeypatch.chdir(tmp_path)
    for name, extra in (("a", ["max_steps=2", "seed=1337"]), ("b", ["max_steps=3", "checkpointing=full"])):
        with kept_logging():  # the Hydra app sets up the root logger for its run
            assert train_main([*quick, *extra, f"hydra.run.dir={name}"]) == 0
    r = read_sweep([tmp_path / "a", tmp_path / "b"])
    # seed is 1337 in both (a typed it, b left it): not a key that varies
    assert r.swept_keys == ["source", "max_steps", "checkpointing"]
    a, b = r.rows
    assert a.swept["checkpointing"] == "none" and b.swept["checkpointing"] == "full"  # the group's option
    text = report.render_text(r, width=300)
    assert "max_steps=2 checkpointing=none" in text and "—" not in text
    assert next(csv.DictReader(io.StringIO(report.to_csv(r))))["checkpointing"] == "none"
    # with neither Hydra's record of the choices nor the summary's config, the job's config.yaml
    (tmp_path / "a" / ".hydra" / "hydra.yaml").unlink()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    del summary["config"]
    (tmp_path / "a" / "summary.json").write_text(json.dumps(summary))
    assert report.effective_value(tmp_path / "a", "checkpointing") == "none"
    assert report.effective_value(tmp_path / "a", "model.n_embd") == "32"
    assert report.effective_value(tmp_path / "a", "no.such.key") is None
    (tmp_path / "a" / ".hydra" / "config.yaml").unlink()  # no record at all: nothing to show
    assert read_sweep([tmp_path / "a", tmp_path / "b"]).rows[0].swept["checkpointing"] is None
