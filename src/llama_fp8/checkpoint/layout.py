"""Names in ``--checkpoint_dir`` and finding the complete checkpoints among them.

Only ``step_N`` folders that hold the ``COMPLETE`` marker count. Everything else is ignored when
resuming: ``step_N.tmp`` (a save in progress or interrupted), ``step_N.old`` (a checkpoint being
deleted by ``--keep_last_k`` or replaced by a newer save of the same step) and ``step_N.broken`` (set
aside because it failed its check at start-up; kept for inspection, never deleted by us).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from llama_fp8.checkpoint.manifest import MARKER

_STEP_RE = re.compile(r"^step_(\d+)$")
TMP, OLD, BROKEN = ".tmp", ".old", ".broken"


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    out = []
    if ckpt_dir.is_dir():
        for p in ckpt_dir.iterdir():
            m = _STEP_RE.match(p.name)
            if m and (p / MARKER).is_file():
                out.append((int(m.group(1)), p))
    return sorted(out)


def find_resume(resume: str, ckpt_dir: Path) -> Path | None:
    """``auto``: the latest complete checkpoint in ckpt_dir (None if there is none); ``none``: None;
    else the given folder, which must be a complete checkpoint. (Whether its files are sound is checked
    next, on every rank: ``resume.check_resume``.)"""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(ckpt_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / MARKER).is_file():
        raise ValueError(f"--resume_from_checkpoint {resume}: not a complete checkpoint (no {MARKER} marker); "
                         f"complete ones in {ckpt_dir}: {[str(p) for _, p in complete_checkpoints(ckpt_dir)]}")
    return path


def step_of(path: Path) -> int:
    m = _STEP_RE.match(Path(path).name)
    assert m, path
    return int(m.group(1))


def remove_leftovers(ckpt_dir: Path) -> None:
    """Interrupted saves and deletions of an earlier attempt (never a complete or a broken checkpoint)."""
    for stale in [*ckpt_dir.glob(f"step_*{TMP}"), *ckpt_dir.glob(f"step_*{OLD}")]:
        shutil.rmtree(stale, ignore_errors=True)


def retire(path: Path) -> Path:
    """Take a complete checkpoint out of the resume candidates in one atomic rename (``step_N.old``);
    the caller deletes it after. A crash in between leaves a folder the next save removes, never a
    half-deleted ``step_N`` that still looks complete."""
    old = path.with_name(path.name + OLD)
    if old.exists():
        shutil.rmtree(old)
    path.rename(old)
    return old


def set_aside(path: Path) -> Path:
    """Rename a checkpoint that failed its check to ``step_N.broken`` (``.broken.2``, ... if taken)."""
    target, n = path.with_name(path.name + BROKEN), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{BROKEN}.{n}")
    path.rename(target)
    fsync_dir(path.parent)
    return target


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new entry in ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
