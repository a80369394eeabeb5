"""MFU's denominator: which peak FLOPS a run is measured against, and why.

The figures themselves live in :mod:`perfrun.telemetry.peaks` (the datasheet table and
gpu-check's measured matmul peak); this module picks one for the run, as ``mfu.peak``
asks, and says where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from perfrun.environment import device_name
from perfrun.summary import RunSummary
from perfrun.telemetry.peaks import datasheet_peak_tflops, measured_peak_tflops


def mfu_dtype(autocast_dtype: str, device: torch.device, tf32: bool) -> str:
    """The precision the matmuls run in, as the peak tables name it."""
    if autocast_dtype == "bfloat16":
        return "bf16"
    if autocast_dtype == "float16":
        return "fp16"
    return "tf32" if (device.type == "cuda" and tf32) else "fp32"


@dataclass
class Peak:
    """The peak TFLOPS MFU divides by (None: MFU is not reported, ``source`` says why)."""

    tflops: float | None
    source: str
    dtype: str
    sources: dict[str, Any] = field(default_factory=dict)  # the datasheet's (and measured) TFLOPS, for the summary

    def facts(self) -> RunSummary:
        return {"mfu_peak_tflops": self.tflops, "mfu_peak_source": self.source, "mfu_dtype": self.dtype,
                **self.sources}  # type: ignore[typeddict-item]

    def describe(self) -> str:
        sheet = self.sources.get("datasheet_tflops")
        return (f"MFU peak: {f'{self.tflops:,.1f} TFLOPS {self.dtype}' if self.tflops else 'none'} ({self.source})"
                + (f"; datasheet {sheet:,.1f} TFLOPS" if sheet and sheet != self.tflops else ""))


def resolve_peak(choice: str, device: torch.device, dtype_name: str) -> Peak:
    """``mfu.peak``: the datasheet table, gpu-check's measurement, or the user's number."""
    name = device_name(device)
    sheet, sheet_note = datasheet_peak_tflops(name, dtype_name)
    sources: dict[str, Any] = {"datasheet_tflops": sheet, "datasheet_note": sheet_note}
    if choice == "datasheet":
        return Peak(sheet, f"datasheet {dtype_name} peak for {name}" if sheet else sheet_note, dtype_name, sources)
    if choice == "measured":
        measured, how = measured_peak_tflops(device, dtype_name)
        sources["measured_tflops"] = measured
        return Peak(measured, f"measured {dtype_name} matmul peak ({how})", dtype_name, sources)
    return Peak(float(choice), "mfu.peak given by the user", dtype_name, sources)
