"""``perfrun generate``: sample text from a checkpoint, with or without a KV cache, timed.

The cache's gain is measured, not claimed: ``cache=false`` (or ``--no-cache``) runs the
same sampler over the full context at every step, and for a fixed seed both paths give
the same tokens, because the sampler draws its uniform numbers from its own CPU generator
(inverse-CDF sampling) rather than from ``torch.multinomial``, whose draws depend on the
device. The generated text goes to stdout as it is produced; the measurements go to
stderr, so ``perfrun generate ... > out.txt`` keeps only the text.

Tokens are bytes (the vocabulary of ``data=pysource`` and ``data=text``): the prompt is
encoded as UTF-8 and the output decoded with ``errors="replace"``. A checkpoint trained on
another vocabulary (GPT-2 token ids from ``data=memmap``) is refused with one line: without
its tokenizer perfrun cannot turn text into its ids or back.

The model uses learned absolute positions, so it sees at most ``block_size`` tokens. A
longer prompt is cropped from the left (and the run says so). Once prompt + output pass
``block_size``, the uncached path conditions on the last ``block_size`` tokens; the cached
path does the same by re-filling its cache from that window at each such step (counted as
``cache_refills``), so the two stay token-for-token equal and the cache's gain applies to
the steps within the window.
"""

from __future__ import annotations

import codecs
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from perfrun import checkpoint_files as checkpoint
from perfrun.config import ConfigError
from perfrun.console import first_line
from perfrun.data import BYTE_VOCAB
from perfrun.model import GPT, GPTConfig, KVCache, padded_vocab

BYTE_SOURCES = ("pysource", "text")
USAGE = ("perfrun generate checkpoint=PATH [prompt=TEXT] [max_new_tokens=N] [temperature=T] "
         "[top_k=K|none] [seed=S] [cache=true|false|--no-cache] [device=auto|cpu|cuda] "
         "[quantize=none|int8] [stream=true|false]")


# --------------------------------------------------------------------------- arguments


def _bool(key: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{key}={value} is not a boolean; write {key}=true or {key}=false")


def _int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value} is not an integer; write e.g. {key}=100") from None


def _float(key: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{key}={value} is not a number; write e.g. {key}=0.8") from None


def parse_kv(argv: list[str], known: set[str], usage: str, flags: dict[str, tuple[str, str]] | None = None) -> dict[str, str]:
    """``key=value`` words into a dict; ``flags`` maps a ``--flag`` to the (key, value) it
    stands for. Unknown keys and stray words are the user's mistake: one line naming the
    accepted keys."""
    out: dict[str, str] = {}
    for word in argv:
        if flags and word in flags:
            key, value = flags[word]
            out[key] = value
            continue
        if "=" not in word:
            raise ConfigError(f"{word!r} is not key=value; usage: {usage}")
        key, value = word.split("=", 1)
        if key not in known:
            raise ConfigError(f"{key} is not a key of this command; the keys are {', '.join(sorted(known))}")
        out[key] = value
    return out


@dataclass
class GenerateArgs:
    """What one ``perfrun generate`` call asks for (validated: a bad value raises ConfigError)."""

    checkpoint: Path
    prompt: str = "\n"
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int | None = None  # None: sample from the whole distribution
    seed: int = 1337
    cache: bool = True
    device: str = "auto"
    quantize: str = "none"
    stream: bool = True

    @classmethod
    def parse(cls, argv: list[str]) -> GenerateArgs:
        kv = parse_kv(argv, {f for f in cls.__dataclass_fields__}, USAGE,
                      flags={"--no-cache": ("cache", "false"), "--cache": ("cache", "true")})
        if "checkpoint" not in kv or not kv["checkpoint"]:
            raise ConfigError(f"checkpoint=PATH is required (a step_*.pt file or a run folder); usage: {USAGE}")
        a = cls(checkpoint=Path(kv["checkpoint"]).expanduser())
        if "prompt" in kv:
            a.prompt = kv["prompt"]
        if "max_new_tokens" in kv:
            a.max_new_tokens = _int("max_new_tokens", kv["max_new_tokens"])
        if "temperature" in kv:
            a.temperature = _float("temperature", kv["temperature"])
        if "top_k" in kv:
            a.top_k = None if kv["top_k"].lower() in ("none", "null", "") else _int("top_k", kv["top_k"])
        if "seed" in kv:
            a.seed = _int("seed", kv["seed"])
        if "cache" in kv:
            a.cache = _bool("cache", kv["cache"])
        if "stream" in kv:
            a.stream = _bool("stream", kv["stream"])
        a.device = kv.get("device", a.device)
        a.quantize = kv.get("quantize", a.quantize)
        a.validate()
        return a

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1; e.g. max_new_tokens=200")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ConfigError(f"temperature={self.temperature} must be a finite number >= 0; "
                              "temperature=0 is greedy, 0.8 a usual choice")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k} must be >= 1; give top_k=none to sample from every token")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device={self.device} is not an option; choose auto, cpu or cuda")
        if self.quantize not in ("none", "int8"):
            raise ConfigError(f"quantize={self.quantize} is not an option; choose none or int8")
        if self.quantize == "int8" and self.device.startswith("cuda"):
            raise ConfigError("quantize=int8 is dynamic int8 for CPU inference; use device=cpu (or auto) with it")
        if not self.prompt:
            raise ConfigError("prompt is empty and byte-level models have no start token; give prompt=\"some text\"")


