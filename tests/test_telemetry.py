"""NVML/host telemetry, the Monitor's aggregation and throttle linking, and peak FLOPs.

GPU paths run against tests/fake_nvml.py, whose API is checked against the installed
pynvml; the few tests that need a real CUDA device are marked ``gpu``.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from perfrun.telemetry import nvml as nvml_mod
from perfrun.telemetry import peaks
from perfrun.telemetry.host import HostSampler, host_facts
from perfrun.telemetry.monitor import Monitor

sys.path.insert(0, str(Path(__file__).parent))
import fake_nvml  # noqa: E402
from conftest import fill, small_disk  # noqa: E402
from fake_nvml import FakeGpu, FakeNvml  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
UUID_A = "GPU-aaaaaaaa-1111-2222-3333-444444444444"
UUID_B = "GPU-bbbbbbbb-1111-2222-3333-444444444444"
CFG = SimpleNamespace(every_n_steps=10, sample_interval_s=0.05, pcie=False)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    nvml_mod.reset_warnings()
    yield
    nvml_mod.reset_warnings()


def torch_uuids(monkeypatch: pytest.MonkeyPatch, mapping: dict[int, str]) -> None:
    """Pretend torch's cuda:i has the given UUID (torch prints it without the GPU- prefix)."""
    monkeypatch.setattr(nvml_mod, "torch_device_uuid", lambda i: mapping[i][4:] if mapping[i].startswith("GPU-") else mapping[i])


def gpu_monitor(monkeypatch: pytest.MonkeyPatch, gpu: FakeGpu, cfg=CFG) -> Monitor:
    torch_uuids(monkeypatch, {0: gpu.uuid})
    return Monitor(torch.device("cuda", 0), cfg, nvml_module=FakeNvml([gpu]))


# --- the fake can't drift from the real pynvml ---------------------------------------------


def test_fake_nvml_matches_real_pynvml_names_signatures_and_constants():
    pynvml = pytest.importorskip("pynvml")
    fake = FakeNvml([])
    names = fake_nvml.api_names()
    assert "nvmlDeviceGetTotalEnergyConsumption" in names and "NVMLError_NotSupported" in names
    for name in names:
        assert hasattr(pynvml, name), f"the fake has {name}, the real pynvml does not"
        real, mine = getattr(pynvml, name), getattr(fake, name)
        if isinstance(real, int):
            assert mine == real, f"{name}: fake {mine} != real {real}"
        elif inspect.isfunction(real):
            assert list(inspect.signature(mine).parameters) == list(inspect.signature(real).parameters), name
        elif isinstance(real, type):
            assert issubclass(real, pynvml.NVMLError) and issubclass(mine, fake_nvml.NVMLError), name
    # exceptions behave alike: NVMLError(code) maps to the subclass
    assert type(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)).__name__ == "NVMLError_NotSupported"
    assert type(fake_nvml.NVMLError(fake_nvml.NVML_ERROR_NOT_SUPPORTED)).__name__ == "NVMLError_NotSupported"


def test_every_nvml_name_perfrun_uses_exists_in_pynvml_and_the_fake():
    pynvml = pytest.importorskip("pynvml")
    fake = FakeNvml([])
    # scanned by prefix (not called), and perfrun's own module attribute
    prefixes = {"nvmlClocksEventReason", "nvmlClocksThrottleReason", "NVML_MODULE"}
    used: set[str] = set()
    for path in [REPO / "perfrun/telemetry/nvml.py", REPO / "perfrun/telemetry/monitor.py",
                 *sorted((REPO / "perfrun/gpucheck").glob("*.py"))]:
        used |= set(re.findall(r"\b(nvml[A-Z]\w*|NVML_[A-Z0-9_]+)\b", path.read_text()))
    used -= prefixes
    assert "nvmlDeviceGetUtilizationRates" in used  # the scan finds real calls
    assert "nvmlDeviceGetEccMode" in used  # gpu-check's own calls among them
    assert sorted(n for n in used if not hasattr(pynvml, n)) == []
    assert sorted(n for n in used if not hasattr(fake, n)) == []


# --- decoding -------------------------------------------------------------------------------


