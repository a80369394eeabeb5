"""Checks on one GPU's facts (NVML and torch): pure, so tests feed them hand-written facts.

Every check that cannot be read on this GPU (a consumer card without ECC, a MIG slice,
a driver without the call) is ``skip`` with what was missing, never a guess.
"""

from __future__ import annotations

from typing import Any

from perfrun.console import fmt
from perfrun.gpucheck.verdict import FAIL, NA, OK, SKIP, WARN, Check
from perfrun.telemetry.nvml import SLOWDOWN_REASONS

#: Memory used on an idle GPU by processes we cannot see (another container), as a share.
HIDDEN_MEM_WARN_SHARE = 0.10


def gpu_checks(g: dict[str, Any]) -> list[Check]:
    """Every check on one GPU's facts (NVML + torch); N/A facts give ``skip``."""
    label = f"gpu {g.get('torch_index', g.get('nvml_index'))}"
    i = g.get("nvml_index", 0)
    out = [Check(
        label, "identity", OK,
        f"{g.get('name')} [{g.get('uuid')}], compute capability {g.get('compute_capability') or 'N/A'}, "
        f"{fmt(g.get('memory_total_mib'), ',.0f', missing=NA)} MiB",
    )]
    if not g.get("nvml"):
        out.append(Check(label, "nvml", SKIP, f"NVML unavailable ({g.get('nvml_error')}): no driver-level facts"))
        return out

    out.append(Check(
        label, "clocks", OK,
        f"SM {fmt(g.get('sm_clock_mhz'), '.0f', missing=NA)}/{fmt(g.get('sm_clock_max_mhz'), '.0f', missing=NA)} MHz, "
        f"memory {fmt(g.get('mem_clock_mhz'), '.0f', missing=NA)}/{fmt(g.get('mem_clock_max_mhz'), '.0f', missing=NA)} MHz (current/max), "
        f"{fmt(g.get('temp_c'), '.0f', missing=NA)} C, {fmt(g.get('power_w'), '.0f', missing=NA)} W",
    ))

    limit, default = g.get("power_limit_w"), g.get("power_default_limit_w")
    if limit is None:
        out.append(Check(label, "power limit", SKIP, "N/A"))
    elif default and limit < 0.95 * default:
        out.append(Check(
            label, "power limit", WARN, f"power limit {limit:.0f} W is below the default {default:.0f} W: clocks will cap early",
            f"sudo nvidia-smi -i {i} -pl {default:.0f}",
        ))
    else:
        out.append(Check(label, "power limit", OK, f"{limit:.0f} W" + (f" (default {default:.0f} W)" if default else "")))

    pm = g.get("persistence_mode")
    if pm is None:
        out.append(Check(label, "persistence mode", SKIP, "N/A on this GPU/OS"))
    elif not pm:
        out.append(Check(
            label, "persistence mode", WARN, "off: the driver unloads when idle, so each run's first CUDA call is slow",
            f"sudo nvidia-smi -i {i} -pm 1 (or enable the nvidia-persistenced service)",
        ))
    else:
        out.append(Check(label, "persistence mode", OK, "on"))

    out.append(_ecc_check(label, i, g))
    out.append(_pcie_check(label, g))

    mig = g.get("mig_mode")
    if mig is None:
        out.append(Check(label, "mig", SKIP, "MIG not supported"))
    elif mig:
        out.append(Check(
            label, "mig", WARN,
            "MIG is enabled: torch sees a slice, and utilisation/power telemetry is N/A on slices",
            f"for the whole GPU: sudo nvidia-smi -i {i} -mig 0 (with no processes running), then reset the GPU",
        ))
    else:
        out.append(Check(label, "mig", OK, "disabled"))

    out.append(_throttle_check(label, g))
    out.append(_process_check(label, g))
    return out


