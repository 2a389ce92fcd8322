"""Sharded, atomic, checksummed DCP checkpoints; finding, checking and loading them for resume.

Layout of ``--checkpoint_dir``::

    step_200/            a complete checkpoint (only complete ones carry this name)
      .metadata, __0_0.distcp, ...   model + optimizer, written by every rank (torch.distributed.checkpoint)
      rank0.safetensors, ...         per-rank state: data-loader position, RNG states (JSON + tensors)
      train_state.json               step, scheduler, world size, config asked and plan resolved (rank 0)
      COMPLETE                       the manifest: every file's size and checksum; written last
    step_300.tmp/        a save in progress or interrupted: never loaded, removed by the next save
    step_100.old/        a checkpoint being deleted (--keep_last_k, in the background): never loaded; one
                         left by an earlier run is removed by this run's first save
    step_250.broken/     failed its check at start-up: set aside, kept for inspection
    step_400.incomplete/ a step_400 folder without COMPLETE (not ours) that a save of step 400 moved aside
    LOCK                 the job that uses this folder (job id, host, pid): one job at a time (lock.py)

A save writes under ``step_N.tmp``: each rank its per-rank file (rank 0 also train_state.json), then
DCP writes the shards; each rank checksums the files DCP reports it wrote; once every rank has (an all-gather that
also carries any rank's error), rank 0 writes ``COMPLETE`` and renames the folder to ``step_N``. A
rename within one file system is atomic, so a crash at any moment leaves the previous complete
checkpoint untouched; a failed write (a full disk) fails the save on every rank, removes the
``.tmp`` folder and stops the run with one message naming the path.

Resuming (``resume.check_resume``, every rank, before the model is built) checks the chosen
checkpoint's files against the manifest and falls back to the previous sound one (``auto``), and
refuses one that does not fit the run. Nothing read from a checkpoint can execute code or change the
process (``files.py``, ``dcp_read.py``); names stay inside the folder, only regular files of capped size are read, and the
load verifies the bytes it uses against the manifest (``safe_io.py``).
Checkpoints of the previous version (``rank{r}.pt``, ``COMPLETE`` = ``ok``) still load: see files.py.
"""

import torch.distributed.checkpoint as dcp  # noqa: F401 - tests patch dcp.async_save through this module

from llama_fp8.checkpoint import lock, places, safe_io
from llama_fp8.checkpoint.checkpointer import Checkpointer, CheckpointWriteError, check_fits, read_rank_file
from llama_fp8.checkpoint.files import UnsafeCheckpointFile
from llama_fp8.checkpoint.layout import complete_checkpoints, find_resume
from llama_fp8.checkpoint.manifest import MARKER, recorded_save_s, verify
from llama_fp8.checkpoint.resume import check_compatible, check_resume, probe_writable

__all__ = ["MARKER", "lock", "places", "safe_io", "CheckpointWriteError", "Checkpointer", "UnsafeCheckpointFile", "check_compatible", "check_fits",
           "check_resume", "complete_checkpoints", "find_resume", "probe_writable", "read_rank_file", "recorded_save_s",
           "verify"]
