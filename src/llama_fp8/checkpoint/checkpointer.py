"""Saving (sync or async, atomic, checksummed) and loading one run's checkpoints."""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from llama_fp8 import faults
from llama_fp8.checkpoint import dcp_read, layout, manifest
from llama_fp8.checkpoint import files as rank_files
from llama_fp8.checkpoint.failures import _describe, _kind, _merge, _space
from llama_fp8.checkpoint.restore import (
    _entry,
    _jsonable,
    _load_scheduler,
    _manifest_files,
    _rng_state,
    _set_rng_state,
    check_fits,
    read_rank_file,
)
from llama_fp8.checkpoint.writer import HashingFileSystemWriter
from llama_fp8.errors import AgreedError, ConfigError
from llama_fp8.faults.transient import AgreedTransient

log = logging.getLogger("llama_fp8.checkpoint")


class CheckpointWriteError(AgreedError):
    """A save failed on at least one rank; every rank raises it together (rank 0 reports it). Nothing of
    that save was marked complete; the checkpoints saved before it are untouched."""


class CheckpointTransientError(AgreedTransient):
    """A save or load failed on some rank with an error of the file system's (EIO, ESTALE: ``faults.transient``);
    every rank raises it together: the launcher restarts the workers, who resume from the latest complete one."""


