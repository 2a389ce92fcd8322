"""The commit protocol on S3, where nothing can be renamed: a checkpoint is complete when its manifest object is.

Layout under ``--checkpoint_dir s3://bucket/prefix``::

    step_200/WRITER          first object of a save: who writes this prefix (job, host, pid); marks it ours
    step_200/.metadata, __0_0.distcp (or 0000000000/__0_0.distcp with a prefix strategy), rank0.safetensors,
             train_state.json
    step_200/COMPLETE        the manifest, written LAST, and only after a listing of the prefix showed every
                             object it names with the size it names (list-and-verify; S3's listings are strongly
                             consistent with the writes before them)
    step_200/BROKEN          a manifest set aside because the objects failed their check at start-up (kept)
    step_300.incomplete/...  objects of a step_300 prefix that was not ours, moved aside before this run saved 300
    step_200.replaced/...    a complete step_200 of an earlier attempt, moved aside while this run saves step 200 again;
                             deleted once the new one is complete (kept if the new save fails)

A prefix with ``WRITER`` and without ``COMPLETE`` is a save that was interrupted (or a retirement: keep_last_k
deletes ``COMPLETE`` first): never loaded, its objects of our names removed by the next save. A prefix without
``WRITER`` is not ours: named, never deleted. Objects of other names inside one of ours are left where they are.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import socket

from llama_fp8.checkpoint import manifest
from llama_fp8.checkpoint.s3.location import S3Location
from llama_fp8.checkpoint.s3.store import ObjectMissing, ObjectStore

log = logging.getLogger("llama_fp8.checkpoint")
WRITER, BROKEN, INCOMPLETE, REPLACED = "WRITER", "BROKEN", ".incomplete", ".replaced"
_STEP = re.compile(r"^step_(\d+)$")
_OURS = re.compile(r"^(?:[0-9a-f]{1,64}/)?__\d+_\d+\.distcp$|^\.metadata(?:\.tmp)?$|^rank\d+\.safetensors$|"
                   r"^train_state\.json$|^COMPLETE$|^BROKEN$|^WRITER$")
"""Keys a save of ours writes (a prefix strategy adds one level of hex or binary digits before a shard)."""


def steps(store: ObjectStore, root: S3Location) -> list[tuple[int, S3Location, dict[str, int]]]:
    """(step, prefix, {key: size}) of every ``step_N`` prefix under ``root``, oldest first."""
    out = []
    for name in store.children(root):
        m = _STEP.match(name)
        if m:
            out.append((int(m.group(1)), root / name, store.list(root / name)))
    return sorted(out, key=lambda t: t[0])


def complete(store: ObjectStore, root: S3Location) -> list[tuple[int, S3Location]]:
    """(step, prefix) of every checkpoint with a manifest, oldest first (whether its objects are sound is checked
    before a resume: ``verify``)."""
    return [(s, p) for s, p, keys in steps(store, root) if manifest.MARKER in keys]


def holder() -> dict:
    return {"job_id": os.environ.get("SLURM_JOB_ID") or None, "host": socket.gethostname(), "pid": os.getpid(),
            "since": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def begin(store: ObjectStore, root: S3Location, step: int, sweep: bool) -> S3Location:
    """Rank 0, before any rank writes: interrupted saves of ours removed (``sweep``: once per run), a ``step_N``
    prefix that is not ours moved aside, then ``WRITER`` written. Returns the checkpoint's prefix."""
    ckpt = root / f"step_{step}"
    for s, prefix, keys in steps(store, root):
        if BROKEN in keys:  # set aside at a start-up check: kept; moved out of the way if this step is saved again
            if s == step:
                _move(store, prefix, keys, root / f"step_{step}.broken", "a checkpoint set aside as damaged")
        elif manifest.MARKER not in keys and WRITER in keys:
            if sweep or s == step:  # an interrupted save (or retirement) of ours
                remove_ours(store, prefix, keys)
        elif s == step and keys and WRITER not in keys:
            _move(store, prefix, keys, root / f"step_{step}{INCOMPLETE}", f"objects without {WRITER} (not a "
                                                                           f"checkpoint of this run)")
        elif s == step and manifest.MARKER in keys:  # the same step from an earlier attempt: kept until this one
            _move(store, prefix, keys, root / f"step_{step}{REPLACED}", "a complete checkpoint of an earlier attempt")
    store.write(ckpt / WRITER, json.dumps(holder()).encode())
    return ckpt


def _move(store: ObjectStore, prefix: S3Location, keys: dict[str, int], aside: S3Location, what: str) -> None:
    """Every object under ``prefix`` copied (server-side) under ``aside``, then deleted: kept, out of the way."""
    log.warning("%s holds %s (%d objects); moved to %s/ before this run saves that step, not deleted", prefix, what,
                len(keys), aside)
    for key in keys:
        store.copy(prefix / key, aside / key)
        store.delete(prefix / key)


