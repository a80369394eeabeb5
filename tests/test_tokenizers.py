"""perfrun.data.tokenizers: byte, a Hugging Face tokenizer.json trained here on a few KB, and
tiktoken:gpt2 from tiktoken's cache only; each bad spec is one line."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from perfrun.config import ConfigError
from perfrun.data.tokenizers import ByteTokenizer, load_tokenizer, tiktoken_cache_dir, train_bpe

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE of 400 ids trained on a few KB of the standard library's source."""
    texts = [(STDLIB / name).read_text() for name in ("textwrap.py", "this.py", "colorsys.py")]
    return train_bpe(texts, 400, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_byte_round_trip() -> None:
    tok = load_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eot_id is None
    text = "naïve café ✓\n"
    assert tok.encode(text) == list(text.encode("utf-8")) and tok.decode(tok.encode(text)) == text


def test_tokenizer_json_round_trip(bpe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(bpe.parent)
    tok = load_tokenizer("tokenizer.json")  # relative: recorded as an absolute path
    assert tok.name == str(bpe.resolve()) and tok.vocab_size == 400 and tok.eot_id == 0
    text = "def wrap(text, width=70):\n    return [line.strip() for line in text]\n"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode()) / 1.5  # merges learned: fewer ids than bytes
    assert max(ids) < 400 and 0 not in ids and tok.decode(ids) == text


@pytest.mark.parametrize("spec, fragments", [
    ("{d}/broken.json", ["does not parse as a Hugging Face tokenizer.json", "broken.json"]),
    ("{d}/missing.json", ["no such file", "missing.json"]),
    ("gpt3", ["tokenizer=gpt3 is not a tokenizer perfrun knows", "tiktoken:gpt2"]),
    ("tiktoken:cl100k_base", ["tiktoken:cl100k_base", "tiktoken:gpt2"]),
])
def test_bad_specs_are_one_line(spec: str, fragments: list[str], tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ConfigError) as info:
        load_tokenizer(spec.format(d=tmp_path))
    msg = str(info.value)
    assert "\n" not in msg and all(f in msg for f in fragments), msg


def test_tiktoken_reads_only_its_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With an empty cache, tiktoken:gpt2 is one line that says how to provide the files;
    nothing is fetched (the cache stays empty) and tiktoken's fetcher is restored."""
    import tiktoken.load

    fetch = tiktoken.load.read_file
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    assert tiktoken_cache_dir() == str(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_tokenizer("tiktoken:gpt2")
    msg = str(info.value)
    assert "\n" not in msg and str(tmp_path) in msg and "TIKTOKEN_CACHE_DIR" in msg and "does not download" in msg
    assert list(tmp_path.iterdir()) == []
    assert tiktoken.load.read_file is fetch


def _gpt2_cached() -> bool:
    try:
        load_tokenizer("tiktoken:gpt2")
    except ConfigError:
        return False
    return True


@pytest.mark.skipif(not _gpt2_cached(), reason=f"GPT-2's encoding is not in tiktoken's cache ({tiktoken_cache_dir()})")
def test_tiktoken_gpt2_from_the_cache() -> None:
    tok = load_tokenizer("tiktoken:gpt2")
    assert tok.vocab_size == 50257 and tok.eot_id == 50256
    assert tok.encode("Hello world") == [15496, 995] and tok.decode([15496, 995]) == "Hello world"
    assert tok.encode("<|endoftext|>") != [50256]  # ordinary text, as nanoGPT's prepare encodes it
