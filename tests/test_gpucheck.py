"""gpu-check: the verdict logic on hand-written facts, NVML fact gathering on the fake,
and a real ``--quick --json`` run on this machine."""

from __future__ import annotations

import copy
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from perfrun.commands.gpu_check import main
from perfrun.gpucheck import gather as gathering
from perfrun.gpucheck.checks import (
    capability_checks,
    cpu_precision,
    evaluate,
    host_checks,
    measurement_checks,
    software_checks,
)
from perfrun.gpucheck.facts import nvml_gpu_facts, pynvml_provenance
from perfrun.gpucheck.gpu_checks import gpu_checks
from perfrun.gpucheck.render import render
from perfrun.gpucheck.verdict import FAIL, OK, SKIP, WARN, Check, counts, exit_code
from perfrun.telemetry import nvml as nvml_mod

sys.path.insert(0, str(Path(__file__).parent))
import fake_nvml  # noqa: E402
from conftest import run_cli  # noqa: E402
from fake_nvml import FakeGpu, FakeNvml  # noqa: E402

UUID = "GPU-aaaaaaaa-1111-2222-3333-444444444444"

HEALTHY_GPU = {
    "nvml": True, "nvml_index": 0, "torch_index": 0, "name": "NVIDIA H100 80GB HBM3", "uuid": UUID,
    "compute_capability": "9.0", "memory_total_mib": 81559.0, "memory_used_mib": 5.0, "utilization_pct": 0,
    "power_w": 70.0, "power_limit_w": 700.0, "power_default_limit_w": 700.0, "temp_c": 30,
    "sm_clock_mhz": 345, "sm_clock_max_mhz": 1980, "mem_clock_mhz": 2619, "mem_clock_max_mhz": 2619,
    "persistence_mode": True, "ecc_mode": True, "ecc_volatile_uncorrected": 0, "ecc_volatile_corrected": 0,
    "ecc_aggregate_uncorrected": 0, "pcie_gen": 5, "pcie_gen_max": 5, "pcie_width": 16, "pcie_width_max": 16,
    "pcie_under_load": True, "mig_mode": False, "throttle_reasons": ["gpu_idle"], "other_processes": [],
}

HEALTHY_SOFTWARE = {
    "python": "3.11.7", "torch": "2.13.0", "torch_cuda": "12.8", "cudnn": 91000, "nccl": "2.27.3",
    "driver": "570.00", "cuda_driver": "12.8", "hydra": "1.3.8", "omegaconf": "2.3.1",
    "pynvml": {"importable": True, "provider": "nvidia-ml-py", "installed": {"nvidia-ml-py": "13.0"}},
    "compilers": {"cxx": "/usr/bin/g++", "cc": "/usr/bin/gcc", "python_h": True},
}

HEALTHY_HOST = {
    "cpu_model": "AMD EPYC", "cpu_physical_cores": 16, "cpu_logical_cores": 32, "cpu_usable_cores": 16,
    "ram_total_gib": 128.0, "ram_available_gib": 100.0, "output_dir": "/work", "disk_free_gib": 50.0,
    "shm_total_gib": 16.0,
}


def report(**overrides):
    base = {
        "software": copy.deepcopy(HEALTHY_SOFTWARE),
        "host": dict(HEALTHY_HOST),
        "cuda": {"torch_device_count": 1, "nvml_device_count": 1},
        "gpus": [dict(HEALTHY_GPU)],
        "device_index": None,
    }
    base.update(overrides)
    return base


def by_name(checks, name):
    found = [c for c in checks if c.name == name]
    assert found, f"no check named {name!r} in {[c.name for c in checks]}"
    return found[0]


def gpu(**changes):
    g = dict(HEALTHY_GPU)
    g.update(changes)
    return gpu_checks(g)


# --- verdict logic --------------------------------------------------------------------------------


def test_exit_code_fails_only_on_fail():
    ok = Check("s", "a", OK, "fine")
    warn = Check("s", "b", WARN, "meh", "do this")
    fail = Check("s", "c", FAIL, "bad", "do that")
    skip = Check("s", "d", SKIP, "n/a")
    assert exit_code([ok, warn, skip]) == 0
    assert exit_code([ok, warn, fail]) == 1
    assert counts([ok, warn, fail, skip, warn]) == {"ok": 1, "warn": 2, "fail": 1, "skip": 1}


