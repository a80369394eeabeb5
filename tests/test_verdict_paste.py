"""The ladder's verdict is a line to paste, and it runs as pasted.

A real small ladder (the naive trainer and the fused-AdamW rung, which stands on bf16 and
SDPA) is run in this process as a user runs it; it stops before its last job (that job's
folder never made), and is resumed with the command perfrun prints for a stopped sweep
(``resume=auto``). The verdict line it prints, with only ``device=cpu`` and a short
``max_steps=`` appended, trains to completion; it never carries ``resume=``, ``repeat=`` or
``hydra.*``, and the runs table lists no ``resume`` as a swept override. A verdict that can
rank nothing names the defaults, still as a command and a shell comment.
"""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest

from perfrun import report
from perfrun.commands.train import train_main
from perfrun.console import kept_logging
from perfrun.ladder.callback import resume_command
from perfrun.ladder.verdict import verdict_line

from conftest import TINY_MODEL

QUICK = [*TINY_MODEL, "max_steps=6", "log_every=3", "eval_batches=1", "device=cpu", "progress=off",
         "timing_warmup_steps=2", "data=synthetic", "data.vocab_size=64", "dataloader.batch_size=4"]


def train(args: list[str], capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``perfrun train ARGS`` in this process: its exit code and what it printed on stdout."""
    capfd.readouterr()
    with kept_logging():
        try:
            code = train_main(args)
        except SystemExit as e:  # a plain run ends through SystemExit
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return code, capfd.readouterr().out


@pytest.mark.slow
def test_the_verdict_line_of_a_resumed_ladder_trains_as_pasted(tmp_path: Path, one_thread: None,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "ladder"
    code, _ = train(["-m", "+sweep=ablation", "+ablation=naive,fused_adamw", "ablation.repeats=1", *QUICK,
                     "ablation.target_s=null", f"hydra.sweep.dir={sweep}"], capfd)
    assert code == 0
    shutil.rmtree(sweep / "1")  # stopped before its last job
    resume = shlex.split(resume_command(sweep) or "")
    assert resume[:2] == ["perfrun", "train"] and "resume=auto" in resume
    code, out = train(resume[2:], capfd)
    assert code == 0, out
    resumed = json.loads((sweep / "1" / "summary.json").read_text())
    assert resumed["status"] == "completed" and resumed["config"]["resume"] == "auto"  # job 0 fresh, job 1 resumed

    rows = report.load([sweep]).rows
    assert "resume" not in report.swept_keys(rows)
    table = [line for line in out.splitlines() if line.startswith("│")]
    assert table and not any("resume" in line for line in table), "\n".join(table)

    verdicts = [line for line in out.splitlines() if line.startswith("verdict: ")]
    assert len(verdicts) == 1, out
    line = verdicts[0].removeprefix("verdict: ")
    words = shlex.split(line, comments=True)  # as a shell reads the pasted line
    assert words[:2] == ["perfrun", "train"], line
    assert not [w for w in words if w.startswith(("resume=", "repeat=", "hydra."))], line

    pasted = tmp_path / "pasted"
    pasted.mkdir()
    monkeypatch.chdir(pasted)
    code, out = train([*words[2:], "device=cpu", "max_steps=1"], capfd)
    assert code == 0, f"{line} device=cpu max_steps=1: {out}"
    (summary,) = pasted.glob("outputs/*/*/summary.json")
    assert json.loads(summary.read_text())["status"] == "completed"


@pytest.mark.parametrize("why", ["no rung can be ranked: every job shared the machine (contended); rerun on a "
                                 "quiet machine", "no job was measured (no completed, uncontended job within loss parity)"])
def test_a_verdict_of_the_defaults_is_a_command_and_a_comment(why: str) -> None:
    """Where nothing could be ranked the verdict names the defaults; pasted, it is still a command."""
    line = verdict_line({"knobs": [], "dropped": [], "line": "perfrun train", "why": why}, None)
    assert shlex.split(line.removeprefix("verdict: "), comments=True) == ["perfrun", "train"], line
    assert why in line
