"""OmegaConf resolvers the YAML uses to turn a knob on only where it can act.

The ladder's rungs are written once for every device: ``${perfrun.if_cuda:${device},A,B}``
picks A where the job trains on CUDA (TF32, the compile mode that autotunes Triton kernels),
``${perfrun.if_fp8:${device},A,B}`` picks A where the GPU has FP8 tensor cores and torchao is
installed (``precision=fp8``). Elsewhere the rung keeps B, its configuration equals the rung
below, and the report shows it as not applicable.
"""

from __future__ import annotations

import importlib.util
from typing import Any

#: FP8 tensor-core matmuls: Ada (8.9), Hopper (9.0), Blackwell and later
FP8_MIN_CAPABILITY = (8, 9)


def _cuda_index(device: str) -> int | None:
    """The CUDA device index ``device`` trains on, or None where it is not CUDA."""
    import torch

    if str(device) == "auto":
        return torch.cuda.current_device() if torch.cuda.is_available() else None
    try:  # torch's parser, lenient about what this machine has (resolve_device refuses that later)
        parsed = torch.device(str(device))
    except RuntimeError:
        return None
    return (parsed.index or 0) if parsed.type == "cuda" else None


def device_kind(device: str) -> str:
    """``cuda`` where ``device`` trains on CUDA, else the device's type (``auto`` without a GPU: cpu)."""
    import torch

    if _cuda_index(device) is not None:
        return "cuda"
    try:
        return "cpu" if str(device) == "auto" else torch.device(str(device)).type
    except RuntimeError:
        return str(device)


def if_cuda(device: str, on_cuda: Any, otherwise: Any) -> Any:
    """``${perfrun.if_cuda:${device},A,B}``: A where ``device`` trains on CUDA, else B."""
    return on_cuda if _cuda_index(device) is not None else otherwise


def has_fp8(device: str) -> bool:
    """Whether ``device`` is a CUDA GPU with FP8 tensor cores and torchao is installed."""
    import torch

    index = _cuda_index(device)
    if index is None or not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return False
    return (torch.cuda.get_device_capability(index) >= FP8_MIN_CAPABILITY
            and importlib.util.find_spec("torchao") is not None)


def if_fp8(device: str, on_fp8: Any, otherwise: Any) -> Any:
    """``${perfrun.if_fp8:${device},A,B}``: A where ``device`` can train in FP8, else B."""
    return on_fp8 if has_fp8(device) else otherwise


#: where a rung's knob can act (conf/ablation/*.yaml ``ablation.acts_on``)
ACTS_ON = ("any", "cuda", "fp8")


def rung_applies(acts_on: str, device: str) -> bool:
    """Whether a ladder rung whose knob acts on ``acts_on`` changes anything on ``device``:
    a rung that cannot is skipped as not applicable rather than measured as noise."""
    if acts_on in ("any", "", None):
        return True
    if acts_on == "cuda":
        return _cuda_index(device) is not None
    if acts_on == "fp8":
        return has_fp8(device)
    raise ValueError(f"ablation.acts_on={acts_on} is not an option; choose one of {', '.join(ACTS_ON)}")


def register() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("perfrun.if_cuda", if_cuda, replace=True)
    OmegaConf.register_new_resolver("perfrun.if_fp8", if_fp8, replace=True)
