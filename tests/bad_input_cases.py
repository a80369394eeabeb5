"""The bad inputs perfrun must answer with one clear line; shared by the test that checks
each of them and by scripts/bad_inputs_table.py, which writes docs/bad-inputs.md from
what perfrun actually prints."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

# A small, fast model for every case that gets as far as building one.
SMALL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
         "dataloader.batch_size=2", "max_steps=2", "eval_batches=1", "monitor.every_n_steps=0", "device=cpu"]


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
         "ablation.repeats=0 must be >= 1", small=False),
    Case("several processes, no distributed mode", ("train", "nproc=2"), "nproc=2 needs distributed=ddp or fsdp"),
    Case("unknown distributed mode", ("train", "distributed=zero3"), "distributed=zero3 is not an option"),
    Case("unknown compile scope", ("train", "compile_options.scope=layers"), "compile_options.scope=layers is not an option"),
    Case("unknown command", ("trian",), "unknown command 'trian'", small=False),
]


def make_fixtures(d: Path, good_checkpoint: Path) -> None:
    """The files the cases point at; ``good_checkpoint`` is a real one of another shape."""
    (d / "empty.txt").write_bytes(b"")
    (d / "short.txt").write_text("print('hi')\n")
    (d / "odd.bin").write_bytes(b"\x01\x02\x03")
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240521, 1, 64)  # a date-like magic llm.c never used
    (d / "badmagic.bin").write_bytes(header.tobytes() + np.arange(64, dtype=np.uint16).tobytes())
    (d / "notes.txt").write_text("not a checkpoint\n")
    raw = good_checkpoint.read_bytes()
    (d / "other_model.pt").write_bytes(raw)
    (d / "truncated.pt").write_bytes(raw[: len(raw) // 2])
