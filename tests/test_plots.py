"""Every plot perfrun draws (the sweep's, the ladder's, a single run's) is read back through
its matplotlib artists, not only as a PNG: contended and failed jobs are hollow markers,
labelled, on no line; bars carry their spread and a single run says "1 run"; the verdict
and the count of contended jobs are on the image. One real tiny run for ``perfrun report``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from matplotlib.container import ErrorbarContainer
from test_ladder import plant, plant_ladder
from test_report import make_job, make_sweep

from perfrun.commands.report import RUN_PNG
from perfrun.commands.report import main as report_main
from perfrun.ladder.analysis import read_sweep
from perfrun.ladder.plot import ladder_figure
from perfrun.report.plot import sweep_figure
from perfrun.report.run_plot import run_figure

from conftest import make_cfg


def contend(job: Path) -> None:
    s = json.loads((job / "summary.json").read_text())
    s["contention"] = {"contended": True, "evidence": ["planted neighbour"]}
    (job / "summary.json").write_text(json.dumps(s))


def hollow(ax: Any) -> list[Any]:
    return [line for line in ax.lines if line.get_markerfacecolor() == "none"]


def points(line: Any) -> set[tuple[float, float]]:
    return set(zip(line.get_xdata(), line.get_ydata(), strict=True))


def texts(ax: Any) -> list[str]:
    return [t.get_text() for t in ax.texts]


def one_line(text: str) -> str:
    return " ".join(text.split())


def test_the_sweep_plot_draws_contended_and_failed_jobs_apart_and_never_on_a_line(tmp_path: Path) -> None:
    make_sweep(tmp_path)  # batch 8, 16, 32 (failed), 64
    contend(tmp_path / "1")
    fig = sweep_figure(read_sweep([tmp_path]))
    (ax,) = fig.axes
    apart = {line.get_label(): points(line) for line in hollow(ax)}
    assert apart == {"shared the machine: not counted": {(1, 1800.0)}, "failed or unfinished: no figure": {(2, 0.0)}}
    assert all(line.get_linestyle() == "None" for line in hollow(ax))
    trend = [line for line in ax.lines if line.get_linestyle() == "-"]
    assert trend and all(points(line) == {(0, 1000.0), (3, 1500.0)} for line in trend)  # 8 and 64 alone
    assert {"1: contended", "2: failed"} <= set(texts(ax))
    assert "1 of 4 jobs shared the machine" in one_line(fig.get_suptitle())
    assert one_line(fig.get_supxlabel()).startswith("verdict: ")


def test_sweep_bars_carry_their_spread_and_a_single_run_says_so(tmp_path: Path) -> None:
    for n, (precision, repeat, tps) in enumerate([("none", 0, 1000.0), ("bf16", 0, 1500.0), ("none", 1, 1100.0),
                                                  ("fp16", 0, 900.0)]):
        make_job(tmp_path / str(n), [f"precision={precision}", f"repeat={repeat}"], tps=tps)
    fig = sweep_figure(read_sweep([tmp_path]))
    (ax,) = fig.axes
    bars = {round(p.get_x() + p.get_width() / 2): p.get_height() for p in ax.patches}
    assert bars == {0: 1050.0, 1: 1500.0, 2: 900.0}  # none: the median of its two repeats
    (errorbar,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    segments = errorbar.lines[2][0].get_segments()
    assert [tuple(s[:, 1]) for s in segments][0] == (1000.0, 1100.0)  # none's min-max
    assert texts(ax).count("1 run") == 2  # bf16 and fp16 ran once; none twice


def test_the_ladder_plot_reads_what_stands(tmp_path: Path) -> None:
    plant_ladder(tmp_path, contend="compile")
    r = read_sweep([tmp_path])
    (a,) = r.ladders
    fig = ladder_figure(r, a)
    waterfall, loo = fig.axes[0], fig.axes[1]
    labels = [t.get_text() for t in waterfall.get_xticklabels()]
    assert labels == ["naive", "bf16", "sdpa", "compile"] and len(waterfall.patches) == 4
    (contended,) = hollow(waterfall)
    assert points(contended) == {(3, 3100.0)} and "18: contended" in texts(waterfall)
    assert "1 run" not in texts(waterfall)  # three repeats each
    assert "olive: no measurable effect" in loo.get_title()  # without_sdpa, measured with a spread
    assert "1 of 36 jobs shared the machine" in fig.get_suptitle()
    assert one_line(fig.get_supxlabel()) == one_line(a["verdict"])
    dashed = [line for line in fig.axes[3].lines if line.get_linestyle() == "--"]
    assert [line.get_label() for line in dashed] == ["18 compile (contended)"]
    # each trade-off's label reads away from the nearer edge: none leaves the axes (a long one
    # at the far right included)
    a["tradeoffs"].append({**a["tradeoffs"][0], "setting": "checkpointing=none, the top rung itself",
                           "peak_mem_mib": 10 * a["tradeoffs"][0]["peak_mem_mib"]})
    fig = ladder_figure(r, a)
    trade = fig.axes[2]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()  # the labels are placed when drawn
    renderer = canvas.get_renderer()
    box = trade.get_window_extent(renderer)
    labels = {t.get_text(): t.get_window_extent(renderer) for t in trade.texts}
    assert len(labels) == 2 and all(box.x0 <= b.x0 and b.x1 <= box.x1 for b in labels.values()), labels


def test_the_ladder_plot_of_single_runs_with_a_contended_baseline(tmp_path: Path) -> None:
    """Issue 27's sweep: single runs say so, nothing claims "no measurable effect", the
    contended naive job is hollow apart, and the verdict on the image is the report's."""
    for n, (rung, tps, contended) in enumerate([("naive", 15958, True), ("naive_seed", 154, True), ("bf16", 660, False),
                                                ("compile", 1500, False), ("without_bf16", 13287, False),
                                                ("without_compile", 690, False)]):
        plant(tmp_path / str(n), rung, 0, tps, contended=contended)
    r = read_sweep([tmp_path])
    (a,) = r.ladders
    fig = ladder_figure(r, a)
    waterfall, loo = fig.axes[0], fig.axes[1]
    assert texts(waterfall).count("1 run") == 2 and texts(loo).count("1 run") == 2
    assert points(hollow(waterfall)[0]) == {(0, 15958.0)}
    assert "no measurable effect" not in loo.get_title() and "1 run, effect unknown" in loo.get_title()
    verdict = one_line(fig.get_supxlabel())
    assert verdict == one_line(a["verdict"]) and "measured as without_bf16" in verdict and "rerun:" in verdict
    assert "2 of 6 jobs shared the machine" in fig.get_suptitle()


