"""Checkpoints users already have keep resuming: a checkpoint written by an earlier perfrun
(tests/fixtures/checkpoint_v1, its README says how) resumes exactly, and today's checkpoints
are written in the same format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from perfrun.loop.run import run

from conftest import make_cfg

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v1" / "step_0000002.pt"
OVERRIDES = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=16", "max_steps=4",
             "log_every=1", "data=synthetic", "data.vocab_size=64", "model.dropout=0.1", "precision=fp16",
             "checkpoint.every_n_steps=2", "checkpoint.at_end=false"]


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}


def _layout(tree: Any) -> Any:
    """A checkpoint's shape without its values: nested keys, and the type at each leaf."""
    if isinstance(tree, dict):
        return {k: _layout(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [type(tree).__name__, *(_layout(v) for v in tree[:3])]
    return type(tree).__name__


@pytest.fixture(scope="module")
def today(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """OVERRIDES run uninterrupted by this perfrun, on the fixture's 2 CPU threads (another
    thread count sums in another order): the
    run the old checkpoint's resume must equal, and the new checkpoint whose layout must be
    the old one's. One run for both tests."""
    run_dir = tmp_path_factory.mktemp("today")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return run_dir, run(make_cfg(*OVERRIDES), run_dir)
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_an_earlier_perfruns_checkpoint_resumes_exactly(today: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    """Steps 3 and 4 resumed from the old file equal an uninterrupted run's, bit for bit:
    weights, AdamW, the schedule, fp16's loss scale, dropout's generators and the data
    position all came back (on the threads the uninterrupted run had)."""
    full_dir, full = today
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        resumed = run(make_cfg(*OVERRIDES, f"resume={FIXTURE}"), tmp_path / "resumed")
    finally:
        torch.set_num_threads(before)
    a, b = _losses(full_dir), _losses(tmp_path / "resumed")
    assert resumed["start_step"] == 2 and resumed["resumed_from"] == str(FIXTURE) and sorted(b) == [3, 4]
    assert [a[3], a[4]] == [b[3], b[4]]
    assert resumed["tokens"] == full["tokens"] and resumed["data_position"] == full["data_position"]


def test_todays_checkpoint_has_the_old_files_layout(today: tuple[Path, dict[str, Any]]) -> None:
    """Same keys at every level and the same kinds of values: the file format did not change
    (the recorded configuration is left out: it grows with the schema, and resuming reads
    only the keys that :func:`perfrun.checkpoint.files.check_compatible` names)."""
    old = torch.load(FIXTURE, map_location="cpu", weights_only=True)
    new = torch.load(today[0] / "checkpoints" / "step_0000002.pt", map_location="cpu", weights_only=True)
    assert isinstance(new.pop("config"), dict) and isinstance(old.pop("config"), dict)
    assert _layout(new) == _layout(old)
    assert new["step"] == old["step"] == 2 and new["data"] == old["data"] and new["tokens"] == old["tokens"]
    assert new["model_shape"] == old["model_shape"] and new["scaler"] == old["scaler"]
    # The same values, to within what another CPU's kernels give: the fixture was written on an
    # AVX-512 Xeon, and an AVX2 machine sums the same two steps in another order (up to 6e-5 apart).
    for k, v in old["model"].items():
        torch.testing.assert_close(new["model"][k], v, rtol=1e-3, atol=1e-4)