def test_a_warning_or_failure_must_say_what_to_do():
    with pytest.raises(ValueError, match="without a fix"):
        Check("s", "x", WARN, "something")
    with pytest.raises(ValueError, match="status"):
        Check("s", "x", "meh", "something")


def test_healthy_machine_passes_with_no_warnings():
    checks = evaluate(report())
    assert [c for c in checks if c.status in (WARN, FAIL)] == []
    assert exit_code(checks) == 0


def test_no_gpu_warns_and_exits_zero():
    checks = evaluate(report(cuda={"torch_device_count": 0, "nvml_device_count": 0}, gpus=[]))
    c = by_name(checks, "cuda device")
    assert c.status == WARN and "no CUDA device is visible" in c.detail and "nvidia-smi" in c.fix
    assert exit_code(checks) == 0


def test_gpu_seen_by_nvml_but_not_torch_fails():
    checks = evaluate(report(cuda={"torch_device_count": 0, "nvml_device_count": 2}))
    c = by_name(checks, "cuda device")
    assert c.status == FAIL and "NVML sees 2" in c.detail and "CUDA build of torch" in c.fix
    assert exit_code(checks) == 1


def test_missing_device_index_fails():
    checks = evaluate(report(device_index=3))
    c = by_name(checks, "cuda device")
    assert c.status == FAIL and "--device 3" in c.detail and "between 0 and 0" in c.fix


@pytest.mark.parametrize(
    ("changes", "name", "status", "fix_part"),
    [
        ({"persistence_mode": False}, "persistence mode", WARN, "-pm 1"),
        ({"persistence_mode": None}, "persistence mode", SKIP, None),
        ({"ecc_volatile_uncorrected": 2}, "ecc", FAIL, "nvidia-smi -i 0 -r"),
        ({"ecc_volatile_corrected": 5}, "ecc", WARN, "-d ECC"),
        ({"ecc_mode": None}, "ecc", SKIP, None),
        ({"pcie_gen": 3}, "pcie link", WARN, "x16 slot"),
        ({"pcie_width": 8}, "pcie link", WARN, "x16 slot"),
        ({"pcie_gen": 1, "pcie_under_load": False}, "pcie link", OK, None),
        ({"mig_mode": True}, "mig", WARN, "-mig 0"),
        ({"throttle_reasons": ["gpu_idle", "hw_slowdown"]}, "throttling", WARN, "PERFORMANCE"),
        ({"throttle_reasons": ["sw_power_cap"], "utilization_pct": 95,
          "other_processes": [{"pid": 1, "name": "x", "used_mib": 10}]}, "throttling", OK, None),
        ({"other_processes": [{"pid": 4242, "name": "python", "used_mib": 30000.0}]}, "other processes", WARN, "--device"),
        ({"memory_used_mib": 20000.0}, "other processes", WARN, "nvidia-smi"),
        ({"other_processes": None}, "other processes", SKIP, None),
        ({"power_limit_w": 400.0}, "power limit", WARN, "-pl 700"),
    ],
)
def test_gpu_check_statuses(changes, name, status, fix_part):
    c = by_name(gpu(**changes), name)
    assert c.status == status, c
    if fix_part:
        assert fix_part in c.fix
    assert by_name(gpu(), name).status == OK  # the healthy baseline differs


def test_other_process_detail_names_the_process():
    c = by_name(gpu(other_processes=[{"pid": 4242, "name": "python", "used_mib": 30000.0}]), "other processes")
    assert "pid 4242 (python, 30,000 MiB)" in c.detail


def test_gpu_without_nvml_skips_driver_checks():
    checks = gpu_checks({"torch_index": 0, "name": "X", "uuid": "u", "nvml": False, "nvml_error": "no lib"})
    assert [c.name for c in checks] == ["identity", "nvml"] and checks[1].status == SKIP


