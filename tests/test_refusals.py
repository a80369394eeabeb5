"""Bad inputs whose refusal tests/bad_input_cases.py's table cannot show: what a refused or
failed job leaves in its run dir, and what a refused command leaves on disk. In this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfrun.config import ConfigError
from perfrun.loop.run import run

from bad_input_cases import SMALL
from conftest import make_cfg, run_cli

EXITS_IN_FORWARD = """
import sys
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, idx, targets=None):
        if idx.shape[0] > 1:  # the training batch (setup's checks run a batch of one)
            sys.exit(4)
        logits = self.layer(idx.float()[..., :2])
        return logits, (logits.float().mean() - targets.float().mean()) ** 2
"""


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_sys_exit_in_user_code_never_leaves_the_summary_running(tmp_path: Path) -> None:
    """An exit in a user's __init__ is refused in one line; one anywhere else in the job (here
    its forward, in the first training step) still ends the job: either way summary.json says
    failed, never running."""
    code = tmp_path / "user.py"
    code.write_text(EXITS_IN_FORWARD + "\n\nclass ExitsInInit(nn.Module):\n    def __init__(self):\n"
                    "        super().__init__()\n        sys.exit(3)\n")
    with pytest.raises(ConfigError, match=r"its __init__ called sys.exit\(3\)"):
        run(make_cfg(*SMALL, "model=custom", f"model.target={code}:ExitsInInit"), tmp_path / "init")
    assert summary_of(tmp_path / "init")["status"] == "failed"
    with pytest.raises(SystemExit):
        run(make_cfg(*SMALL, "model=custom", f"model.target={code}:Model"), tmp_path / "forward")
    s = summary_of(tmp_path / "forward")
    assert s["status"] == "failed" and s["reason"] == "SystemExit: 4"


def test_a_module_that_parses_the_command_line_at_import_sees_none_of_perfrun_s(tmp_path: Path) -> None:
    """Its parser gets no arguments (perfrun's are not the script's), so a parser of options
    alone builds the model and the run completes."""
    code = tmp_path / "opts.py"
    code.write_text("import argparse\n\nargs = argparse.ArgumentParser().parse_args()\n"
                    + EXITS_IN_FORWARD.replace("idx.shape[0] > 1", "False"))
    assert run(make_cfg(*SMALL, "model=custom", f"model.target={code}:Model"), tmp_path / "run")["status"] == "completed"


@pytest.mark.slow
def test_a_module_that_exits_at_import_is_one_line_in_a_real_process(tmp_path: Path) -> None:
    """perfrun's own command line is what such a module parsed (and exited on) before: the
    process as a shell sees it, its exit code, its one line, and the summary it leaves."""
    code = tmp_path / "needs_args.py"
    code.write_text("import argparse\n\nparser = argparse.ArgumentParser()\n"
                    "parser.add_argument('--width', type=int, required=True)\nparser.parse_args()\n")
    r = run_cli("train", *SMALL, "model=custom", f"model.target={code}:Model", "hydra.run.dir=run", cwd=tmp_path)
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr
    assert len(errors) == 1 and errors[0].startswith("perfrun: error: model.target="), r.stderr
    assert "called sys.exit(2) after printing 'needs_args.py: error: the following arguments are required" in errors[0]
    assert summary_of(tmp_path / "run")["status"] == "failed"
