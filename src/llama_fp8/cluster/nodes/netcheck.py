"""The preflight's network test: a short all-reduce over every task of the job step, its bus bandwidth, and
the network NCCL chose for it (from NCCL's own INFO lines, captured per process).

1.train_llama.sbatch runs preflight as one task per GPU on every node (one per core slot on CPU), with
MASTER_ADDR/MASTER_PORT of the first node; ranks come from Slurm's environment (parallel/dist.py). On CPU the
backend is gloo and there is no NCCL log: the test then proves the nodes reach each other and reports gloo.

Bus bandwidth follows nccl-tests (src/all_reduce.cu, doc/PERFORMANCE.md): ``algbw = bytes / time`` and, for
all-reduce, ``busbw = algbw * 2 * (n - 1) / n`` with n ranks, in GB/s (1e9 bytes). busbw is comparable to the
link speed whatever the rank count; algbw is not.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llama_fp8.cluster.nodes import fabric, nccl, nvlink


@dataclass
class NetResult:
    """What rank 0 reports (every field JSON-serialisable: it goes to preflight's --report file)."""

    status: str
    message: str
    backend: str = ""
    ranks: int = 0
    nodes: int = 0
    hosts: tuple[str, ...] = ()
    bytes: int = 0
    iters: int = 0
    time_s: float | None = None
    algbw_gbps: float | None = None
    busbw_gbps: float | None = None
    network: str | None = None
    network_kind: str | None = None
    provider: str | None = None
    nccl_version: str | None = None
    values_ok: bool = True
    """Every rank got the exact sum (a transport that corrupts data fails here, not in training)."""
    failed_nodes: dict[str, list[str]] = field(default_factory=dict)
    """host -> the node checks that failed there (every rank learns them, so all exit with the same code)."""
    nvlink: dict[str, Any] | None = None
    """The job's NVLink domain (``nvlink.NvlinkResult``), where its nodes have one or its ranks disagree."""

    @property
    def failed(self) -> bool:
        """The job step fails: the network, a node, or the NVLink domain."""
        return self.status == "FAIL" or bool(self.failed_nodes) or (self.nvlink or {}).get("status") == "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bus_bandwidth(nbytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of one all-reduce of ``nbytes`` that took ``seconds`` on ``ranks`` ranks."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * (2 * (ranks - 1) / ranks if ranks > 1 else 1.0)


def node_name() -> str:
    """Slurm's name of this node (several slurmd can share one host), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def slurm_task_env(env: dict[str, str], gpus: int) -> dict[str, str]:
    """RANK/WORLD_SIZE/LOCAL_RANK for a Slurm task, its GPU index wrapped to the GPUs it sees: a task bound to
    one GPU (srun --gpus-per-task, CUDA_VISIBLE_DEVICES per task) sees only cuda:0 whatever its SLURM_LOCALID.
    Nothing when torchrun's variables are already set or this is not a Slurm step."""
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env or gpus < 1:
        return {}
    return {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env.get("SLURM_NTASKS", "1"),
            "LOCAL_RANK": str(int(env.get("SLURM_LOCALID", "0")) % gpus),
            "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0].split(",")[0]}


def capture_nccl_log(directory: str) -> Path:
    """Send this process's NCCL INFO lines (init and network only) to a file of its own and return its path.

    Must run before the first NCCL call: NCCL reads NCCL_DEBUG* once, at its first initialization."""
    path = Path(directory) / f"nccl.{socket.gethostname()}.{os.getpid()}.log"
    os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=str(path))
    return path


def _timed_all_reduce(x, iters: int, device) -> float:
    """Mean seconds of one in-place SUM all-reduce of ``x`` (slowest rank), after the caller's warm-up."""
    import torch
    import torch.distributed as dist

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    sync()
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def run(device_type: str, megabytes: float, iters: int, timeout_s: float, efa_devices: int,
        node_failures: list[str] | None = None, node_fabric: dict | None = None) -> NetResult:
    """Join the step's process group, check and time an all-reduce, agree on the network, on the node checks that
    failed (``node_failures`` of this task's node) and on the NVLink domain (``node_fabric``: what this task's node
    check found, None on the node's other tasks); every rank returns the same result."""
    # NCCL's log is read by the end of this call; its folder goes with it (a preflight before every job would
    # otherwise leave one a task and job in the node's temporary folder).
    log_dir = tempfile.mkdtemp(prefix="llama-fp8-nccl-") if device_type == "cuda" else None
    try:
        return _run(device_type, megabytes, iters, timeout_s, efa_devices, node_failures, node_fabric,
                    capture_nccl_log(log_dir) if log_dir else None)
    finally:
        if log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)


