"""A run dir on a full disk: one line before any work, not Hydra's traceback from saving the
configuration. A real, small tmpfs filled to the brim (skipped where mounting is not allowed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from perfrun.commands.train import train_main

from conftest import TINY, fill, small_disk


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    with small_disk(tmp_path / "small", "64k") as mount:
        fill(mount)
        yield mount


def test_a_run_dir_on_a_full_disk_is_one_line(full_disk: Path, capfd: pytest.CaptureFixture[str]) -> None:
    rc = train_main([*TINY, f"hydra.run.dir={full_disk / 'run'}"])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2
    assert len(lines) == 1 and "is full" in lines[0] and "hydra.run.dir" in lines[0], err
    assert not (full_disk / "run").exists()  # nothing half-written