def test_decode_throttle_reasons():
    assert nvml_mod.decode_reasons(0x4 | 0x40) == ["sw_power_cap", "hw_thermal_slowdown"]
    assert nvml_mod.decode_reasons(0) == []
    assert nvml_mod.decode_reasons(None) is None
    assert nvml_mod.decode_reasons(0x1 | 0x8000) == ["gpu_idle", "unknown_0x8000"]
    # two constants share bit 0x2 (UserDefinedClocks, ApplicationsClocksSetting): one name
    assert nvml_mod.decode_reasons(0x2, FakeNvml([])) == ["applications_clocks_setting"]
    assert nvml_mod.is_slowdown(["gpu_idle", "applications_clocks_setting"]) is False
    assert nvml_mod.is_slowdown(["gpu_idle", "sw_power_cap"]) is True


def test_reason_names_from_the_real_module_cover_every_bit():
    pynvml = pytest.importorskip("pynvml")
    names = nvml_mod.reason_names(pynvml)
    all_bits = pynvml.nvmlClocksEventReasonAll
    for bit in range(16):
        if all_bits & (1 << bit):
            assert (1 << bit) in names
    assert names[0x200] == "board_limit"  # named even where this pynvml has no constant for it
    assert names[pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown] == "hw_power_brake_slowdown"


def test_normalize_uuid_formats():
    raw = bytes.fromhex("aaaaaaaa111122223333444444444444")
    assert nvml_mod.normalize_uuid(raw) == UUID_A[4:]
    assert nvml_mod.normalize_uuid(UUID_A.upper()) == UUID_A[4:]
    assert nvml_mod.normalize_uuid(UUID_A.encode()) == UUID_A[4:]
    assert nvml_mod.normalize_uuid("MIG-" + UUID_A[4:]) == UUID_A[4:]


# --- UUID matching --------------------------------------------------------------------------


def test_match_by_uuid_not_index_with_reordered_devices(monkeypatch):
    a, b = FakeGpu(uuid=UUID_A, name="A"), FakeGpu(uuid=UUID_B, name="B")
    fake = FakeNvml([b, a])  # NVML lists B first; torch's cuda:0 is A (CUDA_VISIBLE_DEVICES=1)
    torch_uuids(monkeypatch, {0: UUID_A, 1: UUID_B})
    session = nvml_mod.Nvml(fake)
    dev0 = session.match_torch_device(0)
    assert dev0 is not None and dev0.handle is a and dev0.index == 1 and dev0.name == "A"
    assert session.match_torch_device(1).handle is b
    assert nvml_mod.match_torch_device(0, nvml_module=fake) is a


def test_handles_are_cached_and_nvml_initialised_once(monkeypatch):
    fake = FakeNvml([FakeGpu(uuid=UUID_A)])
    torch_uuids(monkeypatch, {0: UUID_A})
    s1 = nvml_mod.get_session(fake)
    s1.match_torch_device(0)
    s1.match_torch_device(0)
    assert nvml_mod.get_session(fake) is s1
    assert fake.init_calls == 1
    assert fake.gpus[0].calls == {"mig": 1}  # devices enumerated once, then cached
    Monitor(torch.device("cuda", 0), CFG, nvml_module=fake).close()
    assert fake.init_calls == 1 and fake.shutdown_calls == 0  # close() leaves NVML up


def test_no_uuid_match_is_none_with_one_warning(monkeypatch, caplog):
    fake = FakeNvml([FakeGpu(uuid=UUID_B)])
    torch_uuids(monkeypatch, {0: UUID_A})
    session = nvml_mod.Nvml(fake)
    with caplog.at_level(logging.WARNING, logger="perfrun"):
        assert session.match_torch_device(0) is None
        assert session.match_torch_device(0) is None
    assert len([r for r in caplog.records if "no NVML device has the UUID" in r.message]) == 1


