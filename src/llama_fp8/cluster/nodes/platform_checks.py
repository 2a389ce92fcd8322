"""Preflight's checks of what the newest AWS nodes add: the multi-node NVLink domain of GB200 / GB300 NVL72 trays
(``fabric.py``; the job-level comparison after the all-reduce is ``nvlink.py``) and FSx for Lustre under the run's
folders (``lustre.py``). Each returns a ``Check`` like the node checks."""

from __future__ import annotations

from dataclasses import asdict

from llama_fp8.cluster.nodes import fabric, lustre
from llama_fp8.cluster.nodes.config_checks import task_position
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


def check_lustre(s: Settings) -> Check:
    """The run's checkpoint and data folders on FSx for Lustre: each one's mount and options, the checkpoint folder's
    stripe count against one rank's shard (the ``lfs setstripe`` that fixes a count of 1), and the test write that
    proves LNet moves the bytes over EFA (``lustre.py``). Nothing to check off Lustre."""
    from llama_fp8.data.files import is_local

    folders = {"checkpoint_dir": s.checkpoint_dir}
    if s.cfg is not None and s.cfg.dataset and s.cfg.dataset != "synthetic" and is_local(s.cfg.dataset):
        folders["dataset"] = s.cfg.dataset
    on = {name: (lustre.existing(path), m) for name, path in folders.items()
          if (m := lustre.lustre_mount(str(lustre.existing(path)))) is not None}
    if not on:
        return Check("lustre", OK, f"{' and '.join(folders)} not on Lustre (nothing to check)")
    mounts = [f"{name} on Lustre {m.source} at {m.target} ({m.options})" for name, (_, m) in on.items()]
    findings, data = [], None
    if "checkpoint_dir" in on:
        folder = on["checkpoint_dir"][0]
        shard = lustre.shard_bytes(s.cfg, task_position()[2]) if s.train_given else None
        data = {"folder": str(folder), "shard_bytes": shard}  # for the host's tools (lustre.main, job_lib.sh)
        findings += [_or_on_host(lustre.stripe_finding(folder, shard)), _or_on_host(lustre.lnet_finding(folder))]
    else:
        findings.append((OK, "LNet over EFA not proven: only the data is on Lustre, and preflight writes nowhere but "
                             "the checkpoint folder"))
    status = fabric.worst(st for st, _ in findings)
    shown = [m for st, m in findings if st != OK] if status != OK else [m for _, m in findings]
    return Check("lustre", status, "; ".join(mounts + shown), data)


def _or_on_host(finding: tuple[str, str]) -> tuple[str, str]:
    """A finding the tools were missing for, when the batch script checks it with the host's tools after this step
    (LLAMA_FP8_LUSTRE_ON_HOST=1: the image has no Lustre client tools, the host has them)."""
    import os

    if finding[0] == WARN and "not found on PATH" in finding[1] and os.environ.get(lustre.ON_HOST_ENV) == "1":
        what = "stripe count" if "stripe" in finding[1] else "LNet over EFA"
        return OK, f"{what}: checked with the host's Lustre tools after this step (no Lustre tools in the image)"
    return finding
