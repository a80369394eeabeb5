"""The trainer on the CPU with tiny models: it learns, every knob runs, knobs undo themselves,
and what it writes agrees with itself."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from perfrun.config import ConfigError
from perfrun.environment import global_state
from perfrun.knobs import Plan
from perfrun.loop.run import run
from perfrun.models.gpt import GPT, GPTConfig

from conftest import make_cfg


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def unigram_entropy(tokens: np.ndarray) -> float:
    """The best loss (nats/token) a model that ignores context can reach on these tokens."""
    counts = np.bincount(tokens, minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


@pytest.mark.slow
def test_default_data_learns_beyond_unigram(tmp_path: Path) -> None:
    """The default run learns: validation loss falls from ln(256) = 5.55 (uniform bytes)
    to below the val set's own unigram entropy (about 3.3 nats for Python source), which
    no model can reach without using context, so the drop is learning, not noise."""
    cfg = make_cfg("max_steps=100", "model.n_embd=64", "model.block_size=64", "dataloader.batch_size=8",
                   "optim.lr=3e-3", "eval_batches=8")
    summary = run(cfg, tmp_path)
    from perfrun.data import build_datasets

    val = build_datasets(cfg.data, 64, cfg.seed).val
    tokens = np.concatenate([val[i][0].numpy() for i in range(min(len(val), 2000))])
    h = unigram_entropy(tokens)
    assert summary["status"] == "completed"
    assert summary["final_val_loss"] < h - 0.1, (summary["final_val_loss"], h)
    losses = train_losses(tmp_path)
    assert losses[0] > losses[-1] + 1.0


def watch_training_forwards(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.dtype, int]]:
    """Per training forward of the run's GPT: the dtype its first block's MLP produced and
    how many tensors autograd kept for the backward (the FLOP count's forward, on fake
    tensors or under its counting mode, and evaluation's without grad, left out: the first
    job of a process counts a small model's FLOPs on real tensors). Cleared by the caller
    between runs."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    seen: list[tuple[torch.dtype, int]] = []
    real = GPT.forward

    def forward(self: GPT, idx: torch.Tensor, *args: object, **kwargs: object) -> object:
        if isinstance(idx, FakeTensor) or not torch.is_grad_enabled() or is_in_torch_dispatch_mode():
            return real(self, idx, *args, **kwargs)
        got: dict = {"saved": 0}

        def pack(t: torch.Tensor) -> torch.Tensor:
            got["saved"] += 1
            return t

        def note_dtype(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            got.setdefault("dtype", out.dtype)

        handle = self.blocks[0].mlp.c_fc.register_forward_hook(note_dtype)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = real(self, idx, *args, **kwargs)
        finally:
            handle.remove()
        seen.append((got["dtype"], got["saved"]))
        return out

    monkeypatch.setattr(GPT, "forward", forward)
    return seen


# every precision with every checkpointing, each of them under both accumulations (pairwise:
# 9 runs instead of 18); each run is held to what its knobs change, in the trainer itself
PRECISIONS = {"none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CHECKPOINTING = ["none", "full", "selective"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_knob_matrix_changes_what_each_knob_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    precision: str) -> None:
    """Under one precision, the three checkpointings (accumulation 1 or 2, alternating over
    the matrix): the activations take the precision's dtype, checkpointing keeps fewer
    tensors for the backward (full < selective < none), accumulation runs that many forwards
    a step, and only fp16 scales its loss (a loss scale logged at every logged step)."""
    forwards = watch_training_forwards(monkeypatch)
    saved = {}
    i = list(PRECISIONS).index(precision)
    for j, checkpointing in enumerate(CHECKPOINTING):
        accum = 1 + (i + j) % 2
        forwards.clear()
        cfg = make_cfg(f"precision={precision}", f"checkpointing={checkpointing}", f"accumulation.steps={accum}",
                       "max_steps=4", "log_every=2", "timing_warmup_steps=1")
        s = run(cfg, tmp_path / checkpointing)
        assert s["status"] == "completed"
        assert s["knobs"]["precision"] == precision
        assert s["knobs"]["checkpointed_blocks"] == {"none": 0, "full": 2, "selective": 1}[checkpointing]
        assert s["tokens_per_step"] == 4 * 32 * accum
        assert s.get("knobs", {}).get("grad_scaler", False) == (precision == "fp16")
        assert all(math.isfinite(x) for x in train_losses(tmp_path / checkpointing))
        assert len(forwards) == 4 * accum, (checkpointing, len(forwards))  # micro-steps
        assert {dtype for dtype, _ in forwards} == {PRECISIONS[precision]}, forwards
        (saved[checkpointing],) = {n for _, n in forwards}
        scales = [r.get("loss_scale") for r in read_metrics(tmp_path / checkpointing) if r["kind"] == "train"]
        assert len(scales) == 2 and all((x is not None) == (precision == "fp16") for x in scales), scales
    assert saved["full"] < saved["selective"] < saved["none"], saved


def test_full_checkpointing_gives_the_same_losses(tmp_path: Path) -> None:
    a = run(make_cfg("max_steps=10"), tmp_path / "none")
    b = run(make_cfg("max_steps=10", "checkpointing=full"), tmp_path / "full")
    assert a["knobs"]["checkpointed_blocks"] == 0 and b["knobs"]["checkpointed_blocks"] == 2
    np.testing.assert_allclose(train_losses(tmp_path / "none"), train_losses(tmp_path / "full"), rtol=0, atol=1e-6)


def test_accumulation_matches_the_big_batch(tmp_path: Path) -> None:
    """4 micro-batches of 2 and one batch of 8 see the same samples in the same order and
    average the same gradients: losses agree to float32 summation-order noise."""
    a = run(make_cfg("max_steps=10", "dataloader.batch_size=8"), tmp_path / "big")
    b = run(make_cfg("max_steps=10", "dataloader.batch_size=2", "accumulation.steps=4"), tmp_path / "accum")
    assert a["tokens_per_step"] == b["tokens_per_step"]
    np.testing.assert_allclose(train_losses(tmp_path / "big"), train_losses(tmp_path / "accum"), rtol=0, atol=2e-5)


def test_the_plans_step_without_fp16_is_a_plain_backward_clip_and_step() -> None:
    """Without fp16 the plan's gradient scaler is disabled and passes everything through:
    its backward and optimizer step give the same gradient norms and weights, bit for bit,
    as loss.backward(), clip_grad_norm_ and optimizer.step() written out by hand."""
    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    plain = GPT(ours.config)
    plain.load_state_dict(ours.state_dict())
    plan = Plan(model=ours, raw_model=ours)
    opt_ours, opt_plain = torch.optim.AdamW(ours.parameters(), lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x, y = torch.randint(64, (4, 16)), torch.randint(64, (4, 16))
    for _ in range(3):
        plan.backward(ours(x, y)[1])
        norm_ours = plan.optimizer_step(opt_ours, list(ours.parameters()), clip=0.5)
        opt_ours.zero_grad(set_to_none=True)
        plain(x, y)[1].backward()
        norm_plain = torch.nn.utils.clip_grad_norm_(list(plain.parameters()), 0.5)
        opt_plain.step()
        opt_plain.zero_grad(set_to_none=True)
        assert torch.equal(norm_ours, norm_plain) and norm_ours > 0.5  # clipping did something
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), plain.parameters(), strict=True))
    assert not plan.skips_nonfinite_steps and plan.loss_scale() is None and plan.state_dict() is None


def test_compile_runs_matches_eager_and_leaves_no_state(tmp_path: Path) -> None:
    before = global_state()
    eager = run(make_cfg("max_steps=3", "log_every=1", "timing_warmup_steps=1"), tmp_path / "eager")
    compiled = run(make_cfg("max_steps=3", "log_every=1", "timing_warmup_steps=1", "compile=true"), tmp_path / "compiled")
    assert compiled["knobs"]["compile"] is True
    assert compiled["compile_s_estimate"] is not None and compiled["compile_s_estimate"] > 0
    assert compiled["first_step_s"] > compiled["step_time_ms_median"] / 1000
    np.testing.assert_allclose(train_losses(tmp_path / "eager"), train_losses(tmp_path / "compiled"), rtol=1e-4)
    assert global_state() == before
    assert compiled["global_state_after"]["compiled_frames"] == 0
    assert eager["global_state_at_start"] == before


def test_summary_agrees_with_metrics(tmp_path: Path) -> None:
    s = run(make_cfg("max_steps=12", "log_every=5", "timing_warmup_steps=2"), tmp_path)
    train = [r for r in read_metrics(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [5, 10, 12]  # the last, partial interval is logged too
    assert s["tokens"] == sum(r["interval_tokens"] for r in train) == 12 * s["tokens_per_step"]
    assert s["train_time_s"] == pytest.approx(sum(r["interval_s"] for r in train), rel=1e-9)
    for r in train:
        assert r["tokens_per_s"] == pytest.approx(r["interval_tokens"] / r["interval_s"], rel=1e-9)
    assert s["steady_steps"] == 10
    assert s["tokens_per_s_median"] > 0 and s["final_train_loss"] == train[-1]["loss"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["tokens"] == s["tokens"] and on_disk["status"] == "completed"
    assert on_disk["environment"]["torch"] == torch.__version__
    assert on_disk["config"]["max_steps"] == 12
    evals = [r for r in read_metrics(tmp_path) if r["kind"] == "eval"]
    assert evals and evals[-1]["val_loss"] == pytest.approx(s["final_val_loss"])


def test_eager_attention_matches_sdpa(tmp_path: Path) -> None:
    run(make_cfg("max_steps=5", "log_every=1"), tmp_path / "sdpa")
    run(make_cfg("max_steps=5", "log_every=1", "attention=eager"), tmp_path / "eager")
    np.testing.assert_allclose(train_losses(tmp_path / "sdpa"), train_losses(tmp_path / "eager"), rtol=0, atol=1e-5)


def test_sdpa_backend_math_is_applied(tmp_path: Path) -> None:
    s = run(make_cfg("max_steps=2", "sdpa_backend=math"), tmp_path)
    assert s["knobs"]["sdpa_backend"] == "math"


@pytest.mark.parametrize(
    "override, words",
    [
        ("dataloader.batch_size=0", "dataloader.batch_size=0"),
        ("data.seq_len=64", "model.block_size=32"),
        ("dataloader.prefetch_factor=4", "num_workers"),
        ("device=cuda:3", "device=cuda:3"),
        ("max_steps=0", "max_steps=0"),
        ("optim.lr=nan", "optim.lr"),
        ("precision.tf32=true", "tf32"),
        ("sdpa_backend=flash", "CUDA"),
    ],
)
def test_semantic_errors_fail_before_work(tmp_path: Path, override: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as err:
        run(make_cfg(override), tmp_path)
    assert "\n" not in str(err.value)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["reason"] == str(err.value)
    assert not (tmp_path / "metrics.jsonl").read_text()


@pytest.mark.gpu
def test_gpu_bf16_compile_run_releases_its_memory(tmp_path: Path) -> None:
    """A ~50M-parameter model holds ~800 MB of weights, gradients and AdamW state. After
    a job only library workspaces stay allocated (cuBLAS/cuBLASLt keep 32 MiB each, seen
    as 65 MiB held on an H100), and a second identical job adds nothing: no per-job leak."""
    cfg = make_cfg("device=cuda", "precision=bf16", "compile=true", "max_steps=20", "model.n_layer=4",
                   "model.n_embd=1024", "model.n_head=8")
    first = run(cfg, tmp_path / "a")
    second = run(cfg, tmp_path / "b")
    assert first["status"] == second["status"] == "completed"
    assert first["peak_mem_source"] == "cuda_max_memory_allocated" and first["peak_mem_mib"] > 600
    held = first["global_state_after"]["cuda_memory_allocated"] - first["global_state_at_start"]["cuda_memory_allocated"]
    assert held < 128 * 2**20, held
    assert second["global_state_after"]["cuda_memory_allocated"] == first["global_state_after"]["cuda_memory_allocated"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16", "none"])
def test_gpu_precisions_learn(tmp_path: Path, precision: str) -> None:
    s = run(make_cfg("device=cuda", f"precision={precision}", "max_steps=60", "optim.lr=3e-3"), tmp_path)
    losses = train_losses(tmp_path)
    assert s["status"] == "completed" and losses[-1] < losses[0] - 0.5
    assert s["mfu_peak_tflops"] is None or s["mfu_median"] > 0