# --------------------------------------------------------------------------- the model


@dataclass
class Loaded:
    """A checkpoint's model, rebuilt in eval mode, and what generation needs to know of it."""

    model: GPT
    path: Path
    step: int
    vocab_size: int  # the real vocabulary: logits above it are padding, never sampled
    config: dict[str, Any] = field(default_factory=dict)


def resolve_checkpoint(spec: Path) -> Path:
    """A step_*.pt file or sharded step_* folder, or a run folder / checkpoints folder (its newest checkpoint)."""
    if checkpoint.is_sharded(spec):
        return spec
    if spec.is_dir():
        found = checkpoint.list_checkpoints(spec) or checkpoint.list_checkpoints(spec / "checkpoints")
        if not found:
            raise ConfigError(f"checkpoint={spec}: the folder holds no step_*.pt checkpoint; give a "
                              "checkpoint file or a run folder with a checkpoints/ folder")
        return found[-1]
    if not spec.is_file():
        raise ConfigError(f"checkpoint={spec}: no such file; give a step_*.pt written by perfrun train "
                          "(in <run dir>/checkpoints/) or a run folder")
    return spec


def real_vocab(config: dict[str, Any], padded: int) -> int:
    """The vocabulary the model was trained on (the embedding holds it padded to 64)."""
    data = config.get("data", {}) or {}
    if data.get("name") in BYTE_SOURCES:
        return BYTE_VOCAB
    return int(data.get("vocab_size") or padded)


