"""The estimate before a run (perfrun/memory/): fake tensors count the same bytes as the
same steps on real tensors, category by category within 2 % (tiny, a GPT-2-wide model
at a small batch and short block, checkpointing, chunked loss); FSDP2 over a fake process
group divides the optimizer state by the ranks; the largest batch that fits and the knob
that makes a configuration fit; one line for a data-dependent operation and for a bad
memory size; the command prints an estimate, never a measurement."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from perfrun.commands import estimate as estimate_command
from perfrun.config import ConfigError
from perfrun.memory.batch_size import largest_batch
from perfrun.memory.estimate import EstimateError, estimate, optimizer_state
from perfrun.memory.fit import parse_size
from perfrun.memory.tracker import CATEGORIES

from conftest import TINY_MODEL, make_cfg

VOCAB = 256
SMALL = ["data=synthetic", f"data.vocab_size={VOCAB}"]
# GPT-2 124M's width, heads and vocabulary, two of its blocks, at a small batch and short block
GPT2_WIDE = ["model=gpt2", "model.n_layer=2", "data=synthetic", "data.vocab_size=50257", "data.seq_len=64",
             "dataloader.batch_size=2", "device=cpu"]


def _close(estimated: dict[str, float], measured: dict[str, float], merge_temp: bool) -> None:
    """Within 2 % per category (a category under 64 KiB within 64 KiB); under activation
    checkpointing the tracker counts recomputed activations as Temp: compare their sum."""
    e, m = dict(estimated), dict(measured)
    if merge_temp:
        for d in (e, m):
            d["Activation"] += d.pop("Temp")
    for c in e:
        assert abs(e[c] - m[c]) <= max(0.02 * m[c], 2**16), (c, e[c], m[c])


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    [],
    ["checkpointing=full"],
    ["loss=chunked", "loss.chunk_size=32", "accumulation.steps=2"],
    GPT2_WIDE,
], ids=["tiny", "checkpointing", "chunked-accumulation", "gpt2-wide"])
def test_the_estimate_equals_the_same_steps_on_real_tensors(overrides: list[str], one_thread: None) -> None:
    cfg = make_cfg(*overrides, tiny=False) if overrides is GPT2_WIDE else make_cfg(*SMALL, *overrides)
    vocab = int(cfg.data.vocab_size)
    fake = estimate(cfg, vocab)
    real = estimate(cfg, vocab, fake=False)
    assert not fake.measured and fake.to_dict()["kind"] == "estimate" and real.to_dict()["kind"] == "measurement"
    assert fake.peak_bytes > 0 and set(fake.breakdown.categories) == set(CATEGORIES)
    # AdamW: two moments per parameter, and a step count per tensor
    assert fake.breakdown.categories["Optstate"] == pytest.approx(2 * fake.breakdown.categories["Parameter"], rel=0.01)
    _close(fake.breakdown.categories, real.breakdown.categories, merge_temp=cfg.checkpointing.name != "none")
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.02 * real.peak_bytes
    assert [m.name for m in fake.breakdown.modules][:1] == [m.name for m in real.breakdown.modules][:1]


@pytest.mark.parametrize("fused", ["true", "false"])
def test_the_optimizer_state_is_what_a_training_steps_is(fused: str) -> None:
    """The estimate makes the state by a step on zero gradients instead of a whole training
    step: the same tensors (shapes, dtypes, devices) and step counts, and no gradient left."""
    from perfrun.models.build import build_model
    from perfrun.optim.adamw import build_optimizer

    cfg = make_cfg(*SMALL, f"optim.fused={fused}")
    device = torch.device("cpu")
    trained, zeroed = (build_model(cfg.model, VOCAB, cfg.attention) for _ in range(2))
    x = torch.randint(0, VOCAB, (2, int(cfg.model.block_size)))
    (opt_a, _), (opt_b, _) = (build_optimizer(m, cfg.optim, device) for m in (trained, zeroed))
    trained(x, x)[1].backward()
    opt_a.step()
    params = [p for p in zeroed.parameters() if p.requires_grad]
    optimizer_state(opt_b, params)

    def described(opt: torch.optim.Optimizer) -> list[dict[str, tuple[object, ...]]]:
        return [{k: (tuple(v.shape), v.dtype, v.device, float(v) if k == "step" else None) for k, v in st.items()}
                for st in opt.state_dict()["state"].values()]

    assert described(opt_b) == described(opt_a) and len(described(opt_a)) == len(params)
    assert all(p.grad is None for p in params)


SPARE = """
from torch import nn
from torch.nn import functional as F


class WithSpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)
        self.spare = nn.Linear(16, 4096)  # never called: no gradient, so no optimizer state

    def forward(self, idx, targets=None):
        logits = self.head(self.embed(idx))
        return logits, None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
"""


def test_a_parameter_without_a_gradient_gets_no_optimizer_state(tmp_path: Path) -> None:
    """A user's model that leaves a parameter out of its forward: AdamW makes no state for it
    in a run, and neither does the estimate (its state is made by a first training step)."""
    (tmp_path / "spare.py").write_text(SPARE)
    cfg = make_cfg("model=custom", f"model.target={tmp_path / 'spare.py'}:WithSpare", "data=synthetic",
                   "data.vocab_size=64", "model.block_size=16", tiny=False)
    used, spare = 4 * (64 * 16 + 16 * 64 + 64), 4 * (16 * 4096 + 4096)  # float32 bytes
    for fake in (True, False):
        got = estimate(cfg, 64, fake=fake).breakdown.categories
        assert got["Parameter"] == used + spare and got["Optstate"] == 2 * used + 3 * 4  # moments, a step count each


def test_checkpointing_and_chunked_loss_take_what_they_should() -> None:
    base = estimate(make_cfg(*SMALL), VOCAB).breakdown.categories
    full = estimate(make_cfg(*SMALL, "checkpointing=full"), VOCAB).breakdown.categories
    assert full["Activation"] < base["Activation"] / 2
    assert full["Parameter"] == base["Parameter"] and full["Optstate"] == base["Optstate"]


def test_fsdp_over_a_fake_process_group_shards_the_optimizer_state() -> None:
    one = estimate(make_cfg(*SMALL), VOCAB)
    four = estimate(make_cfg(*SMALL, "distributed=fsdp", "nproc=4"), VOCAB)
    assert four.world == 4 and "FSDP" in four.breakdown.method
    assert four.breakdown.categories["Optstate"] == pytest.approx(one.breakdown.categories["Optstate"] / 4, rel=0.05)
    assert not torch.distributed.is_initialized()  # the fake group is gone


@pytest.mark.slow
def test_the_largest_batch_fits_and_one_more_does_not() -> None:
    cfg = make_cfg(*SMALL)
    at = functools.cache(lambda b: estimate(cfg, VOCAB, batch_size=b, top=0).peak_bytes)  # each batch estimated once
    limit = at(1) + 5 * (at(2) - at(1)) + 1000  # room for about batch 6
    batch, runs = largest_batch(at, limit, cap=64)
    assert at(batch) <= limit and at(batch + 1) > limit
    assert runs <= 6


@pytest.mark.parametrize(("slope_after", "kink"), [(8, 8), (1, 4), (20, 3), (10, 10_000)])
def test_the_search_brackets_near_the_line_guess_and_never_estimates_far_past_the_answer(slope_after, kink) -> None:
    """A peak that is not a straight line (a fixed cost until a chunk fills, then steeper; or
    flatter): the guess through batches 1 and 2 is off, and the search gallops from it. Before,
    a guess that fitted with one more left the upper end at the cap, and the bisection estimated
    batches in the tens of thousands (minutes each)."""
    asked: list[int] = []

    def peak(b: int) -> int:
        asked.append(b)
        return asked_peak(b, kink, slope_after)

    limit, cap = 400, 112_000
    want = max(b for b in range(1, 10_000) if asked_peak(b, kink, slope_after) <= limit)
    batch, runs = largest_batch(peak, limit, cap=cap)
    assert batch == want and runs == len(set(asked))
    line_guess = 1 + (limit - asked_peak(1, kink, slope_after)) // (asked_peak(2, kink, slope_after) - asked_peak(1, kink, slope_after))
    assert max(asked) <= max(2 * want + 2, line_guess), asked  # above the answer only as far as the line said


def asked_peak(b: int, kink: int, slope_after: int) -> int:
    return 100 + 4 * min(b, kink) + slope_after * max(0, b - kink)


def test_a_data_dependent_operation_fails_in_one_line_naming_it_and_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    from perfrun.models import build, gpt

    real = build.build_model

    def with_item(*args, **kwargs):  # a model that reads a value back in its first block's MLP
        model = real(*args, **kwargs)
        mlp = model.blocks[0].mlp
        forward = mlp.forward
        mlp.forward = lambda x: forward(x) * float(x.abs().max().item() > 0)
        return model

    monkeypatch.setattr(build, "build_model", with_item)
    assert gpt  # the family module is what build wraps
    with pytest.raises(EstimateError) as e:
        estimate(make_cfg(*SMALL), VOCAB)
    text = str(e.value)
    assert "\n" not in text and "_local_scalar_dense" in text and "blocks.0.mlp" in text


def test_memory_sizes_are_parsed_or_refused() -> None:
    from perfrun.config import ConfigError

    assert parse_size("80GiB") == 80 * 2**30 and parse_size("40 GB") == 40 * 10**9 and parse_size("512MiB") == 2**29
    with pytest.raises(ConfigError, match="memory.size=80XB is not a memory size"):
        parse_size("80XB")


@pytest.mark.slow
def test_the_command_prints_an_estimate_and_the_knob_that_would_fit(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    words = [*SMALL, *TINY_MODEL, "model.n_layer=1", "dataloader.batch_size=8"]
    peak = estimate(make_cfg(*words), VOCAB, top=0).peak_bytes
    out = tmp_path / "estimate.json"
    code = estimate_command.main([*words, f"memory.size={int(peak * 0.7)}B", f"estimate.out={out}"])
    printed = capsys.readouterr().out
    assert code == 0
    assert printed.startswith("ESTIMATE, not a measurement") and "does NOT fit" in printed
    assert "makes it fit" in printed and "largest batch that fits" in printed
    doc = json.loads(out.read_text())
    assert doc["kind"] == "estimate" and doc["measured"] is False and doc["fits"] is False
    assert doc["peak_bytes"] == peak and 1 <= doc["largest_batch"]["batch_size"] < 8
    knobs = {k["overrides"]: k for k in doc["knobs"]}
    assert knobs["checkpointing=full"]["fits"] and knobs["checkpointing=full"]["peak_bytes"] < peak * 0.7


def test_a_memory_size_that_is_no_size_is_refused_before_any_work(capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def no_work(*_: object, **__: object) -> None:
        raise AssertionError("the data was read before memory.size was checked")

    monkeypatch.setattr(estimate_command, "vocab_of", no_work)
    assert estimate_command.main(["memory.size=lots"]) == 2
    err = capsys.readouterr().err
    assert "memory.size=lots is not a memory size" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_train_log_says_the_estimate_and_warns_before_step_1(caplog: pytest.LogCaptureFixture) -> None:
    """On a GPU a configuration that will not fit is warned (an out-of-memory error there is
    caught and explained); on the CPU it is refused (the kernel ends such a process with no
    word). The device is read only for its type, and memory.size stands for its memory, so
    the GPU's branch runs on any machine."""
    from perfrun.memory.preflight import train_preflight

    cpu = torch.device("cpu")
    assert train_preflight(make_cfg(*SMALL), VOCAB, cpu, 1) is None  # a small run on the CPU is not estimated
    peak = estimate(make_cfg(*SMALL), VOCAB, top=0).peak_bytes
    cfg = make_cfg(*SMALL, "memory.estimate=true", f"memory.size={int(peak * 0.8)}B")
    with caplog.at_level("INFO", logger="perfrun"):
        doc = train_preflight(cfg, VOCAB, torch.device("cuda"), 1)
    assert doc is not None and doc["kind"] == "estimate" and doc["measured"] is False and doc["fits"] is False
    said = [r for r in caplog.records if r.getMessage().startswith("memory ESTIMATE (not measured):")]
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "will not fit" in r.getMessage()]
    assert len(said) == 1 and len(warned) == 1 and "makes it fit" in warned[0].getMessage()
    with pytest.raises(ConfigError, match=r"will not fit: its memory ESTIMATE .* \(memory.size=.*memory.estimate=false"):
        train_preflight(cfg, VOCAB, cpu, 1)


def test_a_cpu_run_beyond_this_machine_s_memory_is_refused_before_anything_is_allocated() -> None:
    """Four blocks 65536 wide: 206 billion parameters, terabytes by any count, more than any
    machine running this has available. Estimated by default on the CPU (its parameters are
    counted on the meta device) under fake tensors: refused, nothing allocated."""
    from perfrun.memory.preflight import train_preflight

    huge = make_cfg(*SMALL, "model.n_layer=4", "model.n_embd=65536", "model.n_head=64", "dataloader.batch_size=1",
                    "device=cpu")
    with pytest.raises(ConfigError, match=r"will not fit: its memory ESTIMATE .* \(this machine's available memory\)"):
        train_preflight(huge, VOCAB, torch.device("cpu"), 1)