def test_software_checks():
    sw = copy.deepcopy(HEALTHY_SOFTWARE)
    sw["pynvml"] = {"importable": True, "provider": "pynvml", "installed": {"pynvml": "11.5.0"}}
    c = by_name(software_checks(sw), "pynvml")
    assert c.status == WARN and c.fix == "pip uninstall pynvml && pip install nvidia-ml-py"
    sw["pynvml"] = {"importable": True, "provider": None, "installed": {"pynvml": "11.4.1", "nvidia-ml-py": "12.0"}}
    assert by_name(software_checks(sw), "pynvml").status == WARN
    sw["pynvml"] = {"importable": True, "provider": "nvidia-ml-py", "installed": {"pynvml": "12.0.0", "nvidia-ml-py": "12.0"}}
    assert by_name(software_checks(sw), "pynvml").status == OK
    sw["pynvml"] = {"importable": False, "installed": {}}
    assert by_name(software_checks(sw), "pynvml").status == WARN

    sw = copy.deepcopy(HEALTHY_SOFTWARE)
    sw["compilers"] = {"cxx": None, "cc": None, "python_h": False}
    checks = software_checks(sw)
    assert by_name(checks, "c++ compiler").status == WARN and "compile=false" in by_name(checks, "c++ compiler").fix
    assert by_name(checks, "c compiler").status == WARN
    assert by_name(checks, "python headers").status == WARN
    sw["torch_cuda"] = None  # CPU torch: Triton's needs don't apply
    assert [c.name for c in software_checks(sw) if c.section == "software" and "compiler" in c.name] == ["c++ compiler"]

    sw = copy.deepcopy(HEALTHY_SOFTWARE)
    sw["cuda_driver"] = "11.8"
    assert by_name(software_checks(sw), "cuda driver").status == FAIL
    sw["cuda_driver"] = "12.4"
    assert by_name(software_checks(sw), "cuda driver").status == WARN
    sw["cuda_driver"] = None
    assert not [c for c in software_checks(sw) if c.name == "cuda driver"]


def test_host_checks():
    h = dict(HEALTHY_HOST, disk_free_gib=0.4)
    assert by_name(host_checks(h), "disk").status == FAIL
    h = dict(HEALTHY_HOST, disk_free_gib=3.0)
    assert by_name(host_checks(h), "disk").status == WARN
    h = dict(HEALTHY_HOST, shm_total_gib=64 / 1024)
    c = by_name(host_checks(h), "/dev/shm")
    assert c.status == WARN and "64 MiB" in c.detail and "--shm-size" in c.fix
    h = dict(HEALTHY_HOST, shm_total_gib=None)
    assert by_name(host_checks(h), "/dev/shm").status == WARN
    h = dict(HEALTHY_HOST, ram_available_gib=0.5)
    assert by_name(host_checks(h), "ram").status == WARN


def test_capability_and_measurement_checks():
    cap = {
        "device": "cuda:0", "bf16": False, "fp16": True, "tf32": False,
        "sdpa": {"flash": {"ok": False, "error": "sm75"}, "math": {"ok": True}},
        "compile": {"ok": False, "error": "no compiler"},
    }
    checks = capability_checks(cap)
    assert by_name(checks, "bf16").status == WARN and "precision=fp16" in by_name(checks, "bf16").fix
    assert by_name(checks, "sdpa flash").status == SKIP and by_name(checks, "sdpa math").status == OK
    assert by_name(checks, "torch.compile").status == WARN
    cap["sdpa"]["math"] = {"ok": False, "error": "boom"}
    assert by_name(capability_checks(cap), "sdpa math").status == FAIL

    meas = {
        "device": "cuda:0",
        "matmul": {
            "bf16": {"tflops": 700.0, "method": "m", "datasheet_tflops": 989.5},
            "fp16": {"tflops": 200.0, "method": "m", "datasheet_tflops": 989.5},
            "fp32": {"error": "CUDA error: an illegal memory access"},
        },
        "h2d_pinned": {"gb_s": 10.0, "method": "m", "link_gb_s": 63.0},
        "h2d_pageable": {"gb_s": 8.0, "method": "m"},
    }
    checks = measurement_checks(meas)
    assert by_name(checks, "matmul bf16").status == OK and "71% of the datasheet" in by_name(checks, "matmul bf16").detail
    assert by_name(checks, "matmul fp16").status == WARN
    assert by_name(checks, "matmul fp32").status == FAIL
    assert by_name(checks, "host->device pinned").status == WARN
    assert by_name(checks, "host->device pageable").status == OK

    cpu = {"device": "cpu", "matmul": {"fp32": {"tflops": 0.1, "method": "m"}, "bf16": {"tflops": 0.001, "method": "m"}}}
    checks = measurement_checks(cpu)
    assert "100.0 GFLOPS" in by_name(checks, "matmul fp32").detail
    assert by_name(checks, "cpu precision").status == WARN


