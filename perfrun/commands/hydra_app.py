"""The commands that take a configuration besides ``train`` (``generate``, ``export``,
``prepare``) as Hydra apps over a typed schema, so they share train's grammar: ``key=value``
overrides checked against a dataclass, ``--help`` listing every key with its help,
``--cfg job``, ``--info``, shell completion, and one line for a mistake.

A plain run composes the configuration with Hydra's compose API and runs the job in this
process (no run dir: these commands write only what they are asked to). Anything with a
flag (``--help``, ``--cfg``, ``-sc``, ``-m``) goes to Hydra's own runner (:func:`run_hydra`),
as ``perfrun train``'s do. Two things are done to the words before Hydra sees them:

- keys in ``raw_keys`` (``prompt=``) take their value literally: the text is quoted for
  Hydra, so spaces, commas, quotes, ``=`` or ``${`` in a prompt stay what they are;
- whole words in ``aliases`` are spellings kept from before (``--no-cache``, ``top_k=none``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import textwrap
import typing
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def _command_line(args: list[str]) -> Iterator[None]:
    """``sys.argv`` set to ``perfrun ARGS`` for the call, then put back: ``hydra.main`` reads
    its command line there and nowhere else (Hydra 1.3 has no public entry that takes a list).
    The program's name is the one argparse's errors and the completion script use."""
    before = sys.argv
    sys.argv = ["perfrun", *args]
    try:
        yield
    finally:
        sys.argv = before


def _pickle_flag(args: list[str]) -> str | None:
    """The file Hydra's ``--experimental-rerun`` names in ``args`` (argparse takes any unique
    prefix of a long flag, ``--exp`` included, with ``=FILE`` or FILE next), or None."""
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if len(flag) >= 3 and "--experimental-rerun".startswith(flag):
            return value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return None


def run_hydra(name: str, args: list[str], task: Callable[[DictConfig], None]) -> None:
    """``hydra.main`` over conf/NAME.yaml with ``args`` as the command line: Hydra parses its
    flags, answers ``--cfg``, ``--info`` and ``-sc`` itself, and calls ``task`` with each
    configuration it composes (once, or once per job of ``-m``). ``--help`` is answered here
    (:func:`app_help`), where the configuration is conf/'s own. Hydra's ``--experimental-rerun``
    (a pickle read back) is refused in one line (exit 2), as argparse reads it: an
    abbreviation (``--exp``) included."""
    import hydra
    from hydra import version

    version.setbase("1.3")
    rerun = _pickle_flag(args)
    if rerun is not None:
        error(PICKLE_FLAG_REFUSED.format(name=name, file=rerun))
        raise SystemExit(2)
    own = not any(a.startswith(("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")) for a in args)
    if own and any(a in ("-h", "--help") for a in args):
        raise SystemExit(app_help(name, [a for a in args if not a.startswith("-")], resolve="--resolve" in args))
    app = hydra.main(config_path=config_dir(), config_name=name, version_base="1.3")(task)
    with _command_line(args):
        app()


def app_help(name: str, overrides: list[str], *, resolve: bool = False) -> int:
    """``--help``: the help template of conf/NAME.yaml (``hydra.help.template``) filled in as
    Hydra fills it, from a configuration composed with Hydra's compose API. Hydra's own
    ``--help`` also lists every config group, its own and conf/'s, whatever the template
    shows (over a second of CPU); perfrun's templates show only ``$CONFIG``, and any other
    placeholder is left as written. An override that does not compose is one line (exit 2)."""
    import string

    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name=name):
        try:
            cfg = compose(name, overrides=overrides, return_hydra_config=True)
        except Exception as e:  # noqa: BLE001 - every composition error is the user's input
            error(composition_error(e, name))
            return 2
        HydraConfig.instance().set_config(cfg)  # the template may read ${hydra:...}, as under Hydra's runner
        job = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
        template = string.Template(cfg.hydra.help.template)
        print(template.safe_substitute(CONFIG=OmegaConf.to_yaml(job, resolve=resolve)))
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
