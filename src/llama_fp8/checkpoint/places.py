"""Where checkpoints live: a folder (``Path``) or an S3 prefix (``s3.S3Location``), and the few questions a run asks
of either (which are complete, is one sound, set a damaged one aside, can this rank write there) answered for both.
With ``--checkpoint_copy_dir`` a run has two places: the file system's folder (the fast tier) and S3 (where every
M-th checkpoint is copied); resuming takes the newest complete checkpoint of either (the folder's on a tie)."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

from llama_fp8.checkpoint import layout, manifest
from llama_fp8.checkpoint.s3.location import S3Location, S3Options, is_s3

__all__ = ["S3Location", "candidates", "complete", "copier", "find_resume", "is_s3", "location", "probe_writable",
           "read_train_state", "recorded_save_s", "roots", "set_aside", "strays", "target", "verify"]
from llama_fp8.errors import ConfigError

log = logging.getLogger("llama_fp8.checkpoint")
_targets: dict = {}


def location(value) -> Path | S3Location:
    """``s3://bucket/prefix`` as an S3Location (ConfigError naming the flag if malformed), anything else a Path."""
    if isinstance(value, (Path, S3Location)):
        return value
    if is_s3(value):
        try:
            return S3Location.parse(str(value))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return Path(value)


def target(cfg, where):
    """The S3 target of ``where`` (one per prefix and process: one client), or None for a folder."""
    where = location(where)
    if not isinstance(where, S3Location):
        return None
    try:
        options = S3Options.from_config(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    key = (where.bucket, where.key, options)
    if key not in _targets:
        from llama_fp8.checkpoint.s3.target import S3Target

        _targets[key] = S3Target(where, options)
    return _targets[key]


def roots(cfg, ckpt_dir) -> list:
    """The places checkpoints of this run live: the checkpoint dir, then the copy's (``--checkpoint_copy_dir``)."""
    out = [location(ckpt_dir)]
    if getattr(cfg, "checkpoint_copy_dir", None):
        out.append(location(cfg.checkpoint_copy_dir))
    return out


def complete(cfg, where) -> list[tuple[int, Path | S3Location]]:
    """(step, checkpoint) of every complete checkpoint in ``where``, oldest first."""
    t = target(cfg, where)
    if t is None:
        return layout.complete_checkpoints(location(where))
    from llama_fp8.checkpoint.s3 import commit

    return commit.complete(t.store, t.root)


def candidates(cfg, ckpt_dir) -> list[tuple[int, Path | S3Location]]:
    """Every complete checkpoint of every place, newest first (the folder's before S3's of the same step)."""
    found = [(s, i, p) for i, root in enumerate(roots(cfg, ckpt_dir)) for s, p in complete(cfg, root)]
    return [(s, p) for s, _, p in sorted(found, key=lambda t: (-t[0], t[1]))]


def find_resume(cfg, ckpt_dir):
    """``auto``: the newest complete checkpoint of any place (None if there is none); ``none``: None; else the named
    one, which must be complete."""
    resume = cfg.resume_from_checkpoint
    if resume == "none":
        return None
    if resume == "auto":
        found = candidates(cfg, ckpt_dir)
        return found[0][1] if found else None
    path = location(resume)
    if isinstance(path, S3Location):
        if (path.name, path.parent) not in {(p.name, p.parent) for _, p in complete(cfg, path.parent)}:
            raise ValueError(f"--resume_from_checkpoint {resume}: not a complete checkpoint (no {manifest.MARKER} "
                             f"object under it)")
        return path
    return layout.find_resume(resume, location(ckpt_dir))


def probe_writable(cfg, where, rank: int = 0) -> None:
    """Write and delete a small object (S3) or file (a folder) from this rank: ConfigError if it cannot."""
    t = target(cfg, where)
    if t is None:
        layout.probe_writable(location(where), rank)
        return
    probe = t.root / f".write_probe.{socket.gethostname()}.rank{rank}.{os.getpid()}"
    try:
        t.store.write(probe, b"probe\n")
        t.store.delete(probe)
    except ValueError as e:
        raise ConfigError(f"--checkpoint_dir {t.root} is not writable from rank {rank}: {e}") from None


def verify(cfg, path, rank: int, world: int) -> list[str]:
    t = target(cfg, path)
    if t is None:
        return manifest.verify(location(path), rank, world)
    from llama_fp8.checkpoint.s3 import commit

    return commit.verify(t.store, path, rank, world)


def set_aside(cfg, path) -> str:
    t = target(cfg, path)
    if t is None:
        return f"renamed to {layout.set_aside(location(path)).name} for inspection"
    from llama_fp8.checkpoint.s3 import commit

    return commit.set_aside(t.store, path)


def read_train_state(cfg, path) -> dict:
    t = target(cfg, path)
    if t is None:
        return manifest.read_train_state(location(path))
    from llama_fp8.checkpoint.s3 import read as s3read

    files = s3read.read_manifest(t.store, path)["files"]
    return s3read.read_train_state(t.store, path, files.get(manifest.TRAIN_STATE))


def recorded_save_s(cfg, path) -> float | None:
    t = target(cfg, path)
    return manifest.recorded_save_s(location(path)) if t is None else t.recorded_save_s(path)


def strays(cfg, where) -> list[str]:
    """``step_N`` places that are not checkpoints of this run (named at start-up, never deleted)."""
    t = target(cfg, where)
    if t is None:
        return [str(p) for p in layout.incomplete_folders(location(where))]
    from llama_fp8.checkpoint.s3 import commit

    return [str(p) for _, p, keys in commit.steps(t.store, t.root) if keys and commit.WRITER not in keys]


def copier(cfg, rank: int):
    """Rank 0's background copier of checkpoints to ``--checkpoint_copy_dir`` (None elsewhere, or without one)."""
    if not getattr(cfg, "checkpoint_copy_dir", None) or rank != 0:
        return None
    from llama_fp8.checkpoint.s3.copy import Copier

    return Copier(target(cfg, cfg.checkpoint_copy_dir), cfg.checkpoint_copy_every, cfg.keep_last_k)
