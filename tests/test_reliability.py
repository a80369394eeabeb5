"""Nothing lost: checkpoints, exact resume, graceful stop, crash safety, numeric guards,
out of memory, and one clear line for every bad input."""

from __future__ import annotations

import hashlib
import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from perfrun.checkpoint import files as checkpoint_files
from perfrun.commands.dispatch import main as cli_main
from perfrun.config import ConfigError
from perfrun.loop.run import RunFailed, run
from perfrun.models.gpt import GPT

from bad_input_cases import CASES, SMALL, make_fixtures
from conftest import TINY_MODEL, make_cfg, small_disk, start_train, wait_for


def losses_by_step(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def test_checkpoint_contents_load_with_weights_only(tmp_path: Path) -> None:
    s = run(make_cfg("max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2", "precision=fp16"), tmp_path)
    found = checkpoint_files.list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in found] == ["step_0000004.pt", "step_0000006.pt"]  # keep_last=2; 2 was pruned
    assert s["checkpoints"][-1] == str(found[-1])
    ckpt = torch.load(found[-1], map_location="cpu", weights_only=True)
    assert ckpt["step"] == 6 and ckpt["format"] == checkpoint_files.FORMAT
    assert set(ckpt) >= {"model", "optimizer", "scheduler", "scaler", "rng", "data", "config", "perfrun_version", "tokens"}
    assert ckpt["scaler"]["scale"] > 0 and ckpt["data"] == s["data_position"]
    assert set(ckpt["rng"]) >= {"python", "numpy", "torch"}
    assert ckpt["config"]["model"]["n_embd"] == 32
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


@pytest.mark.parametrize("extra", [
    # the gradient scaler's state, dropout's random masks and the micro-steps, together
    pytest.param(["precision=fp16", "model.dropout=0.1", "accumulation.steps=2"], id="fp16-dropout-accumulation"),
    pytest.param(["precision=bf16"], id="bf16"),  # autocast without a scaler (fp32's state, another dtype)
    # the CUDA input path: host batches copied ahead on a side stream, or drawn on the device
    pytest.param(["device=cuda", "data=pysource", "accumulation.steps=2"], marks=pytest.mark.gpu, id="cuda-pysource"),
    pytest.param(["device=cuda", "data=synthetic", "accumulation.steps=2"], marks=pytest.mark.gpu, id="cuda-synthetic"),
])
def test_resume_is_bit_exact(tmp_path: Path, extra: list[str]) -> None:
    """Stopped at step 4 and resumed, the run's losses at steps 5-8 equal the uninterrupted
    run's bit for bit, one case per path whose saved state differs: under fp16 autocast with
    dropout and accumulation (the gradient scaler's state, every random generator, the
    micro-steps' data position), under bf16 autocast (no scaler: fp32's state), and on CUDA
    with batches read ahead or drawn on the device (their position included). The paths
    with more than one rank resume exactly in test_distributed.py (DDP, through resume=auto)
    and test_fsdp.py (FSDP2 with dropout), beside the 2-rank runs they share; a checkpoint
    of an earlier perfrun in test_checkpoint_format.py."""
    common = ["max_steps=8", "log_every=1", "dataloader.batch_size=8", *extra]
    full = run(make_cfg(*common, "checkpoint.every_n_steps=4", "checkpoint.keep_last=5"), tmp_path / "full")
    ckpt = tmp_path / "full" / "checkpoints" / "step_0000004.pt"
    resumed = run(make_cfg(*common, f"resume={ckpt}"), tmp_path / "resumed")
    a, b = losses_by_step(tmp_path / "full"), losses_by_step(tmp_path / "resumed")
    assert sorted(b) == list(range(5, 9)) and resumed["start_step"] == 4
    assert [a[k] for k in range(5, 9)] == [b[k] for k in range(5, 9)]
    assert resumed["tokens"] == full["tokens"] and resumed["data_position"] == full["data_position"]
    assert resumed["final_val_loss"] == full["final_val_loss"]
    scales = [{r["step"]: r.get("loss_scale") for r in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text()
                                                          .splitlines()) if r["kind"] == "train"} for d in ("full", "resumed")]
    assert [scales[0][k] for k in range(5, 9)] == [scales[1][k] for k in range(5, 9)]  # the scaler's state came back
    assert (scales[1][8] is not None) == ("precision=fp16" in extra)


