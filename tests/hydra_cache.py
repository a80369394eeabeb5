"""Hydra's composition, remembered across the compositions of one test process.

Hydra composes from scratch each time: it parses every YAML file again, builds the defaults
tree again and merges every file again (~0.13 s idle on 2 cores, ~0.24 s under the suite's
load); the suite composes ~570 times in its test processes, over a quarter of its CPU (138
of 489 CPU s in one run). The parts that depend only on the files and on the overrides that
pick files are kept here, per process, and each use takes a copy:

- a config file as loaded (``ConfigRepository.load_config``), while the file is unchanged;
- the defaults list (``create_defaults_list``) for a primary config and the overrides that
  pick files (group choices, ``+group=``, ``~group``, ``hydra/...``), while every file it read
  is unchanged: the value overrides are Hydra's own, classified afresh each time;
- the merge of that list (``_compose_config_from_defaults_list``), under the same condition,
  and the merge halfway (after Hydra's own files, after the primary config): a list that
  differs only past one of those points (a group choice, another rung of a ladder) is merged
  from there.

Each is kept pickled, in memory: unpickling makes a copy of an OmegaConf tree about 5 times
faster than ``copy.deepcopy`` (the merged ``train`` with its ``hydra`` node, on the 2-core
EPYC: 3.3 ms against 17.8 ms, medians of 7 rounds of 20 copies).
Whether a file of an installed package exists is asked once (the package cannot change).

Everything else, the value overrides applied in struct mode, the ``hydra`` node and every
error, is Hydra's own code, run each time; a composition that fails is never kept. A file is
"unchanged" while the source that serves it, its size, modification time and inode are
(a ConfigStore node: while it is the same object). ``test_hydra_cache.py`` holds compositions
made so equal to Hydra's own, a file edited between two compositions included.
"""

from __future__ import annotations

import copy
import enum
import io
import os
import pickle
import stat
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_swapped: list[tuple[object, str, object, object]] = []  # (owner, name, Hydra's, the one kept here)
_recording: list[list[tuple[str, str | None, object]]] = []  # one list of reads per cached step in progress
_loaded: dict[tuple[Any, ...], tuple[object, Frozen]] = {}
_defaults: dict[tuple[Any, ...], tuple[tuple[tuple[str, str | None, object], ...], Frozen]] = {}
_merged: dict[tuple[Any, ...], tuple[tuple[tuple[str, str | None, object], ...], Frozen]] = {}
_prefixes: dict[tuple[Any, ...], tuple[tuple[tuple[str, str | None, object], ...], Frozen]] = {}  # merges halfway
_in_package: dict[tuple[str, str], bool] = {}  # (a pkg:// source, a config path): whether it serves it
_names: dict[tuple[str, object], str] = {}  # (a config path, Hydra's version base): the file name looked for


class _Same:
    """Equal only to a wrapper of the very same object (a ConfigStore node)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _name(config_path: str) -> str:
    """``ConfigSource._normalize_file_name``: the file name Hydra looks for, kept per config
    path and version base (Hydra works the version out again for every name it looks up)."""
    from hydra.version import getbase

    key = (config_path, getbase())
    name = _names.get(key)
    if name is None:
        from hydra.plugins.config_source import ConfigSource

        name = _names[key] = ConfigSource._normalize_file_name(config_path)
    return name


def _file_signature(source: Any, config_path: str) -> tuple[int, int, int] | None:
    """A file source's ``is_config`` and the file's signature in one ``stat``: None where it
    has no such file (``is_config``: ``os.path.isfile`` of the path, its links followed)."""
    try:
        st = os.stat(os.path.join(source.path, _name(config_path)))
    except (OSError, ValueError):
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _signature(source: Any, config_path: str) -> object:
    """What says that the file ``source`` serves for ``config_path`` (not a file source's:
    see :func:`_file_signature`) is the one read before."""
    if source.scheme() == "structured":
        return _Same(source.store._load(_name(config_path)))
    return None  # a package's resources: the installed package, fixed for the process


def _serves(source: Any, config_path: str) -> bool:
    """``source.is_config``; for an installed package's resources, asked once per process."""
    if source.scheme() != "pkg":
        return bool(source.is_config(config_path))
    key = (source.full_path(), config_path)
    if key not in _in_package:
        _in_package[key] = bool(source.is_config(config_path))
    return _in_package[key]


