"""The COMPLETE marker as a manifest (every file's size and checksum), and checking a checkpoint against it.

``COMPLETE`` is written last, once every rank's files are on disk. Since version 2 it is JSON::

    {"format": "llama-fp8 checkpoint", "version": 2, "step": 200, "world_size": 16,
     "files": {".metadata": {"bytes": 31385, "xxh3_64": "9c1e..."},
               "__0_0.distcp": {"bytes": 676571325, "xxh3_64": "...",
                                "blocks": {"size": 4194304, "xxh3_64": ["...", ...]}}, ...}}

A DCP shard file larger than one block also has a digest per block, so that a load can check it piece by
piece as it reads (``safe_io.VerifiedBlocks``); a manifest without them (an earlier version) is loaded by
reading each file whole first.

Each rank checksums the files it wrote right after writing them (they are still in the page cache),
rank 0 gathers the sums into the manifest. Checking reads every file once: the ranks split the files
between them (``share``) and checksum in parallel. Version 1 markers (``ok``) carry no sums: those
checkpoints are checked for structure only - every file DCP's metadata points into exists and is long
enough, the JSON and per-rank files parse - which catches truncation and missing files, not a flipped
bit inside a shard.

The checksum is XXH3-64 (the ``xxhash`` package, which ``datasets`` requires; ~24 GB/s on one core here,
so that checking costs little more than reading) or, where that package is missing, zlib's CRC32 (~4 GB/s);
the manifest names the one it used. Either detects accidental corruption: truncation, torn writes, bit
rot. Neither is a signature: someone who can write the checkpoint can also rewrite the manifest. That
case is covered by the readers in ``files.py`` and ``dcp_read.py``, which never execute what they read.
"""

from __future__ import annotations

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from llama_fp8 import faults
from llama_fp8.checkpoint import dcp_read, safe_io
from llama_fp8.checkpoint import files as rank_files
from llama_fp8.faults.transient import TransientError

log = logging.getLogger("llama_fp8.checkpoint")

MARKER = "COMPLETE"
FORMAT = "llama-fp8 checkpoint"
VERSION = 2
TRAIN_STATE = "train_state.json"
_CHUNK = 16 << 20


# The checksums live beside the safe reads that check them (safe_io), below files and manifest.
HASHERS = safe_io.HASHERS
ALGORITHM = safe_io.ALGORITHM


def digest_file(path: Path, algorithm: str = ALGORITHM, limit: int | None = None) -> tuple[int, str]:
    """(bytes, hex digest) of a regular file (never a link, a device or a FIFO), read in 16 MiB chunks (both
    hashes release the GIL on large chunks); reads at most ``limit`` + 1 bytes when given."""
    h, n = HASHERS[algorithm](), 0
    with safe_io.open_regular(path) as f:
        while chunk := f.read(_CHUNK if limit is None else max(1, min(_CHUNK, limit + 1 - n))):
            h.update(chunk)
            n += len(chunk)
            if limit is not None and n > limit:
                break
    return n, h.hexdigest()


