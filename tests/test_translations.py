"""perfrun report --as: every row of the mapping names arguments the installed trainers take
(their signatures read from the packages), every translation builds the real objects, a real
run with bf16, compile, checkpointing, fused AdamW and two workers comes out as
TrainingArguments, a lightning.Trainer with its LightningModule's knobs, and a PyTorch loop
that trains, and nothing a record holds becomes code."""

from __future__ import annotations

import ast
import inspect
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from perfrun.commands import report as report_command
from perfrun.ladder.analysis import read_sweep
from perfrun.ladder.answer import Answer
from perfrun.ladder.recorded import check
from perfrun.ladder.translate import arguments, translate
from perfrun.ladder.translations import ROWS, TARGETS, Arg, Expr
from perfrun.report import render_text

from conftest import make_cfg

FIXTURE = Path(__file__).parent / "fixtures" / "translate_run"
NEEDS = {"hf": ("transformers", "accelerate"), "lightning": ("lightning",)}


def _need(trainer: str) -> None:
    """Skip, with the reason, where the trainer's packages are not installed (pip install -e .[translate])."""
    for package in NEEDS.get(trainer, ()):
        pytest.importorskip(package, reason=f"{package} is not installed: pip install -e '.[translate]'")


def _callable(target: str) -> Any:
    if target == "TrainingArguments":
        from transformers import TrainingArguments

        return TrainingArguments
    if target == "Trainer":
        import lightning

        return lightning.Trainer
    return {"AdamW": torch.optim.AdamW, "DataLoader": torch.utils.data.DataLoader, "torch.compile": torch.compile,
            "autocast": torch.autocast, "GradScaler": torch.amp.GradScaler}[target]


@pytest.fixture
def benchmark_flag() -> Iterator[None]:
    """lightning.Trainer(benchmark=...) sets cudnn.benchmark for the process: put it back."""
    before = torch.backends.cudnn.benchmark
    yield
    torch.backends.cudnn.benchmark = before


# --------------------------------------------------------------------------- the mapping against the packages


@pytest.mark.parametrize("trainer", [pytest.param("hf", marks=pytest.mark.slow),
                                     pytest.param("lightning", marks=pytest.mark.slow), "torch"])
def test_every_argument_a_row_names_is_one_the_installed_packages_take(trainer: str) -> None:
    _need(trainer)
    wrong = []
    for row in ROWS:
        for form in row.forms(trainer):
            if not isinstance(form, Arg):
                continue
            assert form.target in TARGETS[trainer], f"{row.key}: {form.target} is not a target of {trainer}"
            if form.target == "from_pretrained":  # **kwargs: test_a_real_run_... loads a model with it
                continue
            if form.name not in inspect.signature(_callable(form.target)).parameters:
                wrong.append(f"{row.key}: {form.target} has no argument {form.name}")
    assert not wrong, wrong


def _config(**changes: Any) -> dict[str, Any]:
    """A checked configuration: perfrun's defaults on the CPU, with ``changes`` (dotted keys)."""
    base = {"fused_adamw": True, "device_type": "cpu", "batch_size": 8}
    return check({**base, **changes})


