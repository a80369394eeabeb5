"""perfrun.data: windows, file formats, caches, loaders and the one-line errors."""

from __future__ import annotations

import json
import os
import pickle
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from perfrun.config import ConfigError, DataConfig, DataLoaderConfig
from perfrun.data import build_datasets, build_loader
from perfrun.data import pysource as P

from conftest import fill, small_disk

# --------------------------------------------------------------------------- helpers


def write_llmc(path: Path, tokens: np.ndarray, *, magic: int = 20240520, version: int = 1,
               count: int | None = None) -> None:
    """A token file as llm.c's write_datafile writes it: 256 x int32 header, uint16 tokens."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = [magic, version, len(tokens) if count is None else count]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=np.uint16).tobytes())


def stream(ds) -> np.ndarray:
    """The tokens a dataset covers, rebuilt from its windows (x of each, plus the last y)."""
    xs = [ds[i][0].numpy() for i in range(len(ds))]
    return np.concatenate(xs + [ds[len(ds) - 1][1].numpy()[-1:]])


def batches(loader: DataLoader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]


def dl(**kw) -> DataLoaderConfig:
    return DataLoaderConfig(**kw)


@pytest.fixture
def arange_bin(tmp_path: Path) -> Path:
    """A nanoGPT .bin holding 0, 1, ..., 1000: a token's value is its position."""
    p = tmp_path / "arange.bin"
    np.arange(1001, dtype=np.uint16).tofile(p)
    return p


def write_prepared(folder: Path, tokens: np.ndarray, *, vocab: int, tokenizer: str = "byte", dtype: str = "uint16",
                   val: int = 200) -> None:
    from perfrun.data.meta import TokenMeta, write_meta

    folder.mkdir(parents=True, exist_ok=True)
    tokens.astype(dtype)[:-val].tofile(folder / "train.bin")
    tokens.astype(dtype)[-val:].tofile(folder / "val.bin")
    write_meta(folder, TokenMeta(tokenizer=tokenizer, vocab_size=vocab, eot_id=None, dtype=dtype,
                                 train_tokens=len(tokens) - val, val_tokens=val, documents=1, source="test",
                                 val_fraction=0.1))


# --------------------------------------------------------------------------- windows and formats


def test_windows_shift_by_one(arange_bin: Path) -> None:
    b = build_datasets(DataConfig(name="memmap", path=str(arange_bin), vocab_size=2000), 16, 0)
    n_train = 1001 - 100  # the last val_fraction=0.1 of the tokens is val
    assert len(b.train) == (n_train - 1) // 16
    for i in (0, 1, len(b.train) - 1):
        x, y = b.train[i]
        assert x.dtype == torch.int64 and x.shape == (16,) and y.shape == (16,)
        assert torch.equal(x, torch.arange(i * 16, i * 16 + 16))
        assert torch.equal(y, x + 1)
    assert torch.equal(b.train[-1][0], b.train[len(b.train) - 1][0])
    with pytest.raises(IndexError):
        b.train[len(b.train)]
    assert int(b.val[0][0][0]) == n_train  # val starts where train ends
    assert b.vocab_size == 2000


