"""``perfrun gpu-check [--json] [--quick] [--device N]``: flags, so argparse (not Hydra)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console

from perfrun.gpucheck.checks import evaluate
from perfrun.gpucheck.gather import gather
from perfrun.gpucheck.render import add_verdict, render, to_json


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="perfrun gpu-check",
        description="Diagnose this machine (software, GPUs, host) and measure matmul and copy throughput. "
        "Exit status 1 when a check fails; warnings do not fail.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document to stdout instead of the report")
    p.add_argument("--device", type=int, default=None, metavar="N", help="check and measure only CUDA device N (torch's numbering)")
    p.add_argument("--quick", action="store_true", help="smaller measurements and no torch.compile smoke test")
    return p


@contextlib.contextmanager
def _stdout_to_stderr(enabled: bool) -> Iterator[None]:
    """With --json, stdout carries only the document: anything else printed goes to stderr."""
    if not enabled:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _missing_device(index: int | None) -> str | None:
    """``--device N`` that this machine does not have: one line naming the devices it has."""
    if index is None:
        return None
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return (f"--device {index}: this machine has no CUDA device (torch {torch.__version__}, CUDA "
                f"{torch.version.cuda or 'none'}); drop --device to check the CPU")
    if index >= n:
        names = ", ".join(f"{i}: {torch.cuda.get_device_name(i)}" for i in range(n))
        return f"--device {index} does not exist: this machine has {n} CUDA device(s) ({names}); pick one of them"
    return None


def main(argv: list[str] | None = None, *, nvml_module: Any = None) -> int:
    """Gather, judge, print; the exit status is 1 when a check failed, 2 for a bad flag."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.device is not None and args.device < 0:
        print(f"perfrun gpu-check: --device {args.device} must be >= 0", file=sys.stderr)
        return 2
    missing = _missing_device(args.device)
    if missing is not None:
        print(f"perfrun: error: {missing}", file=sys.stderr)
        return 2
    with _stdout_to_stderr(args.json):
        report = gather(args.device, quick=args.quick, nvml_module=nvml_module)
        checks = evaluate(report)
        _memory_estimate(report, quick=args.quick)
    add_verdict(report, checks)
    if args.json:
        sys.stdout.write(to_json(report))
    else:
        render(report, checks, Console())
        if "memory_estimate" in report:
            from perfrun.memory.preflight import gpu_check_line

            Console(highlight=False).print(gpu_check_line(report["memory_estimate"]), markup=False)
    return report["exit_code"]


def _memory_estimate(report: dict[str, Any], *, quick: bool) -> None:
    """The GPT-2 124M shape's estimated peak against the checked GPU's memory (not with
    --quick, not without a GPU): an estimate, labelled so."""
    index = report.get("device_index") or 0
    if quick or not report["cuda"]["torch_device_count"] or index >= report["cuda"]["torch_device_count"]:
        return
    import torch

    from perfrun.memory.preflight import gpu_check_estimate

    bf16 = bool((report.get("capabilities") or {}).get("bf16"))
    report["memory_estimate"] = gpu_check_estimate(torch.device("cuda", index), bf16)
