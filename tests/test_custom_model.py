"""``model=custom`` and ``data=custom``: the example sequence classifier (not a decoder LM)
trains on its synthetic dataset through perfrun's sampler and loader, laddered over a few
rungs; bad input is one line, exit 2, and nothing is written into a finished run dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfrun.config import ConfigError
from perfrun.ladder.analysis import read_sweep

from conftest import REPO, make_cfg

EXAMPLE = REPO / "examples" / "seq_classifier.py"
CUSTOM = ["model=custom", f"model.target={EXAMPLE}:SeqClassifier", "data=custom", f"data.target={EXAMPLE}:Sequences",
          "+data.args.n=512", "model.block_size=64", "dataloader.batch_size=8"]
BAD = '''
import torch
from torch import nn


class Raises(nn.Module):
    def __init__(self, width: int = 8) -> None:
        raise ValueError("width must be even")


class WrongReturn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 8)

    def forward(self, idx, targets=None):
        return self.embed(idx).mean()
'''


def test_the_example_classifier_trains_with_counted_flops(tmp_path: Path, one_thread: None) -> None:
    from perfrun.loop.run import run

    s = run(make_cfg(*CUSTOM, "max_steps=30", "eval_every=10", "dataloader.num_workers=1"), tmp_path)
    assert s["status"] == "completed" and s["model_class"].endswith("SeqClassifier")
    assert s["flops_per_token_source"] == "counted" and s["flops_per_token"] == s["flops_per_token_counted"] > 0
    assert s["flops_per_token_formula"] is None
    fits = {f["key"]: f for f in s["knob_fits"]}
    assert not fits["attention"]["applies"] and "SeqClassifier does not have" in fits["attention"]["reason"]
    assert fits["precision"]["applies"]
    assert s["final_val_loss"] is not None and s["final_train_loss"] < 1.5  # ln 4 = 1.39 at chance
    assert json.loads((tmp_path / "summary.json").read_text())["knob_fits"] == s["knob_fits"]


@pytest.mark.slow
def test_the_example_laddered_skips_what_cannot_act(tmp_path: Path, one_thread: None) -> None:
    """A few rungs for test time (the top rungs compile, minutes on a CPU): the baseline runs,
    attention and the chunked loss are skipped with the piece they miss, checkpointing acts on
    the example's blocks with the chunked loss it inherits turned off; the report names the model."""
    from perfrun.ladder.rungs import run_rung
    from perfrun.report.render import header

    rungs = {"naive": [], "sdpa": [], "chunked_loss": [], "checkpointing_full": ["compile=false"]}
    for n, (rung, extra) in enumerate(rungs.items()):
        overrides = [f"+ablation={rung}", "repeat=0", "max_steps=8", *extra]
        run_rung(make_cfg(*CUSTOM, *overrides), tmp_path / str(n), overrides=overrides)
    s = [json.loads((tmp_path / str(n) / "summary.json").read_text()) for n in range(len(rungs))]
    assert [x["status"] for x in s] == ["completed", "skipped", "skipped", "completed"]
    assert "attention=sdpa needs `config.attention`" in s[1]["reason"]
    assert s[2]["reason"].startswith("not applicable to model custom: loss=chunked needs `lm_head`")
    assert "loss=standard" in s[3]["overrides"] and s[3]["knobs"]["checkpointed_blocks"] == 2
    loaded = read_sweep([tmp_path])
    (a,) = loaded.ladders
    chunked = next(e for e in a["ladder"] if e["rung"] == "chunked_loss")
    assert not chunked["applicable"] and chunked["verdict"].startswith("not applicable to model custom: loss=chunked")
    line = next(x for x in header(loaded) if x.startswith("model: "))
    assert "SeqClassifier" in line and "FLOPs per token (counted)" in line and "M parameters" in line


@pytest.mark.parametrize(("target", "expected"), [
    ("no_such_pkg.Model", "importing no_such_pkg failed"),
    ("{bad}:Raises", "raised ValueError: width must be even"),
    ("{bad}:WrongReturn", "returned Tensor; it must return (logits or None, loss)"),
])
def test_bad_models_are_one_line_and_leave_a_finished_run_as_it_was(tmp_path: Path, target: str, expected: str,
                                                                    one_thread: None) -> None:
    from perfrun.loop.run import run

    (tmp_path / "bad.py").write_text(BAD)
    done = tmp_path / "run"
    run(make_cfg(*CUSTOM, "max_steps=2"), done)
    finished = (done / "summary.json").read_text()
    bad = [o if not o.startswith("model.target=") else f"model.target={target.format(bad=tmp_path / 'bad.py')}"
           for o in CUSTOM]
    with pytest.raises(ConfigError) as e:
        run(make_cfg(*bad, "max_steps=2"), done)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert (done / "summary.json").read_text() == finished
