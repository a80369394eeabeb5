"""perfrun generate: the KV cache computes what the full forward computes, cached and
uncached sampling give the same tokens, int8 stays close to float, bad input gets one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from perfrun import checkpoint_files as checkpoint
from perfrun.cli import main as cli_main
from perfrun.generate import Sampler, encode, generate, load_model
from perfrun.model import GPT, GPTConfig, KVCache
from perfrun.train import run

from conftest import REPO, make_cfg

# fp32 on both paths; they differ only in summation order (observed ~1e-7)
KV_ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def make_checkpoint(folder: Path) -> Path:
    """A real checkpoint from a short run on byte-level text (this repo's own source)."""
    run(make_cfg("max_steps=12", "checkpoint.every_n_steps=12", "data=text", f"data.path={REPO / 'perfrun'}",
                 "eval_batches=1"), folder)
    return checkpoint.list_checkpoints(folder / "checkpoints")[-1]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gen"))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_kv_cache_logits_match_the_full_forward_at_every_position(attention: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=24, n_layer=2, n_head=2, n_embd=32, attention=attention)).eval()
    idx = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        full = model(idx)[0]
    cache = KVCache.empty(model.config, 2, "cpu", torch.float32)
    # a prefill, a multi-token chunk after it (the masked branch), then one token at a time
    parts = [model.forward_cached(idx[:, :7], cache), model.forward_cached(idx[:, 7:12], cache)]
    parts += [model.forward_cached(idx[:, t : t + 1], cache) for t in range(12, 24)]
    got = torch.cat(parts, dim=1)
    assert cache.length == 24
    assert (got - full).abs().max().item() < KV_ATOL
    with pytest.raises(ValueError, match="overflow"):
        model.forward_cached(idx[:, :1], cache)


@pytest.mark.parametrize(("temperature", "top_k"), [(0.0, None), (1.0, None), (0.9, 5)])
def test_cached_and_uncached_sampling_give_the_same_tokens(ckpt: Path, temperature: float, top_k: int | None) -> None:
    loaded = load_model(ckpt)
    block = loaded.model.config.block_size
    prompt = encode("def f(x):\n    return")
    n = 2 * block  # past block_size, so the cached path must re-fill its window
    runs = [generate(loaded.model, prompt, n, Sampler(temperature, top_k, loaded.vocab_size, seed=3), cache=c)
            for c in (True, False)]
    assert runs[0].tokens == runs[1].tokens
    assert len(runs[0].tokens) == n and all(0 <= t < loaded.vocab_size for t in runs[0].tokens)
    assert runs[0].cache_refills > 0 and runs[1].cache_refills == 0
    if temperature > 0:  # another seed draws other tokens: the seed is really used
        other = generate(loaded.model, prompt, n, Sampler(temperature, top_k, loaded.vocab_size, seed=4))
        assert other.tokens != runs[0].tokens


def test_top_k_one_is_greedy_and_padding_is_never_sampled() -> None:
    logits = torch.randn(3, 320)
    logits[:, 300] = 100.0  # a padded id with the highest logit
    greedy = Sampler(0.0, None, 256, 0)(logits)
    assert torch.equal(Sampler(1.0, 1, 256, 0)(logits), greedy)
    assert torch.equal(greedy.squeeze(1), logits[:, :256].argmax(-1))
    assert (Sampler(1.0, None, 256, 0)(logits) < 256).all()


def test_a_long_prompt_is_cropped_from_the_left(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    loaded = load_model(ckpt)
    block = loaded.model.config.block_size
    g = generate(loaded.model, encode("x" * (block + 9)), 3, Sampler(0.0, None, 256, 0))
    assert g.cropped == 9 and g.prompt_tokens == block
    assert cli_main(["generate", f"checkpoint={ckpt}", "prompt=" + "y" * (block + 5), "max_new_tokens=2"]) == 0
    assert "the first 5 are dropped" in capsys.readouterr().err


def test_cli_streams_text_and_reports_tokens_per_second(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli_main(["generate", f"checkpoint={ckpt.parent.parent}", "prompt=import ", "max_new_tokens=20",
                     "temperature=0", "--no-cache"])
    out = capsys.readouterr()
    assert code == 0
    assert out.out.startswith("import ") and len(out.out) > len("import ")
    assert "20 tokens in" in out.err and "tokens/s" in out.err and "KV cache off" in out.err


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli_main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("perfrun: error:") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(("args", "says"), [
    (["checkpoint=/no/such.pt"], "no such file"),
    (["max_new_tokens=0"], "max_new_tokens=0 must be >= 1"),
    (["temperature=-0.5"], "temperature=-0.5 must be"),
    (["top_k=0"], "top_k=0 must be >= 1"),
    (["colour=red"], "colour is not a key"),
    (["max_new_tokens=many"], "not an integer"),
    (["quantize=int4"], "choose none or int8"),
    (["prompt="], "prompt is empty"),
])
def test_bad_input_gets_one_line_and_exit_2(ckpt: Path, args: list[str], says: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    argv = args if args[0].startswith("checkpoint=") else [f"checkpoint={ckpt}", *args]
    assert says in _refused(argv, capsys)


def test_not_a_checkpoint_and_missing_checkpoint_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "step_0000001.pt"
    junk.write_bytes(b"not a checkpoint")
    assert "is not a readable perfrun checkpoint" in _refused([f"checkpoint={junk}"], capsys)
    assert "checkpoint=PATH is required" in _refused(["prompt=hi"], capsys)


def test_a_non_byte_vocabulary_is_refused(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = checkpoint.load(ckpt)
    state["config"]["data"] = {"name": "memmap", "vocab_size": 50257}
    fake = tmp_path / "step_0000012.pt"
    torch.save(state, fake)
    assert "not bytes" in _refused([f"checkpoint={fake}"], capsys)


def test_int8_val_loss_stays_within_5_percent_of_float(ckpt: Path) -> None:
    """Per-channel int8 weights carry ~0.4% of each row's range as rounding error; that
    moves the loss far less than one more training step does. 5% is the bound: a broken
    quantisation (wrong scales, a lost tied head) moves it by tens of percent."""
    pytest.importorskip("torchao")
    from perfrun.quantize import _val_dataset, quantize_int8, state_dict_bytes, val_loss

    flt, q = load_model(ckpt), load_model(ckpt)
    info = quantize_int8(q.model)
    assert info.layers == 4 * flt.model.config.n_layer and info.skipped == ["lm_head"]
    assert q.model.lm_head.weight is q.model.wte.weight  # the tie survives: the head stays float
    val = _val_dataset(flt.config, flt.model.config.block_size)
    a = val_loss(flt.model, val, batches=2, batch_size=4)
    b = val_loss(q.model, val, batches=2, batch_size=4)
    assert abs(b - a) / a < 0.05
    assert b != a  # the quantised model really is another model
    assert state_dict_bytes(q.model) < state_dict_bytes(flt.model)


def test_generate_int8_runs_from_the_cli(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchao")
    assert cli_main(["generate", f"checkpoint={ckpt}", "prompt=def ", "max_new_tokens=5", "quantize=int8"]) == 0
    err = capsys.readouterr().err
    assert "int8 dynamic quantisation of" in err and "5 tokens in" in err