def test_mig_slice_matches_and_unsupported_fields_are_none(monkeypatch, caplog):
    slice_uuid = "MIG-cccccccc-1111-2222-3333-444444444444"
    sl = FakeGpu(uuid=slice_uuid, util=fake_nvml.NVMLError_NotSupported, power_mw=fake_nvml.NVMLError_NotSupported)
    parent = FakeGpu(uuid=UUID_A, name="NVIDIA A100-SXM4-80GB", mig=(1, 1), mig_slices=[sl])
    monkeypatch.setattr(nvml_mod, "torch_device_uuid", lambda i: slice_uuid)
    fake = FakeNvml([parent])
    dev = nvml_mod.Nvml(fake).match_torch_device(0)
    assert dev is not None and dev.is_mig and dev.handle is sl and dev.index == 0
    with caplog.at_level(logging.WARNING, logger="perfrun"):
        mon = Monitor(torch.device("cuda", 0), CFG, nvml_module=fake)
        for _ in range(3):
            mon.sample()
        rec = mon.collect(10, 0.1)
    assert rec["gpu_util_pct_mean"] is None and rec["power_w_mean"] is None
    assert rec["temp_c_max"] == 40  # what the slice does report still comes through
    msgs = [r.message for r in caplog.records]
    assert sum("gpu_util_pct is N/A" in m for m in msgs) == 1
    assert sum("power_w is N/A" in m for m in msgs) == 1


# --- the Monitor ------------------------------------------------------------------------------


def test_collect_mean_and_max_over_the_interval(monkeypatch):
    gpu = FakeGpu(
        uuid=UUID_A,
        util=[10, 50, 90, 20],
        power_mw=[100_000, 200_000, 300_000, 400_000],
        temp_c=[40, 60, 50, 45],
        sm_clock=[1980, 1500, 1980, 1700],
        mem_used_mib=[1000, 3000, 2000, 2500],
        energy_mj=[1_000, 5_000, 12_000, 20_000],  # read at start, each collect, summary
        reasons=[0, 0x4, 0x1, 0x40],
    )
    mon = gpu_monitor(monkeypatch, gpu)
    for _ in range(3):
        mon.sample()
    rec = mon.collect(10, 0.1)
    assert rec["monitor_samples"] == 3
    assert rec["gpu_util_pct_mean"] == 50.0 and rec["gpu_util_pct_max"] == 90.0
    assert rec["power_w_mean"] == 200.0 and rec["power_w_max"] == 300.0
    assert rec["power_limit_w"] == 700.0
    assert rec["temp_c_max"] == 60.0
    assert rec["sm_clock_mhz_mean"] == round((1980 + 1500 + 1980) / 3) and rec["sm_clock_mhz_min"] == 1500
    assert rec["gpu_mem_used_mib"] == 3000 and rec["gpu_mem_total_mib"] == 81559
    assert rec["energy_j"] == 4.0  # (5000 - 1000) mJ
    assert rec["throttle_reasons"] == ["gpu_idle", "sw_power_cap"]
    assert rec["throttled_sample_share"] == round(1 / 3, 3)
    assert rec["rss_mib_max"] > 0
    # the next interval starts empty: only the one new sample counts
    mon.sample()
    rec2 = mon.collect(20, 0.1)
    assert rec2["monitor_samples"] == 1
    assert rec2["gpu_util_pct_mean"] == 20.0 and rec2["gpu_util_pct_max"] == 20.0
    assert rec2["throttle_reasons"] == ["hw_thermal_slowdown"]
    assert rec2["energy_j"] == 7.0
    s = mon.summary(tokens=1_900)
    assert s["energy_j"] == 19.0 and s["energy_source"] == "nvml_total_energy_counter"
    assert s["joules_per_token"] == pytest.approx(19.0 / 1_900)
    assert s["gpu_util_pct_mean"] == 42.5 and s["temp_c_max"] == 60.0 and s["power_w_mean"] == 250.0
    assert s["throttle_reasons_seen"] == ["gpu_idle", "hw_thermal_slowdown", "sw_power_cap"]
    assert s["throttled_sample_share"] == 0.5
    assert s["gpu_uuid"] == UUID_A
    mon.close()


