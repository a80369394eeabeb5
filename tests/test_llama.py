"""model=llama: the same logits as transformers' LlamaForCausalLM from a folder it wrote, Llama 3's
frequency scaling against transformers' own function, the presets' exact shapes, a KV cache of
n_kv_head heads that computes what the full forward computes, a tiny Llama trained with the
knobs (bf16, compile, checkpointing, chunked loss) and resumed exactly, generate and export on
its checkpoint, and one line for each bad input."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from perfrun.checkpoint import files as checkpoint
from perfrun.commands.dispatch import main as cli_main
from perfrun.config import ConfigError, config_dir
from perfrun.inference.generation import Generator, generate
from perfrun.inference.loading import load_model
from perfrun.inference.sampling import Sampler
from perfrun.loop.run import run
from perfrun.model_schema import ModelConfig, RopeScalingConfig
from perfrun.models.llama import Llama, LlamaConfig, rope_frequencies, swiglu_hidden
from perfrun.models.pretrained import check_llama_shape, init_from
from perfrun.validate import validate

from conftest import losses, make_cfg

pytestmark = pytest.mark.usefixtures("one_thread")

# 4 query heads share 2 key/value heads (head size 8): grouped-query attention at test size
LLAMA = ["model=llama-tiny", "model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.n_embd=32",
         "model.intermediate_size=64", "model.block_size=32", "optim.lr=3e-3"]
SCALING = RopeScalingConfig(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)


def hf_folder(folder: Path, *, tied: bool, kv: int = 2, layers: int = 2) -> Path:
    """A randomly initialised LlamaForCausalLM saved by transformers itself (safetensors)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=kv, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # transformers starts RMSNorm at one: random weights make the test see a mix-up
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def model_cfg(folder: Path | None, *, tied: bool, **changes: object) -> ModelConfig:
    m = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(Path(config_dir(), "model", "llama-tiny.yaml")), {
        "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 32, "intermediate_size": 64, "block_size": 64,
        "rope_theta": 500000.0, "rope_scaling": vars(SCALING), "tie_embeddings": tied,
        "init_from": None if folder is None else str(folder), **changes})
    return m  # type: ignore[return-value]


def tokens(n: int = 40) -> torch.Tensor:
    return torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(1))


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_transformers_llama_from_its_own_folder(tmp_path: Path, tied: bool) -> None:
    transformers = pytest.importorskip("transformers")
    folder = hf_folder(tmp_path / "hf", tied=tied)
    m = model_cfg(folder, tied=tied)
    ours = init_from(Llama(LlamaConfig.from_model(m, 256)), m, 256).eval()
    theirs = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    x = tokens()  # 40 positions: past original_max_position_embeddings, where the scaling matters
    with torch.no_grad():
        diff = (ours(x)[0] - theirs(x).logits).abs().max().item()
    assert diff < 1e-4
    assert (ours.lm_head.weight is ours.wte.weight) == tied


@pytest.mark.slow
def test_a_folder_in_transformers_4s_keys_loads_the_same(tmp_path: Path) -> None:
    """transformers before 5 kept theta as ``rope_theta`` and the scaling as ``rope_scaling``."""
    folder = hf_folder(tmp_path / "v5", tied=True)
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    old = tmp_path / "v4"
    old.mkdir()
    (old / "config.json").write_text(json.dumps(config))
    shutil.copy(folder / "model.safetensors", old / "model.safetensors")
    m = model_cfg(folder, tied=True)
    new_style = init_from(Llama(LlamaConfig.from_model(m, 256)), m, 256).eval()
    m.init_from = str(old)
    old_style = init_from(Llama(LlamaConfig.from_model(m, 256)), m, 256).eval()
    with torch.no_grad():
        assert torch.equal(new_style(tokens())[0], old_style(tokens())[0])
    config["rope_theta"] = 10000.0  # another theta is another model: refused, naming it
    (old / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="rope_theta 10000.0 \\(here 500000.0\\)"):
        init_from(Llama(LlamaConfig.from_model(m, 256)), m, 256)


def test_llama3_frequency_scaling_equals_transformers_function() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, rope_parameters=rope)  # Llama-3.2-1B
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_frequencies(64, 500000.0, RopeScalingConfig(32.0, 1.0, 4.0, 8192))
    plain = rope_frequencies(64, 500000.0, RopeScalingConfig())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert (got < plain).any() and (got == plain).any()  # low frequencies slowed, high ones kept


