"""perfrun prepare: corpus to train.bin/val.bin/meta.json that data=memmap reads; split by
document, end-of-text between documents, the same files for any number of workers, uint32
when the vocabulary needs it, nothing half-written when it fails or is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from perfrun.commands.dispatch import main as cli_main
from perfrun.config import ConfigError, DataConfig
from perfrun.data import build_datasets
from perfrun.data.tokenizers import load_tokenizer, train_bpe
from perfrun.prepare import corpus as prepare_corpus
from perfrun.prepare.corpus import PIECE_BYTES, is_val

from conftest import child_env, perfrun_process

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SOURCES = ["textwrap.py", "colorsys.py", "this.py", "bisect.py", "keyword.py", "fnmatch.py", "glob.py",
           "heapq.py", "shlex.py", "sched.py", "queue.py", "copy.py"]


def prepare(*args: str) -> int:
    try:
        return cli_main(["prepare", "progress=false", *args])
    except SystemExit as e:  # pragma: no cover - main returns codes; kept so a regression reads clearly
        return int(e.code or 0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 documents of real source, one of them larger than a task's piece, so it is cut."""
    root = tmp_path_factory.mktemp("corpus") / "docs"
    root.mkdir()
    for i, name in enumerate(SOURCES):
        (root / f"doc{i:02d}.txt").write_text((STDLIB / name).read_text())
    big = "".join((STDLIB / n).read_text() for n in ("argparse.py", "typing.py", "inspect.py", "pathlib.py"))
    while len(big.encode()) < 2.5 * PIECE_BYTES:
        big += big
    (root / "doc03.txt").write_text(big)
    return root


@pytest.fixture(scope="module")
def bpe(corpus: Path) -> Path:
    texts = [p.read_text()[:4000] for p in sorted(corpus.iterdir())]
    return train_bpe(texts, 500, corpus.parent / "tokenizer.json")


def bins(out: Path, dtype: str = "uint16") -> tuple[np.ndarray, np.ndarray]:
    return np.fromfile(out / "train.bin", dtype=dtype), np.fromfile(out / "val.bin", dtype=dtype)