def test_nanogpt_folder_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    train = rng.integers(0, 50257, 5000).astype(np.uint16)
    val = rng.integers(0, 50257, 700).astype(np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    b = build_datasets(DataConfig(name="memmap", path=str(tmp_path), vocab_size=50257), 64, 0)
    got_train, got_val = stream(b.train), stream(b.val)
    assert np.array_equal(got_train, train[: len(b.train) * 64 + 1])
    assert np.array_equal(got_val, val[: len(b.val) * 64 + 1])
    assert b.vocab_size == 50257 and "nanoGPT" in b.description


def test_llmc_header_detected(tmp_path: Path) -> None:
    tokens = np.random.default_rng(1).integers(0, 50257, 500).astype(np.uint16)
    p = tmp_path / "fineweb_train_000001.bin"
    write_llmc(p, tokens)
    b = build_datasets(DataConfig(name="memmap", path=str(p), val_fraction=0.2), 8, 0)
    assert "llm.c" in b.description
    assert b.train.n_tokens == 400 and b.val.n_tokens == 100  # header[2] = 500 tokens, 80/20
    assert torch.equal(b.train[0][0], torch.from_numpy(tokens[:8].astype(np.int64)))  # not the header
    assert torch.equal(b.val[0][0], torch.from_numpy(tokens[400:408].astype(np.int64)))
    assert np.array_equal(stream(b.train), tokens[: len(b.train) * 8 + 1])


# --------------------------------------------------------------------------- bad input


def _case_text_missing(t: Path):
    return DataConfig(name="text", path=str(t / "nope.txt")), 8, t / "nope.txt", ["does not exist"]


def _case_memmap_missing(t: Path):
    return DataConfig(name="memmap", path=str(t / "nope")), 8, t / "nope", ["does not exist"]


def _case_empty_folder(t: Path):
    (t / "d").mkdir()
    (t / "d" / ".hidden").write_text("skipped")
    return DataConfig(name="text", path=str(t / "d")), 8, t / "d", ["no files"]


def _case_empty_text(t: Path):
    (t / "e.txt").write_bytes(b"")
    return DataConfig(name="text", path=str(t / "e.txt")), 8, t / "e.txt", ["is empty"]


def _case_empty_bin(t: Path):
    (t / "e.bin").write_bytes(b"")
    return DataConfig(name="memmap", path=str(t / "e.bin")), 8, t / "e.bin", ["is empty"]


def _case_too_short(t: Path):
    (t / "s.txt").write_bytes(b"x" * 50)  # 45 train bytes, 5 val bytes
    return (DataConfig(name="text", path=str(t / "s.txt")), 64, t / "s.txt",
            ["train split has 45 tokens", "needs 65", "data.seq_len (at most 44)"])


def _case_val_too_short(t: Path):
    (t / "v.txt").write_bytes(b"y" * 1000)
    return (DataConfig(name="text", path=str(t / "v.txt"), val_fraction=0.01), 32, t / "v.txt",
            ["val split", "has 10 tokens", "data.val_fraction"])


def _case_odd_bin(t: Path):
    (t / "odd.bin").write_bytes(b"\x01" * 11)
    return DataConfig(name="memmap", path=str(t / "odd.bin")), 2, t / "odd.bin", ["11 bytes", "odd", "uint16"]


def _case_llmc_version(t: Path):
    write_llmc(t / "v3.bin", np.arange(100), version=3)
    return DataConfig(name="memmap", path=str(t / "v3.bin")), 8, t / "v3.bin", ["version 3", "version 1"]


def _case_llama3(t: Path):
    write_llmc(t / "l3.bin", np.arange(100), magic=20240801, version=7)
    return DataConfig(name="memmap", path=str(t / "l3.bin")), 8, t / "l3.bin", ["llama-3", "20240801"]


def _case_unknown_magic(t: Path):
    write_llmc(t / "u.bin", np.arange(100), magic=20250101)
    return DataConfig(name="memmap", path=str(t / "u.bin")), 8, t / "u.bin", ["unknown magic 20250101"]


def _case_llmc_truncated(t: Path):
    write_llmc(t / "tr.bin", np.arange(50), count=100)
    return DataConfig(name="memmap", path=str(t / "tr.bin")), 8, t / "tr.bin", ["says 100 tokens", "holds 50"]


def _case_vocab(t: Path):
    tok = np.arange(300, dtype=np.uint16)
    tok.tofile(t / "big.bin")
    return (DataConfig(name="memmap", path=str(t / "big.bin"), vocab_size=256), 8, t / "big.bin",
            ["token id 299", "data.vocab_size=300"])


def _case_no_train_bin(t: Path):
    (t / "m").mkdir()
    np.arange(100, dtype=np.uint16).tofile(t / "m" / "other.bin")
    return (DataConfig(name="memmap", path=str(t / "m")), 8, t / "m",
            ["without train.bin", "other.bin"])


def _case_memmap_text_file(t: Path):
    (t / "corpus.txt").write_text("hello " * 100)
    return DataConfig(name="memmap", path=str(t / "corpus.txt")), 8, t / "corpus.txt", ["data=text"]


def _case_unwritable_cache(t: Path):
    (t / "afile").write_text("not a folder")
    return (DataConfig(name="pysource", cache_dir=str(t / "afile")), 8, t / "afile",
            ["cannot write the pysource cache", "data.cache_dir"])


def _case_meta_vocab_lowered(t: Path):
    write_prepared(t / "p", np.arange(1000) % 256, vocab=256)
    return (DataConfig(name="memmap", path=str(t / "p"), vocab_size=100), 8, t / "p",
            ["data.vocab_size=100 is smaller than the vocabulary of the tokenizer (256", "meta.json"])


def _case_meta_damaged(t: Path):
    write_prepared(t / "p", np.arange(1000) % 256, vocab=256)
    (t / "p" / "val.bin").write_bytes(b"\0\0" * 10)
    return (DataConfig(name="memmap", path=str(t / "p")), 8, t / "p",
            ["val.bin has 20 bytes but meta.json records 200 uint16 tokens", "run perfrun prepare again"])


def _case_meta_other_tokenizer(t: Path):
    write_prepared(t / "p", np.arange(1000) % 256, vocab=256)
    return (DataConfig(name="memmap", path=str(t / "p"), tokenizer="tiktoken:gpt2"), 8, t / "p",
            ["data.tokenizer=tiktoken:gpt2 but", "made by byte"])


def _case_pysource_tokenizer(t: Path):
    return (DataConfig(name="pysource", tokenizer="tiktoken:gpt2", cache_dir=str(t)), 8, "data.tokenizer=tiktoken:gpt2",
            ["data=pysource is byte-level"])


def _case_text_tokenizer_unparsable(t: Path):
    (t / "c.txt").write_text("some text " * 100)
    (t / "tok.json").write_text("{ not json")
    return (DataConfig(name="text", path=str(t / "c.txt"), tokenizer=str(t / "tok.json")), 8, t / "tok.json",
            ["does not parse as a Hugging Face tokenizer.json"])


BAD_CASES: dict[str, Callable] = {
    f.__name__.removeprefix("_case_"): f
    for f in (
        _case_text_missing, _case_memmap_missing, _case_empty_folder, _case_empty_text,
        _case_empty_bin, _case_too_short, _case_val_too_short, _case_odd_bin,
        _case_llmc_version, _case_llama3, _case_unknown_magic, _case_llmc_truncated,
        _case_vocab, _case_no_train_bin, _case_memmap_text_file, _case_unwritable_cache,
        _case_meta_vocab_lowered, _case_meta_damaged, _case_meta_other_tokenizer, _case_pysource_tokenizer,
        _case_text_tokenizer_unparsable,
    )
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_input_is_one_clear_line(case: str, tmp_path: Path) -> None:
    cfg, seq_len, path, fragments = BAD_CASES[case](tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(ConfigError) as info:
        build_datasets(cfg, seq_len, 0)
    msg = str(info.value)
    assert "\n" not in msg
    assert str(path) in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg
    # nothing written beside the user's files (e.g. no half cache)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# --------------------------------------------------------------------------- text and loaders


def test_text_reads_in_workers_like_in_process(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    rng = np.random.default_rng(2)
    files = {"a.txt": 3000, "b.txt": 1, "sub/c.bin": 5000}  # tiny b: windows span files
    for name, n in files.items():
        (root / name).write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_bytes(b"\xff" * 4000)  # hidden: must be skipped
    b = build_datasets(DataConfig(name="text", path=str(root)), 32, 0)
    assert b.vocab_size == 256
    want = b"".join((root / n).read_bytes() for n in sorted(files))
    n_train = len(want) - round(len(want) * 0.1)
    got = stream(b.train).astype(np.uint8).tobytes()
    assert got == want[: len(got)] and len(got) == len(b.train) * 32 + 1
    assert stream(b.val).astype(np.uint8).tobytes() == want[n_train : n_train + len(b.val) * 32 + 1]

    ref = batches(build_loader(b.train, dl(batch_size=4), device_type="cpu", shuffle=True, seed=7))
    par = batches(build_loader(b.train, dl(batch_size=4, num_workers=2), device_type="cpu",
                               shuffle=True, seed=7))
    assert len(ref) == len(b.train) // 4 and len(par) == len(ref)
    for (x0, y0), (x1, y1) in zip(ref, par, strict=True):
        assert torch.equal(x0, x1) and torch.equal(y0, y1)


def test_shuffled_order_is_independent_of_batch_size(arange_bin: Path) -> None:
    b = build_datasets(DataConfig(name="memmap", path=str(arange_bin), vocab_size=2000), 8, 0)

    def first_tokens(batch_size: int, seed: int, n: int, shuffle: bool = True) -> list[int]:
        loader = build_loader(b.train, dl(batch_size=batch_size), device_type="cpu",
                              shuffle=shuffle, seed=seed)
        out: list[int] = []
        for x, _ in loader:
            out += x[:, 0].tolist()
            if len(out) >= n:
                break
        return out[:n]

    eight = first_tokens(8, seed=3, n=8)
    twos = first_tokens(2, seed=3, n=8)
    assert eight == twos
    assert first_tokens(8, seed=3, n=8) == eight  # reproducible
    assert first_tokens(8, seed=4, n=8) != eight  # and it is the seed that decides
    assert eight != sorted(eight)
    assert first_tokens(4, seed=3, n=8, shuffle=False) == [i * 8 for i in range(8)]


def test_build_loader_options(arange_bin: Path) -> None:
    b = build_datasets(DataConfig(name="memmap", path=str(arange_bin), vocab_size=2000), 8, 0)
    cpu = build_loader(b.train, dl(pin_memory=True), device_type="cpu", shuffle=False, seed=0)
    cuda = build_loader(b.train, dl(pin_memory=True), device_type="cuda", shuffle=False, seed=0)
    assert cpu.pin_memory is False and cuda.pin_memory is True and cpu.drop_last
    w = build_loader(b.train, dl(num_workers=2, prefetch_factor=5, persistent_workers=True),
                     device_type="cpu", shuffle=True, seed=0)
    assert w.prefetch_factor == 5 and w.persistent_workers and w.num_workers == 2
    with pytest.raises(ConfigError, match=r"dataloader\.batch_size=500 .* 112 training sequences"):
        build_loader(b.train, dl(batch_size=500), device_type="cpu", shuffle=True, seed=0)
    # a validation set smaller than a batch gives no batch (the trainer warns), not an error
    assert len(b.val) == 12
    assert list(build_loader(b.val, dl(batch_size=500), device_type="cpu", shuffle=False, seed=0)) == []
    # iterating never draws from torch's global RNG (evals must not perturb training)
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    next(iter(cpu))
    assert torch.equal(torch.rand(1), expected)


@pytest.mark.slow
def test_memmap_dataset_pickles_without_its_array_and_works_in_spawn(arange_bin: Path) -> None:
    b = build_datasets(DataConfig(name="memmap", path=str(arange_bin), vocab_size=2000), 8, 0)
    first = b.train[3]  # opens the memmap in this process
    blob = pickle.dumps(b.train)
    assert len(blob) < 1000  # paths and numbers, not 2 KB of tokens
    clone = pickle.loads(blob)
    assert clone._mm is None and torch.equal(clone[3][0], first[0])
    ref = [x for x, _ in DataLoader(b.train, batch_size=4)]
    spawned = [x for x, _ in DataLoader(b.train, batch_size=4, num_workers=1,
                                        multiprocessing_context="spawn")]
    assert len(spawned) == len(ref) and all(torch.equal(a, c) for a, c in zip(ref, spawned, strict=True))


# --------------------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic() -> None:
    cfg = DataConfig(name="synthetic", vocab_size=1000)
    a = build_datasets(cfg, 32, seed=5)
    b = build_datasets(cfg, 32, seed=5)
    c = build_datasets(cfg, 32, seed=6)
    assert a.vocab_size == 1000 and len(a.train) == 1 << 20
    x, y = a.train[12345]
    assert torch.equal(x, b.train[12345][0]) and torch.equal(y, b.train[12345][1])
    assert torch.equal(x[1:], y[:-1])
    assert not torch.equal(x, c.train[12345][0])
    assert not torch.equal(x, a.val[12345][0])  # val is another stream
    assert int(x.min()) >= 0 and int(x.max()) < 1000
    default = build_datasets(DataConfig(name="synthetic"), 16, seed=0)
    assert default.vocab_size == 50257


# --------------------------------------------------------------------------- pysource


@pytest.fixture
def fake_stdlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A small stand-in for the standard library, so cache mechanics test in milliseconds."""
    lib = tmp_path / "lib"
    for i in range(20):
        (lib / "pkg").mkdir(parents=True, exist_ok=True)
        (lib / "pkg" / f"mod{i:02d}.py").write_text(f"def f{i}():\n    return {i}\n" * 20)
    (lib / "site-packages").mkdir()
    (lib / "site-packages" / "third_party.py").write_text("THIRD_PARTY_MARKER = 1\n" * 50)
    monkeypatch.setattr(P, "stdlib_dir", lambda: lib)
    return lib


def test_pysource_split_excludes_site_packages_and_rebuilds_a_damaged_cache(
    fake_stdlib: Path, tmp_path: Path
) -> None:
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"), val_fraction=0.5)
    b = build_datasets(cfg, 8, 0)
    assert "built" in b.description
    all_bytes = stream(b.train).astype(np.uint8).tobytes() + stream(b.val).astype(np.uint8).tobytes()
    assert b"THIRD_PARTY_MARKER" not in all_bytes
    rels = [r for r, _ in P.pysource_files(fake_stdlib)]
    assert len(rels) == 20 and not any("site-packages" in r for r in rels)
    val_rels = [r for r in rels if P.is_val(r, 0.5)]
    assert 0 < len(val_rels) < 20
    val_bytes = b"".join((fake_stdlib / r).read_bytes() for r in val_rels)
    assert b.val.n_tokens == len(val_bytes)
    # a damaged train.bin (e.g. copied halfway) is noticed and rebuilt, not trusted
    train_bin = Path(b.train.path)
    train_bin.write_bytes(train_bin.read_bytes()[:100])
    again = build_datasets(cfg, 8, 0)
    assert "built" in again.description and train_bin.stat().st_size == 2 * again.train.n_tokens


def test_the_interpreters_own_stdlib_is_listed_once_and_any_other_folder_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listed: list[Path] = []
    listing = P._listed
    monkeypatch.setattr(P, "_listed", lambda folder: listed.append(folder) or listing(folder))
    P._own_stdlib_files.cache_clear()
    own = Path(sysconfig.get_paths()["stdlib"])
    first = P.pysource_files(own)
    first.clear()  # a caller's copy: what is kept stays whole
    assert P.pysource_files(own) == listing(own) and listed == [own]
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "a.py").write_text("A = 1\n")
    assert [r for r, _ in P.pysource_files(lib)] == ["a.py"]
    (lib / "b.py").write_text("B = 2\n")
    assert [r for r, _ in P.pysource_files(lib)] == ["a.py", "b.py"] and listed == [own, lib, lib]


def test_pysource_failed_write_leaves_no_cache(fake_stdlib: Path, tmp_path: Path) -> None:
    """A cache on a real disk that is full: refused with the reason, nothing left behind;
    built once there is room."""
    with small_disk(tmp_path / "cache", "64k") as cache:
        fill(cache)
        cfg = DataConfig(cache_dir=str(cache), val_fraction=0.5)
        with pytest.raises(ConfigError, match="No space left on device"):
            build_datasets(cfg, 8, 0)
        leftovers = [p for p in cache.rglob("*") if p.is_file() and p.name != ".filler"]
        assert leftovers == []
        (cache / ".filler").unlink()
        assert "built" in build_datasets(cfg, 8, 0).description


def test_pysource_real_cache_is_built_once_and_decodes_to_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[str] = []  # every source file tokenised, counted (not timed): once each, then never again
    tokenise = P._tokenise
    monkeypatch.setattr(P, "_tokenise", lambda stdlib, rels: read.extend(rels) or tokenise(stdlib, rels))
    cfg = DataConfig(cache_dir=str(tmp_path))
    b = build_datasets(cfg, 256, 0)
    assert sorted(read) == [r for r, _ in P.pysource_files(P.stdlib_dir())]
    train_bin = Path(b.train.path)
    v = sys.version_info
    assert f"py{v.major}.{v.minor}.{v.micro}" in train_bin.parent.name
    mtimes = {p.name: p.stat().st_mtime_ns for p in train_bin.parent.iterdir()}
    assert set(mtimes) == {"train.bin", "val.bin", "meta.json"}  # no temp files left
    assert b.vocab_size == 256 and b.train.n_tokens > 1_000_000 and len(b.val) > 100

    read.clear()
    again = build_datasets(cfg, 256, 0)
    assert "reused" in again.description and read == []  # the second build read the cache, no source
    assert {p.name: p.stat().st_mtime_ns for p in train_bin.parent.iterdir()} == mtimes

    stdlib = P.stdlib_dir()
    first = next(r for r, _ in P.pysource_files(stdlib) if not P.is_val(r, cfg.val_fraction))
    source = (stdlib / first).read_bytes()
    tokens = np.memmap(train_bin, dtype=np.uint16, mode="r")
    assert tokens[: len(source)].astype(np.uint8).tobytes() == source
    compile(source, first, "exec")  # it is real Python source
    decoded = b.train[0][0].numpy().astype(np.uint8).tobytes()
    assert decoded == tokens[:256].astype(np.uint8).tobytes()  # the dataset reads the cache


# --------------------------------------------------------------------------- every token id checked


def test_a_token_beyond_the_vocabulary_late_in_the_file_is_refused_before_step_1(
    tmp_path: Path, capfd: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id 300 sits 2^24 + 5 tokens into a 32 MiB file (past any bounded prefix):
    ``perfrun train`` refuses it with one line, before the first step."""
    from perfrun.commands.dispatch import main as cli_main

    tokens = np.zeros((1 << 24) + 10, dtype=np.uint16)
    tokens[(1 << 24) + 5] = 300
    tokens.tofile(tmp_path / "late.bin")
    monkeypatch.chdir(tmp_path)
    try:
        rc = cli_main(["train", "data=memmap", f"data.path={tmp_path / 'late.bin'}", "data.vocab_size=256",
                       "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32", "max_steps=2",
                       "device=cpu", "monitor.every_n_steps=0", "hydra.run.dir=run"])
    except SystemExit as e:
        rc = e.code
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert "holds token id 300 (first at token 16,777,221) but data.vocab_size=256" in lines[0]
    assert "data.vocab_size=301" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").read_text().strip()  # no step ran
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "failed"


def test_the_whole_file_check_runs_once_per_version_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(2000, dtype=np.uint16).tofile(path)
    cfg = DataConfig(name="memmap", path=str(path), vocab_size=2000, cache_dir=str(tmp_path / "cache"))
    build_datasets(cfg, 8, 0)
    build_datasets(cfg, 16, 0)
    assert len(list((tmp_path / "cache" / "largest-token").glob("*.json"))) == 1
    before = path.stat()
    tokens = np.arange(2000, dtype=np.uint16)
    tokens[1500] = 2500
    tokens.tofile(path)  # rewritten in place, same size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same version of the file, as far as it can tell
    build_datasets(cfg, 8, 0)  # the cached verdict: the file is not read again (a scan would refuse 2500)
    os.utime(path, ns=(time.time_ns(), before.st_mtime_ns + 1_000_000))  # a newer version: read again, and refused
    with pytest.raises(ConfigError, match="holds token id 2500"):
        build_datasets(cfg, 8, 0)


# --------------------------------------------------------------------------- folders from perfrun prepare


def test_a_prepared_folder_gives_its_vocabulary_and_tokenizer(tmp_path: Path) -> None:
    write_prepared(tmp_path / "p", np.arange(1000) % 256, vocab=256)
    b = build_datasets(DataConfig(name="memmap", path=str(tmp_path / "p")), 16, 0)
    assert (b.vocab_size, b.tokenizer) == (256, "byte")  # not GPT-2's 50257: read from meta.json
    padded = build_datasets(DataConfig(name="memmap", path=str(tmp_path / "p"), vocab_size=320), 16, 0)
    assert padded.vocab_size == 320
    raw = tmp_path / "raw"
    raw.mkdir()
    np.arange(1000, dtype=np.uint16).tofile(raw / "train.bin")
    assert build_datasets(DataConfig(name="memmap", path=str(raw)), 16, 0).tokenizer is None  # nobody knows


# --------------------------------------------------------------------------- text with a tokenizer


def test_text_with_a_tokenizer_gives_whole_windows_of_the_text(tmp_path: Path) -> None:
    import sysconfig

    from perfrun.data.tokenizers import load_tokenizer, train_bpe

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    root = tmp_path / "corpus"
    root.mkdir()
    sources = ["textwrap.py", "colorsys.py", "bisect.py", "this.py"]
    for name in sources:
        (root / name).write_text((stdlib / name).read_text())
    spec = str(train_bpe([(root / n).read_text() for n in sources], 400, tmp_path / "tok.json"))
    tok = load_tokenizer(spec)
    b = build_datasets(DataConfig(name="text", path=str(root), tokenizer=spec), 64, 0)
    assert b.vocab_size == 400 and b.tokenizer == spec and "tokenised in the DataLoader" in b.description
    assert len(b.train) > 50 and len(b.val) >= 1
    texts = [(root / n).read_text() for n in sorted(sources)]
    for i in (0, 1, len(b.train) // 2, len(b.train) - 1):
        x, y = b.train[i]
        assert x.shape == (64,) and torch.equal(x[1:], y[:-1]) and int(y.max()) < 400
        pieces = tok.decode([t for t in torch.cat([x, y[-1:]]).tolist() if t != tok.eot_id]).split("\ufffd")
        assert all(any(p.strip() in t for t in texts) for p in pieces if p.strip())  # real text, whole words
    ids = [t for i in range(len(b.train)) for t in b.train[i][0].tolist()]
    assert ids.count(tok.eot_id) >= 2  # documents (files) are separated by the end-of-text token
    ref = batches(build_loader(b.train, dl(batch_size=4), device_type="cpu", shuffle=True, seed=7))
    par = batches(build_loader(b.train, dl(batch_size=4, num_workers=2), device_type="cpu", shuffle=True, seed=7))
    assert len(par) == len(ref) and all(torch.equal(a[0], c[0]) for a, c in zip(ref, par, strict=True))
    assert len(pickle.dumps(b.train)) < 2000  # paths and numbers: the tokenizer loads in each worker
