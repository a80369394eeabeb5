"""DDP on the CPU with gloo, 2 processes started by torchrun: the same losses as one
process with the same global batch, one run dir written by rank 0 only, exact resume.

Each torchrun start costs ~5 s of imports on 2 cores, so the runs are shared by module
fixtures and kept to a few steps of a tiny model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from perfrun.data import ResumableSampler
from perfrun.data.sampler import CHUNK
from perfrun.loop.run import run
from perfrun.telemetry.sinks import gpu_parts

from conftest import RANKS_COMMON, REPO, launch, losses, make_cfg

# float32 sums in another order (two half-batch means averaged by the all-reduce, against
# one mean over the whole batch): equal to ~1e-7 relative; 1e-5 leaves room.
TOL = 1e-5
STEPS = 6
COMMON = RANKS_COMMON  # 6 steps of the tiny model, 2 micro-steps
CHUNKED = ["loss=chunked", "loss.chunk_size=24"]  # 2 x 32 = 64 rows per rank: 3 chunks, the last one short


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks x batch 2 through ``perfrun train distributed=ddp nproc=2`` (which starts
    torchrun; the launcher in this process), no hydra.run.dir: the parent resolves
    outputs/DATE/TIME once for both."""
    cwd = tmp_path_factory.mktemp("ddp")
    assert launch("train", *COMMON, "distributed=ddp", "nproc=2", "dataloader.batch_size=2",
                  "checkpoint.every_n_steps=3", "checkpoint.keep_last=5", "monitor.every_n_steps=3", cwd=cwd) == 0
    return cwd


