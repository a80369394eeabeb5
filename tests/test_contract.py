"""The model contract (perfrun/models/contract.py): GPT and Llama meet every part of it; a
model without a piece gets the knobs that need it refused before any work, with one line that
names the piece; the ladder's own code skips a rung that cannot act on the model."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from perfrun.knobs import KnobRefused, apply_knobs
from perfrun.model_schema import ModelConfig
from perfrun.models import contract
from perfrun.models.gpt import GPT, GPTConfig
from perfrun.models.llama import Llama, LlamaConfig

from conftest import REPO, make_cfg

EXAMPLE = REPO / "examples" / "seq_classifier.py"
CUSTOM = ["model=custom", f"model.target={EXAMPLE}:SeqClassifier", "data=custom", f"data.target={EXAMPLE}:Sequences",
          "+data.args.n=256", "model.block_size=64"]


FLAT = """
import torch
from torch import nn


class Flat(nn.Module):
    \"\"\"The least a model can be: a forward that returns (logits, loss), nothing repeated, no head.\"\"\"

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.out = nn.Linear(16, 64)

    def forward(self, idx, targets=None):
        logits = self.out(self.embed(idx))
        return logits, None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
"""
_scope: dict[str, object] = {}
exec(FLAT, _scope)  # the same source the CLI test writes to a file
Flat: type[nn.Module] = _scope["Flat"]  # type: ignore[assignment]


def _llama() -> Llama:
    m = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(REPO / "conf/model/llama-tiny.yaml"))
    return Llama(LlamaConfig.from_model(m, 256))


@pytest.mark.parametrize("build", [lambda: GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=32)), _llama],
                         ids=["gpt", "llama"])
def test_gpt_and_llama_meet_the_whole_contract(build: object) -> None:
    model = build()  # type: ignore[operator]
    assert isinstance(model, contract.Model) and isinstance(model, contract.DecoderLM)
    for capability in ("blocks", "head", "decoder", "flops", "linear", "attention"):
        assert contract.has(model, capability), capability
    cfg = make_cfg("checkpointing=full", "loss=chunked", "compile=true", "compile_options.scope=blocks")
    fits = contract.knob_fits(model, cfg)
    assert all(f.applies for f in fits), [f for f in fits if not f.applies]


def test_a_model_without_blocks_or_head_is_refused_those_knobs_naming_the_piece() -> None:
    model = Flat()
    assert isinstance(model, contract.Model) and not contract.has(model, "blocks") and not contract.has(model, "head")
    for override, piece in (("checkpointing=full", "`blocks`"), ("loss=chunked", "`lm_head`")):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with ExitStack() as stack, pytest.raises(KnobRefused) as refused:
            apply_knobs(make_cfg(override), torch.device("cpu"), model, stack)
        message = str(refused.value)
        assert "\n" not in message and piece in message and "Flat does not have" in message
        assert refused.value.knob == override
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert "forward" not in model.__dict__ and "loss_fn" not in model.__dict__  # nothing applied


def test_what_applies_is_listed_and_what_does_not_says_why() -> None:
    fits = contract.knob_fits(Flat(), make_cfg("checkpointing=selective", "precision=bf16"))
    by_key = {f.key: f for f in fits}
    assert by_key["checkpointing"].refused and not by_key["checkpointing"].applies
    assert not by_key["attention"].applies and not by_key["attention"].refused  # it does not act: a note
    assert by_key["precision"].applies and by_key["precision"].knob == "precision=bf16"
    lines = contract.describe(fits)
    assert lines[0].startswith("knobs that apply to this model: ") and "precision=bf16" in lines[0]
    assert any(line.startswith("refused: checkpointing=selective needs `blocks`") for line in lines)


def test_the_ladder_skips_a_rung_the_model_cannot_take_and_turns_inherited_ones_off() -> None:
    from perfrun.ladder.rungs import decide

    chunked = decide(make_cfg(*CUSTOM, "+ablation=chunked_loss"))
    assert chunked.skip is not None and chunked.skip.startswith("not applicable to model custom: loss=chunked needs")
    dropped = decide(make_cfg(*CUSTOM, "+ablation=without_chunked_loss"))  # the top without it is the top here
    assert dropped.skip is not None and "loss=chunked needs `lm_head`" in dropped.skip
    sdpa = decide(make_cfg(*CUSTOM, "+ablation=without_sdpa"))
    assert sdpa.skip is not None and "config.attention" in sdpa.skip
    cfg = make_cfg(*CUSTOM, "+ablation=without_compile")  # the top rung holds loss=chunked from below
    kept = decide(cfg)
    assert kept.skip is None and kept.turned_off == ["loss=standard"] and kept.config.loss.name == "standard"
    assert cfg.loss.name == "chunked"  # the configuration given is left as it was
    gpt = decide(make_cfg("+ablation=chunked_loss"))
    assert gpt.skip is None and gpt.turned_off == []


def test_a_refused_knob_in_a_plain_run_is_one_line_and_exit_2(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """In this process, its file descriptors captured (tests/test_cli.py checks a real
    process's exit code and stderr for a refused setting)."""
    from perfrun.console import kept_logging

    from conftest import launch

    (tmp_path / "flat.py").write_text(FLAT)
    with kept_logging():
        code = launch("train", "model=custom", f"model.target={tmp_path / 'flat.py'}:Flat", "model.block_size=32",
                      "data=synthetic", "data.vocab_size=64", "checkpointing=full", "device=cpu", "max_steps=2",
                      f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    out, stderr = capfd.readouterr()
    assert code == 2, stderr
    err = [line for line in stderr.splitlines() if line.startswith("perfrun: error")]
    assert len(err) == 1 and "checkpointing=full needs `blocks`" in err[0] and "Traceback" not in out + stderr


@pytest.mark.slow
def test_a_ladders_calibration_runs_each_rung_as_its_job_will_on_this_model() -> None:
    """The time estimate calibrates a rung kind with what the model cannot take turned off, as
    the rung's job runs (the top rung's loss=chunked here: no lm_head), and passes over a rung
    whose job will be skipped; before, the refusal stopped the calibration, and the ladder of
    your own model ran every job at full length with no estimate."""
    from hydra import compose, initialize_config_dir

    from perfrun.config import config_dir, register_configs
    from perfrun.ladder.plan import _calibrate

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        top = compose("train", overrides=[*CUSTOM, "+ablation=without_compile", "+sweep=ablation", "device=cpu"])
        chunked = compose("train", overrides=[*CUSTOM, "+ablation=chunked_loss", "+sweep=ablation", "device=cpu"])
    timing = _calibrate(top)
    assert timing is not None and timing.step_s > 0 and timing.first_step_s > 0
    assert _calibrate(chunked) is None