def _run(device_type: str, megabytes: float, iters: int, timeout_s: float, efa_devices: int,
         node_failures: list[str] | None, node_fabric: dict | None, log_path: Path | None) -> NetResult:
    import torch.distributed as dist

    from llama_fp8.parallel import dist as pdist

    if device_type == "cuda":
        import torch

        os.environ.update(slurm_task_env(dict(os.environ), torch.cuda.device_count()))
    cfg = types.SimpleNamespace(device=device_type, process_group_timeout=timeout_s)
    try:
        env = pdist.init_distributed(cfg)
    except Exception as e:  # noqa: BLE001 - any failure to form the group is the finding
        return NetResult("FAIL", f"could not form the process group ({type(e).__name__}: {str(e)[:300]})")
    try:
        return _measure_and_agree(env, megabytes, iters, log_path, efa_devices, node_failures or [], node_fabric)
    except Exception as e:  # noqa: BLE001 - e.g. NCCL_NET names a network that did not initialize
        said = nccl.parse(log_path.read_text(errors="replace")) if log_path and log_path.exists() else None
        errors = (said.mnnvl_errors + said.plugin_errors) if said else []
        why = f"; NCCL said: {errors[0]}" if errors else ""
        return NetResult("FAIL", f"all-reduce failed ({type(e).__name__}: {str(e).splitlines()[0][:300]}){why}",
                         backend=dist.get_backend() if dist.is_initialized() else "")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure_and_agree(env, megabytes: float, iters: int, log_path: Path | None, efa_devices: int,
                       node_failures: list[str], node_fabric: dict | None = None) -> NetResult:
    import torch
    import torch.distributed as dist

    numel = max(1, int(megabytes * 2**20) // 4)
    x = torch.full((numel,), float(env.rank + 1), dtype=torch.float32, device=env.device)
    dist.all_reduce(x)  # warm-up (creates the NCCL communicator) and the value check
    expected = env.world_size * (env.world_size + 1) / 2
    wrong = int((x != expected).sum().item())
    x.zero_()  # the timed loop must not grow the values to inf
    dist.all_reduce(x)
    seconds = _timed_all_reduce(x, iters, env.device)
    mine = {"host": node_name(), "efa": efa_devices, "wrong": wrong, "failed": node_failures,
            "log": log_path.read_text(errors="replace") if log_path and log_path.exists() else "",
            "fabric": node_fabric, "settings": fabric.settings()}
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    return summarize(everyone, dist.get_backend(), numel * 4, iters, seconds, expected)


def summarize(per_rank: list[dict[str, Any]], backend: str, nbytes: int, iters: int, seconds: float,
              expected: float) -> NetResult:
    """Rank 0's verdict from every rank's host, EFA count, value check and NCCL log."""
    hosts = tuple(dict.fromkeys(r["host"] for r in per_rank))
    ranks = len(per_rank)
    algbw, busbw = bus_bandwidth(nbytes, seconds, ranks)
    res = NetResult("OK", "", backend=backend, ranks=ranks, nodes=len(hosts), hosts=hosts, bytes=nbytes,
                    iters=iters, time_s=seconds, algbw_gbps=algbw, busbw_gbps=busbw)
    for r in per_rank:
        if r.get("failed"):
            res.failed_nodes.setdefault(r["host"], list(r["failed"]))
    bad = [i for i, r in enumerate(per_rank) if r["wrong"]]
    if bad:
        res.values_ok = False
        res.status, res.message = "FAIL", (f"all-reduce returned wrong values on rank(s) {bad[:8]} "
                                           f"(expected every element = {expected:g}): a broken transport")
        return res
    if backend != "nccl":
        res.network, res.network_kind = f"{backend} (TCP)", "socket"
        res.message = f"{backend} over TCP (CPU run)"
        domain = nvlink.decide(per_rank, None)
        res.nvlink = domain.to_dict() if domain else None
        return res
    nets = [nccl.parse(r["log"]) for r in per_rank]
    domain = nvlink.decide(per_rank, nets)
    res.nvlink = domain.to_dict() if domain else None
    first = nets[0]
    res.network, res.network_kind, res.provider, res.nccl_version = (first.network, first.kind, first.provider,
                                                                    first.nccl_version)
    differ = sorted({n.describe() for n in nets})
    efa = max(r["efa"] for r in per_rank)
    decision = nccl.decide(first, efa, len(hosts))
    if len(differ) > 1:
        decision = nccl.Decision("FAIL", f"ranks use different networks: {'; '.join(differ[:4])}")
    else:  # the worst verdict of any rank (a node whose plugin did not load fails the test)
        for n in nets[1:]:
            d = nccl.decide(n, efa, len(hosts))
            if d.status == "FAIL" or (d.status == "WARN" and decision.status == "OK"):
                decision = d
    res.status, res.message = decision.status, decision.message
    return res


def result_lines(res: NetResult) -> list[tuple[str, str, str]]:
    """(check name, status, message) lines for the preflight report."""
    lines = [] if not res.values_ok else [("network", res.status, res.message or "")]
    if res.nvlink:
        lines.append(("nvlink_domain", res.nvlink["status"], res.nvlink["message"]))
    if res.busbw_gbps is not None:
        where = f"{res.ranks} ranks on {res.nodes} node(s)"
        note = "" if res.nodes > 1 else " (one node: intra-node links, not the network)"
        values = "" if res.values_ok else f"{res.message}; "
        lines.append(("all_reduce", "OK" if res.values_ok else "FAIL",
                      f"{values}{res.bytes / 2**20:g} MiB x {res.iters} over {where}: busbw {res.busbw_gbps:.2f} GB/s, "
                      f"algbw {res.algbw_gbps:.2f} GB/s, {res.time_s * 1e3:.2f} ms each{note}"))
    return lines


def default_megabytes(device_type: str) -> float:
    """256 MiB on GPU (large enough for busbw to approach the link speed), 4 MiB on CPU (gloo is slow)."""
    return 256.0 if device_type == "cuda" else 4.0
