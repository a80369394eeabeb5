"""``make_cfg`` (tests/conftest.py), the configuration most tests train, composes a set of
group options once and applies each ``key=value`` as Hydra applies it. Here it gives exactly
what Hydra's compose gives for the same command line, typed: values of every kind (numbers
coerced to their field's type, null, a dict, a list, an interpolation, a size), a value
before the group option it belongs to, an addition, and a value Hydra refuses."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from perfrun.config import TrainConfig, config_dir, register_configs, typed

from conftest import TINY, make_cfg

LINES = [
    (),
    ("max_steps=3", "optim.lr=1e-3", "optim.lr=2e-3"),
    ("optim.lr=1", "optim.grad_clip=0", "seed=${max_steps}"),
    ("precision=bf16", "precision.tf32=false", "compile=true"),
    ("model.n_layer=1", "model=llama", "model.n_kv_head=1"),
    ("dataloader.batch_size=auto", "memory.size=24GiB", "dataloader.max_batch_size=null"),
    ("model=custom", "model.target=examples/custom_model.py:Classifier", "+model.args.dim=128", "+model.args.w=[4, 8]"),
    ("optim.fused=true", "resume=null", "data=text", "data.path='/tmp/a b'"),
    ("distributed=ddp", "nproc=2", "+sweep=ablation", "ablation.repeats=2"),
]


def composed(*overrides: str) -> TrainConfig:
    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return typed(compose("train", overrides=[*TINY, *overrides]))


@pytest.mark.parametrize("line", LINES, ids=[" ".join(line) or "TINY" for line in LINES])
def test_make_cfg_is_what_compose_gives(line: tuple[str, ...]) -> None:
    assert make_cfg(*line) == composed(*line)


@pytest.mark.parametrize("line", [("max_steps=abc",), ("dataloader.bogus=1",), ("precision=bf17",),
                                  ("model=custom", "model.args={dim: 3}")])
def test_a_value_hydra_refuses_is_refused_here_too(line: tuple[str, ...]) -> None:
    with pytest.raises(Exception) as by_hydra:
        composed(*line)
    with pytest.raises(Exception) as here:
        make_cfg(*line)
    key = line[-1].split("=")[0]
    assert key in f"{by_hydra.value} {by_hydra.value.__cause__}" and key in f"{here.value} {here.value.__cause__}"