@pytest.mark.parametrize(("preset", "shape", "params"), [
    ("smollm2-135m", (30, 576, 9, 3, 1536, 100000.0, True, 1.0), 134_515_008),
    ("llama-3.2-1b", (16, 2048, 32, 8, 8192, 500000.0, True, 32.0), 1_235_814_400),
    ("llama-3-8b", (32, 4096, 32, 8, 14336, 500000.0, False, 1.0), 8_030_261_248),
])
def test_presets_have_the_published_shapes(preset: str, shape: tuple, params: int) -> None:
    """Each preset's shape, and with its tokenizer's vocabulary (49152, 128256) the parameter
    count its model card gives, counted on the meta device."""
    m = make_cfg(f"model={preset}", tiny=False).model
    validate(make_cfg(f"model={preset}", "data.seq_len=256", tiny=False))
    assert (m.n_layer, m.n_embd, m.n_head, m.n_kv_head, m.intermediate_size, m.rope_theta, m.tie_embeddings,
            m.rope_scaling.factor) == shape
    if preset == "llama-3.2-1b":
        assert (m.rope_scaling.low_freq_factor, m.rope_scaling.high_freq_factor,
                m.rope_scaling.original_max_position_embeddings) == (1.0, 4.0, 8192)
    with torch.device("meta"):
        model = Llama(LlamaConfig.from_model(m, 49152 if preset.startswith("smollm") else 128256))
    assert model.num_params(non_embedding=False) == params
    assert swiglu_hidden(4096, 1024, 1.3) == 14336  # Llama 3 8B's rule gives its intermediate_size


# the model cards' config.json (transformers 4's keys: rope_theta and rope_scaling at the top)
PUBLISHED = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rope_theta=100000, rope_scaling=None, rms_norm_eps=1e-05,
                         tie_word_embeddings=True, max_position_embeddings=8192, vocab_size=49152),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-05,
                         rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                         tie_word_embeddings=True, max_position_embeddings=131072, vocab_size=128256),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, rope_theta=500000.0, rope_scaling=None, rms_norm_eps=1e-05,
                       tie_word_embeddings=False, max_position_embeddings=8192, vocab_size=128256),
}


@functools.cache
def _preset_on_meta(name: str) -> tuple[ModelConfig, Llama]:
    """A preset's model section and its model on the meta device, built once for every case below."""
    m = make_cfg(f"model={name}", tiny=False).model
    with torch.device("meta"):
        return m, Llama(LlamaConfig.from_model(m, 128256))


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_each_published_config_fits_its_preset_and_names_it_otherwise(preset: str) -> None:
    config = {"model_type": "llama", "hidden_act": "silu", **PUBLISHED[preset]}
    for name in PUBLISHED:
        m, model = _preset_on_meta(name)
        if name == preset:
            check_llama_shape(config, model, m, "FOLDER")
        else:
            with pytest.raises(ConfigError, match=f"use model={preset} \\(or model.n_layer="):
                check_llama_shape(config, model, m, "FOLDER")


def test_kv_cache_keeps_n_kv_head_heads_and_matches_the_full_forward() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(block_size=24, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64,
                      rope_scaling=SCALING)
    model = Llama(cfg).eval()
    idx = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        full = model(idx)[0]
    cache = model.new_kv_cache(2, "cpu", torch.float32)
    assert cache.k[0].shape == (2, 2, 24, 8)  # n_kv_head heads, not n_head
    parts = [model.forward_cached(idx[:, :7], cache), model.forward_cached(idx[:, 7:12], cache)]
    parts += [model.forward_cached(idx[:, t: t + 1], cache) for t in range(12, 24)]
    assert (torch.cat(parts, dim=1) - full).abs().max().item() < 1e-5
    # the static decode step, each sequence at its own position
    cache = model.new_kv_cache(2, "cpu", torch.float32, capacity=20)
    model.forward_cached(idx[:, :9], cache)
    pos = torch.tensor([4, 9])
    for _ in range(8):
        got = model.decode_step(idx.gather(1, pos.unsqueeze(1)), pos, cache)
        for row in range(2):
            with torch.no_grad():
                want = model(idx[row: row + 1, : int(pos[row]) + 1])[0][0, -1]
            assert (got[row] - want).abs().max().item() < 1e-5
        pos += 1


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_flops_and_eager_attention(attention: str) -> None:
    """6N + 12*L*n_head*head_dim*T, and eager attention computes what SDPA computes."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64,
                              attention=attention, tie_embeddings=False)).eval()
    n = sum(p.numel() for p in model.parameters()) - model.wte.weight.numel()
    assert model.num_params() == n and model.flops_per_token(32) == 6 * n + 12 * 2 * 4 * 8 * 32
    reference = Llama(LlamaConfig(block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64,
                                  tie_embeddings=False)).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (model(tokens(32))[0] - reference(tokens(32))[0]).abs().max().item() < 1e-5


# --------------------------------------------------------------------------- training, resume, generate, export


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama trained 20 steps (Python source, bytes), checkpointed at steps 8, 16 and 20."""
    d = tmp_path_factory.mktemp("llama")
    run(make_cfg(*LLAMA, "max_steps=20", "log_every=1", "checkpoint.every_n_steps=8", "checkpoint.keep_last=5"), d)
    return d


