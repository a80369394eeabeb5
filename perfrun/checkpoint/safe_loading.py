"""Reading a checkpoint someone else wrote without running any of its code.

perfrun reads three kinds of pickled file from a checkpoint: a single ``step_N.pt`` (or a
sharded folder's ``meta.pt``), a ``torch.distributed.checkpoint`` (DCP) folder's
``.metadata``, and the entries of its shard files. Each is read so that a pickle can only
make what a checkpoint holds:

- ``.pt`` files and every shard entry go through torch's weights-only unpickler (tensors,
  numbers, strings, lists, dicts); a refusal names the file and the function or class it
  names, not torch's advice to retry with ``weights_only=False``.
- ``.metadata`` is read by :class:`MetadataUnpickler`, which admits only the names DCP's
  metadata pickles (its dataclasses, ``torch.Size``, dtypes, layouts, paths) and even those
  only as inert records: the real objects are then built here, field by field, from
  checked values, so no constructor, ``__setstate__`` or class of the file's choosing runs.
- the shard files the metadata names must be plain files inside the folder, each entry
  within its file, with no stream transforms; DCP's own reader would unpickle its "bytes"
  entries with plain ``torch.load``, so :func:`dcp_load` reads them weights-only instead.

Missing files are left to DCP, which reports them as it always has.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import pickle
import re
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch

from perfrun.config import ConfigError
from perfrun.console import first_line

METADATA = ".metadata"  # DCP's name for a folder's metadata file
_DCP = "torch.distributed.checkpoint.metadata"
_STORAGE_INFO = "torch.distributed.checkpoint.filesystem._StorageInfo"
_GET_LAYOUT = "torch.serialization._get_layout"
_MEM_FORMAT = f"{_DCP}._MEM_FORMAT_ENCODING"
_PATHS = {"pathlib.PosixPath": PurePosixPath, "pathlib.PurePosixPath": PurePosixPath,
          "pathlib.WindowsPath": PureWindowsPath, "pathlib.PureWindowsPath": PureWindowsPath}
_DTYPES = {f"torch.{name}": v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format}
ADMITTED = frozenset({
    *(f"{_DCP}.{name}" for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                    "ChunkStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta")),
    _MEM_FORMAT, _STORAGE_INFO, _GET_LAYOUT, "torch.Size", *_PATHS, *_DTYPES,
})
_GLOBAL = re.compile(r"GLOBAL (\S+) (?:was not an allowed global|whose module)")


class UntrustedFileError(ConfigError):
    """A file of a checkpoint holds something other than what perfrun loads (it could run
    code) or is not what its folder's metadata says; nothing of it was used."""


def refused(file: Path, detail: str) -> UntrustedFileError:
    return UntrustedFileError(
        f"{file} was not loaded: {detail}, and a checkpoint may hold only tensors and plain values "
        "(nothing that can run code); use a checkpoint that perfrun wrote, or weights saved as safetensors")


def unreadable(file: Path, detail: str) -> UntrustedFileError:
    return UntrustedFileError(f"{file} is not a readable part of a perfrun checkpoint ({detail}); pick another checkpoint")


def weights_only_refusal(file: Path, e: pickle.UnpicklingError, entry: str = "") -> UntrustedFileError | None:
    """torch's weights-only loader refusing a name (a function or class to call) as one line
    naming the file and that name, without torch's advice to retry with ``weights_only=False``.
    None for any other unpickling error (a corrupt file), which the caller reports as such:
    any code a pickle could run must first be named, so it ends here."""
    name = _GLOBAL.search(str(e)) if str(e).startswith("Weights only load failed") else None
    if name is None:
        return None
    return refused(file, f"{f'its entry {entry}' if entry else 'it'} names {name.group(1)}")


