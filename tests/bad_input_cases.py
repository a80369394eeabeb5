"""The bad inputs perfrun must answer with one clear line; shared by the test that checks
each of them and by scripts/bad_inputs_table.py, which writes docs/bad-inputs.md from
what perfrun actually prints."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# A small, fast model for every case that gets as far as building one; its job leaves the
# test process's heap as it finds it (see TINY in tests/conftest.py).
SMALL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
         "dataloader.batch_size=2", "max_steps=2", "eval_batches=1", "monitor.every_n_steps=0", "device=cpu",
         "runtime.gc=default"]


@dataclass(frozen=True)
class Case:
    what: str  # the mistake, in words
    args: tuple[str, ...]  # perfrun's command line ({d} is the fixtures folder)
    says: str  # a phrase the one-line answer must contain
    small: bool = True  # append SMALL (so a case that wrongly ran would still end fast)


CASES = [
    Case("unknown option of a group", ("train", "precision=bf17"), "precision=bf17 is not an option"),
    Case("unknown model preset", ("train", "model=gpt3"), "model=gpt3 is not an option"),
    Case("wrong type", ("train", "max_steps=abc"), "could not be converted to Integer"),
    Case("batch size neither a number nor auto", ("train", "dataloader.batch_size=abc"), "neither a whole number nor auto"),
    Case("unknown key", ("train", "dataloader.bogus=1"), "dataloader.bogus is not a key"),
    Case("key added with +", ("train", "+foo=1"), "foo: not a key perfrun knows"),
    Case("key added with + in a group", ("train", "+model.rope_scaling.foo=1"), "model.rope_scaling.foo: not a key perfrun knows"),
    Case("data=text without a path", ("train", "data=text"), "data=text needs a file or folder"),
    Case("missing data path", ("train", "data=text", "data.path={d}/nope.txt"), "does not exist"),
    Case("empty data file", ("train", "data=text", "data.path={d}/empty.txt"), "is empty"),
    Case("file shorter than one sequence", ("train", "data=text", "data.path={d}/short.txt"), "needs 33"),
    Case(".bin of odd size", ("train", "data=memmap", "data.path={d}/odd.bin"), "odd number"),
    Case("wrong llm.c magic", ("train", "data=memmap", "data.path={d}/badmagic.bin"), "magic"),
    Case("checkpoint of another model", ("train", "resume={d}/other_model.pt"), "another model shape"),
    Case("truncated checkpoint", ("train", "resume={d}/truncated.pt"), "not a readable perfrun checkpoint"),
    Case("non-checkpoint file as checkpoint", ("train", "resume={d}/notes.txt"), "not a readable perfrun checkpoint"),
    Case("checkpoint that does not exist", ("train", "resume={d}/missing.pt"), "no such checkpoint file"),
    Case("unwritable output dir", ("train", "hydra.run.dir={d}/notes.txt/run"), "cannot be created"),
    Case("device that does not exist", ("train", "device=cuda:3"), "device=cuda:3"),
    Case("device of an unknown kind", ("train", "device=tpu"), "device=tpu"),
    Case("prefetch_factor with num_workers=0", ("train", "dataloader.prefetch_factor=2"), "dataloader.num_workers=0"),
    Case("persistent_workers with num_workers=0", ("train", "dataloader.persistent_workers=true"), "persistent_workers"),
    Case("zero steps", ("train", "max_steps=0"), "max_steps=0 must be >= 1"),
    Case("negative steps", ("train", "max_steps=-5"), "max_steps=-5 must be >= 1"),
    Case("learning rate NaN", ("train", "optim.lr=nan"), "optim.lr=nan must be a finite number"),
    Case("sequence beyond the model's", ("train", "data.seq_len=4096"), "longer than model.block_size"),
    Case("batch size 0", ("train", "dataloader.batch_size=0"), "dataloader.batch_size=0 must be >= 1"),
    Case("accumulation steps 0", ("train", "accumulation.steps=0"), "accumulation.steps=0 must be >= 1"),
    Case("heads that don't divide the width", ("train", "model.n_embd=30", "model.n_head=4"), "not divisible"),
    Case("TF32 on the CPU", ("train", "precision.tf32=true"), "precision.tf32=true needs a CUDA device"),
    Case("flash attention on the CPU", ("train", "sdpa_backend=flash"), "runs only on CUDA"),
    Case("validation fraction out of range", ("train", "data.val_fraction=1.5"), "data.val_fraction=1.5"),
    Case("MFU peak that is not a number", ("train", "mfu.peak=fast"), "mfu.peak=fast"),
    Case("memory snapshot on the CPU", ("train", "memory_snapshot=true"), "memory_snapshot=true records the CUDA allocator"),
    Case("profiler window beyond max_steps", ("train", "profile=true"), "raise max_steps"),
    Case("sweep syntax without -m", ("train", "precision=bf16,fp16"), "Ambiguous value"),
    Case("a ladder of no repeats", ("train", "-m", "+sweep=ablation", "ablation.repeats=0"),
         "ablation.repeats=0 is outside 1 to 100", small=False),
    Case("several processes, no distributed mode", ("train", "nproc=2"), "nproc=2 needs distributed=ddp or fsdp"),
    Case("unknown distributed mode", ("train", "distributed=zero3"), "distributed=zero3 is not an option"),
    Case("unknown compile scope", ("train", "compile_options.scope=layers"), "compile_options.scope=layers is not an option"),
    Case("FSDP prefetch without FSDP", ("train", "model.n_layer=2", "fsdp.forward_prefetch=1"), "add distributed=fsdp"),
    Case("negative FSDP prefetch", ("train", "distributed=fsdp", "fsdp.backward_prefetch=-1"),
         "fsdp.backward_prefetch=-1 must be >= 0"),
    Case("FSDP prefetch beyond the last block", ("train", "distributed=fsdp", "fsdp.forward_prefetch=1"),
         "reaches past the model's 1 block(s)"),
    Case("resharding the last block alone", ("train", "distributed=fsdp", "fsdp.reshard_last_block=true",
                                             "fsdp.reshard_after_forward=false"), "drop one of the two"),
    Case("chunked loss with chunks of no tokens", ("train", "loss=chunked", "loss.chunk_size=0"),
         "loss.chunk_size=0 must be >= 1"),
    Case("FP8 training on the CPU", ("train", "precision=fp8"), "precision=fp8 needs a CUDA GPU with FP8 tensor cores"),
    Case("optimizer step in the backward with a global-norm clip", ("train", "optim.in_backward=true"),
         "set optim.grad_clip=0"),
    Case("optimizer step in the backward with accumulation",
         ("train", "optim.in_backward=true", "optim.grad_clip=0", "accumulation.steps=2"), "set accumulation.steps=1"),
    Case("optimizer step in the backward under fp16",
         ("train", "optim.in_backward=true", "optim.grad_clip=0", "precision=fp16"), "use precision=bf16"),
    Case("offloading on the CPU", ("train", "offload=activations"), "nothing to offload to"),
    Case("unknown offload", ("train", "offload=disk"), "offload=disk is not an option"),
    Case("8-bit AdamW with the fused kernel", ("train", "optim=adamw8bit", "optim.fused='true'"),
         "optim=adamw8bit has no fused kernel"),
    Case("unknown FP8 recipe", ("train", "precision=fp8", "precision.recipe=blockwise"),
         "precision.recipe=blockwise is not an option"),
    Case("token id beyond the vocabulary, at the end of the file", ("train", "data=memmap", "data.path={d}/high_id.bin",
                                                                     "data.vocab_size=256"), "holds token id 999"),
    Case("tokenizer file that does not parse (data=text)", ("train", "data=text", "data.path={d}/corpus.txt",
                                                            "data.tokenizer={d}/bad_tokenizer.json"), "does not parse"),
    Case("init_from a folder that is not a GPT-2 checkpoint", ("train", "model.init_from={d}"), "has no config.json"),
    Case("init_from a GPT-2 of another shape", ("train", "model.init_from={d}/gpt2_config"), "use model=gpt2"),
    Case("Llama query heads that key/value heads do not divide", ("train", "model=llama-tiny", "model.n_kv_head=3"),
         "is not divisible by model.n_kv_head=3"),
    Case("a Llama setting on a GPT", ("train", "model.n_kv_head=1"), "model.n_kv_head applies to family=llama"),
    Case("init_from a Llama of another shape", ("train", "model=llama-tiny", "model.init_from={d}/llama_config"),
         "use model=smollm2-135m"),
    Case("init_from a Llama folder with a GPT model", ("train", "model.init_from={d}/llama_config"),
         "which needs a Llama model group"),
    Case("prepare: corpus that does not exist", ("prepare", "path={d}/missing.txt", "out={d}/tokens"), "does not exist",
         small=False),
    Case("prepare: empty corpus", ("prepare", "path={d}/empty.txt", "out={d}/tokens"), "is empty", small=False),
    Case("prepare: tokenizer file that does not parse", ("prepare", "path={d}/corpus.txt", "out={d}/tokens",
                                                          "tokenizer={d}/bad_tokenizer.json"), "does not parse", small=False),
    Case("prepare: unknown tokenizer", ("prepare", "path={d}/corpus.txt", "out={d}/tokens", "tokenizer=gpt3"),
         "tokenizer=gpt3 is not a tokenizer perfrun knows", small=False),
    Case("prepare: .jsonl line without the text", ("prepare", "path={d}/docs.jsonl", "out={d}/tokens"),
         "line 2 of", small=False),
    Case("prepare: output folder holding other files", ("prepare", "path={d}/corpus.txt", "out={d}/gpt2_config"),
         "holds files that perfrun prepare did not write", small=False),
    Case("prepare: unknown key", ("prepare", "path={d}/corpus.txt", "out={d}/tokens", "worker=2"),
         "worker is not a key", small=False),
    Case("prepare: a value of the wrong type", ("prepare", "path={d}/corpus.txt", "out={d}/tokens", "workers=two"),
         "workers=two is not an integer; write e.g. workers=0", small=False),
    Case("unknown experiment logger", ("train", "logger=neptune"), "logger=neptune is not an option"),
    Case("unknown W&B mode", ("train", "logger=wandb", "logger.mode=sometimes"), "logger.mode=sometimes is not an option"),
    Case("logger folder under a file", ("train", "logger=tensorboard", "logger.dir={d}/notes.txt/tb"),
         "logger=tensorboard could not start"),
    Case("unknown command", ("trian",), "unknown command 'trian'", small=False),
    Case("seed too large for training's random number generators", ("train", "seed=4294967296"),
         "seed=4294967296 is outside what the random number generators take"),
    Case("negative seed", ("train", "seed=-1"), "seed=-1 is outside what the random number generators take"),
    Case("resume: a weight of the wrong shape", ("train", "resume={d}/wrong_tensor.pt"),
         "its model weights cannot be loaded"),
    Case("resume: blocks missing from the weights", ("train", "resume={d}/missing_blocks.pt"),
         "its model weights cannot be loaded"),
    Case("resume: no optimizer state", ("train", "resume={d}/no_optimizer.pt"), "its optimizer state cannot be loaded"),
    Case("resume: a broken learning-rate schedule", ("train", "resume={d}/bad_scheduler.pt"),
         "its learning-rate schedule cannot be loaded"),
    Case("resume: a schedule that is not a state at all", ("train", "resume={d}/scheduler_not_a_dict.pt"),
         "its learning-rate schedule cannot be loaded"),
    Case("resume: broken random generator state", ("train", "resume={d}/bad_rng.pt"),
         "its random generators cannot be loaded"),
    Case("resume: a negative step", ("train", "resume={d}/negative_step.pt"), "impossible position (step=-5"),
    Case("resume: a data position that is not a number", ("train", "resume={d}/bad_position.pt"),
         "impossible position (data.consumed='x'"),
    Case("resume=auto: a run already at max_steps in that run dir", ("train", "resume=auto", "hydra.run.dir={d}/small"),
         "already at max_steps=2"),
    Case("seed too large for the random number generator",
         ("generate", "checkpoint={d}/other_model.pt", "seed=18446744073709551616"),
         "is outside what the random number generator takes", small=False),
    Case("prompt file that is not UTF-8", ("generate", "checkpoint={d}/other_model.pt", "prompts_file={d}/latin1.txt"),
         "line 1 is not valid UTF-8", small=False),
    Case("max_new_tokens beyond its bound", ("generate", "checkpoint={d}/other_model.pt", "max_new_tokens=1000000000"),
         "at most 100000", small=False),
    Case("generate from weights that are not finite", ("generate", "checkpoint={d}/nan_weights.pt"),
         "its weights are not finite", small=False),
    Case("export of weights that are not finite",
         ("export", "checkpoint={d}/nan_weights.pt", "format=safetensors", "out={d}/hf"),
         "its weights are not finite", small=False),
    Case("report whose only input is unreadable", ("report", "{d}/unreadable_run"), "nothing to report", small=False),
    Case("a plain-pickle checkpoint", ("train", "resume={d}/plain_pickle.pt"), "holds pickled code"),
    Case("a pretrained pytorch_model.bin that is a plain pickle", ("train", "model.init_from={d}/pickle_bin"),
         "holds pickled code"),
    Case("a ladder rung that does not exist", ("train", "-m", "+sweep=ablation", "+ablation=nope"),
         "+ablation=nope: no such rung", small=False),
    Case("a ladder key of the wrong type", ("train", "-m", "+sweep=ablation", "ablation.repeats=many"),
         "ablation.repeats=many", small=False),
    Case("the ladder without -m", ("train", "+sweep=ablation"), "add -m"),
    Case("a pretrained config.json field of the wrong type", ("train", "model.init_from={d}/gpt2_badtype"),
         "gpt2_badtype/config.json: field n_layer"),
    Case("absurd gradient accumulation", ("train", "accumulation.steps=1000000000"), "more than 1024 micro-batches"),
    Case("a run dir the override grammar refuses", ("train", "hydra.run.dir={d}/run'1"),
         "the override grammar cannot read this value"),
    Case("estimate: its output file read-only", ("estimate", "estimate.out={d}/read_only.json"),
         "is read-only, so perfrun does not replace it"),
    Case("estimate: its output file a folder", ("estimate", "estimate.out={d}/gpt2_config"), "is a folder"),
    Case("estimate: its output file under a missing folder", ("estimate", "estimate.out={d}/nope/estimate.json"),
         "/nope does not exist; create it"),
    Case("estimate: a negative number of modules", ("estimate", "estimate.top=-1"), "estimate.top=-1 must be >= 0"),
    Case("estimate: FSDP over no processes", ("estimate", "distributed=fsdp", "nproc=0"), "nproc=0 must be >= 1"),
    Case("a custom model with no parameters", ("train", "model=custom", "model.target={d}/user_code.py:NoParameters"),
         "has no parameters to train"),
    Case("a custom model that calls sys.exit in __init__", ("train", "model=custom", "model.target={d}/user_code.py:Exits"),
         "its __init__ called sys.exit(3)"),
    Case("a custom model whose module parses the command line at import",
         ("train", "model=custom", "model.target={d}/parses_argv.py:Model"),
         "parses_argv.py called sys.exit(2) after printing"),
    Case("a custom dataset of no items", ("train", "data=custom", "data.target={d}/user_code.py:NoItems"),
         "its __len__ returned 0"),
    Case("a custom dataset of negative length", ("train", "data=custom", "data.target={d}/user_code.py:NegativeLength"),
         "its __len__ returned -1"),
    Case("a custom dataset that is iterable, not map-style", ("train", "data=custom", "data.target={d}/user_code.py:Stream"),
         "has no __len__ (an iterable dataset?)"),
    Case("a custom dataset of float inputs for a GPT", ("train", "data=custom", "data.target={d}/user_code.py:FloatIds"),
         "train item 0's input is a torch.float32 tensor, not token ids"),
    Case("a custom dataset with ids beyond its vocabulary", ("train", "data=custom", "data.target={d}/user_code.py:HighIds"),
         "holds token id 100 but the vocabulary is 64"),
    Case("a custom model of a smaller vocabulary than data=synthetic's",
         ("train", "model=custom", "model.target={d}/user_code.py:SmallVocab", "data=synthetic"),
         "takes token ids below 16 (its vocab_size) but data=synthetic has a vocabulary of 50257; set data.vocab_size=16"),
    *[Case(f"a Llama's {key} not finite", ("train", "model=llama-tiny", f"model.{key}={value}"),
           f"model.{key}={value} must be a finite number")
      for key, value in (("rope_theta", "nan"), ("norm_eps", "inf"), ("rope_scaling.factor", "nan"),
                         ("ffn_dim_multiplier", "inf"))],
    Case("init_from a folder of NaN weights", ("train", "model.init_from={d}/nan_init"),
         "nan_init: its weight blocks.0.attn.c_attn.weight holds 1 NaN or infinite values"),
    Case("init_from a Llama config.json field of the wrong type", ("train", "model=llama-tiny",
                                                                   "model.init_from={d}/llama_badtype"),
         'llama_badtype/config.json: field num_hidden_layers is "thirty", not a whole number'),
    Case("init_from a Llama config.json without a field of the shape", ("train", "model=llama-tiny",
                                                                        "model.init_from={d}/llama_missing"),
         "llama_missing/config.json: field hidden_size is missing"),
    Case("init_from a GPT-2 config.json without a field of the shape", ("train", "model.init_from={d}/gpt2_missing"),
         "gpt2_missing/config.json: field n_layer is missing"),
    Case("report of a summary.json of another shape", ("report", "{d}/wrong_shape_run"),
         'wrong_shape_run/summary.json is not a perfrun summary: environment is "cpu", not an object or null',
         small=False),
    Case("a run that will not fit the memory it is given, on the CPU", ("train", "memory.size=100KiB"),
         "will not fit: its memory ESTIMATE"),
    Case("a run dir name longer than the filesystem takes", ("train", "hydra.run.dir={d}/" + "r" * 300),
         "more than the 255 this filesystem allows"),
    Case("int8 report of a checkpoint that records a data class", ("export", "checkpoint={d}/records_data_class.pt",
                                                                   "format=int8-report"),
         "perfrun never imports a class that a file names", small=False),
    Case("resume from a checkpoint that records a model class not typed", ("train", "resume={d}/records_model_class.pt"),
         "perfrun never imports a class that a file names"),
    Case("generate from a checkpoint of a custom model", ("generate", "checkpoint={d}/records_model_class.pt"),
         "perfrun never imports a class that a file names", small=False),
    Case("Hydra's rerun from a pickle", ("train", "--experimental-rerun", "{d}/config.pickle"), "never reads one"),
    Case("a ladder job's time budget that is no time", ("train", "-m", "+sweep=ablation", "ablation.budget_s=-1"),
         "ablation.budget_s=-1.0 must be more than 0", small=False),
    Case("a ladder of absurd repeats", ("train", "-m", "+sweep=ablation", "ablation.repeats=100000"),
         "ablation.repeats=100000 is outside 1 to 100", small=False),
    Case("memory trade-offs of no repeats", ("train", "-m", "+sweep=ablation", "ablation.tradeoff_repeats=-1"),
         "ablation.tradeoff_repeats=-1 is outside 1 to 100", small=False),
    Case("a ladder too large to finish", ("train", "-m", "+sweep=ablation", "ablation.repeats=50"),
         "rungs x 50 repeats), more than 1,000", small=False),
    Case("a rung's own key on the ladder's command line", ("train", "-m", "+sweep=ablation", "ablation.kind=ladder"),
         "ablation.kind is each rung's own", small=False),
]


def make_fixtures(d: Path, good_checkpoint: Path, small_checkpoint: Path) -> None:
    """The files the cases point at; ``good_checkpoint`` is a real one of another shape,
    ``small_checkpoint`` one of SMALL's shape (its run dir is ``d/small``), damaged here."""
    (d / "empty.txt").write_bytes(b"")
    (d / "short.txt").write_text("print('hi')\n")
    (d / "odd.bin").write_bytes(b"\x01\x02\x03")
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240521, 1, 64)  # a date-like magic llm.c never used
    (d / "badmagic.bin").write_bytes(header.tobytes() + np.arange(64, dtype=np.uint16).tobytes())
    (d / "notes.txt").write_text("not a checkpoint\n")
    (d / "read_only.json").write_text("{}\n")
    (d / "read_only.json").chmod(0o444)
    raw = good_checkpoint.read_bytes()
    (d / "other_model.pt").write_bytes(raw)
    (d / "truncated.pt").write_bytes(raw[: len(raw) // 2])
    (d / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))
    state = torch.load(good_checkpoint, map_location="cpu", weights_only=True)
    first = next(iter(state["model"]))
    state["model"][first].view(-1)[0] = float("nan")  # a diverged run's checkpoint
    torch.save(state, d / "nan_weights.pt")
    np.concatenate([np.arange(200, dtype=np.uint16) % 256, [999]]).astype(np.uint16).tofile(d / "high_id.bin")
    (d / "corpus.txt").write_text("def f(x):\n    return x\n" * 200)
    (d / "bad_tokenizer.json").write_text('{"model": {"type": "BPE", ')
    (d / "docs.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    (d / "gpt2_config").mkdir()
    (d / "gpt2_config" / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024, "vocab_size": 50257}))
    smollm2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
               "num_attention_heads": 9, "num_key_value_heads": 3, "rope_theta": 100000, "rms_norm_eps": 1e-05,
               "tie_word_embeddings": True, "max_position_embeddings": 8192, "vocab_size": 49152}
    for name, config in (("llama_config", smollm2), ("llama_badtype", {**smollm2, "num_hidden_layers": "thirty"}),
                         ("llama_missing", {k: v for k, v in smollm2.items() if k != "hidden_size"})):
        (d / name).mkdir()
        (d / name / "config.json").write_text(json.dumps(config))
    damaged_resumes(d, small_checkpoint)
    untrusted_and_mistyped(d)
    recorded_code(d, small_checkpoint)
    user_code(d)


