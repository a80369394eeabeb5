"""perfrun tune: with planted trials it picks the fastest configuration (not the largest
batch), tries far fewer points than the grid, and prints the line to paste; its tune.* keys
and the flags that spell them run the same tune; --help lists them all; --json puts the
result alone on stdout; real quick tunes on the CPU leave no checkpoint unless asked; bad
input gets one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from perfrun import report
from perfrun.commands import tune
from perfrun.commands.tune import Candidate, Space, TrialResult, search
from perfrun.tune.config import FLAGS, TuneConfig, flags_to_overrides

from conftest import TINY_MODEL


def planted(table: dict[Candidate, float | str]):  # noqa: ANN201
    """A trial that answers from ``table`` (tokens/s, or "oom"); unknown points OOM."""
    calls: list[Candidate] = []

    def trial(c: Candidate) -> TrialResult:
        calls.append(c)
        v = table.get(c, "oom")
        if v == "oom":
            return TrialResult(c, "oom", reason="out of memory (planted)")
        return TrialResult(c, "completed", tokens_per_s=float(v))

    return trial, calls


def model_tps(c: Candidate) -> float | str:
    """Throughput that grows with batch until 32; no checkpointing OOMs from 16, nothing fits 64;
    checkpointing costs 20%, compile buys 30%, two workers buy 10%."""
    if c.batch_size >= 64 or (c.checkpointing == "none" and c.batch_size >= 16):
        return "oom"
    tps = float(min(c.batch_size, 32))
    tps *= 0.8 if c.checkpointing == "full" else 1.0
    tps *= 1.3 if c.compile else 1.0
    tps *= 1.1 if c.num_workers == 2 else 1.0
    return tps


GRID = [Candidate(b, ck, comp, w) for b in (1, 2, 4, 8, 16, 32, 64) for ck in ("none", "full")
        for comp in (False, True) for w in (0, 2)]


def test_tuner_picks_the_best_of_planted_trials() -> None:
    trial, calls = planted({c: model_tps(c) for c in GRID})
    result = search(trial, Space(num_workers=[0, 2]))
    best = max((c for c in GRID if model_tps(c) != "oom"), key=model_tps)  # type: ignore[arg-type]
    assert result.winner is not None and result.winner.candidate == best == Candidate(32, "full", True, 2)
    assert len(calls) == len(set(calls)) and len(calls) < len(GRID) / 2  # greedy, not the grid
    assert {r.phase for r in result.trials} == {"batch", "checkpointing", "compile", "workers"}
    assert all(r.ok or r.status == "oom" for r in result.trials)


def test_tuner_wants_speed_not_the_largest_batch() -> None:
    # throughput peaks at batch 8 and falls after, although 64 still fits
    shape = {1: 10.0, 2: 18.0, 4: 30.0, 8: 40.0, 16: 35.0, 32: 30.0, 64: 25.0}
    trial, calls = planted({Candidate(b): v for b, v in shape.items()})
    result = search(trial, Space(checkpointing=["none"], compile=[False], num_workers=[0]))
    assert result.winner is not None and result.winner.candidate == Candidate(8)
    assert max(c.batch_size for c in calls) == 16  # stopped once tokens/s fell (patience 1)


def test_tuner_when_every_trial_fails(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trial, _ = planted({})
    assert tune.main(["--quick", "--out", str(tmp_path)], trial=trial) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "every trial failed" in err[0] and "out of memory (planted)" in err[0]


def test_main_prints_the_table_and_the_line_to_paste(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trial, _ = planted({c: model_tps(c) for c in GRID})
    rc = tune.main(["--workers", "0,2", "--out", str(tmp_path), "model=gpt2"], trial=trial)
    out = capsys.readouterr().out
    assert rc == 0
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1] == ("perfrun train model=gpt2 dataloader.batch_size=32 checkpointing=full compile=true "
                         "dataloader.num_workers=2")
    assert "perfrun tune: trials" in out and "★" in out
    saved = json.loads((tmp_path / "tune_summary.json").read_text())
    assert saved["command"] == lines[-1] and saved["winner"]["batch_size"] == 32


def test_a_searched_key_on_the_command_line_is_held_fixed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trial, calls = planted({c: model_tps(c) for c in GRID})
    assert tune.main(["--workers", "0,2", "--out", str(tmp_path), "checkpointing=full", "compile=false"],
                     trial=trial) == 0
    assert {c.checkpointing for c in calls} == {"full"} and {c.compile for c in calls} == {False}
    assert capsys.readouterr().out.splitlines()[-1].endswith("checkpointing=full compile=false dataloader.num_workers=2")


@pytest.mark.parametrize("args, words", [
    (["max_steps=5"], "max_steps is set by perfrun tune"),
    (["--steps", "2", "--warmup", "3"], "must be more than --warmup"),
    (["--compile", "maybe"], "give false, true"),
    (["nosuchkey=1"], "nosuchkey"),
    (["dataloader.batch_size=auto"], "dataloader.batch_size=auto"),
    (["tune.steps=abc"], "tune.steps=abc"),
    (["tune.nope=1"], "tune.nope is not a key"),
    (["tune.steps=2", "tune.warmup=3"], "must be more than --warmup"),
    (["tune.workers=[-1]"], "give whole numbers >= 0"),
    (["tune.checkpointing=[sometimes]"], "sometimes is not an option"),
    (["tune.batch_sizes=[]"], "tries nothing"),
    (["--steps"], "expected one argument"),
    (["-m"], "sweep with perfrun train -m"),
    (["--bogus"], "unknown option --bogus"),
])
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], words: str) -> None:
    assert tune.main([*args, "--out", str(tmp_path)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("perfrun: error: tune:") and words in err[0]


@pytest.mark.slow
def test_a_real_quick_tune_on_the_cpu(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "tune"
    rc = tune.main(["device=cpu", "--quick", "--batch-sizes", "2,4", "--steps", "3", "--warmup", "1",
                    "--out", str(out), *TINY_MODEL])  # overrides before and after the options
    text = capsys.readouterr().out
    assert rc == 0, text
    said = [line for line in text.splitlines() if "save no checkpoints" in line]
    assert len(said) == 1 and "checkpoint.at_end=true" in said[0]
    assert [p for p in out.rglob("*") if p.is_file() and "checkpoints" in p.parts] == []  # a measurement
    saved = json.loads((out / "tune_summary.json").read_text())
    trials = saved["trials"]
    assert [t["candidate"]["batch_size"] for t in trials] == [2, 4] and all(t["status"] == "completed" for t in trials)
    had_the_machine = [t for t in trials if not t.get("contended")] or trials  # a contended trial never wins
    fastest = max(had_the_machine, key=lambda t: t["tokens_per_s"])
    assert saved["winner"] == fastest["candidate"]
    assert text.splitlines()[-1] == saved["command"]
    # every trial is a run dir: perfrun report reads the tune dir like a sweep
    r = report.load([out])
    assert [row.tokens_per_s for row in r.rows] == [t["tokens_per_s"] for t in trials]
    assert r.swept_keys == ["dataloader.batch_size"]


def test_a_crashing_trial_is_recorded_and_the_search_goes_on(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import perfrun.loop.run

    def fake_run(cfg, run_dir, *, overrides=None):  # noqa: ANN001, ANN202
        if cfg.compile:
            raise RuntimeError("inductor exploded\nsecond line of a long traceback")
        return {"tokens_per_s_median": 10.0 * cfg.dataloader.batch_size, "peak_mem_mib": 1.0}

    monkeypatch.setattr(perfrun.loop.run, "run", fake_run)
    rc = tune.main(["--batch-sizes", "2,4", "--checkpointing", "none", "--workers", "0", "--out", str(tmp_path),
                    "device=cpu"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "failed: RuntimeError: inductor exploded" in out and "second line" not in out
    assert out.splitlines()[-1].endswith("dataloader.batch_size=4 checkpointing=none compile=false dataloader.num_workers=0")


def test_out_keeps_spaces_quotes_backslashes_and_dollar_braces(tmp_path: Path) -> None:
    """--out is quoted for Hydra so that the tune dir is the folder given, character for character."""
    for name in ("a b", "it's", "back\\slash", "ends\\", "x${y}"):
        (override,) = flags_to_overrides(["--out", str(tmp_path / name)])
        assert tune._compose([override])[1] == tmp_path / name, override


def test_keys_and_flags_spell_the_same_tune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--batch-sizes", "4,8", "--checkpointing", "none,full", "--compile", "false", "--workers", "0,2",
             "--steps", "7", "--warmup=2", "--patience", "2", "--min-gain", "0.1", "--start", "2", "--max-batch", "64"]
    keys = ["tune.batch_sizes=[4,8]", "tune.checkpointing=[none,full]", "tune.compile=[false]", "tune.workers=[0,2]",
            "tune.steps=7", "tune.warmup=2", "tune.patience=2", "tune.min_gain=0.1", "tune.start=2",
            "tune.max_batch=64"]
    assert flags_to_overrides([*flags, "model=gpt2", "--out", "a b"]) == [*keys, "model=gpt2", "hydra.run.dir='a b'"]
    saved = []
    for name, spelling in (("flags", flags), ("keys", keys)):
        trial, _ = planted({c: model_tps(c) for c in GRID})
        out = tmp_path / name
        assert tune.main([*spelling, "model=gpt2", "--out", str(out)], trial=trial) == 0
        saved.append({k: v for k, v in json.loads((out / "tune_summary.json").read_text()).items() if k != "dir"})
        assert (out / ".hydra" / "config.yaml").is_file()  # the tune dir is the Hydra app's run dir
    assert saved[0] == saved[1]
    assert saved[0]["steps"] == 7 and saved[0]["warmup"] == 2 and saved[0]["space"]["batch_sizes"] == [4, 8]
    assert saved[0]["space"]["num_workers"] == [0, 2] and saved[0]["space"]["min_gain"] == 0.1
    assert saved[0]["overrides"] == ["model=gpt2"]


@pytest.mark.slow
def test_help_lists_every_key_and_flag_and_cfg_job_composes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert tune.main(["--help"]) == 0
    text = capsys.readouterr().out
    tree = text.split("\ntune:\n")[1]
    for key in TuneConfig.__dataclass_fields__:
        assert f"  {key}:" in tree, key
    for flag, (key, _) in FLAGS.items():
        assert flag in text and key.split("=")[0] in text, flag
    assert "model:" in text and "precision: bf16, fp16, fp8, none" in text  # the trainer's keys and groups too
    assert tune.main(["--cfg", "job", "--steps", "4", "model=gpt2"]) == 0
    cfg = capsys.readouterr().out
    assert "  steps: 4\n" in cfg and "n_layer: 12" in cfg
    assert list(tmp_path.iterdir()) == []  # nothing ran, nothing was written


def test_json_puts_the_result_alone_on_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trial, _ = planted({c: model_tps(c) for c in GRID})
    assert tune.main(["--json", "--workers", "0,2", "--out", str(tmp_path), "model=gpt2"], trial=trial) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)  # nothing else on stdout
    assert result == json.loads((tmp_path / "tune_summary.json").read_text())
    assert result["command"].endswith("dataloader.batch_size=32 checkpointing=full compile=true dataloader.num_workers=2")
    assert result["winner"]["batch_size"] == 32 and result["dir"] == str(tmp_path)
    assert "trial 0: [batch]" in err and "perfrun tune: trials" not in out + err  # the lines on stderr, no table
    failing, _ = planted({})
    assert tune.main(["--json", "--quick", "--out", str(tmp_path / "none")], trial=failing) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["winner"] is None and "every trial failed" in err


@pytest.mark.slow
def test_a_tune_keeps_its_checkpoints_when_asked(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "tune"
    assert tune.main(["device=cpu", "--quick", "--batch-sizes", "2", "--steps", "2", "--warmup", "1",
                      "checkpoint.at_end=true", "--out", str(out), *TINY_MODEL]) == 0
    assert "save no checkpoints" not in capsys.readouterr().out
    assert len(list((out / "0" / "checkpoints").glob("*.pt"))) == 1


def test_no_winner_inside_the_noise_fewer_knobs_win_and_contended_trials_lose() -> None:
    from perfrun.tune.search import winner

    def trial(c: Candidate, tps: float, contended: bool = False) -> TrialResult:
        return TrialResult(c, "completed", tokens_per_s=tps, contended=contended)

    plain, compiled = trial(Candidate(8), 1000.0), trial(Candidate(8, compile=True), 1015.0)
    assert winner([plain, compiled], noise=0.02) is plain  # 1.5 % is inside the 2 % floor
    faster = trial(Candidate(8, compile=True), 1100.0)
    assert winner([plain, faster], noise=0.02) is faster  # 10 % is an effect
    lucky = trial(Candidate(16), 2000.0, contended=True)
    assert winner([plain, lucky], noise=0.02) is plain