def digest_bytes(data: bytes, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """(bytes, hex digest) of ``data`` (what was just written to a file)."""
    h = HASHERS[algorithm]()
    h.update(data)
    return len(data), h.hexdigest()


def entry(nbytes: int, digest: str, blocks: list[str] | None = None) -> dict[str, Any]:
    """A file's manifest entry: its size and checksum, and, for a file hashed block by block as it was
    written, the digest of every ``safe_io.BLOCK`` bytes (what the loader checks as it reads)."""
    out: dict[str, Any] = {"bytes": nbytes, ALGORITHM: digest}
    if blocks is not None and nbytes > safe_io.BLOCK:
        out["blocks"] = {"size": safe_io.BLOCK, ALGORITHM: blocks}
    return out


def sums(folder: Path, names: list[str], threads: int = 4) -> dict[str, dict[str, Any]]:
    """{name: {"bytes", ALGORITHM}} of files in ``folder``, several files at a time."""
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        results = list(pool.map(lambda n: digest_file(folder / n), names))
    return {n: {"bytes": b, ALGORITHM: c} for n, (b, c) in zip(names, results)}


def owned_files(meta, rank: int, world: int) -> set[str]:
    """The files of DCP's ``meta`` that rank ``rank`` wrote (``__{rank}_{n}.distcp``); rank 0 also owns
    any file no rank of this world claims, so that every file DCP wrote is checksummed by someone."""
    names = {info.relative_path for info in meta.storage_data.values()}
    base = {n: n.rsplit("/", 1)[-1] for n in names}  # on S3 a prefix strategy puts a shard one level down
    mine = {n for n in names if base[n].startswith(f"__{rank}_")}
    if rank == 0:
        mine |= {n for n in names if not any(base[n].startswith(f"__{r}_") for r in range(world))}
    return mine


def check_against_metadata(folder: Path, files: dict[str, dict], meta=None) -> None:
    """Before COMPLETE is written: every byte range of DCP's metadata (``meta``, else read from ``folder``) lies in a
    file of the manifest; ValueError naming what is missing otherwise (the save then fails on every rank)."""
    meta = meta or dcp_read.read_dcp_metadata(folder, files.get(".metadata"))
    short = sorted({f"{info.relative_path} (needs {info.offset + info.length} bytes, "
                    f"{'not in the manifest' if info.relative_path not in files else files[info.relative_path]['bytes']})"
                    for info in meta.storage_data.values()
                    if info.offset + info.length > int(files.get(info.relative_path, {}).get("bytes", -1))})
    if short or TRAIN_STATE not in files:
        raise ValueError(f"the manifest of {folder} does not cover what DCP wrote: "
                         f"{'; '.join(short[:5]) or f'{TRAIN_STATE} not in the manifest'}")


def write_manifest(folder: Path, step: int, world_size: int, files: dict[str, dict],
                   save_s: float | None = None, copies: list[str] | None = None) -> None:
    """Write COMPLETE (fsynced): the one file whose presence makes a checkpoint complete. ``save_s``: how long the
    save took, from its start to this manifest (what the next run's hang bound and time-limit check use)."""
    body = manifest_text(step, world_size, files, save_s, copies)
    with open(folder / MARKER, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())


def rewrite_copies(folder: Path, man: dict, copies: list[str]) -> None:
    """Rewrite a complete checkpoint's manifest ``man`` (read_manifest's) naming ``copies``: written beside it,
    fsynced and renamed over it, so that a crash leaves the old manifest or the new one, never half of one (the
    temporary file lies beside the folder, not in it: a checkpoint's folder holds only what its manifest lists)."""
    body = manifest_text(int(man["step"]), int(man["world_size"]), man["files"], man.get("save_s"), copies)
    tmp = folder.parent / f".{folder.name}.{MARKER}.tmp"
    with open(tmp, "w") as f:
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / MARKER)


def manifest_text(step: int, world_size: int, files: dict[str, dict], save_s: float | None = None,
                  copies: list[str] | None = None) -> str:
    """The manifest's JSON. ``copies``: where every copy of this checkpoint is meant to live (the file system's
    folder and the S3 prefix of a copied one); a copy is complete only where its own manifest is."""
    extra = {} if save_s is None else {"save_s": round(save_s, 3)}
    if copies:
        extra["copies"] = list(copies)
    return json.dumps({"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size, **extra,
                       "files": dict(sorted(files.items()))}, indent=1) + "\n"


def read_manifest(folder: Path) -> dict | None:
    """The manifest; None for a version-1 marker (no file list). ValueError if it is neither."""
    text = safe_io.read_capped(folder / MARKER, safe_io.MAX_JSON).decode(errors="replace")
    if text.strip() == "ok":
        return None
    return parse_manifest(text, folder, lambda name: safe_io.confined(folder, name))


def parse_manifest(text: str, folder, confine) -> dict:
    """The manifest in ``text`` (of the checkpoint at ``folder``); ValueError if it is not one, or if ``confine``
    refuses one of its names (UnsafeCheckpointFile)."""
    try:
        man = json.loads(text)
        assert man["format"] == FORMAT and isinstance(man["files"], dict)
        assert all(isinstance(v, dict) and isinstance(v.get("bytes"), int) and v["bytes"] >= 0
                   for v in man["files"].values())
    except (ValueError, KeyError, AssertionError, TypeError):
        raise ValueError(f"{folder / MARKER}: not a checkpoint manifest (truncated or overwritten)") from None
    for name in man["files"]:
        confine(name)  # UnsafeCheckpointFile (a ValueError) naming the entry
    return man


