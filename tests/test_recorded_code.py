"""No value recorded in a file names code that runs.

A checkpoint records its configuration, and so do a run dir (``summary.json``, ``.hydra/``)
and a sweep dir; ``model.target`` and ``data.target`` in it name a class. Each place perfrun
reads such a record is handed a crafted one whose class would create a marker file if it
were imported or built: ``os.system`` with ``args.command='touch MARKER'``, and a
``evil.py:Cls`` whose import creates the marker. Each payload is first shown to be armed
(perfrun's own importer does create the marker). Then: ``export`` (every format),
``generate``, ``train resume=PATH``, ``train resume=auto`` (the run dir's ``.hydra/`` and
checkpoint) and ``report`` never import it; where the class is needed the command refuses
in one line naming the recorded class and the override that would name it. Hydra's
``--experimental-rerun`` (it unpickles a file) is refused by every command that takes it.
Commands run as a user types them, through perfrun's own entry, in this process.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_untrusted_files import Done, run_perfrun

from perfrun.config import ConfigError, as_dict
from perfrun.console import kept_logging
from perfrun.loop.run import run
from perfrun.user_code import instantiate

from conftest import TINY_MODEL, make_cfg

STEPS = 2
ARGS = [*TINY_MODEL, "dataloader.batch_size=4", "log_every=1", "eval_every=0", "eval_batches=1", "device=cpu",
        "progress=off", "monitor.every_n_steps=0", "optim.warmup_steps=1"]
EVIL_MODULE = "open({marker!r}, 'w').close()\n\n\nclass Cls:\n    def __init__(self, **kwargs):\n        pass\n"


@dataclass
class Payload:
    """A class name and its arguments that create ``marker`` when imported or built."""

    target: str
    args: dict[str, Any]
    marker: Path


def payload(kind: str, folder: Path) -> Payload:
    marker = folder / "payload-ran"
    if kind == "os.system":
        return Payload("os.system", {"command": f"touch {marker}"}, marker)
    evil = folder / "evil.py"
    evil.write_text(EVIL_MODULE.format(marker=str(marker)))
    return Payload(f"{evil}:Cls", {}, marker)


def armed(p: Payload) -> bool:
    """Whether perfrun's importer, handed the payload, runs it (the test would prove nothing else)."""
    try:
        instantiate(p.target, p.args, "the payload")
    except ConfigError:
        pass  # os.system returns an int: built, then refused as no Dataset; the command has run
    ran = p.marker.exists()
    p.marker.unlink(missing_ok=True)
    return ran


def perfrun(*args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> Done:
    """``perfrun ARGS`` in ``cwd``, through perfrun's own entry in this process, the root
    logger kept as it was (a Hydra job configures it)."""
    with kept_logging():
        return run_perfrun(*args, cwd=cwd, monkeypatch=monkeypatch, capfd=capfd)


def lines(p: Done) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.strip()]


def refused(p: Done, *phrases: str) -> None:
    """Exit 2, one line, no traceback, holding every phrase."""
    shown = lines(p)
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(shown) == 1 and shown[0].startswith("perfrun: error:"), p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    for phrase in phrases:
        assert phrase in shown[0], shown[0]


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> dict[str, Path]:
    """A real run on text, 2 steps: its checkpoint and the corpus it read."""
    root = tmp_path_factory.mktemp("good")
    corpus = root / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 200)
    run(make_cfg(*ARGS, "data=text", f"data.path={corpus}", f"max_steps={STEPS}", tiny=False), root / "run")
    return {"corpus": corpus, "run": root / "run", "pt": root / "run" / "checkpoints" / f"step_{STEPS:07d}.pt"}


def plant(good: dict[str, Path], dest: Path, group: str, p: Payload) -> Path:
    """The good checkpoint with ``group`` (model or data) recording the payload as its class."""
    ckpt = torch.load(good["pt"], weights_only=True)
    ckpt["config"][group].update(name="custom", target=p.target, args=p.args)
    if group == "model":
        ckpt["config"]["model"]["family"] = "custom"
    dest.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, dest)
    return dest


KINDS = ["os.system", "file.py:Cls"]


