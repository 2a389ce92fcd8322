"""Names in ``--checkpoint_dir`` and finding the complete checkpoints among them.

Only ``step_N`` folders that hold the ``COMPLETE`` marker count. Everything else is ignored when
resuming: ``step_N.tmp`` (a save in progress or interrupted), ``step_N.old`` (a checkpoint being
deleted by ``--keep_last_k`` or replaced by a newer save of the same step) and ``step_N.broken`` (set
aside because it failed its check at start-up; kept for inspection, never deleted by us). A ``step_N``
folder without ``COMPLETE`` (not ours: copied by hand, or left by another tool) is named at start-up and,
if this run saves step N, renamed ``step_N.incomplete`` first: never deleted. A checkpoint folder that
exists but cannot be listed stops the run: an empty listing would silently start the run over.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from llama_fp8 import faults
from llama_fp8.checkpoint import safe_io
from llama_fp8.checkpoint.manifest import MARKER
from llama_fp8.errors import ConfigError
from llama_fp8.faults.transient import TransientError

_STEP_RE = re.compile(r"^step_(\d+)$")
TMP, OLD, BROKEN, INCOMPLETE = ".tmp", ".old", ".broken", ".incomplete"


def step_folders(ckpt_dir: Path) -> list[tuple[int, Path, bool]]:
    """(step, path, complete) of every ``step_N`` folder, oldest first; ConfigError if ``ckpt_dir`` exists
    but cannot be listed (after retrying a transient error)."""
    try:
        entries = safe_io.retry(lambda: list(Path(ckpt_dir).iterdir()), Path(ckpt_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        raise ConfigError(f"--checkpoint_dir {ckpt_dir} cannot be listed ({e.strerror or e}): its checkpoints "
                          f"cannot be found, and starting over could overwrite them. Fix the mount or the "
                          f"permissions and rerun (nothing was changed)") from None
    out = []
    for p in entries:
        m = _STEP_RE.match(p.name)
        if m and p.is_dir() and not p.is_symlink():
            out.append((int(m.group(1)), p, (p / MARKER).is_file()))
    return sorted(out)


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    return [(s, p) for s, p, done in step_folders(ckpt_dir) if done]


def incomplete_folders(ckpt_dir: Path) -> list[Path]:
    """``step_N`` folders without the COMPLETE marker (not resume candidates; named, never deleted)."""
    return [p for _, p, done in step_folders(ckpt_dir) if not done]


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


def step_of(path) -> int:
    """N of a ``step_N`` folder or S3 prefix."""
    m = _STEP_RE.match(path.name if hasattr(path, "name") else Path(path).name)
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


def set_aside(path: Path, suffix: str = BROKEN) -> Path:
    """Rename a checkpoint that failed its check to ``step_N.broken`` (``.broken.2``, ... if taken)."""
    target, n = path.with_name(path.name + suffix), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{suffix}.{n}")
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


def probe_writable(folder: Path, rank: int = 0) -> None:
    """Create ``folder`` if needed and write, fsync and delete a probe file in it; ConfigError if not."""
    probe = folder / f".write_probe.rank{rank}.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"probe\n")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        if faults.kind_of(e) is not None:  # EIO, ESTALE: the file system for a moment, not the setting
            raise TransientError("io", f"--checkpoint_dir {folder}: a probe write from rank {rank} failed "
                                       f"({e.strerror or e})") from e
        raise ConfigError(f"--checkpoint_dir {folder} is not writable from rank {rank} ({e.strerror or e}): no "
                          f"checkpoint could be saved; fix its permissions or mount, or choose another "
                          f"--checkpoint_dir (nothing was computed)") from None