def recorded_save_s(folder: Path) -> float | None:
    """The save time a checkpoint's manifest recorded (None: an earlier version, or unreadable)."""
    try:
        value = (read_manifest(folder) or {}).get("save_s")
    except (OSError, ValueError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def listing(folder: Path) -> dict[str, dict[str, Any]]:
    """What a checkpoint should hold: the manifest's files, or (version 1) the files that are there."""
    man = read_manifest(folder)
    if man is not None:
        return man["files"]
    return {p.name: {"bytes": p.stat().st_size} for p in sorted(folder.iterdir())
            if p.name != MARKER and p.is_file() and not p.is_symlink()}


def share(files: dict[str, dict], rank: int, world: int) -> list[str]:
    """This rank's part of the files to check: largest first to the least loaded rank (the same answer
    on every rank, so that every file is checked exactly once)."""
    load, mine = [0] * world, []
    for name in sorted(files, key=lambda n: (-int(files[n].get("bytes", 0)), n)):
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += int(files[name].get("bytes", 0)) + 1
        if r == rank:
            mine.append(name)
    return mine


def check_files(folder: Path, files: dict[str, dict], names: list[str]) -> list[str]:
    """Problems of ``names`` (sizes, checksums, structure); [] when they are sound. A transient I/O error
    is retried (``safe_io.retry``); one that outlasts the retries is raised as a TransientError (the file system's
    failure, not the checkpoint's: it must not be set aside as damaged)."""

    def one(name: str) -> str | None:
        try:
            path = safe_io.confined(folder, name)
            return safe_io.retry(lambda: _check_one(folder, path, files[name]), path, log.warning) or \
                _check_structure(folder, name, files)
        except safe_io.UnsafeCheckpointFile as e:
            return str(e)
        except OSError as e:
            if faults.kind_of(e) is not None:
                raise TransientError("io", f"{folder / name}: {e.strerror or e} after "
                                           f"{len(safe_io.RETRIES)} retries") from e
            return f"{folder / name}: missing or unreadable ({e.strerror or e})"

    with ThreadPoolExecutor(max(1, min(4, len(names)))) as pool:
        return [p for p in pool.map(one, names) if p]


def _check_one(folder: Path, path: Path, want: dict) -> str | None:
    algorithm = next((a for a in HASHERS if a in want), ALGORITHM)
    size, got = digest_file(path, algorithm, limit=int(want["bytes"]))
    if size != int(want["bytes"]):
        return f"{path}: {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)"
    if algorithm in want and got != want[algorithm]:
        return f"{path}: checksum ({algorithm}) {got}, the manifest says {want[algorithm]} (corrupted)"
    return None


def _check_structure(folder: Path, name: str, files: dict[str, dict]) -> str | None:
    """Parse what can be parsed; in particular, files that could carry code are read the safe way."""
    path = folder / name
    try:
        if name == TRAIN_STATE:
            read_train_state(folder)
        elif name == ".metadata":
            meta = dcp_read.read_dcp_metadata(folder)
            for info in meta.storage_data.values():
                have = int(files.get(info.relative_path, {}).get("bytes", -1))
                if info.offset + info.length > have:
                    return (f"{folder / info.relative_path}: DCP metadata needs bytes up to {info.offset + info.length}, "
                            f"the file has {max(have, 0)} (truncated or missing)")
        elif name.startswith("rank") and name.endswith(".safetensors"):
            rank_files.read_rank_state(path)
        elif name.startswith("rank") and name.endswith(".pt"):
            rank_files.read_legacy_rank_state(path)
    except rank_files.UnsafeCheckpointFile as e:
        return str(e)
    except (OSError, ValueError) as e:
        return f"{path}: {e}"
    return None


_STATE_FIELDS = {"step": int, "world_size": int, "scheduler": dict, "config": (dict, type(None)),
                 "plan": (dict, type(None))}


def read_train_state(folder: Path, want: dict | None = None) -> dict:
    """``train_state.json`` (capped; verified against ``want`` on the bytes parsed), with its fields checked:
    UnsafeCheckpointFile naming the file and the field that is missing or of the wrong type."""
    path = folder / TRAIN_STATE
    return parse_train_state(safe_io.read_checked(path, want, safe_io.MAX_JSON, HASHERS), path)


def parse_train_state(raw: bytes, path) -> dict:
    """``train_state.json``'s bytes (``path``: where they were read, for messages), with its fields checked."""
    try:
        state = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        if isinstance(e, safe_io.UnsafeCheckpointFile):
            raise
        raise safe_io.UnsafeCheckpointFile(path, f"is not valid JSON ({e}); truncated or not ours") from None
    if not isinstance(state, dict):
        raise safe_io.UnsafeCheckpointFile(path, f"holds a {type(state).__name__}, not an object")
    for field, kind in _STATE_FIELDS.items():
        if field not in state and field in ("step", "world_size", "scheduler"):
            raise safe_io.UnsafeCheckpointFile(path, f"field {field!r} is missing (truncated or not ours)")
        value = state.get(field)
        if field in state and (not isinstance(value, kind) or isinstance(value, bool)):
            raise safe_io.UnsafeCheckpointFile(path, f"field {field!r} is {value!r}, which is not a "
                                               f"{getattr(kind, '__name__', 'object or null')}; refused")
    if state["step"] < 0 or state["world_size"] < 1:
        bad = "step" if state["step"] < 0 else "world_size"
        raise safe_io.UnsafeCheckpointFile(path, f"field {bad!r} is {state[bad]!r}, out of range; refused")
    return state


def verify(folder: Path, rank: int = 0, world: int = 1) -> list[str]:
    """Problems found in this rank's share of a checkpoint (all of it with the defaults); [] if sound."""
    try:
        files = safe_io.retry(lambda: listing(folder), folder / MARKER, log.warning)
    except (OSError, ValueError) as e:
        return [str(e)]
    if TRAIN_STATE not in files or ".metadata" not in files:
        return [f"{folder}: no {TRAIN_STATE} or .metadata (not a complete checkpoint)"]
    return check_files(folder, files, share(files, rank, world))