def load_model(spec: Path, device: torch.device | str = "cpu", *, byte_level: bool = True) -> Loaded:
    """Load on the CPU first (checkpoint.load), rebuild GPT from ``model_shape``, then move it.

    ``byte_level=True`` refuses a checkpoint whose tokens are not bytes (generation needs
    to encode and decode text); export takes any vocabulary.
    """
    path = resolve_checkpoint(spec)
    try:
        ckpt = checkpoint.load(path)
    except ConfigError as e:
        raise ConfigError(str(e).replace(f"resume={path}", f"checkpoint={path}")) from None
    shape = ckpt.get("model_shape") or {}
    missing = [k for k in checkpoint.SHAPE_KEYS if k not in shape]
    if missing:
        raise ConfigError(f"checkpoint={path} has no model shape ({', '.join(missing)} missing); "
                          "it was written by an older perfrun, retrain or pick a newer checkpoint")
    config = ckpt.get("config") or {}
    mcfg = config.get("model", {}) or {}
    vocab = real_vocab(config, int(shape["vocab_size"]))
    if byte_level and (vocab > BYTE_VOCAB or int(shape["vocab_size"]) != padded_vocab(BYTE_VOCAB)):
        what = (config.get("data", {}) or {}).get("name", "?")
        raise ConfigError(
            f"checkpoint={path} was trained on data={what} with a vocabulary of {vocab} token ids, not bytes; "
            "perfrun generate reads and writes byte-level text (train with data=pysource or data=text), "
            "or export it (perfrun export format=safetensors) and sample with that vocabulary's tokenizer"
        )
    gcfg = GPTConfig(
        vocab_size=int(shape["vocab_size"]), block_size=int(shape["block_size"]), n_layer=int(shape["n_layer"]),
        n_head=int(shape["n_head"]), n_embd=int(shape["n_embd"]), dropout=0.0,
        bias=bool(mcfg.get("bias", True)), attention=str(config.get("attention", "sdpa")),
    )
    model = GPT(gcfg)
    try:
        checkpoint.load_model_weights(ckpt, model)
    except ConfigError as e:  # unreadable shards
        raise ConfigError(str(e).replace(f"resume={path}", f"checkpoint={path}")) from None
    except RuntimeError as e:
        raise ConfigError(f"checkpoint={path}: its weights do not fit the model it describes ({first_line(e)}); "
                          "the file is damaged or hand-edited, pick another checkpoint") from None
    model.eval().to(device)
    return Loaded(model, path, int(ckpt.get("step", 0)), vocab, config)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but CUDA is not available here; use device=cpu or device=auto")
    return torch.device(name)


# --------------------------------------------------------------------------- sampling


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class Sampler:
    """Temperature and top-k sampling by inverse CDF with uniforms from a seeded CPU
    generator: one uniform per token whatever the device or path, so a fixed seed gives
    the same tokens with and without the cache (and on CPU and CUDA, up to float noise)."""

    def __init__(self, temperature: float, top_k: int | None, vocab_size: int, seed: int) -> None:
        self.temperature = temperature
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V_padded) logits of the last position -> (B, 1) token ids."""
        logits = logits[:, : self.vocab_size].float()
        u = torch.rand(logits.size(0), 1, generator=self.gen).to(logits.device)
        if self.temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / self.temperature
        if self.top_k is not None and self.top_k < logits.size(-1):
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        cdf = torch.softmax(logits, dim=-1).cumsum(dim=-1)
        # right=True: the first token whose cumulative probability exceeds u (never a zero-probability one)
        idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
        return idx.clamp_(max=logits.size(-1) - 1)


@dataclass
class Generation:
    """Tokens out and how long they took (wall clock, device synchronised)."""

    tokens: list[int]
    seconds: float
    first_token_s: float  # prompt processing + first sample: what the user waits before text appears
    cache: bool
    cache_refills: int = 0
    prompt_tokens: int = 0
    cropped: int = 0  # prompt tokens dropped from the left to fit block_size

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else float("inf")

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Steady-state rate after the first token (None with a single token)."""
        n, t = len(self.tokens) - 1, self.seconds - self.first_token_s
        return n / t if n > 0 and t > 0 else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def generate(model: GPT, prompt: list[int], max_new_tokens: int, sampler: Sampler, *, cache: bool = True,
             on_token: Callable[[int], None] | None = None, warmup: bool = True) -> Generation:
    """Sample ``max_new_tokens`` tokens after ``prompt`` (batch of one).

    Timing starts after an untimed warm-up forward (first-call allocations and kernel
    selection are not the cache's fault) and ends after a device synchronise.
    """
    block = model.config.block_size
    device = next(model.parameters()).device
    cropped = max(0, len(prompt) - block)
    ids = list(prompt[cropped:])
    ctx = torch.tensor([ids], dtype=torch.long, device=device)
    if warmup:
        if cache:
            model.forward_cached(ctx, KVCache.empty(model.config, 1, device, model.lm_head.weight.dtype))
        else:
            model(ctx)
        _sync(device)
    out: list[int] = []
    refills = 0
    t0 = time.perf_counter()
    first = 0.0
    if cache:
        kv = KVCache.empty(model.config, 1, device, model.lm_head.weight.dtype)
        logits = model.forward_cached(ctx, kv)[:, -1]
    for i in range(max_new_tokens):
        if not cache:
            logits = model(ctx[:, -block:])[0][:, -1]
        nxt = sampler(logits)
        tok = int(nxt.item())  # the host needs it (to print, to stop): this syncs the device
        out.append(tok)
        if i == 0:
            first = time.perf_counter() - t0
        if on_token is not None:
            on_token(tok)
        if i == max_new_tokens - 1:
            break
        ctx = torch.cat([ctx, nxt], dim=1)
        if cache:
            if kv.length + 1 <= block:
                logits = model.forward_cached(nxt, kv)[:, -1]
            else:  # window full: positions shift, so re-fill from the last block_size tokens
                kv.length = 0
                logits = model.forward_cached(ctx[:, -block:], kv)[:, -1]
                refills += 1
        ctx = ctx[:, -block:] if ctx.size(1) > 2 * block else ctx  # keep the context tensor bounded
    _sync(device)
    seconds = time.perf_counter() - t0
    return Generation(out, seconds, first, cache, refills, len(ids), cropped)


