"""The commands that take a configuration besides ``train`` (``generate``, ``export``,
``prepare``) as Hydra apps over a typed schema, so they share train's grammar: ``key=value``
overrides checked against a dataclass, ``--help`` listing every key with its help,
``--cfg job``, ``--info``, shell completion, and one line for a mistake.

A plain run composes the configuration with Hydra's compose API and runs the job in this
process (no run dir: these commands write only what they are asked to). Anything with a
flag (``--help``, ``--cfg``, ``-sc``, ``-m``) goes to Hydra's own runner (:func:`run_hydra`),
as ``perfrun train``'s do; a plain ``perfrun train`` runs the configuration it composed
through Hydra's own job machinery (:func:`run_composed`), so that it composes once. Two things are done to the words before Hydra sees them:

- keys in ``raw_keys`` (``prompt=``) take their value literally: the text is quoted for
  Hydra, so spaces, commas, quotes, ``=`` or ``${`` in a prompt stay what they are;
- whole words in ``aliases`` are spellings kept from before (``--no-cache``, ``top_k=none``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import textwrap
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from perfrun.config import config_dir
from perfrun.console import composition_error, error, hydra_quoted

if TYPE_CHECKING:
    from omegaconf import DictConfig

# Hydra's only flag that reads a pickle: --experimental-rerun FILE unpickles a job's config.pickle,
# and unpickling runs whatever the file names; no file perfrun reads may run code
PICKLE_FLAG_REFUSED = ("--experimental-rerun {file}: Hydra would unpickle that file, and a pickle can run any code, so "
                       "perfrun never reads one; run the job again from its overrides instead: perfrun {name} followed "
                       "by the lines of its run dir's .hydra/overrides.yaml")
KINDS = {int: "an integer", float: "a number", bool: "a boolean (true or false)"}
EXAMPLES = {int: "1", float: "0.5", bool: "true"}


def schema_fields(schema: type, prefix: str = "") -> list[tuple[str, Any, dataclasses.Field]]:
    """(dotted key, type, field) of every leaf of a dataclass schema, nested ones flattened."""
    hints = typing.get_type_hints(schema)
    out: list[tuple[str, Any, dataclasses.Field]] = []
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out += schema_fields(kind, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        else:
            out.append((prefix + f.name, kind, f))
    return out


def _plain_type(kind: Any) -> Any:
    """``int | None`` -> int; anything else as it is."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    return args[0] if len(args) == 1 else kind


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) and (not value or value != value.strip() or "\n" in value) else str(value)


def keys_help(schema: type, width: int = 100) -> str:
    """Every key of ``schema`` with its help (the field's ``metadata["help"]``) and default,
    for ``--help``. ``$`` is doubled: Hydra fills its help template with string.Template."""
    fields = schema_fields(schema)
    column = max(len(key) for key, _, _ in fields) + 3
    lines = []
    for key, _kind, f in fields:
        text = f"{f.metadata.get('help', '')} [default: {_shown(_default(f))}]"
        lines += textwrap.wrap(text, width, initial_indent=f"  {key:<{column - 3}} ", subsequent_indent=" " * column)
    return "\n".join(lines).replace("$", "$$")