USER_CODE = """
import sys
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, IterableDataset


class NoParameters(nn.Module):  # nothing for the optimizer to step
    def forward(self, idx, targets=None):
        logits = torch.zeros(*idx.shape, 64, requires_grad=True)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Exits(nn.Module):
    def __init__(self):
        super().__init__()
        sys.exit(3)


class SmallVocab(nn.Module):
    def __init__(self, vocab_size=16):
        super().__init__()
        self.vocab_size = vocab_size
        self.embed, self.head = nn.Embedding(vocab_size, 8), nn.Linear(8, vocab_size)

    def forward(self, idx, targets=None):
        logits = self.head(self.embed(idx))
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Tokens(Dataset):  # 64 windows of 32 ids below vocab_size, the item i's ids i, i+1, ...
    vocab_size = 64

    def __len__(self):
        return 64

    def __getitem__(self, i):
        t = (torch.arange(33) + i) % self.vocab_size
        return t[:-1], t[1:]


class NoItems(Tokens):
    def __len__(self):
        return 0


class NegativeLength(Tokens):
    def __len__(self):
        return -1


class FloatIds(Tokens):
    def __getitem__(self, i):
        return tuple(t.float() for t in super().__getitem__(i))


class HighIds(Tokens):  # says 64 ids, holds 100 in its first item
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        x[3] = 100
        return x, y


class Stream(IterableDataset):
    vocab_size = 64

    def __iter__(self):
        yield from (Tokens()[i] for i in range(64))
"""