def _read(repo: Any, config_path: str) -> tuple[str, str | None, object]:
    """(the config path, the source that serves it now, its signature): the first source
    that has it, as ``ConfigRepository._find_object_source`` finds it."""
    for source in repo.get_sources():
        if source.scheme() == "file":
            signature = _file_signature(source, config_path)
            if signature is not None:
                return config_path, source.full_path(), signature
        elif _serves(source, config_path):
            return config_path, source.full_path(), _signature(source, config_path)
    return config_path, None, None


def _unchanged(repo: Any, reads: tuple[tuple[str, str | None, object], ...]) -> bool:
    return all(_read(repo, path) == (path, source, signature) for path, source, signature in reads)


@contextmanager
def _recorded() -> Iterator[list[tuple[str, str | None, object]]]:
    reads: list[tuple[str, str | None, object]] = []
    _recording.append(reads)
    try:
        yield reads
    finally:
        _recording.pop()  # this one: the recordings nest as the calls do


class Frozen:
    """An object pickled, to be copied by unpickling. What ``copy.deepcopy`` never copies
    (classes, functions, enum members) is kept as the very object, not looked up by name
    again: Hydra's plugin scan executes a plugin's module again, and a config node of its
    dataclass must keep the class it was made with (submitit pickles the job's config)."""

    __slots__ = ("data", "kept")

    def __init__(self, obj: Any) -> None:
        self.kept: list[object] = []
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = self._as_is  # type: ignore[method-assign]
        pickler.dump(obj)
        self.data = buffer.getvalue()

    def _as_is(self, obj: object) -> int | None:
        if isinstance(obj, (type, enum.Enum, types.FunctionType, types.BuiltinFunctionType)):
            self.kept.append(obj)
            return len(self.kept) - 1
        return None

    def copy(self) -> Any:
        unpickler = pickle.Unpickler(io.BytesIO(self.data))  # noqa: S301 - pickled here, in memory
        unpickler.persistent_load = self.kept.__getitem__  # type: ignore[method-assign]
        return unpickler.load()


def _kept(obj: Any, config: Callable[[Any], Any] = lambda o: o, edit: Callable[[Any], Any] | None = None) -> Frozen:
    """A copy to keep: its configuration (``config(obj)``, which only reads) without what its
    resolvers have cached (``${now:...}``, which Hydra resolves while it merges), so that
    each use resolves them afresh, as each composition by Hydra does; ``edit`` is applied to
    the copy, never to ``obj`` (which Hydra goes on using). Without a cached value or an
    edit, ``obj`` is kept as it is."""
    from omegaconf import OmegaConf

    frozen = Frozen(obj)
    if edit is None and not any(OmegaConf.get_cache(config(obj)).values()):
        return frozen
    kept = frozen.copy()
    OmegaConf.clear_cache(config(kept))
    if edit is not None:
        edit(kept)
    return Frozen(kept)


def _sources(repo: Any) -> tuple[object, ...]:
    """The sources searched, and every node of the ConfigStore (a schema Hydra matches to a
    file by its name is read from there without a ``load_config``)."""
    from hydra.core.config_store import ConfigStore

    def nodes(tree: dict[str, Any]) -> Iterator[object]:
        for name, node in tree.items():
            yield from nodes(node) if isinstance(node, dict) else ((name, _Same(node)),)

    return (*(source.full_path() for source in repo.get_sources()), *nodes(ConfigStore.instance().repo))


