"""The ladder's maths on planted job dirs (fast), the noise floor, the contention verdict and
GPU starvation on planted figures, and loss parity calibrated by seed noise on real tiny
jobs: a learning rate 10x too high is flagged, bf16 on the CPU is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from perfrun import report
from perfrun.data.handoff_timer import HandOffTimer
from perfrun.ladder.analysis import read_sweep
from perfrun.report.noise import effect, spread
from perfrun.telemetry import contention

BASE_LOSS = {10: 3.0, 20: 2.5, 30: 2.2, 40: 2.0, 50: 1.9}
META = {  # rung: (kind, step, knob, acts_on)
    "naive": ("ladder", 0, "", "any"), "naive_seed": ("seed", 0, "", "any"), "tf32": ("ladder", 1, "", "cuda"),
    "bf16": ("ladder", 2, "", "any"), "fp16": ("alternative", 2, "bf16", "any"), "sdpa": ("ladder", 3, "", "any"),
    "compile": ("ladder", 4, "", "any"), "without_bf16": ("without", 0, "bf16", "any"),
    "without_sdpa": ("without", 0, "sdpa", "any"), "without_compile": ("without", 0, "compile", "any"),
    "checkpointing_full": ("tradeoff", 0, "checkpointing=full", "any"),
    "largest_batch_full": ("tradeoff", 0, "checkpointing=full", "any"),
}
CONFIG = {  # what each rung's configuration holds (the line to paste is its difference)
    "naive": {"precision": {"name": "none"}, "attention": "eager", "compile": False},
    "tf32": {"precision": {"name": "none"}, "attention": "eager", "compile": False},
    "bf16": {"precision": {"name": "bf16"}, "attention": "eager", "compile": False},
    "sdpa": {"precision": {"name": "bf16"}, "attention": "sdpa", "compile": False},
    "compile": {"precision": {"name": "bf16"}, "attention": "sdpa", "compile": True},
    "fp16": {"precision": {"name": "fp16"}, "attention": "eager", "compile": False},
    "naive_seed": {"precision": {"name": "none"}, "attention": "eager", "compile": False},
    "without_bf16": {"precision": {"name": "none"}, "attention": "sdpa", "compile": True},
    "without_sdpa": {"precision": {"name": "bf16"}, "attention": "eager", "compile": True},
    "without_compile": {"precision": {"name": "bf16"}, "attention": "sdpa", "compile": False},
}


def plant(job: Path, rung: str, repeat: int, tps: float, *, loss_scale: float = 1.0, mem: float = 100.0,
          contended: bool = False, device: str = "cpu", status: str = "completed", auto_batch: int | None = None) -> None:
    """A job dir of a ladder sweep as perfrun.loop.run.run leaves it."""
    job.mkdir(parents=True)
    kind, step, knob, acts_on = META[rung]
    config = {**CONFIG.get(rung, CONFIG["compile"]), "repeat": repeat,
              "ablation": {"rung": rung, "kind": kind, "step": step, "knob": knob, "acts_on": acts_on, "why": f"{rung}!"}}
    s = {"status": status, "overrides": [f"repeat={repeat}", f"+ablation={rung}", "+sweep=ablation"],
         "tokens_per_s_median": tps if status == "completed" else None, "peak_mem_mib": mem, "first_step_s": 0.5,
         "peak_mem_source": "process_rss_sampled_at_log_steps", "config": config,
         "environment": {"device": device, "device_name": "Test CPU", "torch": "2.13.0"},
         "contention": {"contended": contended, "evidence": ["planted neighbour"] if contended else []}}
    if auto_batch:
        s["batch_size_auto"] = {"batch_size": auto_batch}
    (job / "summary.json").write_text(json.dumps(s))
    losses = {k: v * loss_scale for k, v in BASE_LOSS.items()}
    (job / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": k, "loss": v}) + "\n"
                                               for k, v in losses.items()))


def plant_ladder(root: Path, *, contend: str | None = None) -> None:
    """Three interleaved repeats; compile is 2x sdpa; sdpa is inside bf16's noise."""
    speeds = {"naive": [1000, 1040, 980], "naive_seed": [1000, 1010, 990], "tf32": [1000, 1000, 1000],
              "bf16": [1500, 1550, 1480], "fp16": [1490, 1560, 1500], "sdpa": [1520, 1530, 1500],
              "compile": [3000, 3100, 2950], "without_bf16": [2000, 2050, 1990], "without_sdpa": [2990, 3050, 3000],
              "without_compile": [1500, 1520, 1490], "checkpointing_full": [2400, 2450, 2420],
              "largest_batch_full": [2800, 2790, 2810]}
    losses = {"naive_seed": 1.01, "bf16": 1.002, "fp16": 1.2}  # fp16 derails: 20 % worse
    n = 0
    for repeat in range(3):
        for rung, tps in speeds.items():
            plant(root / str(n), rung, repeat, tps[repeat], loss_scale=losses.get(rung, 1.0),
                  mem=60.0 if "checkpointing" in rung else 100.0, contended=(rung == contend and repeat == 1),
                  auto_batch=64 if rung.startswith("largest") else None)
            n += 1


