"""The GPU benchmark's scripts on the CPU: every suite's commands printed by --dry-run (and
their overrides composed, so a typo in a suite shows without a GPU), the smoke suite's rows
(every CUDA path, the rows of what this checkout lacks skipped, the table written row by row
with the machine and versions above it), the torch API probe, the ladder comparison on two
planted sweep summaries, loss parity on planted metrics, and the starvation benchmark on a
tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from perfrun.commands.dispatch import main as cli_main
from perfrun.validate import validate

from conftest import REPO, make_cfg

SCRIPTS = REPO / "scripts"


def script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dry_run(*suites: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / "gpu_bench.sh"), "--dry-run", *suites], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def overrides(line: str) -> list[str]:
    """The Hydra overrides of a printed perfrun train or bench script call: KEY=VALUE words that
    are not an option's value, a sweep's first value, hydra.* keys left out (not composed)."""
    words, out, skip = shlex.split(line), [], False
    for w in words[1:]:
        if skip or w.startswith("-"):
            skip = w.startswith("--")
            continue
        if "=" in w and not w.startswith("hydra."):
            key, value = w.split("=", 1)
            out.append(f"{key}={value.split(',')[0] if ' -m ' in line else value}")
    return out


@pytest.fixture(scope="module")
def dry_run_all() -> subprocess.CompletedProcess:
    return dry_run("all")


@pytest.fixture(scope="module")
def validated(dry_run_all: subprocess.CompletedProcess) -> set[tuple[str, ...]]:
    """The overrides of every ``perfrun train`` call of every suite (``--dry-run all``), each
    distinct set composed once and passed through the checks perfrun makes before it builds
    anything: a misspelt key or group, or a refused value, fails here as on the GPU machine."""
    res = dry_run_all
    assert res.returncode == 0, res.stderr
    trains = {tuple(overrides(ln)) for ln in res.stdout.splitlines()
              if ln.startswith("python3 ") and " -m perfrun train " in ln}
    for words in trains:
        validate(make_cfg(*words, tiny=False))
    return trains


@pytest.mark.slow
def test_dry_run_prints_every_suite_runs_nothing_and_its_overrides_compose(
        dry_run_all: subprocess.CompletedProcess, validated: set[tuple[str, ...]]) -> None:
    res = dry_run_all
    assert res.returncode == 0, res.stderr
    suites = re.search(r'^ALL="(.*?)"$', (SCRIPTS / "gpu_bench.sh").read_text(), re.S | re.M)
    assert suites
    names = suites.group(1).replace("\\\n", " ").split()
    headers = re.findall(r"^== (\S+)$", res.stdout, re.M)
    assert headers == names and {"ladder-gpt2", "ladder-tiny", "starvation", "speed-loss", "speed-fp8"} <= set(names)
    calls = [ln for ln in res.stdout.splitlines() if ln.startswith("python3 ")]
    for name in names:  # every suite prints at least one command
        block = res.stdout.split(f"== {name}\n", 1)[1].split("\n== ", 1)[0]
        assert "python3 " in block, name
    assert not any("/tmp" in ln for ln in calls) and all("outputs/benchmarks" not in ln for ln in calls)
    trains = [ln for ln in calls if re.search(r"-m perfrun train |scripts/bench_\w+\.py ", ln)]
    assert len(trains) >= 20
    benches = {tuple(overrides(ln)) for ln in trains} - validated  # the bench scripts' own calls
    assert len(validated) >= 15 and benches
    for words in benches:  # a misspelt key or group fails here, as it would on the GPU machine
        make_cfg(*words, tiny=False)
    known = dict(script("bench_speed").variants("default"))
    chosen = [shlex.split(ln)[shlex.split(ln).index("--variants") + 1] for ln in calls if "--variants" in ln]
    assert len(chosen) == 2 and all(n in known for names in chosen for n in names.split(","))  # names as printed
    assert "compare_ladders.py $DIR/ladder_gpt2_1 $DIR/ladder_gpt2_2" in res.stdout
    assert "--profile-best $DIR/profiled_best" in res.stdout
    bad = dry_run("ladder-gtp2")
    assert bad.returncode == 2 and "unknown suite ladder-gtp2" in bad.stderr and bad.stdout == ""


SMOKE_PATHS = [  # (what the row must run, a regular expression its printed command matches)
    ("fp8 tensorwise", r"-m perfrun train .*model=gpt2 .*max_steps=20 .*precision=fp8 precision.recipe=tensorwise"),
    ("fp8 rowwise", r"-m perfrun train .*model=gpt2 .*max_steps=20 .*precision=fp8 precision.recipe=rowwise"),
    ("compile default", r"compile=true compile_options.mode=default accumulation.steps=1 "),
    ("max-autotune-no-cudagraphs", r"compile_options.mode=max-autotune-no-cudagraphs "),
    ("reduce-overhead, accumulation", r"compile_options.mode=reduce-overhead accumulation.steps=2 "),
    ("max-autotune, accumulation", r"compile_options.mode=max-autotune accumulation.steps=2 "),
    ("memmap device input", r"data=memmap .*dataloader.device_input=true device=cuda"),
    ("chunked loss compiled", r"loss=chunked compile=true"),
    ("offloaded activations", r"-m perfrun train .*device=cuda.* offload=activations "),
    ("offloaded optimizer", r"-m perfrun train .*device=cuda.* offload=optimizer "),
    ("8-bit AdamW stepped in the backward", r"optim=adamw8bit optim.in_backward=true optim.grad_clip=0 "),
    ("generate, CUDA graphs, batched", r"-m perfrun generate .*batch_size=4 compile=true .*device=cuda"),
    ("FSDP2 saved", r"torch.distributed.run .*distributed=fsdp fsdp.forward_prefetch=1 fsdp.backward_prefetch=1 "
                    r".*checkpoint.every_n_steps=6"),
    ("FSDP2 resumed", r"torch.distributed.run .*distributed=fsdp .*resume=\$DIR/smoke_fsdp/checkpoints/step_0000006"),
    ("profiler and snapshot", r"profile=true .*memory_snapshot=true"),
    ("gpu-check quick", r"-m perfrun gpu-check --quick"),
    ("pytest gpu", r"-m pytest -m gpu"),
    ("torch API probe", r"scripts/torch_api_probe.py"),
]


@pytest.mark.slow
def test_smoke_dry_run_runs_every_cuda_path_and_each_composes(
        validated: set[tuple[str, ...]], capsys: pytest.CaptureFixture[str]) -> None:
    res = dry_run("smoke")
    assert res.returncode == 0, res.stderr
    calls = [ln for ln in res.stdout.splitlines() if ln.startswith("python3 ")]
    for what, pattern in SMOKE_PATHS:
        assert any(re.search(pattern, ln) for ln in calls), what
    rows = re.findall(r"^# row: ([^:\n]+)", res.stdout, re.M)
    assert len(rows) == len(set(rows)) >= len(SMOKE_PATHS) + 4  # one row per path, named apart
    llama = REPO / "conf" / "model" / "llama-tiny.yaml"
    llama_runs = [ln for ln in calls if "model=llama-tiny" in ln]
    if llama.is_file():
        assert len(llama_runs) == 3 and any("precision=fp8" in ln for ln in llama_runs)
    else:  # decided by looking, and said
        assert not llama_runs
        assert res.stdout.count("skipped: not in this checkout (no conf/model/llama-tiny.yaml)") == 3
    has_estimate = cli_main(["estimate", "--help"]) == 0
    capsys.readouterr()
    assert any(" -m perfrun estimate " in ln for ln in calls) == has_estimate
    assert ("perfrun estimate --help fails: no such command" in res.stdout) != has_estimate
    trains = [ln for ln in calls if " -m perfrun train " in ln]
    assert trains and {tuple(overrides(ln)) for ln in trains} <= validated  # each composed and checked


@pytest.mark.slow
def test_smoke_writes_its_table_row_by_row_under_the_machine_and_versions(tmp_path: Path) -> None:
    """A spent budget: every row is written, as skipped with the reason, and nothing is run;
    the digest starts with the machine, the versions and the commit."""
    env = {**os.environ, "SMOKE_BUDGET_S": "0", "PYTHONPATH": str(REPO)}
    res = subprocess.run(["bash", str(SCRIPTS / "gpu_bench.sh"), "--out", str(tmp_path), "smoke"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    digest = (tmp_path / "digest_smoke.md").read_text()
    head, table = digest.split("| path | result | detail |\n|---|---|---|\n")
    assert "`scripts/gpu_bench.sh smoke`" in head and "- machine: " in head
    assert f"torch {torch.__version__}" in head and "Hydra " in head and "- perfrun: commit " in head
    rows = [r.split(" | ") for r in table.strip().splitlines()]
    assert len(rows) >= len(SMOKE_PATHS) + 4 and all(r[1] == "skipped" for r in rows)
    why = ("budget was spent", "not in this checkout", "the memmap run did not save one", "from the row above")
    assert all(any(w in r[2] for w in why) for r in rows) and sum("budget" in r[2] for r in rows) >= 12
    assert digest in (tmp_path / "digest.txt").read_text()
    assert not list(tmp_path.glob("smoke_*.log"))  # nothing ran


@pytest.mark.slow
def test_torch_api_probe_reads_perfrun_and_names_what_is_missing(tmp_path: Path) -> None:
    probe = script("torch_api_probe")
    used = probe.used_names()
    assert "torch.distributed.fsdp.fully_shard" in used and "torch.nn.attention.sdpa_kernel" in used
    assert "perfrun/knobs/fsdp.py" in used["torch.distributed.fsdp.fully_shard"]
    result = probe.probe()
    assert result["torch"] == torch.__version__ and result["checked"] > len(used) // 2
    assert result["missing"] == {}  # the torch the tests run on has everything perfrun calls
    pkg = tmp_path / "perfrun"
    pkg.mkdir()
    (pkg / "new.py").write_text("import torch\nfrom torch.nn import Linear, NoSuchLayer\n"
                                "def f():\n    return torch.cuda.no_such_api(), torch.nn.Linear\n")
    missing = probe.probe(pkg)["missing"]
    assert set(missing) >= {"torch.nn.NoSuchLayer", "torch.cuda.no_such_api"}
    assert "torch.nn.Linear" not in missing and missing["torch.cuda.no_such_api"]["used_in"] == ["perfrun/new.py"]
    assert "has no no_such_api" in missing["torch.cuda.no_such_api"]["why"]


def test_smoke_note_reads_the_summary_keys_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    note = script("smoke_note")
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "trace.json").write_text("{}")
    (tmp_path / "summary.json").write_text(json.dumps(
        {"status": "completed", "gpu_starved_pct": 0.123456, "knobs": {"fp8": {"kept_in_bf16": ["lm_head"]}}}))
    assert note.main([str(tmp_path), "knobs.fp8.kept_in_bf16", "gpu_starved_pct", "knobs.nope", "file:profile/trace.json*"]) == 0
    assert capsys.readouterr().out.strip() == ('status=completed; knobs.fp8.kept_in_bf16=["lm_head"]; '
                                               "gpu_starved_pct=0.1235; knobs.nope=absent; "
                                               "profile/trace.json*: 1 files, 2 bytes")
    assert note.main([str(tmp_path / "none")]) == 2 and "no readable summary.json" in capsys.readouterr().err


def rung(name: str, tps: float | None, part_kind: str = "ladder", applicable: bool = True) -> dict[str, Any]:
    return {"rung": name, "kind": part_kind, "applicable": applicable, "tokens_per_s": tps, "spread_pct": 1.0,
            "verdict": "not applicable on cuda: planted" if not applicable else "1.00×"}


def plant(folder: Path, ladder: list[dict[str, Any]], without: list[dict[str, Any]]) -> Path:
    folder.mkdir()
    one = {"ladder": ladder, "alternatives": [], "leave_one_out": without, "tradeoffs": [], "recommended": {}}
    (folder / "sweep_summary.json").write_text(json.dumps({"rows": [], "ablation": [one], **one}))
    return folder


def test_compare_ladders_reads_the_rungs_from_the_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    compare = script("compare_ladders")
    a = plant(tmp_path / "a", [rung("naive", 100.0), rung("tf32", None, applicable=False), rung("bf16", 400.0),
                               rung("fp8_rung", 800.0)], [rung("without_bf16", 150.0, "without")])
    b = plant(tmp_path / "b", [rung("naive", 102.0), rung("tf32", None, applicable=False), rung("bf16", 380.0),
                               rung("fp8_rung", 800.0), rung("device_input", 900.0)],
              [rung("without_bf16", 150.0, "without")])
    assert compare.main([str(a), str(b / "sweep_summary.json"), "--goal", "3", "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    rows = {r["rung"]: r for r in json.loads((tmp_path / "c.json").read_text())["rows"]}
    assert list(rows) == ["naive", "tf32", "bf16", "fp8_rung", "without_bf16", "device_input"]
    assert rows["naive"]["moved_pct"] == pytest.approx(2.0) and rows["naive"]["within_goal"] is True
    assert rows["bf16"]["moved_pct"] == pytest.approx(-5.0) and rows["bf16"]["within_goal"] is False
    assert rows["without_bf16"]["part"] == "leave_one_out" and rows["without_bf16"]["moved_pct"] == 0.0
    assert rows["tf32"]["moved_pct"] is None and "not applicable" in rows["tf32"]["why_not"]
    assert rows["device_input"]["why_not"] == "only in run B"
    assert "3 of 4 rungs moved less than ±3%" in out and "largest move -5.0% (bf16)" in out


def test_compare_ladders_refuses_what_is_not_a_ladder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    compare = script("compare_ladders")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "sweep_summary.json").write_text(json.dumps({"rows": [], "ablation": []}))
    assert compare.main([str(tmp_path / "plain"), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "has no ladder" in err and "+sweep=ablation" in err and len(err.strip().splitlines()) == 1
    assert compare.main([str(tmp_path / "missing"), str(tmp_path / "plain")]) == 2
    assert "cannot read" in capsys.readouterr().err


def metrics(folder: Path, losses: dict[int, float]) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": s, "loss": v}) + "\n"
                                                  for s, v in losses.items()))
    return folder


def test_loss_parity_compares_the_tail_of_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parity = script("loss_parity")
    base = metrics(tmp_path / "bf16", {s: 4.0 - s / 100 for s in range(10, 110, 10)})
    fp8 = metrics(tmp_path / "fp8", {s: 1.01 * (4.0 - s / 100) for s in range(10, 110, 10)})
    assert parity.main([str(base), str(fp8), "--window", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "steps 90-100" in out and "(+1.00%)" in out and "largest gap at one step 1.00%" in out
    assert parity.main([str(base), str(fp8), "--window", "0.2", "--tolerance", "0.005"]) == 1  # 1 % > 0.5 %
    assert "tolerance 0.50%: EXCEEDED" in capsys.readouterr().out
    assert parity.main([str(base), str(fp8), "--window", "0.2", "--tolerance", "0.02"]) == 0
    assert "tolerance 2.00%: within" in capsys.readouterr().out
    assert parity.main([str(base), str(tmp_path / "none")]) == 2
    assert "no train losses" in capsys.readouterr().err


@pytest.mark.slow
def test_starvation_benchmark_runs_its_four_cases_on_the_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The script's main in this process (its jobs run in-process anyway; the slow case's
    DataLoader workers are forked from it, as from the script's own process)."""
    mm = tmp_path / "mm"
    mm.mkdir()
    np.arange(4096, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(mm / "train.bin")
    np.arange(1024, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(mm / "val.bin")
    (mm / "meta.json").write_text(json.dumps({"vocab_size": 256, "dtype": "uint16", "tokenizer": "byte"}))
    monkeypatch.chdir(tmp_path)
    assert script("bench_starvation").main([
        "--memmap", str(mm), "--steps", "2", "--warmup", "0", "--sleep-ms", "20",
        "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "s.json"), "device=cpu",
        "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16", "dataloader.batch_size=2"]) == 0
    stdout = capsys.readouterr().out
    cases = json.loads((tmp_path / "s.json").read_text())["cases"]
    assert list(cases) == ["synthetic", "memmap", "slow, 0 workers", "slow, 2 workers"]
    assert all(c["status"] == "completed" and c["gpu_starved_pct"] is None for c in cases.values())  # CPU: n/a
    assert cases["slow, 0 workers"]["host_data_wait_pct"] > 0  # the sleep before each window is waited for
    assert all((Path(c["run_dir"]) / "summary.json").is_file() for c in cases.values())
    assert "starvation: synthetic n/a, memmap n/a" in stdout


def test_speed_benchmark_names_a_failing_variant_and_keeps_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """bench_speed on the CPU, two repeats of a tiny model: a variant that breaks is reported
    with its error while the plain loop and the rest are measured, with their spread; a
    variant the CPU cannot run is skipped with the reason; an unknown name is refused."""
    bench = script("bench_speed")
    real_row = bench.perfrun_row

    def row(overrides: list[str]) -> dict[str, Any]:
        if "loss=chunked" in overrides:
            raise RuntimeError("planted failure\nsecond line")
        return real_row(overrides)

    monkeypatch.setattr(bench, "perfrun_row", row)
    out = tmp_path / "speed.json"
    base = ["device=cpu", "model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16",
            "dataloader.batch_size=2"]
    assert bench.main(["--steps", "3", "--warmup", "1", "--repeats", "2",
                       "--variants", "perfrun,loss=chunked,precision=fp8", "--json", str(out), *base]) == 0
    result = json.loads(out.read_text())
    assert list(result["table"]) == ["plain (nanoGPT recipe)", "perfrun"]
    assert all(t["repeats"] == 2 and t["spread_pct"] >= 0 for t in result["table"].values())
    assert result["failed"] == {"loss=chunked": "RuntimeError: planted failure"}
    assert "FP8 tensor cores" in result["skipped"]["precision=fp8"]
    shown = capsys.readouterr().out
    assert "failed loss=chunked (repeat 0): RuntimeError: planted failure" in shown
    assert "skipped loss=chunked: failed: RuntimeError" in shown and re.search(r"^perfrun +[\d,]+ +±", shown, re.M)
    assert bench.main(["--variants", "perfrun,fp9", *base]) == 2 and "no variant 'fp9'" in capsys.readouterr().err