def test_resume_auto_finds_the_latest_in_the_run_dir(tmp_path: Path) -> None:
    run(make_cfg("max_steps=4", "checkpoint.every_n_steps=2"), tmp_path)
    s = run(make_cfg("max_steps=6", "resume=auto"), tmp_path)
    assert s["resumed_from"].endswith("step_0000004.pt") and s["start_step"] == 4 and s["steps"] == 6
    fresh = run(make_cfg("max_steps=2", "resume=auto"), tmp_path / "outputs" / "d" / "t")
    assert fresh["resumed_from"] is None and fresh["start_step"] == 0  # nothing to resume: a fresh start, said in the log


def test_checkpoint_counts_tokens_between_log_points(tmp_path: Path) -> None:
    s = run(make_cfg("max_steps=6", "log_every=4", "checkpoint.every_n_steps=3"), tmp_path)
    ckpt = checkpoint_files.load(tmp_path / "checkpoints" / "step_0000003.pt")
    assert ckpt["tokens"] == 3 * s["tokens_per_step"]
    resumed = run(make_cfg("max_steps=6", "log_every=4", f"resume={tmp_path / 'checkpoints' / 'step_0000003.pt'}"),
                  tmp_path / "resumed")
    assert resumed["tokens"] == s["tokens"] == 6 * s["tokens_per_step"]


def test_resume_refuses_another_data_order(tmp_path: Path) -> None:
    run(make_cfg("max_steps=2"), tmp_path / "a")
    with pytest.raises(ConfigError, match=r"other settings \(seed=1337 vs 7"):
        run(make_cfg("max_steps=4", "seed=7", f"resume={tmp_path / 'a' / 'checkpoints'}"), tmp_path / "b")


def test_resume_auto_never_takes_a_sibling_runs_checkpoint(tmp_path: Path) -> None:
    run(make_cfg("max_steps=2"), tmp_path / "outputs" / "multirun" / "0")
    s = run(make_cfg("max_steps=2", "resume=auto"), tmp_path / "outputs" / "multirun" / "1")
    assert s["resumed_from"] is None and s["start_step"] == 0