def user_code(d: Path) -> None:
    """A user's model and dataset classes, each wrong in one way, and a module that parses the
    command line when imported. Compiled here, so importing them writes nothing beside them."""
    import py_compile

    (d / "user_code.py").write_text(USER_CODE)
    (d / "parses_argv.py").write_text("import argparse\n\nparser = argparse.ArgumentParser()\n"
                                      "parser.add_argument('--width', type=int, required=True)\n"
                                      "args = parser.parse_args()\n\nfrom torch import nn\n\n\n"
                                      "class Model(nn.Module):\n    pass\n")
    for name in ("user_code.py", "parses_argv.py"):
        py_compile.compile(str(d / name), doraise=True)


def untrusted_and_mistyped(d: Path) -> None:
    """Plain pickles (never loaded here: written only), a config.json of the wrong types and
    a run whose summary.json is damaged."""
    import pickle

    (d / "plain_pickle.pt").write_bytes(pickle.dumps({"model": {}, "call": print}))
    small = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 32, "vocab_size": 256}
    (d / "pickle_bin").mkdir()
    (d / "pickle_bin" / "config.json").write_text(json.dumps(small))
    (d / "pickle_bin" / "pytorch_model.bin").write_bytes(pickle.dumps({"call": print}))
    (d / "gpt2_badtype").mkdir()
    (d / "gpt2_badtype" / "config.json").write_text(json.dumps({**small, "n_layer": "one"}))
    (d / "gpt2_missing").mkdir()
    (d / "gpt2_missing" / "config.json").write_text(json.dumps({k: v for k, v in small.items() if k != "n_layer"}))
    nan_init(d / "nan_init")
    (d / "unreadable_run").mkdir()
    (d / "unreadable_run" / "summary.json").write_text('{"status": "compl')
    (d / "wrong_shape_run").mkdir()
    (d / "wrong_shape_run" / "summary.json").write_text('{"status": "completed", "environment": "cpu"}')