def install() -> None:
    """Keep Hydra's compositions in this process (once; a second call does nothing)."""
    if _swapped:
        return
    try:  # Hydra's internals as 1.3.x has them; another Hydra composes as it always does, only slower
        import hydra._internal.config_loader_impl as loader_impl
        from hydra._internal.config_repository import CachingConfigRepository, ConfigRepository
        from hydra._internal.defaults_list import DefaultsList, Overrides
        from hydra.core.config_store import ConfigStore

        load_config: Callable[..., Any] = ConfigRepository.load_config
        caching_load: Callable[..., Any] = CachingConfigRepository.load_config
        create_defaults_list: Callable[..., Any] = loader_impl.create_defaults_list
        merge: Callable[..., Any] = loader_impl.ConfigLoaderImpl._compose_config_from_defaults_list
    except (ImportError, AttributeError) as e:
        import hydra

        warnings.warn(f"Hydra {hydra.__version__} has other internals ({e}): its compositions are not kept, "
                      "so the suite runs slower", stacklevel=2)
        return

    def cached_load(self: Any, config_path: str) -> Any:
        key = (tuple(source.full_path() for source in self.get_sources()), config_path)
        read = _read(self, config_path)
        kept = _loaded.get(key)
        if kept is not None and kept[0] == read:
            return kept[1].copy()
        ret = load_config(self, config_path)
        if ret is not None and read[1] is not None:
            _loaded[key] = (read, _kept(ret, lambda result: result.config))
        return ret

    def recording_load(self: Any, config_path: str) -> Any:
        ret = caching_load(self, config_path)
        if _recording:
            read = _read(self.delegate, config_path)
            for reads in _recording:
                reads.append(read)
        return ret

    def init(self: Any, delegate: Any) -> None:
        # Hydra copies the repository so as not to change its sources; the ConfigStore it
        # refers to is shared by every copy (it is never changed by a source's setup).
        store = ConfigStore.instance()
        self.delegate = copy.deepcopy(delegate, {id(store): store})
        self.cache = {}

    def cached_defaults(repo: Any, config_name: str | None, overrides_list: list[Any], prepend_hydra: bool,
                        skip_missing: bool) -> Any:
        fresh = Overrides(repo=repo, overrides_list=overrides_list)  # which overrides are values
        values = {id(o) for o in fresh.config_overrides}
        picking = tuple(o.input_line for o in overrides_list if id(o) not in values)
        key = (_sources(repo), config_name, picking, prepend_hydra, skip_missing)
        kept = _defaults.get(key)
        if kept is not None and _unchanged(getattr(repo, "delegate", repo), kept[0]):
            made = kept[1].copy()
        else:
            with _recorded() as reads:
                made = create_defaults_list(repo, config_name, overrides_list, prepend_hydra, skip_missing)
            _defaults[key] = (tuple(reads), Frozen(made))
        made.overrides.config_overrides = fresh.config_overrides
        return DefaultsList(defaults=made.defaults, config_overrides=fresh.config_overrides,
                            defaults_tree=made.defaults_tree, overrides=made.overrides)

    def cached_merge(self: Any, defaults: list[Any], repo: Any) -> Any:
        sources, items = _sources(repo), tuple((d.config_path, d.package, d.parent, d.is_self, d.primary)
                                               for d in defaults)
        kept = _merged.get((sources, items))
        if kept is not None and _unchanged(getattr(repo, "delegate", repo), kept[0]):
            return kept[1].copy()
        with _recorded() as reads:
            cfg = _merged_from_a_kept_prefix(self, defaults, repo, sources, items, reads)
        _merged[(sources, items)] = (tuple(reads), _kept(cfg))
        return cfg

    _swapped.extend([
        (ConfigRepository, "load_config", load_config, cached_load),
        (CachingConfigRepository, "load_config", caching_load, recording_load),
        (CachingConfigRepository, "__init__", CachingConfigRepository.__init__, init),
        (loader_impl, "create_defaults_list", create_defaults_list, cached_defaults),
        (loader_impl.ConfigLoaderImpl, "_compose_config_from_defaults_list", merge, cached_merge),
    ])
    for owner, name, _, kept in _swapped:
        setattr(owner, name, kept)


def _prefix_ends(items: tuple[tuple[Any, ...], ...]) -> set[int]:
    """Where a merge in progress is kept, as the number of files merged: after Hydra's own
    files (the ``hydra`` node, the same for every composition that picks no ``hydra/`` group)
    and after the primary config (the same for every rung of a sweep, whose ``+group=`` files
    come after it)."""
    hydras = next((i for i, item in enumerate(items) if not str(item[2] or "").startswith("hydra/")
                   and not str(item[0]).startswith("hydra/")), 0)
    primary = next((i + 1 for i, item in enumerate(items) if item[4]), 0)
    return {end for end in (hydras, primary) if 0 < end < len(items)}