def test_unwritable_checkpoint_dir_fails_before_training(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match="checkpoint.dir=.*a-file/ck is not writable"):
        run(make_cfg("max_steps=2", f"checkpoint.dir={tmp_path / 'a-file' / 'ck'}"), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any record: not even the file


def test_resume_refuses_another_model_shape(tmp_path: Path) -> None:
    run(make_cfg("max_steps=2"), tmp_path / "a")
    with pytest.raises(ConfigError, match="another model shape .*n_embd 32 vs 64"):
        run(make_cfg("max_steps=4", "model.n_embd=64", f"resume={tmp_path / 'a' / 'checkpoints'}"), tmp_path / "b")


def test_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """A real disk of 700 KiB: room for one checkpoint of the tiny model (~460 KiB), not two."""
    with small_disk(tmp_path / "small", "700k") as disk:
        with pytest.raises(RunFailed, match="the disk is full.*previous checkpoint step_0000002.pt is intact"):
            run(make_cfg("max_steps=6", "checkpoint.every_n_steps=2", f"checkpoint.dir={disk}"), tmp_path / "run")
        files = sorted(p.name for p in disk.iterdir() if not p.name.startswith("."))
        assert files == ["step_0000002.pt"]  # no partial file, the good one intact
        assert checkpoint_files.load(disk / files[0])["step"] == 2
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_divergence_stops_with_a_clear_message(tmp_path: Path) -> None:
    with pytest.raises(RunFailed, match=r"diverged: .* not finite for 3 consecutive steps .*lower optim.lr"):
        run(make_cfg("max_steps=30", "optim.lr=1e30", "optim.warmup_steps=0", "checkpoint.every_n_steps=1"), tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["status"] == "failed" and s["guard"]["nonfinite_steps"] == 3 and s["guard"]["max_nonfinite_streak"] == 3
    ckpts = checkpoint_files.list_checkpoints(tmp_path / "checkpoints")
    last_good = checkpoint_files.load(ckpts[-1])
    assert all(torch.isfinite(t).all() for t in last_good["model"].values())  # no NaN state was saved
    assert str(ckpts[-1]) in s["reason"]


def test_fp16_counts_scaler_skipped_steps(tmp_path: Path) -> None:
    s = run(make_cfg("max_steps=8", "precision=fp16", "optim.lr=1e30", "optim.warmup_steps=0", "guard.max_bad_steps=100"),
            tmp_path)
    assert s["guard"]["scaler_skipped_steps"] >= 1
    assert s["guard"]["scaler_skipped_steps"] <= 8


def test_out_of_memory_becomes_advice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(GPT, "forward", oom)
    with pytest.raises(RunFailed, match="out of memory .*smaller dataloader.batch_size.*checkpointing=full"):
        run(make_cfg("max_steps=2"), tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


def test_compile_without_a_compiler_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(ConfigError, match="needs a C\\+\\+ compiler"):
        run(make_cfg("compile=true"), tmp_path)


def _files(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*")) if p.is_file() and "outputs" not in p.parts]


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in _files(root)}


def _stats(root: Path) -> dict[str, tuple[int, int, int]]:
    """Each file's size, modification time and inode: any write, replacement or new file changes them."""
    return {str(p.relative_to(root)): (s.st_size, s.st_mtime_ns, s.st_ino) for p in _files(root) for s in [p.stat()]}


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("bad-inputs")
    run(make_cfg("max_steps=1", "model.n_embd=64"), d / "source")
    run(make_cfg(*SMALL), d / "small")
    make_fixtures(d, checkpoint_files.list_checkpoints(d / "source" / "checkpoints")[-1],
                  checkpoint_files.list_checkpoints(d / "small" / "checkpoints")[-1])
    return d


@pytest.fixture(scope="module")
def fixtures_as_made(fixtures: Path) -> tuple[dict[str, tuple[int, int, int]], dict[str, str]]:
    """The fixtures' stats and contents before any case ran."""
    return _stats(fixtures), _digest(fixtures)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.what for c in CASES])
def test_bad_input_gets_one_line(case, fixtures: Path, fixtures_as_made: tuple[dict, dict],
                                 capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(CASES) >= 25
    monkeypatch.chdir(fixtures)
    stats, contents = fixtures_as_made
    given = [a.format(d=fixtures) for a in case.args]
    args = [given[0], *(SMALL if case.small else []), *given[1:]]  # the case's own values come last and win
    try:
        rc = cli_main(args)
    except SystemExit as e:  # Hydra's app exits through SystemExit
        rc = e.code
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc not in (0, None), out + err
    assert len(lines) == 1 and lines[0].startswith("perfrun: error:"), err
    assert case.says in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert _stats(fixtures) == stats or _digest(fixtures) == contents  # no file damaged: untouched, or as it was


def test_a_value_the_schema_refuses_makes_no_run_dir_and_imports_no_trainer(
        tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad value of a single run is refused by the command, before Hydra's job makes the
    run dir (and before the trainer is imported): nothing is made, then undone."""
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "perfrun.loop.run", raising=False)  # given back after the test
    rc = cli_main(["train", *SMALL, "max_steps=0"])
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "max_steps=0 must be >= 1" in lines[0], lines
    assert list(tmp_path.iterdir()) == []
    assert "perfrun.loop.run" not in sys.modules


@pytest.mark.parametrize("value", ["precision.tf32=true", "sdpa_backend=flash", "offload=activations", "seed=-1",
                                   "optim.in_backward=true", "memory_snapshot=true", "device=tpu"])
def test_a_setting_this_run_cannot_take_makes_no_run_dir(
        value: str, tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """What setup would refuse from the configuration and the device alone (a knob this CPU
    cannot run, a seed out of range) is refused by the command before Hydra's job makes the
    run dir: a refused run leaves no folder."""
    monkeypatch.chdir(tmp_path)
    rc = cli_main(["train", *SMALL, value])
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"perfrun: error: {value.split('=')[0]}"), lines
    assert out == "" and list(tmp_path.iterdir()) == []


def _first_metrics(tmp_path: Path) -> bool:
    return any(p.stat().st_size > 0 for p in tmp_path.rglob("metrics.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_stops_gracefully_and_resumes(tmp_path: Path, sig: int, code: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The signalled run is a real process; the resume runs in this process (no signal in it)."""
    p = start_train(tmp_path, *TINY_MODEL, "max_steps=100000", "log_every=1", "device=cpu", "monitor.every_n_steps=0",
               "hydra.run.dir=run")
    wait_for(lambda: _first_metrics(tmp_path))
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    assert "Traceback" not in err
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["interrupted_by"] == sig
    (ckpt,) = checkpoint_files.list_checkpoints(tmp_path / "run" / "checkpoints")
    assert checkpoint_files.load(ckpt)["step"] == s["steps"]
    if sig == signal.SIGINT:
        return  # the resume below is the same for both signals: run it once
    stop_step = s["steps"]
    monkeypatch.chdir(tmp_path)
    assert cli_main(["train", *TINY_MODEL, f"max_steps={stop_step + 3}", "device=cpu", "monitor.every_n_steps=0",
                     "hydra.run.dir=run", "resume=auto"]) == 0
    s2 = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s2["status"] == "completed" and s2["start_step"] == stop_step and s2["steps"] == stop_step + 3


# A user's dataset whose fetches stall (as a slow disk would) once a file named "stall" exists:
# it then says so ("stalled"), and says when the run's stop handler has taken a first signal
# ("first-signal-taken"), so that a test sends the second one only then.
STALLING_DATASET = """
import signal, time
from pathlib import Path
import torch
from torch.utils.data import Dataset

class Stalls(Dataset):
    vocab_size = 64

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        while Path("stall").exists():
            Path("stalled").touch()
            handler = signal.getsignal(signal.SIGINT)
            if getattr(getattr(handler, "__self__", None), "requested", False):
                Path("first-signal-taken").touch()
            time.sleep(0.01)
        t = torch.randint(0, 64, (33,), generator=torch.Generator().manual_seed(i))
        return t[:-1], t[1:]
"""


@pytest.mark.slow
def test_second_sigint_stops_at_once(tmp_path: Path) -> None:
    """Ctrl-C, then Ctrl-C again while the run is still finishing its step: it stops at once,
    saving nothing, and its summary says so. The step here is held in the user's dataset
    until the second signal, so the order of the two does not depend on how fast either
    side runs."""
    (tmp_path / "stalls.py").write_text(STALLING_DATASET)
    p = start_train(tmp_path, *TINY_MODEL, "data=custom", "data.target=stalls.py:Stalls", "dataloader.batch_size=2",
                    "max_steps=100000", "log_every=1", "device=cpu", "monitor.every_n_steps=0", "hydra.run.dir=run")
    wait_for(lambda: _first_metrics(tmp_path))
    (tmp_path / "stall").touch()
    wait_for(lambda: (tmp_path / "stalled").exists())
    p.send_signal(signal.SIGINT)
    wait_for(lambda: (tmp_path / "first-signal-taken").exists())
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["status"] == "interrupted" and "second SIGINT" in s["reason"]
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.slow
def test_kill_9_during_a_checkpoint_write_leaves_the_previous_one(tmp_path: Path) -> None:
    """A model big enough that a save takes a while; killed while a .tmp is being written."""
    p = start_train(tmp_path, "model.n_layer=2", "model.n_embd=512", "model.n_head=4", "model.block_size=32",
               "dataloader.batch_size=2", "max_steps=100000", "log_every=1", "device=cpu",
               "monitor.every_n_steps=0", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2", "hydra.run.dir=run")
    ckdir = tmp_path / "run" / "checkpoints"
    try:
        wait_for(lambda: len(checkpoint_files.list_checkpoints(ckdir)) >= 1)
        wait_for(lambda: any(ckdir.glob("*.tmp")))
        p.kill()
    finally:
        p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert any(ckdir.glob("*.tmp"))  # it really died mid-write
    good = checkpoint_files.list_checkpoints(ckdir)[-1]
    step = checkpoint_files.load(good)["step"]
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # every line that was written is whole
    s = run(make_cfg("model.n_layer=2", "model.n_embd=512", "model.n_head=4", "model.block_size=32",
                     "dataloader.batch_size=2", f"max_steps={step + 1}", f"resume={good}"), tmp_path / "resumed")
    assert s["status"] == "completed" and s["start_step"] == step
    assert np.isfinite(s["final_train_loss"])
