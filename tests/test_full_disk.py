"""A run dir on a full disk: one line before any work, not Hydra's traceback from saving the
configuration. A real, small tmpfs filled to the brim (skipped where mounting is not allowed)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from perfrun.commands.train import train_main

from conftest import TINY


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.decode().strip()})")
    try:
        with (mount / "filler").open("wb") as f:
            try:
                f.write(bytes(128 * 1024))
                f.flush()
            except OSError:
                pass  # full: what this fixture is for
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_run_dir_on_a_full_disk_is_one_line(full_disk: Path, capfd: pytest.CaptureFixture[str]) -> None:
    rc = train_main([*TINY, f"hydra.run.dir={full_disk / 'run'}"])
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2
    assert len(lines) == 1 and "is full" in lines[0] and "hydra.run.dir" in lines[0], err
    assert not (full_disk / "run").exists()  # nothing half-written
