"""The house rules, checked over perfrun/'s source: no import cycle (lazy imports count), imports
between packages only in the directions :data:`MAY_IMPORT` allows, no private name imported
across modules, no private module of Hydra's, no module over 500 lines, a training loop that
fits on one screen; and over tests/: no test patches an attribute of a third-party module.
Each rule reads the real source, so breaking one fails here, not in a review."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "perfrun"

# The allowed directions between perfrun's packages, written once (docs/architecture.md describes
# them). The ground floor is perfrun's root modules: every package may import them, and they import
# nothing but each other. A package imports its own modules, the ground floor and the packages named
# here; any other arrow fails test_imports_follow_the_allowed_directions. An entry point (a
# ``__main__`` module) is a command.
GROUND = {"perfrun", "config", "model_schema", "validate", "console", "summary", "distributed", "devices", "device_conditions",
          "environment", "user_code"}
LIBRARY = {"ladder", "loop", "memory", "optim", "knobs", "models", "data", "checkpoint", "telemetry", "inference", "report",
           "prepare", "tune", "gpucheck"}
MAY_IMPORT: dict[str, set[str]] = {
    "commands": LIBRARY,  # one thin module per command over the library
    # the ladder plans, runs and reads a sweep of jobs: the loop runs each, the report renders them
    "ladder": {"loop", "memory", "knobs", "models", "data", "checkpoint", "telemetry", "report"},
    "loop": {"memory", "optim", "knobs", "models", "data", "checkpoint", "telemetry"},  # setup and the schedule
    # the estimate builds the run's model and knobs under fake tensors; the breakdown writes
    # through telemetry's sinks; the loop hands its own step to the batch-size trials
    "memory": {"optim", "knobs", "models", "telemetry"},
    "optim": set(),  # the optimizer: the loop steps it, the estimate counts its state
    "knobs": {"models"},  # a knob acts on the model (the chunked loss on its head)
    "inference": {"models", "data", "checkpoint"},  # a saved run, rebuilt and sampled
    "prepare": {"data", "checkpoint"},  # a corpus written as the data sources read it
    "gpucheck": {"telemetry"},  # the peaks and the NVML readings the trainer uses too
    "report": {"checkpoint"},  # atomic writes
    "telemetry": {"checkpoint"},  # atomic writes
    "data": {"checkpoint"},  # atomic writes
    "tune": {"loop", "report"},  # its trials are short runs of the trainer, shown as a report's table
    "models": {"checkpoint"},  # the Hugging Face layout's safetensors, written atomically
    "checkpoint": set(),  # saves Stateful parts: knows no class of the loop, the knobs or the models
}
# Arrows against the directions that stay until the work named beside them lands; each must still
# exist (a mended one is taken off this list), and no other may join them.
KNOWN_BREACHES: dict[tuple[str, str], str] = {}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once for every rule below (the source does not change
    while the tests run)."""
    return ast.parse(path.read_text())


