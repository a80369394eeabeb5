"""The chunked linear cross-entropy against the standard path: same loss and gradients in
fp32, close under bf16 autocast, whole under torch.compile, and no batch x sequence x
vocabulary tensor kept or allocated."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf
from torch.profiler import ProfilerActivity, profile

from perfrun.models.gpt import GPT, GPTConfig
from perfrun.models.losses import (
    LOSSES,
    LossConfig,
    build,
    chunked_linear_cross_entropy,
    standard_linear_cross_entropy,
)

REPO = Path(__file__).resolve().parent.parent
B, T, C, V = 3, 20, 16, 96  # 60 rows


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a against b, as a norm."""
    return ((a - b).norm() / b.norm()).item()


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, C, generator=g, requires_grad=True)
    weight = torch.randn(V, C, generator=g, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, targets


def loss_and_grads(fn: Callable[..., torch.Tensor], *args: object, **kw: object) -> tuple[torch.Tensor, ...]:
    hidden, weight = args[0], args[1]
    loss = fn(*args, **kw)
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))


@pytest.mark.parametrize("chunk", [15, 7, 60, 1000])  # divides the 60 rows, does not, all of them, more
def test_chunked_equals_standard_in_fp32(chunk: int) -> None:
    hidden, weight, targets = inputs()
    targets[0, :4] = -1  # ignored positions count in neither the loss nor its mean
    want = loss_and_grads(standard_linear_cross_entropy, hidden, weight, targets)
    got = loss_and_grads(chunked_linear_cross_entropy, hidden, weight, targets, chunk)
    assert abs(got[0].item() - want[0].item()) <= 1e-5 * abs(want[0].item())
    assert rel(got[1], want[1]) <= 1e-5 and rel(got[2], want[2]) <= 1e-5
    assert got[1][0, :4].abs().max().item() == 0.0  # no gradient flows to an ignored row


def test_chunk_size_below_one_is_refused() -> None:
    hidden, weight, targets = inputs()
    with pytest.raises(ValueError, match="chunk_size=0"):
        chunked_linear_cross_entropy(hidden, weight, targets, 0)


def test_bf16_autocast_runs_the_matmul_in_bf16_and_stays_close_to_standard() -> None:
    hidden, weight, targets = inputs(1)
    fp32 = loss_and_grads(standard_linear_cross_entropy, hidden, weight, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        std = loss_and_grads(standard_linear_cross_entropy, hidden, weight, targets)
        chk = loss_and_grads(chunked_linear_cross_entropy, hidden, weight, targets, 16)
    assert chk[0].dtype == torch.float32 and chk[1].dtype == hidden.dtype and chk[2].dtype == weight.dtype
    # Same bf16 logits as the standard path (up to summation order), unlike fp32's.
    bf16_effect = abs(std[0].item() - fp32[0].item())
    assert bf16_effect > 0 and abs(chk[0].item() - std[0].item()) < bf16_effect / 10
    assert rel(chk[1], std[1]) < 2e-2 and rel(chk[2], std[2]) < 2e-2


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def headless(model: GPT) -> GPT:
    """The same model returning the final hidden states: its head is the loss's matmul."""
    model.lm_head = nn.Identity()  # the tied weight lives on as wte.weight
    return model


def accumulated_grads(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], model: nn.Module,
                      batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Gradients of one optimizer step over micro-batches (each loss scaled by 1/n)."""
    model.zero_grad(set_to_none=True)
    for x, y in batches:
        (step(x, y) / len(batches)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, 4, 17), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True])
def test_tiny_gpt_tied_weight_and_accumulation_match_standard(compiled: bool) -> None:
    """Every parameter's gradient, the tied embedding/head included, over two micro-batches;
    compiled with fullgraph=True, so a graph break anywhere in forward or loss fails."""
    standard = tiny_gpt()
    want = accumulated_grads(lambda x, y: standard(x, y)[1], standard, micro_batches())

    model = headless(copy.deepcopy(standard))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return chunked_linear_cross_entropy(model(x)[0], model.wte.weight, y, 24)

    torch._dynamo.reset()
    run = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
    try:
        got = accumulated_grads(run, model, micro_batches())
    finally:
        torch._dynamo.reset()
    assert set(got) == set(want) and "wte.weight" in got
    for name, grad in want.items():
        assert rel(got[name], grad) <= 1e-5, name


def largest(fn: Callable[[], torch.Tensor]) -> tuple[int, int]:
    """(bytes of the largest allocation by one op in forward + backward, elements of the
    largest tensor saved for backward)."""
    saved: list[int] = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel()), t)[1], lambda t: t):
            loss = fn()
        loss.backward()
    return max(e.self_cpu_memory_usage for e in prof.events()), max(saved)


def test_no_tensor_of_all_logits_is_saved_or_allocated() -> None:
    rows, width, vocab, chunk = 256, 8, 512, 32
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, width, generator=g, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    logits_bytes = rows * vocab * 4

    std_alloc, std_saved = largest(lambda: standard_linear_cross_entropy(hidden, weight, targets))
    assert std_alloc >= logits_bytes and std_saved >= rows * vocab  # the measure sees the full logits
    chk_alloc, chk_saved = largest(lambda: chunked_linear_cross_entropy(hidden, weight, targets, chunk))
    assert chk_alloc <= chunk * vocab * 4 < logits_bytes
    assert chk_saved <= max(rows * width, vocab * width) < rows * vocab


@pytest.mark.parametrize("name, fn", [("standard", standard_linear_cross_entropy),
                                      ("chunked", chunked_linear_cross_entropy)])
def test_yaml_of_the_loss_group_fits_its_dataclass(name: str, fn: Callable[..., torch.Tensor]) -> None:
    cfg = OmegaConf.merge(OmegaConf.structured(LossConfig), OmegaConf.load(REPO / "conf" / "loss" / f"{name}.yaml"))
    assert cfg.name == name and sorted(p.stem for p in (REPO / "conf" / "loss").glob("*.yaml")) == sorted(LOSSES)
    loss_fn = build(cfg)
    assert loss_fn.func is fn and loss_fn.keywords == {"chunk_size": cfg.chunk_size}
    hidden, weight, targets = inputs()
    assert torch.allclose(loss_fn(hidden, weight, targets), standard_linear_cross_entropy(hidden, weight, targets))


@pytest.mark.gpu
def test_chunked_on_cuda_compiled_in_bf16_matches_standard() -> None:
    """Inductor, fullgraph, bf16 autocast on the GPU: the path a training step takes."""
    device = torch.device("cuda")
    hidden, weight, targets = (t.detach().to(device).requires_grad_(t.requires_grad) for t in inputs(2))
    run = torch.compile(chunked_linear_cross_entropy, fullgraph=True)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            std = loss_and_grads(standard_linear_cross_entropy, hidden, weight, targets)
            chk = loss_and_grads(run, hidden, weight, targets, 16)
    finally:
        torch._dynamo.reset()
    assert abs(chk[0].item() - std[0].item()) <= 1e-3 * abs(std[0].item())
    assert rel(chk[1], std[1]) < 2e-2 and rel(chk[2], std[2]) < 2e-2
