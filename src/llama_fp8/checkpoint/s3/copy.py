"""The two tiers: checkpoints saved to the shared file system (FSx for Lustre: fast, sized for throughput), every
M-th copied to S3 (durable, outlives the cluster) in the background while training goes on.

The copy runs in one thread of rank 0 after the checkpoint is complete on the file system (every rank's files are
there: a shared file system). It streams each file the manifest lists to an object, hashing the bytes on their way
and comparing them with the manifest (a file damaged on the file system is not copied as sound), then publishes the
copy with S3's commit protocol (``commit``: list-and-verify, the manifest last). Both manifests name both places
(``copies``). While a copy runs, ``--keep_last_k`` does not delete its source; one copy at a time (the next waits:
a copy slower than the checkpoint interval delays the next copy, never a training step). A failed copy is logged
and counted; the checkpoint on the file system is untouched and training goes on.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from llama_fp8.checkpoint import manifest, safe_io
from llama_fp8.checkpoint.s3 import commit
from llama_fp8.checkpoint.s3.location import S3Location

log = logging.getLogger("llama_fp8.checkpoint")
_CHUNK = 8 << 20


class Copier:
    def __init__(self, target, every: int, keep: int) -> None:
        self.target, self.every, self.keep = target, every, keep
        self._saves, self._swept, self.failures = 0, False, 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-copy")
        self._pending: tuple[int, Future] | None = None
        self.copied: list[int] = []  # steps copied and published, in order
        self.skipped: int | None = None  # a due copy skipped (the one before still running), none copied since

    def destination(self, step: int) -> S3Location | None:
        """Where checkpoint ``step`` is copied to, if it is (every ``every``-th save, unless the previous copy is
        still running: then the next one due is copied); counts the save."""
        self._saves += 1
        if (self._saves - 1) % self.every:
            return None
        if self.busy() is not None:
            log.warning("the copy of step_%d to S3 is still running: step_%d is not copied (the next one due is); "
                        "copies slower than checkpoints: raise --checkpoint_copy_every", self.busy(), step)
            self._saves -= 1  # the next save is due instead
            self.skipped = step  # unless a later one is copied, the end of the run copies it (late)
            return None
        self.skipped = None
        return self.target.root / f"step_{step}"

    def busy(self) -> int | None:
        """The step being copied (its source must stay), or None."""
        return self._pending[0] if self._pending and not self._pending[1].done() else None

    def submit(self, folder: Path, step: int) -> None:
        """Copy the complete checkpoint ``folder`` in the background (after the copy before it, if any)."""
        self._pending = (step, self._pool.submit(self._copy_logged, folder, step))

    def join(self) -> None:
        """Wait for the copy in flight (at the end of a run: its checkpoint should reach S3)."""
        if self._pending is not None:
            self._pending[1].result()

    def finish(self, folder_root: Path, latest: int | None) -> None:
        """At the end of a run: wait for the copy in flight; then, if the run's last due copy was skipped while the
        copy before it ran and ``latest`` (the run's newest complete checkpoint under ``folder_root``) is that one,
        copy it now, so that the run's newest checkpoint reaches S3 (before, a copy slower than the checkpoint
        interval left it on the file system only). Its manifest is rewritten first (atomically) to name both
        places, as a copy made at save time does."""
        self.join()
        step, self.skipped = self.skipped, None
        folder = folder_root / f"step_{step}"
        if step is None or step != latest or not (folder / manifest.MARKER).is_file():
            return
        man = manifest.read_manifest(folder)
        if man is None:  # a version-1 marker: no file list to copy by
            return
        dest = self.target.root / folder.name
        manifest.rewrite_copies(folder, man, [str(folder), str(dest)])
        log.info("copying %s to %s now: its copy was skipped while the copy before it ran", folder, dest)
        self.submit(folder, step)
        self.join()

    def _copy_logged(self, folder: Path, step: int) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = self.copy(folder, step)
        except Exception as e:  # noqa: BLE001 - a failed copy never stops training; the folder's copy stands
            self.failures += 1
            log.warning("COPY of %s to %s FAILED (%s: %s); the checkpoint on the file system is intact, the next "
                        "copy tries again", folder, self.target.root / folder.name, type(e).__name__, e)
            return
        dt = time.perf_counter() - t0
        log.info("copied %s to %s: %.1f MiB in %.1f s (%.1f MiB/s), in the background", folder,
                 self.target.root / folder.name, nbytes / 2**20, dt, nbytes / 2**20 / max(dt, 1e-9))

    def copy(self, folder: Path, step: int) -> int:
        store, root = self.target.store, self.target.root
        man = manifest.read_manifest(folder)
        files = man["files"]
        ckpt = commit.begin(store, root, step, sweep=not self._swept)
        self._swept = True
        with ThreadPoolExecutor(max(1, min(self.target.options.threads, len(files)))) as pool:
            list(pool.map(lambda name: self._upload(folder, name, files[name], ckpt / name), sorted(files)))
        commit.publish(store, ckpt, step, int(man["world_size"]), files, man.get("save_s"),
                       copies=man.get("copies") or [str(folder), str(ckpt)])
        self.copied.append(step)
        done = commit.complete(store, root)
        for _, old in (done[:-self.keep] if self.keep > 0 else []):
            self.target.retire(old)
        return sum(int(e["bytes"]) for e in files.values())

    def _upload(self, folder: Path, name: str, want: dict, where: S3Location) -> None:
        """One file streamed to one object, checked against the manifest on the bytes sent."""
        algorithm = next((a for a in safe_io.HASHERS if a in want), manifest.ALGORITHM)

        def run() -> None:
            h, n = safe_io.HASHERS[algorithm](), 0
            with safe_io.open_regular(safe_io.confined(folder, name)) as f, \
                    self.target.store.client.put_object(where.bucket, where.key) as w:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    n += len(chunk)
                    w.write(chunk)
                if n != int(want["bytes"]) or (algorithm in want and h.hexdigest() != want[algorithm]):
                    raise safe_io.UnsafeCheckpointFile(folder / name, f"{n} bytes, checksum {h.hexdigest()}: not "
                                                       f"what the manifest says ({want['bytes']} bytes); not copied")

        self.target.store._call(f"copying {folder / name} to {where}", run)
