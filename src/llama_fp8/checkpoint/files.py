"""The per-rank state file of a checkpoint, read so that it cannot execute code.

- Per-rank state (data-loader position, RNG states) is ``rank{r}.safetensors``: the tensors as
  safetensors (a JSON header + raw bytes), everything else as JSON in the header's metadata. Neither
  can carry code. Tuples and numpy arrays are tagged so that they come back as what was saved.
- Checkpoints of earlier versions hold ``rank{r}.pt`` (``torch.save`` pickles). They are read with
  ``torch.load(weights_only=True)`` plus an explicit allow-list of the three numpy globals an RNG state
  needs (numpy's own array reconstruction); a pickled callable or any other global is refused.

DCP's own files (``.metadata`` and the shards) are read by ``dcp_read.py``.
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

from llama_fp8.checkpoint import safe_io
from llama_fp8.checkpoint.safe_io import UnsafeCheckpointFile

RANK_FILE = "rank{}.safetensors"
LEGACY_RANK_FILE = "rank{}.pt"
_META_KEY = "llama_fp8.state"
_FORMAT = "llama-fp8 rank state v2"


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


def rank_state_bytes(state: dict) -> bytes:
    """This rank's state as the bytes of a ``rank{r}.safetensors``."""
    from safetensors.torch import save as st_save

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors)
    return st_save(tensors, metadata={"format": _FORMAT, _META_KEY: json.dumps(skeleton)})


def write_rank_state(path: Path, state: dict) -> bytes:
    """Write this rank's state (and fsync it: a checkpoint is complete only once its bytes are on disk);
    returns the bytes written (the caller hashes them for the manifest)."""
    blob = rank_state_bytes(state)
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    return blob


def read_rank_state(path: Path, want: dict | None = None) -> dict:
    """This rank's state from ``rank{r}.safetensors`` (verified against its manifest entry ``want`` on the
    bytes that are parsed); UnsafeCheckpointFile if it is not one."""
    try:
        blob = safe_io.read_checked(Path(path), want, safe_io.MAX_RANK_FILE, safe_io.HASHERS)
    except UnsafeCheckpointFile:
        raise
    except OSError as e:
        raise UnsafeCheckpointFile(path, f"cannot be read: {e}") from None
    return parse_rank_state(blob, path)


def parse_rank_state(blob, path) -> dict:
    """A per-rank state from the (verified) bytes of a ``rank{r}.safetensors`` read from ``path``."""
    from safetensors.torch import load as st_load

    try:
        tensors = st_load(bytes(blob))  # safetensors takes bytes only
        n = int.from_bytes(blob[:8], "little")  # safetensors: 8-byte header length, then the JSON header
        meta = json.loads(blob[8:8 + n]).get("__metadata__") or {}
        if meta.get("format") != _FORMAT:
            raise ValueError(f"header format {meta.get('format')!r}, expected {_FORMAT!r}")
        return _decode(json.loads(meta[_META_KEY]), tensors)
    except UnsafeCheckpointFile:
        raise
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
            blob = safe_io.read_capped(Path(path), safe_io.MAX_RANK_FILE)
            state = torch.load(io.BytesIO(blob), weights_only=True, map_location="cpu")
    except UnsafeCheckpointFile:
        raise
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
