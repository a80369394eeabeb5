"""FSDP2 on the CPU with gloo (torch supports ``fully_shard`` there): 2 ranks match one
process, sharded ``torch.distributed.checkpoint`` folders are written by every rank, and
resume is exact on the same ranks and continues on another number of ranks, or in one
plain process. The host-overhead settings (``fsdp.reshard_last_block``, explicit
prefetching, per-block compile) change what FSDP2 does and not the losses. Tiny models and
few steps: each torchrun start costs ~5 s of imports, so those run in one process (a world
of one over gloo) where they can.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from perfrun import distributed
from perfrun.checkpoint import files as checkpoint_files
from perfrun.config import ConfigError
from perfrun.inference.loading import load_model
from perfrun.knobs import Plan, apply_knobs
from perfrun.loop.run import run
from perfrun.models.gpt import GPT, GPTConfig

from conftest import RANKS_COMMON, launch, losses, make_cfg, perfrun_process, torchrun

TOL = 1e-5  # float32 sums in another order (see test_distributed.py)
STEPS = 6
COMMON = RANKS_COMMON  # 6 steps of the tiny model, 2 micro-steps


CHUNKED = ["loss=chunked", "loss.chunk_size=24"]  # 2 x 32 = 64 rows per rank: 3 chunks, the last one short


@pytest.fixture(scope="module")
def fsdp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 ranks x batch 2 x 2 micro-steps, through ``perfrun train distributed=fsdp nproc=2``
    (the launcher in this process; torchrun and the ranks are real processes), with the
    chunked loss: held to one process with the standard loss, it shows both FSDP2 and the
    chunked loss under FSDP2 (DDP's case is test_distributed.py's sweep)."""
    run_dir = tmp_path_factory.mktemp("fsdp") / "run"
    assert launch("train", *COMMON, *CHUNKED, "distributed=fsdp", "nproc=2", "dataloader.batch_size=2",
                  "checkpoint.every_n_steps=3", "checkpoint.keep_last=5", f"hydra.run.dir={run_dir}",
                  cwd=run_dir.parent) == 0
    return run_dir


