"""perfrun generate: the KV cache computes what the full forward computes, cached and
uncached sampling give the same tokens, the static cache keeps its shapes, every path
(uncached, cached, compiled; alone and batched) gives the same greedy tokens, sequences
stop at their end-of-text token, int8 stays close to float, the command's keys and help,
and bad input gets one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from perfrun.checkpoint import files as checkpoint
from perfrun.commands.dispatch import main as cli_main
from perfrun.commands.generate import Streamer
from perfrun.data.tokenizers import load_tokenizer
from perfrun.inference.generation import Generator, generate
from perfrun.inference.loading import load_model
from perfrun.inference.sampling import Sampler
from perfrun.models.gpt import GPT, GPTConfig, KVCache

# fp32 on both paths; they differ only in summation order (observed ~1e-7)
KV_ATOL = 1e-5
encode = load_tokenizer("byte").encode


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(text_checkpoint: Path) -> Path:
    """A real checkpoint from 12 steps on byte-level text, this repo's own source
    (conftest.py: shared with test_export.py)."""
    return text_checkpoint


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
    (["temperature=hot"], "temperature=hot is not a number"),
    (["cache=maybe"], "cache=maybe is not a boolean"),
    (["seed=18446744073709551616"], "seed=18446744073709551616 is outside what the random number generator takes"),
    (["seed=-9223372036854775809"], "is outside what the random number generator takes"),
    (["max_new_tokens=100001"], "at most 100000"),
    (["prompt=caf\udce9"], "prompt holds bytes that are not valid UTF-8"),  # how Python reads byte 0xe9 in argv
    (["compile=true", "--no-cache"], "compile=true compiles the cached decode step"),
    (["prompts_file=/no/such.txt"], "prompts_file=/no/such.txt: No such file"),
    (["prompt=a", "prompts_file=/no/such.txt"], "not both"),
    (["prompts_file=/no/such.txt", "stream=true"], "drop stream=true"),
    (["batch_size=0"], "batch_size=0 must be >= 1"),
    (["device=tpu"], "device=tpu"),
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


@pytest.mark.parametrize(("content", "says"), [
    (b"def f(\ncaf\xe9 = 1\n", "line 2 is not valid UTF-8 (byte 0xe9 at column 4)"),
    (b"def f(\n\nimport\n", "line 2 is empty"),
    (b"", "holds no prompt"),
])
def test_a_bad_prompts_file_is_refused(ckpt: Path, tmp_path: Path, content: bytes, says: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "prompts.txt").write_bytes(content)
    assert says in _refused([f"checkpoint={ckpt}", f"prompts_file={tmp_path / 'prompts.txt'}"], capsys)


def test_weights_that_are_not_finite_are_refused(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = checkpoint.load(ckpt)
    state["model"]["blocks.1.mlp.c_fc.weight"][3, 5] = float("nan")
    bad = tmp_path / "step_0000012.pt"
    torch.save(state, bad)
    assert cli_main(["generate", f"checkpoint={bad}", "max_new_tokens=5"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no text at all, rather than garbage
    assert err.startswith("perfrun: error:") and err.count("\n") == 1
    assert "weights are not finite (blocks.1.mlp.c_fc.weight holds NaN or infinity)" in err


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
    import torch._inductor.config as inductor  # inductor's settings have no public module: torchao sets them here

    from perfrun.inference.int8 import quantize_int8, state_dict_bytes, val_dataset, val_loss

    flt, q = load_model(ckpt), load_model(ckpt)
    settings = inductor.get_config_copy()
    info = quantize_int8(q.model)
    assert inductor.get_config_copy() == settings  # an uncompiled model: no inductor setting of the process changed
    assert info.layers == 4 * flt.model.config.n_layer and info.skipped == ["lm_head"]
    assert q.model.lm_head.weight is q.model.wte.weight  # the tie survives: the head stays float
    val = val_dataset(flt.config, flt.model.config.block_size)
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


# --------------------------------------------------------------------------- the static cache, batches, compile


def test_decode_step_matches_the_full_forward_with_a_position_per_sequence() -> None:
    """Two sequences right-padded in one batch, each at its own position: every decode step
    (static shapes, the whole cache under a mask) gives the full forward's logits."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=24, n_layer=2, n_head=2, n_embd=32)).eval()
    seqs = torch.randint(0, 256, (2, 20))
    lengths = [4, 9]  # prompt lengths; then one token per step from each sequence's own text
    cache = KVCache.empty(model.config, 2, "cpu", torch.float32, capacity=20)
    padded = seqs[:, :9].clone()
    padded[0, 4:] = 0  # the shorter prompt's padding, never attended to
    model.forward_cached(padded, cache)
    pos = torch.tensor(lengths)
    for _ in range(10):
        idx = seqs.gather(1, pos.unsqueeze(1))
        got = model.decode_step(idx, pos, cache)
        for row in range(2):
            p = int(pos[row])
            with torch.no_grad():
                want = model(seqs[row: row + 1, : p + 1])[0][0, -1]
            assert (got[row] - want).abs().max().item() < KV_ATOL
        pos += 1