class Checkpointer:
    """Saves every --checkpoint_freq steps (and at the end), keeps the last --keep_last_k, resumes."""

    def __init__(self, ckpt_dir: Path, keep_last_k: int, async_save: bool, rank: int, world: int,
                 timeout_s: float | None = None, s3=None, copy=None):
        self.dir, self.keep, self.async_save, self.rank, self.world = ckpt_dir, keep_last_k, async_save, rank, world
        self.s3 = s3  # an s3.target.S3Target when ckpt_dir is an s3:// prefix (then self.dir is its S3Location)
        self.copy = copy  # rank 0's s3.copy.Copier with --checkpoint_copy_dir: every M-th checkpoint to S3
        # DCP's collectives (and ours around a save) run on a gloo group of their own: an async save's
        # background thread must never share a group with the training's collectives (two threads issuing
        # collectives on one group can pair different operations across ranks), and async saves need a
        # CPU backend, which an NCCL-only default group does not have. Its collectives wait up to ``timeout_s``
        # (--checkpoint_timeout: a rank still writing a large state), not the training's timeout.
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else faults.collective_timeout()
        self._pg = dist.new_group(backend="gloo", timeout=timeout) if dist.is_initialized() else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt") if async_save else None
        # One stager for the run: it keeps its host-memory copy of the state between saves, so staging a
        # save is a copy into memory already mapped, not an allocation of the state's size with all its page
        # faults (1.3 GB over 2 ranks here: 0.13 s instead of 0.5-0.7 s of blocked training per save). The
        # copy costs host memory the size of this rank's shards, for the whole run.
        self._stager = _stager() if async_save else None
        self._pending: tuple[Future, Path, Path, int] | None = None  # (this rank's sums, tmp, final, step)
        self._own_digests: dict[str, tuple[int, str]] = {}  # the per-rank file and train_state.json, as written
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="ckpt-delete")  # retired checkpoints
        self._swept = False  # leftovers of an earlier attempt removed (by the first save of this run)
        self.last_complete: int | None = None  # the step of the latest checkpoint known complete (saved or loaded)
        self._started = 0.0  # perf_counter at the start of the save being finalized (its manifest records the time)

    def join_copy(self) -> None:
        """At the end of a run: wait for the background copy to S3 in flight (rank 0 with --checkpoint_copy_dir), and
        for the deletion of retired S3 checkpoints (a prefix left half-deleted is billed until the next run's first
        save removes it; a folder's deletion is not waited for: the next run's first save finishes it)."""
        if self.copy is not None:
            self.copy.finish(self.dir, self.last_complete)
        if self.s3 is not None:
            self._deleter.shutdown(wait=True)
            self._deleter = ThreadPoolExecutor(1, thread_name_prefix="ckpt-delete")

    @property
    def group(self):
        """The process group of the checkpoint's collectives (None on one rank)."""
        return self._pg

    # --- save ----------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, scheduler, loader, cfg, plan=None) -> None:
        """Write checkpoint ``step``; with async_save, returns once the state is staged in host memory."""
        self.wait()  # at most one save in flight: the previous one is finalized first
        final = self.dir / f"step_{step}"
        tmp = final if self.s3 else self.dir / f"step_{step}{layout.TMP}"  # on S3 the manifest is what completes
        t0 = self._started = time.perf_counter()
        self._agree(step, lambda: self._prepare(tmp, step) if self.rank == 0 else None)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        self._agree(step, lambda: self._write_own(tmp, step, scheduler, loader, cfg, plan))
        faults.at("save.files_written", step)
        state = {"model": model_sd, "optim": optim_sd}
        if not self.async_save:
            try:
                writer = self._writer(tmp)
                written = dcp.save(state, storage_writer=writer, process_group=self._pg)
                sums, error = self._my_sums(tmp, written, writer.digests), None
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported on every rank below
                sums, error = None, (_describe(e), _kind(e))
            self._finalize(tmp, final, step, sums, error)
            log.info("checkpoint saved: %s (%.2f s)", final, time.perf_counter() - t0)
            return
        try:
            writer = self._writer(tmp)
            fut = dcp.async_save(state, storage_writer=writer, process_group=self._pg, async_stager=self._stager)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a staging error: agreed on in wait()
            fut = Future()
            fut.set_exception(e)
        self._pending = (self._pool.submit(self._sums_after, fut, tmp, writer.digests), tmp, final, step,
                         self._started)
        log.info("checkpoint step_%d staged in %.2f s; writing in the background", step, time.perf_counter() - t0)
        faults.at("save.async_in_flight", step)

    def wait(self) -> None:
        """Finish an async save in flight (every rank), then finalize it."""
        if self._pending is None:
            return
        sums_future, tmp, final, step, self._started = self._pending
        self._pending = None
        try:
            sums, error = sums_future.result(), None
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported on every rank in _finalize
            sums, error = None, (_describe(e), _kind(e))
        self._finalize(tmp, final, step, sums, error)
        log.info("checkpoint saved: %s (written in the background)", final)

    def _writer(self, tmp):
        hasher = manifest.HASHERS[manifest.ALGORITHM]
        return self.s3.writer(tmp, hasher, self.world) if self.s3 else HashingFileSystemWriter(str(tmp), hasher)

    def _prepare(self, tmp: Path, step: int | None = None) -> None:  # step: the S3 prefix's (a folder: in tmp)
        if self.s3:
            self.s3.begin(step, sweep=not self._swept)
            self._swept = True
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self._swept:  # interrupted saves and deletions of an earlier attempt, once per run: a later
            layout.remove_leftovers(self.dir)  # step_N.old is this run's, being deleted by the background deleter,
            self._swept = True  # and removing it here would hold up training for the whole deletion
        tmp.mkdir()

    def _write_own(self, tmp: Path, step: int, scheduler, loader, cfg, plan) -> None:
        """This rank's data position and RNG states; on rank 0 also train_state.json."""
        self._own_digests = {}
        own = {"loader": loader.state_dict(), "rng": _rng_state()}
        if self.s3:
            blob = rank_files.rank_state_bytes(own)
            self.s3.put(tmp, rank_files.RANK_FILE.format(self.rank), blob)
        else:
            blob = rank_files.write_rank_state(tmp / rank_files.RANK_FILE.format(self.rank), own)
        self._own_digests[rank_files.RANK_FILE.format(self.rank)] = manifest.digest_bytes(blob)
        if self.rank == 0:
            body = json.dumps({
                "step": step, "world_size": self.world, "scheduler": _jsonable(scheduler.state_dict()),
                "config": {k: v for k, v in asdict(cfg).items() if k != "config"},
                "plan": None if plan is None else plan.to_dict()}, default=str, indent=1)
            if self.s3:
                self.s3.put(tmp, manifest.TRAIN_STATE, body.encode())
                self._own_digests[manifest.TRAIN_STATE] = manifest.digest_bytes(body.encode())
                return
            with open(tmp / manifest.TRAIN_STATE, "wb") as f:
                f.write(body.encode())
                f.flush()
                os.fsync(f.fileno())
            self._own_digests[manifest.TRAIN_STATE] = manifest.digest_bytes(body.encode())

    def _sums_after(self, fut, tmp: Path, digests: dict) -> dict:
        """Background thread of an async save: wait for DCP's write, then checksum this rank's files."""
        result = fut.result()
        if hasattr(result, "upload_completion"):  # AsyncSaveResponse in newer torch
            result.upload_completion.result()
        return self._my_sums(tmp, result, digests)

    def _my_sums(self, tmp: Path, written, digests: dict[str, tuple]) -> dict:
        """Size and checksum of the files this rank wrote (read back from the page cache). The shard names
        come from what DCP reports it wrote (its Metadata, on every rank), not from a directory listing,
        which a network file system may show incomplete for a while."""
        from torch.distributed.checkpoint.metadata import Metadata

        # Another torch's return value, or torch 2.11's Metadata without storage_data (its FileSystemWriter.finish
        # fills a copy): DCP's own record of the save, the .metadata file, names the shards then.
        if not isinstance(written, Metadata) or written.storage_data is None:
            written = self.s3.read_metadata(tmp) if self.s3 else dcp_read.read_dcp_metadata(tmp)
        names = sorted(manifest.owned_files(written, self.rank, self.world)) + [rank_files.RANK_FILE.format(self.rank)]
        if self.rank == 0:
            names += [".metadata", manifest.TRAIN_STATE]
        known = {**digests, **self._own_digests}  # hashed while written: no second pass over the bytes
        out = {n: manifest.entry(*known[n]) for n in names if n in known}
        rest = [n for n in names if n not in known]
        return {**out, **(self.s3.sums(tmp, rest) if self.s3 else manifest.sums(tmp, rest))}

    def _finalize(self, tmp: Path, final: Path, step: int, sums: dict | None, error: tuple | None) -> None:
        """Every rank: agree that all wrote their files. Rank 0: manifest, rename, retention."""
        faults.at("save.shards_written", step)
        gathered = self._gather((sums, error))
        if any(e for _, e in gathered):
            self._fail(step, tmp, [e for _, e in gathered])

        def publish() -> None:
            if self.rank != 0:
                faults.at("save.marker_written", step)
                return
            files = {k: v for s, _ in gathered for k, v in s.items()}
            if self.s3:  # list-and-verify, then the manifest object; no rename exists on S3
                doomed = self.s3.publish(final, step, self.world, files, time.perf_counter() - self._started,
                                         self.keep)
                faults.at("save.marker_written", step)
                for prefix in doomed:
                    faults.at("save.pruning", step)
                    self._deleter.submit(self.s3.retire, prefix)
                return
            manifest.check_against_metadata(tmp, files)  # nothing DCP wrote is missing from the manifest
            dest = self.copy.destination(step) if self.copy else None  # this one is copied to S3 after the rename
            manifest.write_manifest(tmp, step, self.world, files, time.perf_counter() - self._started,
                                    [str(final), str(dest)] if dest else None)
            faults.at("save.marker_written", step)
            old = None
            if final.exists() and not (final / manifest.MARKER).is_file():  # not ours: kept, named
                log.warning("%s has no COMPLETE marker (not a checkpoint of this run); renamed to %s before "
                            "saving step %d there, not deleted", final, layout.set_aside(final, layout.INCOMPLETE).name, step)
            elif final.exists():
                old = layout.retire(final)  # the same step from an earlier attempt
            tmp.rename(final)
            layout.fsync_dir(self.dir)
            faults.at("save.renamed", step)
            if dest:
                self.copy.submit(final, step)
            doomed = [old] if old is not None else []
            copying = self.copy.busy() if self.copy else None
            for s, done in layout.complete_checkpoints(self.dir)[:-self.keep] if self.keep > 0 else []:
                if s == copying:  # the copy's source stays until it is copied; a later save retires it
                    continue
                doomed.append(layout.retire(done))
                faults.at("save.pruning", step)
            for folder in doomed:  # no longer candidates: deleting their files need not hold up training
                self._deleter.submit(shutil.rmtree, folder, ignore_errors=True)

        self._agree(step, publish, tmp)
        self.last_complete = step

    # --- agreement: a failure on one rank stops every rank at the same point ----------------------------
    def _gather(self, obj: Any) -> list:
        if self._pg is None or self.world == 1:
            return [obj]
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self._pg)
        return out

    def _agree(self, step: int, fn, tmp: Path | None = None) -> None:
        """Run ``fn`` on every rank; if it failed anywhere, every rank raises CheckpointWriteError."""
        try:
            fn()
            error = None
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others would hang
            error = (_describe(e), _kind(e))
        errors = self._gather(error)
        if any(errors):
            self._fail(step, tmp or self.dir / f"step_{step}{layout.TMP}", errors)

    def _fail(self, step: int, tmp: Path, errors: list[tuple | None]) -> None:
        """Every rank raises: CheckpointTransientError when a rank's error was the file system's for a moment
        (EIO, ESTALE), else CheckpointWriteError (a full disk, a permission: a rerun would fail the same way)."""
        why, kind = _merge([e[0] if e else None for e in errors]), next((e[1] for e in errors if e and e[1]), None)
        space = "" if self.s3 else _space(self.dir)  # before the partial files are removed
        self._gather(None)  # every rank has looked before rank 0 frees the space
        if self.rank == 0:
            if self.s3:
                self.s3.discard(tmp)
            else:
                shutil.rmtree(tmp, ignore_errors=True)  # never left to look like a save in progress
        if self.s3:
            intact = self.s3.intact()
        else:
            done = layout.complete_checkpoints(self.dir)
            intact = f"the latest complete checkpoint ({done[-1][1].name}) is intact" if done else \
                "there is no earlier complete checkpoint"
        if kind is not None:
            raise CheckpointTransientError(kind, f"checkpoint step_{step} was not saved to {self.dir}: {why}; "
                                                 f"nothing of it was marked complete and {intact}")
        raise CheckpointWriteError(f"checkpoint step_{step} was not saved to {self.dir}: {why}; {space or 'S3'}; nothing of "
                                   f"it was marked complete and {intact}. Free space or point --checkpoint_dir at a "
                                   f"writable file system, then rerun to resume")

    # --- load ----------------------------------------------------------------------------------
    def load(self, path: Path, model, optimizer, scheduler, loader, batch_size: int | None = None,
             source=None) -> int:
        """Restore model, optimizer, scheduler, data position and RNG from ``path``; returns its step.
        (``batch_size`` is not needed any more: a synthetic loader rescales its position itself.)

        Every file is verified against the manifest on the bytes that are loaded (a file changed after the
        start-up check is refused, not loaded), and every failure is agreed on: all ranks raise the same
        AgreedError together (a rank-local error would leave the others in DCP's collectives)."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        got: dict = {}
        s3 = source or (self.s3 if not isinstance(path, Path) else None)  # the S3 target of an s3:// checkpoint

        def first() -> None:
            if s3:
                got.update(s3.first(path, state))
                return
            got["files"] = _manifest_files(path)
            got["meta"] = manifest.read_train_state(path, _entry(got["files"], manifest.TRAIN_STATE))
            got["dcp"] = check_fits(path, state, _entry(got["files"], ".metadata"))

        self._agreed_load(path, first)
        files, meta = got["files"], got["meta"]
        reader = s3.reader(path, files, got["dcp"]) if s3 else \
            dcp_read.SafeFileSystemReader(str(path), files, got["dcp"])
        try:  # reshards to this world size; DCP raises on every rank if a read failed on any
            dcp.load(state, storage_reader=reader,
                     planner=dcp_read.SafeLoadPlanner(), process_group=self._pg)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - one line naming the checkpoint
            kind = _kind(e)  # a read that failed past its retries on any rank: the file system, not the checkpoint
            if kind is not None:
                raise CheckpointTransientError(kind, f"cannot load {path}: {_describe(e)}") from None
            raise AgreedError(f"cannot load {path}: {_describe(e)}") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        same = int(meta["world_size"]) == self.world

        def last() -> None:  # per-rank state, schedule, data position, RNG: any of them may be forged
            extra = s3.rank_state(path, self.rank if same else 0, files) if s3 else \
                read_rank_file(path, self.rank if same else 0, files)
            try:
                _load_scheduler(scheduler, optimizer, meta["scheduler"])
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                raise ConfigError(f"{path / manifest.TRAIN_STATE}: field 'scheduler' cannot be loaded "
                                  f"({type(e).__name__}: {e})") from None
            if same:
                loader.load_state_dict(extra["loader"])
                _set_rng_state(extra["rng"])
            else:
                self._load_other_world(path, meta, loader, extra)

        self._agreed_load(path, last)
        log.info("resumed from %s (step %d, saved by %d ranks, now %d)", path, meta["step"], meta["world_size"],
                 self.world)
        self.last_complete = int(meta["step"])
        return self.last_complete

    def _agreed_load(self, path: Path, fn) -> None:
        """Run a step of a load on every rank; if it failed on any, every rank raises the same AgreedError."""
        try:
            fn()
            error = None
        except (ValueError, OSError) as e:  # ConfigError, UnsafeCheckpointFile, the loader's DataStateError
            error = (str(e).removeprefix(f"cannot resume from {path}: "), _kind(e))
        except Exception as e:  # noqa: BLE001 - a forged value deep in a state: named, agreed, no traceback
            error = (f"{type(e).__name__}: {e}", _kind(e))
        errors = self._gather(error)
        if any(errors):
            why, kind = _merge([e[0] if e else None for e in errors]), next((e[1] for e in errors if e and e[1]),
                                                                            None)
            if kind is not None:
                raise CheckpointTransientError(kind, f"cannot resume from {path}: {why}")
            raise AgreedError(f"cannot resume from {path}: {why}")

    def _load_other_world(self, path: Path, meta: dict, loader, extra: dict) -> None:
        """Different world size: model and optimizer reshard; the data position carries over when it does not depend
        on the rank split (a tokenized corpus: one global position; synthetic data); otherwise the stream restarts,
        said loudly."""
        state = extra["loader"]
        if state.get("kind") == "corpus":  # the same on every rank: the position of every rank together
            loader.load_state_dict(state)
            return
        if state.get("kind") == "synthetic":
            # Synthetic batches are indexed by global sample: the loader rescales its batch counter to this
            # layout. States of the previous version lack the layout; it was all data-parallel then.
            loader.load_state_dict({"dp_world": int(meta["world_size"]),
                                    "batch_size": int(meta["config"]["train_batch_size"]), **state})
            return
        log.warning("checkpoint %s was saved by %d ranks, this run has %d: model and optimizer are resharded, "
                    "but the data stream restarts from its beginning (per-rank reader positions of text tokenized on "
                    "the fly do not map to a new world size; a tokenized corpus, llama_fp8 tokenize, resumes exactly)",
                    path, meta["world_size"], self.world)


def _stager():
    """DCP's default stager, synchronous, in plain host memory (pinned and shared memory need CUDA)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=False, use_non_blocking_copy=False))