def pickled_code(file: Path, limit: int = 1 << 20) -> UntrustedFileError | None:
    """A plain pickle (not torch's zip format), which torch's weights-only loader refuses with
    a multi-line warning and no word of why: one line saying it holds pickled code and the
    names it would call, read from its opcodes (``pickletools``: nothing is run). None for a
    file that is not a plain pickle."""
    import pickletools
    import zipfile

    try:
        if zipfile.is_zipfile(file):
            return None
        with open(file, "rb") as f:
            head = f.read(limit)
    except OSError:
        return None
    if not head.startswith(b"\x80"):  # every pickle of protocol 2 or later opens with PROTO
        return None
    names: list[str] = []
    strings: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(head)):
            if op.name == "GLOBAL":
                names.append(str(arg).replace(" ", "."))
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(f"{strings[-2]}.{strings[-1]}")
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # noqa: BLE001 - a pickle cut at the limit or damaged: the names read so far stand
        pass
    what = f"names {', '.join(dict.fromkeys(names))}" if names else "is a plain pickle"
    return refused(file, f"it holds pickled code (a plain Python pickle, not torch's format, that {what})")


def quiet_load(source: Any) -> Any:
    """torch's weights-only load onto the CPU without its warnings (a refusal says why itself)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(source, map_location="cpu", weights_only=True)


def load_pt(file: Path) -> Any:
    """``torch.load(weights_only=True)`` onto the CPU; a file that holds more than tensors
    and plain values is refused with one line naming it (torch's own warnings silenced: the
    refusal says why)."""
    try:
        return quiet_load(file)
    except pickle.UnpicklingError as e:
        refusal = weights_only_refusal(Path(file), e) or pickled_code(Path(file))
        if refusal is None:
            raise
        raise refusal from None


# --------------------------------------------------------------------------- .metadata


class _Record:
    """What :class:`MetadataUnpickler` makes of an admitted name: the arguments it was
    called with and the state it was given, and nothing of the real class runs."""

    name = ""

    def __new__(cls, *args: Any) -> _Record:
        record = object.__new__(cls)
        record.args, record.state = args, None
        return record

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Forbidden(pickle.UnpicklingError):
    """The pickle names something outside :data:`ADMITTED`."""


class MetadataUnpickler(pickle.Unpickler):
    """A pickle reader for DCP's ``.metadata``: every admitted name becomes a fresh record
    type of this reader's own (so even a pickle that sets attributes on a class changes
    nothing outside it); any other name is refused before anything is made."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.records: dict[str, type[_Record]] = {}

    def find_class(self, module: str, name: str) -> type[_Record]:
        key = f"{module}.{name}"
        if key not in ADMITTED:
            raise _Forbidden(key)
        if key not in self.records:
            self.records[key] = type(name, (_Record,), {"name": key})
        return self.records[key]


class _Malformed(ValueError):
    """The pickle admitted only known names but is not shaped like DCP's metadata."""


