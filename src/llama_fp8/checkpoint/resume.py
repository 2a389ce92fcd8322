"""Start-up checks of the checkpoint side of a run, on every rank, before anything is built:

1. ``--checkpoint_dir`` is writable from every rank (a probe file), or the run stops now, not at its
   first save hours later; rank 0 takes its lock (one job per folder, ``lock.py``).
2. The checkpoint to resume from is sound: every file has its manifest size and checksum and parses (the
   ranks split the files and check in parallel); skipped for the checkpoint this job itself saved, on a restart
   inside the allocation (``TRUSTED_ENV``): the load verifies the bytes it uses. With ``--resume_from_checkpoint auto`` a damaged one
   is renamed ``step_N.broken``, named loudly with its broken files, and the previous complete
   checkpoint is tried; a checkpoint named explicitly is never replaced by another: the run stops.
3. It fits this run: the same model implementation, model shape, optimizer and dataset, or the run
   stops naming the flag. Other changes are allowed and logged (see docs/reliability.md for why each
   is correct: precision, world size, batch size, LR schedule, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import torch.distributed as dist

from llama_fp8 import parallel
from llama_fp8.checkpoint import layout, lock, places
from llama_fp8.checkpoint.layout import probe_writable  # noqa: F401 - re-exported
from llama_fp8.checkpoint.safe_io import UnsafeCheckpointFile
from llama_fp8.errors import AgreedError, ConfigError
from llama_fp8.faults.transient import AgreedTransient, TransientError

log = logging.getLogger("llama_fp8.checkpoint")

SHAPE_FLAGS = ("vocab_size", "hidden_width", "num_layers", "num_heads", "num_key_value_heads", "intermediate_size",
               "tie_word_embeddings")
"""Flags that change which parameters exist or their shapes: a checkpoint of another shape cannot load."""
MUST_MATCH = (*SHAPE_FLAGS, "optimizer", "dataset", "data_blend")
"""... plus the optimizer (its state has another structure) and the data source (the saved position
is a position in that data; to train the saved weights on other data, export them with ``llama-fp8
convert`` and start a new run with --init_from_hf)."""
_BOOKKEEPING = {"run_dir", "checkpoint_dir", "resume_from_checkpoint", "config"}
TRUSTED_ENV = "LLAMA_FP8_SAVED_CHECKPOINT"
"""Set by ``llama-fp8 launch`` for a restart inside the allocation: the step of the latest checkpoint this job's
workers saved and reported complete. Resuming from it skips the start-up check (the load verifies every byte it
uses against the manifest: one read of the checkpoint, not two); a load that fails makes the next attempt check
in full and fall back."""


def check_resume(cfg, env, plan):
    """The plan with the checkpoint to resume from checked (or replaced by the previous sound one)."""
    for root in places.roots(cfg, plan.checkpoint_dir):  # the checkpoint dir, and the copy's S3 prefix
        parallel.on_every_rank(env, lambda root=root: places.probe_writable(cfg, root, env.rank))
    ckpt_dir = places.location(plan.checkpoint_dir)
    # one job per checkpoint folder, taken before anything in it is renamed or deleted (lock.py); on S3 there is no
    # atomic create-if-absent through the connector: one job per prefix is the user's to keep (docs/checkpoints.md)
    if isinstance(ckpt_dir, Path):
        parallel.on_every_rank(env, lambda: lock.acquire(ckpt_dir) if env.is_main else None)
    if env.is_main:
        for stray in places.strays(cfg, ckpt_dir):
            log.warning("%s has no COMPLETE marker: not a checkpoint this run can resume from (copied by hand or "
                        "left by another tool?); kept as it is, and moved to %s%s if this run saves that step",
                        stray, stray.rstrip("/").rsplit("/", 1)[-1], layout.INCOMPLETE)
    if plan.resume_from is None:
        return plan
    explicit = cfg.resume_from_checkpoint != "auto"
    candidates, trusted = _candidates(env, cfg, places.location(plan.resume_from), ckpt_dir, explicit)
    if trusted:  # this job saved it minutes ago: the load verifies every byte it uses, one read instead of two
        chosen = candidates[0]
        if env.is_main:
            log.info("resuming from %s, which this job saved (%s): not checked twice; the load verifies the bytes "
                     "it uses", chosen, TRUSTED_ENV)
    else:
        chosen = _first_sound(candidates, env, explicit, ckpt_dir, cfg)
    parallel.on_every_rank(env, lambda: check_compatible(chosen, cfg, plan, env.is_main))
    return dataclasses.replace(plan, resume_from=str(chosen), resume_checked=not trusted)


def trusted_step(env_value: str | None) -> int | None:
    """The step of the checkpoint the launcher says this job saved (``TRUSTED_ENV``), or None."""
    return int(env_value) if env_value and env_value.isdigit() else None


def _candidates(env, cfg, first, ckpt_dir, explicit: bool) -> tuple[list, bool]:
    """The decided checkpoint, then (auto) every older complete one; rank 0's listing, so that every rank
    tries the same list even if the file system shows them different views for a moment. And whether the first is
    the one the launcher says this job saved (rank 0's answer, so that every rank checks or none does)."""
    listed = [first] if explicit else [p for s, p in places.candidates(cfg, ckpt_dir) if s <= layout.step_of(first)]
    trusted = bool(listed) and not explicit and layout.step_of(listed[0]) == trusted_step(os.environ.get(TRUSTED_ENV))
    out: list = [(listed, trusted)]
    if env.world_size > 1:
        dist.broadcast_object_list(out, src=0)
    return out[0]


def _first_sound(candidates: list, env, explicit: bool, ckpt_dir, cfg=None):
    damaged = []
    for path in candidates:
        transient = None
        try:
            mine = places.verify(cfg, path, env.rank, env.world_size)
        except TransientError as e:  # the file system failing, not the checkpoint: never set aside for it
            mine, transient = [], f"rank {env.rank}: {e}"
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather below
            mine = [f"{path}: check failed: {type(e).__name__}: {e}"]
        gathered: list = [None] * env.world_size
        if env.world_size > 1:
            dist.all_gather_object(gathered, (mine, transient))
        else:
            gathered = [(mine, transient)]
        failing = [t for _, t in gathered if t]
        if failing:
            raise AgreedTransient("io", f"checking {path}: {'; '.join(failing)}; nothing was set aside")
        problems = [p for part, _ in gathered for p in part]
        if not problems:
            if damaged and env.is_main:
                log.warning("RESUMING FROM %s: %d newer checkpoint(s) were damaged and set aside (see above)",
                            path, len(damaged))
            return path
        if explicit:
            raise AgreedError(f"--resume_from_checkpoint {path}: the checkpoint is damaged: {'; '.join(problems)}. "
                              f"Nothing was changed; resume from another one, or use auto (the latest sound one)")
        damaged.append(path)
        _set_aside(path, problems, env.is_main, cfg)
    raise AgreedError(f"no sound checkpoint to resume from in {ckpt_dir}: every complete one is damaged "
                      f"({', '.join(p.name for p in damaged)}; renamed *.broken, see the warnings). Start over in a "
                      f"new --run_dir, or repair them (nothing was deleted)")


def _set_aside(path, problems: list[str], is_main: bool, cfg=None) -> None:
    if not is_main:
        return
    try:
        where = places.set_aside(cfg, path)
    except (OSError, ValueError, RuntimeError) as e:
        where = f"could not be set aside ({getattr(e, 'strerror', None) or e})"
    log.warning("CHECKPOINT %s IS DAMAGED, not resuming from it (%s): %s. Trying the previous complete "
                "checkpoint", path, where, "; ".join(problems))


def check_compatible(path: Path, cfg, plan, is_main: bool = True) -> None:
    """ConfigError naming every flag that makes ``path`` unusable for this run; logs what else changed."""
    try:
        saved = places.read_train_state(cfg, path)
    except UnsafeCheckpointFile as e:
        raise ConfigError(f"cannot resume from {path}: {e}") from None
    asked, ran = saved.get("config") or {}, saved.get("plan") or {}
    bad = []
    impl = ran.get("model_impl") or asked.get("model_impl")
    if impl and impl != "auto" and impl != plan.model_impl:
        bad.append(f"saved with model implementation {impl!r}, this run resolves --model_impl to {plan.model_impl!r}")
    bad += [f"saved with --{k}={asked[k]!r}, this run has --{k}={getattr(cfg, k)!r}" for k in MUST_MATCH
            if k in asked and asked[k] != getattr(cfg, k)]
    if bad:
        raise ConfigError(f"cannot resume from {path}: it does not fit this run: {'; '.join(bad)}. Resume with the "
                          f"saved settings, or start a new --run_dir (nothing was changed)")
    if not is_main:
        return
    changed = {k: (asked[k], v) for k, v in dataclasses.asdict(cfg).items()
               if k in asked and asked[k] != v and k not in _BOOKKEEPING}
    if changed:
        log.info("resuming from %s with changed settings: %s", path,
                 ", ".join(f"--{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
    precision = ran.get("precision")
    before = precision.get("name") if isinstance(precision, dict) else None
    if before and before != plan.precision.name:
        log.warning("resuming a %s checkpoint as %s: master weights and optimizer states are FP32 in both and load "
                    "as saved; from step %s on the run is %s", before, plan.precision.name, saved["step"],
                    plan.precision.name)
    if int(saved["world_size"]) != plan.world_size:
        log.info("checkpoint %s was saved by %d ranks, this run has %d: model and optimizer are resharded",
                 path, saved["world_size"], plan.world_size)