def test_collect_makes_no_blocking_nvml_call_while_the_thread_runs(monkeypatch):
    """The energy counter blocks ~4 ms on an H100: only the sampler thread may read it."""
    monkeypatch.setattr("perfrun.telemetry.monitor.SLOW_READ_PERIOD_S", 0.02)
    counter = iter(range(0, 10**9, 1000))
    gpu = FakeGpu(uuid=UUID_A, energy_mj=lambda: next(counter))
    mon = gpu_monitor(monkeypatch, gpu, SimpleNamespace(every_n_steps=1, sample_interval_s=0.01, pcie=False))
    mon.start()
    deadline = time.monotonic() + 120  # a guard against a hang, not a figure the test needs
    while gpu.calls.get("energy_mj", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gpu.calls["energy_mj"] >= 4  # the thread read the counter (and sampled) several times
    mon._stop.set()  # freeze the thread so the call counts stay put
    mon._thread.join()
    mon._stop.clear()
    monkeypatch.setattr(Monitor, "sampling", property(lambda self: True))
    reads = gpu.calls["energy_mj"]
    rec = mon.collect(10, 0.1)
    assert gpu.calls["energy_mj"] == reads  # collect used the thread's latest reading
    # with the thread, an interval's energy integrates its power samples (the counter may
    # not have advanced within a short interval); the run's total comes from the counter
    assert rec["energy_j"] is not None and rec["energy_j"] > 0
    total = mon.summary(tokens=1000)
    assert total["energy_source"] == "nvml_total_energy_counter"
    mon.close()


def test_short_interval_repeats_the_latest_sample_without_reading(monkeypatch):
    gpu = FakeGpu(uuid=UUID_A, util=[30, 60])
    mon = gpu_monitor(monkeypatch, gpu)
    mon.sample()
    mon.sample()
    first = mon.collect(10, 0.1)
    monkeypatch.setattr(Monitor, "sampling", property(lambda self: True))  # as if the thread ran
    calls = dict(gpu.calls)
    rec = mon.collect(11, 0.1)
    assert gpu.calls == calls  # nothing read on the training thread
    assert rec["monitor_samples"] == 0 and rec["gpu_util_pct_mean"] == 60.0 and first["monitor_samples"] == 2
    assert rec["host_cpu_pct_mean"] == first["host_cpu_pct_mean"]  # no new host reading either
    assert mon.summary(1)["monitor_samples"] == 2  # the repeat is not a new sample


def test_collect_without_samples_takes_one(monkeypatch):
    mon = gpu_monitor(monkeypatch, FakeGpu(uuid=UUID_A, util=77))
    rec = mon.collect(1, None)
    assert rec["monitor_samples"] == 1 and rec["gpu_util_pct_mean"] == 77.0


def test_unsupported_field_is_none_with_one_warning_per_field(monkeypatch, caplog):
    gpu = FakeGpu(uuid=UUID_A, temp_c=fake_nvml.NVMLError_NotSupported, energy_mj=fake_nvml.NVMLError_NotSupported)
    with caplog.at_level(logging.WARNING, logger="perfrun"):
        mon = gpu_monitor(monkeypatch, gpu)
        for step in (10, 20):
            for _ in range(3):
                mon.sample()
            rec = mon.collect(step, 0.1)
    assert rec["temp_c_max"] is None and rec["temp_c_mean"] is None
    assert rec["gpu_util_pct_mean"] == 50.0  # other fields unaffected
    # no energy counter: the interval's power samples are integrated instead
    assert rec["energy_j"] is not None and rec["energy_j"] >= 0
    temp_lines = [r for r in caplog.records if "temp_c is N/A" in r.message]
    assert len(temp_lines) == 1 and "NVMLError_NotSupported" in temp_lines[0].message
    assert len([r for r in caplog.records if "energy_j is N/A" in r.message]) == 1
    assert mon.summary(100)["energy_source"] == "power_samples_integrated"


def test_power_integration_fallback_is_exact_for_constant_power():
    """The fallback where the energy counter is N/A: power samples integrated over their
    own times (a window's trapezoids), exact for a constant power."""
    from perfrun.telemetry.aggregate import Sample, Window

    window, prev = Window(), None
    for t in (0.0, 1.0, 3.0):
        s = Sample(t=t, power_w=250.0)
        window.add(s, prev)
        prev = s
    assert window.integrated_energy_j() == pytest.approx(250.0 * 3.0)
    window.add(Sample(t=4.0, power_w=None), prev)  # one N/A reading: no integral rather than a wrong one
    assert window.integrated_energy_j() is None


def test_no_nvml_library_gives_none_and_one_warning(monkeypatch, caplog):
    fake = FakeNvml([FakeGpu(uuid=UUID_A)], init_error=fake_nvml.NVMLError_LibraryNotFound)
    torch_uuids(monkeypatch, {0: UUID_A})
    with caplog.at_level(logging.WARNING, logger="perfrun"):
        mon = Monitor(torch.device("cuda", 0), CFG, nvml_module=fake)
        mon.sample()
        rec = mon.collect(10, 0.1)
        Monitor(torch.device("cuda", 0), CFG, nvml_module=fake).close()
    assert rec["gpu_util_pct_mean"] is None and rec["energy_j"] is None and rec["throttle_reasons"] is None
    assert rec["rss_mib_max"] > 0  # host side still works
    lines = [r.message for r in caplog.records if "NVML unavailable" in r.message]
    assert len(lines) == 1 and "Library Not Found" in lines[0]
    s = mon.summary(10)
    assert s["gpu_util_pct_mean"] is None and s["joules_per_token"] is None


def test_real_pynvml_without_a_driver_does_not_crash(monkeypatch, caplog):
    """This machine has pynvml but no libnvidia-ml: the real module's error path."""
    pynvml = pytest.importorskip("pynvml")
    session = nvml_mod.Nvml(pynvml)
    if session.available:
        pytest.skip("NVML works here")
    monkeypatch.setattr(nvml_mod, "_sessions", {})
    with caplog.at_level(logging.WARNING, logger="perfrun"):
        mon = Monitor(torch.device("cuda", 0), CFG)
        mon.sample()
        rec = mon.collect(1, None)
    assert rec["gpu_util_pct_mean"] is None
    assert any("NVML unavailable" in r.message for r in caplog.records)


def test_pynvml_not_installed(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    monkeypatch.setattr(nvml_mod, "_sessions", {})
    session = nvml_mod.get_session()
    assert session.module is None and not session.available and "nvidia-ml-py" in session.error
    with caplog.at_level(logging.WARNING, logger="perfrun"):
        assert nvml_mod.match_torch_device(0) is None
    assert any("pip install nvidia-ml-py" in r.message for r in caplog.records)


def test_pcie_only_when_asked(monkeypatch):
    gpu = FakeGpu(uuid=UUID_A, pcie_tx_kbs=[1000, 3000], pcie_rx_kbs=500)
    mon = gpu_monitor(monkeypatch, gpu)
    mon.sample()
    assert "pcie_tx_mb_s_mean" not in mon.collect(1, None) and "pcie_tx_kbs" not in gpu.calls
    mon = gpu_monitor(monkeypatch, gpu, SimpleNamespace(every_n_steps=1, sample_interval_s=0.05, pcie=True))
    mon.sample()
    mon.sample()
    rec = mon.collect(2, None)
    assert rec["pcie_tx_mb_s_mean"] == 2.0 and rec["pcie_rx_mb_s_mean"] == 0.5


def test_throttle_linked_to_slow_steps(monkeypatch):
    """Intervals: 3 normal, one throttled but not slow, one slow + power-capped, one slow + idle only."""
    plan = [  # (clock-event mask for the interval's samples, step time)
        (0x0, 0.100),
        (0x0, 0.101),
        (0x8, 0.102),  # hw_slowdown but not slower: not listed
        (0x0, 0.099),
        (0x4, 0.130),  # sw_power_cap and 30% slower: listed
        (0x1, 0.140),  # slow but only gpu_idle: not a throttle
        (0x40, 0.120),  # thermal and 20% slower: listed
    ]
    gpu = FakeGpu(uuid=UUID_A)
    mon = gpu_monitor(monkeypatch, gpu)
    for i, (mask, step_time) in enumerate(plan, start=1):
        gpu.reasons = mask
        mon.sample()
        mon.sample()
        mon.collect(10 * i, step_time)
    slow = mon.throttle_slow_steps()
    assert [(d["step"], d["since_step"], d["reasons"]) for d in slow] == [
        (50, 40, ["sw_power_cap"]),
        (70, 60, ["hw_thermal_slowdown"]),
    ]
    assert slow[0]["median_step_time_s"] == pytest.approx(0.102)
    assert slow[0]["slower_pct"] == pytest.approx(100 * (0.130 / 0.102 - 1), abs=0.05)
    s = mon.summary(1000)
    assert s["throttle_slow_steps"] == slow
    assert s["throttled_sample_share"] == round(6 / 14, 3)  # 3 intervals x 2 samples with a slowdown


def test_slow_steps_need_three_timed_intervals(monkeypatch):
    gpu = FakeGpu(uuid=UUID_A, reasons=0x4)
    mon = gpu_monitor(monkeypatch, gpu)
    mon.collect(10, 0.1)
    mon.collect(20, 0.5)
    mon.collect(30, None)  # warm-up intervals carry no step time
    assert mon.throttle_slow_steps() == []


def test_cpu_monitor_thread_samples_host_only():
    mon = Monitor(torch.device("cpu"), SimpleNamespace(every_n_steps=1, sample_interval_s=0.02, pcie=False))
    mon.start()
    cpu0 = time.process_time()
    deadline = time.monotonic() + 120  # a guard against a hang, not a figure the test needs
    # keep this process busy until it has used 50 ms of CPU (the kernel counts it in 10 ms
    # ticks), however little of a core a busy machine leaves it, and 3 samples were taken
    while (time.process_time() - cpu0 < 0.05 or mon._run.samples < 3) and time.monotonic() < deadline:
        sum(range(20_000))
    # two more samples: the thread's latest host counters are then read after that CPU was used
    seen = mon._run.samples
    while mon._run.samples < seen + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    rec = mon.collect(5, 0.01)
    mon.close()
    mon.close()  # idempotent
    assert mon._thread is not None and not mon._thread.is_alive()
    assert not any(k.startswith(("gpu_", "power_", "temp_", "energy")) for k in rec)
    assert rec["monitor_samples"] >= 3 and rec["rss_mib_max"] > 10
    assert rec["host_cpu_pct_mean"] is not None and 0 <= rec["host_cpu_pct_mean"] <= 100
    assert rec["proc_cpu_pct_mean"] > 0
    s = mon.summary(tokens=100)
    assert s["gpu_util_pct_mean"] is None and s["energy_j"] is None
    assert s["monitor_samples"] >= 3
    assert s["monitor_sampler_cpu_s"] > 0 and s["monitor_collect_s"] > 0
    assert s["monitor_overhead_s"] == pytest.approx(s["monitor_sampler_cpu_s"] + s["monitor_collect_s"], abs=1e-3)
    n = mon._run.samples
    time.sleep(0.1)
    assert mon._run.samples == n  # stopped for good


def test_host_sampler_counts_worker_children_and_their_cpu():
    """CPU shares are checked against bounds computed from wall time measured here, so a
    busy machine (a worker that takes seconds to get its 0.6 s of CPU) cannot fail it."""
    t_start = time.monotonic()
    host = HostSampler()
    burn = (
        "import sys, time\nt=time.process_time()\nwhile time.process_time()-t<0.6: pass\n"
        "print('done', flush=True)\ntime.sleep(600)"
    )
    worker = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True)
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # compile_worker"])
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == "done"
        t_first = time.monotonic()
        iv = host.interval()
        first_span = time.monotonic() - t_start  # at least the interval's length
        assert iv.workers == 1  # the compile_worker helper is not a DataLoader worker
        # the worker's 0.6 s of CPU (>= 0.5 s in the kernel's 10 ms ticks) all fall in the interval
        assert iv.workers_cpu_pct is not None and iv.workers_cpu_pct >= 100 * 0.5 / first_span
        assert iv.host_cpu_pct is not None
        time.sleep(0.3)
        iv2 = host.interval()  # the worker now sleeps: little CPU in the new interval
        second_span = time.monotonic() - t_first  # at least the interval's length
        assert iv2.workers == 1 and iv2.workers_cpu_pct is not None
        assert iv2.workers_cpu_pct / 100 * second_span < 0.1  # CPU seconds, against >= 0.5 before
    finally:
        worker.kill()
        helper.kill()
        worker.wait()
        helper.wait()
        if worker.stdout is not None:
            worker.stdout.close()


def test_host_facts(tmp_path):
    facts = host_facts(tmp_path)
    assert facts["cpu_logical_cores"] >= 1 and facts["ram_total_gib"] > 0
    assert facts["disk_free_gib"] > 0 and facts["output_dir"] == str(tmp_path.resolve())


# --- peaks ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype", "value"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 PCIe", "bfloat16", 756.5),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA H200", "tf32", 494.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100-PCIE-40GB", "fp32", 19.5),
        ("NVIDIA A10", "bf16", 125.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA GeForce RTX 4090", "torch.bfloat16", 165.2),
        ("NVIDIA GeForce RTX 3090", "fp16", 71.0),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla T4", "float16", 65.0),
    ],
)
def test_datasheet_lookup(name, dtype, value):
    got, source = peaks.datasheet_peak_tflops(name, dtype)
    assert got == value and source.startswith("datasheet")