@pytest.mark.parametrize("kind", KINDS)
def test_int8_report_never_imports_the_recorded_data_target(kind: str, good: dict[str, Path], tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    """The exploit this guards against: the int8 report rebuilt the val split from the recorded
    data config."""
    p = payload(kind, tmp_path)
    assert armed(p)
    ckpt = plant(good, tmp_path / "ckpt" / "step_0000002.pt", "data", p)
    done = perfrun("export", f"checkpoint={ckpt}", "format=int8-report", cwd=tmp_path, monkeypatch=monkeypatch,
                   capfd=capfd)
    assert not p.marker.exists(), "the recorded data.target ran"
    refused(done, f"data.target={p.target}", "never imports", f"give it on this command line: data.target={p.target}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["generate", "onnx", "safetensors", "int8-report"])
def test_generate_and_export_never_import_the_recorded_model_target(
        command: str, kind: str, good: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    p = payload(kind, tmp_path)
    assert armed(p)
    ckpt = plant(good, tmp_path / "ckpt" / "step_0000002.pt", "model", p)
    args = (["generate", f"checkpoint={ckpt}", "prompt=def", "max_new_tokens=2"] if command == "generate"
            else ["export", f"checkpoint={ckpt}", f"format={command}", f"out={tmp_path / 'exported'}"])
    done = perfrun(*args, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    assert not p.marker.exists(), f"the recorded model.target ran under {command}"
    refused(done, f"checkpoint={ckpt} holds a custom model (model.target={p.target})", "never imports")
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("command", ["generate", "safetensors"])
def test_generate_and_export_need_no_data_class_and_import_none(
        command: str, good: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A recorded data.target is left unread where the data is not needed: the command works."""
    p = payload("os.system", tmp_path)
    ckpt = plant(good, tmp_path / "ckpt" / "step_0000002.pt", "data", p)
    args = (["generate", f"checkpoint={ckpt}", "prompt=def", "max_new_tokens=2"] if command == "generate"
            else ["export", f"checkpoint={ckpt}", "format=safetensors", f"out={tmp_path / 'hf'}"])
    done = perfrun(*args, cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    assert not p.marker.exists()
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("group", "kind", "how"), [("model", "file.py:Cls", "PATH"), ("data", "os.system", "PATH"),
                                                    ("model", "os.system", "auto"), ("data", "file.py:Cls", "auto")])
def test_resume_never_imports_the_recorded_target(group: str, kind: str, how: str, good: dict[str, Path],
                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """resume=PATH reads the checkpoint's record; resume=auto its run dir's checkpoint, whose
    ``.hydra/config.yaml`` records the payload too. The run builds only the classes typed."""
    p = payload(kind, tmp_path)
    assert armed(p)
    run_dir = tmp_path / "run"
    ckpt = plant(good, run_dir / "checkpoints" / good["pt"].name, group, p)
    recorded = as_dict(make_cfg(*ARGS, "data=text", f"data.path={good['corpus']}", tiny=False))
    recorded[group].update(name="custom", target=p.target, args=p.args)
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump(recorded))
    done = perfrun("train", *ARGS, "data=text", f"data.path={good['corpus']}", f"max_steps={STEPS + 2}",
                   f"hydra.run.dir={run_dir}", f"resume={ckpt if how == 'PATH' else 'auto'}", cwd=tmp_path,
                   monkeypatch=monkeypatch, capfd=capfd)
    assert not p.marker.exists(), f"the recorded {group}.target ran under resume={how}"
    refused(done, f"{group}.target={p.target} and this run has {group}.target=null", "never imports",
            f"give it on this command line: {group}=custom {group}.target={p.target}")


def test_report_never_imports_the_recorded_targets(good: dict[str, Path], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    """A sweep dir whose jobs' summary.json and .hydra/ name both payloads is reported, and nothing runs."""
    model, data = payload("file.py:Cls", tmp_path), payload("os.system", tmp_path)
    assert armed(model) and armed(data)
    summary = json.loads((good["run"] / "summary.json").read_text())
    for job in range(2):
        folder = tmp_path / "sweep" / str(job)
        (folder / ".hydra").mkdir(parents=True)
        for group, p in (("model", model), ("data", data)):
            summary["config"][group].update(name="custom", target=p.target, args=p.args)
        summary["overrides"] = [f"model.target={model.target}", f"optim.lr={job + 1}e-3"]
        (folder / "summary.json").write_text(json.dumps(summary))
        (folder / ".hydra" / "config.yaml").write_text(yaml.safe_dump(summary["config"]))
        (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(summary["overrides"]))
    done = perfrun("report", str(tmp_path / "sweep"), cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    assert not model.marker.exists() and not data.marker.exists()
    assert done.returncode == 0, done.stderr
    assert "optim.lr" in done.stdout


class Unpickled:
    """Unpickling this creates ``marker``: what a config.pickle could hold."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


@pytest.fixture
def pickled(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """An armed config.pickle (plain unpickling creates the marker) and its marker."""
    marker, path = tmp_path / "payload-ran", tmp_path / "config.pickle"
    path.write_bytes(pickle.dumps(Unpickled(marker)))
    pickle.loads(path.read_bytes())
    assert marker.exists(), "the pickle would run nothing: the test proves nothing"
    marker.unlink()
    yield path, marker


@pytest.mark.parametrize("args", [["train", "--experimental-rerun", "{pickle}"], ["train", "-m", "--exp={pickle}"],
                                  *([c, "--experimental-rerun", "{pickle}"] for c in
                                    ("generate", "export", "estimate", "prepare"))])
def test_hydra_rerun_from_a_pickle_is_refused(args: list[str], pickled: tuple[Path, Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capfd: pytest.CaptureFixture[str]) -> None:
    """Hydra's --experimental-rerun (any abbreviation argparse takes) unpickles its file: refused, nothing written."""
    path, marker = pickled
    before = set(tmp_path.rglob("*"))
    done = perfrun(*(a.format(pickle=path) for a in args), cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    assert not marker.exists(), "the pickle was read"
    refused(done, f"--experimental-rerun {path}", "never reads one", f"perfrun {args[0]} followed by")
    assert set(tmp_path.rglob("*")) == before


def test_tune_takes_no_rerun_flag(pickled: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capfd: pytest.CaptureFixture[str]) -> None:
    """perfrun tune parses its own flags: Hydra's rerun flag is not one of them."""
    path, marker = pickled
    done = perfrun("tune", "--experimental-rerun", str(path), cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    assert not marker.exists(), "the pickle was read"
    refused(done, "--experimental-rerun")


DATASET = '''
import torch


class Windows(torch.utils.data.Dataset):
    """Token windows of a fixed random sequence."""

    vocab_size = 64

    def __init__(self, n: int = 96, seq_len: int = 32) -> None:
        self.tokens = torch.randint(0, 64, (n + seq_len + 1,), generator=torch.Generator().manual_seed(0))
        self.n, self.seq_len = n, seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        w = self.tokens[i: i + self.seq_len + 1]
        return w[:-1], w[1:]
'''


@pytest.mark.slow
def test_int8_report_of_a_custom_dataset_takes_the_class_typed(tmp_path: Path, one_thread: None,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    """A GPT trained on the user's own Dataset: the int8 report rebuilds its val split with the
    class given on the command line, and without it says which override to give."""
    (tmp_path / "windows.py").write_text(DATASET)
    target = f"{tmp_path / 'windows.py'}:Windows"
    run(make_cfg(*ARGS, "data=custom", f"data.target={target}", f"max_steps={STEPS}", tiny=False), tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / f"step_{STEPS:07d}.pt"
    done = perfrun("export", f"checkpoint={ckpt}", "format=int8-report", cwd=tmp_path, monkeypatch=monkeypatch,
                   capfd=capfd)
    refused(done, f"data.target={target}", f"give it on this command line: data.target={target}")
    done = perfrun("export", f"checkpoint={ckpt}", "format=int8-report", f"data.target={target}", "int8.json=true",
                   "int8.gen_tokens=4", cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["val_tokens"] > 0 and report["float_val_loss"] > 0
    summary = run(make_cfg(*ARGS, "data=custom", f"data.target={target}", f"max_steps={STEPS + 1}", f"resume={ckpt}",
                           tiny=False), tmp_path / "run")  # the class typed again: the run continues
    assert summary["status"] == "completed" and summary["start_step"] == STEPS
