"""The user's own code, named on the command line: ``model.target`` and ``data.target``.

A target is ``pkg.module.ClassName`` (a module on the Python path) or
``path/to/file.py:ClassName``; the class is called with its ``args`` as keyword arguments.
Importing it runs the user's own code, which is the point of ``model=custom``; nothing perfrun
reads (config, checkpoints, data files) runs code. Each failure is one ConfigError line.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
