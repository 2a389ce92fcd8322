"""Reading a checkpoint's per-rank state, schedule and RNG back, and checking that it fits the model: the
pieces ``Checkpointer.load`` puts together (every file verified against the manifest on the bytes used)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llama_fp8.checkpoint import dcp_read, manifest
from llama_fp8.checkpoint import files as rank_files
from llama_fp8.errors import ConfigError


def _manifest_files(path: Path) -> dict | None:
    """The manifest's files (None for a version-1 checkpoint without one)."""
    man = manifest.read_manifest(path)
    return None if man is None else man["files"]


def _entry(files: dict | None, name: str) -> dict | None:
    """The manifest entry of ``name`` (None without a manifest); a file the manifest lacks is refused."""
    if files is None:
        return None
    if name not in files:
        raise rank_files.UnsafeCheckpointFile(Path(name), "is not in the checkpoint's manifest; refused")
    return files[name]


def read_rank_file(path: Path, rank: int, files: dict | None = None) -> dict:
    """Rank ``rank``'s saved state: ``rank{r}.safetensors``, or ``rank{r}.pt`` in older checkpoints;
    verified against the manifest's ``files`` on the bytes parsed, when given."""
    new, old = path / rank_files.RANK_FILE.format(rank), path / rank_files.LEGACY_RANK_FILE.format(rank)
    try:
        if new.exists() or not old.exists():
            return rank_files.read_rank_state(new, _entry(files, new.name))
        return rank_files.read_legacy_rank_state(old)
    except rank_files.UnsafeCheckpointFile as e:
        raise ConfigError(f"cannot resume from {path}: {e}") from None


def check_fits(path: Path, state: dict, want: dict | None = None):
    """Every tensor this model and optimizer need is in the checkpoint with the same global shape;
    otherwise a ConfigError naming them (instead of DCP's error from deep inside its planner). Returns DCP's
    metadata as read and checked here (the load uses this one read, not a second)."""

    try:
        meta = dcp_read.read_dcp_metadata(path, want)
    except rank_files.UnsafeCheckpointFile as e:
        raise ConfigError(f"cannot resume from {path}: {e}") from None
    return fits(path, state, meta)


def fits(path, state: dict, meta):
    """``check_fits`` on DCP's metadata already read (``meta``); returns it."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:  # DCP's own flattening (private), so that the keys are exactly the ones it looks up
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    except ImportError:  # another torch: DCP's own error stands in for this check
        return meta
    saved = meta.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    missing = [k for k in flat if k not in saved]
    wrong = [f"{k} saved {tuple(saved[k].size)}, this run {tuple(v.shape)}" for k, v in flat.items()
             if isinstance(v, torch.Tensor) and isinstance(saved.get(k), TensorStorageMetadata)
             and tuple(saved[k].size) != tuple(v.shape)]
    if missing or wrong:
        listed = wrong[:4] + [f"{k} not in the checkpoint" for k in missing[:4]]
        more = len(missing) + len(wrong) - len(listed)
        raise ConfigError(f"cannot resume from {path}: it does not fit this model and optimizer: "
                          f"{'; '.join(listed)}{f' (and {more} more)' if more else ''}. Resume with the settings "
                          f"it was saved with (its train_state.json), or start a new --run_dir")
    return meta


def _load_scheduler(scheduler, optimizer, saved: dict) -> None:
    """The saved schedule position, with this run's LR settings: ``base_lrs`` (the peak LR) and each
    group's current LR come from this run's --lr and schedule, so a changed --lr/--lr_decay_iters
    takes effect at the resumed step; unchanged ones give exactly the saved values."""
    fresh = list(scheduler.base_lrs)
    scheduler.load_state_dict(saved)
    scheduler.base_lrs = fresh
    lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(fresh, scheduler.lr_lambdas)]
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _jsonable(obj: Any) -> Any:
    """Scheduler state as JSON: tensors (torchao.optim keeps LRs as tensors) become numbers."""
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
