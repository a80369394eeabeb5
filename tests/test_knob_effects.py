"""What each knob changes, read off the model and one training micro-step, without a run:
the dtype the activations take, the tensors kept for the backward, the scaler, the compiled
module, the loss function, the micro-steps; and that closing the job's stack undoes it.

The whole trainer with these knobs runs end to end in test_train.py's matrix; here each
knob is held to its effect, cheaply (no data, no loaders, no run dir)."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch

from perfrun.knobs import apply_knobs
from perfrun.models.gpt import GPT, GPTConfig

from conftest import make_cfg

CPU = torch.device("cpu")


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))


def one_micro_step(plan, model: GPT) -> dict:
    """Forward and backward of one micro-batch through the plan; what the first block's MLP
    produced and how many tensors autograd kept for the backward."""
    seen: dict = {"saved": 0}

    def note_dtype(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen.setdefault("dtype", out.dtype)

    handle = model.blocks[0].mlp.c_fc.register_forward_hook(note_dtype)

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen["saved"] += 1
        return t

    x, y = torch.randint(64, (2, 16)), torch.randint(64, (2, 16))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), plan.forward_context():
            _, loss = plan.model(x, y)
        plan.backward(loss)
    finally:
        handle.remove()
    seen["grads"] = all(p.grad is not None for p in model.parameters())
    return seen


@pytest.mark.parametrize(("precision", "dtype", "scaled"), [
    ("none", torch.float32, False), ("bf16", torch.bfloat16, False), ("fp16", torch.float16, True),
])
def test_precision_sets_the_activations_dtype_and_only_fp16_scales(precision: str, dtype: torch.dtype,
                                                                   scaled: bool) -> None:
    model = tiny_gpt()
    with ExitStack() as stack:
        plan = apply_knobs(make_cfg(f"precision={precision}", "device=cpu"), CPU, model, stack)
        seen = one_micro_step(plan, model)
        assert seen["dtype"] == dtype and seen["grads"]
        assert plan.scaler.is_enabled() is scaled and plan.skips_nonfinite_steps is scaled
    assert not torch.is_autocast_enabled("cpu")  # autocast lives only inside the plan's forward context


def test_checkpointing_keeps_fewer_tensors_for_the_backward_and_undoes_itself() -> None:
    kept = {}
    for name in ("none", "selective", "full"):
        model = tiny_gpt()
        with ExitStack() as stack:
            plan = apply_knobs(make_cfg(f"checkpointing={name}", "device=cpu"), CPU, model, stack)
            kept[name] = one_micro_step(plan, model)["saved"]
            assert plan.notes["checkpointed_blocks"] == {"none": 0, "selective": 1, "full": 2}[name]
        assert all("forward" not in block.__dict__ for block in model.blocks)  # the instance patch is gone
    assert kept["full"] < kept["selective"] < kept["none"], kept


def test_compile_hands_the_loop_a_compiled_module_and_keeps_the_plain_one() -> None:
    from torch._dynamo.eval_frame import OptimizedModule

    model = tiny_gpt()
    with ExitStack() as stack:
        plan = apply_knobs(make_cfg("compile=true", "device=cpu"), CPU, model, stack)
        assert isinstance(plan.model, OptimizedModule) and plan.raw_model is model
    with ExitStack() as stack:
        plan = apply_knobs(make_cfg("device=cpu"), CPU, tiny_gpt(), stack)
        assert not isinstance(plan.model, OptimizedModule)


def test_chunked_loss_swaps_the_models_loss_function_and_gives_the_same_loss() -> None:
    standard, chunked = tiny_gpt(), tiny_gpt()
    x, y = torch.randint(64, (2, 16)), torch.randint(64, (2, 16))
    with ExitStack() as stack:
        plan = apply_knobs(make_cfg("loss=chunked", "loss.chunk_size=8", "device=cpu"), CPU, chunked, stack)
        assert chunked.loss_fn is not standard.loss_fn
        torch.testing.assert_close(plan.model(x, y)[1], standard(x, y)[1], rtol=0, atol=1e-5)


def test_accumulation_sets_the_micro_steps() -> None:
    with ExitStack() as stack:
        plan = apply_knobs(make_cfg("accumulation.steps=3", "device=cpu"), CPU, tiny_gpt(), stack)
        assert plan.micro_steps == 3 and plan.notes["accumulation_steps"] == 3