def remove_ours(store: ObjectStore, prefix: S3Location, keys: dict[str, int] | None = None) -> None:
    """Delete the objects of our names under ``prefix``, the manifest first (from then on it is no longer complete)
    and ``WRITER`` last (until then a crash leaves a prefix the next save recognizes as ours)."""
    keys = store.list(prefix) if keys is None else keys
    order = sorted((k for k in keys if _OURS.match(k)), key=lambda k: (k != manifest.MARKER, k == WRITER, k))
    for key in order:
        try:
            store.delete(prefix / key)
        except ObjectMissing:
            pass
    others = sorted(k for k in keys if not _OURS.match(k))
    if others:
        log.warning("%s: %d objects not of a checkpoint's names kept (%s)", prefix, len(others), ", ".join(others[:3]))


def publish(store: ObjectStore, ckpt: S3Location, step: int, world: int, files: dict[str, dict],
            save_s: float | None, copies: list[str] | None = None) -> None:
    """List-and-verify, then the manifest: ValueError naming what is missing or of another size (nothing is then
    marked complete)."""
    listed = store.list(ckpt)
    wrong = [f"{name} ({_size(listed.get(name))}, expected {e['bytes']} bytes)" for name, e in sorted(files.items())
             if listed.get(name) != int(e["bytes"])]
    if wrong:
        raise ValueError(f"{ckpt}: the listing does not show what the ranks wrote: {'; '.join(wrong[:5])}")
    store.write(ckpt / manifest.MARKER, manifest.manifest_text(step, world, files, save_s, copies).encode())


def set_aside(store: ObjectStore, ckpt: S3Location) -> str:
    """A checkpoint that failed its check: its manifest moved to ``BROKEN`` (no longer a resume candidate; every
    object kept for inspection)."""
    store.copy(ckpt / manifest.MARKER, ckpt / BROKEN)
    store.delete(ckpt / manifest.MARKER)
    return f"its manifest moved to {ckpt}/{BROKEN} for inspection"


def verify(store: ObjectStore, ckpt: S3Location, rank: int = 0, world: int = 1) -> list[str]:
    """Problems of this rank's share of the checkpoint (list-and-verify: every object named, of its size; then the
    checksums of the objects read); [] if sound. A transient failure is raised (TransientError)."""
    from llama_fp8.checkpoint.s3 import read as s3read

    try:
        files = s3read.read_manifest(store, ckpt)["files"]
    except ValueError as e:
        return [str(e)]
    if manifest.TRAIN_STATE not in files or ".metadata" not in files:
        return [f"{ckpt}: no {manifest.TRAIN_STATE} or .metadata (not a complete checkpoint)"]
    listed = store.list(ckpt)
    mine = manifest.share(files, rank, world)
    problems = [f"{ckpt}/{n}: {_size(listed.get(n))}, the manifest says {files[n]['bytes']} bytes (truncated, "
                f"overwritten or deleted)" for n in mine if listed.get(n) != int(files[n]["bytes"])]
    for name in (n for n in mine if listed.get(n) == int(files[n]["bytes"])):
        try:
            _check_one(store, ckpt, name, files)
        except ValueError as e:  # UnsafeCheckpointFile: a checksum, a forged field, a name outside
            problems.append(str(e))
    return problems


def _check_one(store: ObjectStore, ckpt: S3Location, name: str, files: dict) -> None:
    from llama_fp8.checkpoint.s3 import read as s3read

    want = files[name]
    if name == manifest.TRAIN_STATE:
        s3read.read_train_state(store, ckpt, want)
    elif name == ".metadata":  # and every byte range it points to lies in an object the manifest lists
        meta = s3read.read_dcp_metadata(store, ckpt, want)
        short = sorted({info.relative_path for info in meta.storage_data.values()
                        if info.offset + info.length > int(files.get(info.relative_path, {}).get("bytes", -1))})
        if short:
            raise ValueError(f"{ckpt}/.metadata points past the end of {', '.join(short[:3])} (truncated or missing)")
    elif name.startswith("rank") and name.endswith(".safetensors"):
        s3read.read_rank_state(store, ckpt, int(name[4:-len(".safetensors")]), files)
    elif "blocks" in want:  # a shard: read forward, every block against its digest, nothing kept
        reader = s3read._Objects(store, ckpt, files).blocks(name, want, 0)
        try:
            end = 0
            while end < reader.size:
                end = min(reader.size, end + reader.block)
                reader.span(end - min(reader.block, end), end)
        finally:
            reader.close()
    else:
        s3read.read_checked(store, s3read.confined_key(ckpt, name), want, 1 << 62)


def _size(n: int | None) -> str:
    return "missing" if n is None else f"{n} bytes"