def nan_init(folder: Path) -> None:
    """A Hugging Face GPT-2 folder of SMALL's shape (as perfrun export writes it) with one NaN weight."""
    from perfrun.models.gpt import GPT, GPTConfig, padded_vocab
    from perfrun.models.hf_layout import export_safetensors

    model = GPT(GPTConfig(vocab_size=padded_vocab(256), block_size=32, n_layer=1, n_head=2, n_embd=32, dropout=0.0,
                          bias=True))
    with torch.no_grad():
        model.blocks[0].attn.c_attn.weight[0, 0] = float("nan")
    export_safetensors(model, folder, 256, {})


def damaged_resumes(d: Path, small_checkpoint: Path) -> None:
    """Checkpoints of the right shape and format whose state does not load: each load step's failure."""
    def variant(name: str, change) -> None:
        state = torch.load(small_checkpoint, map_location="cpu", weights_only=True)
        change(state)
        torch.save(state, d / name)

    variant("wrong_tensor.pt", lambda s: s["model"].__setitem__("wte.weight", torch.zeros(3, 3)))
    variant("missing_blocks.pt", lambda s: s.__setitem__("model", {k: v for k, v in s["model"].items()
                                                                    if not k.startswith("blocks.")}))
    variant("no_optimizer.pt", lambda s: s.pop("optimizer"))
    variant("bad_scheduler.pt", lambda s: s["scheduler"].__setitem__("last_epoch", "x"))
    variant("scheduler_not_a_dict.pt", lambda s: s.__setitem__("scheduler", [1, 2]))
    variant("bad_rng.pt", lambda s: s["rng"].__setitem__("torch", torch.zeros(3, dtype=torch.uint8)))
    variant("negative_step.pt", lambda s: s.__setitem__("step", -5))
    variant("bad_position.pt", lambda s: s["data"].__setitem__("consumed", "x"))


class _Unpickled:
    """Unpickling this creates ``payload-ran``: a config.pickle as --experimental-rerun reads it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


def recorded_code(d: Path, small_checkpoint: Path) -> None:
    """Files that name code which would create ``d/payload-ran`` (never loaded here: written
    only): checkpoints recording a data class (os.system) and a model class (a .py file whose
    import runs), and a pickle."""
    import pickle

    marker = d / "payload-ran"
    (d / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n\n\nclass Cls:\n    pass\n")
    state = torch.load(small_checkpoint, map_location="cpu", weights_only=True)
    state["config"]["data"].update(name="custom", target="os.system", args={"command": f"touch {marker}"})
    torch.save(state, d / "records_data_class.pt")
    state = torch.load(small_checkpoint, map_location="cpu", weights_only=True)
    state["config"]["model"].update(name="custom", family="custom", target=f"{d / 'evil.py'}:Cls")
    torch.save(state, d / "records_model_class.pt")
    (d / "config.pickle").write_bytes(pickle.dumps(_Unpickled(marker)))
