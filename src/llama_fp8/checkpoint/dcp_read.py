"""DCP's files of a checkpoint (``.metadata`` and the shards), read so that nothing in them can execute code
and no byte is used before it is verified.

DCP's ``.metadata`` is a pickle, and DCP reads it with a plain ``pickle.load``; non-tensor entries
(optimizer hyper-parameters) are ``torch.load(weights_only=False)``. ``SafeFileSystemReader`` and
``SafeLoadPlanner`` replace both reads: the metadata through an unpickler that resolves only the classes
DCP's metadata is made of, the entries through ``weights_only=True``. The shards are read forward and
verified block by block against the manifest before any tensor is loaded from them (``read_data``).
"""

from __future__ import annotations

import enum
import io
import logging
import pickle
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata

from llama_fp8 import faults
from llama_fp8.checkpoint import safe_io
from llama_fp8.checkpoint.safe_io import UnsafeCheckpointFile

log = logging.getLogger("llama_fp8.checkpoint")

# --- DCP metadata and non-tensor entries -------------------------------------------------------------
_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    (f"{_DCP}.metadata", n) for n in ("Metadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                      "TensorStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                      "_MEM_FORMAT_ENCODING")
} | {(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}
_CONTAINERS = {pickle.SETITEM[0]: (dict, OrderedDict), pickle.SETITEMS[0]: (dict, OrderedDict),
               pickle.APPEND[0]: (list,), pickle.APPENDS[0]: (list,), pickle.ADDITEMS[0]: (set,)}


def _enum_member(cls: Any, name: Any) -> Any:
    """``builtins.getattr`` in DCP metadata, taken only as Python 3.11.2 (Debian 12's; not 3.11.7 nor 3.12) pickles
    an enum member: ``getattr(EnumClass, member_name)``. The class on the stack came through find_class, so it is
    an allowed one; anything but one of its members by name is refused."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise pickle.UnpicklingError(f"builtins.getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}) in "
                                 "DCP metadata: only an enum member by its name is allowed")


class _MetadataUnpickler(pickle._Unpickler):
    """Resolves only the classes DCP metadata is made of (the "restricting globals" recipe of the pickle
    docs): ``os.system``, ``builtins.eval``, a class with a ``__reduce__`` payload are refused before they
    can be called. Restricting globals is not enough: pickle's BUILD sets attributes on whatever object is
    on the stack, and an allowed *class* (or an enum member, or a function) is one object shared by the
    whole process - a BUILD on it would rebind a method of, say, ``PosixPath`` for the rest of the run. So,
    like torch's weights-only unpickler, BUILD is allowed only on an instance this load created itself
    (NEWOBJ), and SETITEM/APPEND only on a plain container of the exact builtin type. A refused load has
    changed nothing outside the objects it created. (torch's own unpickler cannot be used: it reads only
    pickle protocol 2, DCP writes the default protocol.) Pure-Python pickle, so that these opcodes can be
    intercepted; the metadata is small (about 100 bytes per shard)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file) -> None:
        super().__init__(file)
        self._made: dict[int, Any] = {}  # id -> object created by this load (kept alive, so ids stay unique)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")

    def _load_newobj(self) -> None:
        pickle._Unpickler.load_newobj(self)
        self._made[id(self.stack[-1])] = self.stack[-1]

    def _load_newobj_ex(self) -> None:
        pickle._Unpickler.load_newobj_ex(self)
        self._made[id(self.stack[-1])] = self.stack[-1]

    def _load_build(self) -> None:
        target = self.stack[-2]
        if id(target) not in self._made:
            raise pickle.UnpicklingError(f"BUILD on {target!r} ({type(target).__name__}), an object this load did "
                                         f"not create: it would change it for the whole process")
        pickle._Unpickler.load_build(self)

    def _container_op(self, opcode: int, method) -> None:
        target = {pickle.APPEND[0]: lambda: self.stack[-2], pickle.SETITEM[0]: lambda: self.stack[-3]}.get(
            opcode, lambda: self.metastack[-1][-1])()
        if type(target) not in _CONTAINERS[opcode]:
            raise pickle.UnpicklingError(f"opcode {bytes([opcode])!r} on a {type(target).__name__}: only plain "
                                         f"containers may be filled")
        method(self)

    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _load_build
    dispatch[pickle.SETITEM[0]] = lambda self: self._container_op(pickle.SETITEM[0], pickle._Unpickler.load_setitem)
    dispatch[pickle.SETITEMS[0]] = lambda self: self._container_op(pickle.SETITEMS[0],
                                                                   pickle._Unpickler.load_setitems)
    dispatch[pickle.APPEND[0]] = lambda self: self._container_op(pickle.APPEND[0], pickle._Unpickler.load_append)
    dispatch[pickle.APPENDS[0]] = lambda self: self._container_op(pickle.APPENDS[0], pickle._Unpickler.load_appends)
    dispatch[pickle.ADDITEMS[0]] = lambda self: self._container_op(pickle.ADDITEMS[0],
                                                                   pickle._Unpickler.load_additems)


