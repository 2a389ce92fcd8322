"""What would make a run fit: the next activation-checkpointing level, half the micro-batch (with twice the
accumulation: the same global batch), twice the nodes, twice the tensor parallelism. Each change is estimated
the same way as the run itself (one more estimate each), never guessed; a change the run's flags cannot take
(a layout that does not divide, an implementation without it) is skipped with its reason. The changes are those
the job's implementation takes (through a stand-in: the TE model's, not the stand-in's)."""

from __future__ import annotations

import dataclasses

from llama_fp8.errors import ConfigError
from llama_fp8.estimate import assess, run

AC_ORDER = ("none", "selective", "full")  # from the least recomputation to the most


def candidates(e: assess.Estimate) -> list[tuple[str, object, object]]:
    """(the change as flags, the config, the options) of each suggestion that applies to ``e``'s run."""
    cfg, opts, job = e.cfg, e.opts, e.measurement.decision.job_impl
    out = []
    modes = [m for m in AC_ORDER if m == "none" or m in job.activation_checkpointing_modes]
    if cfg.activation_checkpointing in modes and modes.index(cfg.activation_checkpointing) + 1 < len(modes):
        nxt = modes[modes.index(cfg.activation_checkpointing) + 1]
        out.append((f"--activation_checkpointing {nxt}", dataclasses.replace(cfg, activation_checkpointing=nxt), opts))
    if cfg.train_batch_size > 1:
        b = cfg.train_batch_size // 2 if cfg.train_batch_size % 2 == 0 else 1
        accum = cfg.grad_accum_steps * (cfg.train_batch_size // b)
        out.append((f"--train_batch_size {b} --grad_accum_steps {accum} (the same global batch)",
                    dataclasses.replace(cfg, train_batch_size=b, grad_accum_steps=accum), opts))
    if cfg.sharding_strategy == "full" and cfg.dp_shard_size == -1:
        out.append((f"--nodes {opts.nodes * 2} (FSDP shards over twice the GPUs; the global batch doubles)", cfg,
                    dataclasses.replace(opts, nodes=opts.nodes * 2)))
    if job.tensor_parallel and cfg.tp_size * 2 <= opts.gpus_per_node:
        out.append((f"--tp_size {cfg.tp_size * 2} (within a node; half the data-parallel ranks: the global batch "
                    f"halves)", dataclasses.replace(cfg, tp_size=cfg.tp_size * 2), opts))
    return out


def suggest(e: assess.Estimate, progress: run.Progress = lambda _: None) -> list[dict]:
    """Each candidate's own estimate: its change, status, needed bytes and verdict line."""
    found = []
    for change, cfg, opts in candidates(e):
        progress(f"suggestion: {change}")
        try:
            other = assess.estimate(cfg, dataclasses.replace(opts, suggest=False), progress)
        except ConfigError as err:
            found.append({"change": change, "status": "not possible", "needed": None, "verdict": f"not possible: {err}"})
            continue
        found.append({"change": change, "status": other.verdict.status, "needed": other.verdict.needed,
                      "verdict": other.verdict.text})
    return found
