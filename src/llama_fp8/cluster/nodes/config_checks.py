"""Preflight's config checks: the decisions the train flags lead to, made by the same functions the run's
plan uses (``models.resolve``, ``precision.resolve``, ``ParallelDims`` and ``check_shapes``), reported as a
``Check`` with their ConfigError's words; preflight never decides these itself."""

from __future__ import annotations

import os

from llama_fp8.cluster.nodes.node_checks import FAIL, OK, Check, Settings


def torch_device(asked: str):
    """``--device`` as training will run it (``parallel.dist.device_type`` decides)."""
    import torch

    from llama_fp8.parallel.dist import device_type

    return torch.device(device_type(asked))





def check_model_impl(s: Settings) -> Check:
    """The implementation --model_impl asks for can run here (auto: which one it will pick)."""
    from llama_fp8 import models

    device = torch_device(s.cfg.device)
    try:
        impl = models.resolve(s.cfg.model_impl, device)
    except ValueError as e:
        return Check("model_impl", FAIL, str(e))
    reason = impl.unavailable(device)
    if reason:
        return Check("model_impl", FAIL, f"--model_impl {impl.name}: {reason[:200]}")
    return Check("model_impl", OK, f"{s.cfg.model_impl} -> {impl.name} ({impl.description}) on {device.type}")


def check_fp8_features(s: Settings) -> Check:
    """The FP8 choice of the train flags, made by the one resolver (``precision.resolve``, without the hardware
    check: check_gpus reports what this node's GPUs run): the backend and recipe exist in the installed
    library (the recipe table's minimum versions); nothing to check without --fp8 1."""
    from llama_fp8 import models, precision

    cfg = s.cfg
    if not s.train_given or not cfg.fp8:
        return Check("fp8_features", OK, "no FP8 asked for")
    try:
        impl = models.resolve(cfg.model_impl, torch_device(s.cfg.device))
        choice = precision.resolve(cfg, impl, None, others=models.implementations())
    except ValueError as e:  # ConfigError: the resolver's own words
        return Check("fp8_features", FAIL, str(e))
    backend = next(b for b in impl.fp8_backends() if b.name == choice.backend)
    return Check("fp8_features", OK, f"{backend.name} {choice.recipe}{' + FP8 all-gather' if cfg.fp8_all_gather else ''}"
                 f" with {backend.library} {backend.library_version()}")


TRAIN_TASKS_ENV = "LLAMA_FP8_TRAIN_TASKS"
"""The training world's size when it is smaller than the preflight step's (spare nodes: job_nodes.sh)."""


def check_layout(s: Settings) -> Check:
    """The mesh the train flags ask for (--dp_*, --tp_size, --cp_size) fits the allocation's tasks and the model."""
    from llama_fp8 import parallel

    cfg = s.cfg
    rank, _, tasks = task_position()
    # A job with spare nodes checks every node but trains on N of them: the layout is the training world's.
    tasks = int(os.environ.get(TRAIN_TASKS_ENV) or 0) or tasks
    if not s.train_given:
        return Check("layout", OK, f"{tasks} task(s), no train flags to check")
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
                or tasks)
    env = parallel.DistEnv(rank, 0, tasks, local, None)
    try:
        dims = parallel.ParallelDims.from_config(cfg, env)
        parallel.check_shapes(cfg, dims)
    except ValueError as e:
        return Check("layout", FAIL, f"{e} (this allocation: {tasks} task(s), {local} per node)")
    mesh = " x ".join(f"{n} {v}" for n, v in dims.shape)
    return Check("layout", OK, f"{mesh} = {tasks} rank(s); {dims.dp_size} data-parallel")


def task_position(env: dict[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, local rank, tasks) of this process: torchrun's variables, else a Slurm step's, else (0, 0, 1)."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"])
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env.get("SLURM_NTASKS", 1))
    return 0, 0, 1