def test_noise_floor_is_the_min_max_range() -> None:
    a, b = spread([100, 104, 98]), spread([101, 103, 99, None])
    assert (a.n, a.median, a.lo, a.hi) == (3, 100, 98, 104) and a.half_pct == pytest.approx(3.0)
    same = effect(a, b)
    assert same.measurable is False and same.text() == "no measurable effect (±5.0%)"
    faster = effect(spread([150, 152, 149]), a)
    assert faster.measurable and faster.text().startswith("1.50×")
    assert effect(spread([150]), a).text() == "1.50× (1 run: no spread)"


def test_the_ladder_from_planted_jobs(tmp_path: Path) -> None:
    plant_ladder(tmp_path)
    r = read_sweep([tmp_path])
    (a,) = r.ladders
    rungs = {e["rung"]: e for e in a["ladder"]}
    assert [e["rung"] for e in a["ladder"]] == ["naive", "tf32", "bf16", "sdpa", "compile"]
    assert rungs["bf16"]["n"] == 3 and rungs["bf16"]["tokens_per_s"] == 1500
    assert rungs["bf16"]["vs_below_measurable"] and rungs["bf16"]["vs_below"] == pytest.approx(1.5)
    # TF32 cannot act on a CPU: not measured, and bf16 is compared with the naive trainer
    assert not rungs["tf32"]["applicable"] and rungs["tf32"]["verdict"] == "not applicable on cpu: tf32!"
    assert rungs["sdpa"]["vs_below_measurable"] is False and rungs["sdpa"]["verdict"].startswith("no measurable effect")
    assert rungs["compile"]["vs_baseline"] == pytest.approx(3.0)
    # leave-one-out from the top: without compile the top halves; without sdpa nothing measurable
    loo = {e["knob"]: e for e in a["leave_one_out"]}
    assert loo["compile"]["vs_below"] == pytest.approx(0.5) and loo["compile"]["vs_below_measurable"]
    assert loo["sdpa"]["verdict"].startswith("no measurable effect")
    # fp16 beside bf16 (against the rung below, naive here), flagged by loss parity; bf16 is not
    (fp16,) = a["alternatives"]
    assert fp16["vs_below"] == pytest.approx(1.5) and fp16["parity"] == "FLAGGED" and rungs["bf16"]["parity"] == "ok"
    assert a["seed_gap"] == pytest.approx(0.01) and a["loss_tolerance"] == pytest.approx(0.03)
    # trade-offs apart: memory, speed, the largest batch and the speed at it
    (full,) = a["tradeoffs"]
    assert full["setting"] == "checkpointing=full" and full["peak_mem_mib"] == 60 and full["largest_batch"] == 64
    assert full["tokens_per_s_at_largest"] == 2800
    # the recommendation is a measured job: the top without sdpa is as fast as the top (inside
    # the noise) with one knob fewer, so it wins; the line runs exactly that configuration
    rec = a["recommended"]
    assert rec["knobs"] == ["bf16", "compile"] and rec["dropped"] == ["sdpa"] and rec["measured_as"] == "without_sdpa"
    assert rec["fastest"] == "compile" and rec["measured_exactly"]
    assert rec["line"] == "perfrun train precision.name=bf16 attention=eager compile=true"
    assert a["verdict"].startswith("verdict: perfrun train precision.name=bf16 attention=eager compile=true  # 3.00×")
    data = json.loads(report.to_json(r))
    assert {"ladder", "leave_one_out", "tradeoffs", "recommended"} <= set(data)
    text = report.render_text(r, width=260)
    assert "not applicable on cpu" in text and "no measurable effect" in text and "FLAGGED" in text
    sdpa_line = next(line for line in text.splitlines() if line.startswith("│ sdpa"))
    assert "★" not in sdpa_line and "1.01×" not in sdpa_line