def _merged_from_a_kept_prefix(loader: Any, defaults: list[Any], repo: Any, sources: tuple[object, ...],
                               items: tuple[tuple[Any, ...], ...], reads: list[tuple[str, str | None, object]]) -> Any:
    """Hydra's ``_compose_config_from_defaults_list`` (1.3), started from the longest kept
    merge of a prefix of ``defaults`` whose files are unchanged; the prefixes it passes are
    kept in turn (with the reads that made them)."""
    import sys

    from hydra.errors import ConfigCompositionException
    from omegaconf import DictConfig, OmegaConf, flag_override
    from omegaconf.errors import OmegaConfBaseException

    ends = _prefix_ends(items)
    start, cfg = 0, None
    for end in sorted(ends, reverse=True):
        kept = _prefixes.get((sources, items[:end]))
        if kept is not None and _unchanged(getattr(repo, "delegate", repo), kept[0]):
            start, cfg = end, kept[1].copy()
            reads.extend(kept[0])
            break
    cfg = OmegaConf.create() if cfg is None else cfg
    with flag_override(cfg, "no_deepcopy_set_nodes", True):
        for i in range(start, len(defaults)):
            if i in ends and i > start:
                _prefixes[(sources, items[:i])] = (tuple(reads), _kept(cfg, edit=_without_merge_flag))
            loaded = loader._load_single_config(default=defaults[i], repo=repo)
            try:
                cfg.merge_with(loaded.config)
            except OmegaConfBaseException as e:
                raise ConfigCompositionException(  # noqa: B904 - as Hydra raises it
                    f"In '{defaults[i].config_path}': {type(e).__name__} raised while composing config:\n{e}"
                ).with_traceback(sys.exc_info()[2])

    def strip_defaults(node: Any) -> None:  # Hydra's: the defaults lists left in any node
        if isinstance(node, DictConfig):
            if node._is_missing() or node._is_none():
                return
            with flag_override(node, ["readonly", "struct"], False):
                if node._get_flag("HYDRA_REMOVE_TOP_LEVEL_DEFAULTS"):
                    node._set_flag("HYDRA_REMOVE_TOP_LEVEL_DEFAULTS", None)
                    node.pop("defaults", None)
            for _key, value in node.items_ex(resolve=False):
                strip_defaults(value)

    strip_defaults(cfg)
    return cfg


def _without_merge_flag(cfg: Any) -> Any:
    """A merge kept halfway, as Hydra's merge starts it: without the flag the merge sets."""
    cfg._set_flag("no_deepcopy_set_nodes", None)
    return cfg


def active() -> bool:
    """Whether this process keeps Hydra's compositions."""
    return bool(_swapped)


def forget() -> None:
    """Nothing kept: the next compositions are made again."""
    for kept in (_loaded, _defaults, _merged, _prefixes, _in_package):
        kept.clear()


@contextmanager
def hydras_own() -> Iterator[None]:
    """Hydra's own composition for a while (what the kept one is compared with)."""
    for owner, name, hydras, _ in _swapped:
        setattr(owner, name, hydras)
    try:
        yield
    finally:
        for owner, name, _, kept in _swapped:
            setattr(owner, name, kept)


def store_schemas() -> None:
    """Store now every schema perfrun's commands store in Hydra's ConfigStore at their first
    start: a kept composition is keyed on the store's nodes, and a node stored halfway
    through a test process would have every composition kept before it made again."""
    import importlib

    from perfrun.commands.dispatch import HYDRA_COMMANDS
    from perfrun.config import register_configs
    from perfrun.tune.config import register_tune_schema

    register_configs()
    register_tune_schema()
    for name in HYDRA_COMMANDS:
        command = getattr(importlib.import_module(f"perfrun.commands.{name}"), "COMMAND", None)
        if command is not None:  # tune stores its schema by register_tune_schema
            command.register()


def warm() -> None:
    """Compose ``perfrun train`` once (its files, its defaults list, their merge), so that a
    process forked after this starts with them kept."""
    from hydra import compose, initialize_config_dir

    from perfrun.config import config_dir, register_configs

    register_configs()
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="train"):
        compose("train", return_hydra_config=True)