def test_a_tiny_llama_trains_and_resumes_exactly(trained: Path, tmp_path: Path) -> None:
    full = losses(trained)
    assert full[20] < full[1] - 0.5, full  # it learns
    resumed = run(make_cfg(*LLAMA, "max_steps=20", "log_every=1", f"resume={trained / 'checkpoints' / 'step_0000016.pt'}"),
                  tmp_path)
    again = losses(tmp_path)
    assert resumed["start_step"] == 16 and sorted(again) == list(range(17, 21))
    assert [again[k] for k in range(17, 21)] == [full[k] for k in range(17, 21)]  # bit for bit


@pytest.mark.parametrize(("override", "named"), [("model.n_kv_head=4", "n_kv_head 2 vs 4"),
                                                   ("model.rope_theta=500000.0", "rope_theta 10000.0 vs 500000.0")])
def test_resume_with_another_llama_shape_or_rope_is_refused_naming_it(trained: Path, tmp_path: Path, override: str,
                                                                     named: str) -> None:
    """A Llama field that changes the weights (n_kv_head) or the numerics (rope_theta) is part of
    the shape a checkpoint records: resuming with another value is refused in one line."""
    from perfrun.config import ConfigError

    with pytest.raises(ConfigError, match="another model shape") as refused:
        run(make_cfg(*LLAMA, override, "max_steps=20", f"resume={trained / 'checkpoints' / 'step_0000008.pt'}"),
            tmp_path)
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_a_tiny_llama_trains_with_bf16_checkpointing_and_chunked_loss(trained: Path, tmp_path: Path) -> None:
    s = run(make_cfg(*LLAMA, "max_steps=5", "log_every=1", "precision=bf16", "checkpointing=full", "loss=chunked",
                     "loss.chunk_size=32"), tmp_path)
    assert s["knobs"]["autocast_dtype"] == "bfloat16" and s["knobs"]["loss"]["name"] == "chunked"
    assert s["knobs"]["checkpointing"] == "full" and s["knobs"]["checkpointed_blocks"] == 2
    got, fp32 = losses(tmp_path), losses(trained)  # steps 1-5 are the warm-up: the same learning rates
    assert all(abs(got[k] - fp32[k]) < 0.02 * fp32[k] for k in range(1, 6)), (got, fp32)


@pytest.mark.slow
def test_a_tiny_llama_compiles_per_block_and_trains_as_eager(trained: Path, tmp_path: Path) -> None:
    s = run(make_cfg(*LLAMA, "max_steps=2", "log_every=1", "timing_warmup_steps=1", "compile=true",
                     "compile_options.scope=blocks"), tmp_path)
    assert s["knobs"]["compile"] is True
    got, eager = losses(tmp_path), losses(trained)
    assert got[1] == pytest.approx(eager[1], rel=1e-4) and got[2] == pytest.approx(eager[2], rel=1e-4)


@pytest.fixture(scope="module")
def sharp(trained: Path) -> Llama:
    """The trained checkpoint's model with seeded random weights x6 in place of its own: 20 steps
    of training greedily repeat one byte (any two paths would agree); these pick each token by
    a wide margin, and another one as the context changes."""
    model = load_model(trained).model
    assert isinstance(model, Llama) and model.config.n_kv_head == 2
    torch.manual_seed(0)
    fresh = Llama(model.config)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(6)
    model.load_state_dict(fresh.state_dict())
    return model


PROMPT = list(b"def f(x):\n    return")