@pytest.fixture(scope="module", autouse=True)
def _trees_given_back() -> Iterator[None]:
    """The trees are let go with this file: the test process has other files to run."""
    yield
    _tree.cache_clear()


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The perfrun modules ``name`` imports, at the top or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules and base != "perfrun":
                    found.add(base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    found.discard(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_a_planted_cycle_is_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _package(module: str) -> str:
    """``perfrun.loop.step`` -> loop; a root module is its own name; an entry point is a command."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "commands"
    return parts[1] if len(parts) > 1 else "perfrun"


def _breaches(graph: dict[str, set[str]]) -> list[str]:
    """Every module arrow between packages that :data:`MAY_IMPORT` does not allow."""
    out = []
    for source, targets in graph.items():
        for target in targets:
            a, b = _package(source), _package(target)
            allowed = a == b or b in GROUND or (a not in GROUND and b in MAY_IMPORT.get(a, set()))
            if not allowed and (source, target) not in KNOWN_BREACHES:
                out.append(f"{source} -> {target} ({a} may import {sorted(MAY_IMPORT.get(a, set())) or 'no package'})")
    return sorted(out)


def test_imports_follow_the_allowed_directions() -> None:
    modules = _modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert _breaches(graph) == []
    arrows = {(source, target) for source, targets in graph.items() for target in targets}
    assert set(KNOWN_BREACHES) <= arrows  # a mended breach leaves the list
    unknown = {_package(name) for name in modules} - GROUND - set(MAY_IMPORT)
    assert unknown == set()  # a new package says what it may import


def test_a_planted_arrow_against_the_directions_is_found() -> None:
    graph = {"perfrun.knobs.fp8": {"perfrun.inference.int8", "perfrun.models.gpt", "perfrun.config"},
             "perfrun.checkpoint.checkpointer": {"perfrun.loop.step"},
             "perfrun.config": {"perfrun.models.gpt"},
             "perfrun.gpucheck.__main__": {"perfrun.commands.gpu_check"}}
    assert _breaches(graph) == [
        "perfrun.checkpoint.checkpointer -> perfrun.loop.step (checkpoint may import no package)",
        "perfrun.config -> perfrun.models.gpt (config may import no package)",
        "perfrun.knobs.fp8 -> perfrun.inference.int8 (knobs may import ['models'])",
    ]


def test_the_directions_say_what_the_design_says() -> None:
    """Commands use everything; the ladder uses the loop and the report, and nothing in the
    library uses the ladder; the loop uses memory, optim, knobs, models, data, checkpoint,
    telemetry; memory sits below the loop; optim below both; checkpoint, models, data and telemetry use none of loop, memory,
    knobs or commands; knobs never import inference; nothing in the library imports commands."""
    assert MAY_IMPORT["commands"] == LIBRARY == set(MAY_IMPORT) - {"commands"}
    assert {"loop", "report"} <= MAY_IMPORT["ladder"]
    assert all("ladder" not in MAY_IMPORT[p] for p in LIBRARY)
    assert MAY_IMPORT["loop"] == {"memory", "optim", "knobs", "models", "data", "checkpoint", "telemetry"}
    assert "loop" not in MAY_IMPORT["memory"] and MAY_IMPORT["optim"] == set()
    assert all(not MAY_IMPORT[p] & {"loop", "memory", "knobs", "commands"}
               for p in ("checkpoint", "models", "data", "telemetry"))
    assert "inference" not in MAY_IMPORT["knobs"]
    assert all("commands" not in MAY_IMPORT[p] for p in LIBRARY)
    assert _cycles({p: set(targets) for p, targets in MAY_IMPORT.items()}) == []  # the directions form layers


# Where a knob module is named outside knobs/: evaluation and the batch-size trials run compiled
# code eagerly. A new knob adds none: it is its module, its place in knobs.apply_knobs' order (and
# its check in knobs.check_knobs), its config group, its test and its docs line
# (docs/architecture.md: adding a knob).
KNOB_SEAMS = {"perfrun.loop.evaluation": {"compilation"}, "perfrun.memory.batch_size": {"compilation"}}


def test_knob_modules_are_named_only_inside_knobs_and_at_the_known_seams() -> None:
    modules = _modules()
    named = {}
    for name, path in modules.items():
        if _package(name) != "knobs":
            knobs = {t.rpartition(".")[2] for t in _imports(path, name, modules) if t.startswith("perfrun.knobs.")}
            if knobs:
                named[name] = knobs
    assert named == KNOB_SEAMS


def test_no_private_name_crosses_modules() -> None:
    crossing = []
    for name, path in _modules().items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("perfrun")):
                crossing += [f"{name}: {node.module}.{a.name}" for a in node.names
                             if a.name.startswith("_") and not a.name.startswith("__")]
    assert crossing == []


def test_no_module_over_500_lines() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: n for name, n in sizes.items() if n > 500} == {}


def test_a_command_module_stays_thin() -> None:
    """A command reads its command line and calls the library: about 250 lines at most, the
    library code in its package."""
    long = {name: n for name, path in _modules().items() if _package(name) == "commands"
            and (n := len(path.read_text().splitlines())) > 260}
    assert long == {}


REPO = PACKAGE.parent
MACHINE_WORDS = re.compile(r"\b(EPYC|Xeon|Ryzen|on (?:our|my) machine|on 2 cores|this box)\b", re.IGNORECASE)


def test_no_machine_figure_in_the_source() -> None:
    """Comments say why; a figure measured on a machine belongs in docs/ beside its command."""
    found = [f"{name}:{i}: {line.strip()}" for name, path in _modules().items()
             for i, line in enumerate(path.read_text().splitlines(), 1) if MACHINE_WORDS.search(line)]
    assert found == []


def test_the_machine_words_are_found() -> None:
    assert MACHINE_WORDS.search("# ~17 ms of ~23 on 2 cores") and MACHINE_WORDS.search("measured on an EPYC")
    assert not MACHINE_WORDS.search("nproc: processes on this machine")


def test_the_readme_is_a_front_door() -> None:
    """README.md: at most 300 lines, no commit hash; every local link resolves."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert re.findall(r"\b(?:commit|at) [0-9a-f]{7,40}\b", text) == []
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if "://" not in link and not (REPO / link).exists()]
    assert links and missing == []


def test_the_training_loop_fits_on_one_screen() -> None:
    tree = _tree(PACKAGE / "loop" / "schedule.py")
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "train_loop")
    assert loop.end_lineno - loop.lineno + 1 <= 80