@pytest.mark.slow
def test_two_fsdp_ranks_match_one_process(fsdp_dir: Path, one_process_run: tuple[Path, dict[str, Any]]) -> None:
    s = json.loads((fsdp_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["world_size"] == 2 and s["knobs"]["distributed"] == "fsdp"
    assert s["knobs"]["loss"] == {"name": "chunked", "chunk_size": 24}
    assert one_process_run[1]["knobs"]["loss"] == {"name": "standard"}
    assert s["knobs"]["fsdp"] == {"shard_groups": 3, "param_dtype": "float32", "reduce_dtype": "float32",
                                  "reshard_after_forward": True, "reshard_last_block": False,
                                  "forward_prefetch": 0, "backward_prefetch": 0, "backend": "gloo"}
    a, b = losses(one_process_run[0]), losses(fsdp_dir)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert all(abs(a[k] - b[k]) <= TOL * abs(a[k]) for k in a), (a, b)


@pytest.mark.slow
def test_every_rank_writes_its_shards_into_one_folder(fsdp_dir: Path) -> None:
    ckpts = checkpoint_files.list_checkpoints(fsdp_dir / "checkpoints")
    assert [c.name for c in ckpts] == ["step_0000003", "step_0000006"]
    for c in ckpts:
        assert sorted(f.name for f in c.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    meta = checkpoint_files.load(ckpts[-1])  # weights_only: a plain dict of the rest of the state
    assert meta["sharded"] and meta["world_size"] == 2 and meta["step"] == 6 and "model" not in meta
    assert len(meta["rng_ranks"]) == 2
    assert not torch.equal(meta["rng_ranks"][0]["torch"], meta["rng_ranks"][1]["torch"])  # own dropout streams
    assert not list(fsdp_dir.rglob("*.partial"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", "none"])
def test_resume_on_one_process_continues_with_the_same_global_batch(
        fsdp_dir: Path, tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    """Saved by 2 FSDP ranks, read by 1 (DCP reshards), FSDP or a plain model."""
    with caplog.at_level(logging.WARNING, logger="perfrun"):
        s = run(make_cfg(*COMMON, f"distributed={mode}", "dataloader.batch_size=4",
                         f"resume={fsdp_dir / 'checkpoints' / 'step_0000003'}", "checkpoint.at_end=false"), tmp_path)
    assert s["start_step"] == 3 and s["data_position"] == json.loads((fsdp_dir / "summary.json").read_text())["data_position"]
    assert "saved by 2 rank(s) and continues on 1" in caplog.text
    a, b = losses(fsdp_dir), losses(tmp_path)  # weights, Adam moments, schedule and data order carried over
    assert sorted(b) == [4, 5, 6]
    assert all(abs(a[k] - b[k]) <= TOL * abs(a[k]) for k in b), (a, b)


@pytest.mark.slow
def test_the_same_global_batch_split_another_way_warns(
        fsdp_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """2 ranks x 2 x 2 micro-steps, resumed as 1 x 8 x 1: the same 8 sequences per step."""
    with caplog.at_level(logging.WARNING, logger="perfrun"):
        s = run(make_cfg(*COMMON, "dataloader.batch_size=8", "accumulation.steps=1", "checkpoint.at_end=false",
                         f"resume={fsdp_dir / 'checkpoints' / 'step_0000003'}"), tmp_path)
    assert s["status"] == "completed" and s["start_step"] == 3
    assert "the same global batch split another way" in caplog.text and "instead of 4" in caplog.text


@pytest.mark.slow
def test_unreadable_shards_are_one_line(fsdp_dir: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "step_0000003"
    shutil.copytree(fsdp_dir / "checkpoints" / "step_0000003", ckpt)
    (ckpt / "__1_0.distcp").unlink()  # what a rank sees when the folder is not shared
    with pytest.raises(ConfigError, match=r"its shards cannot be read \(.*\); every rank must see the whole folder"):
        run(make_cfg(*COMMON, "distributed=fsdp", "dataloader.batch_size=4", f"resume={ckpt}"), tmp_path / "r")


def test_a_failed_sharded_save_is_one_line_and_keeps_nothing_half_done(tmp_path: Path) -> None:
    from perfrun.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=1, n_embd=8, dropout=0.0, bias=True,
                          attention="sdpa"))
    (tmp_path / ".step_0000005.partial").write_text("a file where the save's folder must go")
    with pytest.raises(checkpoint_files.CheckpointWriteError, match="could not save the checkpoint for step 5"):
        checkpoint_files.save_sharded(tmp_path, 5, model, torch.optim.AdamW(model.parameters()), {}, keep_last=2)
    assert checkpoint_files.list_checkpoints(tmp_path) == []


@pytest.mark.slow
def test_a_different_global_batch_is_refused(fsdp_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"global batch of 8 sequences per step .* set dataloader.batch_size=4"):
        run(make_cfg(*COMMON, "distributed=fsdp", "dataloader.batch_size=2",
                     f"resume={fsdp_dir / 'checkpoints' / 'step_0000003'}"), tmp_path)


def test_fsdp_refuses_a_single_file_checkpoint(tmp_path: Path) -> None:
    run(make_cfg(*COMMON, "dataloader.batch_size=4", "max_steps=2"), tmp_path / "plain")
    (ckpt,) = checkpoint_files.list_checkpoints(tmp_path / "plain" / "checkpoints")
    with pytest.raises(ConfigError, match="single-file checkpoint .* resume it with distributed=ddp"):
        run(make_cfg(*COMMON, "distributed=fsdp", "dataloader.batch_size=4", f"resume={ckpt}"), tmp_path / "r")


@pytest.mark.slow
def test_a_save_cut_short_is_ignored_and_cleaned_up(fsdp_dir: Path, tmp_path: Path) -> None:
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(fsdp_dir / "checkpoints", ckpts)
    partial = ckpts / ".step_0000009.partial"  # what kill -9 during a save leaves: shards, no meta.pt
    shutil.copytree(ckpts / "step_0000006", partial)
    (partial / "meta.pt").unlink()
    incomplete = ckpts / "step_0000012"  # a folder of that name without meta.pt is not a checkpoint
    incomplete.mkdir()
    assert checkpoint_files.resolve("auto", ckpts).name == "step_0000006"
    whole = ckpts / ".step_0000005.partial"  # complete, cut off before its rename: recovered
    shutil.copytree(ckpts / "step_0000003", whole)
    checkpoint_files.recover_interrupted_saves(ckpts)
    assert (ckpts / "step_0000005" / "meta.pt").is_file() and not whole.exists() and not partial.exists()
    shutil.copytree(ckpts / "step_0000005", partial)  # and a cut-short one again for the run below
    (partial / "meta.pt").unlink()
    s = run(make_cfg(*COMMON, "distributed=fsdp", "dataloader.batch_size=4", "max_steps=7", "resume=auto",
                     f"checkpoint.dir={ckpts}"), tmp_path / "r")
    assert s["status"] == "completed" and s["start_step"] == 6
    assert not partial.exists() and (ckpts / "step_0000007" / "meta.pt").is_file()


def test_a_step_in_both_layouts_resolves_to_the_newer(tmp_path: Path) -> None:
    (tmp_path / "step_0000003").mkdir()
    (tmp_path / "step_0000003" / "meta.pt").write_bytes(b"x")
    (tmp_path / "step_0000003.pt").write_bytes(b"x")
    os.utime(tmp_path / "step_0000003.pt", (1, 1))  # the single file is older
    assert checkpoint_files.list_checkpoints(tmp_path)[-1].name == "step_0000003"
    os.utime(tmp_path / "step_0000003" / "meta.pt", (0, 0))
    os.utime(tmp_path / "step_0000003", (0, 0))
    assert checkpoint_files.list_checkpoints(tmp_path)[-1].name == "step_0000003.pt"


@pytest.mark.slow
def test_generate_and_export_read_a_sharded_checkpoint(
        fsdp_dir: Path, one_process_run: tuple[Path, dict[str, Any]]) -> None:
    sharded = load_model(fsdp_dir)  # a run folder: its newest checkpoint
    assert sharded.tokenizer().name == "byte"  # byte-level: generate reads and writes its text
    assert sharded.step == 6 and sharded.path.name == "step_0000006"
    # the 2-rank sharded weights are the weights one process trains with the same global batch
    plain = load_model(one_process_run[0] / "checkpoints" / "step_0000006.pt")
    a, b = sharded.model.state_dict(), plain.model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6, msg=name)


def _trained_to(metrics: Path, step: int) -> bool:
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    return any(r["kind"] == "train" and r["step"] >= step for r in map(json.loads, filter(None, lines)))


@pytest.mark.slow
def test_sigterm_stops_every_rank_at_one_step_and_the_same_ranks_resume_exactly(tmp_path: Path) -> None:
    """SIGTERM to ``perfrun train distributed=fsdp nproc=2`` (as a scheduler sends it): the
    launcher passes it to torchrun, which passes it to both ranks; they agree on one step,
    write one sharded checkpoint together, and exit 143. Its sharded checkpoints then resume
    on the same 2 ranks:

    - exactly, dropout included (each rank draws its own masks; resume gives every rank its
      own RNG back): from the checkpoint two steps before the stop, the stopped run's last two
      steps again, bit for bit. That resume is raw torchrun with no hydra.run.dir: rank 0 resolves
      outputs/DATE/TIME and broadcasts it, so both ranks write into one run dir. The
      learning rate is still warming up at every step here (optim.warmup_steps=1000), where
      it depends on the step alone: the runs can stop at different max_steps and share it.
    - resume=auto in the stopped run's dir picks its newest sharded checkpoint, the stop's
      (rank 0's choice, which every rank then loads as the exact resume above does).

    The launcher's resume=auto, which continues a stopped run in its run dir on the same
    ranks exactly, is in test_distributed.py (DDP: the launcher and the run dir do not
    depend on how the weights are saved)."""
    args = [*COMMON, "distributed=fsdp", "dataloader.batch_size=2", "model.dropout=0.1", "optim.warmup_steps=1000",
            "checkpoint.every_n_steps=1", "checkpoint.keep_last=3"]
    stopped = tmp_path / "run"
    p = perfrun_process("train", *args, f"hydra.run.dir={stopped}", "nproc=2", "max_steps=100000", cwd=tmp_path,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 120
    while not _trained_to(stopped / "metrics.jsonl", 3):  # checkpoints before the stop's to resume from
        assert time.monotonic() < end and p.poll() is None, p.stderr.read() if p.poll() is not None else "timeout"
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 143 and "Traceback" not in err, err
    s = json.loads((stopped / "summary.json").read_text())
    assert s["status"] == "interrupted" and s["interrupted_by"] == signal.SIGTERM
    stop = s["steps"]
    before, middle, last = checkpoint_files.list_checkpoints(stopped / "checkpoints")  # keep_last=3
    meta = checkpoint_files.load(last)
    assert meta["step"] == stop and meta["world_size"] == 2 and len(list(last.glob("*.distcp"))) == 2
    assert checkpoint_files.load(before)["step"] == stop - 2

    cwd = tmp_path / "exact"
    cwd.mkdir()
    p2 = torchrun(cwd, *args, f"max_steps={stop}", f"resume={before}")
    assert p2.returncode == 0, p2.stderr
    (resumed,) = cwd.glob("outputs/*/*")
    assert len(list(cwd.rglob("metrics.jsonl"))) == 1 and (resumed / "summary.json").is_file()
    assert [c.name for c in checkpoint_files.list_checkpoints(resumed / "checkpoints")] == [middle.name, last.name]
    a, b = losses(stopped), losses(resumed)
    assert sorted(b) == [stop - 1, stop]
    assert [a[k] for k in b] == [b[k] for k in b]  # bit for bit
    s_exact = json.loads((resumed / "summary.json").read_text())
    assert s_exact["start_step"] == stop - 2 and s_exact["data_position"] == s["data_position"]

    assert checkpoint_files.resolve("auto", stopped / "checkpoints") == last


@pytest.mark.parametrize("precision, dtype, reshard", [("bf16", "bfloat16", True), ("fp16", "float16", False)])
def test_fsdp_mixed_precision_policy_follows_the_precision_group(
        precision: str, dtype: str, reshard: bool, tmp_path: Path) -> None:
    s = run(make_cfg(*COMMON, "distributed=fsdp", "dataloader.batch_size=4", f"precision={precision}",
                     f"fsdp.reshard_after_forward={str(reshard).lower()}", "max_steps=3", "checkpoint.at_end=false"),
            tmp_path)
    assert s["status"] == "completed" and s["knobs"]["fsdp"]["param_dtype"] == dtype
    assert s["knobs"]["fsdp"]["reshard_after_forward"] is reshard
    assert s["knobs"]["fsdp"]["reduce_dtype"] == "float32"
    assert s["knobs"].get("grad_scaler", False) == (precision == "fp16")
    assert s["final_train_loss"] == pytest.approx(5.5, abs=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("compile_", [False, True])
def test_fsdp_on_cuda_over_nccl_trains_saves_and_resumes(compile_: bool, tmp_path: Path) -> None:
    """One rank on the GPU, under torchrun, so the group is NCCL with the gloo side group."""
    args = [*COMMON, "device=cuda", "precision=bf16", "distributed=fsdp", "dataloader.batch_size=4",
            f"compile={str(compile_).lower()}", "checkpoint.every_n_steps=3"]
    p = torchrun(tmp_path, *args, f"hydra.run.dir={tmp_path / 'a'}", nproc=1)
    assert p.returncode == 0, p.stderr
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert s["status"] == "completed" and s["knobs"]["fsdp"]["param_dtype"] == "bfloat16"
    assert s["knobs"]["fsdp"]["backend"] == "nccl"
    assert s["knobs"]["compile"] == compile_
    assert s["environment"]["device_name"] and s["peak_mem_source"] == "cuda_max_memory_allocated"
    p = torchrun(tmp_path, *args, f"resume={tmp_path / 'a' / 'checkpoints' / 'step_0000003'}",
                 f"hydra.run.dir={tmp_path / 'b'}", nproc=1)
    assert p.returncode == 0, p.stderr
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(b) == [4, 5, 6]
    assert all(abs(a[k] - b[k]) <= 1e-3 * abs(a[k]) for k in b), (a, b)  # bf16 kernels may differ run to run


def test_saving_a_step_again_replaces_it_only_once_the_new_one_is_whole(tmp_path: Path) -> None:
    """One process, no process group (DCP then writes alone): the second save of step 5
    is written beside the first and takes its name only when complete."""
    POSITION = {"step": 5, "data": {"epoch": 0, "consumed": 0}}  # noqa: N806 - what every real checkpoint records
    from perfrun.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=1, n_embd=8, dropout=0.0, bias=True,
                          attention="sdpa"))
    opt = torch.optim.AdamW(model.parameters())
    checkpoint_files.save_sharded(tmp_path, 5, model, opt, {"note": "first", **POSITION}, keep_last=3)
    with torch.no_grad():
        model.wte.weight.add_(1.0)
    checkpoint_files.save_sharded(tmp_path, 5, model, opt, {"note": "second", **POSITION}, keep_last=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000005"]
    ckpt = checkpoint_files.load(tmp_path / "step_0000005")
    assert ckpt["note"] == "second"
    fresh = GPT(model.config)
    checkpoint_files.load_model_weights(ckpt, fresh)
    assert torch.equal(fresh.wte.weight, model.wte.weight)


def sharded(stack: ExitStack, *overrides: str) -> tuple[GPT, Plan]:
    """A 3-block GPT through the knobs under distributed=fsdp, a world of one over gloo."""
    cfg = make_cfg(*COMMON, "distributed=fsdp", "model.n_layer=3", *overrides)
    device = distributed.setup_device("cpu", "fsdp", stack)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=3, n_head=2, n_embd=32))
    return model, apply_knobs(cfg, device, model, stack)


TOKENS = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("overrides, held, forward, backward", [
    # held after forward: blocks 0-2, then the root; prefetches: how often each block's all-gather was issued early
    ((), [False, False, True, True], {}, {"blocks.2": 1, "blocks.1": 1, "blocks.0": 1}),
    (("fsdp.reshard_last_block=true",), [False] * 4, {}, {"blocks.2": 1, "blocks.1": 1, "blocks.0": 1}),
    (("fsdp.reshard_after_forward=false",), [True] * 4, {}, {"blocks.2": 1, "blocks.1": 1, "blocks.0": 1}),
    (("fsdp.forward_prefetch=2", "fsdp.backward_prefetch=2"), [False, False, True, True],
     {"blocks.1": 1, "blocks.2": 2}, {"blocks.2": 1, "blocks.1": 1, "blocks.0": 2}),
])
def test_reshard_and_prefetch_settings_change_what_fsdp_does(
        overrides: tuple[str, ...], held: list[bool], forward: dict[str, int], backward: dict[str, int]) -> None:
    """Which shard groups still hold their gathered (plain, not DTensor) weights between the
    forward and the backward, and which all-gathers FSDP2 issued ahead (its profiler marks)."""
    with ExitStack() as stack:
        model, plan = sharded(stack, *overrides)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _, loss = plan.model(TOKENS[:, :-1], TOKENS[:, 1:])
            after_forward = [not isinstance(m.weight, DTensor) for m in (*(b.mlp.c_fc for b in model.blocks), model.wte)]
            loss.backward()
    marks = Counter(e.name.split("FSDP::")[1] for e in prof.events() if e.name.startswith("FSDP::") and "_prefetch for" in e.name)
    assert after_forward == held
    assert {k.removeprefix("forward_prefetch for "): n for k, n in marks.items() if k.startswith("forward")} == forward
    assert {k.removeprefix("backward_prefetch for "): n for k, n in marks.items() if k.startswith("backward")} == backward
    assert plan.notes["fsdp"]["reshard_last_block"] == ("fsdp.reshard_last_block=true" in overrides)


@pytest.mark.slow
def test_per_block_compile_keeps_fsdp_hooks_outside_the_graph() -> None:
    """compile_options.scope=blocks under FSDP2: every sharded block's forward is compiled
    whole (fullgraph: a hook inside would break the graph and fail), FSDP2's hooks stay on the
    module, and loss and gradients equal the eager sharded model's. aot_eager instead of
    inductor: the question is where dynamo's graph ends, not which kernels inductor writes."""
    x, y = TOKENS[:, :-1], TOKENS[:, 1:]
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        with ExitStack() as stack:
            model, plan = sharded(stack, f"compile={str(compiled).lower()}", "compile_options.scope=blocks",
                                  "compile_options.fullgraph=true", "compile_options.backend=aot_eager",
                                  "fsdp.forward_prefetch=1", "fsdp.backward_prefetch=1")
            for block in model.blocks:
                assert isinstance(block, FSDPModule) and block._forward_pre_hooks and block._forward_hooks
                assert hasattr(block.__dict__.get("forward"), "_torchdynamo_orig_callable") == compiled
            _, loss = plan.model(x, y)
            loss.backward()
            results.append((loss.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}))
    (eager_loss, eager_grads), (loss, grads) = results
    assert abs(loss - eager_loss) <= TOL * abs(eager_loss)
    for name, grad in eager_grads.items():
        assert ((grads[name] - grad).norm() / grad.norm()).item() <= TOL, name


def test_the_host_overhead_settings_keep_the_losses(tmp_path: Path) -> None:
    """Every setting on (no reshard of the last block and root, prefetching 2 ahead both
    ways) against FSDP2 as it was (every group resharded, implicit prefetch) and one plain
    process, same global batch."""
    base = [*COMMON, "dataloader.batch_size=4", "checkpoint.at_end=false", "model.n_layer=3", "max_steps=3"]
    runs = {"plain": [], "fsdp": ["distributed=fsdp", "fsdp.reshard_last_block=true"],
            "tuned": ["distributed=fsdp", "fsdp.forward_prefetch=2", "fsdp.backward_prefetch=2"]}
    got = {}
    for name, extra in runs.items():
        s = run(make_cfg(*base, *extra), tmp_path / name)
        assert s["status"] == "completed"
        got[name] = losses(tmp_path / name)
    assert s["knobs"]["fsdp"]["forward_prefetch"] == s["knobs"]["fsdp"]["backward_prefetch"] == 2
    assert sorted(got["plain"]) == sorted(got["fsdp"]) == sorted(got["tuned"]) == [1, 2, 3]
    for name in ("fsdp", "tuned"):
        assert all(abs(got[name][k] - got["plain"][k]) <= TOL * abs(got["plain"][k]) for k in got["plain"]), got