@dataclass
class HydraCommand:
    """One configuration-taking command: its name (the command word and ``conf/NAME.yaml``),
    its schema, and the job that runs a composed configuration and returns the exit code."""

    name: str
    schema: type
    job: Callable[[Any], int]
    raw_keys: tuple[str, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)

    def register(self) -> None:
        from hydra.core.config_store import ConfigStore
        from omegaconf import OmegaConf

        store = ConfigStore.instance()
        if f"{self.name}_schema.yaml" not in store.repo:  # once per process, as register_configs
            store.store(name=f"{self.name}_schema", node=self.schema)
        text = keys_help(self.schema)  # conf/NAME.yaml's help template reads it as ${perfrun_keys:}
        OmegaConf.register_new_resolver("perfrun_keys", lambda: text, replace=True)

    def words(self, argv: list[str]) -> list[str]:
        """The command line as Hydra overrides: aliases replaced, raw values quoted."""
        out = []
        for word in argv:
            word = self.aliases.get(word, word)
            key, sep, value = word.partition("=")
            out.append(f"{key}={hydra_quoted(value)}" if sep and key in self.raw_keys else word)
        return out

    def main(self, argv: list[str]) -> int:
        """``perfrun NAME ARGS``: the job's exit code; 2 for a configuration that does not compose."""
        self.register()
        args = self.words(argv)
        if any(a.startswith("-") for a in args):
            return self._hydra_main(args)
        from hydra import compose, initialize_config_dir

        try:
            with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name=self.name):
                cfg = compose(self.name, overrides=args)
        except Exception as e:  # noqa: BLE001 - every composition error is the user's input
            error(self.override_error(e))
            return 2
        return self.run(cfg)

    def run(self, cfg: DictConfig) -> int:
        from omegaconf import OmegaConf

        return self.job(OmegaConf.to_object(cfg))

    def override_error(self, exc: BaseException) -> str:
        """A value of the wrong type, said in the key's own terms; any other composition
        error as :func:`perfrun.console.composition_error` words it."""
        text = str(exc).strip()
        if text.startswith("Error merging override") and exc.__cause__ is not None:
            key, _, value = text.removeprefix("Error merging override").strip().partition("=")
            kinds = {k: (_plain_type(t), f) for k, t, f in schema_fields(self.schema)}
            kind, f = kinds.get(key, (None, None))
            if kind in KINDS and f is not None:
                example = _default(f)
                example = EXAMPLES[kind] if example is None else _shown(example)
                return f"{key}={value} is not {KINDS[kind]}; write e.g. {key}={example}"
        return composition_error(exc, self.name)

    def _hydra_main(self, args: list[str]) -> int:
        """Hydra's own handling of the flags; a job it runs (``-m``) runs as a plain one does."""
        line = os.environ.get("COMP_LINE")
        if line is not None and any(a.startswith("query=") for a in args):  # Hydra completes the words after the program
            os.environ["COMP_LINE"] = line.replace(f" {self.name}", "", 1)
        return hydra_main(self.name, args, self.run)


def run_hydra(name: str, args: list[str], task: Callable[[DictConfig], None]) -> None:
    """What ``hydra.main`` over conf/NAME.yaml does, with ``args`` as the command line instead
    of ``sys.argv``: Hydra parses its flags, answers ``--help``, ``--cfg``, ``--info`` and
    ``-sc`` itself, and calls ``task`` with each configuration it composes (once, or once per
    job of ``-m``). hydra.main's own runner (``hydra._internal.utils._run_hydra``, Hydra 1.3)
    takes the parsed arguments; ``hydra.main`` reads them from ``sys.argv`` only. Hydra's
    ``--experimental-rerun`` (a pickle read back) is refused in one line (exit 2)."""
    from hydra import version
    from hydra._internal.utils import _run_hydra, get_args_parser

    version.setbase("1.3")
    parser = get_args_parser()
    parser.prog = "perfrun"  # argparse's own errors name the program the user ran
    parsed = parser.parse_args(args)
    if parsed.experimental_rerun is not None:  # read as argparse reads it: an abbreviation (--exp) included
        error(PICKLE_FLAG_REFUSED.format(name=name, file=parsed.experimental_rerun))
        raise SystemExit(2)
    if parsed.help and parsed.config_dir is None:
        raise SystemExit(app_help(name, parsed, parser))
    _run_hydra(args=parsed, args_parser=parser, task_function=task, config_path=config_dir(), config_name=name)


