"""Preflight's checks of what the newest AWS nodes add: the multi-node NVLink domain of GB200 / GB300 NVL72 trays
(``fabric.py``; the job-level comparison after the all-reduce is ``nvlink.py``) and FSx for Lustre under the run's
folders (``lustre.py``). Each returns a ``Check`` like the node checks."""

from __future__ import annotations

from dataclasses import asdict

from llama_fp8.cluster.nodes import fabric
from llama_fp8.cluster.nodes.node_checks import OK, WARN, Check, Settings


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def check_nvlink(_: Settings) -> Check:
    """This node's NVLink domain: every GPU registered in one domain, the IMEX channel device and daemon, and the
    NCCL settings that would keep NCCL off it; its findings go to the job step's comparison (``Check.data``)."""
    status, message, node = fabric.check()
    if node is None and status == OK and _has_gpu():
        status = WARN  # GPUs but no nvidia-smi: the domain cannot be read, so it cannot be vouched for
    return Check("nvlink_domain", status, message, asdict(node) if node is not None else None)
