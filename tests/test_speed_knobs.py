"""The speed knobs wired into the trainer: ``loss=chunked`` trains as ``loss=standard``
does (alone, with accumulation, under DDP and FSDP2 with 2 gloo ranks, compiled whole),
and each knob is named in summary.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from perfrun.losses import build
from perfrun.model import GPT, GPTConfig
from perfrun.train import run

from conftest import TINY_MODEL, losses, make_cfg, run_cli

TOL = 1e-5  # relative; fp32 sums in another order
STEPS = 4
COMMON = [*TINY_MODEL, f"max_steps={STEPS}", "log_every=1", "eval_every=0", "eval_batches=2", "device=cpu",
          "progress=off", "monitor.every_n_steps=0", "optim.warmup_steps=2", "checkpoint.at_end=false"]
CHUNKED = ["loss=chunked", "loss.chunk_size=24"]  # 4 x 32 = 128 rows: 6 chunks, the last one short


def assert_close(a: dict[int, float], b: dict[int, float]) -> None:
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert all(abs(a[k] - b[k]) <= TOL * abs(a[k]) for k in a), (a, b)


@pytest.fixture(scope="module")
def standard_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """loss=standard, one process, batch 4 in 1 and in 2 micro-steps: the reference losses."""
    out = {}
    for micro in (1, 2):
        out[micro] = tmp_path_factory.mktemp(f"standard{micro}")
        run(make_cfg(*COMMON, f"accumulation.steps={micro}", "dataloader.batch_size=4"), out[micro])
    return out


@pytest.mark.parametrize("micro", [1, 2])
def test_chunked_trains_as_standard(standard_runs: dict[int, Path], micro: int, tmp_path: Path) -> None:
    s = run(make_cfg(*COMMON, *CHUNKED, f"accumulation.steps={micro}", "dataloader.batch_size=4"), tmp_path)
    assert s["knobs"]["loss"] == {"name": "chunked", "chunk_size": 24}
    assert_close(losses(standard_runs[micro]), losses(tmp_path))
    standard = json.loads((standard_runs[micro] / "summary.json").read_text())
    assert standard["knobs"]["loss"] == {"name": "standard"}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_chunked_under_two_ranks_trains_as_standard_in_one_process(
    standard_runs: dict[int, Path], mode: str, tmp_path: Path,
) -> None:
    """2 ranks x batch 2 x 2 micro-steps against one process x batch 4 x 2 micro-steps."""
    p = run_cli("train", *COMMON, *CHUNKED, f"distributed={mode}", "nproc=2", "dataloader.batch_size=2",
                "accumulation.steps=2", f"hydra.run.dir={tmp_path}", cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["world_size"] == 2 and s["knobs"]["distributed"] == mode and s["knobs"]["loss"]["name"] == "chunked"
    assert_close(losses(standard_runs[2]), losses(tmp_path))


def test_compiled_gpt_with_the_chunked_loss_has_no_graph_break() -> None:
    """The model's forward with its loss function, compiled with fullgraph=True (a graph
    break fails), gives the eager standard loss and gradients, tied head included."""
    torch.manual_seed(0)
    standard = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    chunked = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    chunked.load_state_dict(standard.state_dict())
    chunked.loss_fn = build(make_cfg("loss=chunked", "loss.chunk_size=20").loss)
    tokens = torch.randint(0, 64, (3, 17), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_and_grads(model: torch.nn.Module, call: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits, loss = call(x, y)
        assert logits is None  # with targets, forward hands back the loss only
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    want = loss_and_grads(standard, standard)
    torch._dynamo.reset()
    try:
        got = loss_and_grads(chunked, torch.compile(chunked, fullgraph=True, backend="aot_eager"))
    finally:
        torch._dynamo.reset()
    assert abs(got[0] - want[0]) <= TOL * abs(want[0])
    assert set(got[1]) == set(want[1]) and "wte.weight" in got[1]
    for name, grad in want[1].items():
        assert ((got[1][name] - grad).norm() / grad.norm()).item() <= TOL, name
