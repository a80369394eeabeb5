"""``model=hf model.path=FOLDER``: folders written by transformers itself (random weights, tiny
shapes, nothing downloaded) of Llama, Qwen2 (tied embeddings), Mistral and GPT-2 train through
perfrun, load their safetensors (sharded too), take the knobs through their decoder layers,
head and attn_implementation, are measured (FLOPs formula against the counter, the estimate,
the ladder) and come out again (generate, export to a folder from_pretrained loads)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from perfrun.config import ConfigError

from conftest import make_cfg

transformers = pytest.importorskip("transformers")

VOCAB = 256
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": COMMON,
    "qwen2": {**COMMON, "tie_word_embeddings": True},
    "mistral": COMMON,
    "gpt2": {"vocab_size": VOCAB, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
             "bos_token_id": 0, "eos_token_id": 0},
}
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
        "gpt2": "GPT2LMHeadModel"}
RUN = ["model=hf", "data=synthetic", f"data.vocab_size={VOCAB}", "model.block_size=32", "max_steps=6",
       "dataloader.batch_size=4", "log_every=2", "eval_every=0", "optim.warmup_steps=2"]


def write_folder(out: Path, kind: str, **extra: Any) -> Path:
    """A random-init folder as transformers' save_pretrained writes it."""
    config = transformers.AutoConfig.for_model(kind, **{**FAMILIES[kind], **extra})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {kind: write_folder(root / kind, kind) for kind in FAMILIES}


def file_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def build(path: Path, *extra: str, attention: str = "sdpa") -> Any:
    from perfrun.models.build import build_model

    cfg = make_cfg(*RUN, f"model.path={path}", f"attention={attention}", *extra)
    return build_model(cfg.model, VOCAB, cfg.attention)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_each_family_trains_from_its_folder_with_its_formula(kind: str, folders: dict[str, Path], tmp_path: Path,
                                                              one_thread: None, caplog: pytest.LogCaptureFixture) -> None:
    from perfrun.loop.run import run

    caplog.set_level(logging.INFO, logger="perfrun")
    s = run(make_cfg(*RUN, f"model.path={folders[kind]}"), tmp_path)
    assert s["status"] == "completed", s.get("error")
    assert s["model_class"].endswith(ARCH[kind])
    reference = transformers.AutoModelForCausalLM.from_pretrained(folders[kind])
    assert s["params"] == sum(p.numel() for p in reference.parameters())
    # the formula from the config's shapes against torch's FLOP counter on the same model
    assert s["flops_per_token_source"] == "formula"
    assert abs(s["flops_per_token_counted"] - s["flops_per_token_formula"]) <= 0.01 * s["flops_per_token_formula"]
    assert {f["key"]: f["applies"] for f in s["knob_fits"]}["attention"]
    log = caplog.text
    assert f"model=hf: {ARCH[kind]}" in log and "weights from" in log and "model.safetensors" in log
    assert s["final_train_loss"] < 6.0  # ln 256 = 5.55 at chance: finite and near it


