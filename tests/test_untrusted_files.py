"""No file perfrun reads can run code.

A payload (a pickle whose ``__reduce__`` creates a marker file) is planted in each place
perfrun reads a checkpoint from: a single ``step_N.pt``, a sharded folder's ``meta.pt``,
its ``.metadata``, and an entry of its shard file ``__0_0.distcp`` (a "bytes" entry, which
DCP's own reader unpickles with plain ``torch.load``, and a tensor entry). Each is handed
to every command that reads it, through ``perfrun``'s own command line (in this process,
its output read from the file descriptors): ``generate``, ``export``, ``train
resume=PATH`` and ``train resume=auto`` with the checkpoint among the run's. The payload
never runs, the command fails, and its one line names the planted file. Every planted
file is first shown to be armed: plain unpickling does create the marker. A good sharded
checkpoint (``distributed=fsdp`` on the CPU) still resumes and generates.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from perfrun.checkpoint import safe_loading as safe_checkpoint
from perfrun.commands.dispatch import main as cli_main
from perfrun.commands.generate import load_model
from perfrun.config import ConfigError
from perfrun.loop.run import run

from conftest import TINY_MODEL, make_cfg

STEPS = 2
ARGS = [*TINY_MODEL, "data=text", "dataloader.batch_size=4", "log_every=1", "eval_every=0", "eval_batches=1",
        "device=cpu", "progress=off", "monitor.every_n_steps=0", "optim.warmup_steps=1"]
SHARD = "__0_0.distcp"
ENTRY = "model.wte.weight"  # read by every command: generate and export load only the model


class Payload:
    """Anything unpickling this creates ``marker``, the proof that code ran: with ``open``
    (a global torch's weights-only loader does not admit) or ``os.makedirs`` (one from a
    module it blocks outright)."""

    def __init__(self, marker: Path, how: str = "open") -> None:
        self.marker, self.how = str(marker), how

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w")) if self.how == "open" else (os.makedirs, (self.marker,))


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory, one_thread: None) -> dict[str, Path]:
    """A real single-file checkpoint and a real sharded one (FSDP on the CPU), both at step 2."""
    root = tmp_path_factory.mktemp("good")
    corpus = root / "corpus.txt"
    corpus.write_text("def add(a, b):\n    return a + b\n\n" * 200)
    data = f"data.path={corpus}"
    run(make_cfg(*ARGS, data, f"max_steps={STEPS}", tiny=False), root / "single")
    run(make_cfg(*ARGS, data, f"max_steps={STEPS}", "distributed=fsdp", tiny=False), root / "sharded")
    return {"data": Path(data.split("=", 1)[1]), "pt": root / "single" / "checkpoints" / f"step_{STEPS:07d}.pt",
            "folder": root / "sharded" / "checkpoints" / f"step_{STEPS:07d}"}


def plant_pt(good: dict[str, Path], ckpts: Path, payload: Payload) -> Path:
    ckpt = torch.load(good["pt"], weights_only=True)
    ckpt["note"] = payload
    torch.save(ckpt, ckpts / good["pt"].name)
    return ckpts / good["pt"].name


def _copy_folder(good: dict[str, Path], ckpts: Path) -> Path:
    return Path(shutil.copytree(good["folder"], ckpts / good["folder"].name))


def plant_meta(good: dict[str, Path], ckpts: Path, payload: Payload) -> Path:
    folder = _copy_folder(good, ckpts)
    meta = torch.load(folder / "meta.pt", weights_only=True)
    meta["note"] = payload
    torch.save(meta, folder / "meta.pt")
    return folder / "meta.pt"


def plant_metadata(good: dict[str, Path], ckpts: Path, payload: Payload) -> Path:
    folder = _copy_folder(good, ckpts)
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own file: plain pickle is safe here
    metadata.planner_data["note"] = payload
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return folder / ".metadata"


def _replace_entry(folder: Path, blob: bytes, as_bytes: bool) -> None:
    """Append ``blob`` to the shard and point ENTRY's metadata at it (as a "bytes" entry,
    or still as the tensor it was)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    shard = folder / SHARD
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == ENTRY)
    del metadata.storage_data[index]
    if as_bytes:
        metadata.state_dict_metadata[ENTRY] = BytesStorageMetadata()
        index = MetadataIndex(ENTRY)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def _saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def plant_bytes_entry(good: dict[str, Path], ckpts: Path, payload: Payload) -> Path:
    folder = _copy_folder(good, ckpts)
    _replace_entry(folder, _saved(payload), as_bytes=True)
    return folder / SHARD


