"""model.init_from: a Hugging Face GPT-2 folder starts the run. Round trip: train, export
to safetensors, init_from the export, identical logits; transformers' own layout
(pytorch_model.bin, unprefixed names, mask buffers); each folder that does not fit is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from perfrun.commands.dispatch import main as cli_main
from perfrun.config import ConfigError, DataLoaderConfig, ModelConfig
from perfrun.data import build_datasets, build_loader
from perfrun.loop.run import run
from perfrun.models.gpt import GPT, GPTConfig
from perfrun.models.hf_layout import hf_config, hf_state_dict
from perfrun.models.pretrained import init_from

from conftest import losses, make_cfg

pytestmark = pytest.mark.usefixtures("one_thread")
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, block_size=32)  # conftest's TINY_MODEL


def tiny(vocab: int = 256, bias: bool = True, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, bias=bias, **SHAPE)).eval()


def model_cfg(folder: Path | str | None, bias: bool = True) -> ModelConfig:
    return ModelConfig(name="tiny", bias=bias, init_from=None if folder is None else str(folder), **SHAPE)


def logits(model: GPT) -> torch.Tensor:
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.eval()(x)[0]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[GPT, Path, Path]:
    """A tiny model trained 20 steps, its checkpoint, and its safetensors export."""
    d = tmp_path_factory.mktemp("trained")
    run(make_cfg("max_steps=20"), d / "run")
    ckpt = sorted((d / "run" / "checkpoints").glob("step_*.pt"))[-1]
    assert cli_main(["export", f"checkpoint={ckpt}", "format=safetensors", f"out={d / 'hf'}"]) == 0
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = tiny()
    model.load_state_dict(state["model"])
    return model, ckpt, d / "hf"


def test_export_then_init_from_gives_identical_logits(trained: tuple[GPT, Path, Path]) -> None:
    model, _, hf = trained
    fresh = tiny(seed=123)
    assert not torch.equal(logits(fresh), logits(model))
    loaded = init_from(fresh, model_cfg(hf), 256)
    assert loaded is fresh and torch.equal(logits(loaded), logits(model))
    assert init_from(tiny(seed=5), model_cfg(None), 256).state_dict()["wte.weight"].equal(tiny(seed=5).state_dict()["wte.weight"])


def test_training_starts_from_the_folder(trained: tuple[GPT, Path, Path], tmp_path: Path) -> None:
    """Step 1's loss is the exported model's loss on the first batch, and the run records
    where it started from."""
    model, _, hf = trained
    s = run(make_cfg(f"model.init_from={hf}", "max_steps=1", "log_every=1"), tmp_path / "from")
    cfg = make_cfg()
    data = build_datasets(cfg.data, 32, cfg.seed)
    x, y = next(iter(build_loader(data.train, DataLoaderConfig(batch_size=4), device_type="cpu", shuffle=True,
                                  seed=cfg.seed)))
    with torch.no_grad():
        want = model(x, y)[1].item()
    assert losses(tmp_path / "from")[1] == pytest.approx(want, rel=1e-6)
    scratch = run(make_cfg("max_steps=1", "log_every=1"), tmp_path / "scratch")
    assert losses(tmp_path / "scratch")[1] > want + 0.5  # far from a model that has learned
    assert s["config"]["model"]["init_from"] == str(hf) and scratch["config"]["model"]["init_from"] is None


def test_transformers_layout_in_pytorch_model_bin(trained: tuple[GPT, Path, Path], tmp_path: Path) -> None:
    """GPT-2 as transformers saves it: names without ``transformer.``, causal-mask buffers,
    lm_head written tied, in a pytorch_model.bin read with weights_only=True."""
    from safetensors.torch import load_file

    model, _, hf = trained
    weights = {k.removeprefix("transformer."): v for k, v in load_file(str(hf / "model.safetensors")).items()}
    for i in range(2):
        weights[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
        weights[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    weights["lm_head.weight"] = weights["wte.weight"].clone()
    (tmp_path / "gpt2").mkdir()
    torch.save(weights, tmp_path / "gpt2" / "pytorch_model.bin")
    (tmp_path / "gpt2" / "config.json").write_text((hf / "config.json").read_text())
    assert torch.equal(logits(init_from(tiny(seed=9), model_cfg(tmp_path / "gpt2"), 256)), logits(model))


def save_folder(folder: Path, model: GPT, vocab: int, *, rows: int | None = None, edit=None) -> Path:
    """``model`` as a transformers GPT-2 folder, its embedding cut to ``rows`` rows."""
    from safetensors.torch import save_file

    weights = hf_state_dict(model)
    if rows is not None:
        weights["transformer.wte.weight"] = weights["transformer.wte.weight"][:rows].contiguous()
    config = hf_config(model, vocab)
    config["vocab_size"] = rows or config["vocab_size"]
    if edit is not None:
        edit(weights, config)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_rows_the_checkpoint_lacks_start_as_the_mean(tmp_path: Path) -> None:
    """GPT-2 has 50257 rows, perfrun pads to 50304; here 300 rows into a model of 320."""
    source = tiny(vocab=320, seed=3)
    folder = save_folder(tmp_path / "hf", source, 300, rows=300)
    loaded = init_from(tiny(vocab=320, seed=4), model_cfg(folder), 300)
    wte, want = loaded.wte.weight.detach(), source.wte.weight.detach()
    assert torch.equal(wte[:300], want[:300])
    assert torch.allclose(wte[300:], want[:300].mean(0).expand(20, -1))
    assert loaded.lm_head.weight is loaded.wte.weight


def _untied(w, c):
    w["lm_head.weight"] = torch.randn_like(w["transformer.wte.weight"])


def _bias(w, c):
    w["transformer.h.0.mlp.c_fc.bias"] += 1.0


def _missing(w, c):
    del w["transformer.h.1.ln_1.weight"]


def _llama(w, c):
    c["model_type"] = "llama"


def _gelu(w, c):
    c["activation_function"] = "relu"


def _gpt2_shape(w, c):
    c.update(n_layer=12, n_head=12, n_embd=768, n_positions=1024)


BAD = {
    "missing folder": (None, "nope", ["does not exist"]),
    "no config.json": (None, "", ["is not a GPT-2 checkpoint folder: it has no config.json"]),
    "another architecture": (_llama, "hf", ["model_type=llama", "GPT-2 folders"]),
    "another activation": (_gelu, "hf", ["activation relu"]),
    "another shape": (_gpt2_shape, "hf", ["n_layer 12", "but model=tiny has n_layer 2", "use model=gpt2"]),
    "a tensor missing": (_missing, "hf", ["its weights have no tensor h.1.ln_1.weight"]),
    "lm_head not tied": (_untied, "hf", ["lm_head) is not tied"]),
    "biases into model.bias=false": (_bias, "hf", ["non-zero blocks.0.mlp.c_fc.bias", "set model.bias=true"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_folder_that_does_not_fit_is_one_line(case: str, tmp_path: Path) -> None:
    edit, sub, fragments = BAD[case]
    if sub == "hf":
        save_folder(tmp_path / "hf", tiny(bias=True), 256, edit=edit)
    target = tiny(bias=case != "biases into model.bias=false")
    before = target.state_dict()["wte.weight"].clone()
    with pytest.raises(ConfigError) as info:
        init_from(target, model_cfg(tmp_path / sub, bias=case != "biases into model.bias=false"), 256)
    msg = str(info.value)
    assert "\n" not in msg and f"model.init_from={tmp_path / sub}" in msg, msg
    assert all(f in msg for f in fragments), msg
    assert torch.equal(target.state_dict()["wte.weight"], before)  # refused before any weight changed


def test_zero_biases_load_into_a_model_without_bias(tmp_path: Path) -> None:
    source = tiny(bias=False, seed=7)
    folder = save_folder(tmp_path / "hf", source, 256)  # export writes zero biases for bias=false
    assert torch.equal(logits(init_from(tiny(bias=False, seed=8), model_cfg(folder, bias=False), 256)), logits(source))


def test_damaged_weights_and_another_vocabulary(tmp_path: Path) -> None:
    folder = save_folder(tmp_path / "hf", tiny(), 256)
    with pytest.raises(ConfigError, match="was trained on a vocabulary of 256 token ids but the data has 1000"):
        init_from(tiny(vocab=1024), model_cfg(folder), 1000)
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ConfigError, match="its weights cannot be read .* the file is damaged"):
        init_from(tiny(), model_cfg(folder), 256)
