"""precision=fp8: refused in one line where it cannot run, the layer filter's choice on a
tiny GPT, torchao's conversion on the CPU (and an emulated training run), and real FP8
training on a GPU that has FP8 tensor cores."""

from __future__ import annotations

import copy
import importlib.util
import math
from contextlib import ExitStack
from typing import Any

import pytest
import torch
import torch.nn as nn

from perfrun.config import (
    ConfigError,
    DataConfig,
    DataLoaderConfig,
    ModelConfig,
    PrecisionConfig,
    TrainConfig,
)
from perfrun.knobs import Plan
from perfrun.knobs.fp8 import RECIPES, apply, check, choose_layers, convert, inner_rows, refusal
from perfrun.models.gpt import GPT, GPTConfig

# torchao is imported by the tests that use it (2 s on 2 cores): a test process that collects
# this file and runs none of them is spared it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")

BLOCK_LINEARS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


@pytest.fixture
def float8_linear() -> type[nn.Module]:
    """torchao's FP8 layer, the type a converted Linear becomes."""
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear


def fp8_cfg(recipe: str = "tensorwise", batch: Any = 4, seq_len: int | None = None) -> TrainConfig:
    """The pieces the fp8 knob reads, typed as a job's configuration is."""
    return TrainConfig(precision=PrecisionConfig(name="fp8", dtype="bfloat16", tf32=False, recipe=recipe),
                       dataloader=DataLoaderConfig(batch_size=batch), data=DataConfig(seq_len=seq_len),
                       model=ModelConfig(block_size=32))


def tiny_gpt(n_embd: int = 32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=n_embd))


def test_refused_on_this_cpu_in_one_line_before_touching_the_model(float8_linear: type[nn.Module]) -> None:
    model = tiny_gpt()
    with pytest.raises(ConfigError) as err:
        check(fp8_cfg(), torch.device("cpu"))
    message = str(err.value)
    assert "needs a CUDA GPU with FP8 tensor cores" in message and "precision=bf16" in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match="needs a CUDA GPU"), ExitStack() as stack:
        apply(fp8_cfg(), torch.device("cpu"), Plan(model=model, raw_model=model), stack)
    assert not any(isinstance(m, float8_linear) for m in model.modules())


@pytest.mark.parametrize("device_type, capability, torchao, says", [
    ("cuda", (8, 6), True, "NVIDIA A10 has compute capability 8.6"),
    ("cuda", (8, 0), True, "compute capability 8.0; use precision=bf16"),
    ("cuda", (9, 0), False, "torchao is not installed; install it with pip install torchao"),
    ("mps", None, True, "but the device is mps"),
])
def test_refusal_says_why_and_how_to_fix(device_type: str, capability: tuple[int, int] | None,
                                         torchao: bool, says: str) -> None:
    reason = refusal(device_type, capability, torchao, gpu="NVIDIA A10")
    assert reason is not None and says in reason and "\n" not in reason


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 0)])
def test_fp8_capable_gpus_are_not_refused(capability: tuple[int, int]) -> None:
    assert refusal("cuda", capability, True) is None


def test_unknown_recipe_is_refused() -> None:
    with pytest.raises(ConfigError, match="precision.recipe=blockwise is not an option; choose one of tensorwise, rowwise"):
        check(fp8_cfg("blockwise"), torch.device("cpu"))


def test_other_precisions_are_left_alone(float8_linear: type[nn.Module]) -> None:
    cfg = fp8_cfg()
    cfg.precision.name = "bf16"
    model = tiny_gpt()
    plan = Plan(model=model, raw_model=model)
    check(cfg, torch.device("cpu"))
    with ExitStack() as stack:
        apply(cfg, torch.device("cpu"), plan, stack)
    assert "fp8" not in plan.notes and not any(isinstance(m, float8_linear) for m in model.modules())


def test_filter_converts_the_block_linears_and_keeps_the_tied_head() -> None:
    layers = choose_layers(tiny_gpt(32))
    assert layers.convert == [f"blocks.{i}.{name}" for i in range(2) for name in BLOCK_LINEARS]
    assert list(layers.kept) == ["lm_head"] and "tied to wte.weight" in layers.kept["lm_head"]