def test_no_function_over_100_lines() -> None:
    long = []
    for name, path in _modules().items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_the_suites_slow_first_list_names_its_test_files() -> None:
    """tests/conftest.py hands the longest files to the workers first: a renamed file must be
    renamed there too, or the workers end apart again."""
    from conftest import SLOW_FIRST

    tests = Path(__file__).resolve().parent
    assert [n for n in SLOW_FIRST if not (tests / n).is_file()] == [] and len(set(SLOW_FIRST)) == len(SLOW_FIRST)


def _imported_modules(tree: ast.AST) -> Iterator[str]:
    """Every module an import statement names (a lazy import inside a function too)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _private_third_party(module: str) -> bool:
    parts = module.split(".")
    return parts[0] in ("hydra", "omegaconf") and any(p.startswith("_") for p in parts[1:])


def test_no_private_hydra_module_is_used() -> None:
    """perfrun enters Hydra through its public API (hydra.main, compose, the override parser,
    its plugin and callback interfaces): a private module of Hydra's or OmegaConf's may change
    in any release."""
    used = sorted(f"{name}: {module}" for name, path in _modules().items()
                  for module in _imported_modules(_tree(path)) if _private_third_party(module))
    assert used == []


def test_a_planted_private_hydra_import_is_found() -> None:
    planted = ast.parse("import hydra.core\ndef f():\n    from omegaconf._utils import is_dict_annotation\n")
    assert [m for m in _imported_modules(planted) if _private_third_party(m)] == [
        "omegaconf._utils", "omegaconf._utils.is_dict_annotation"]


TESTS = Path(__file__).resolve().parent


def _third_party_patches(tree: ast.AST) -> list[str]:
    """``monkeypatch.setattr(X, ...)`` calls whose X is, or lies in, a module this file imports
    from outside perfrun and tests/ (X a name bound by an import, or a dotted string)."""
    local = {p.stem for p in TESTS.glob("*.py")}
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update({(a.asname or a.name).split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                          for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            bound.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                and isinstance(node.func.value, ast.Name) and node.args):
            continue
        target = node.args[0]
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            module = target.value
        else:
            while isinstance(target, (ast.Attribute, ast.Call, ast.Subscript)):  # a.b, a.f(), a[k]: a
                target = target.func if isinstance(target, ast.Call) else target.value
            module = bound.get(target.id, "") if isinstance(target, ast.Name) else ""
        root = module.split(".")[0]
        if module and root != "perfrun" and root not in local:
            found.append(f"line {node.lineno}: setattr on {module}")
    return found


def test_no_test_replaces_an_attribute_of_a_third_party_module() -> None:
    """Tests run what users run: torch, Hydra and the standard library are used as they are, not
    patched (perfrun's own seams may be; a process environment is set with setenv)."""
    found = {p.name: f for p in sorted(TESTS.glob("*.py")) if (f := _third_party_patches(_tree(p)))}
    assert found == {}


def test_a_planted_third_party_patch_is_found() -> None:
    planted = ast.parse("import importlib.util\nfrom hydra.core.hydra_config import HydraConfig\n"
                        "from perfrun.models import flops\n"
                        "def test(monkeypatch):\n"
                        "    monkeypatch.setattr(importlib.util, 'find_spec', None)\n"
                        "    monkeypatch.setattr(HydraConfig.instance(), 'cfg', None)\n"
                        "    monkeypatch.setattr('torch.cuda.is_available', lambda: True)\n"
                        "    monkeypatch.setattr(flops, 'REAL_PASS_FLOPS', 0)\n")
    assert _third_party_patches(planted) == ["line 5: setattr on importlib", "line 6: setattr on hydra.core.hydra_config.HydraConfig",
                                             "line 7: setattr on torch.cuda.is_available"]
