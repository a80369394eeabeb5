"""``model=custom model.target=...``: the user's own nn.Module, and (``data=custom``) dataset.

``target`` is ``pkg.module.ClassName`` (a module on the Python path) or
``path/to/file.py:ClassName``; the class is called with ``args`` as keyword arguments.
Importing it runs the user's own code, which is the point; nothing perfrun reads (config,
checkpoints, data files) runs code. Each failure is one ConfigError line: an unknown target,
a class that raises in ``__init__``, a forward that does not return ``(logits or None, loss)``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from perfrun.config import ConfigError
from perfrun.console import first_line


def load_class(target: str, what: str) -> Any:
    """The class ``target`` names (``pkg.module.Class`` or ``file.py:Class``)."""
    module_name, sep, name = target.rpartition(":") if ".py:" in target else target.rpartition(".")
    if not sep or not module_name or not name:
        raise ConfigError(f"{what}={target} is not pkg.module.ClassName or path/to/file.py:ClassName; give one of those")
    try:
        module = _import_file(Path(module_name).expanduser(), what) if module_name.endswith(".py") \
            else importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module: whatever it raises is one line
        raise ConfigError(f"{what}={target}: importing {module_name} failed ({type(e).__name__}: {first_line(e)}); "
                          "check the module name and that it is on the Python path (PYTHONPATH)") from None
    found = getattr(module, name, None)
    if not callable(found):
        raise ConfigError(f"{what}={target}: {module_name} has no class {name}; check the name")
    return found


def _import_file(path: Path, what: str) -> Any:
    if not path.is_file():
        raise ConfigError(f"{what}: {path} is not a file; give the path of your .py file")
    name = f"perfrun_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling (DataLoader workers) look the module up
    spec.loader.exec_module(module)
    return module


def instantiate(target: str, args: Mapping[str, Any], what: str, **given: Any) -> Any:
    """``target(**given, **args)``, any exception in the user's ``__init__`` as one line."""
    cls = load_class(target, what)
    kwargs = {**given, **{str(k): _plain(v) for k, v in args.items()}}
    try:
        return cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's constructor
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ConfigError(f"{what}={target}({shown}) raised {type(e).__name__}: {first_line(e)}; "
                          f"fix the class or its arguments ({what.rsplit('.', 1)[0]}.args)") from None


def _plain(value: Any) -> Any:
    """An OmegaConf node as plain Python (lists and dicts), for the user's constructor."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def build_custom(target: str, args: Mapping[str, Any]) -> nn.Module:
    """The user's model; refused where it is no nn.Module."""
    model = instantiate(target, args, "model.target")
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.target={target} built a {type(model).__name__}, not a torch.nn.Module; "
                          "point model.target at an nn.Module subclass")
    return model


def check_forward(model: nn.Module, sample: torch.Tensor, target: torch.Tensor, name: str) -> None:
    """One forward on a batch of one: it must return (logits or None, a scalar loss tensor)."""
    try:
        out = model(sample.unsqueeze(0), target.unsqueeze(0))
    except Exception as e:  # noqa: BLE001 - the user's forward
        raise ConfigError(f"model {name}: forward(idx, targets) raised {type(e).__name__}: {first_line(e)}; "
                          "it must take a batch of the dataset's inputs and targets") from None
    ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor) and out[1].numel() == 1 \
        and out[1].is_floating_point() and out[1].requires_grad
    if not ok:
        got = (f"a tuple of {len(out)}" if isinstance(out, tuple) else type(out).__name__)
        raise ConfigError(f"model {name}: forward(idx, targets) returned {got}; it must return (logits or None, loss) "
                          "with loss a scalar tensor that requires grad (perfrun.models.contract.Model)")