def cpu_meas(spread=0.02, **speed_vs_fp32):
    """CPU matmul facts: fp32 at 100 GFLOPS, each other dtype at the given multiple of it,
    each with its repeats within +-``spread`` of its median (None: no range recorded)."""
    def entry(tflops):
        rng = None if spread is None else [tflops * (1 - spread), tflops * (1 + spread)]
        return {"tflops": tflops, "method": "m", **({"tflops_range": rng} if rng else {})}

    return {"device": "cpu", "matmul": {dt: entry(0.1 * r) for dt, r in {"fp32": 1.0, **speed_vs_fp32}.items()}}


def test_cpu_precision_says_bf16_is_slower_here():
    meas = cpu_meas(bf16=0.4, fp16=0.05)
    advice = cpu_precision(meas)
    assert advice["recommended"] == "fp32" and advice["fastest"] == "fp32" and advice["override"] == "precision=none"
    assert advice["speed_vs_fp32"] == pytest.approx({"fp32": 1.0, "bf16": 0.4, "fp16": 0.05})
    assert advice["verdict_vs_fp32"] == {"bf16": "slower", "fp16": "slower"}
    c = by_name(measurement_checks(meas), "cpu precision")
    assert c.status == WARN
    assert c.detail == "fp32 is the fastest precision on this CPU: bf16 matmuls run at 0.40x fp32, fp16 matmuls run at 0.05x fp32"
    assert "precision=none" in c.fix and "AMX" in c.fix and "+sweep=ablation" in c.fix
    assert by_name(evaluate(report(cuda={"torch_device_count": 0, "nvml_device_count": 0}, gpus=[],
                                   measurements=meas)), "cpu precision").status == WARN
    assert cpu_precision(cpu_meas(spread=None, bf16=0.4))["verdict_vs_fp32"] == {"bf16": "slower"}  # medians alone


def test_cpu_precision_recommends_a_faster_precision_only_beyond_the_noise():
    c = by_name(measurement_checks(cpu_meas(bf16=2.0, fp16=1.2)), "cpu precision")
    assert c.status == OK and c.detail == (
        "bf16 matmuls run at 2.00x fp32 on this CPU (vs fp32: bf16 2.00x, fp16 1.20x): try precision=bf16 here; "
        "the ladder (perfrun train -m +sweep=ablation) times whole training steps")
    assert cpu_precision(cpu_meas(bf16=0.5, fp16=1.3))["override"] == "precision=fp16"
    # 5 % faster is inside a CPU matmul's noise: fp32, which needs no knob, stays the advice
    near = cpu_meas(bf16=1.05, fp16=0.97)
    assert cpu_precision(near)["fastest"] == "bf16" and cpu_precision(near)["recommended"] == "fp32"
    c = by_name(measurement_checks(near), "cpu precision")
    assert c.status == OK and c.detail == ("no precision is measurably faster than fp32 on this CPU "
                                           "(vs fp32: bf16 1.05x, fp16 0.97x, within the noise): "
                                           "fp32 (precision=none, the default) for matmuls; "
                                           "the ladder (perfrun train -m +sweep=ablation) times whole training steps")
    c = by_name(measurement_checks(cpu_meas(bf16=1.05, fp16=0.5)), "cpu precision")
    assert c.status == WARN and c.detail == "no precision is measurably faster than fp32 on this CPU: fp16 matmuls run at 0.50x fp32"
    # 1.3x by the medians, but the repeats overlap (a busy machine): not a measured gain, nor a loss
    noisy = cpu_meas(spread=0.4, bf16=1.3, fp16=0.75)
    advice = cpu_precision(noisy)
    assert advice["verdict_vs_fp32"] == {"bf16": "even", "fp16": "even"} and advice["recommended"] == "fp32"
    assert by_name(measurement_checks(noisy), "cpu precision").status == OK


