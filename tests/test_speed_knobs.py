"""The speed knobs wired into the trainer: ``loss=chunked`` trains as ``loss=standard``
does (alone, with accumulation, compiled whole; under FSDP2 with 2 gloo ranks in
test_fsdp.py's 2-rank run, under DDP in test_distributed.py's sweep), each knob is named in summary.json, and the CUDA input
path (batches read ahead, or drawn on the device) keeps the order and the resume position
of the plain stream (its exact resume: test_reliability.py's test_resume_is_bit_exact)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from perfrun.config import DataLoaderConfig
from perfrun.data import ResumableSampler, build_loader
from perfrun.data.synthetic import SyntheticTokens
from perfrun.knobs import Plan, compilation
from perfrun.loop.run import run
from perfrun.loop.step import BatchStream
from perfrun.models.gpt import GPT, GPTConfig
from perfrun.models.losses import build
from perfrun.validate import validate

from conftest import TINY_MODEL, losses, make_cfg

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


@pytest.mark.slow
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


def loader_of(n: int = 10, seq: int = 4, batch: int = 3) -> torch.utils.data.DataLoader:
    """A real resumable loader over n windows (3 batches an epoch, one window left over)."""
    tokens = torch.arange(n * (seq + 1)).view(n, seq + 1)
    data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
    return build_loader(data, DataLoaderConfig(batch_size=batch, num_workers=0, pin_memory=False),
                        device_type="cpu", shuffle=True, seed=5)


def test_reading_ahead_keeps_the_order_and_the_position_across_epochs() -> None:
    """The CUDA path (one batch read and copied ahead), run on the CPU: the plain stream's
    batches and, after each, its position; then a resume from a mid-epoch position."""
    plain, ahead = BatchStream(loader_of()), BatchStream(loader_of(), ahead=True)
    plain.start(0, 0)
    ahead.start(0, 0)
    positions, batches = [], []
    for _ in range(8):  # into the third epoch
        want, got = plain.next(), ahead.next()
        assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
        assert ahead.position() == plain.position()
        positions.append(plain.position())
        batches.append(want)
    assert positions[2] == {"epoch": 0, "consumed": 9} and positions[3] == {"epoch": 1, "consumed": 3}
    resumed = BatchStream(loader_of(), ahead=True)
    resumed.start(**positions[3])
    for want in batches[4:]:
        assert all(torch.equal(a, b) for a, b in zip(want, resumed.next(), strict=True))
    assert resumed.position() == positions[-1] and resumed.pop_gpu_wait_ms() is None  # no device timeline off CUDA


def test_device_synthetic_stream_resumes_on_the_next_batch() -> None:
    data = SyntheticTokens(vocab_size=50, seq_len=8, seed=3, stream=0, windows=64)
    make = lambda: torch.utils.data.DataLoader(data, batch_size=4, sampler=ResumableSampler(len(data), 3))  # noqa: E731
    whole = BatchStream(make(), ahead=True)
    whole.start(0, 0)
    batches = [whole.next() for _ in range(5)]
    assert whole.position() == {"epoch": 0, "consumed": 20} and whole.pop_gpu_wait_ms() is None
    resumed = BatchStream(make(), ahead=True)
    resumed.start(0, 8)
    for x, y in batches[2:]:
        rx, ry = resumed.next()
        assert torch.equal(rx, x) and torch.equal(ry, y) and int(x.max()) < 50


def test_the_cpu_loop_reports_no_gpu_starvation(standard_runs: dict[int, Path]) -> None:
    records = [json.loads(line) for line in (standard_runs[1] / "metrics.jsonl").read_text().splitlines()]
    assert all(r["gpu_starved_pct"] is None for r in records if r["kind"] == "train")
    summary = json.loads((standard_runs[1] / "summary.json").read_text())
    assert summary["gpu_starved_pct"] is None and summary["knobs"]["input"] == "loader"


@pytest.mark.gpu
@pytest.mark.parametrize("data", ["pysource", "synthetic"])
def test_cuda_input_times_the_gpus_wait(data: str, tmp_path: Path) -> None:
    """On CUDA: host data copied ahead (its waits timed), synthetic data drawn on the device.
    That both resume exactly is test_reliability.py's test_resume_is_bit_exact[cuda-*]."""
    args = [*COMMON, "device=cuda", f"data={data}", "max_steps=6", "dataloader.batch_size=4", "accumulation.steps=2"]
    straight = run(make_cfg(*args), tmp_path / "straight")
    expected = {"pysource": "copied ahead on a side stream", "synthetic": "drawn on the device"}[data]
    assert straight["status"] == "completed" and straight["knobs"]["input"] == expected
    starved = straight["gpu_starved_pct"]
    assert 0 <= starved <= 100  # device-drawn batches are timed too: the draw between two steps


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"])
def test_compile_modes_are_options_and_only_cuda_graph_modes_mark_steps(
        mode: str, caplog: pytest.LogCaptureFixture) -> None:
    cfg = make_cfg("compile=true", f"compile_options.mode={mode}")
    validate(cfg)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    graph_mode = mode in compilation.CUDA_GRAPH_MODES
    with ExitStack() as stack, caplog.at_level("WARNING", logger="perfrun"):
        plan = Plan(model=model, raw_model=model)
        compilation.apply(cfg, torch.device("cpu"), plan, stack)
        assert plan.notes["compile_options"]["mode"] == mode and plan.step_start_hooks == []  # the CPU has no graphs
        assert plan.notes["compile_options"]["cuda_graphs"] is False
        said = [r.getMessage() for r in caplog.records]
        assert said == ([f"compile_options.mode={mode} replays CUDA graphs, which the cpu does not have: here it "
                         f"compiles as mode={compilation.WITHOUT_GRAPHS[mode]} would"] if graph_mode else [])
        if graph_mode:
            plan = Plan(model=model, raw_model=model)
            compilation.apply(cfg, torch.device("cuda"), plan, stack)  # torch.compile is lazy: nothing runs on CUDA
            assert plan.step_start_hooks == [compilation.next_graph_generation] and plan.step_hooks == []
            assert plan.notes["compile_options"]["cuda_graphs"] is True