def test_every_decode_step_has_the_same_shapes_and_storage(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(ckpt)
    model = loaded.model
    seen: list[tuple] = []
    step = model.decode_step

    def recording(idx: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        seen.append((tuple(idx.shape), tuple(pos.shape), tuple(cache.k[0].shape),
                     tuple(t.data_ptr() for t in cache.k + cache.v)))
        return step(idx, pos, cache)

    monkeypatch.setattr(model, "decode_step", recording)
    gen = Generator(model, Sampler(0.0, None, 256, 0), 12, longest_prompt=7, batch=2, warmup=False)
    g = gen.run([encode("def f("), encode("import")])
    assert gen.kv is not None and gen.kv.capacity == 7 + 12 - 1  # prompt + max_new_tokens - 1, under block_size
    assert [len(s) for s in g.sequences] == [12, 12]
    assert len(seen) == 11 and len(set(seen)) == 1  # one prefill, then 11 steps of identical shapes and storage
    with pytest.raises(ValueError, match="longer than the longest_prompt"):  # it would not fit the cache
        gen.run([encode("a prompt longer than seven tokens")])


@pytest.fixture(scope="module")
def sharp_ckpt(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint with seeded random weights x6 in place of its trained ones: a model
    this small, trained this briefly, greedily repeats one byte, which would make any two
    paths agree; these weights pick each token by a wide margin, and a different one as
    the context changes."""
    torch.manual_seed(0)
    model = GPT(load_model(ckpt).model.config)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(6)
    state = checkpoint.load(ckpt)
    state["model"] = model.state_dict()
    path = tmp_path_factory.mktemp("sharp") / "step_0000012.pt"
    torch.save(state, path)
    return path


PROMPTS = ["def f(x):\n    return", "import ", "class A:\n    def __init__(self"]


def _greedy(ckpt: Path, prompts: list[list[int]], n: int, *, batch: int, cache: bool, compile: bool) -> list[list[int]]:
    model = load_model(ckpt).model
    gen = Generator(model, Sampler(0.0, None, 256, 0), n, longest_prompt=max(map(len, prompts)), batch=batch,
                    cache=cache, compile=compile)
    out = []
    for lo in range(0, len(prompts), batch):
        g = gen.run(prompts[lo: lo + batch])
        assert g.compiled == compile and (g.warmup_s > 0) == (lo == 0)  # warmed up (and compiled) once
        out += g.sequences
    return out


@pytest.mark.slow
def test_greedy_tokens_are_identical_on_every_path(sharp_ckpt: Path) -> None:
    """Uncached, cached and compiled; alone and in a batch of prompts of other lengths; past
    block_size (the window re-fills) included: the same greedy tokens everywhere."""
    block = load_model(sharp_ckpt).model.config.block_size
    prompts = [encode(p) for p in PROMPTS]
    n = block + 8
    reference = _greedy(sharp_ckpt, prompts, n, batch=1, cache=False, compile=False)
    assert all(len(s) == n and len(set(s)) > 3 for s in reference) and len({tuple(s) for s in reference}) == 3
    for batch, cache, compile in [(3, False, False), (1, True, False), (3, True, False), (1, True, True),
                                  (3, True, True)]:
        assert _greedy(sharp_ckpt, prompts, n, batch=batch, cache=cache, compile=compile) == reference, \
            (batch, cache, compile)


def test_each_sequence_stops_at_the_end_of_text_token(sharp_ckpt: Path) -> None:
    model = load_model(sharp_ckpt).model
    prompts = [encode("def f("), encode("import os\n"), encode("x = ")]
    full = Generator(model, Sampler(0.0, None, 256, 0), 40, longest_prompt=10, batch=3).run(prompts).sequences
    eot = full[0][5]  # a token the first sequence emits: stand-in for a tokenizer's end-of-text id
    g = Generator(model, Sampler(0.0, None, 256, 0), 40, longest_prompt=10, batch=3, eot_id=eot).run(prompts)
    for seq, stopped, whole in zip(g.sequences, g.stopped, full, strict=True):
        assert stopped == (eot in whole)
        assert seq == (whole[: whole.index(eot)] if stopped else whole)
    streamed: list[int] = []
    one = Generator(model, Sampler(0.0, None, 256, 0), 40, longest_prompt=6, eot_id=eot).run(prompts[:1], streamed.append)
    assert one.sequences[0] == streamed == full[0][: full[0].index(eot)] and one.stopped == [True]


def test_streamer_prints_whole_characters_only() -> None:
    import io

    out = io.StringIO()
    streamer = Streamer(load_tokenizer("byte"), out)
    text = "café € \U0001f600!"
    shown = []
    for byte in text.encode("utf-8") + b"\xff":
        streamer(byte)
        shown.append(out.getvalue())
        assert "\ufffd" not in shown[-1]  # a character cut in the middle is held back
    streamer.close()
    assert out.getvalue() == text + "\ufffd\n"  # the stray byte is replaced at the end


# --------------------------------------------------------------------------- the command


def test_prompts_file_prints_one_json_line_per_prompt_as_each_prompt_alone(sharp_ckpt: Path, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import json

    prompts = [*PROMPTS[1:], "x = [1, 2]", "café"]  # a comma and a multi-byte character: taken literally
    (tmp_path / "prompts.txt").write_text("\n".join(p.replace("\n", " ") for p in prompts) + "\n", encoding="utf-8")
    common = [f"checkpoint={sharp_ckpt}", "temperature=0", "max_new_tokens=12"]
    assert cli_main(["generate", *common, f"prompts_file={tmp_path / 'prompts.txt'}", "batch_size=3"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt"] for r in rows] == [p.replace("\n", " ") for p in prompts]
    assert all(r["tokens"] == 12 and r["stopped_by"] == "max_new_tokens" for r in rows)
    assert "4 prompts (batches of up to 3), 48 tokens in" in err
    for row in rows:  # each one alone, streamed, gives the same text
        assert cli_main(["generate", *common, f"prompt={row['prompt']}"]) == 0
        assert capsys.readouterr().out == row["prompt"] + row["completion"] + "\n"


@pytest.mark.slow
def test_compile_from_the_cli_reports_its_time_apart_and_gives_the_same_text(sharp_ckpt: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # 9 prompt tokens + 24 new fill the 32-position cache as the batch-1 compiled path above
    # does: the same shapes, so inductor's kernels built there are reused here
    common = ["generate", f"checkpoint={sharp_ckpt}", "temperature=0", "max_new_tokens=24", "prompt=def main(",
              "stream=false"]
    assert cli_main(common) == 0
    eager = capsys.readouterr()
    assert cli_main([*common, "compile=true", "device=cpu"]) == 0
    compiled = capsys.readouterr()
    assert compiled.out == eager.out and len(eager.out) > len("def main(\n")
    assert "decode step compiled" in compiled.err and "compile and warm-up" in compiled.err
    assert "compile and warm-up" not in eager.err


@pytest.mark.slow
def test_help_lists_every_key_with_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    from perfrun.commands.export import ExportConfig
    from perfrun.commands.generate import GenerateConfig
    from perfrun.commands.hydra_app import schema_fields

    for name, schema in (("generate", GenerateConfig), ("export", ExportConfig)):
        assert cli_main([name, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())  # help lines are wrapped
        for key, _kind, f in schema_fields(schema):
            assert f" {key} {' '.join(f.metadata['help'].split())}" in text, key
    assert cli_main(["generate", "--help"]) == 0
    assert "re-filled from them at every further token" in " ".join(capsys.readouterr().out.split())


def test_cfg_job_shows_the_composed_configuration_with_a_literal_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    from omegaconf import OmegaConf

    prompt = "it's ${HOME}, a=b [x] \\"
    assert cli_main(["generate", "--cfg", "job", "checkpoint=some.pt", f"prompt={prompt}", "top_k=none",
                     "--no-cache"]) == 0
    cfg = OmegaConf.create(capsys.readouterr().out)
    assert cfg.prompt == prompt and cfg.top_k is None and cfg.cache is False and cfg.checkpoint == "some.pt"