def _record(obj: Any, kind: str, fields: tuple[str, ...], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The state of a record of ``kind`` made without arguments, holding only ``fields``."""
    if not isinstance(obj, _Record) or obj.name != kind or obj.args:
        raise _Malformed(f"{kind.rsplit('.', 1)[1]} expected, found {_describe(obj)}")
    state = {} if obj.state is None else obj.state
    if not isinstance(state, dict) or not set(state) <= set(fields) or not set(required) <= set(state):
        raise _Malformed(f"{kind.rsplit('.', 1)[1]} with fields {sorted(state) if isinstance(state, dict) else state!r}")
    return state


def _describe(obj: Any) -> str:
    if isinstance(obj, _Record):
        return obj.name
    return obj.name if isinstance(obj, type) and issubclass(obj, _Record) else type(obj).__name__


def _called(obj: Any, kind: str) -> tuple[Any, ...]:
    """The arguments of a record of ``kind`` made by a call (``torch.Size((2, 3))``)."""
    if not isinstance(obj, _Record) or obj.name != kind or obj.state is not None:
        raise _Malformed(f"{kind.rsplit('.', 1)[1]} expected, found {_describe(obj)}")
    return obj.args


def _typed(value: Any, types: type | tuple[type, ...], what: str) -> Any:
    allowed = types if isinstance(types, tuple) else (types,)
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise _Malformed(f"{what} is a {_describe(value)}")
    return value


def _one_arg(obj: Any, kind: str) -> Any:
    args = _called(obj, kind)
    if len(args) != 1:
        raise _Malformed(f"{kind.rsplit('.', 1)[1]} made with {len(args)} arguments")
    return args[0]


def _size(obj: Any) -> torch.Size:
    dims = [_typed(n, int, "a size") for n in _typed(_one_arg(obj, "torch.Size"), tuple, "torch.Size's argument")]
    if any(n < 0 for n in dims):
        raise _Malformed(f"a negative size {dims}")
    return torch.Size(dims)


def _optional(value: Any, types: type, what: str) -> Any:
    return None if value is None else _typed(value, types, what)


def _plain(value: Any) -> Any:
    """Numbers, strings and containers of them (DCP's planner data), nothing else."""
    if value is None or isinstance(value, (str, int, float, bool, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    raise _Malformed(f"planner data holds a {_describe(value)}")


def _properties(obj: Any) -> Any:
    from torch.distributed.checkpoint.metadata import TensorProperties

    if not isinstance(obj, _Record) or obj.name != f"{_DCP}.TensorProperties" or obj.args:
        raise _Malformed(f"TensorProperties expected, found {_describe(obj)}")
    state = obj.state
    if not isinstance(state, tuple) or len(state) != 5:
        raise _Malformed("TensorProperties of another layout than torch 2.x writes")
    dtype, layout, requires_grad, memory_format, pin_memory = state
    if not (isinstance(dtype, type) and issubclass(dtype, _Record) and dtype.name in _DTYPES):
        raise _Malformed(f"a dtype that is a {_describe(dtype)}")
    layout_name, encoding = _one_arg(layout, _GET_LAYOUT), _one_arg(memory_format, _MEM_FORMAT)
    if layout_name not in _LAYOUTS or encoding not in _MEMORY_FORMATS:
        raise _Malformed(f"layout {layout_name!r} or memory format {encoding!r}")
    return TensorProperties(dtype=_DTYPES[dtype.name], layout=_LAYOUTS[layout_name],
                            requires_grad=_typed(requires_grad, bool, "requires_grad"),
                            memory_format=_MEMORY_FORMATS[encoding], pin_memory=_typed(pin_memory, bool, "pin_memory"))


def _storage_type(obj: Any) -> Any:
    """A ``TensorStorageMetadata`` or ``BytesStorageMetadata``, rebuilt from checked fields."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorStorageMetadata,
    )

    if isinstance(obj, _Record) and obj.name == f"{_DCP}.BytesStorageMetadata":
        _record(obj, obj.name, ())
        return BytesStorageMetadata()
    fields = ("properties", "size", "chunks")
    s = _record(obj, f"{_DCP}.TensorStorageMetadata", fields, fields)
    chunks = []
    for c in _typed(s["chunks"], list, "chunks"):
        cs = _record(c, f"{_DCP}.ChunkStorageMetadata", ("offsets", "sizes"), ("offsets", "sizes"))
        chunks.append(ChunkStorageMetadata(offsets=_size(cs["offsets"]), sizes=_size(cs["sizes"])))
    return TensorStorageMetadata(properties=_properties(s["properties"]), size=_size(s["size"]), chunks=chunks)


def _index(obj: Any) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    s = _record(obj, f"{_DCP}.MetadataIndex", ("fqn", "offset", "index"), ("fqn",))
    offset = None if s.get("offset") is None else _size(s["offset"])
    return MetadataIndex(fqn=_typed(s["fqn"], str, "fqn"), offset=offset, index=_optional(s.get("index"), int, "index"))


def _storage_info(obj: Any, file: Path) -> Any:
    """Where an entry lies: a plain file name inside the folder, a non-negative range, no transforms."""
    from torch.distributed.checkpoint import filesystem  # DCP's per-entry storage record

    s = _record(obj, _STORAGE_INFO, ("relative_path", "offset", "length", "transform_descriptors"),
                ("relative_path", "offset", "length"))
    name = _typed(s["relative_path"], str, "a shard file name")
    if name != Path(name).name or name != PureWindowsPath(name).name or name.startswith(".") or "\0" in name:
        raise refused(file, f"it names the shard file {name!r}, which is not a plain file name inside its folder")
    offset, length = _typed(s["offset"], int, "an offset"), _typed(s["length"], int, "a length")
    if offset < 0 or length < 0:
        raise _Malformed(f"a negative offset or length in {name}")
    if s.get("transform_descriptors"):
        raise refused(file, f"its entries in {name} use stream transforms {s['transform_descriptors']!r}, which perfrun never writes")
    return filesystem._StorageInfo(relative_path=name, offset=offset, length=length)


def _storage_meta(obj: Any) -> Any:
    from torch.distributed.checkpoint.metadata import StorageMeta

    if obj is None:
        return StorageMeta()
    s = _record(obj, f"{_DCP}.StorageMeta", ("checkpoint_id", "save_id", "load_id", "modules"))
    where = s.get("checkpoint_id")
    if isinstance(where, _Record) and where.name in _PATHS:
        where = str(_PATHS[where.name](*(_typed(p, str, "a path part") for p in _called(where, where.name))))
    modules = [_typed(m, str, "a module name") for m in _typed(s.get("modules", []), list, "modules")]
    return StorageMeta(checkpoint_id=_optional(where, str, "checkpoint_id"), save_id=_optional(s.get("save_id"), str, "save_id"),
                       modules=modules)


def _metadata(obj: Any, file: Path) -> Any:
    """DCP's ``Metadata``, built here from the records' checked fields."""
    from torch.distributed.checkpoint.metadata import Metadata

    s = _record(obj, f"{_DCP}.Metadata", ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"),
                ("state_dict_metadata", "storage_data"))
    entries = {_typed(k, str, "a key"): _storage_type(v) for k, v in _typed(s["state_dict_metadata"], dict, "the entries").items()}
    storage = {_index(k): _storage_info(v, file) for k, v in _typed(s["storage_data"], dict, "storage data").items()}
    return Metadata(state_dict_metadata=entries, planner_data=_plain(s.get("planner_data")), storage_data=storage,
                    storage_meta=_storage_meta(s.get("storage_meta")), version=_optional(s.get("version"), str, "version"))


def read_metadata(file: Path) -> Any:
    """A DCP ``.metadata`` file as DCP's ``Metadata``; refused, naming the file, when it
    names anything but DCP's metadata classes or is not shaped like them."""
    file = Path(file)
    try:
        with open(file, "rb") as f:
            tree = MetadataUnpickler(f).load()
        return _metadata(tree, file)
    except _Forbidden as e:
        raise refused(file, f"it names {e}, which is not one of torch.distributed.checkpoint's metadata classes") from None
    except UntrustedFileError:
        raise
    except Exception as e:  # noqa: BLE001 - only the unpickler and the checks above ran: a malformed file
        raise unreadable(file, f"not torch.distributed.checkpoint metadata: {first_line(e, 120)}") from None


# --------------------------------------------------------------------------- the shard files


def verify_sharded(folder: Path) -> None:
    """Check a sharded checkpoint folder before DCP reads it: its ``.metadata`` (see
    :func:`read_metadata`), the shard files it names (plain files, entries within them),
    and every "bytes" entry, loaded weights-only. A missing file is left to DCP, which
    reports it as it always has (a folder not shared between nodes)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    if not (folder / METADATA).is_file():
        return
    metadata = read_metadata(folder / METADATA)
    by_file: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    for name, entries in by_file.items():
        shard = folder / name
        if shard.is_symlink() or (shard.exists() and not shard.is_file()):
            raise refused(folder / METADATA, f"its shard {name} is a link or not a plain file")
        if not shard.exists():
            continue
        size = shard.stat().st_size
        with open(shard, "rb") as f:
            for index, info in entries:
                if info.offset + info.length > size:
                    raise unreadable(shard, f"entry {index.fqn} ends at byte {info.offset + info.length}, past its end")
                if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                    f.seek(info.offset)
                    load_entry(io.BytesIO(f.read(info.length)), shard, index.fqn)


def load_entry(data: io.BytesIO, shard: Path, entry: str) -> Any:
    """One "bytes" entry of a shard file, weights-only; refused or unreadable, naming both."""
    try:
        return quiet_load(data)
    except Exception as e:  # noqa: BLE001 - any entry that does not load is refused, whatever the reason
        raise entry_error(shard, entry, e) from None


def entry_error(shard: Path, entry: str, e: Exception) -> UntrustedFileError:
    refusal = weights_only_refusal(shard, e, entry) if isinstance(e, pickle.UnpicklingError) else None
    return refusal or unreadable(shard, f"entry {entry}: {first_line(e, 120)}")


class _EntryError(Exception):
    """A "bytes" entry that did not load weights-only, on its way to the reader that knows its file."""

    def __init__(self, entry: str, error: Exception) -> None:
        super().__init__(entry)
        self.entry, self.error = entry, error


@functools.cache
def _dcp_classes() -> tuple[type, type]:
    """DCP's file reader and load planner with every unpickling made safe (built on first
    use: importing DCP costs most of a second)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.futures import Future

    class Reader(FileSystemReader):
        """``.metadata`` through :func:`read_metadata`, and each shard file read on its own
        so that a refused entry names its file."""

        refusal: UntrustedFileError | None = None

        def read_metadata(self) -> Any:  # no **kwargs: DCP tries no rank-local metadata perfrun never writes
            try:
                metadata = read_metadata(Path(self.path) / METADATA)
            except UntrustedFileError as e:
                self.refusal = e
                raise
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Future:
            by_file: dict[str, list[Any]] = {}
            for item in plan.items:
                by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in by_file.items():
                try:
                    super().read_data(dataclasses.replace(plan, items=items), planner).wait()
                except _EntryError as e:
                    self.refusal = entry_error(Path(self.path) / name, e.entry, e.error)
                    raise self.refusal from None
                except pickle.UnpicklingError as e:  # a tensor entry torch's weights-only loader refused
                    self.refusal = weights_only_refusal(Path(self.path) / name, e)
                    if self.refusal is None:
                        raise
                    raise self.refusal from None
            done: Future = Future()
            done.set_result(None)
            return done

    class Planner(DefaultLoadPlanner):
        """DCP's planner, whose "bytes" entries are read weights-only, not with plain ``torch.load``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                obj = quiet_load(value)
            except Exception as e:  # noqa: BLE001 - the reader names the file and refuses it
                raise _EntryError(read_item.dest_index.fqn, e) from None
            checked = io.BytesIO()
            torch.save(obj, checked)  # tensors and plain values only: DCP's own torch.load of this runs nothing else
            checked.seek(0)
            super().load_bytes(read_item, checked)

    return Reader, Planner


def dcp_load(state: dict[str, Any], folder: Path) -> None:
    """``torch.distributed.checkpoint.load`` of ``folder`` into ``state``, verified first
    (:func:`verify_sharded`) and read by a reader and planner that unpickle nothing unsafe.
    A refusal is raised as itself, one line naming the file, not inside DCP's exception."""
    import torch.distributed.checkpoint as dcp

    verify_sharded(folder)
    reader_type, planner_type = _dcp_classes()
    reader = reader_type(str(folder))
    try:
        dcp.load(state, storage_reader=reader, planner=planner_type())
    except BaseException:
        if reader.refusal is not None:
            raise reader.refusal from None
        raise