def test_nothing_faster_than_the_naive_trainer_outside_the_noise_recommends_it(tmp_path: Path) -> None:
    """A machine where every knob is within the noise of the naive trainer (or slower): the
    verdict is the naive trainer, said as such, never the top rung's knobs."""
    n = 0
    for repeat in range(3):
        for rung, tps in {"naive": [1000, 1040, 980], "naive_seed": [1000, 1010, 990], "bf16": [990, 1030, 1000],
                          "sdpa": [900, 910, 905], "compile": [1010, 1050, 985]}.items():
            plant(tmp_path / str(n), rung, repeat, tps[repeat])
            n += 1
    (a,) = read_sweep([tmp_path]).ladders
    rec = a["recommended"]
    assert rec["measured_as"] == "naive" and rec["knobs"] == [] and rec["fastest"] == "compile"
    assert rec["line"] == "perfrun train attention=eager"  # the naive trainer, from perfrun's defaults
    assert "the naive trainer: no configuration measured here was faster outside the noise" in a["verdict"]


def test_a_contended_job_is_marked_and_never_counted(tmp_path: Path) -> None:
    plant_ladder(tmp_path, contend="compile")
    r = read_sweep([tmp_path])
    rungs = {e["rung"]: e for e in r.ladders[0]["ladder"]}
    assert rungs["compile"]["n"] == 2 and rungs["compile"]["contended"] == 1
    assert rungs["compile"]["tokens_per_s"] == pytest.approx(2975)  # 3000 and 2950, not the contended 3100
    assert r.ladders[0]["notes"] == ["1 of 36 jobs shared the machine and are not counted (jobs 18); the first: "
                                       "planted neighbour",
                                       "machine noise: ±3.0% from the naive trainer's 6 uncontended jobs (naive, naive_seed)"]
    text = report.render_text(r, width=260)
    assert "2 (+1 contended)" in text
    assert next(row for row in r.rows if row.contended).best is False


def test_repeats_of_a_sweep_are_grouped_and_no_winner_inside_the_noise(tmp_path: Path) -> None:
    n = 0
    for repeat in range(3):
        for batch, tps in ((4, [1000, 1100, 950][repeat]), (8, [1050, 1000, 1080][repeat])):
            job = tmp_path / str(n)
            job.mkdir()
            (job / "summary.json").write_text(json.dumps({
                "status": "completed", "overrides": [f"dataloader.batch_size={batch}", f"repeat={repeat}"],
                "tokens_per_s_median": tps, "config": {"repeat": repeat}, "contention": {"contended": False}}))
            n += 1
    r = read_sweep([tmp_path])
    assert r.swept_keys == ["dataloader.batch_size"]  # repeat is not a knob
    assert [(g.overrides, g.jobs, g.tps.median) for g in r.groups] == [
        (["dataloader.batch_size=4"], ["0", "2", "4"], 1000), (["dataloader.batch_size=8"], ["1", "3", "5"], 1050)]
    assert r.best is None and not any(g.best for g in r.groups)  # inside each other's spread: no star
    text = report.render_text(r, width=200)
    assert "repeats of the same overrides" in text and not any(line.startswith("│ ★") for line in text.splitlines())
    assert "fastest median, inside the others' noise" in text and "no measurable effect" in text