def plant_tensor_entry(good: dict[str, Path], ckpts: Path, payload: Payload) -> Path:
    folder = _copy_folder(good, ckpts)
    _replace_entry(folder, _saved(payload), as_bytes=False)
    return folder / SHARD


PLACES: dict[str, Callable[[dict[str, Path], Path, Payload], Path]] = {
    "single .pt": plant_pt, "meta.pt": plant_meta, ".metadata": plant_metadata, "shard bytes entry": plant_bytes_entry,
    "shard tensor entry": plant_tensor_entry,
}


def armed(place: str, planted: Path, marker: Path) -> bool:
    """Whether plain unpickling of the planted file (what a careless reader does) runs the payload."""
    if place == ".metadata":
        pickle.loads(planted.read_bytes())
    elif place.startswith("shard"):
        metadata = pickle.loads((planted.parent / ".metadata").read_bytes())
        info = next(s for i, s in metadata.storage_data.items() if i.fqn == ENTRY)
        torch.load(io.BytesIO(planted.read_bytes()[info.offset:info.offset + info.length]), weights_only=False)
    else:
        torch.load(planted, weights_only=False)
    ran = marker.exists()
    if marker.is_dir():
        marker.rmdir()
    marker.unlink(missing_ok=True)
    return ran


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


# what a plain ``python`` prints of a warning raised outside ``__main__``: every category but these
SILENT = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def run_perfrun(*args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> Done:
    """``perfrun ARGS`` run in ``cwd`` in this process (one interpreter start fewer per
    command): its exit code and what it wrote, the warnings a terminal would show included."""
    monkeypatch.chdir(cwd)
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            code = cli_main(list(args))
        except SystemExit as e:  # a Hydra app exits through SystemExit
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    out, err = capfd.readouterr()
    shown = [f"{w.category.__name__}: {w.message}" for w in caught if not issubclass(w.category, SILENT)]
    return Done(code, out, err + "".join(line + "\n" for line in shown))


def command(name: str, ckpt: Path, run_dir: Path, data: Path) -> list[str]:
    """The command line that reads checkpoint ``ckpt`` (a file, or a folder in ``run_dir/checkpoints``)."""
    train = ["train", *ARGS, f"data.path={data}", f"max_steps={STEPS + 2}", f"hydra.run.dir={run_dir}"]
    return {
        "generate": ["generate", f"checkpoint={ckpt}", "prompt=def", "max_new_tokens=4"],
        "export": ["export", f"checkpoint={ckpt}", "format=safetensors", f"out={run_dir / 'exported'}"],
        "train resume=PATH": [*train, f"resume={ckpt}"],
        "train resume=auto": [*train, "resume=auto"],
    }[name]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", ["generate", "export", "train resume=PATH", "train resume=auto"])
@pytest.mark.parametrize("place", [p for p in PLACES if p != "shard tensor entry"])
def test_a_planted_payload_never_runs(place: str, cmd: str, good: dict[str, Path], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "payload-ran"
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    ckpts.mkdir(parents=True)
    planted = PLACES[place](good, ckpts, Payload(marker))
    assert armed(place, planted, marker), "the planted file would not run anything: the test proves nothing"
    ckpt = planted if place == "single .pt" else planted.parent
    p = run_perfrun(*command(cmd, ckpt, run_dir, good["data"]), cwd=tmp_path, monkeypatch=monkeypatch, capfd=capfd)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert not marker.exists(), f"the payload ran under {cmd}"
    assert p.returncode == 2, p.stdout + p.stderr
    assert len(lines) == 1 and lines[0].startswith("perfrun: error:"), p.stderr
    assert f"{planted} was not loaded" in lines[0] and "io.open" in lines[0], lines[0]
    assert "Traceback" not in p.stdout + p.stderr
    if place.startswith("shard"):
        assert ENTRY in lines[0], lines[0]


def test_a_tensor_entry_that_is_not_a_tensor_is_refused_naming_the_shard(
        good: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """DCP loads tensor entries weights-only already; the refusal must still name the file."""
    marker = tmp_path / "payload-ran"
    planted = plant_tensor_entry(good, tmp_path, Payload(marker))
    assert armed("shard tensor entry", planted, marker)
    p = run_perfrun("generate", f"checkpoint={planted.parent}", "prompt=def", "max_new_tokens=4", cwd=tmp_path,
                monkeypatch=monkeypatch, capfd=capfd)
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert not marker.exists()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert f"{planted} was not loaded: it names io.open" in lines[0], lines[0]


def test_a_good_sharded_checkpoint_still_resumes_and_generates(
        good: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(good["folder"], run_dir / "checkpoints" / good["folder"].name)
    p = run_perfrun(*command("train resume=auto", None, run_dir, good["data"]), "distributed=fsdp", cwd=tmp_path,
                monkeypatch=monkeypatch, capfd=capfd)
    assert p.returncode == 0, p.stderr
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["status"] == "completed" and s["start_step"] == STEPS and s["steps"] == STEPS + 2
    p = run_perfrun("generate", f"checkpoint={good['folder']}", "prompt=def", "max_new_tokens=4", "seed=1", cwd=tmp_path,
                monkeypatch=monkeypatch, capfd=capfd)
    assert p.returncode == 0, p.stderr
    assert "def" in p.stdout


def test_metadata_admits_only_dcp_classes_and_rebuilds_them(good: dict[str, Path], tmp_path: Path) -> None:
    """The restricted reading of a real ``.metadata`` equals plain pickle's; a shard name
    that leaves the folder, and a shard that is a link, are refused naming ``.metadata``;
    a ``.metadata`` cut short is reported as damaged."""
    real = good["folder"] / ".metadata"
    ours, theirs = safe_checkpoint.read_metadata(real), pickle.loads(real.read_bytes())
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.planner_data == theirs.planner_data
    assert ours.storage_data == theirs.storage_data and ours.version == theirs.version
    for name in ("../outside.distcp", "/etc/passwd", ".metadata"):
        folder = tmp_path / f"escape{len(name)}"
        shutil.copytree(good["folder"], folder)
        metadata = pickle.loads(real.read_bytes())
        metadata.storage_data = {i: dataclasses.replace(s, relative_path=name) for i, s in metadata.storage_data.items()}
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(safe_checkpoint.UntrustedFileError, match=f"{re.escape(str(folder / '.metadata'))} was not loaded: it names the shard file"):
            safe_checkpoint.verify_sharded(folder)
    folder = Path(shutil.copytree(good["folder"], tmp_path / "cut"))
    (folder / ".metadata").write_bytes(real.read_bytes()[:100])  # cut short: damaged, not hostile
    with pytest.raises(safe_checkpoint.UntrustedFileError, match="is not a readable part of a perfrun checkpoint"):
        safe_checkpoint.verify_sharded(folder)
    folder = Path(shutil.copytree(good["folder"], tmp_path / "linked"))
    (folder / SHARD).unlink()
    (folder / SHARD).symlink_to(good["folder"] / SHARD)
    with pytest.raises(safe_checkpoint.UntrustedFileError, match=f"its shard {SHARD} is a link"):
        safe_checkpoint.verify_sharded(folder)


@pytest.mark.parametrize("how", ["open", "makedirs"])
@pytest.mark.parametrize("place", list(PLACES))
def test_each_reader_refuses_each_kind_of_payload(place: str, how: str, good: dict[str, Path], tmp_path: Path) -> None:
    """In one process, as generate and export load: whichever global the payload names."""
    marker = tmp_path / "payload-ran"
    planted = PLACES[place](good, tmp_path, Payload(marker, how))
    assert armed(place, planted, marker)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(planted))} was not loaded: .* names (io\.open|os\.makedirs)"):
        load_model(planted if place == "single .pt" else planted.parent)
    assert not marker.exists()
