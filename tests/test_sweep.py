"""Multirun sweeps end to end: a failed job (an invalid swept value, out of memory) does
not stop the sweep, the sweep summary's rows are the jobs' summary.json, the failed jobs
read back from the sweep's folder, jobs in one process leave no state behind, ``perfrun
report`` reproduces the callback's table, and the ablation preset composes the jobs it
promises, which save no checkpoints unless asked."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from perfrun import report
from perfrun.commands.report import main as report_main
from perfrun.commands.train import train_main
from perfrun.config import config_dir, register_configs
from perfrun.console import kept_logging
from perfrun.ladder import sweep_files
from perfrun.ladder.analysis import read_sweep
from perfrun.ladder.callback import failed_jobs

from conftest import REPO, TINY_MODEL, launch

QUICK = [*TINY_MODEL, "max_steps=6", "log_every=3", "eval_batches=1", "device=cpu", "progress=off",
         "monitor.every_n_steps=0", "timing_warmup_steps=1"]


@pytest.mark.slow
def test_sweep_with_a_bad_value_goes_on_and_report_reproduces_it(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, restore_logging: None
) -> None:
    """The sweep in this process, its file descriptors captured (a sweep in a real process
    is tests/test_cli.py's, and test_sweep_stop.py's)."""
    sweep = tmp_path / "sweep"
    monkeypatch.setenv("COLUMNS", "200")
    code = launch("train", "-m", "dataloader.batch_size=0,2", *QUICK, f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    r = capfd.readouterr()
    assert code == 1, r.err  # a job failed: the sweep says so at the end
    assert "Traceback" not in r.err + r.out
    assert "dataloader.batch_size=0 must be >= 1" in r.err and "1 job(s) of the sweep failed" in r.err

    jobs = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(2)]
    assert [j["status"] for j in jobs] == ["failed", "completed"]
    rows = list(csv.DictReader(io.StringIO((sweep / sweep_files.SWEEP_CSV).read_text())))
    assert [row["job"] for row in rows] == ["0", "1"]
    for row, job in zip(rows, jobs, strict=True):  # one source of truth: the jobs' summary.json
        assert row["status"] == job["status"]
        assert row["overrides"] == " ".join(job["overrides"])
        for key in ("tokens_per_s", "peak_mem_mib", "final_train_loss"):
            summary_key = "tokens_per_s_median" if key == "tokens_per_s" else key
            assert (float(row[key]) if row[key] else None) == job.get(summary_key)
    # the completed job is the best unless it shared this machine (every job is assessed, monitor or not)
    quiet = not jobs[1]["contention"]["contended"]
    assert rows[0]["reason"] == jobs[0]["reason"] and [row["best"] for row in rows] == ["False", str(quiet)]
    # what a launcher running jobs elsewhere leaves: the failed jobs, read back from the folder
    assert failed_jobs(sweep) == [f"job 0 ({' '.join(jobs[0]['overrides'])}): {jobs[0]['reason']}"]
    data = json.loads((sweep / sweep_files.SWEEP_JSON).read_text())
    assert data["swept_keys"] == ["dataloader.batch_size"] and data["best"] == ("1" if quiet else None)
    assert (sweep / sweep_files.SWEEP_PNG).read_bytes()[:4] == b"\x89PNG"
    # the failed job left the process as it found it
    assert jobs[1]["global_state_at_start"] == jobs[0]["global_state_at_start"] == jobs[1]["global_state_after"]

    # perfrun report reproduces the callback's files and table exactly
    assert report_main([str(sweep), "--csv"]) == 0
    assert capfd.readouterr().out == (sweep / sweep_files.SWEEP_CSV).read_text()
    assert report_main([str(sweep), "--json"]) == 0
    assert capfd.readouterr().out == (sweep / sweep_files.SWEEP_JSON).read_text()
    table = report.render_text(read_sweep([sweep]), width=200)  # COLUMNS=200 above
    assert table.strip() and table in r.out


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """An in-process Hydra app configures the root logger (console and train.log handlers)."""
    with kept_logging():
        yield


def test_failed_jobs_are_read_from_the_sweep_folder(tmp_path: Path) -> None:
    """Each job as a launcher in other processes leaves it: a summary, a cut one, none at all."""
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "summary.json").write_text(json.dumps({"status": "completed", "overrides": ["a=1"],
                                                              "tokens_per_s_median": 10.0}))
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "summary.json").write_text(json.dumps({"status": "failed", "overrides": ["a=2"],
                                                              "reason": "out of memory on cuda:0"}))
    (tmp_path / "2" / ".hydra").mkdir(parents=True)  # killed before it wrote a summary
    (tmp_path / "2" / ".hydra" / "overrides.yaml").write_text("- a=3\n")
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "summary.json").write_text('{"status": "comp')  # cut short
    found = failed_jobs(tmp_path)
    assert found[0] == "job 1 (a=2): out of memory on cuda:0"
    assert found[1].startswith("job 2 (a=3): no summary.json") and found[2].startswith("job 3 (): summary.json")
    assert len(found) == 3
    assert failed_jobs(tmp_path / "nothing here") == [] and failed_jobs(tmp_path / "0") == []


@pytest.mark.slow
def test_ablation_jobs_save_no_checkpoints_and_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    assert train_main(["-m", "+sweep=ablation", "ablation.repeats=1", "+ablation=naive,sdpa", *QUICK,
                       f"hydra.sweep.dir={sweep}"]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "save no checkpoints" in line]
    assert len(said) == 1 and "checkpoint.at_end=true" in said[0]
    assert sorted(p.parent.name for p in sweep.glob("*/summary.json")) == ["0", "1"]
    jobs = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(2)]
    assert all(j["status"] == "completed" and j["checkpoints"] == [] for j in jobs)
    assert [p for p in sweep.rglob("*") if p.is_file() and "checkpoints" in p.parts] == []
    assert "each rung adds one knob to the rung below" in out and "│ sdpa" in out  # the ladder's table
    assert "verdict: perfrun train" in out  # the line to paste


@pytest.mark.slow
def test_out_of_memory_job_does_not_stop_the_sweep_nor_leak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restore_logging: None
) -> None:
    """Out of memory, simulated on the CPU: batch 4's forward raises torch.OutOfMemoryError.
    The jobs before and after it, in the same process, must be identical."""
    from perfrun.models.gpt import GPT

    real_forward = GPT.forward

    def forward(self, idx, targets=None):  # noqa: ANN001, ANN202
        if idx.shape[0] >= 4:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(self, idx, targets)

    monkeypatch.setattr(GPT, "forward", forward)
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    rc = train_main(["-m", "dataloader.batch_size=2,4,2", *QUICK, "log_every=1", f"hydra.sweep.dir={sweep}"])
    assert rc == 1
    jobs = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(3)]
    assert [j["status"] for j in jobs] == ["completed", "failed", "completed"]
    assert jobs[1]["reason"].startswith("out of memory") and "dataloader.batch_size=4" in jobs[1]["reason"]
    curves = [[json.loads(line)["loss"] for line in (sweep / str(i) / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "train"] for i in (0, 2)]
    assert curves[0] == curves[1] and len(curves[0]) == 6  # the job after the OOM is the job before it
    assert jobs[0]["global_state_at_start"] == jobs[2]["global_state_at_start"] == jobs[2]["global_state_after"]
    data = json.loads((sweep / sweep_files.SWEEP_JSON).read_text())
    assert [row["status"] for row in data["rows"]] == ["completed", "failed", "completed"]


LADDER = ["naive", "tf32", "bf16", "sdpa", "fused_adamw", "compile", "workers", "device_input", "chunked_loss",
          "compile_mode", "fp8"]
NOT_HERE = ("tf32", "compile_mode", "fp8")  # knobs that change nothing in a CPU job's configuration


def knobs(cfg) -> dict:  # noqa: ANN001
    return {"precision": cfg.precision.name, "tf32": cfg.precision.tf32, "attention": cfg.attention,
            "fused": cfg.optim.fused, "compile": cfg.compile, "workers": cfg.dataloader.num_workers,
            "checkpointing": cfg.checkpointing.name, "accumulation": cfg.accumulation.steps,
            "batch": cfg.dataloader.batch_size, "device_input": cfg.dataloader.device_input, "loss": cfg.loss.name,
            "mode": cfg.compile_options.mode}


@pytest.mark.slow
def test_ablation_preset_composes_a_cumulative_ladder_leave_one_out_and_tradeoffs() -> None:
    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        sweep = compose("train", overrides=["+sweep=ablation"], return_hydra_config=True)
        params = sweep.hydra.sweeper.params
        choices = [c.strip() for c in params["+ablation"].split(",")]
        cfgs = {c: compose("train", overrides=["+sweep=ablation", f"+ablation={c}"]) for c in choices}
        on_cuda = compose("train", overrides=["+sweep=ablation", "+ablation=bf16", "device=cuda"])
        mode_on_cuda = compose("train", overrides=["+sweep=ablation", "+ablation=compile_mode", "device=cuda"])
        default_seed = compose("train").seed
    # one job per (repeat, rung), the repeat first so that the rungs vary fastest; 5 repeats off CUDA
    assert list(params) == ["repeat", "+ablation"] and params["repeat"] == "range(0,5)"
    assert on_cuda.ablation.repeats == 3 and on_cuda.precision.tf32  # TF32 acts where it can
    assert sorted(p.stem for p in (REPO / "conf" / "ablation").glob("*.yaml")) == sorted([*choices, "top"])
    assert [c for c in choices if cfgs[c].ablation.kind == "ladder"] == LADDER
    # each rung adds exactly one knob to the rung below (tf32 adds none off CUDA: not applicable there)
    added = {c: {k for k, v in knobs(cfgs[c]).items() if v != knobs(cfgs[b])[k]} for b, c in pairwise(LADDER)}
    assert added == {"tf32": set(), "bf16": {"precision"}, "sdpa": {"attention"}, "fused_adamw": {"fused"},
                     "compile": {"compile"}, "workers": {"workers"}, "device_input": {"device_input"},
                     "chunked_loss": {"loss"}, "compile_mode": set(), "fp8": set()}
    assert cfgs["tf32"].ablation.acts_on == "cuda" and "CUDA" in cfgs["tf32"].ablation.why
    assert mode_on_cuda.compile_options.mode == "max-autotune-no-cudagraphs"
    assert cfgs["fp8"].ablation.acts_on == "fp8" and cfgs["fp8"].precision.name == "bf16"  # no FP8 tensor cores here
    assert knobs(cfgs["naive"]) == {"precision": "none", "tf32": False, "attention": "eager", "fused": "false",
                                    "compile": False, "workers": 0, "checkpointing": "none", "accumulation": 1,
                                    "batch": 8, "device_input": False, "loss": "standard", "mode": "default"}
    top = knobs(cfgs["fp8"])
    for c in (c for c in choices if c.startswith("without_")):  # the top with one knob off
        gone = {k for k, v in knobs(cfgs[c]).items() if v != top[k]}
        assert gone == added[cfgs[c].ablation.knob] or cfgs[c].ablation.knob in NOT_HERE, c
    assert {k for k, v in knobs(cfgs["fp16"]).items() if v != knobs(cfgs["tf32"])[k]} == {"precision"}
    assert cfgs["fp16"].ablation.kind == "alternative" and cfgs["fp16"].ablation.knob == "bf16"
    assert cfgs["naive_seed"].seed != default_seed and knobs(cfgs["naive_seed"]) == knobs(cfgs["naive"])
    assert all(cfg.seed == default_seed for c, cfg in cfgs.items() if c != "naive_seed")
    # memory trade-offs start from the top and are never a rung of the speed ladder
    trade = [c for c in choices if cfgs[c].ablation.kind == "tradeoff"]
    assert {cfgs[c].checkpointing.name for c in trade} == {"none", "selective", "full"}
    assert cfgs["accumulation"].accumulation.steps * cfgs["accumulation"].dataloader.batch_size == 8
    assert {c for c in trade if cfgs[c].dataloader.batch_size == "auto"} == {
        "largest_batch", "largest_batch_selective", "largest_batch_full"}
    assert cfgs["largest_batch"].dataloader.memory_budget_mib == 256  # the CPU needs a budget
    # the jobs (as the sweep composes them) measure: no checkpoint, at the end or on the way,
    # unless the command line asks; the monitor runs, so contention is detected
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        asked = compose("train", overrides=["+sweep=ablation", "+ablation=bf16", "checkpoint.at_end=true"])
        plain = compose("train", overrides=["+ablation=bf16"])  # a run outside the sweep keeps its checkpoint
    assert all(not job.checkpoint.at_end and job.checkpoint.every_n_steps == 0 for job in cfgs.values())
    assert all(job.monitor.every_n_steps > 0 for job in cfgs.values())
    assert asked.checkpoint.at_end and plain.checkpoint.at_end