def test_filter_keeps_an_untied_head_that_the_loss_reads_as_a_matrix() -> None:
    """A Llama with its own head: the loss takes lm_head.weight inside forward, so the layer's
    forward never runs; converted it would be named FP8 and run in bf16. It is kept, and said."""
    from perfrun.models.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_kv_head=1, n_embd=32,
                              intermediate_size=64, tie_embeddings=False))
    layers = choose_layers(model)
    assert "lm_head" not in layers.convert and "never calling the layer" in layers.kept["lm_head"]
    assert layers.convert and all(name.startswith("blocks.0.") for name in layers.convert)


def test_filter_keeps_shapes_fp8_cannot_take() -> None:
    layers = choose_layers(tiny_gpt(40))  # 40 features: not a multiple of 16
    assert layers.convert == []
    assert layers.kept["blocks.0.mlp.c_fc"] == "40 -> 160 features: FP8 matmuls need multiples of 16"
    assert "tied" in layers.kept["lm_head"]
    mixed = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 10))
    assert choose_layers(mixed).convert == ["0"] and list(choose_layers(mixed).kept) == ["2"]
    with pytest.raises(ConfigError, match="no Linear layer can run in FP8 .*multiples of 16"):
        convert(tiny_gpt(40), "tensorwise")


@pytest.mark.parametrize("recipe", RECIPES)
def test_conversion_on_the_cpu_swaps_the_chosen_layers(recipe: str, float8_linear: type[nn.Module]) -> None:
    model = tiny_gpt()
    names = list(model.state_dict())
    layers = convert(model, recipe, tokens=4 * 32)
    converted = sorted(n for n, m in model.named_modules() if isinstance(m, float8_linear))
    assert converted == sorted(layers.convert) and len(converted) == 8
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.wte.weight  # still tied
    assert list(model.state_dict()) == names  # checkpoints keep their keys
    assert not layers.pad_inner_dim
    assert convert(tiny_gpt(), recipe, tokens=3 * 30).pad_inner_dim  # 90 rows: padded to 96
    assert convert(tiny_gpt(), recipe, tokens=None).pad_inner_dim  # unknown
    # batch_size=auto: unknown when fp8 converts, but any batch x 1024 is a multiple of 16, any x 30 not
    assert inner_rows(3, 30) == 90 and inner_rows("auto", 1024) == 1024 and inner_rows("auto", 30) is None


def train(model: GPT, device: torch.device, steps: int, dtype: torch.dtype | None = None) -> list[float]:
    """Losses of a few AdamW steps on one fixed batch (the model must fit it)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (4, 33), generator=g).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_fp8_trains_like_fp32_on_the_cpu(recipe: str) -> None:
    """torchao's emulation runs the float8 casts and scales in fp32 arithmetic: the converted
    model trains, and its losses stay near the unconverted model's."""
    reference = tiny_gpt()
    model = copy.deepcopy(reference)
    convert(model, recipe, tokens=4 * 32, emulate=True)
    want = train(reference, torch.device("cpu"), 8)
    got = train(model, torch.device("cpu"), 8)
    assert got[-1] < got[0] - 0.3  # it learns the batch
    assert all(abs(a - b) <= 0.005 * b for a, b in zip(got, want, strict=True))
    assert got != want  # the float8 rounding is really in the loop


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_trains_on_cuda(recipe: str) -> None:
    device = torch.device("cuda")
    if torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("needs compute capability 8.9 or higher (FP8 tensor cores)")
    check(fp8_cfg(recipe), device)
    model = tiny_gpt(64).to(device)
    reference = copy.deepcopy(model)
    layers = convert(model, recipe, tokens=4 * 32)
    assert len(layers.convert) == 8
    model = torch.compile(model)
    try:
        got = train(model, device, 20, torch.bfloat16)
    finally:
        torch._dynamo.reset()
    want = train(reference, device, 20, torch.bfloat16)
    assert all(math.isfinite(v) for v in got)
    assert got[-1] < got[0] - 0.5
    assert abs(got[-1] - want[-1]) <= 0.1 * want[-1]