@pytest.mark.gpu
def test_fp8_run_names_the_layers_kept_in_bf16(tmp_path: Path) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9 or higher")
    s = run(make_cfg(*COMMON, "device=cuda", "precision=fp8", "dataloader.batch_size=4"), tmp_path)
    fp8 = s["knobs"]["fp8"]
    assert s["status"] == "completed" and fp8["converted"] == 8  # 4 Linear layers in each of 2 blocks
    assert list(fp8["kept_in_bf16"]) == ["lm_head"] and "tied" in fp8["kept_in_bf16"]["lm_head"]


def test_blocks_compiled_in_place_run_eagerly_for_trials_and_eval() -> None:
    """scope=blocks compiles the plain model's blocks, which the auto-batch trials and eval
    call too: inside ``compilation.eager()`` nothing reaches dynamo (no compile per trial)."""
    from torch._dynamo.utils import counters

    cfg = make_cfg("compile=true", "compile_options.scope=blocks")
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    x = torch.randint(0, 64, (2, 16))
    with ExitStack() as stack:
        plan = Plan(model=model, raw_model=model)
        compilation.apply(cfg, torch.device("cpu"), plan, stack)
        assert all("forward" in vars(block) for block in model.blocks)  # compiled in place
        frames = counters["frames"]["total"]
        with compilation.eager(), torch.no_grad():
            for batch in (1, 2, 4):
                model(x[:1].repeat(batch, 1), x[:1].repeat(batch, 1))
        assert counters["frames"]["total"] == frames
    assert not any("forward" in vars(block) for block in model.blocks)  # undone at the job's end


def test_a_new_cuda_graph_generation_starts_before_each_steps_first_micro_batch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With CUDA graphs the generation must turn before a step's micro-batches, never between
    them: the gradients the first micro-batch left must live until the optimizer reads them.
    The real loop runs with the hook compilation installs on CUDA, its marks recorded."""
    import perfrun.loop.setup as setup_module

    events: list[str] = []
    apply_knobs = setup_module.apply_knobs

    def next_generation(step: int) -> None:  # the hook compilation adds, its calls recorded
        compilation.next_graph_generation(step)
        events.append("generation")

    def with_graph_marks(cfg, device, model, stack):  # what compilation.apply adds on CUDA for these modes
        plan = apply_knobs(cfg, device, model, stack)
        plan.step_start_hooks.append(next_generation)
        model.register_forward_pre_hook(lambda *_: events.append("forward") if model.training else None)
        return plan

    monkeypatch.setattr(setup_module, "apply_knobs", with_graph_marks)
    run(make_cfg(*COMMON, "max_steps=3", "accumulation.steps=2"), tmp_path)
    assert events == ["generation", "forward", "forward"] * 3