def test_datasheet_misses_say_why():
    # ... and how to get an MFU figure all the same (the note is what a run prints for MFU)
    v, why = peaks.datasheet_peak_tflops("AMD EPYC 7B13", "fp32")
    assert v is None and why == (
        "no datasheet entry for 'AMD EPYC 7B13'; for an MFU figure, run `perfrun gpu-check` to measure "
        "this machine's peak, then train with mfu.peak=measured")
    v, why = peaks.datasheet_peak_tflops("Tesla V100-PCIE-32GB", "bf16")
    assert v is None and "no bf16" in why and "Volta" in why and why.endswith("mfu.peak=measured")
    v, why = peaks.datasheet_peak_tflops("NVIDIA A10G", "bf16")
    assert v is None and "A10G" in why and "measured" in why
    assert why.count("mfu.peak=measured") == 1  # its own note says it already
    with pytest.raises(ValueError, match="dtype"):
        peaks.datasheet_peak_tflops("NVIDIA A10", "int8")


def test_measure_matmul_cpu():
    r = peaks.measure_matmul(torch.device("cpu"), torch.float32, size=128, repeats=3)
    assert r.tflops > 0 and r.size == 128 and r.inner >= 1
    assert "median of 3" in r.method() and "perf_counter" in r.method()
    assert peaks.measure_matmul_tflops(torch.device("cpu"), torch.float32, size=64, repeats=2) > 0