def test_the_folder_weights_are_loaded_sharded_or_not_and_random_on_request(folders: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    expected = file_weights(folders["llama"])
    loaded = build(folders["llama"]).lm.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(folders["llama"]).save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    from_shards = build(sharded).lm.state_dict()
    assert all(torch.equal(from_shards[k], v) for k, v in expected.items())
    random = build(folders["llama"], "model.init=random")
    assert random.weights is None
    assert not torch.equal(random.lm.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           expected["model.layers.0.self_attn.q_proj.weight"])


def test_the_wrapper_gives_transformers_logits_and_acts_on_its_layers(folders: dict[str, Path]) -> None:
    """Its forward gives the architecture's own logits; blocks are the decoder layers;
    attention=eager|sdpa reaches transformers' attention (torch's SDPA kernel or not)."""
    from torch.utils.flop_counter import FlopCounterMode

    idx = torch.randint(0, VOCAB, (2, 16))
    for kind in FAMILIES:
        model = build(folders[kind]).eval()  # GPT-2 has dropout in training
        reference = transformers.AutoModelForCausalLM.from_pretrained(folders[kind])
        assert torch.allclose(model(idx)[0], reference(input_ids=idx).logits, atol=1e-5)
        assert len(model.blocks) == 2 and model.blocks is model.lm.base_model.get_submodule(
            "layers" if kind != "gpt2" else "h")
        assert model.lm_head is model.lm.get_output_embeddings()
    ops = {}
    for attention in ("sdpa", "eager"):
        counter = FlopCounterMode(display=False)
        with counter:
            build(folders["qwen2"], attention=attention)(idx)
        ops[attention] = {str(op) for op in counter.get_flop_counts()["Global"]}
    # eager attention multiplies scores as batched matmuls; SDPA's fused kernel has no bmm
    assert "aten.bmm" in ops["eager"] and "aten.bmm" not in ops["sdpa"]


@pytest.mark.slow
def test_the_knobs_act_on_its_layers_and_head(folders: dict[str, Path], tmp_path: Path, one_thread: None) -> None:
    """checkpointing wraps its decoder layers, loss=chunked takes its head and final hidden
    states and trains as the standard loss does, eager attention trains too."""
    from perfrun.loop.run import run

    path = f"model.path={folders['mistral']}"
    base = run(make_cfg(*RUN, path), tmp_path / "base")
    chunked = run(make_cfg(*RUN, path, "loss=chunked", "loss.chunk_size=24", "checkpointing=full"), tmp_path / "kn")
    eager = run(make_cfg(*RUN, path, "attention=eager"), tmp_path / "eager")
    assert chunked["status"] == eager["status"] == "completed"
    assert chunked["knobs"]["checkpointed_blocks"] == 2 and chunked["knobs"]["loss"]["name"] == "chunked"
    for other in (chunked, eager):
        assert abs(other["final_train_loss"] - base["final_train_loss"]) < 1e-4


@pytest.mark.parametrize(("setup", "expected"), [
    ("remote", "auto_map names code in the folder"),
    ("pickled", "holds pickled weights (pytorch_model.bin)"),
    ("no_config", "has no config.json"),
    ("unknown", "cannot read config.json"),
    ("not_causal", "is not a causal LM"),
    ("missing", "does not exist"),
    ("pretrained", "model.init=pretrained asks for its weights"),
    ("vocab", "has a vocabulary of 128"),
])
def test_a_folder_perfrun_cannot_take_is_refused_in_one_line(setup: str, expected: str, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    extra: list[str] = []
    marker = tmp_path / "ran"
    if setup in ("remote", "pickled", "pretrained", "vocab"):
        write_folder(folder, "llama", **({"vocab_size": 128} if setup == "vocab" else {}))
    if setup == "remote":  # code that would leave a marker file if anything imported it
        config = json.loads((folder / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Evil"}
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    elif setup == "pickled":
        torch.save(file_weights(folder), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
    elif setup == "pretrained":
        (folder / "model.safetensors").unlink()
        extra.append("model.init=pretrained")
    elif setup == "unknown":
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    elif setup == "not_causal":
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "vit"}))
    elif setup == "no_config":
        folder.mkdir()
    with pytest.raises(ConfigError) as e:
        build(folder, *extra)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


def test_model_hf_without_a_path_is_refused_by_the_schema() -> None:
    from perfrun.validate import validate

    with pytest.raises(ConfigError, match="model=hf needs model.path"):
        validate(make_cfg(*RUN))
    with pytest.raises(ConfigError, match="apply to model=hf"):
        validate(make_cfg("model.path=/x"))


@pytest.mark.slow
def test_its_checkpoint_generates_with_the_folder_tokenizer_and_exports_for_from_pretrained(
        tmp_path: Path, one_thread: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Out again: perfrun generate samples with the folder's tokenizer.json; perfrun export
    format=safetensors writes a folder transformers loads with the trained model's logits."""
    from perfrun.commands import export, generate
    from perfrun.data.tokenizers import train_bpe
    from perfrun.inference.loading import load_model
    from perfrun.loop.run import run

    folder = write_folder(tmp_path / "qwen", "qwen2", vocab_size=320)
    train_bpe(["def f(x):\n    return x + 1\n" * 20, "hello world, hello perfrun"], 300, folder / "tokenizer.json")
    s = run(make_cfg(*RUN, f"model.path={folder}", "data.vocab_size=320"), tmp_path / "run")
    assert s["status"] == "completed"
    code = generate.run(generate.GenerateConfig(checkpoint=str(tmp_path / "run"), prompt="hello", max_new_tokens=4,
                                                device="cpu", temperature=0.0))
    out = capsys.readouterr()
    assert code == 0 and out.out.startswith("hello") and "no KV cache for Qwen2ForCausalLM" in out.err
    assert generate.run(generate.GenerateConfig(checkpoint=str(tmp_path / "run"), prompt="hi", compile=True,
                                                device="cpu")) == 2
    assert export.run(export.ExportConfig(checkpoint=str(tmp_path / "run"), format="safetensors",
                                          out=str(tmp_path / "out"))) == 0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    trained = load_model(tmp_path / "run").model
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    idx = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        assert torch.equal(trained(idx)[0], reloaded(input_ids=idx).logits)
    assert not torch.equal(trained.lm.state_dict()["model.layers.0.mlp.up_proj.weight"],
                           file_weights(folder)["model.layers.0.mlp.up_proj.weight"])  # trained, not the folder's


@pytest.mark.slow
def test_estimated_and_laddered_like_perfrun_own(folders: dict[str, Path], tmp_path: Path, one_thread: None) -> None:
    """perfrun estimate breaks its memory down by decoder layer; the ladder's rungs act on it
    (none skipped for the model) and the report's header names the architecture."""
    from perfrun.ladder.analysis import read_sweep
    from perfrun.ladder.rungs import run_rung
    from perfrun.memory.estimate import estimate
    from perfrun.report.render import header

    path = f"model.path={folders['qwen2']}"
    e = estimate(make_cfg(*RUN, path), VOCAB, top=10)
    assert e.peak_bytes > 0 and any(m.name == "lm.model.layers.0" for m in e.breakdown.modules)
    rungs = ["naive", "sdpa", "chunked_loss", "checkpointing_full"]
    for n, rung in enumerate(rungs):
        overrides = [f"+ablation={rung}", "repeat=0", "max_steps=4", "compile=false"]
        run_rung(make_cfg(*RUN, path, *overrides), tmp_path / str(n), overrides=overrides)
    s = [json.loads((tmp_path / str(n) / "summary.json").read_text()) for n in range(len(rungs))]
    assert [x["status"] for x in s] == ["completed"] * 4, [x.get("reason") for x in s]
    assert s[2]["knobs"]["loss"]["name"] == "chunked" and s[3]["knobs"]["checkpointed_blocks"] == 2
    line = next(x for x in header(read_sweep([tmp_path])) if x.startswith("model: "))
    assert "Qwen2ForCausalLM from" in line and "M parameters" in line and "FLOPs per token (formula)" in line


@pytest.mark.slow
def test_a_transformers_module_wrapped_as_model_custom_trains_with_the_memory_estimate(tmp_path: Path,
                                                                                    one_thread: None) -> None:
    """model=custom with a user's wrapper that builds Qwen2ForCausalLM (tied embeddings) and
    calls ``.to(dtype)`` in its __init__: the memory estimate builds it too, and a module made
    under fake tensors cannot be moved (torch swaps a fake parameter, and refuses one the fake
    mode holds a weak reference to). The estimate is made, with the tied weight once, and the
    run trains."""
    from perfrun.loop.run import run

    target = f"{Path(__file__).parent / 'fixtures' / 'hf_wrapper.py'}:QwenWrapper"
    s = run(make_cfg("model=custom", f"model.target={target}", "data=synthetic", f"data.vocab_size={VOCAB}",
                     "model.block_size=32", "max_steps=4", "dataloader.batch_size=2", "memory.estimate=true"), tmp_path)
    assert s["status"] == "completed", s.get("reason")
    assert s["model_class"].endswith("QwenWrapper") and s["flops_per_token_source"] == "counted"
    assert s["flops_per_token_counted"] > 0 and s["final_train_loss"] < 6.0
    estimate = s["memory_estimate"]
    assert "error" not in estimate, estimate
    assert estimate["categories_bytes"]["Parameter"] == 4 * s["params"]  # float32, the tied weight once


def test_model_llama_takes_the_folder_shape_a_preset_refuses_it(tmp_path: Path, one_thread: None,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """model=llama model.init_from=FOLDER trains the folder's shape (logged, recorded, its
    weights loaded); a preset of another shape refuses the folder, naming model=llama."""
    from perfrun.loop.run import run

    caplog.set_level(logging.INFO, logger="perfrun")
    folder = write_folder(tmp_path / "llama", "llama", hidden_size=64, intermediate_size=96, num_attention_heads=8,
                          num_key_value_heads=4, rms_norm_eps=1e-5)
    common = ["data=synthetic", f"data.vocab_size={VOCAB}", "model.block_size=32", "max_steps=2",
              "dataloader.batch_size=2", "eval_every=0", f"model.init_from={folder}"]
    s = run(make_cfg("model=llama", *common), tmp_path / "run")
    assert s["status"] == "completed", s.get("reason")
    m = s["config"]["model"]
    assert (m["n_layer"], m["n_embd"], m["n_head"], m["n_kv_head"], m["intermediate_size"]) == (2, 64, 8, 4, 96)
    assert not m["tie_embeddings"] and f"model=llama: the shape of {folder / 'config.json'}: n_layer 2" in caplog.text
    assert s["params"] == sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(folder).parameters())
    with pytest.raises(ConfigError) as e:
        run(make_cfg("model=llama-tiny", *common), tmp_path / "preset")
    assert "is a Llama of another shape than model=llama-tiny" in str(e.value)
    assert str(e.value).endswith("or model=llama, which takes the folder's shape from its config.json")


def test_without_transformers_one_line_names_the_extra(folders: dict[str, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's own way to make a package unimportable (None in sys.modules): the line names
    the install command; transformers itself is not touched."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ConfigError) as e:
        build(folders["llama"])
    assert str(e.value) == ('model=hf needs the transformers package, which is not installed; '
                            'pip install -e ".[hf]"')


@pytest.mark.slow  # a real process
def test_a_refused_folder_is_one_line_exit_2_and_no_run(tmp_path: Path) -> None:
    """As a user types it: a folder whose config.json asks for code of its own."""
    from conftest import run_cli

    folder = tmp_path / "remote"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": {"AutoConfig": "x.Y"}}))
    p = run_cli("train", "model=hf", f"model.path={folder}", "data=synthetic", "data.vocab_size=256",
                "model.block_size=32", "max_steps=1", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = [x for x in p.stderr.splitlines() if "auto_map" in x]
    assert len(lines) == 1 and "trust_remote_code" in lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_perfrun_tune_tunes_it(folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               one_thread: None) -> None:
    from perfrun.commands import tune

    out = tmp_path / "tune"
    rc = tune.main(["device=cpu", "--quick", "--batch-sizes", "2,4", "--steps", "3", "--warmup", "1", "--out", str(out),
                    "model=hf", f"model.path={folders['qwen2']}", "data=synthetic", f"data.vocab_size={VOCAB}",
                    "model.block_size=32"])
    text = capsys.readouterr().out
    assert rc == 0, text
    saved = json.loads((out / "tune_summary.json").read_text())
    assert [t["status"] for t in saved["trials"]] == ["completed", "completed"]
    assert "model=hf" in saved["command"] and f"model.path={folders['qwen2']}" in saved["command"]


def test_fp8_converts_its_projections_and_keeps_its_head(folders: dict[str, Path]) -> None:
    """precision=fp8's conversion (emulated: torchao's float8 matmuls in fp32 on the CPU)
    takes the decoder layers' projections and keeps the head the loss reads as a matrix."""
    pytest.importorskip("torchao")
    from perfrun.knobs.fp8 import convert

    model = build(folders["llama"])
    layers = convert(model, "tensorwise", tokens=2 * 16, emulate=True)
    assert "lm.model.layers.0.self_attn.q_proj" in layers.convert and "lm.model.layers.1.mlp.down_proj" in layers.convert
    assert "the output head" in layers.kept["lm.lm_head"]
    _, loss = model(torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16)))
    loss.backward()
    assert type(model.lm.model.layers[0].self_attn.q_proj).__name__ == "Float8Linear"
    assert model.lm.model.layers[0].self_attn.q_proj.weight.grad is not None


@pytest.mark.slow
def test_per_block_compile_compiles_its_decoder_layers(folders: dict[str, Path], tmp_path: Path,
                                                       one_thread: None) -> None:
    from perfrun.loop.run import run

    s = run(make_cfg(*RUN, f"model.path={folders['llama']}", "compile=true", "compile_options.scope=blocks",
                     "max_steps=3"), tmp_path)
    assert s["status"] == "completed", s.get("reason")
    assert s["knobs"]["compile_options"]["scope"] == "blocks" and s["final_train_loss"] < 6.0


def test_fsdp2_shards_its_decoder_layers(folders: dict[str, Path]) -> None:
    """distributed=fsdp in a world of one over gloo: FSDP2 wraps each decoder layer and the
    root, the weights become DTensors, and a forward and backward run through them."""
    from contextlib import ExitStack

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from perfrun import distributed
    from perfrun.knobs import apply_knobs

    cfg = make_cfg(*RUN, f"model.path={folders['qwen2']}", "distributed=fsdp", "device=cpu")
    with ExitStack() as stack:
        device = distributed.setup_device("cpu", "fsdp", stack)
        model = build(folders["qwen2"])
        plan = apply_knobs(cfg, device, model, stack)
        assert all(isinstance(layer, FSDPModule) for layer in model.lm.model.layers) and isinstance(model, FSDPModule)
        assert plan.notes["fsdp"]["shard_groups"] == 3
        assert isinstance(model.lm.model.layers[0].self_attn.q_proj.weight, DTensor)
        idx = torch.randint(0, VOCAB, (2, 17))
        _, loss = plan.model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        assert model.lm.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_a_mixture_of_experts_has_no_formula_and_says_so(tmp_path: Path) -> None:
    """Mixtral's tokens run only their routed experts: 6 x parameters would overcount, so
    there is no formula and the figure is the counter's (or none, with why)."""
    from perfrun.models.flops import flops_figure

    folder = tmp_path / "mixtral"
    config = transformers.AutoConfig.for_model("mixtral", **COMMON, num_local_experts=4, num_experts_per_tok=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    model = build(folder)
    assert model.flops_per_token(16) is None and model.config.experts
    figure = flops_figure(model, (torch.randint(0, VOCAB, (16,)), torch.randint(0, VOCAB, (16,))), 16)
    assert figure.formula is None and figure.source in ("counted", "none")
    assert "the model has no formula" in figure.describe()
