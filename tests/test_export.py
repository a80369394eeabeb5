"""perfrun export: ONNX verified in onnxruntime, safetensors in GPT-2's Hugging Face layout,
atomic writes, one line for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from perfrun.commands.dispatch import main as cli_main
from perfrun.inference import onnx_export
from perfrun.inference.loading import load_model
from perfrun.models import hf_layout
from perfrun.models.gpt import GPT

ONNX_ATOL = onnx_export.DEFAULT_ATOL  # fp32 logits in both runtimes; only summation order differs


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(text_checkpoint: Path) -> Path:
    """12 steps on this repo's source, bias-free (conftest.py: shared with test_generate.py)."""
    return text_checkpoint


@pytest.mark.slow
def test_onnx_export_has_dynamic_axes_and_matches_pytorch(ckpt: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    out = tmp_path / "m.onnx"
    assert cli_main(["export", f"checkpoint={ckpt}", "format=onnx", f"out={out}"]) == 0
    assert "max abs diff" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no temporary left behind
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [type(d) for d in sess.get_inputs()[0].shape] == [str, str]  # batch and seq are symbolic
    model = load_model(ckpt).model
    x = torch.randint(0, 256, (4, 11))  # a shape the exporter never saw
    with torch.no_grad():
        ref = model(x)[0].numpy()
    got = sess.run(["logits"], {"idx": x.numpy()})[0]
    assert got.shape == ref.shape and abs(got - ref).max() <= ONNX_ATOL


@pytest.mark.slow
def test_onnx_mismatch_writes_nothing_and_exits_1(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    out = tmp_path / "m.onnx"
    out.write_bytes(b"the previous good export")
    monkeypatch.setattr(onnx_export, "verify_onnx", lambda *a, **k: onnx_export.OnnxCheck(0.5, ONNX_ATOL, [(1, 1)]))
    assert cli_main(["export", f"checkpoint={ckpt}", "format=onnx", f"out={out}"]) == 1
    assert "differ from PyTorch's by up to 0.5" in capsys.readouterr().err
    assert out.read_bytes() == b"the previous good export"
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]


def test_safetensors_round_trip_in_the_hugging_face_layout(ckpt: Path, tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    assert cli_main(["export", f"checkpoint={ckpt}", "format=safetensors", f"out={out}"]) == 0
    model = load_model(ckpt).model
    hf = load_file(str(out / "model.safetensors"))
    c = model.config
    assert "lm_head.weight" not in hf  # tied to wte, as transformers saves it
    assert torch.equal(hf["transformer.wte.weight"], model.wte.weight)
    for i, block in enumerate(model.blocks):
        h = f"transformer.h.{i}."
        # Conv1D stores (in, out): the transpose of nn.Linear's weight
        assert torch.equal(hf[h + "attn.c_attn.weight"], block.attn.c_attn.weight.t())
        assert hf[h + "attn.c_attn.weight"].shape == (c.n_embd, 3 * c.n_embd)
        assert torch.equal(hf[h + "mlp.c_fc.weight"], block.mlp.c_fc.weight.t())
        assert torch.equal(hf[h + "mlp.c_proj.weight"], block.mlp.c_proj.weight.t())
        assert torch.equal(hf[h + "ln_1.weight"], block.ln_1.weight)
        assert not hf[h + "attn.c_attn.bias"].any()  # model.bias=false -> zero biases
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["n_layer"], cfg["n_head"], cfg["n_embd"], cfg["n_positions"], cfg["vocab_size"]) == (
        c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size)
    assert cfg["activation_function"] == "gelu_new" and cfg["tie_word_embeddings"] is True
    # back into perfrun: the same logits
    back = GPT(model.config).eval()
    res = back.load_state_dict(hf_layout.perfrun_state_dict(hf, c.n_layer), strict=False)
    assert not res.missing_keys  # every perfrun weight came back (the zero biases are extra)
    assert back.lm_head.weight is back.wte.weight
    x = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        assert torch.allclose(back(x)[0], model(x)[0], atol=1e-6)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_transformers_loads_the_export(ckpt: Path, tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    assert cli_main(["export", f"checkpoint={ckpt}", "format=safetensors", f"out={out}"]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out)).eval()
    model = load_model(ckpt).model
    x = torch.randint(0, 256, (2, 13))
    with torch.no_grad():
        diff = (hf(x).logits - model(x)[0]).abs().max().item()
    assert diff < 1e-4


@pytest.mark.parametrize(("args", "says"), [
    (["format=pdf"], "format=pdf is not an option"),
    (["format=onnx", "colour=red"], "colour is not a key"),
    (["format=onnx", "atol=0"], "atol=0.0 must be > 0"),
    (["format=onnx", "out=FOLDER"], "is a folder"),
    (["format=safetensors", "out=FILE"], "is a file"),
    (["format=onnx", "opset=x"], "opset=x is not an integer"),
    (["format=int8-report", "int8.val_batches=0"], "int8.val_batches=0 must be >= 1"),
])
def test_bad_input_gets_one_line_and_exit_2(ckpt: Path, tmp_path: Path, args: list[str], says: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "FILE").write_text("x")
    argv = [a.replace("FOLDER", str(tmp_path)).replace("FILE", str(tmp_path / "FILE")) for a in args]
    assert cli_main(["export", f"checkpoint={ckpt}", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("perfrun: error:") and "\n" not in err and says in err


def test_missing_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["export", f"checkpoint={tmp_path / 'nope.pt'}", "format=onnx"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("perfrun: error:") and "no such file" in err and "\n" not in err


def test_int8_report_from_export_and_from_python_m_perfrun_quantize(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchao")
    from perfrun.commands import quantize

    assert quantize.main([f"checkpoint={ckpt}", "val_batches=1", "batch_size=2", "gen_tokens=4", "json=true"]) == 0
    old = json.loads(capsys.readouterr().out)
    assert cli_main(["export", f"checkpoint={ckpt}", "format=int8-report", "int8.val_batches=1", "int8.batch_size=2",
                     "int8.gen_tokens=4", "int8.json=true"]) == 0
    new = json.loads(capsys.readouterr().out)
    block = load_model(ckpt).model.config.block_size
    for report in (old, new):
        assert report["int8_bytes"] < report["float_bytes"] and report["gen_tokens"] == 4
        assert report["val_tokens"] == 2 * block and report["float_val_loss"] > 0
    assert (old["float_val_loss"], old["int8_val_loss"]) == (new["float_val_loss"], new["int8_val_loss"])


def test_int8_report_writes_its_json_to_out(ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torchao")
    out = tmp_path / "reports" / "int8.json"
    assert cli_main(["export", f"checkpoint={ckpt}", "format=int8-report", "int8.val_batches=1", "int8.batch_size=2",
                     "int8.gen_tokens=4", f"out={out}"]) == 0
    written = json.loads(out.read_text())
    assert written["gen_tokens"] == 4 and written["int8_bytes"] < written["float_bytes"]
    assert str(out) in capsys.readouterr().err
    assert cli_main(["export", f"checkpoint={ckpt}", "format=int8-report", f"out={tmp_path}"]) == 2  # a folder
    assert "is a folder" in capsys.readouterr().err