def app_help(name: str, parsed: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--help``: the text Hydra's ``Hydra.app_help`` prints (Hydra 1.3), with only the
    placeholders the template uses filled in. Hydra lists every config group, its own and
    conf/'s, whether the template shows them or not (~3 s on 2 cores), and perfrun's
    templates show neither. An override that does not compose is one line (exit 2)."""
    import copy
    import string

    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name=name):
        hydra = GlobalHydra.instance().hydra
        assert hydra is not None
        try:
            cfg = hydra.compose_config(name, parsed.overrides, RunMode.RUN, with_log_configuration=True)
        except Exception as e:  # noqa: BLE001 - every composition error is the user's input
            error(composition_error(e, name))
            return 2
        HydraConfig.instance().set_config(cfg)
        template = string.Template(cfg.hydra.help.template)
        job = hydra.get_sanitized_cfg(copy.deepcopy(cfg), "job")

        def groups(hydras: bool) -> str:
            return hydra.format_config_groups(lambda g: (g == "hydra" or g.startswith("hydra/")) == hydras)

        fill = {"FLAGS_HELP": lambda: hydra.format_args_help(parser), "HYDRA_CONFIG_GROUPS": lambda: groups(True),
                "APP_CONFIG_GROUPS": lambda: groups(False), "CONFIG": lambda: OmegaConf.to_yaml(job, resolve=parsed.resolve)}
        used = {m.group("named") or m.group("braced") for m in template.pattern.finditer(template.template)}
        print(template.substitute({key: make() for key, make in fill.items() if key in used}))
    return 0


def hydra_main(name: str, args: list[str], job: Callable[[Any], int]) -> int:
    """Hydra over conf/NAME.yaml with ``args`` as the command line (:func:`run_hydra`),
    running ``job`` on each configuration it composes. The exit code is the worst job's, or
    Hydra's own when it exits (``--help``, a refused override)."""
    codes: list[int] = []

    def app(cfg: DictConfig) -> None:
        codes.append(job(cfg))

    try:
        run_hydra(name, args, app)
    except SystemExit as e:  # Hydra's own answers and errors exit; the exit code is the answer
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    return max(codes, default=0)


def with_hydra_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """``cfg`` (composed with its ``hydra`` node) with more ``hydra.KEY=VALUE`` (or ``~hydra.KEY``)
    overrides, applied and recorded (``hydra.overrides.hydra``, hence .hydra/hydra.yaml) as
    Hydra applies and records those of the command line, so that the configuration is not
    composed again."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    for override in OverridesParser.create().parse_overrides(overrides):
        deleted = override.is_delete() and override.value() is None
        if not override.is_hydra_override() or override.is_sweep_override() or override.is_add() \
                or (override.is_delete() and not deleted) or override.is_force_add():
            raise ValueError(f"{override.input_line}: only a plain hydra.KEY=VALUE or ~hydra.KEY is applied to a "
                             "composed configuration")
        key = override.key_or_group
        if deleted:
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key)
            if not OmegaConf.is_dict(parent) or leaf not in parent:
                raise ValueError(f"{override.input_line}: there is no {key} to delete")
            with open_dict(parent):
                del parent[leaf]
        else:
            OmegaConf.update(cfg, key, override.value(), merge=True)
        cfg.hydra.overrides.hydra.append(override.input_line)
    return cfg


def run_composed(name: str, cfg: DictConfig, task: Callable[[DictConfig], None]) -> None:
    """A single run of ``task`` on ``cfg``, composed already over conf/NAME.yaml with its
    ``hydra`` node (``compose(..., return_hydra_config=True)``): what Hydra's runner does once
    it has composed (``Hydra.run`` after ``compose_config`` in hydra/_internal/hydra.py, Hydra
    1.3): Hydra's logging, its callbacks, and ``hydra.core.utils.run_job``, which makes the run
    dir, writes .hydra/ (config.yaml, hydra.yaml, overrides.yaml), sets up the job's logging
    and calls the task with HydraConfig set. An exception the task lets out is reported as
    Hydra reports it (exit 1); a SystemExit passes through."""
    from hydra import initialize_config_dir
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode

    if cfg.hydra.mode is None:  # as Hydra's runner says a run's mode: in hydra.yaml's overrides too
        with_hydra_overrides(cfg, ["hydra.mode=RUN"])

    def job() -> None:
        hydra = GlobalHydra.instance().hydra
        assert hydra is not None
        if cfg.hydra.verbose:  # Hydra's debug header (plugins, search path, defaults tree) composes to print it
            hydra.compose_config(name, [*cfg.hydra.overrides.task, *cfg.hydra.overrides.hydra], RunMode.RUN,
                                 with_log_configuration=True)
        else:
            configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
        callbacks = Callbacks(cfg)
        callbacks.on_run_start(config=cfg, config_name=name)
        ret = run_job(task_function=task, config=cfg, job_dir_key="hydra.run.dir", job_subdir_key=None,
                      hydra_context=HydraContext(config_loader=hydra.config_loader, callbacks=callbacks))
        callbacks.on_run_end(config=cfg, config_name=name, job_return=ret)
        _ = ret.return_value  # the task's exception, if it raised one

    # Hydra is initialised over conf/ during the job, as under its own runner
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name=name):
        run_and_report(job)