def test_report_on_a_single_run_plots_loss_and_tokens_per_s_and_says_where(
        tmp_path: Path, one_thread: None, capsys: pytest.CaptureFixture[str]) -> None:
    from perfrun.loop.run import run

    overrides = ["max_steps=20", "log_every=2", "eval_every=10", "timing_warmup_steps=4"]
    s = run(make_cfg(*overrides), tmp_path / "run", overrides=overrides)
    assert report_main([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f"report: wrote {tmp_path / 'run' / RUN_PNG}" in out
    assert (tmp_path / "run" / RUN_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = read_sweep([tmp_path / "run"])
    fig = run_figure(r, r.rows[0])
    ax_loss, ax_tps = fig.axes
    by_label = {line.get_label(): line for line in ax_loss.lines}
    assert list(by_label["train loss (per log interval)"].get_xdata()) == list(range(2, 21, 2))
    assert list(by_label["validation loss"].get_xdata()) == [10, 20]
    tps = {line.get_label(): line for line in ax_tps.lines}
    assert list(tps["tokens/s per log interval"].get_xdata()) == list(range(2, 21, 2))
    median = tps[f"median of the steady steps: {s['tokens_per_s_median']:,.0f}"]
    assert list(median.get_ydata()) == [s["tokens_per_s_median"]] * 2
    assert any("warm-up (4 steps" in p.get_label() for p in ax_tps.patches)
    assert "perfrun run run" in fig.get_suptitle() and "tokens/s (median of the steady steps)" in fig.get_supxlabel()
    # machine-readable output stays clean: the path goes to stderr
    assert report_main([str(tmp_path / "run"), "--json", "--plot", str(tmp_path / "elsewhere.png")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["rows"][0]["job"] == "run" and f"report: wrote {tmp_path / 'elsewhere.png'}" in err