def _ecc_check(label: str, i: int, g: dict[str, Any]) -> Check:
    mode = g.get("ecc_mode")
    if mode is None:
        return Check(label, "ecc", SKIP, "ECC not supported (typical of consumer GPUs)")
    vol_unc = g.get("ecc_volatile_uncorrected") or 0
    vol_cor = g.get("ecc_volatile_corrected") or 0
    agg_unc = g.get("ecc_aggregate_uncorrected") or 0
    counts_text = f"volatile uncorrected {vol_unc}, corrected {vol_cor}; lifetime uncorrected {agg_unc}"
    if vol_unc > 0:
        return Check(
            label, "ecc", FAIL, f"uncorrected ECC errors since the driver loaded ({counts_text}): results may be wrong",
            f"stop work on this GPU and reset it (sudo nvidia-smi -i {i} -r) or reboot; if errors return, "
            "report the GPU to your provider",
        )
    if vol_cor > 0 or agg_unc > 0:
        return Check(
            label, "ecc", WARN, f"ECC errors recorded ({counts_text})",
            "watch `nvidia-smi -q -d ECC`; if counts grow, reset the GPU and report it to your provider",
        )
    return Check(label, "ecc", OK, f"{'on' if mode else 'off'}; {counts_text}")


def _pcie_check(label: str, g: dict[str, Any]) -> Check:
    gen, gen_max = g.get("pcie_gen"), g.get("pcie_gen_max")
    width, width_max = g.get("pcie_width"), g.get("pcie_width_max")
    if None in (gen, gen_max, width, width_max):
        return Check(label, "pcie link", SKIP, "PCIe link N/A")
    text = f"Gen{gen} x{width} (max Gen{gen_max} x{width_max})"
    below = gen < gen_max or width < width_max
    if not below:
        return Check(label, "pcie link", OK, text + (" under load" if g.get("pcie_under_load") else ""))
    if not g.get("pcie_under_load"):
        return Check(label, "pcie link", OK, text + " at idle; GPUs lower the link speed when idle to save power")
    return Check(
        label, "pcie link", WARN, text + " while copying: host-to-device transfers are slower than the slot allows",
        "reseat the GPU or move it to a full x16 slot of its generation; check the BIOS PCIe settings and risers "
        "(`nvidia-smi -q -d PCIE`)",
    )


def _throttle_check(label: str, g: dict[str, Any]) -> Check:
    reasons = g.get("throttle_reasons")
    if reasons is None:
        return Check(label, "throttling", SKIP, "clock-event reasons N/A")
    slow = [r for r in reasons if r in SLOWDOWN_REASONS]
    busy = bool(g.get("other_processes")) or (g.get("utilization_pct") or 0) >= 10
    if slow and not busy:
        return Check(
            label, "throttling", WARN, f"throttled at idle: {', '.join(slow)}",
            "check cooling, airflow and power cabling; `nvidia-smi -q -d PERFORMANCE` shows which limit is hit "
            "(sw_power_cap at idle means the power limit is set too low: `nvidia-smi -pl`)",
        )
    state = "busy" if busy else "idle"
    return Check(label, "throttling", OK, f"{state}; clock-event reasons now: {', '.join(reasons) or 'none'}")


def _process_check(label: str, g: dict[str, Any]) -> Check:
    others = g.get("other_processes")
    total = g.get("memory_total_mib")
    used = g.get("memory_used_mib")
    if others:
        listed = ", ".join(
            f"pid {p.get('pid')} ({p.get('name') or '?'}, {fmt(p.get('used_mib'), ',.0f', missing=NA)} MiB)" for p in others[:5]
        )
        return Check(
            label, "other processes", WARN, f"{len(others)} other process(es) on this GPU: {listed}",
            "stop them, or pick a free GPU (--device N / CUDA_VISIBLE_DEVICES); shared GPUs give noisy measurements",
        )
    if others is not None and used is not None and total and used > HIDDEN_MEM_WARN_SHARE * total:
        return Check(
            label, "other processes", WARN,
            f"{used:,.0f} of {total:,.0f} MiB in use by processes not visible from here (another container?)",
            "find the owner with `nvidia-smi` on the host, or pick a free GPU (--device N / CUDA_VISIBLE_DEVICES)",
        )
    if others is None:
        return Check(label, "other processes", SKIP, "process list N/A")
    return Check(label, "other processes", OK, f"none; {fmt(used, ',.0f', missing=NA)} MiB in use")