VARIANTS = {  # between them, every row's forms are on in one and off in another
    "defaults": {},
    "the done case": {"precision.name": "bf16", "compile": True, "checkpointing.name": "full",
                      "checkpointing.every_k": 1, "dataloader.num_workers": 2, "dataloader.persistent_workers": True},
    "everything else": {"precision.name": "fp16", "compile": True, "compile_options.mode": "max-autotune-no-cudagraphs",
                        "compile_options.scope": "blocks", "compile_options.fullgraph": True,
                        "compile_options.dynamic": None, "checkpointing.name": "selective", "checkpointing.every_k": 2,
                        "dataloader.num_workers": 2, "dataloader.prefetch_factor": 4, "accumulation.steps": 4,
                        "cudnn_benchmark": True, "attention": "eager", "sdpa_backend": "math", "loss.name": "chunked",
                        "optim.grad_clip": 0.0, "fused_adamw": False},
    "fp8 and ddp": {"precision.name": "fp8", "distributed": "ddp", "nproc": 2, "dataloader.pin_memory": False},
    "cuda": {"precision.name": "bf16", "precision.tf32": True, "device_type": "cuda", "dataloader.device_input": True},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_translation_is_python_and_the_loop_sets_up(variant: str) -> None:
    """Each configuration's three translations parse; the loop's runs and sets up a model on the
    CPU (its blocks compiled one by one, the chunked loss defined, fp8 left to a GPU)."""
    a = Answer(_config(**VARIANTS[variant]), "a test", "perfrun train")
    for trainer in ("hf", "lightning"):
        ast.parse(translate(a, trainer, f"--as {trainer}"))
    space: dict[str, Any] = {}
    exec(compile(translate(a, "torch", "--as torch"), "loop.py", "exec"), space)
    if a.config["precision.name"] == "fp8" or a.config["device_type"] == "cuda":
        return  # torchao's float8 training and the CUDA device are for a GPU
    net = _tiny_transformer()
    model, optimizer, _, scaler, loader = space["setup"](net, [(torch.zeros(4, dtype=torch.long),) * 2] * 8)
    assert scaler.is_enabled() == (a.config["precision.name"] == "fp16")
    assert loader.num_workers == a.config["dataloader.num_workers"]
    if a.config["loss.name"] == "chunked":
        hidden, weight = torch.randn(2, 4, 16), torch.randn(32, 16)
        targets = torch.randint(0, 32, (2, 4))
        assert torch.allclose(space["lm_loss"](hidden, weight, targets),
                              F.cross_entropy((hidden @ weight.t()).flatten(0, 1), targets.flatten()), atol=1e-5)


def _read_back(obj: Any, name: str) -> Any:
    value = getattr(obj, name)
    return getattr(value, "value", value)  # TrainingArguments keeps optim and the scheduler as enums


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_translation_builds_training_arguments_and_a_lightning_trainer(
        variant: str, tmp_path: Path, benchmark_flag: None) -> None:
    _need("hf")
    _need("lightning")
    import lightning
    from transformers import TrainingArguments

    a = Answer(_config(**VARIANTS[variant]), "a test", "perfrun train")
    if a.config["device_type"] == "cuda" and not torch.cuda.is_available():
        pytest.skip("tf32 and the GPU accelerator are refused without a CUDA device")
    hf = arguments(a, "hf")
    args = TrainingArguments(output_dir=str(tmp_path), **hf["TrainingArguments"])
    for name, value in hf["TrainingArguments"].items():
        assert _read_back(args, name) == value, name
    lt = arguments(a, "lightning")
    trainer = lightning.Trainer(default_root_dir=str(tmp_path), logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, **lt["Trainer"])
    expected = {"accumulate_grad_batches": trainer.accumulate_grad_batches, "max_steps": trainer.max_steps,
                "gradient_clip_val": trainer.gradient_clip_val, "devices": trainer.num_devices}
    for name, value in lt["Trainer"].items():
        if name in expected:
            assert expected[name] == value, name
    if "16-mixed" != lt["Trainer"]["precision"]:  # fp16 AMP on a CPU: Lightning takes bf16 and says so
        assert trainer.precision == lt["Trainer"]["precision"]
    # the plain objects both loops build, from the same rows
    weight = nn.Parameter(torch.ones(2, 2))
    for trainer_name in ("lightning", "torch"):
        made = arguments(a, trainer_name)
        optimizer = torch.optim.AdamW([weight], **made["AdamW"])
        assert bool(optimizer.defaults["fused"]) == a.config["fused_adamw"]
        loader = torch.utils.data.DataLoader(list(range(16)), **made["DataLoader"])
        assert loader.num_workers == a.config["dataloader.num_workers"]
        if "torch.compile" in made:
            torch.compile(nn.Linear(2, 2), **made["torch.compile"])  # lazy: checks the options, compiles nothing
    torch_args = arguments(a, "torch")
    autocast = {k: getattr(torch, v.split(".")[1]) if isinstance(v, Expr) else v for k, v in torch_args["autocast"].items()}
    with torch.autocast("cpu", **autocast):
        pass
    assert torch.amp.GradScaler("cpu", **torch_args["GradScaler"]).is_enabled() == (a.config["precision.name"] == "fp16")


# --------------------------------------------------------------------------- a real run, translated and run


def _tiny_transformer(vocab: int = 32, dim: int = 16) -> nn.Module:
    """A model of perfrun's contract: forward(x, y) -> (logits, loss), its blocks in ``blocks``."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = nn.Linear(dim, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.mlp(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
            self.blocks = nn.ModuleList(Block() for _ in range(2))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            logits = self.head(h)
            return logits, F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return Net()


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(FIXTURE, run)
    return run


def _translated(run: Path, trainer: str, *extra: str, capsys: pytest.CaptureFixture[str]) -> str:
    assert report_command.main([str(run), "--as", trainer, *extra]) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_a_real_run_comes_out_as_training_arguments_with_its_knobs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _need("hf")
    from transformers import AutoModelForCausalLM, GPT2Config

    code = _translated(_run_dir(tmp_path), "hf", capsys=capsys)
    space: dict[str, Any] = {}
    exec(compile(code, "hf.py", "exec"), space)  # the printed script runs as printed
    args = space["args"]
    assert args.bf16 and args.torch_compile and args.gradient_checkpointing and args.use_cpu
    assert args.optim.value == "adamw_torch_fused" and args.dataloader_num_workers == 2
    assert args.dataloader_persistent_workers and args.per_device_train_batch_size == 4
    assert "Hugging Face compiles the whole model" in code and "the model's own gradient checkpointing" in code
    # the attention implementation goes to a real from_pretrained
    folder = tmp_path / "tiny-gpt2"
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=16,
                                                bos_token_id=0, eos_token_id=0)).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, **space["model_kwargs"])
    assert model.config._attn_implementation == "sdpa"  # no public getter of the implementation chosen


@pytest.mark.slow
def test_a_real_run_comes_out_as_a_lightning_trainer_and_module(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], benchmark_flag: None) -> None:
    _need("lightning")
    from torch.utils.checkpoint import checkpoint

    code = _translated(_run_dir(tmp_path), "lightning", capsys=capsys)
    space: dict[str, Any] = {}
    exec(compile(code, "lightning.py", "exec"), space)
    assert space["trainer"].precision == "bf16-mixed"
    assert space["loader_kwargs"]["num_workers"] == 2 and space["loader_kwargs"]["persistent_workers"]
    module = space["PerfrunKnobs"]()
    net = _tiny_transformer()
    module.model = net
    module.configure_model()
    assert all(block.forward.func is checkpoint for block in net.blocks)
    assert type(module.model).__name__ == "OptimizedModule"  # torch.compile's wrapper: torch has no public predicate
    optimizer = module.configure_optimizers()["optimizer"]
    assert optimizer.defaults["fused"] is True


@pytest.mark.slow
def test_a_real_run_comes_out_as_a_pytorch_loop_with_each_knob(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torch.utils.checkpoint import checkpoint

    code = _translated(_run_dir(tmp_path), "torch", capsys=capsys)
    space: dict[str, Any] = {}
    exec(compile(code, "loop.py", "exec"), space)
    assert space["autocast_kwargs"]["dtype"] is torch.bfloat16 and space["autocast_kwargs"]["enabled"]
    net = _tiny_transformer()
    data = [(torch.randint(0, 32, (8,)), torch.randint(0, 32, (8,))) for _ in range(16)]
    model, optimizer, _, scaler, loader = space["setup"](net, data)
    assert type(model).__name__ == "OptimizedModule"  # torch.compile's wrapper: torch has no public predicate
    assert all(block.forward.func is checkpoint for block in net.blocks)
    assert optimizer.defaults["fused"] is True and not scaler.is_enabled()
    assert loader.num_workers == 2 and loader.persistent_workers and loader.batch_size == 4


@pytest.mark.slow
def test_the_pytorch_loop_of_a_run_trained_here_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run trained in this test (bf16, checkpointing, fused AdamW, two workers; compile off,
    which takes minutes on a CPU), translated: its loop trains a model for real."""
    from perfrun.loop.run import run

    run_dir = tmp_path / "fresh"
    run(make_cfg("precision=bf16", "checkpointing=full", "optim.fused='true'", "dataloader.num_workers=2",
                 "dataloader.persistent_workers=true", "max_steps=4", "log_every=2"), run_dir)
    code = _translated(run_dir, "torch", capsys=capsys)
    assert "torch.compile" not in code.split("def setup")[1]  # compile=false: no compile in the setup
    space: dict[str, Any] = {}
    exec(compile(code, "loop.py", "exec"), space)
    net = _tiny_transformer()
    data = [(torch.randint(0, 32, (8,)), torch.randint(0, 32, (8,))) for _ in range(16)]
    parts = space["setup"](net, data)
    before = [p.detach().clone() for p in net.parameters()]
    space["train"](*parts, steps=2)
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters(), strict=True))