def read_dcp_metadata(path: Path, want: dict | None = None) -> Metadata:
    """``path/.metadata`` of a DCP checkpoint (verified against its manifest entry ``want`` on the bytes that
    are unpickled); UnsafeCheckpointFile if it is unreadable, unsafe, or names files outside ``path``."""
    file = Path(path) / ".metadata"
    try:
        blob = safe_io.read_checked(file, want, safe_io.MAX_METADATA, safe_io.HASHERS)
    except OSError as e:
        raise UnsafeCheckpointFile(file, f"cannot be read: {e}") from None
    return parse_dcp_metadata(blob, file, lambda name: safe_io.confined(file.parent, name))


def parse_dcp_metadata(blob, file, confine) -> Metadata:
    """DCP's metadata from the (verified) bytes ``blob`` of ``file``, through the allow-list unpickler; every storage
    entry must name a key ``confine`` accepts."""
    try:
        meta = _MetadataUnpickler(io.BytesIO(blob)).load()
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointFile(file, f"refused: {e}; nothing in it was executed or changed") from None
    except UnsafeCheckpointFile:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbled pickle
        raise UnsafeCheckpointFile(file, f"is not valid DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(meta, Metadata):
        raise UnsafeCheckpointFile(file, f"holds a {type(meta).__name__}, not DCP Metadata")
    _check_storage(file, meta, confine)
    return meta


def _check_storage(file, meta: Metadata, confine) -> None:
    """Every storage entry names a plain file of the folder and a non-negative byte range."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(meta.storage_data, dict) or not isinstance(meta.state_dict_metadata, dict):
        raise UnsafeCheckpointFile(file, "is not valid DCP metadata (storage_data or state_dict_metadata missing)")
    for info in meta.storage_data.values():
        if not (isinstance(info, _StorageInfo) and isinstance(info.offset, int) and isinstance(info.length, int)
                and info.offset >= 0 and info.length >= 0):
            raise UnsafeCheckpointFile(file, f"holds a malformed storage entry {info!r}")
        try:
            confine(info.relative_path)
        except UnsafeCheckpointFile as e:
            raise UnsafeCheckpointFile(file, f"points outside the checkpoint folder: {e.reason}") from None


class _CheckedFileSystem(FileSystem):
    """DCP's file system for reading. Names stay inside the checkpoint folder; only regular files are opened.
    Without a manifest (version 1), a file is streamed as DCP would. With one, ``SafeFileSystemReader.read_data``
    reads the shards itself, verified, and never opens a stream here; should some DCP path still open one,
    it gets the whole file read and verified first (served from memory), never unchecked bytes."""

    def __init__(self, folder: Path, files: dict[str, dict] | None) -> None:
        super().__init__()
        self.folder, self.files = Path(folder), files

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise UnsafeCheckpointFile(Path(path), "a checkpoint being loaded is never written")
        name = Path(path).name
        file = safe_io.confined(self.folder, name)
        if Path(path) != file:
            raise UnsafeCheckpointFile(Path(path), "is not a file of the checkpoint folder")
        if self.files is None:  # no checksums (version 1): nothing to verify, DCP streams the regular file
            with safe_io.open_regular(file) as raw:
                yield io.BufferedReader(raw)
            return
        want = self.files.get(name)
        if want is None:
            raise UnsafeCheckpointFile(file, "is not in the checkpoint's manifest; refused")
        yield MemoryFile(safe_io.read_checked(file, want, 1 << 62, safe_io.HASHERS))

    def confine(self, name: str) -> Path:
        return safe_io.confined(self.folder, name)

    def blocks(self, name: str, want: dict, largest: int) -> safe_io.VerifiedBlocks:
        """File ``name`` read forward and verified a block at a time."""
        return safe_io.VerifiedBlocks(self.confine(name), want, safe_io.HASHERS, largest)

    def read_verified(self, name: str) -> torch.Tensor:
        """The whole of file ``name`` of the folder as a uint8 tensor, verified against its manifest entry on
        exactly these bytes (read into uninitialized memory: its pages are touched once)."""
        file = safe_io.confined(self.folder, name)
        want = (self.files or {}).get(name)
        if want is None:
            raise UnsafeCheckpointFile(file, "is not in the checkpoint's manifest; refused")
        return torch.from_numpy(safe_io.read_checked(file, want, 1 << 62, safe_io.HASHERS, _uninitialized))


def _uninitialized(n: int) -> np.ndarray:
    return np.empty(n, dtype=np.uint8)


class MemoryFile(io.RawIOBase):
    """A read-only, seekable file over bytes already in memory, without copying them (``io.BytesIO`` copies
    a bytearray whole): DCP slices it and ``torch.load``s each slice from it."""

    def __init__(self, data: bytes | bytearray) -> None:
        super().__init__()
        self._view, self._pos = memoryview(data), 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b) -> int:
        chunk = self._view[self._pos:self._pos + len(b)]
        b[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else self._pos + size
        out = self._view[self._pos:end].tobytes()
        self._pos += len(out)
        return out


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read through the allow-list unpickler and every file verified
    against the manifest ``files`` on the bytes that are loaded (``files`` None: no checksums, version 1).
    ``metadata``: DCP's metadata already read (and checked) through ``read_dcp_metadata``, used as it is."""

    def __init__(self, path: str, files: dict[str, dict] | None = None, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self.files, self.metadata = files, metadata
        self.fs = _CheckedFileSystem(Path(path), files)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not used by our checkpoints
            raise UnsafeCheckpointFile(Path(self.path), "per-rank DCP metadata is not supported")
        from torch.distributed.checkpoint.metadata import StorageMeta

        meta = self.metadata or read_dcp_metadata(Path(self.path), None if self.files is None else
                                                  self.files.get(".metadata"))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta

    def read_data(self, plan, planner):
        """DCP's read, except that what a checkpoint with checksums holds is verified before it is used, on
        the bytes that are used, without a copy per tensor: a file with block digests is read forward a block
        at a time (``safe_io.VerifiedBlocks``: memory for the largest tensor and two blocks), one without
        them whole into one buffer first; every tensor is loaded as a view of those verified bytes and copied
        into its place. Without checksums (version 1), DCP's own read through the checked file system."""
        if self.files is None:
            return super().read_data(plan, planner)
        from torch.futures import Future

        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            items.sort(key=lambda it: self.storage_data[it.storage_index].offset)  # one forward pass per file
            # A transient I/O error (EIO, ESTALE) reads the file again: safe, every tensor of it is copied into its
            # place again from bytes verified anew.
            safe_io.retry(lambda name=name, items=items: self._read_file(name, items, planner),
                    self.fs.confine(name), log.warning)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, items: list, planner) -> None:
        """Read file ``name`` of the checkpoint, verified, and load its ``items`` (sorted by offset)."""
        file, want = self.fs.confine(name), self.files.get(name)
        if want is None:
            raise UnsafeCheckpointFile(file, "is not in the checkpoint's manifest; refused")
        faults.at("checkpoint.read")
        if "blocks" in want:
            largest = max(self.storage_data[it.storage_index].length for it in items)
            reader = self.fs.blocks(name, want, largest)
            try:
                for item in items:
                    info = self.storage_data[item.storage_index]
                    _check_entry(info, file)
                    self._commit(item, torch.frombuffer(reader.span(info.offset, info.offset + info.length),
                                                        dtype=torch.uint8) if info.length else
                                 torch.empty(0, dtype=torch.uint8), planner, file)
            finally:
                reader.close()
            return
        data = self.fs.read_verified(name)
        for item in items:
            info = self.storage_data[item.storage_index]
            _check_entry(info, file)
            if info.offset + info.length > data.numel():
                raise UnsafeCheckpointFile(file, f"is {data.numel()} bytes; DCP's metadata points at bytes "
                                                 f"{info.offset}-{info.offset + info.length} of it")
            self._commit(item, data[info.offset:info.offset + info.length], planner, file)

    @staticmethod
    def _commit(item, record: torch.Tensor, planner, file: Path) -> None:
        """Load one entry from its verified bytes ``record`` into its place in the state dict."""
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType

        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(record.numpy().tobytes()))
            return
        tensor = narrow_tensor_by_index(load_tensor(record), item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise UnsafeCheckpointFile(file, f"holds {item.dest_index.fqn} with shape {tuple(tensor.size())}, "
                                             f"expected {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def _check_entry(info, file: Path) -> None:
    if getattr(info, "transform_descriptors", None):
        raise UnsafeCheckpointFile(file, f"uses DCP stream transforms {list(info.transform_descriptors)}, which "
                                         f"this loader does not read (our checkpoints never have them)")


def load_tensor(record: torch.Tensor) -> torch.Tensor:
    """The tensor ``torch.save`` wrote into the bytes ``record`` (uint8), read with ``weights_only`` and
    sharing ``record``'s memory: torch.load's own path for memory-mapped files, given the record's storage
    in place of a mapping. Where that internal entry point is missing (another torch version), torch.load
    from a seekable view, which copies."""
    view = MemoryFile(memoryview(record.numpy()))
    if _ZERO_COPY:
        ser = torch.serialization
        base = record.untyped_storage()[record.storage_offset():record.storage_offset() + record.numel()]
        with ser._open_zipfile_reader(view) as zipped:
            got = ser._load(zipped, "cpu", ser._weights_only_unpickler, overall_storage=base, encoding="utf-8")
    else:
        got = torch.load(view, map_location="cpu", weights_only=True)
    if not isinstance(got, torch.Tensor):
        raise pickle.UnpicklingError(f"a tensor entry holds a {type(got).__name__}")
    return got


def _has_zero_copy_load() -> bool:
    import inspect

    ser = torch.serialization
    try:
        params = inspect.signature(ser._load).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return ("overall_storage" in params and hasattr(ser, "_open_zipfile_reader")
            and hasattr(ser, "_weights_only_unpickler"))


_ZERO_COPY = _has_zero_copy_load()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries load with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