def test_cpu_precision_needs_two_cpu_figures():
    assert cpu_precision(cpu_meas()) is None  # fp32 alone: nothing to compare
    failed = {"device": "cpu", "matmul": {"fp32": {"error": "boom"}, "bf16": {"tflops": 0.1, "method": "m"}}}
    assert cpu_precision({"device": "cpu", "matmul": {"fp32": {"tflops": 0.1}, "bf16": {"error": "boom"}}}) is None
    assert cpu_precision(failed) is None
    gpu_meas = {"device": "cuda:0", "matmul": {"fp32": {"tflops": 50.0, "method": "m"}, "bf16": {"tflops": 700.0, "method": "m"}}}
    assert cpu_precision(gpu_meas) is None
    assert [c for c in measurement_checks(gpu_meas) if c.name == "cpu precision"] == []


def test_render_lists_fixes_and_verdict():
    checks = evaluate(report(gpus=[dict(HEALTHY_GPU, persistence_mode=False, ecc_volatile_uncorrected=1)]))
    buf = io.StringIO()
    render({"gather_s": 1.0}, checks, Console(file=buf, width=200, color_system=None))
    out = buf.getvalue()
    assert "FAIL: " in out and "-pm 1" in out and "nvidia-smi -i 0 -r" in out and "what to do" in out
    assert f"[{UUID}]" in out  # square brackets in details are text, not rich markup


# --- gathering on the fake NVML ------------------------------------------------------------------


def test_nvml_gpu_facts_from_fake():
    me = os.getpid()
    g = FakeGpu(
        uuid=UUID, persistence=0, reasons=0x1 | 0x8, pcie_gen=3, mig=fake_nvml.NVMLError_NotSupported,
        ecc={(fake_nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, fake_nvml.NVML_VOLATILE_ECC): 2},
        processes=[(me, 500 * 2**20), (999_999, 2 * 2**30)],
        power_default_limit_mw=fake_nvml.NVMLError_NotSupported,
    )
    session = nvml_mod.Nvml(FakeNvml([g]))
    facts = nvml_gpu_facts(session, session.devices()[0])
    assert facts["uuid"] == UUID and facts["compute_capability"] == "9.0"
    assert facts["persistence_mode"] is False and facts["mig_mode"] is None
    assert facts["ecc_volatile_uncorrected"] == 2 and facts["ecc_volatile_corrected"] == 0
    assert facts["throttle_reasons"] == ["gpu_idle", "hw_slowdown"]
    assert facts["power_limit_w"] == 700.0 and facts["power_default_limit_w"] is None
    assert [p["pid"] for p in facts["other_processes"]] == [999_999]  # this process is not "another"
    assert facts["other_processes"][0]["used_mib"] == 2048.0
    statuses = {c.name: c.status for c in gpu_checks({**facts, "torch_index": 0})}
    assert statuses["ecc"] == FAIL and statuses["persistence mode"] == WARN
    assert statuses["other processes"] == WARN and statuses["mig"] == SKIP
    assert statuses["pcie link"] == OK  # Gen3 at idle is power saving, not a fault


def test_gather_with_nvml_gpus_torch_cannot_use(monkeypatch, tmp_path):
    """NVML (fake) sees a GPU, this CPU-only torch can't: a failure, with the GPU's facts reported."""
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    monkeypatch.setenv("PERFRUN_CACHE", str(tmp_path))
    monkeypatch.setattr(gathering, "measurement_facts", lambda device, **k: {"device": str(device), "matmul": {}})
    monkeypatch.setattr(gathering, "capability_facts", lambda device, **k: {"device": str(device), "sdpa": {}, "compile": {}})
    fake = FakeNvml([FakeGpu(uuid=UUID)])
    rep = gathering.gather(None, quick=True, nvml_module=fake)
    assert rep["cuda"] == {**rep["cuda"], "torch_device_count": 0, "nvml_device_count": 1}
    assert rep["gpus"][0]["uuid"] == UUID and rep["software"]["driver"] == "570.00.00"
    assert rep["software"]["cuda_driver"] == "12.8"
    checks = evaluate(rep)
    assert by_name(checks, "cuda device").status == FAIL and exit_code(checks) == 1


