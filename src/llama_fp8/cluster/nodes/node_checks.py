"""Preflight's node checks: what this node has (GPUs and the FP8 recipes they run, the FP8 libraries, NCCL,
EFA and the OFI plugin, the site's node health check, the container mounts, a writable checkpoint folder,
readable data paths). Each
returns a ``Check``; none decides anything about the run (``config_checks.py`` asks the plan's resolvers)."""

from __future__ import annotations

import ctypes
import glob
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llama_fp8.cluster.launch import health, mounts
from llama_fp8.cluster.nodes import nccl

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass
class Check:
    """Result of one check: status OK/WARN/FAIL and a one-line explanation."""

    name: str
    status: str
    message: str
    data: dict | None = None
    """What the check found, for the job step's comparison (JSON-able; NVLink domain: ``fabric.NodeFabric``)."""

    def line(self) -> str:
        return f"[{self.status:>4}] {self.name}: {self.message}"


@dataclass
class Settings:
    """What the checks look at: the train config (train flags after ``--``, preflight's own flags applied
    on top), the folder that must be writable and the path flags for the mount check."""

    cfg: Any = None
    """The resolved TrainConfig (own flags applied); None only in tests of checks that do not read it."""
    train_given: bool = False
    """Train flags were given (the layout check needs them)."""
    checkpoint_dir: str = "runs"
    paths: dict[str, str] = field(default_factory=dict)
    """Resolved path flags (run_dir, checkpoint_dir, dataset, ...) for the container mount check."""


def fp8_recipes(capability: tuple[int, int], cuda: str | None) -> list[str]:
    """``backend:recipe`` names a GPU of this compute capability runs natively (the FP8 recipe table)."""
    from llama_fp8.precision import recipes

    return [f"{r.backend}:{r.name}" for r in recipes.supported_on(capability, cuda)]


def check_gpus(s: Settings) -> Check:
    """GPU count, names, compute capability and FP8 recipes; no GPU is a FAIL only with --device cuda."""
    import torch

    if not torch.cuda.is_available():
        status = FAIL if s.cfg.device == "cuda" else WARN
        return Check("gpu", status, f"no GPU (torch {torch.__version__}); --device {s.cfg.device} -> training on CPU"
                     if status == WARN else "no GPU but --device cuda: check the node / CUDA driver")
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    cap = min(caps)
    recipes = fp8_recipes(cap, torch.version.cuda)
    desc = f"{torch.cuda.device_count()} x {', '.join(sorted(names))} (sm_{cap[0]}{cap[1]})"
    if not recipes:
        status = FAIL if s.cfg.fp8 else OK
        return Check("gpu", status, f"{desc}: no FP8 recipe runs on it{'; use --fp8=0' if s.cfg.fp8 else ''}")
    return Check("gpu", OK, f"{desc}: FP8 recipes {', '.join(recipes)}")


def check_fp8_backends(s: Settings) -> list[Check]:
    """Each FP8 library: importable, and its version; a missing one fails only when --fp8_backend asks for it."""
    from llama_fp8 import models

    checks, seen = [], set()
    for impl in models.implementations():
        for backend in impl.fp8_backends():
            if backend.name in seen:
                continue
            seen.add(backend.name)
            try:
                checks.append(Check(backend.library, OK, f"version {backend.library_version()}"))
            except Exception as e:  # noqa: BLE001 - TE raises OSError/RuntimeError without CUDA too
                status = FAIL if s.cfg.fp8_backend == backend.name else WARN if s.cfg.fp8 or _gpu_wanted(s) else OK
                checks.append(Check(backend.library, status, f"not importable ({type(e).__name__}: {str(e)[:160]})"))
    return checks


def check_nccl(s: Settings) -> Check:
    """NCCL version of this torch build; missing NCCL is a FAIL only when GPUs are wanted."""
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception as e:  # noqa: BLE001 - CPU builds raise at call time
        status = FAIL if s.cfg.device == "cuda" else OK
        return Check("nccl", status, f"not available in torch {torch.__version__} ({type(e).__name__}); gloo on CPU")
    return Check("nccl", OK, "version " + ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version))


def efa_devices(sysfs: str = "/sys/class/infiniband") -> list[str]:
    """InfiniBand devices bound to the efa driver."""
    return sorted(Path(d).name for d in glob.glob(f"{sysfs}/*")
                  if os.path.realpath(f"{d}/device/driver").endswith("/efa"))


