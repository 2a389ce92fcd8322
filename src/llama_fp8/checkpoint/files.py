"""The file formats of a checkpoint, read so that no file can execute code.

- Per-rank state (data-loader position, RNG states) is ``rank{r}.safetensors``: the tensors as
  safetensors (a JSON header + raw bytes), everything else as JSON in the header's metadata. Neither
  can carry code. Tuples and numpy arrays are tagged so that they come back as what was saved.
- Checkpoints of earlier versions hold ``rank{r}.pt`` (``torch.save`` pickles). They are read with
  ``torch.load(weights_only=True)`` plus an explicit allow-list of the three numpy globals an RNG state
  needs (numpy's own array reconstruction); a pickled callable or any other global is refused.
- DCP's ``.metadata`` is a pickle, and DCP reads it with a plain ``pickle.load``; non-tensor entries
  (optimizer hyper-parameters) are ``torch.load(weights_only=False)``. ``SafeFileSystemReader`` and
  ``SafeLoadPlanner`` replace both reads: the metadata through an unpickler that resolves only the
  classes DCP's metadata is made of, the entries through ``weights_only=True``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata

RANK_FILE = "rank{}.safetensors"
LEGACY_RANK_FILE = "rank{}.pt"
_META_KEY = "llama_fp8.state"
_FORMAT = "llama-fp8 rank state v2"


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file that is unreadable, malformed, or holds something that could execute code."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = Path(path), reason


# --- per-rank state: JSON + safetensors ----------------------------------------------------------
def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A JSON-able copy of ``obj`` with tensors and arrays moved to ``tensors`` (tagged placeholders)."""
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().cpu().contiguous().clone()  # safetensors wants owned, dense storage
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": key}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, str)]
        if bad or any(k.startswith("__") and k.endswith("__") for k in obj):
            raise TypeError(f"per-rank state keys must be plain strings, got {bad or list(obj)[:3]}")
        return {k: _encode(v, tensors) for k, v in obj.items()}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"per-rank state holds a {type(obj).__name__}, which has no safe file format")


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__ndarray__" in obj:
            return tensors[obj["__ndarray__"]].numpy()
        if "__tuple__" in obj:
            return tuple(_decode(v, tensors) for v in obj["__tuple__"])
        return {k: _decode(v, tensors) for k, v in obj.items()}
    return obj


def write_rank_state(path: Path, state: dict) -> None:
    """Write this rank's state (and fsync it: a checkpoint is complete only once its bytes are on disk)."""
    from safetensors.torch import save as st_save

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors)
    blob = st_save(tensors, metadata={"format": _FORMAT, _META_KEY: json.dumps(skeleton)})
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())


def read_rank_state(path: Path) -> dict:
    """This rank's state from ``rank{r}.safetensors``; UnsafeCheckpointFile if it is not one."""
    from safetensors.torch import load as st_load

    try:
        blob = Path(path).read_bytes()
        tensors = st_load(blob)
        n = int.from_bytes(blob[:8], "little")  # safetensors: 8-byte header length, then the JSON header
        meta = json.loads(blob[8:8 + n]).get("__metadata__") or {}
        if meta.get("format") != _FORMAT:
            raise ValueError(f"header format {meta.get('format')!r}, expected {_FORMAT!r}")
        return _decode(json.loads(meta[_META_KEY]), tensors)
    except OSError as e:
        raise UnsafeCheckpointFile(path, f"cannot be read: {e}") from None
    except Exception as e:  # noqa: BLE001 - any parse error: the file is not what we wrote
        raise UnsafeCheckpointFile(path, f"is not a valid per-rank state file ({type(e).__name__}: {e})") from None


def _numpy_globals() -> list:
    """What ``torch.save`` of a numpy array (numpy's RNG state) references: the array class, its dtype and
    numpy's reconstruction function, which builds an empty array of an allow-listed class."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_legacy_rank_state(path: Path) -> dict:
    """A ``rank{r}.pt`` of an earlier version, without executing anything it may hold."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        first = str(e).split("\n")
        why = next((ln.strip() for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0])
        raise UnsafeCheckpointFile(path, f"refused: it holds a pickled object outside the allow-list of a "
                                         f"per-rank state ({why}); nothing in it was executed") from None
    except Exception as e:  # noqa: BLE001 - truncated zip, not a torch file, ...
        raise UnsafeCheckpointFile(path, f"cannot be read as a per-rank state ({type(e).__name__}: "
                                         f"{str(e).splitlines()[0] if str(e) else ''})") from None
    if not (isinstance(state, dict) and {"loader", "rng"} <= set(state)):
        raise UnsafeCheckpointFile(path, "is not a per-rank state (no loader/rng entries)")
    return state


# --- DCP metadata and non-tensor entries -------------------------------------------------------------
_DCP = "torch.distributed.checkpoint"
_ALLOWED = {
    (f"{_DCP}.metadata", n) for n in ("Metadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                      "TensorStorageMetadata", "TensorProperties", "MetadataIndex", "StorageMeta",
                                      "_MEM_FORMAT_ENCODING")
} | {(f"{_DCP}.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
     ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP metadata is made of (the "restricting globals" recipe of the pickle
    docs); anything else - ``os.system``, ``builtins.eval``, a class with a ``__reduce__`` payload - is
    refused before it can be called."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def read_dcp_metadata(path: Path) -> Metadata:
    """``path/.metadata`` of a DCP checkpoint; UnsafeCheckpointFile if it is unreadable or unsafe."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except OSError as e:
        raise UnsafeCheckpointFile(file, f"cannot be read: {e}") from None
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointFile(file, f"refused: {e}; nothing in it was executed") from None
    except Exception as e:  # noqa: BLE001 - truncated or garbled pickle
        raise UnsafeCheckpointFile(file, f"is not valid DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(meta, Metadata):
        raise UnsafeCheckpointFile(file, f"holds a {type(meta).__name__}, not DCP Metadata")
    return meta


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read through the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not used by our checkpoints
            raise UnsafeCheckpointFile(Path(self.path), "per-rank DCP metadata is not supported")
        from torch.distributed.checkpoint.metadata import StorageMeta

        meta = read_dcp_metadata(Path(self.path))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor entries load with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