# --------------------------------------------------------------------------- ladders, pointers, bad records


def _plant(job: Path, rung: str, kind: str, step: int, tps: float, config: dict[str, Any], knob: str = "") -> None:
    job.mkdir(parents=True)
    summary = {"status": "completed", "overrides": [f"+ablation={rung}"], "tokens_per_s_median": tps,
               "peak_mem_mib": 100.0, "environment": {"device": "cpu", "device_name": "Test CPU", "torch": "2.13.0"},
               "contention": {"contended": False, "evidence": []},
               "config": {**config, "ablation": {"rung": rung, "kind": kind, "step": step, "knob": knob,
                                                 "acts_on": "any", "why": "planted"}}}
    (job / "summary.json").write_text(json.dumps(summary))
    (job / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 3.0 - s / 10}) + "\n"
                                               for s in (10, 20, 30)))


def plant_ladder(root: Path, bf16_rung: str = "bf16") -> None:
    """naive -> bf16 -> compile, two repeats each, compile twice as fast as bf16."""
    rungs = [("naive", "ladder", 0, [1000, 1010], {"precision": {"name": "none"}, "compile": False}),
             (bf16_rung, "ladder", 1, [1500, 1510], {"precision": {"name": "bf16"}, "compile": False}),
             ("compile", "ladder", 2, [3000, 3020], {"precision": {"name": "bf16"}, "compile": True}),
             ("without_compile", "without", 0, [1500, 1490], {"precision": {"name": "bf16"}, "compile": False})]
    n = 0
    for repeat in range(2):
        for rung, kind, step, tps, config in rungs:
            _plant(root / str(n), rung, kind, step, tps[repeat], {**config, "repeat": repeat},
                   "compile" if kind == "without" else "")
            n += 1


