"""scripts/bench_train.py on the CPU at its smallest: two alternating pairs give a report with
the ratio, its intervals, the threads both sides ran with and what the machine did meanwhile;
a side in a fresh process sets its own threads; the Python-call count per step of each
side; the sign-test interval on known ratios. No timing is asserted: the machine is shared."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import REPO, TINY_MODEL

SMALL = [*TINY_MODEL, "dataloader.batch_size=2", "device=cpu", "data=synthetic"]


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_train", REPO / "scripts" / "bench_train.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def in_process(module: ModuleType) -> Callable[..., dict[str, Any]]:
    """``spawn`` with the child's code run in this process: the same ``--one`` arguments, the
    same BENCH_TRAIN line parsed. The fresh process ``spawn`` starts is
    :func:`test_a_side_in_a_fresh_process_runs_on_the_threads_asked_for`'s; here the report
    built from the pairs is under test."""
    def spawn(side: str, args: Any, overrides: list[str], *, calls: bool = False) -> dict[str, Any]:
        argv = ["--one", side, "--threads", str(args.threads), "--steps", str(args.steps),
                "--warmup", str(args.warmup), *(["--calls"] if calls else []), *overrides]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert module.main(argv) == 0
        return json.loads(out.getvalue().rpartition("BENCH_TRAIN ")[2].split("\n", 1)[0])
    return spawn


@pytest.mark.slow
def test_two_pairs_report_the_ratio_its_interval_the_threads_and_the_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "bench.json"
    module = bench()
    monkeypatch.setattr(module, "spawn", in_process(module))
    assert module.main(["--pairs", "2", "--steps", "3", "--warmup", "1", "--threads", "1", "--configs", "custom",
                        "--json", str(out), *SMALL]) == 0
    result = json.loads(out.read_text())
    row = result["configs"]["custom"]
    assert row["overrides"] == SMALL and [p["first"] for p in row["pairs"]] == ["perfrun", "plain"]  # alternating
    for p in row["pairs"]:
        assert p["ratio"] == pytest.approx(p["perfrun"]["tokens_per_s"] / p["plain"]["tokens_per_s"])
    ratios = sorted(p["ratio"] for p in row["pairs"])
    assert row["median_ratio"] == pytest.approx(sum(ratios) / 2)
    assert row["ci95_sign_test"] is None  # two pairs: no 95 % sign-test interval exists
    lo, hi = row["ci95_bootstrap"]
    assert ratios[0] <= lo <= hi <= ratios[1]
    threads = row["threads"]  # (torch threads, interop threads, OMP_NUM_THREADS) as each side read them back
    assert threads["perfrun"] == threads["plain"] and [(t[0], t[2]) for t in threads["plain"]] == [(1, "1")]
    machine = row["machine"]
    assert machine["cpus"] >= 1 and machine["load_avg_1m"]["min"] <= machine["load_avg_1m"]["max"]
    assert 0 <= machine["others_cpu_share_pct"] and isinstance(machine["busiest_others"], list)
    shown = capsys.readouterr().out
    assert "custom pair 2/2 (plain first)" in shown and "95% sign test" in shown and "busiest others" in shown


@pytest.mark.slow
def test_a_side_in_a_fresh_process_runs_on_the_threads_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """``spawn`` as the benchmark starts each side: a fresh process that reads back the
    threads it ran with (``--threads 1``, against this process's OMP_NUM_THREADS, changed here
    so that only spawn can have set it); perfrun's side, the one whose run could change them."""
    module = bench()
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    got = module.spawn("perfrun", module.parse(["--steps", "2", "--warmup", "1", "--threads", "1"]), SMALL)
    assert (got["torch_threads"], got["omp_num_threads"]) == (1, "1") and got["tokens_per_s"] > 0


@pytest.mark.slow
def test_python_calls_per_step_of_both_sides() -> None:
    module = bench()
    counts = {side: module.calls_per_step(side, 1, [*SMALL, "progress=off", "monitor.every_n_steps=0"])
              for side in ("perfrun", "plain")}
    for side, got in counts.items():  # a forward, backward and AdamW step are hundreds of Python calls
        assert got["calls_per_step"] > 100, side
        assert sum(got["top"].values()) <= got["calls_per_step"] + 1e-6 and len(got["top"]) == 30
        assert got["aten_ops"]["aten._fused_adamw_"] >= 1 and got["aten_ops"]["aten.mm"] >= 2 * 2  # 2 blocks
        assert got["aten_ops_per_step"] == sum(got["aten_ops"].values())


def test_sign_test_interval_is_the_order_statistics_of_the_binomial() -> None:
    module = bench()
    ratios = [1.0 + i / 100 for i in range(10)]  # n=10: P(B<=1) = 1.07 % <= 2.5 % < P(B<=2): the 2nd and 9th
    assert module.sign_test_interval(ratios) == (1.01, 1.08)
    assert module.sign_test_interval(ratios[:6]) == (1.0, 1.05)  # n=6: min and max cover 96.9 %
    assert module.sign_test_interval(ratios[:5]) is None


def test_unknown_configuration_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench().main(["--configs", "huge-*"]) == 2
    err = capsys.readouterr().err
    assert "matches none of tiny-fp32-on" in err and len(err.strip().splitlines()) == 1