def test_measure_matmuls_interleaves_the_repeats(monkeypatch):
    """Timed repeats alternate between the dtypes, so a load that comes and goes hits each alike."""
    timed = []
    real = peaks._time_once

    def recorded(fn, device, inner):
        timed.append(fn)
        return real(fn, device, inner)

    monkeypatch.setattr(peaks, "_time_once", recorded)
    fp32, bf16 = peaks.measure_matmuls(torch.device("cpu"), [(torch.float32, None), (torch.bfloat16, None)],
                                       size=64, repeats=3, warmup_s=0.0)
    last = timed[-6:]  # after both warm-ups: the six timed repeats
    assert last[0] is not last[1] and last == [last[0], last[1]] * 3
    assert (fp32.dtype, bf16.dtype) == ("fp32", "bf16") and fp32.interleaved_with == ("bf16",)
    assert "median of 3 repeats" in bf16.method() and "interleaved with fp32" in bf16.method()
    for r in (fp32, bf16):
        low, high = r.tflops_range
        assert 0 < low <= r.tflops <= high
    assert peaks.measure_matmul(torch.device("cpu"), torch.float32, size=64, repeats=2).interleaved_with == ()


def test_tf32_context_restores_the_flag():
    before = peaks.tf32_enabled()
    with peaks.tf32(not before):
        assert peaks.tf32_enabled() is (not before)
    assert peaks.tf32_enabled() is before


