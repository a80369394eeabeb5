"""The memory knobs that make a model fit: AdamW's moments in 8 or 4 bits (torchao), the
optimizer step in the backward, offloading to host memory (CUDA). Each trains, resumes bit for
bit and, where it should, gives the same run as the knob's absence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from perfrun.checkpoint import files as checkpoint_files
from perfrun.commands import estimate as estimate_command
from perfrun.config import select
from perfrun.loop.run import run
from perfrun.memory.estimate import estimate
from perfrun.optim.low_bit import state_bytes

from conftest import TINY_MODEL, make_cfg

# matrices of 4096 values or more (torchao keeps smaller tensors' moments in fp32), divisible
# by both block sizes (256 and 128): the quantized state is exercised
QUANTIZED = ["model.n_embd=64", "dataloader.batch_size=8"]


def train_records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "train"}


def resumed_equals_uninterrupted(tmp_path: Path, *common: str) -> dict:
    """Train 8 steps, and 4 then 4 more from the step-4 checkpoint: the resumed losses must
    equal the uninterrupted run's bit for bit. Returns the step-4 checkpoint."""
    common = ("max_steps=8", "log_every=1", *common)
    full = run(make_cfg(*common, "checkpoint.every_n_steps=4", "checkpoint.keep_last=5"), tmp_path / "full")
    ckpt = tmp_path / "full" / "checkpoints" / "step_0000004.pt"
    resumed = run(make_cfg(*common, f"resume={ckpt}"), tmp_path / "resumed")
    a, b = train_records(tmp_path / "full"), train_records(tmp_path / "resumed")
    assert sorted(b) == [5, 6, 7, 8] and resumed["start_step"] == 4
    assert [a[k]["loss"] for k in range(5, 9)] == [b[k]["loss"] for k in range(5, 9)]
    assert [a[k]["lr"] for k in range(5, 9)] == [b[k]["lr"] for k in range(5, 9)]
    assert resumed["final_val_loss"] == full["final_val_loss"]
    return torch.load(ckpt, map_location="cpu", weights_only=True)


@pytest.mark.slow  # torchao compiles its step for each parameter shape (inductor, C++)
@pytest.mark.parametrize("name,codes_per_value", [("adamw8bit", 1.0), ("adamw4bit", 0.5)])
def test_low_bit_adamw_resumes_bit_exact_from_plain_tensors(tmp_path: Path, name: str, codes_per_value: float) -> None:
    """The 8/4-bit moments are saved as their codes, scales and map (weights-only loadable:
    torch's unpickler makes no tensor subclass) and come back to continue the run exactly."""
    ckpt = resumed_equals_uninterrupted(tmp_path, f"optim={name}", *QUANTIZED)
    shapes = {k: v.shape for k, v in ckpt["model"].items()}
    quantized = 0
    for entry in ckpt["optimizer"]["state"].values():
        for moment in ("exp_avg", "exp_avg_sq"):
            value = entry[moment]
            if isinstance(value, dict):  # a quantized moment, as its parts
                quantized += 1
                assert value["codes"].dtype == torch.uint8
                numel = value["codes"].numel() / codes_per_value
                assert numel >= 4096 and any(numel == s.numel() for s in shapes.values())
            else:
                assert value.dtype == torch.float32 and value.numel() < 4096
    assert quantized >= 2 * 4  # every matrix of both blocks and the embedding at the least
    # the estimate's layout of the state (fake tensors cannot make torchao's) is the saved state's size
    saved = sum(t.numel() * t.element_size() for entry in ckpt["optimizer"]["state"].values() for v in entry.values()
                for t in ([v[k] for k in ("codes", "scale", "qmap")] if isinstance(v, dict) else [v]))
    numels = [int(e["exp_avg"]["codes"].numel() / codes_per_value) if isinstance(e["exp_avg"], dict)
              else e["exp_avg"].numel() for e in ckpt["optimizer"]["state"].values()]  # one entry a parameter
    assert saved == state_bytes(name, numels)