def test_byte_prepare_is_split_by_document_and_read_by_memmap(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "byte"
    assert prepare(f"path={corpus}", f"out={out}", "workers=2") == 0
    docs = [p.read_bytes() for p in sorted(corpus.iterdir())]
    train, val = bins(out)
    assert train.astype(np.uint8).tobytes() == b"".join(d for k, d in enumerate(docs) if not is_val(k, 0.1))
    assert val.astype(np.uint8).tobytes() == docs[9]  # one document in ten, evenly spread: the tenth
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert meta["split"] == "documents" and meta["documents"] == 12 and meta["eot_id"] is None
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["byte"]  # no temporary folder left beside it
    b = build_datasets(DataConfig(name="memmap", path=str(out)), 64, 0)
    assert b.vocab_size == 256 and b.tokenizer == "byte" and "perfrun prepare" in b.description
    assert b.train.n_tokens == train.size and b.val.n_tokens == val.size


def test_bpe_documents_end_with_eot_and_workers_do_not_change_the_files(
        corpus: Path, bpe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 64 KiB here (1 MiB in use) and the long document cut to 2.5 of them: the
    same cuts for a nineteenth of the encoding (160 KiB of the fixture's 3 MiB)."""
    monkeypatch.setattr(prepare_corpus, "PIECE_BYTES", 1 << 16)
    docs = tmp_path / "docs"
    docs.mkdir()
    for p in sorted(corpus.iterdir()):  # doc03 cut to 160 K characters (the others are shorter), whole characters
        (docs / p.name).write_text(p.read_text()[: 5 << 15])
    tasks, _ = prepare_corpus.plan([(p, p.stat().st_size) for p in sorted(docs.iterdir())])
    assert sum(piece.path.endswith("doc03.txt") for task in tasks for piece in task) >= 3
    one, two = tmp_path / "one", tmp_path / "two"
    assert prepare(f"path={docs}", f"out={one}", f"tokenizer={bpe}", "workers=1") == 0
    assert prepare(f"path={docs}", f"out={two}", f"tokenizer={bpe}", "workers=2") == 0
    for name in ("train.bin", "val.bin"):
        assert (one / name).read_bytes() == (two / name).read_bytes()
    tok = load_tokenizer(str(bpe))
    expected: dict[bool, list[int]] = {False: [], True: []}
    for k, p in enumerate(sorted(docs.iterdir())):  # doc03 was cut into pieces: its ids are the whole file's
        expected[is_val(k, 0.1)] += tok.encode(p.read_text()) + [tok.eot_id]
    train, val = bins(one)
    assert train.tolist() == expected[False] and val.tolist() == expected[True]
    meta = json.loads((one / "meta.json").read_text())
    assert meta["tokenizer"] == "tokenizer.json" and meta["vocab_size"] == 500 and meta["eot_id"] == 0
    assert (one / "tokenizer.json").read_bytes() == bpe.read_bytes()  # the folder carries its tokenizer
    b = build_datasets(DataConfig(name="memmap", path=str(one)), 32, 0)
    assert b.vocab_size == 500 and b.tokenizer == str((one / "tokenizer.json").resolve())


def test_jsonl_documents_and_a_bad_line(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    docs = [f"document {i}: " + "words " * i for i in range(12)]
    lines = [json.dumps({"body": d, "id": i}) for i, d in enumerate(docs)]
    lines.insert(4, "   ")  # a blank line is no document
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    assert prepare(f"path={tmp_path / 'c'}", f"out={tmp_path / 'out'}", "text_field=body") == 0
    train, val = bins(tmp_path / "out")
    index = [k for k in range(13) if k != 4]  # document index = line index
    assert val.astype(np.uint8).tobytes().decode() == "".join(d for k, d in zip(index, docs, strict=True) if is_val(k, 0.1))
    assert train.size + val.size == sum(len(d) for d in docs)
    capfd.readouterr()
    lines[7] = '{"body": 3}'
    (tmp_path / "c" / "docs.jsonl").write_text("\n".join(lines) + "\n")
    assert prepare(f"path={tmp_path / 'c'}", f"out={tmp_path / 'out2'}", "text_field=body") == 2
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "line 8 of" in err and "'body'" in err and "is a int" in err
    assert not (tmp_path / "out2").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["c", "out"]


def test_a_jsonl_line_longer_than_a_piece(tmp_path: Path) -> None:
    docs = [f"short {i}" for i in range(12)]
    docs[5] = "long " * (PIECE_BYTES // 3)  # 1.7 MiB on one line
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert prepare(f"path={tmp_path / 'docs.jsonl'}", f"out={tmp_path / 'out'}", "workers=2") == 0
    train, val = bins(tmp_path / "out")
    assert train.astype(np.uint8).tobytes().decode() == "".join(d for k, d in enumerate(docs) if not is_val(k, 0.1))
    assert val.astype(np.uint8).tobytes().decode() == docs[9]


def test_one_document_is_split_as_a_stream(tmp_path: Path) -> None:
    text = (STDLIB / "textwrap.py").read_bytes()
    (tmp_path / "one.txt").write_bytes(text)
    assert prepare(f"path={tmp_path / 'one.txt'}", f"out={tmp_path / 'out'}", "val_fraction=0.2") == 0
    train, val = bins(tmp_path / "out")
    n_val = round(len(text) * 0.2)
    assert val.astype(np.uint8).tobytes() == text[-n_val:] and train.astype(np.uint8).tobytes() == text[:-n_val]
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["split"] == "stream"


def test_a_vocabulary_beyond_uint16_is_written_as_uint32(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(70_000)}
    words["<|endoftext|>"] = 70_000
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "words.json"))
    ids = [3, 65_535, 65_536, 69_999, 12, 66_000] * 200
    (tmp_path / "c.txt").write_text(" ".join(f"w{i}" for i in ids))
    out = tmp_path / "out"
    assert prepare(f"path={tmp_path / 'c.txt'}", f"out={out}", f"tokenizer={tmp_path / 'words.json'}") == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_001 and meta["eot_id"] == 70_000
    train, val = bins(out, "uint32")
    assert np.concatenate([train, val]).tolist() == ids + [70_000]
    b = build_datasets(DataConfig(name="memmap", path=str(out)), 8, 0)
    assert b.vocab_size == 70_001 and b.train[0][0].tolist() == ids[:8] and b.train.dtype == "uint32"


def test_out_is_new_empty_or_an_earlier_prepare(corpus: Path, tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert prepare(f"path={corpus}", f"out={mine}") == 2
    assert "holds files that perfrun prepare did not write (notes.txt)" in capfd.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    out = tmp_path / "out"
    assert prepare(f"path={corpus / 'doc00.txt'}", f"out={out}") == 0
    assert prepare(f"path={corpus}", f"out={out}") == 0  # an earlier prepare's folder is replaced whole
    assert json.loads((out / "meta.json").read_text())["documents"] == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]
    capfd.readouterr()
    assert prepare(f"path={corpus}", f"out={corpus / 'tokens'}") == 2
    assert "inside path=" in capfd.readouterr().err and not (corpus / "tokens").exists()
    assert prepare(f"path={tmp_path / 'empty.txt'}", f"out={tmp_path / 'new' / 'deep' / 'out'}") == 2
    (tmp_path / "empty.txt").write_text("")
    assert prepare(f"path={tmp_path / 'empty.txt'}", f"out={tmp_path / 'new' / 'deep' / 'out'}") == 2
    assert "is empty" in capfd.readouterr().err and not (tmp_path / "new").exists()


def _start(*args: str) -> Any:
    env = child_env(PYTHONUNBUFFERED="1")
    return perfrun_process("prepare", "progress=false", *args, cwd=Path.cwd(), env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)


def _wait_for_tokens(tmp: Path, proc: subprocess.Popen) -> None:
    """Until the prepare has written tokens into its temporary folder."""
    while not any(p.stat().st_size > 0 for p in tmp.glob(".out.prepare-*.tmp/train.bin")):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_stopped_prepare_leaves_nothing_training_would_read(corpus: Path, bpe: Path, tmp_path: Path, sig: int) -> None:
    big = tmp_path / "big"
    big.mkdir()
    for i in range(64):  # 160 MB of BPE work, minutes on any machine: the signal lands long before its end
        os.link(corpus / "doc03.txt", big / f"part{i}.txt")  # (links: the test writes none of it)
    out = tmp_path / "out"
    proc = _start(f"path={big}", f"out={out}", f"tokenizer={bpe}", "workers=1")
    _wait_for_tokens(tmp_path, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert not out.exists()
    with pytest.raises(ConfigError, match="does not exist"):
        build_datasets(DataConfig(name="memmap", path=str(out)), 8, 0)
    if sig == signal.SIGINT:
        assert proc.returncode == 130 and err.strip().splitlines() == [
            f"perfrun: error: stopped by SIGINT; nothing was written (out={out} is as it was)"]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big"]
    else:
        assert [p.name for p in tmp_path.glob(".out.*")] == [f".out.prepare-{proc.pid}.tmp"]  # what kill -9 leaves
        assert prepare(f"path={corpus / 'doc00.txt'}", f"out={out}") == 0  # the next prepare removes it
        assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "out"]


def test_help_lists_every_key(capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["prepare", "--help"]) == 0
    shown = capsys.readouterr().out
    for key in ("path", "out", "tokenizer", "val_fraction", "workers", "text_field", "progress"):
        assert f"\n  {key} " in shown, shown
    assert cli_main(["--help"]) == 0 and "prepare" in capsys.readouterr().out


# The pool's workers, forked from the pool's own thread, in a fresh process: forked from a test
# process that has run torch's threads, a worker can crash as it starts, and the pool then
# replaces crashed workers for ever.
ENDED_BEFORE_IT_RAN = """
import os, signal, time
from perfrun.prepare import build
from perfrun.prepare.corpus import Settings

real = build._pool_worker

def late_worker(settings):  # a worker that the machine has not run yet when the pool ends it
    time.sleep(1)
    real(settings)

build._pool_worker = late_worker
settings = Settings(tokenizer="byte", dtype="uint8", val_fraction=0.1, by_document=True, text_field="text")
with build.stop_on_signals(), build.worker_pool(settings, 2) as pool:
    workers = list(pool._pool)
    for w in workers:  # during their sleep: before they set their own handlers
        os.kill(w.pid, signal.SIGTERM)
    end = time.monotonic() + 120  # against a hang only: the pool's own thread reaps them too
    while any(w.exitcode is None for w in workers) and time.monotonic() < end:
        time.sleep(0.01)
    print([w.exitcode for w in workers], pool.apply(len, ("abc",)))
"""


def test_a_worker_ended_before_it_ran_ends_and_the_pool_exits(tmp_path: Path) -> None:
    """The pool ends its workers once the work is done, on a busy machine before some have
    run: each still ends by SIGTERM (not by the parent's handler, which it holds until it
    sets its own, nor never, which hung the pool's exit), the pool replaces them and works,
    and the process exits."""
    done = subprocess.run([sys.executable, "-c", ENDED_BEFORE_IT_RAN], cwd=tmp_path, env=child_env(),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == f"{[-signal.SIGTERM] * 2} 3"
