"""The torch internals ``llama-fp8 launch`` relies on for its decisions, checked before any worker starts: without
them the launcher stops (exit 2) naming the torch version, instead of running with torch's plain restarts."""

from __future__ import annotations

import torch

from llama_fp8.cluster.launch.outcome import JobStop
from llama_fp8.errors import EXIT_BAD_CONFIG


def internals(what: str) -> JobStop:
    """The stop for a torch without an internal this launcher relies on (exit 2: no restart, no requeue)."""
    return JobStop(EXIT_BAD_CONFIG, "fail", f"torch {torch.__version__} has no {what}, which llama-fp8 launch "
                   "relies on for its restart decisions (written against torch 2.13); not starting the workers. "
                   "Use a torch this version of llama-fp8 supports, or plain torchrun (no job-wide restart budget)")


def check_torch() -> None:
    """torch's ``launch_agent`` must build its agent by the name ``LocalElasticAgent`` of its own module, which
    ``launch.py`` binds to ``JobAgent``; otherwise the job would run with torch's plain restarts."""
    from torch.distributed.launcher import api

    fn = getattr(api, "launch_agent", None)
    code = getattr(fn, "__code__", None)
    if not (hasattr(api, "LocalElasticAgent") and code is not None and "LocalElasticAgent" in code.co_names
            and getattr(fn, "__globals__", None) is vars(api)):
        raise internals("launch_agent that builds torch.distributed.launcher.api.LocalElasticAgent by that name")


def rendezvous_round(handler) -> int | None:
    """The round of the c10d/etcd dynamic rendezvous (0 for the first attempt, +1 per restart of the job), or None
    when it cannot be read. torch keeps it in the handler's state holder (no public accessor)."""
    value = getattr(getattr(getattr(handler, "_state_holder", None), "state", None), "round", None)
    return value if isinstance(value, int) else None