def test_pynvml_provenance_here():
    prov = pynvml_provenance()
    assert prov["importable"] is True
    assert prov["provider"] == "nvidia-ml-py", prov  # pyproject requires nvidia-ml-py, not pynvml
    assert prov["file"].endswith("pynvml.py")


def test_bad_device_argument(capsys):
    assert main(["--device", "-1"]) == 2
    assert "--device -1" in capsys.readouterr().err


# --- for real, on this machine ----------------------------------------------------------------------


@pytest.mark.slow
def test_gpu_check_quick_json_for_real(tmp_path):
    proc = run_cli("--quick", "--json", cwd=tmp_path, env={"PERFRUN_CACHE": str(tmp_path / "cache")}, timeout=120,
                   module="perfrun.gpucheck")
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document
    assert set(doc) >= {"software", "host", "cuda", "gpus", "capabilities", "measurements", "checks", "summary",
                        "exit_code", "verdict"}
    assert proc.returncode == doc["exit_code"]
    assert doc["software"]["torch"] == torch.__version__
    assert doc["host"]["output_dir"] == str(tmp_path.resolve())
    statuses = {c["name"]: c for c in doc["checks"]}
    assert statuses["torch.compile"]["status"] == "skip"  # --quick
    assert statuses["sdpa math"]["status"] == "ok"
    if torch.cuda.is_available():
        assert doc["measurements"]["matmul"]["bf16"]["tflops"] > 0
        return
    assert proc.returncode == 0 and doc["verdict"] == "pass"
    cuda = statuses["cuda device"]
    assert cuda["status"] == "warn" and "no CUDA device" in cuda["detail"] and cuda["fix"]
    fp32 = doc["measurements"]["matmul"]["fp32"]
    assert fp32["tflops"] > 0 and "perf_counter" in fp32["method"]
    assert doc["measurements"]["matmul"]["bf16"]["tflops"] > 0
    cached = json.loads((tmp_path / "cache" / "peaks.json").read_text())
    (key, entry), = cached["devices"].items()
    assert key.startswith("cpu: ") and entry["fp32"]["tflops"] == fp32["tflops"]
    assert entry["fp32"]["measured_by"] == "perfrun gpu-check"
    # which precision to train in on this CPU, from the matmuls just measured
    matmul = doc["measurements"]["matmul"]
    for dt in ("bf16", "fp16"):  # measured where it runs, interleaved with the others
        assert (dt in matmul) is doc["capabilities"][dt]
    assert "interleaved with" in matmul["fp32"]["method"]
    for m in matmul.values():
        low, high = m["tflops_range"]
        assert 0 < low <= m["tflops"] <= high
    advice = doc["precision_advice"]
    assert advice == json.loads(json.dumps(cpu_precision(doc["measurements"])))
    assert advice["speed_vs_fp32"]["fp32"] == 1.0 and set(advice["verdict_vs_fp32"]) == set(matmul) - {"fp32"}
    assert advice["recommended"] in matmul and advice["override"].startswith("precision=")
    advice_check = statuses["cpu precision"]
    assert advice_check["status"] in ("ok", "warn")
    if advice["recommended"] == "fp32":
        assert "precision=none" in advice_check["detail"] + (advice_check["fix"] or "")
    else:
        assert advice["override"] in advice_check["detail"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_check_on_real_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PERFRUN_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    code = main(["--quick", "--json", "--device", "0"])
    doc = json.loads(capsys.readouterr().out)
    assert code == doc["exit_code"]
    g = doc["gpus"][0]
    assert nvml_mod.normalize_uuid(g["uuid"]) == nvml_mod.normalize_uuid(torch.cuda.get_device_properties(0).uuid)
    m = doc["measurements"]
    assert m["matmul"]["bf16"]["tflops"] > 1 and m["h2d_pinned"]["gb_s"] > 0 and m["d2d_copy"]["gb_s"] > 0