def test_contention_verdict_on_planted_figures() -> None:
    quiet = contention.assess({"host_cpu_pct_mean": 50.0, "proc_cpu_pct_mean": 95.0, "interval_step_times_s": [1.0] * 8},
                              cpus=2)
    assert quiet["contended"] is False and quiet["evidence"] == []
    busy = contention.assess({"host_cpu_pct_mean": 100.0, "proc_cpu_pct_mean": 60.0}, cpus=2)
    assert busy["contended"] and busy["others_cpu_pct"] == 140.0 and "other processes used 140% CPU" in busy["evidence"][0]
    # a busy neighbour on a big machine with idle cores left is not contention
    assert contention.assess({"host_cpu_pct_mean": 20.0, "proc_cpu_pct_mean": 100.0}, cpus=64)["contended"] is False
    gpu = contention.assess({"gpu_other_processes_max": 1}, cpus=2)
    assert gpu["contended"] and "1 other process(es)" in gpu["evidence"][0]
    jumpy = contention.assess({"interval_step_times_s": [1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 1.0, 3.0, 1.0, 3.0]}, cpus=2)
    assert jumpy["contended"] and "step times spread" in jumpy["evidence"][0]
    assert contention.assess({}, cpus=2)["contended"] is None  # nothing measured: unknown, not "no"


class Timeline:
    """A hand-built device timeline: the host's clock moves by hand; work queued on the stream
    runs after the work before it; an event completes when the device reaches it."""

    def __init__(self) -> None:
        self.host = 0.0  # ms
        self.busy_until = 0.0

    def queue(self, ms: float) -> None:
        self.busy_until = max(self.host, self.busy_until) + ms

    def event(self) -> Event:
        return Event(self)


class Event:
    def __init__(self, timeline: Timeline) -> None:
        self.timeline, self.t = timeline, None

    def record(self, stream: object) -> None:
        self.t = max(self.timeline.host, self.timeline.busy_until)

    def query(self) -> bool:
        return self.t is not None and self.t <= max(self.timeline.host, self.timeline.busy_until)

    def elapsed_time(self, other: Event) -> float:
        return other.t - self.t


def waits_on_a_timeline(read_ms: list[float]) -> tuple[list[float], float]:
    """Steps of 100 ms of device work; before each, the host reads its batch for ``read_ms``
    inside the hand-off, then takes 1 ms to queue the step. Returns the timer's waits and the
    device's total time."""
    tl = Timeline()
    timer = HandOffTimer(torch.device("cpu"), new_event=tl.event, stream=lambda: None)
    for ms in read_ms:
        with timer.hand_off():
            tl.host += ms
        tl.host += 1.0
        tl.queue(100.0)
    tl.host = tl.busy_until  # the device has passed every hand-off
    return timer.pop_ms(), tl.busy_until


def test_gpu_starvation_from_a_hand_built_timeline() -> None:
    """The hand-off timer on a hand-built timeline. A host that reads each batch in 20 ms
    while the device runs 100 ms steps never starves it (only the first batch, with nothing
    queued yet, is waited for); one that needs 150 ms leaves the device idle 50 ms a step."""
    kept_up, kept_up_total = waits_on_a_timeline([5.0, 20.0, 20.0, 20.0])
    assert kept_up == pytest.approx([5.0, 0.0, 0.0, 0.0])
    slow, total = waits_on_a_timeline([5.0, 150.0, 150.0, 150.0])
    assert slow == pytest.approx([5.0, 50.0, 50.0, 50.0]) and total == pytest.approx(559.0)
    assert contention.gpu_starved_pct(slow, [total]) == pytest.approx(100.0 * 155.0 / 559.0)
    assert kept_up_total == pytest.approx(406.0)
    assert contention.gpu_starved_pct(kept_up, [kept_up_total]) == pytest.approx(100.0 * 5.0 / 406.0)
    assert contention.gpu_starved_pct([], []) is None


@pytest.mark.slow
def test_loss_parity_calibrated_by_seeds_flags_a_10x_learning_rate_not_bf16(tmp_path: Path, one_thread: None) -> None:
    from perfrun.loop.run import run

    from conftest import make_cfg

    jobs = [("naive", []), ("naive_seed", []), ("bf16", []),
            ("bf16", ["optim.lr=0.01", "ablation.rung=bf16_lr10x", "ablation.step=3"])]
    for n, (rung, extra) in enumerate(jobs):
        overrides = [f"+ablation={rung}", *extra, "max_steps=40", "log_every=4", "monitor.every_n_steps=0"]
        run(make_cfg(*overrides), tmp_path / str(n), overrides=overrides)
    (a,) = read_sweep([tmp_path]).ladders
    rungs = {e["rung"]: e for e in a["ladder"]}
    assert a["seed_gap"] is not None and a["seed_gap"] > 0
    assert rungs["bf16"]["parity"] == "ok", (rungs["bf16"]["loss_rel_diff"], a["loss_tolerance"])
    assert rungs["bf16_lr10x"]["parity"] == "FLAGGED", (rungs["bf16_lr10x"]["loss_rel_diff"], a["loss_tolerance"])