def test_a_ladder_translates_its_verdict_with_what_each_knob_bought(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    plant_ladder(tmp_path)
    code = _translated(tmp_path, "torch", capsys=capsys)
    assert "the verdict of the ladder" in code and "measured as its rung compile" in code
    prose = re.sub(r"\n *# ", " ", code)  # the comments as one text, wrapped lines joined
    assert "compile=true: rung compile: 2.00×" in prose  # its own figure, from the sweep
    assert "the top rung with compile=false (rung without_compile): 0.50×" in prose
    ast.parse(code)
    line = _translated(tmp_path, "perfrun", capsys=capsys).splitlines()[-1]
    assert line == "perfrun train precision.name=bf16 compile=true"  # the verdict's own line
    rung = _translated(tmp_path, "perfrun", "--rung", "bf16", capsys=capsys)
    assert "the rung bf16 of the ladder" in rung and rung.splitlines()[-1] == "perfrun train precision.name=bf16"


def test_the_report_and_its_html_point_to_the_translations(tmp_path: Path) -> None:
    plant_ladder(tmp_path / "sweep")
    r = read_sweep([tmp_path / "sweep"])
    text = render_text(r, width=200)
    verdict = text.splitlines().index(next(ln for ln in text.splitlines() if ln.startswith("verdict:")))
    assert text.splitlines()[verdict + 1] == (f"in your trainer's words: perfrun report {tmp_path / 'sweep'} "
                                              "--as hf|lightning|torch")
    assert report_command.main([str(tmp_path / "sweep"), "--html", str(tmp_path / "ladder.html")]) == 0
    page = (tmp_path / "ladder.html").read_text()
    assert page.count("<details>") == 3
    assert "args = TrainingArguments(" in page and "trainer = lightning.Trainer(" in page and "def setup(model" in page
    run = _run_dir(tmp_path / "one")  # a single run: its report says so too, --as perfrun included
    one = read_sweep([run])
    assert f"in your trainer's words: perfrun report {run} --as hf|lightning|torch|perfrun" in render_text(one, 200)
    assert report_command.main([str(run), "--html", str(tmp_path / "one.html")]) == 0
    assert (tmp_path / "one.html").read_text().count("<details>") == 3


@pytest.mark.parametrize("argv, says", [
    (["--as", "hf", "--rung", "nope"], "--rung nope is not a rung of"),
    (["--rung", "bf16"], "--rung bf16 picks the configuration --as translates"),
    (["--as", "hf", "--html", "x.html"], "--as prints code and writes no file"),
])
def test_a_bad_as_or_rung_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                      says: str) -> None:
    plant_ladder(tmp_path / "sweep")
    assert report_command.main([str(tmp_path / "sweep"), *argv]) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1 and says in out.err
    if "is not a rung" in says:
        assert "naive, bf16, compile, without_compile" in out.err
    assert not (tmp_path / "x.html").exists()


def test_a_recorded_value_that_is_code_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A summary.json whose compile mode would close the string and call open(): one line, no code."""
    run = _run_dir(tmp_path)
    marker = tmp_path / "MARKER"
    s = json.loads((run / "summary.json").read_text())
    s["config"]["compile_options"]["mode"] = f"default'); open({str(marker)!r}, 'w'); ('"
    (run / "summary.json").write_text(json.dumps(s))
    assert report_command.main([str(run), "--as", "torch"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "compile_options.mode=" in out.err and len(out.err.strip().splitlines()) == 1


def test_recorded_names_stay_comments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A rung whose name carries a line of code: in every translation it stays inside a comment
    (no call to open in the parsed code), and the loop's script runs without making the file."""
    marker = tmp_path / "MARKER"
    plant_ladder(tmp_path / "sweep", bf16_rung=f"bf16\nopen({str(marker)!r}, 'w')\n")
    for trainer in ("hf", "lightning", "torch"):
        code = _translated(tmp_path / "sweep", trainer, "--rung", "compile", capsys=capsys)
        assert "open(" in code  # the name is shown, as a comment
        calls = [n.func.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        assert "open" not in calls, trainer
        if trainer == "torch":
            exec(compile(code, "loop.py", "exec"), {})
    assert not marker.exists()