@pytest.mark.slow  # torchao's step compiled (the shapes of the test above: cached when run after it)
def test_a_tracked_step_of_low_bit_adamw_counts_its_state_as_the_estimate_does(tmp_path: Path) -> None:
    """memory.breakdown=true (every ladder rung's): the tracked step runs torchao's step eagerly
    (its fullgraph compile fails under the tracker) and the run goes on compiled after it; the
    measured optimizer state is the estimate's layout figure, byte for byte."""
    words = ["optim=adamw8bit", *QUANTIZED, "data=synthetic", "data.vocab_size=256", "memory.breakdown=true",
             "max_steps=5", "timing_warmup_steps=2"]
    summary = run(make_cfg(*words), tmp_path)
    b = summary["memory"]["breakdown"]
    assert summary["status"] == "completed" and summary["steps"] == 5 and any("eagerly" in n for n in b["notes"])
    assert b["categories_bytes"]["Optstate"] == estimate(make_cfg(*words), 256).breakdown.categories["Optstate"]


def test_low_bit_adamw_is_refused_where_unmeasured(tmp_path: Path) -> None:
    from perfrun.config import ConfigError

    with pytest.raises(ConfigError, match="optim=adamw4bit with distributed=ddp"):
        run(make_cfg("optim=adamw4bit", "distributed=ddp"), tmp_path)
    assert not (tmp_path / "summary.json").exists() or json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("extra", [
    pytest.param([], id="fp32"),
    pytest.param(["precision=bf16", "checkpointing=full"], id="bf16-checkpointed"),
    pytest.param(["loss=chunked", "model.dropout=0.1"], id="chunked-dropout"),
])
def test_optimizer_step_in_the_backward_trains_as_the_step_after_it(tmp_path: Path, extra: list[str]) -> None:
    """Each parameter stepped in its gradient's hook gives the losses and weights of the step
    after the backward, bit for bit (the same AdamW, the same rates from the schedule); the
    gradient norm is summed in another order, so equal to rounding."""
    common = ["max_steps=6", "log_every=1", "optim.grad_clip=0", "checkpoint.every_n_steps=6", *extra]
    after = run(make_cfg(*common), tmp_path / "after")
    inside = run(make_cfg(*common, "optim.in_backward=true"), tmp_path / "inside")
    a, b = train_records(tmp_path / "after"), train_records(tmp_path / "inside")
    assert [a[k]["loss"] for k in a] == [b[k]["loss"] for k in b] and len(a) == 6
    assert [a[k]["lr"] for k in a] == [b[k]["lr"] for k in b]
    assert [b[k]["grad_norm"] for k in b] == pytest.approx([a[k]["grad_norm"] for k in a], rel=1e-6)
    weights = [torch.load(checkpoint_files.list_checkpoints(tmp_path / d / "checkpoints")[-1], map_location="cpu",
                          weights_only=True)["model"] for d in ("after", "inside")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert inside["knobs"]["optim_in_backward"] is True and after["final_val_loss"] == inside["final_val_loss"]


def test_optimizer_step_in_the_backward_resumes_bit_exact(tmp_path: Path) -> None:
    resumed_equals_uninterrupted(tmp_path, "optim.in_backward=true", "optim.grad_clip=0", "model.dropout=0.1")


@pytest.mark.slow  # compiles the tiny model twice (inductor, C++)
def test_optimizer_step_in_the_backward_under_compile(tmp_path: Path) -> None:
    """Under torch.compile the hooks still fire on the plain model's parameters (after the
    compiled backward accumulates each gradient): the losses match the compiled run's."""
    common = ["max_steps=4", "log_every=1", "optim.grad_clip=0", "compile=true"]
    run(make_cfg(*common), tmp_path / "after")
    run(make_cfg(*common, "optim.in_backward=true"), tmp_path / "inside")
    a, b = train_records(tmp_path / "after"), train_records(tmp_path / "inside")
    assert [a[k]["loss"] for k in a] == pytest.approx([b[k]["loss"] for k in b], rel=1e-6) and len(a) == 4


SMALL = ["data=synthetic", "data.vocab_size=256", *TINY_MODEL, "model.n_embd=64"]


def test_the_estimate_holds_low_bit_state_at_its_size_and_no_gradients_in_the_backward() -> None:
    """fp32 AdamW's state under the tracker is the layout's fp32 figure; the 8/4-bit state is
    its layout's; stepping in the backward holds no gradient at the step's peak (a batch of
    one short sequence: the peak is the optimizer step's, where the gradients were)."""
    cfg = [*SMALL, "dataloader.batch_size=1", "data.seq_len=4"]
    base = estimate(make_cfg(*cfg), 256, top=0)
    numels = [p.numel() for p in torch.nn.Module.parameters(_model(make_cfg(*cfg)))]
    assert base.breakdown.categories["Optstate"] == state_bytes("adamw", numels)
    for name in ("adamw8bit", "adamw4bit"):
        low = estimate(make_cfg(*cfg, f"optim={name}"), 256, top=0)
        assert low.breakdown.categories["Optstate"] == state_bytes(name, numels) < state_bytes("adamw", numels) / 3
        assert base.peak_bytes - low.peak_bytes == state_bytes("adamw", numels) - state_bytes(name, numels)
        assert any(name in note for note in low.not_counted)
    assert base.breakdown.categories["Gradient"] > 0
    inside = estimate(make_cfg(*cfg, "optim.in_backward=true", "optim.grad_clip=0"), 256, top=0)
    assert inside.breakdown.categories["Gradient"] == 0 and inside.peak_bytes < base.peak_bytes


def _model(cfg):
    from perfrun.models.build import build_model

    with torch.device("meta"):
        return build_model(cfg.model, 256, cfg.attention)


@pytest.mark.slow  # some twenty estimates, three of them FSDP2's
def test_the_command_ranks_every_memory_knob_and_names_the_cheapest_that_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every memory knob the CPU allows, estimated alone and listed by its peak; with a ladder's
    sweep summary, the speed it measured beside each, and the fastest that fits named."""
    words = [*SMALL, "dataloader.batch_size=2", "data.seq_len=8"]  # the optimizer state a good part of the peak
    peak = estimate(make_cfg(*words), 256, top=0).peak_bytes
    ladder = tmp_path / "sweep_summary.json"  # a ladder's summary as perfrun report writes it: the keys read
    ladder.write_text(json.dumps({"ablation": [{
        "top": "chunked_loss", "ladder": [{"rung": "chunked_loss", "tokens_per_s": 1000.0}],
        "tradeoffs": [{"setting": "checkpointing=full", "rung": "checkpointing_full", "tokens_per_s": 700.0},
                      {"setting": "optim=adamw8bit", "rung": "adamw8bit", "tokens_per_s": 900.0},
                      {"setting": "checkpointing=none", "rung": "chunked_loss", "tokens_per_s": 1000.0}]}]}))
    out = tmp_path / "estimate.json"
    code = estimate_command.main([*words, f"memory.size={int(peak * 0.85)}B", f"estimate.ladder={tmp_path}",
                                  f"estimate.out={out}"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    knobs = {k["overrides"]: k for k in json.loads(out.read_text())["knobs"]}
    assert {"loss=chunked", "optim=adamw8bit", "optim=adamw4bit", "optim.in_backward=true optim.grad_clip=0",
            "checkpointing=selective", "checkpointing=full", "dataloader.batch_size=1 accumulation.steps=2"} <= set(knobs)
    assert not any(k.startswith("offload") for k in knobs)  # a CPU estimate: nothing to offload to
    assert knobs["optim=adamw8bit"]["speed"] == 0.9 and knobs["checkpointing=full"]["speed"] == 0.7
    rows = [line for line in printed.split("each memory knob alone")[1].splitlines()[1:] if " peak " in line]
    ranked = [line[4:52].strip() for line in rows]
    assert [knobs[o]["peak_bytes"] for o in ranked] == sorted(knobs[o]["peak_bytes"] for o in ranked)
    assert len(ranked) >= 7
    fitting = {o for o, k in knobs.items() if k["fits"]}
    assert "optim=adamw8bit" in fitting  # 8-bit state: 6 bytes a parameter less
    named = [line[4:52].strip() for line in rows if line.endswith("<- cheapest that fits")]
    assert named == [max((o for o in fitting if knobs[o]["speed"] is not None), key=lambda o: knobs[o]["speed"])]


def test_the_ladder_measures_each_memory_knob_from_the_top_rung(tmp_path: Path) -> None:
    """adamw8bit and optim_in_backward are the top rung with the knob (kind tradeoff, memory
    tracked); offload_activations is skipped on a CPU with the reason, nothing trained."""
    from perfrun.ladder.rungs import run_rung

    top = make_cfg("+ablation=top", "+sweep=ablation")
    for rung, changed in (("adamw8bit", {"optim.name": "adamw8bit"}),
                          ("optim_in_backward", {"optim.in_backward": True, "optim.grad_clip": 0.0}),
                          ("offload_activations", {"offload.name": "activations"})):
        cfg = make_cfg(f"+ablation={rung}", "+sweep=ablation")
        assert cfg.ablation.kind == "tradeoff" and cfg.ablation.rung == rung and cfg.memory.breakdown
        for key, value in changed.items():
            assert select(cfg, key) == value != select(top, key)
        for key in ("compile", "precision.name", "loss.name", "attention", "dataloader.batch_size"):
            assert select(cfg, key) == select(top, key)
    overrides = ["+ablation=offload_activations", "repeat=0"]
    s = run_rung(make_cfg(*overrides), tmp_path / "offload", overrides=overrides)
    assert s["status"] == "skipped" and s["reason"].startswith("not applicable on cpu")
    assert not (tmp_path / "offload" / "metrics.jsonl").exists()


def test_the_memory_plot_labels_each_trade_off_with_the_category_it_freed() -> None:
    from perfrun.ladder.memory_plot import add_savings, bar_labels, memory_png

    def line(setting: str, tps: float, **cats: int) -> dict:
        bytes_ = {"Parameter": 100, "Buffer": 0, "Gradient": 100, "Optstate": 200, "Activation": 300, "Temp": 10}
        bytes_.update(cats)
        return {"setting": setting, "tokens_per_s": tps,
                "memory_breakdown": {"categories_bytes": bytes_, "peak_bytes": sum(bytes_.values())}}

    lines = [line("checkpointing=none", 1000.0), line("optim=adamw8bit", 900.0, Optstate=50),
             line("optim.in_backward=true optim.grad_clip=0", 990.0, Gradient=0)]
    add_savings(lines)
    assert lines[1]["memory_freed"]["category"] == "Optstate" and lines[2]["memory_freed"]["category"] == "Gradient"
    assert lines[1]["memory_verdict"] == "optim=adamw8bit freed 0.0 MiB of optimizer state for 10 % of speed"
    ablation = {"ladder": [], "tradeoffs": lines}
    labels = bar_labels(ablation)
    assert labels["optim=adamw8bit"].endswith("optimizer state") and labels[lines[2]["setting"]].endswith("gradients")
    assert "checkpointing=none" not in labels
    png = memory_png(ablation)
    assert png is not None and png.startswith(b"\x89PNG")


@pytest.mark.gpu
@pytest.mark.parametrize("offload", ["activations", "optimizer"])
def test_offload_trains_as_without_it(tmp_path: Path, offload: str) -> None:
    """Offloaded activations or optimizer give the losses of the run without offloading (the
    same arithmetic, the tensors parked on the host), and resume exactly."""
    common = ["device=cuda", "max_steps=6", "log_every=1", "model.n_embd=64"]
    run(make_cfg(*common), tmp_path / "none")
    summary = run(make_cfg(*common, f"offload={offload}"), tmp_path / offload)
    a, b = train_records(tmp_path / "none"), train_records(tmp_path / offload)
    assert [b[k]["loss"] for k in b] == pytest.approx([a[k]["loss"] for k in a], rel=1e-5)
    assert summary["knobs"]["offload"] == offload
    resumed_equals_uninterrupted(tmp_path / "resume", "device=cuda", "model.n_embd=64", f"offload={offload}")
