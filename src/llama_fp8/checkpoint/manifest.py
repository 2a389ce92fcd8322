"""The COMPLETE marker as a manifest (every file's size and checksum), and checking a checkpoint against it.

``COMPLETE`` is written last, once every rank's files are on disk. Since version 2 it is JSON::

    {"format": "llama-fp8 checkpoint", "version": 2, "step": 200, "world_size": 16,
     "files": {".metadata": {"bytes": 31385, "xxh3_64": "9c1e..."}, "__0_0.distcp": {...}, ...}}

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
case is covered by the readers in ``files.py``, which never execute what they read.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from llama_fp8.checkpoint import files as F

MARKER = "COMPLETE"
FORMAT = "llama-fp8 checkpoint"
VERSION = 2
TRAIN_STATE = "train_state.json"
_CHUNK = 16 << 20


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _hashers() -> dict[str, Any]:
    out: dict[str, Any] = {"crc32": _Crc32}
    try:
        import xxhash

        out["xxh3_64"] = xxhash.xxh3_64
    except ImportError:
        pass
    return out


HASHERS = _hashers()
ALGORITHM = "xxh3_64" if "xxh3_64" in HASHERS else "crc32"


def digest_file(path: Path, algorithm: str = ALGORITHM) -> tuple[int, str]:
    """(bytes, hex digest) of a file, read in 16 MiB chunks (both hashes release the GIL on large chunks)."""
    h, n = HASHERS[algorithm](), 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


def sums(folder: Path, names: list[str], threads: int = 4) -> dict[str, dict[str, Any]]:
    """{name: {"bytes", ALGORITHM}} of files in ``folder``, several files at a time."""
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        results = list(pool.map(lambda n: digest_file(folder / n), names))
    return {n: {"bytes": b, ALGORITHM: c} for n, (b, c) in zip(names, results)}


def write_manifest(folder: Path, step: int, world_size: int, files: dict[str, dict]) -> None:
    """Write COMPLETE (fsynced): the one file whose presence makes a checkpoint complete."""
    body = json.dumps({"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
                       "files": dict(sorted(files.items()))}, indent=1)
    with open(folder / MARKER, "w") as f:
        f.write(body + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(folder: Path) -> dict | None:
    """The manifest; None for a version-1 marker (no file list). ValueError if it is neither."""
    text = (folder / MARKER).read_text(errors="replace")
    if text.strip() == "ok":
        return None
    try:
        man = json.loads(text)
        assert man["format"] == FORMAT and isinstance(man["files"], dict)
        return man
    except (ValueError, KeyError, AssertionError, TypeError):
        raise ValueError(f"{folder / MARKER}: not a checkpoint manifest (truncated or overwritten)") from None


def listing(folder: Path) -> dict[str, dict[str, Any]]:
    """What a checkpoint should hold: the manifest's files, or (version 1) the files that are there."""
    man = read_manifest(folder)
    if man is not None:
        return man["files"]
    return {p.name: {"bytes": p.stat().st_size} for p in sorted(folder.iterdir()) if p.name != MARKER and p.is_file()}


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
    """Problems of ``names`` (sizes, checksums, structure); [] when they are sound."""
    problems: list[str] = []

    def one(name: str) -> str | None:
        path, want = folder / name, files[name]
        try:
            size = path.stat().st_size
        except OSError as e:
            return f"{path}: missing or unreadable ({e.strerror})"
        if size != int(want["bytes"]):
            return f"{path}: {size} bytes, the manifest says {want['bytes']} (truncated or overwritten)"
        algorithm = next((a for a in HASHERS if a in want), None)
        if algorithm is not None:
            got = digest_file(path, algorithm)[1]
            if got != want[algorithm]:
                return f"{path}: checksum ({algorithm}) {got}, the manifest says {want[algorithm]} (corrupted)"
        return _check_structure(folder, name, files)

    with ThreadPoolExecutor(max(1, min(4, len(names)))) as pool:
        problems = [p for p in pool.map(one, names) if p]
    return problems


def _check_structure(folder: Path, name: str, files: dict[str, dict]) -> str | None:
    """Parse what can be parsed; in particular, files that could carry code are read the safe way."""
    path = folder / name
    try:
        if name == TRAIN_STATE:
            state = json.loads(path.read_text())
            missing = {"step", "world_size", "scheduler"} - set(state)
            if missing:
                return f"{path}: no {sorted(missing)} (truncated or not ours)"
        elif name == ".metadata":
            meta = F.read_dcp_metadata(folder)
            for info in meta.storage_data.values():
                have = int(files.get(info.relative_path, {}).get("bytes", -1))
                if info.offset + info.length > have:
                    return (f"{folder / info.relative_path}: DCP metadata needs bytes up to {info.offset + info.length}, "
                            f"the file has {max(have, 0)} (truncated or missing)")
        elif name.startswith("rank") and name.endswith(".safetensors"):
            F.read_rank_state(path)
        elif name.startswith("rank") and name.endswith(".pt"):
            F.read_legacy_rank_state(path)
    except F.UnsafeCheckpointFile as e:
        return str(e)
    except (OSError, ValueError) as e:
        return f"{path}: {e}"
    return None


def verify(folder: Path, rank: int = 0, world: int = 1) -> list[str]:
    """Problems found in this rank's share of a checkpoint (all of it with the defaults); [] if sound."""
    try:
        files = listing(folder)
    except (OSError, ValueError) as e:
        return [str(e)]
    if TRAIN_STATE not in files or ".metadata" not in files:
        return [f"{folder}: no {TRAIN_STATE} or .metadata (not a complete checkpoint)"]
    return check_files(folder, files, share(files, rank, world))
