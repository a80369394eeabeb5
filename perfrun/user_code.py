"""The user's own code, named on the command line: ``model.target`` and ``data.target``.

A target is ``pkg.module.ClassName`` (a module on the Python path) or
``path/to/file.py:ClassName``; the class is called with its ``args`` as keyword arguments.
Importing it runs the user's own code, which is the point of ``model=custom``; nothing perfrun
reads (config, checkpoints, data files) runs code. Each failure is one ConfigError line.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from perfrun.config import ConfigError
from perfrun.console import first_line

T = TypeVar("T")


def load_class(target: str, what: str) -> Any:
    """The class ``target`` names (``pkg.module.Class`` or ``file.py:Class``)."""
    module_name, sep, name = target.rpartition(":") if ".py:" in target else target.rpartition(".")
    if not sep or not module_name or not name:
        raise ConfigError(f"{what}={target} is not pkg.module.ClassName or path/to/file.py:ClassName; give one of those")
    try:
        module = _as_a_library(lambda: _import_file(Path(module_name).expanduser(), what)
                               if module_name.endswith(".py") else importlib.import_module(module_name),
                               f"{what}={target}: importing {module_name}", Path(module_name).name)
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
        module = target.rpartition(":")[0] if ".py:" in target else target.rpartition(".")[0]
        return _as_a_library(lambda: cls(**kwargs), f"{what}={target}: its __init__", Path(module).name)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's constructor
        shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise ConfigError(f"{what}={target}({shown}) raised {type(e).__name__}: {first_line(e)}; "
                          f"fix the class or its arguments ({what.rsplit('.', 1)[0]}.args)") from None


def _as_a_library(call: Callable[[], T], doing: str, program: str) -> T:
    """``call()`` (an import or a constructor of the user's) as library code: it sees a command
    line of no arguments, as ``program`` run alone would (``sys.argv`` holds perfrun's own),
    and a ``sys.exit`` in it (an argument parser at import, an exit in ``__init__``) becomes
    one ConfigError line, with the last line the code printed on stderr (an argument parser's
    complaint), instead of ending perfrun there. What it prints on stderr otherwise is passed
    on once it returns."""
    printed = io.StringIO()
    argv = sys.argv
    sys.argv = [program]
    try:
        with contextlib.redirect_stderr(printed):
            result = call()
    except SystemExit as e:
        said = [line.strip() for line in printed.getvalue().splitlines() if line.strip()]
        why = f" after printing {said[-1]!r}" if said else ""
        raise ConfigError(f"{doing} called sys.exit({e.code}){why}; perfrun imports and builds it as a library: "
                          "keep command-line parsing and exits under if __name__ == '__main__'") from None
    except BaseException:
        sys.stderr.write(printed.getvalue())
        raise
    finally:
        sys.argv = argv
    sys.stderr.write(printed.getvalue())
    return result


def _plain(value: Any) -> Any:
    """An OmegaConf node as plain Python (lists and dicts), for the user's constructor."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