def test_generate_cached_and_uncached_give_the_same_tokens(sharp: Llama, trained: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    n = 40  # past block_size 32: the cached path re-fills its window
    runs = [generate(sharp, PROMPT, n, Sampler(0.0, None, 256, seed=0), cache=c) for c in (True, False)]
    assert runs[0].tokens == runs[1].tokens and len(set(runs[0].tokens)) > 3 and runs[0].cache_refills > 0
    sampled = [generate(sharp, PROMPT, n, Sampler(0.9, 5, 256, seed=3), cache=c).tokens for c in (True, False)]
    assert sampled[0] == sampled[1] != runs[0].tokens
    assert cli_main(["generate", f"checkpoint={trained}", "prompt=def ", "max_new_tokens=8"]) == 0  # streamed
    printed = capsys.readouterr()
    assert printed.out.startswith("def ") and "tokens/s" in printed.err


def test_compiled_batched_decode_keeps_n_kv_head_heads_and_the_same_tokens(sharp: Llama) -> None:
    alone = [generate(sharp, p, 12, Sampler(0.0, None, 256, 0)).tokens for p in (PROMPT, list(b"import "))]
    gen = Generator(sharp, Sampler(0.0, None, 256, 0), 12, longest_prompt=len(PROMPT), batch=2, compile=True)
    assert gen.kv is not None and gen.kv.k[0].shape == (2, 2, len(PROMPT) + 11, 8)  # n_kv_head=2 heads of 8
    batched = gen.run([PROMPT, list(b"import ")])
    assert batched.compiled and batched.sequences == alone


def test_export_loads_in_transformers_with_equal_logits_and_back(trained: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    ckpt = checkpoint.list_checkpoints(trained / "checkpoints")[-1]
    out = tmp_path / "hf"
    assert cli_main(["export", f"checkpoint={ckpt}", "format=safetensors", f"out={out}"]) == 0
    theirs = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    ours = load_model(ckpt).model
    x = tokens(32)
    with torch.no_grad():
        assert (theirs(x).logits - ours(x)[0]).abs().max().item() < 1e-4
    back = run(make_cfg(*LLAMA, f"model.init_from={out}", "max_steps=1", "log_every=1"), tmp_path / "from")
    assert back["config"]["model"]["init_from"] == str(out)


# --------------------------------------------------------------------------- bad input: one line, exit 2


def test_a_llama_folder_of_another_shape_names_the_overrides(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "hf", tied=True, kv=1, layers=3)
    m = model_cfg(folder, tied=True)
    with pytest.raises(ConfigError) as e:
        init_from(Llama(LlamaConfig.from_model(m, 256)), m, 256)
    said = str(e.value)
    assert "\n" not in said and "n_layer 3 (here 2)" in said and "n_kv_head 1 (here 2)" in said
    assert "model.n_layer=3" in said and "model.n_kv_head=1" in said and "model.rope_scaling.factor=32.0" in said
    gpt = model_cfg(folder, tied=True)
    gpt.family, gpt.init_from = "gpt", str(folder)
    from perfrun.models.gpt import GPT, GPTConfig
    with pytest.raises(ConfigError, match="model_type=llama checkpoint, which needs a Llama model group"):
        init_from(GPT(GPTConfig()), gpt, 256)


def test_n_head_not_divisible_by_n_kv_head_is_one_line_and_exit_2(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = cli_main(["train", *LLAMA, "model.n_kv_head=3", "device=cpu", f"hydra.run.dir={tmp_path}"])
    except SystemExit as e:  # Hydra's app exits through SystemExit
        code = e.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "model.n_head=4 is not divisible by model.n_kv_head=3" in err and "pick n_kv_head dividing n_head" in err
    assert not (tmp_path / "checkpoints").exists()


def test_old_rotary_buffers_are_skipped_and_a_foreign_tensor_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = hf_folder(tmp_path / "hf", tied=True)
    m = model_cfg(folder, tied=True)
    want = init_from(Llama(LlamaConfig.from_model(m, 256)), m, 256).state_dict()
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # as transformers < 4.31 saved it
    save_file(weights, folder / "model.safetensors")
    got = init_from(Llama(LlamaConfig.from_model(m, 256)), m, 256).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    weights["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ConfigError, match="hold model.layers.0.self_attn.q_proj.bias, which perfrun's Llama has no"):
        init_from(Llama(LlamaConfig.from_model(m, 256)), m, 256)


@pytest.mark.parametrize(("overrides", "says"), [
    (["model.bias=true"], "is a Llama, which has no biases; set model.bias=false"),
    (["model=tiny", "model.n_kv_head=1"], "model.n_kv_head applies to family=llama"),
    (["model=tiny", "model.rope_scaling.factor=8"], "model.rope_scaling applies to family=llama"),
    (["model=tiny", "model.tie_embeddings=false"], "model.tie_embeddings applies to family=llama"),
    (["model.family=mamba"], "model.family=mamba is not a model family"),
    (["model.rope_scaling.factor=0.5"], "needs factor >= 1"),
    (["model.n_embd=36"], "RoPE rotates pairs of dimensions"),
])
def test_bad_model_settings_are_refused_with_one_line(overrides: list[str], says: str) -> None:
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(*([] if "model=tiny" in overrides else LLAMA), *overrides))
    assert says in str(e.value) and "\n" not in str(e.value)
