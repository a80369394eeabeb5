"""FLOPs per token counted for any model (perfrun/models/flops.py): they agree with GPT's and
Llama's formulas, do not depend on the device (the CPU flash-attention kernel is counted) nor on
whether the pass ran on fake tensors or (a small model of perfrun's own on the CPU) real copies,
leave the model and the random stream as they were, and a run records which figure MFU used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from perfrun.model_schema import ModelConfig
from perfrun.models.flops import counted_flops_per_token
from perfrun.models.gpt import GPT, GPTConfig
from perfrun.models.llama import Llama, LlamaConfig

from conftest import REPO, make_cfg


def _batch(vocab: int, t: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, t))


def test_gpt_counted_agrees_with_the_formula_at_the_issue_shape() -> None:
    """4 layers x 256 wide, block 256, GPT-2's vocabulary: 96.1M counted before the CPU's
    attention kernel was counted, against 99.4M by the formula."""
    model = GPT(GPTConfig(vocab_size=50304, block_size=256, n_layer=4, n_head=4, n_embd=256))
    x = _batch(50304, 256)
    counted, formula = counted_flops_per_token(model, x, x), model.flops_per_token(256)
    assert abs(counted - formula) / formula < 0.02, (counted, formula)
    attention = 12 * 4 * 256 * 256  # 12 * L * (H * Q) * T per token: what the CPU kernel used to miss
    assert counted > formula - attention / 2, "attention is not counted"
    assert all(p.grad is None for p in model.parameters())  # the model is not touched


def test_llama_counted_agrees_with_the_formula() -> None:
    m = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "conf/model/llama-tiny.yaml"))
    model = Llama(LlamaConfig.from_model(m, 256))
    x = _batch(256, 256)
    counted, formula = counted_flops_per_token(model, x, x), model.flops_per_token(256)
    assert abs(counted - formula) / formula < 0.02, (counted, formula)


def test_the_count_does_not_depend_on_the_device() -> None:
    """On the meta device SDPA decomposes into plain matmuls; on the CPU it is one flash
    kernel whose count perfrun registers: the same figure either way."""
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=64)
    cpu = GPT(config)
    with torch.device("meta"):
        meta = GPT(config)
    x = _batch(256, 64)
    assert counted_flops_per_token(cpu, x, x) == counted_flops_per_token(meta, x.to("meta"), x.to("meta"))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_a_small_own_model_is_counted_on_real_tensors_as_fake_ones_count_it(
        family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below REAL_PASS_FLOPS on the CPU the pass runs on real copies (dropout on: the random
    stream is given back); fake tensors count the same ops. A user's model is always faked
    (its forward may read a value), as is one of perfrun's above the bound."""
    from perfrun.models import flops

    if family == "gpt":
        model: torch.nn.Module = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32,
                                               dropout=0.1))
    else:
        m = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "conf/model/llama-tiny.yaml"))
        model = Llama(LlamaConfig.from_model(m, 256))
    x = _batch(256, 32)
    weights = {n: t.clone() for n, t in model.state_dict().items()}
    faked: list[int] = []
    fake_mode = flops.FakeTensorMode
    monkeypatch.setattr(flops, "FakeTensorMode", lambda *a, **k: faked.append(1) or fake_mode(*a, **k))
    assert flops._small_own_model_on_cpu(model, torch.device("cpu"), x)
    rng = torch.get_rng_state()
    real = flops._count(model, x, x)
    assert faked == [] and torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(t, weights[n]) for n, t in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    monkeypatch.setattr(flops, "REAL_PASS_FLOPS", 0)
    assert flops._count(model, x, x) == real and faked == [1]
    monkeypatch.setattr(flops, "REAL_PASS_FLOPS", float("inf"))
    assert not flops._small_own_model_on_cpu(_UserLM(GPTConfig()), torch.device("cpu"), x)


def test_one_configuration_of_perfruns_models_is_counted_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs of a sweep share their model: its second count is the first's, with no pass;
    another configuration, another input shape or a user's model is counted again."""
    from perfrun.models import flops

    config = GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=48)
    x = _batch(256, 32)
    first = counted_flops_per_token(GPT(config), x, x)
    passes: list[int] = []
    count = flops._count
    monkeypatch.setattr(flops, "_count", lambda *a: passes.append(1) or count(*a))
    assert counted_flops_per_token(GPT(config), x, x) == first and passes == []
    wider = counted_flops_per_token(GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=64)), x, x)
    longer = counted_flops_per_token(GPT(config), x[:, :16], x[:, :16])
    assert passes == [1, 1] and wider > first and longer != first
    lm = _UserLM(config)  # a config is not enough: a user's forward may read more than it shows
    counted_flops_per_token(lm, x, x)
    counted_flops_per_token(lm, x, x)
    assert passes == [1, 1, 1, 1]


class _UserLM(torch.nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.net, self.config = torch.nn.Sequential(torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256)), config

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.net(idx)
        return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def test_a_run_logs_both_figures_and_records_which_one_mfu_used(tmp_path: Path, one_thread: None,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    from perfrun.loop.run import run

    with caplog.at_level("INFO", logger="perfrun"):
        s = run(make_cfg("max_steps=3", "data=synthetic", "data.vocab_size=256"), tmp_path)
    assert s["flops_per_token_source"] == "formula" and s["flops_per_token"] == s["flops_per_token_formula"]
    # 32 wide: LayerNorm weights and biases, which the formula's 6N counts and no matmul does, are 2.4 %
    assert abs(s["flops_per_token_counted"] - s["flops_per_token"]) / s["flops_per_token"] < 0.05
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("FLOPs per token"))
    assert "formula" in line and "counted" in line
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["flops_per_token_counted"] == s["flops_per_token_counted"]


class _DataDependent(torch.nn.Module):
    """A forward that reads a value (``.item()``): FakeTensorMode cannot run it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[None, torch.Tensor]:
        scale = float(idx.max().item()) + 1.0
        return None, self.embed(idx).mean() / scale


def test_a_model_that_cannot_be_counted_says_so_and_gets_no_mfu() -> None:
    from perfrun.models.flops import flops_figure

    x = torch.randint(0, 16, (8,))
    figure = flops_figure(_DataDependent(), (x, x), 8)
    assert figure.counted is None and figure.per_token == 0.0 and figure.source == "none"
    assert figure.problem and "so no MFU" in figure.describe()