def check_efa(_: Settings) -> Check:
    """EFA devices and, when present, the OFI plugin NCCL will load (it must exist and load: without it NCCL
    falls back to TCP sockets) and NCCL_NET naming it (so that a plugin failure is an error, not TCP)."""
    devices = efa_devices()
    if not devices:
        return Check("efa", OK, "no EFA devices (NCCL uses its default transport)")
    plugin, how = nccl.configured_plugin()
    if plugin is None:
        return Check("efa", FAIL, f"{len(devices)} EFA device(s) but no aws-ofi-nccl plugin ({how}): NCCL would use "
                     "TCP sockets; rebuild the image (scripts/build_image.sh) or set NCCL_NET_PLUGIN to the plugin")
    try:
        ctypes.CDLL(plugin)
    except OSError as e:  # e.g. a libibverbs that does not match libefa (docs/cluster.md: Troubleshooting)
        return Check("efa", FAIL, f"{len(devices)} EFA device(s) but the OFI plugin {plugin} does not load: {e}")
    net = os.environ.get("NCCL_NET")
    if not net or net.lower() not in nccl.OFI_NETWORKS:
        return Check("efa", WARN, f"{len(devices)} EFA device(s), plugin {plugin}, but NCCL_NET={net or 'unset'}: "
                     f"a plugin that fails to initialize falls back to TCP silently; export "
                     f"NCCL_NET='{nccl.OFI_NET_NAME}' (1.train_llama.sbatch does)")
    return Check("efa", OK, f"{len(devices)} EFA device(s) ({', '.join(devices[:4])}), OFI plugin {plugin} "
                 f"({how}), NCCL_NET={net}")


def check_node_health(_: Settings) -> Check:
    """The site's own node check (``LLAMA_FP8_NODE_CHECK``, exit 0 = healthy), the one the launcher runs before
    restarting workers: a node, spare or training, that fails it is never used (cluster/launch/health.py)."""
    if not os.environ.get(health.CHECK_ENV):
        return Check("node health", OK, f"no site check ({health.CHECK_ENV} unset)")
    problem = health.problem(None)
    return Check("node health", FAIL, problem) if problem else \
        Check("node health", OK, f"{health.CHECK_ENV} passed")


def check_mounts(s: Settings) -> Check:
    """Inside a Pyxis container started by our scripts (LLAMA_FP8_CONTAINER_MOUNTS set): every path of the
    resolved config is on a mount, not on the container's throw-away root file system."""
    spec = os.environ.get(mounts.MOUNTS_ENV)
    if spec is None:
        return Check("mounts", OK, "not in a container started by the launch scripts (nothing to check)")
    paths = mounts.run_paths(s.paths, os.getcwd(), dict(os.environ))
    bad = mounts.problems(paths, mounts.parse_mounts(spec))
    if bad:
        return Check("mounts", FAIL, "; ".join(bad) + f" (mounts: {spec})")
    return Check("mounts", OK, f"{len(paths)} path(s) on mounts ({spec})")


def check_bucket(s: Settings, where: str) -> Check:
    """An s3:// checkpoint prefix is reachable and writable from this node with the credentials it has: one small
    object written, then deleted (the AWS credential chain of the node: its instance or pod role, never a key)."""
    from llama_fp8.checkpoint import places

    try:
        places.probe_writable(s.cfg, where, rank=0)
    except Exception as e:  # noqa: BLE001 - any failure is this check's result, named
        return Check("checkpoint_dir", FAIL, f"{where}: {e}")
    return Check("checkpoint_dir", OK, f"{where} reachable and writable from {socket.gethostname()} (a probe object "
                                       f"written and deleted)")


def check_writable(s: Settings) -> Check:
    """The checkpoint dir (or its nearest existing parent) accepts a file; nothing is left behind. An s3:// prefix
    (the checkpoint dir, or --checkpoint_copy_dir's) gets a probe object instead."""
    copy = getattr(s.cfg, "checkpoint_copy_dir", None) if s.cfg is not None else None
    if str(s.checkpoint_dir).startswith("s3://") or copy:
        checks = [check_bucket(s, w) for w in (s.checkpoint_dir, copy) if w and str(w).startswith("s3://")]
        bad = [c for c in checks if c.status == FAIL]
        if not str(s.checkpoint_dir).startswith("s3://"):
            checks.append(_check_folder(s))
        return bad[0] if bad else Check("checkpoint_dir", OK, "; ".join(c.message for c in checks))
    return _check_folder(s)


def _check_folder(s: Settings) -> Check:
    path = Path(s.checkpoint_dir).expanduser().resolve()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return Check("checkpoint_dir", FAIL, f"{path}: {existing} is not a directory")
    probe = existing / f".preflight-{socket.gethostname()}-{os.getpid()}"
    try:
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        return Check("checkpoint_dir", FAIL, f"{path}: cannot write in {existing} ({e.strerror})")
    where = "exists" if existing == path else f"will be created under {existing}"
    return Check("checkpoint_dir", OK, f"{path} writable ({where})")


def check_path(name: str, value: str | None) -> Check:
    """A local dataset/tokenizer path must exist and be readable; hub names and `synthetic` are not fetched.
    Local or hub: the data loader's own test (``data.files.is_local``)."""
    from llama_fp8.data.files import is_local

    if value is None or value == "synthetic":
        return Check(name, OK, f"{value or 'default'} (nothing to check)")
    if not is_local(value):
        return Check(name, OK, f"{value}: hub name, not fetched by preflight")
    path = Path(value).expanduser()
    if not path.exists():
        return Check(name, FAIL, f"{path}: no such file or directory (--{name})")
    if not os.access(path, os.R_OK):
        return Check(name, FAIL, f"{path}: not readable (--{name})")
    return Check(name, OK, f"{path} readable")


def _gpu_wanted(s: Settings) -> bool:
    return s.cfg.device == "cuda"
