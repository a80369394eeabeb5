#!/usr/bin/env python3
"""Which torch APIs perfrun calls are missing from the torch installed here.

    python scripts/torch_api_probe.py [--json FILE] [--ci-torch VERSION]

The names come from perfrun's own source, read as code (``ast``): every ``torch.a.b`` chain
and every ``from torch.a import b``; plus the methods and classes perfrun reaches through
objects, which no chain names (FSDP2's prefetch setters, torchao's float8 entry points), and
the ones that the memory estimate and the measured FLOPs rely on. Each is resolved here
(importing the module part, then ``getattr`` for the rest); the missing ones are listed. The
first lines say which torch this is and which torch the tests run on (CI), so a GPU machine
with another torch says at once what of perfrun it cannot run. Exit 0 either way: a missing
API is a finding, and the paths that use it fail or are skipped on their own rows.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

PACKAGE = Path(__file__).resolve().parent.parent / "perfrun"
CI_TORCH = "2.13.0"  # the torch the CPU test suite runs on
# Reached through objects (no torch.* chain in the source names them), or used by the memory
# estimate and the measured FLOPs (torch.distributed._tools, fake tensors, the FLOP counter).
THROUGH_OBJECTS = (
    "torch.distributed.fsdp.FSDPModule.set_modules_to_forward_prefetch",
    "torch.distributed.fsdp.FSDPModule.set_modules_to_backward_prefetch",
    "torch.distributed.fsdp.FSDPModule.set_requires_gradient_sync",
    "torch.distributed.fsdp.FSDPModule.set_reshard_after_backward",
    "torch.distributed.tensor.DTensor.full_tensor",
    "torch.compiler.set_stance",
    "torch.compiler.cudagraph_mark_step_begin",
    "torch.nn.attention.sdpa_kernel",
    "torch.nn.attention.SDPBackend.CUDNN_ATTENTION",
    "torch.utils.flop_counter.FlopCounterMode",
    "torch.distributed._tools.mem_tracker.MemTracker",
    "torch._subclasses.fake_tensor.FakeTensorMode",
    "torch.cuda.memory._record_memory_history",
    "torch.cuda.memory._dump_snapshot",
)
TORCHAO = ("torchao.float8.convert_to_float8_training", "torchao.float8.Float8LinearConfig.from_recipe_name")


def chain(node: ast.AST) -> str | None:
    """``torch.a.b`` for an Attribute chain rooted at the name ``torch``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "torch" and parts:
        return ".".join(["torch", *reversed(parts)])
    return None


def used_names(package: Path = PACKAGE) -> dict[str, list[str]]:
    """Every torch name perfrun's code uses, with the files that use it."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        where = str(path.relative_to(package.parent))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
                name = chain(node)
                if name:
                    names.append(name)
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
                names += [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
            elif isinstance(node, ast.Import):
                names += [a.name for a in node.names if a.name.split(".")[0] == "torch"]
            for name in names:
                found.setdefault(name, set()).add(where)
    # a chain's prefixes are checked by the chain itself: keep the longest ones
    longest = {n for n in found if not any(o.startswith(n + ".") for o in found)}
    return {n: sorted(found[n]) for n in sorted(longest)}


def resolve(name: str) -> str | None:
    """None when ``name`` exists here; else why not (one line)."""
    parts = name.split(".")
    obj: Any = None
    for i in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        except Exception as e:  # noqa: BLE001 - a module that fails to import is a finding too
            return f"importing {'.'.join(parts[:i])} failed: {type(e).__name__}: {e}"
        break
    else:
        return f"no module {parts[0]}"
    for attr in parts[i:]:
        if not hasattr(obj, attr):
            return f"{'.'.join(parts[:parts.index(attr)])} has no {attr}"
        obj = getattr(obj, attr)
    return None


def probe(package: Path = PACKAGE) -> dict[str, Any]:
    used = used_names(package)
    extra = {n: ["(reached through objects or by the estimate)"] for n in THROUGH_OBJECTS if n not in used}
    checks = {**used, **extra}
    missing = {n: {"why": why, "used_in": checks[n]} for n in checks if (why := resolve(n)) is not None}
    torchao: dict[str, str | None] = {}
    if importlib.util.find_spec("torchao") is not None:
        torchao = {n: resolve(n) for n in TORCHAO}
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "ci_torch": CI_TORCH,
            "python": platform.python_version(), "checked": len(checks), "missing": missing,
            "torchao": {"installed": bool(torchao), "missing": {n: w for n, w in torchao.items() if w}}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args(argv)
    result = probe()
    miss, ao = result["missing"], result["torchao"]
    for name, info in miss.items():
        print(f"missing {name}: {info['why']} (used in {', '.join(info['used_in'][:3])})")
    for name, why in ao["missing"].items():
        print(f"missing {name}: {why}")
    torchao = ("torchao not installed (precision=fp8 refuses)" if not ao["installed"] else
               f"torchao float8 entry points: {len(TORCHAO) - len(ao['missing'])} of {len(TORCHAO)} present")
    print(f"torch {result['torch']} here (CUDA {result['cuda']}, Python {result['python']}; the tests run on torch "
          f"{result['ci_torch']}): {result['checked']} torch APIs perfrun uses checked, missing here: "
          f"{', '.join(miss) or 'none'}; {torchao}")  # last: the smoke table's row
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