def test_measured_peak_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("PERFRUN_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    with pytest.raises(peaks.PeakUnavailable, match="gpu-check"):
        peaks.measured_peak_tflops(cpu, torch.float32, measure_if_missing=False)
    monkeypatch.setattr(peaks, "_default_size", lambda device, dtype: 128)
    value, how = peaks.measured_peak_tflops(cpu, torch.float32)
    assert value > 0 and "measured now" in how
    data = json.loads((tmp_path / "peaks.json").read_text())
    key = peaks.device_key(cpu)
    assert key.startswith("cpu: ") and data["devices"][key]["fp32"]["tflops"] == value
    again, how2 = peaks.measured_peak_tflops(cpu, "float32", measure_if_missing=False)
    assert again == value and "cached in" in how2
    assert list(tmp_path.glob(".peaks.*")) == []  # no temporary files left behind


def test_cache_write_is_atomic(tmp_path, monkeypatch):
    """A write that the disk cannot take (a real, full one) leaves the cache as it was."""
    with small_disk(tmp_path / "cache", "64k") as cache:
        monkeypatch.setenv("PERFRUN_CACHE", str(cache))
        result = peaks.MatmulResult(1.5, 128, 3, 1, "fp32", "cpu")
        peaks.store_measured("dev", "fp32", result)
        good = (cache / "peaks.json").read_text()
        fill(cache)
        with pytest.raises(OSError, match="No space left on device"):
            peaks.store_measured("dev", "bf16", result)
        assert (cache / "peaks.json").read_text() == good
        assert list(cache.glob(".peaks.*")) == []


# --- on a real GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_monitor_on_real_gpu():
    mon = Monitor(torch.device("cuda", 0), SimpleNamespace(every_n_steps=1, sample_interval_s=0.02, pcie=False))
    assert mon.gpu is not None, "torch's cuda:0 must match an NVML device by UUID"
    mon.start()
    a = torch.randn(4096, 4096, device="cuda")
    t_end = time.time() + 1.0
    while time.time() < t_end:
        a @ a
    torch.cuda.synchronize()
    rec = mon.collect(1, 0.1)
    s = mon.summary(tokens=1000)
    mon.close()
    assert rec["monitor_samples"] >= 5
    assert rec["gpu_util_pct_max"] > 0 and rec["gpu_mem_used_mib"] > 0
    assert rec["sm_clock_mhz_mean"] > 0 and rec["throttle_reasons"] is not None
    assert s["gpu_uuid"] and nvml_mod.normalize_uuid(s["gpu_uuid"]) == nvml_mod.normalize_uuid(
        torch.cuda.get_device_properties(0).uuid
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_matmul_on_real_gpu():
    r = peaks.measure_matmul(torch.device("cuda", 0), torch.bfloat16, size=2048, repeats=3)
    assert r.tflops > 1 and "CUDA events" in r.method()


def test_run_host_means_cover_the_steady_intervals_only():
    """The warm-up interval (compilation, with inductor's compile-worker processes) must not
    count in the run's host CPU means that contention is judged by: the run's figure is the
    steady interval's, not a mix with the warm-up's."""
    mon = Monitor(torch.device("cpu"), SimpleNamespace(every_n_steps=1, sample_interval_s=0.02, pcie=False))
    warm = mon.collect(10, None)  # a warm-up interval: no step time
    cpu0 = time.process_time()
    while time.process_time() - cpu0 < 0.03:  # CPU to read in the steady interval
        sum(range(20_000))
    steady = mon.collect(20, 0.01)
    s = mon.summary(tokens=100)
    mon.close()
    assert warm["proc_cpu_pct_mean"] is not None and steady["proc_cpu_pct_mean"] is not None
    assert s["host_cpu_window"] == "steady intervals"
    assert s["host_cpu_pct_mean"] == steady["host_cpu_pct_mean"]
    assert s["proc_cpu_pct_mean"] == steady["proc_cpu_pct_mean"]


def test_run_host_means_fall_back_to_every_interval_without_a_steady_one():
    mon = Monitor(torch.device("cpu"), SimpleNamespace(every_n_steps=1, sample_interval_s=0.02, pcie=False))
    only = mon.collect(10, None)
    s = mon.summary(tokens=100)
    mon.close()
    assert s["host_cpu_window"] == "all intervals"
    assert s["proc_cpu_pct_mean"] == only["proc_cpu_pct_mean"]
