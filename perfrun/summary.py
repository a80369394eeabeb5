"""summary.json: what one training job tells when it ends. This TypedDict is the one
definition of its keys; the trainer writes it and report, tune, sweeps and the
benchmark scripts read it through :func:`read_summary`, so a renamed key breaks a type
check instead of a table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, TypedDict

SUMMARY_FILE = "summary.json"

# skipped: a ladder rung whose knob cannot act on this device or model (perfrun/ladder/rungs.py)
Status = Literal["running", "completed", "interrupted", "failed", "skipped"]


class RunSummary(TypedDict, total=False):
    # what the job was and how it ended
    status: Status
    reason: str
    overrides: list[str]
    config: dict[str, Any]  # as composed, with the data's tokenizer and vocabulary and the batch size found
    resolved: dict[str, Any]  # what setup found out: device, batch_size, tokenizer, vocab_size, vocab_size_padded
    rank: int
    world_size: int
    resumed_from: str | None
    resumed_from_step: int | None  # the checkpoint's step this job continued from (None: from step 0)
    history: list[dict[str, Any]]  # the summaries of the earlier jobs in this run dir, oldest first
    wall_s: float
    setup_s: float
    interrupted_by: int | None
    failure: str | None
    # the model, the data and the knobs as applied
    knobs: dict[str, Any]
    fused_adamw: bool
    params: int
    params_non_embedding: int
    vocab_size: int
    vocab_size_padded: int
    seq_len: int
    tokens_per_step: int
    flops_per_token: float  # what MFU uses: the model's formula, else the counted figure
    flops_per_token_source: str  # formula | counted | none
    flops_per_token_counted: float | None  # FlopCounterMode over one forward and backward (perfrun/models/flops.py)
    flops_per_token_formula: float | None  # the model's flops_per_token(seq_len), where it has one
    model_class: str  # the module trained (perfrun.models.gpt.GPT, or the user's class)
    knob_fits: list[dict[str, Any]]  # each configured knob: applies or not, and why (perfrun/models/contract.py)
    data: str
    batch_size_auto: dict[str, Any] | None
    runtime: dict[str, Any]  # runtime.gc and runtime.malloc as the job applied them (perfrun/loop/runtime.py)
    memory_snapshot: bool | None
    memory_snapshot_path: str | None
    environment: dict[str, Any]
    global_state_at_start: dict[str, Any]
    global_state_after: dict[str, Any]
    # MFU's denominator
    mfu_peak_tflops: float | None
    mfu_peak_source: str
    mfu_dtype: str
    datasheet_tflops: float | None
    datasheet_note: str
    measured_tflops: float | None
    # the figures
    steps: int
    start_step: int
    tokens: int
    train_time_s: float
    eval_time_s: float
    checkpoint_time_s: float
    first_step_s: float | None
    step_time_ms_median: float | None
    steady_steps: int
    tokens_per_s_median: float | None
    tokens_per_s_mean: float | None
    tokens_per_s_per_rank_median: float | None
    mfu_median: float | None
    peak_mem_mib: float
    peak_mem_source: str
    data_wait_pct: float | None  # old runs' name of host_data_wait_pct
    host_data_wait_pct: float | None  # the host's wait for the DataLoader, % of the step's wall time
    gpu_starved_pct: float | None  # CUDA: % of the step the GPU waited for its next batch
    compile_s_estimate: float | None
    final_train_loss: float | None
    final_val_loss: float | None
    step_breakdown: dict[str, Any]
    data_position: dict[str, int]
    checkpoints: list[str]
    guard: dict[str, Any]
    # telemetry
    monitor: dict[str, Any]
    monitor_ranks: list[dict[str, Any]]
    monitor_job: dict[str, Any]
    host_load: dict[str, Any]  # the host CPU over the steady steps (start and end of the loop): contention is judged by it where the monitor has no figure
    contention: dict[str, Any]  # did the job have the machine? telemetry.contention.assess


def read_summary(path: Path) -> RunSummary:
    """A job's summary.json (``path`` is the file or its run dir). Raises OSError or
    ValueError for a missing or unreadable file; the caller says which run."""
    path = Path(path)
    if path.is_dir():
        path = path / SUMMARY_FILE
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data  # type: ignore[return-value]


# What perfrun report reads of a summary.json, and the JSON types each may have (a figure is a
# number or null, never a bool or a string): a summary.json of another shape is said, not drawn.
NUMBER = (int, float, type(None))
REPORTED: dict[str, tuple[type, ...]] = {
    "status": (str,), "reason": (str, type(None)), "overrides": (list, type(None)), "config": (dict, type(None)),
    "knobs": (dict, type(None)), "environment": (dict, type(None)), "contention": (dict, type(None)),
    "peak_mem_source": (str, type(None)), **{key: NUMBER for key in (
        "tokens_per_s_median", "mfu_median", "peak_mem_mib", "host_data_wait_pct", "data_wait_pct",
        "gpu_starved_pct", "final_train_loss", "final_val_loss", "first_step_s")},
}
REPORTED_INSIDE: dict[tuple[str, str], tuple[type, ...]] = {
    ("config", "ablation"): (dict, type(None)), ("config", "repeat"): (int, type(None)),
    ("contention", "contended"): (bool, type(None)), ("contention", "evidence"): (list, type(None)),
    **{("environment", key): (str, type(None)) for key in ("device_name", "device_type", "torch", "cuda")},
}


def shape_problem(data: dict[str, Any]) -> str | None:
    """The first key :data:`REPORTED` (or :data:`REPORTED_INSIDE`) names whose value is not of
    its type, said as ``key is VALUE, not TYPE``; None when the summary has the shape perfrun
    writes. Keys that are absent are fine (older runs lack some)."""
    from perfrun.console import json_kinds

    checks = [(key, data.get(key), types) for key, types in REPORTED.items() if key in data]
    checks += [(f"{outer}.{inner}", data[outer][inner], types) for (outer, inner), types in REPORTED_INSIDE.items()
               if isinstance(data.get(outer), dict) and inner in data[outer]]
    for key, value, types in checks:
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            shown = json.dumps(value, default=str)
            return f"{key} is {shown[:60]}, not {json_kinds(types)}"
    return None
