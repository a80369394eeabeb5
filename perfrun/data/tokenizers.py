"""Tokenizers: text to token ids and back, behind one small interface, so training data,
``perfrun prepare`` and ``perfrun generate`` agree on what a token is.

A tokenizer is named by a spec, the string a run records as ``data.tokenizer``:

* ``byte``: the built-in one (vocabulary 256, every byte its own token, no end-of-text id);
* ``PATH`` to a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library): any BPE,
  WordPiece or Unigram tokenizer, e.g. the one in a GPT-2 folder, or one you trained;
* ``tiktoken:gpt2``: OpenAI's GPT-2 encoding through ``tiktoken``, read from tiktoken's
  local cache only. perfrun never downloads it: with no cache the answer is one line that
  says how to provide the files.

The libraries are optional: ``pip install 'perfrun[tokenizers]'``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from perfrun.config import ConfigError
from perfrun.console import first_line

BYTE_VOCAB = 256
# what a tokenizer.json calls its end-of-text token, in the order they are looked for
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
TIKTOKEN_ENCODINGS = ("gpt2",)
INSTALL = "pip install 'perfrun[tokenizers]'"


class Tokenizer(Protocol):
    name: str  # the spec it was loaded from: "byte", "tiktoken:gpt2", or a tokenizer.json path
    vocab_size: int
    eot_id: int | None  # the end-of-text token that separates documents (None: no such token)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens; decoding replaces what is not valid UTF-8."""

    name = "byte"
    vocab_size = BYTE_VOCAB
    eot_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < BYTE_VOCAB).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library. Special tokens written in
    the text are kept as text's tokens would be; no template (BOS/EOS) is added."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ConfigError(f"tokenizer={path} needs the tokenizers library; {INSTALL}") from None
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception for a bad file
            raise ConfigError(
                f"tokenizer={path} does not parse as a Hugging Face tokenizer.json ({first_line(e, 100)}); "
                "give the tokenizer.json of a tokenizers/transformers tokenizer, byte or tiktoken:gpt2"
            ) from None
        self.name = str(path.resolve())
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        found = (self._tok.token_to_id(t) for t in EOT_NAMES)
        self.eot_id = next((i for i in found if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class TiktokenTokenizer:
    """A tiktoken encoding; text is encoded as ordinary text (``<|endoftext|>`` written in
    a document is not the end-of-text token), as nanoGPT's prepare.py does."""

    def __init__(self, encoding: Any, name: str) -> None:
        self._enc = encoding
        self.name = name
        self.vocab_size = int(encoding.n_vocab)
        self.eot_id = int(encoding.eot_token)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(list(ids), errors="replace")


class NotCached(Exception):
    """tiktoken asked for a file that is not in its cache."""


@contextmanager
def _cache_only(load_module: Any) -> Iterator[None]:
    """While loading an encoding, tiktoken's cache is the only source: the function it
    fetches missing files with raises instead of going to the network."""

    def refuse(blobpath: str) -> bytes:
        raise NotCached(blobpath)

    fetch = load_module.read_file
    load_module.read_file = refuse
    try:
        yield
    finally:
        load_module.read_file = fetch


def tiktoken_cache_dir() -> str:
    """Where tiktoken keeps its files (its own rule: these variables, else the temp folder)."""
    return (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
            or os.path.join(tempfile.gettempdir(), "data-gym-cache"))


def _load_tiktoken(spec: str) -> TiktokenTokenizer:
    name = spec.split(":", 1)[1]
    if name not in TIKTOKEN_ENCODINGS:
        raise ConfigError(f"tokenizer={spec}: perfrun reads the tiktoken encoding(s) {', '.join(TIKTOKEN_ENCODINGS)}; "
                          "use tokenizer=tiktoken:gpt2, or give a tokenizer.json")
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        raise ConfigError(f"tokenizer={spec} needs the tiktoken library; {INSTALL}") from None
    try:
        with _cache_only(tiktoken.load):
            encoding = tiktoken.get_encoding(name)
    except NotCached:
        raise ConfigError(
            f"tokenizer={spec}: GPT-2's encoding files are not in tiktoken's cache ({tiktoken_cache_dir()}) and "
            "perfrun does not download them; on a machine with network run python -c \"import tiktoken; "
            f"tiktoken.get_encoding('{name}')\" with TIKTOKEN_CACHE_DIR=DIR, copy DIR here and set "
            "TIKTOKEN_CACHE_DIR=DIR (or use tokenizer=PATH/tokenizer.json of a local GPT-2 folder)"
        ) from None
    return TiktokenTokenizer(encoding, spec)


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by ``spec``: ``byte``, ``tiktoken:gpt2`` or a tokenizer.json path.
    A spec that cannot be loaded raises ConfigError with one line: what, why, the fix."""
    spec = str(spec)
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("tiktoken:"):
        return _load_tiktoken(spec)
    path = Path(spec).expanduser()
    if path.is_file():
        return HuggingFaceTokenizer(path)
    if path.suffix == ".json" or os.sep in spec:
        raise ConfigError(f"tokenizer={spec}: no such file; give the path of a Hugging Face tokenizer.json, "
                          "byte or tiktoken:gpt2")
    raise ConfigError(f"tokenizer={spec} is not a tokenizer perfrun knows; use byte, tiktoken:gpt2 "
                      "or the path of a Hugging Face tokenizer.json")


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> Path:
    """Train a byte-level BPE tokenizer like GPT-2's (same pre-tokenizer, ``<|endoftext|>``
    as its end-of-text id 0) on ``texts`` and save it as ``out`` (a tokenizer.json), for a
    corpus that GPT-2's tokenizer serves badly, or a test that must not download one."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ConfigError(f"training a tokenizer needs the tokenizers library; {INSTALL}") from None
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_NAMES[0]], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out