class Streamer:
    """Writes bytes as text as they come: an incremental UTF-8 decoder holds a partial
    multi-byte character until its last byte arrives (invalid bytes become U+FFFD)."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def __call__(self, token: int) -> None:
        if 0 <= token < 256:
            self.stream.write(self.decoder.decode(bytes([token])))
            self.stream.flush()

    def close(self) -> None:
        self.stream.write(self.decoder.decode(b"", final=True) + "\n")
        self.stream.flush()


# --------------------------------------------------------------------------- command


def _console() -> Any:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def main(argv: list[str]) -> int:
    """``perfrun generate KEY=VALUE...``: 0 on success, 2 for a user's mistake."""
    from perfrun.console import error as _error

    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: {USAGE}")
        return 0
    try:
        args = GenerateArgs.parse(argv)
        device = torch.device("cpu") if args.quantize == "int8" else pick_device(args.device)
        loaded = load_model(args.checkpoint, device)
    except ConfigError as e:
        _error(str(e))
        return 2
    console = _console()
    model = loaded.model
    note = ""
    if args.quantize == "int8":
        from perfrun.quantize import quantize_int8

        note = f", {quantize_int8(model).describe()}"
    prompt = encode(args.prompt)
    c = model.config
    console.print(f"[dim]{loaded.path} (step {loaded.step}; {c.n_layer} layers, {c.n_embd} wide, "
                  f"block_size {c.block_size}) on {device}{note}; KV cache {'on' if args.cache else 'off'}[/]")
    if len(prompt) > c.block_size:
        console.print(f"[yellow]the prompt is {len(prompt)} tokens, longer than block_size {c.block_size}: "
                      f"the first {len(prompt) - c.block_size} are dropped (the model sees only its last "
                      f"{c.block_size})[/]")
    sampler = Sampler(args.temperature, args.top_k, loaded.vocab_size, args.seed)
    streamer = Streamer() if args.stream else None
    if streamer is not None:
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    g = generate(model, prompt, args.max_new_tokens, sampler, cache=args.cache, on_token=streamer)
    if streamer is not None:
        streamer.close()
    else:
        print(args.prompt + decode(g.tokens))
    steady = g.decode_tokens_per_s
    console.print(
        f"[bold]{len(g.tokens)} tokens in {g.seconds:.3f} s: {g.tokens_per_s:.1f} tokens/s[/] "
        f"(first token after {g.first_token_s * 1e3:.1f} ms for a {g.prompt_tokens}-token prompt"
        + (f"; then {steady:.1f} tokens/s" if steady is not None else "")
        + (f"; cache re-filled {g.cache_refills} times past block_size" if g.cache_refills else "")
        + f"; KV cache {'on' if g.cache else 'off'}, seed {args.seed}"
        + ("" if streamer is None else "; printing included") + ")"
    )
    return 0