def test_a_rung_that_cannot_act_here_is_skipped_and_shown_not_applicable(tmp_path: Path) -> None:
    """FP8 on a CPU: the job trains nothing, says why in its summary, does not fail the
    sweep, and the ladder shows the rung as not applicable, never as a measurement."""
    from perfrun.ladder.callback import failed_jobs
    from perfrun.ladder.rungs import run_rung

    from conftest import make_cfg

    plant_ladder(tmp_path)
    overrides = ["+ablation=fp8", "max_steps=40", "repeat=0"]
    s = run_rung(make_cfg(*overrides), tmp_path / "fp8", overrides=overrides)
    assert s["status"] == "skipped" and "FP8 tensor cores" in s["reason"] and s["reason"].startswith("not applicable on cpu")
    written = json.loads((tmp_path / "fp8" / "summary.json").read_text())
    assert written["status"] == "skipped" and written["config"]["precision"]["name"] == "bf16"
    assert not (tmp_path / "fp8" / "metrics.jsonl").exists()  # nothing trained
    assert failed_jobs(tmp_path) == []
    (a,) = read_sweep([tmp_path]).ladders
    fp8 = next(e for e in a["ladder"] if e["rung"] == "fp8")
    assert not fp8["applicable"] and fp8["n"] == 0 and fp8["failed"] == 0 and fp8["tokens_per_s"] is None
    assert fp8["verdict"].startswith("not applicable on cpu: FP8 matmuls need FP8 tensor cores")


def test_where_a_rung_acts_is_decided_per_device() -> None:
    from perfrun.device_conditions import device_kind, if_fp8, rung_applies

    assert rung_applies("any", "cpu") and not rung_applies("cuda", "cpu") and not rung_applies("fp8", "cpu")
    assert rung_applies("cuda", "cuda:1")  # the device named, whatever this machine has
    assert if_fp8("cpu", "fp8", "bf16") == "bf16"
    assert device_kind("cpu") == "cpu" and device_kind("cuda:1") == "cuda" and device_kind("mps") == "mps"
    with pytest.raises(ValueError, match="choose one of any, cuda, fp8"):
        rung_applies("gpu", "cpu")


def test_loss_parity_holds_when_every_naive_job_shared_the_machine(tmp_path: Path) -> None:
    """Contention changes a job's speed, not its losses: the naive trainer's loss curve still
    calibrates parity when none of its repeats can be ranked."""
    plant_ladder(tmp_path)
    for summary in tmp_path.glob("*/summary.json"):
        s = json.loads(summary.read_text())
        if s["config"]["ablation"]["rung"] == "naive":
            s["contention"] = {"contended": True, "evidence": ["planted neighbour"]}
            summary.write_text(json.dumps(s))
    (a,) = read_sweep([tmp_path]).ladders
    rungs = {e["rung"]: e for e in a["ladder"]}
    assert rungs["naive"]["n"] == 0 and rungs["naive"]["contended"] == 3
    assert a["seed_gap"] == pytest.approx(0.01) and rungs["bf16"]["parity"] == "ok"
    assert a["alternatives"][0]["parity"] == "FLAGGED"  # fp16's planted 20 % loss gap


def test_at_80_columns_the_tables_leave_columns_out_rather_than_cut_figures(tmp_path: Path) -> None:
    """A terminal of 80 columns: every table fits without an ellipsis, the least needed columns
    are left out and named under their table; a wide terminal shows them all."""
    plant_ladder(tmp_path)
    r = read_sweep([tmp_path])
    narrow = report.render_text(r, width=80)
    table_lines = [line for line in narrow.splitlines() if line[:1] in "┏┃┡│└"]
    assert table_lines and all(len(line) <= 80 for line in table_lines)
    assert "…" not in narrow
    assert "left out at 80 columns: first step s" in " ".join(narrow.split())
    assert "compile" in narrow and "3,000" in narrow  # the rung and its figure are kept
    wide = report.render_text(r, width=300)
    assert "left out" not in wide and "first step s" in wide
