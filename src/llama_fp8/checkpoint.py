"""Sharded, atomic DCP checkpoints and their discovery for resume.

Layout of ``--checkpoint_dir``::

    step_200/            a complete checkpoint (only complete ones carry this name)
      .metadata, __0_0.distcp, ...   model + optimizer, written by every rank (torch.distributed.checkpoint)
      rank0.pt, rank1.pt, ...        per-rank state: data-loader position, RNG states
      train_state.json               step, scheduler, world size, config asked and plan resolved (rank 0)
      COMPLETE                       written last, after every rank finished
    step_300.tmp/        a save in progress or interrupted: never loaded, removed by the next save

A save writes under ``step_N.tmp``; once every rank has written (a barrier, or the async save's
futures), rank 0 writes ``COMPLETE`` and renames the folder to ``step_N``: a rename within one file
system is atomic, so a crash at any moment leaves the previous complete checkpoint untouched.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_STEP_RE = re.compile(r"^step_(\d+)$")


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
    else the given folder, which must be a complete checkpoint."""
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


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpointer:
    """Saves every --checkpoint_freq steps (and at the end), keeps the last --keep_last_k, resumes."""

    def __init__(self, ckpt_dir: Path, keep_last_k: int, async_save: bool, rank: int, world: int):
        self.dir, self.keep, self.async_save, self.rank, self.world = ckpt_dir, keep_last_k, async_save, rank, world
        self._pending: tuple[Any, Path, Path] | None = None  # (future, tmp dir, final dir)

    # --- save ----------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, scheduler, loader, cfg, plan=None) -> None:
        """Write checkpoint ``step``; with async_save, returns once the state is staged."""
        self.wait()  # at most one save in flight: the previous one is finalized first
        final, tmp = self.dir / f"step_{step}", self.dir / f"step_{step}.tmp"
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob("step_*.tmp"):  # interrupted saves of an earlier run
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        torch.save({"loader": loader.state_dict(), "rng": _rng_state()}, tmp / f"rank{self.rank}.pt")
        if self.rank == 0:
            (tmp / "train_state.json").write_text(json.dumps({
                "step": step, "world_size": self.world, "scheduler": _jsonable(scheduler.state_dict()),
                "config": {k: v for k, v in asdict(cfg).items() if k != "config"},
                "plan": None if plan is None else plan.to_dict()}, default=str, indent=1))
        state = {"model": model_sd, "optim": optim_sd}
        if self.async_save:
            self._pending = (dcp.async_save(state, checkpoint_id=str(tmp)), tmp, final)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._finalize(tmp, final)

    def wait(self) -> None:
        """Finish an async save in flight (every rank), then finalize it."""
        if self._pending is None:
            return
        fut, tmp, final = self._pending
        self._pending = None
        result = fut.result()
        if hasattr(result, "upload_completion"):  # AsyncSaveResponse in newer torch
            result.upload_completion.result()
        self._finalize(tmp, final)

    def _finalize(self, tmp: Path, final: Path) -> None:
        _barrier()  # every rank has written its files
        if self.rank == 0:
            (tmp / MARKER).write_text("ok\n")
            if final.exists():  # a complete checkpoint of the same step from an earlier attempt
                shutil.rmtree(final)
            tmp.rename(final)
            log.info("checkpoint saved: %s", final)
            for _, old in complete_checkpoints(self.dir)[:-self.keep] if self.keep > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()

    # --- load ----------------------------------------------------------------------------------
    def load(self, path: Path, model, optimizer, scheduler, loader, batch_size: int) -> int:
        """Restore model, optimizer, scheduler, data position and RNG from ``path``; returns its step."""
        meta = json.loads((path / "train_state.json").read_text())
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(path))  # reshards to this world size
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        scheduler.load_state_dict(meta["scheduler"])
        mine = path / f"rank{self.rank}.pt"
        if meta["world_size"] == self.world and mine.is_file():
            extra = torch.load(mine, weights_only=False)
            loader.load_state_dict(extra["loader"])
            _set_rng_state(extra["rng"])
        else:
            self._load_other_world(path, meta, loader, batch_size)
        log.info("resumed from %s (step %d, saved by %d ranks, now %d)", path, meta["step"], meta["world_size"],
                 self.world)
        return int(meta["step"])

    def _load_other_world(self, path: Path, meta: dict, loader, batch_size: int) -> None:
        """Different world size: model and optimizer reshard; the data position carries over only when it
        does not depend on the rank split (synthetic data); otherwise the stream restarts, said loudly."""
        state = torch.load(path / "rank0.pt", weights_only=False)["loader"]
        if state.get("kind") == "synthetic":
            # Synthetic batches are indexed by global sample: rescale the batch counter to this world.
            consumed = int(state["step"]) * meta["world_size"] * int(meta["config"]["train_batch_size"])
            state = {**state, "step": consumed // (self.world * batch_size)}
            loader.load_state_dict(state)
            return
        log.warning("checkpoint %s was saved by %d ranks, this run has %d: model and optimizer are resharded, "
                    "but the data stream restarts from its beginning (per-rank reader positions do not map "
                    "to a new world size)", path, meta["world_size"], self.world)


def _jsonable(obj: Any) -> Any:
    """Scheduler state as JSON: tensors (torchao.optim keeps LRs as tensors) become numbers."""
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