def test_sampler_shards_union_to_the_one_process_order() -> None:
    one = list(ResumableSampler(101, 7))
    ranks = [list(ResumableSampler(101, 7, r, 2)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 50  # the odd tail is cut: no rank has a batch more
    for k in range(25):  # batch k (2 per rank) of both ranks = batch k (4) of one process
        assert sorted(ranks[0][2 * k:2 * k + 2] + ranks[1][2 * k:2 * k + 2]) == sorted(one[4 * k:4 * k + 4])
    s = ResumableSampler(101, 7, 1, 2)
    s.set_position(0, 40)  # a global position: 40 samples of all ranks taken
    assert list(s) == ranks[1][20:]


def test_an_epoch_is_the_seeds_permutation_handed_out_a_chunk_at_a_time() -> None:
    """The order is what runs written before recorded their position in (a resumed run must
    rebuild it exactly), across chunk boundaries; the first index comes without the whole
    epoch turned into Python ints (40 bytes an index)."""
    import tracemalloc

    n = 3 * CHUNK + 5
    s = ResumableSampler(n, 11, 1, 2)
    s.set_position(2, 7)
    whole = torch.randperm(n, generator=torch.Generator().manual_seed(13))[7:]
    assert list(s) == whole[: len(whole) - len(whole) % 2][1::2].tolist()
    big = ResumableSampler(1 << 22, 3)
    tracemalloc.start()
    try:
        next(iter(big))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 * CHUNK * 36, peak  # a chunk or so; the whole epoch took 168 MB


def test_a_second_sampler_of_the_same_epoch_reuses_its_order_unchanged() -> None:
    """A sweep's jobs in one process draw the same epoch: drawn once (one miss of the kept
    order), and handing it out (from a position, on a rank) leaves the kept order as drawn;
    another epoch is drawn."""
    from perfrun.data import sampler

    sampler.epoch_order.cache_clear()
    first = ResumableSampler(1001, 5, 1, 2)
    first.set_position(0, 10)
    taken = list(first)
    again = list(ResumableSampler(1001, 5))
    assert sampler.epoch_order.cache_info().misses == 1
    assert again == torch.randperm(1001, generator=torch.Generator().manual_seed(5)).tolist()
    assert taken == again[10:1000][1::2]
    later = ResumableSampler(1001, 5)
    later.set_position(1)
    assert list(later) != again and sampler.epoch_order.cache_info().misses == 2


@pytest.mark.slow
def test_two_ranks_match_one_process_with_the_same_global_batch(
        ddp_run: Path, one_process_run: tuple[Path, dict[str, Any]]) -> None:
    (run_dir,) = [p.parent for p in ddp_run.glob("outputs/*/*/summary.json")]
    one_dir, one = one_process_run
    a, b = losses(one_dir), losses(run_dir)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert all(abs(a[k] - b[k]) <= TOL * abs(a[k]) for k in a), (a, b)
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["world_size"] == 2 and s["knobs"]["distributed"] == "ddp"
    assert s["tokens_per_step"] == one["tokens_per_step"]  # all ranks' tokens
    assert s["tokens_per_s_per_rank_median"] == pytest.approx(s["tokens_per_s_median"] / 2)
    assert abs(s["final_val_loss"] - one["final_val_loss"]) <= TOL * one["final_val_loss"]  # sharded val, averaged


@pytest.mark.slow
def test_only_rank_0_writes_into_one_run_dir(ddp_run: Path) -> None:
    files = sorted(str(p.relative_to(ddp_run)) for p in ddp_run.rglob("*") if p.is_file())
    (run_dir,) = {Path(f).parts[:3] for f in files}  # everything under one outputs/DATE/TIME
    names = sorted(str(Path(*Path(f).parts[3:])) for f in files)
    assert names == [".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml", ".perfrun.lock",
                     "checkpoints/step_0000003.pt", "checkpoints/step_0000006.pt",
                     "metrics.jsonl", "summary.json", "train.log"]
    lines = (ddp_run.joinpath(*run_dir) / "metrics.jsonl").read_text().splitlines()
    assert len([r for r in map(json.loads, lines) if r["kind"] == "train"]) == STEPS  # one writer, no duplicates


@pytest.mark.slow
def test_every_ranks_telemetry_reaches_rank_0s_log(ddp_run: Path) -> None:
    (run_dir,) = [p.parent for p in ddp_run.glob("outputs/*/*/summary.json")]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    monitors = [r for r in map(json.loads, lines) if r["kind"] == "monitor"]
    assert [r["step"] for r in monitors] == [3, 6]
    for r in monitors:
        assert [x["rank"] for x in r["ranks"]] == [0, 1]
        assert all(x["rss_mib_max"] > 0 and x["host"] for x in r["ranks"])  # measured by each rank itself
        assert r["ranks"][0]["rss_mib_max"] == r["rss_mib_max"]  # rank 0's own figures stay at the top level
    s = json.loads((run_dir / "summary.json").read_text())
    assert [x["rank"] for x in s["monitor_ranks"]] == [0, 1] and s["monitor_job"]["ranks"] == 2
    assert gpu_parts(monitors[0], monitors[0]["ranks"]) == []  # a CPU's samples stay off the console's step line


@pytest.mark.slow
def test_a_sweep_of_distributed_jobs_starts_torchrun_per_job(
        tmp_path: Path, one_process_run: tuple[Path, dict[str, Any]]) -> None:
    """nproc=1,2: each job with nproc > 1 starts its own torchrun into its job folder. The
    jobs use loss=chunked, so the 2-rank job also shows the chunked loss under DDP training
    as loss=standard does in one process with the same global batch (a torchrun start fewer
    than a run of its own; test_fsdp.py's 2-rank run holds the FSDP2 case)."""
    assert launch("train", "-m", *COMMON, "distributed=ddp", "nproc=1,2", "dataloader.batch_size=2",
                  "checkpoint.at_end=false", "profile=true", "profiler.start_step=1", "profiler.warmup=0",
                  "profiler.active=1", *CHUNKED, cwd=tmp_path) == 0
    (sweep,) = tmp_path.glob("outputs/multirun/*/*")
    summaries = [json.loads((sweep / str(n) / "summary.json").read_text()) for n in (0, 1)]
    assert [s["status"] for s in summaries] == ["completed", "completed"]
    assert [s["knobs"]["loss"] for s in summaries] == [{"name": "chunked", "chunk_size": 24}] * 2
    # 2 ranks x batch 2 x 2 micro-steps, chunked, against one process x batch 4 x 2 micro-steps, standard
    a, b = losses(one_process_run[0]), losses(sweep / "1")
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert all(abs(a[k] - b[k]) <= TOL * abs(a[k]) for k in a), (a, b)
    assert [s["world_size"] for s in summaries] == [1, 2]
    assert [s["tokens_per_step"] for s in summaries] == [2 * 2 * 32, 2 * 2 * 32 * 2]  # batch x accumulation x seq x ranks
    assert len(list(sweep.rglob("metrics.jsonl"))) == 2 and len(list(sweep.rglob("config.yaml"))) == 2  # one writer each
    assert [len(list((sweep / str(n) / "profile").glob("trace.json"))) for n in (0, 1)] == [1, 1]  # rank 0 profiles
    table = json.loads((sweep / "sweep_summary.json").read_text())
    assert len(table["rows"]) == 2 and {r["status"] for r in table["rows"]} == {"completed"}


@pytest.mark.slow
def test_resume_auto_under_ddp_continues_the_run_in_its_run_dir_exactly(
        ddp_run: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """distributed=ddp nproc=2 resume=auto: the launcher decides once, before the ranks start,
    and both ranks resume from the one checkpoint into the one run dir, bit for bit (same
    ranks, same order). A copy of the module's 2-rank run, its step-6 checkpoint removed, is
    continued from step 3; the launcher runs in this process (a process start fewer), the
    ranks are torchrun's, importing this checkout."""
    shutil.copytree(ddp_run / "outputs", tmp_path / "outputs")
    (run_dir,) = [p.parent.relative_to(tmp_path) for p in tmp_path.glob("outputs/*/*/summary.json")]
    (tmp_path / run_dir / "checkpoints" / "step_0000006.pt").unlink()
    capfd.readouterr()
    assert launch("train", *COMMON, "distributed=ddp", "nproc=2", "dataloader.batch_size=2", "checkpoint.every_n_steps=3",
                  "checkpoint.keep_last=5", "monitor.every_n_steps=3", "resume=auto", cwd=tmp_path) == 0
    assert f"continuing the run in {run_dir} from step 3" in capfd.readouterr().err
    assert [p.relative_to(tmp_path) for p in tmp_path.glob("outputs/*/*")] == [run_dir]  # no second run dir
    assert len(list(tmp_path.rglob("metrics.jsonl"))) == 1
    before = json.loads((ddp_run / run_dir / "summary.json").read_text())
    s = json.loads((tmp_path / run_dir / "summary.json").read_text())
    assert s["world_size"] == 2 and s["status"] == "completed" and s["start_step"] == s["resumed_from_step"] == 3
    assert s["steps"] == STEPS and s["data_position"] == before["data_position"]
    lines = (tmp_path / run_dir / "metrics.jsonl").read_text().splitlines()
    redone = [r for r in map(json.loads, lines) if r["kind"] == "train"][STEPS:]  # written by the resumed ranks
    a = losses(ddp_run / run_dir)
    assert [r["step"] for r in redone] == list(range(4, STEPS + 1))
    assert [r["loss"] for r in redone] == [a[r["step"]] for r in redone]  # bit for bit


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_in_one_process_with_the_same_global_batch(ddp_run: Path, tmp_path: Path) -> None:
    (run_dir,) = [p.parent for p in ddp_run.glob("outputs/*/*/summary.json")]
    s = run(make_cfg(*COMMON, "dataloader.batch_size=4", f"resume={run_dir / 'checkpoints' / 'step_0000003.pt'}",
                     "checkpoint.at_end=false"), tmp_path)
    a, b = losses(run_dir), losses(tmp_path)
    assert s["start_step"] == 3 and sorted(b) == [4, 5, 6]
    assert all(abs(a[k] - b[k]) <= TOL * abs(a[k]) for k in b), (a, b)


@pytest.mark.slow
def test_a_checkpoint_from_before_ranks_were_recorded_infers_them(ddp_run: Path, tmp_path: Path) -> None:
    """Written by 2 ranks before perfrun recorded world_size: within the first epoch the
    data position says how many ranks there were, so the global batch is checked right."""
    import torch

    from perfrun.checkpoint import files as checkpoint_files

    (run_dir,) = [p.parent for p in ddp_run.glob("outputs/*/*/summary.json")]
    old = checkpoint_files.load(run_dir / "checkpoints" / "step_0000003.pt")
    for key in ("world_size", "rng_ranks"):
        old.pop(key)
    torch.save(old, tmp_path / "old.pt")
    assert checkpoint_files.saved_world(old) == 2
    s = run(make_cfg(*COMMON, "dataloader.batch_size=4", f"resume={tmp_path / 'old.pt'}", "checkpoint.at_end=false"),
            tmp_path / "r")
    assert s["start_step"] == 3 and s["status"] == "completed"


@pytest.mark.parametrize("args, says", [
    (["nproc=2"], "nproc=2 needs distributed=ddp"),
    (["distributed=ddp", "nproc=0"], "nproc=0 must be >= 1"),
    (["distributed=zero3"], "distributed=zero3 is not an option"),
    # refused before torchrun starts: one line, not one per rank
    (["distributed=ddp", "nproc=2", "model.n_embd=33"], "model.n_embd=33 is not divisible by model.n_head=2"),
    (["distributed=ddp", "nproc=2", "dataloader.batch_size=auto"], "batch_size=auto is not supported with distributed=ddp"),
])
def test_bad_distributed_input_gets_one_line(args: list[str], says: str, tmp_path: Path,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    """In this process (test_cli.py checks the exit code and stderr of a real process)."""
    code = launch("train", *COMMON, *args, cwd=tmp_path)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and says in lines[0], err
    assert not (tmp_path / "outputs").exists()


LAUNCHER_ONLY = """
import sys
import perfrun.commands.launch as launch
launch.run_torchrun = lambda nproc, args: print("torchrun", nproc, *args) or 0
from perfrun.commands.dispatch import main
code = main(["train", "distributed=ddp", "nproc=2", "device=cpu", "resume=auto", "hydra.run.dir=" + sys.argv[1]])
print("exit", code, "torch imported:", "torch" in sys.modules)
"""


def test_the_launcher_starts_torchrun_without_importing_torch(tmp_path: Path) -> None:
    """The process that starts torchrun composes, validates and looks for the run resume=auto
    continues, all without torch (its import is two seconds of every multi-rank start)."""
    res = subprocess.run([sys.executable, "-c", LAUNCHER_ONLY, str(tmp_path / "run")], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "torchrun 2 " in res.stdout and "exit 0 torch imported: False" in res.stdout, res.stdout
