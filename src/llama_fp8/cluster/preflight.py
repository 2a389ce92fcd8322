"""`python -m llama_fp8 preflight`: is this job ready to train? One line per check, non-zero exit on failure.

    python -m llama_fp8 preflight --device cuda -- --model llama3.1-8b --fp8=1 --run_dir /fsx/runs/a

Train flags after `--` are parsed and validated exactly as `train` does (presets, --config YAML), and
the checks use the resolved values (device, fp8, fp8_backend, dataset, tokenizer, run dir); own flags
before `--` win.

1.train_llama.sbatch runs it as one task per GPU on every node (SKIP_PREFLIGHT=1 skips it). The first task of
each node checks the node (GPUs and FP8 recipes, TE/torchao, NCCL, EFA and the OFI plugin, the container mounts,
write access, data paths); then all tasks run a short all-reduce (netcheck.py) that reports the bus bandwidth
and the network NCCL chose, and fails when EFA devices exist but NCCL is on TCP sockets. Every task exits
with the same code. Started as a single process (no Slurm step, no torchrun) it checks this node only.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import glob
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llama_fp8.cluster import mounts, nccl, netcheck

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass
class Check:
    """Result of one check: status OK/WARN/FAIL and a one-line explanation."""

    name: str
    status: str
    message: str

    def line(self) -> str:
        return f"[{self.status:>4}] {self.name}: {self.message}"


@dataclass
class Settings:
    """What the checks look at; from own flags, else train flags, else these defaults."""

    device: str = "auto"
    model_impl: str = "auto"
    fp8: bool = False
    fp8_backend: str = "auto"
    dataset: str = "synthetic"
    tokenizer: str | None = None
    checkpoint_dir: str = "runs"
    paths: dict[str, str] = field(default_factory=dict)
    """Resolved path flags (run_dir, checkpoint_dir, dataset, ...) for the container mount check."""
    train: Any = None
    """The parsed train flags (a TrainConfig), when preflight was given any."""


def fp8_recipes(capability: tuple[int, int], cuda: str | None) -> list[str]:
    """``backend:recipe`` names a GPU of this compute capability runs natively (the FP8 recipe table)."""
    from llama_fp8.precision import recipes

    return [f"{r.backend}:{r.name}" for r in recipes.supported_on(capability, cuda)]


def check_gpus(s: Settings) -> Check:
    """GPU count, names, compute capability and FP8 recipes; no GPU is a FAIL only with --device cuda."""
    import torch

    if not torch.cuda.is_available():
        status = FAIL if s.device == "cuda" else WARN
        return Check("gpu", status, f"no GPU (torch {torch.__version__}); --device {s.device} -> training on CPU"
                     if status == WARN else "no GPU but --device cuda: check the node / CUDA driver")
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    names = {torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}
    cap = min(caps)
    recipes = fp8_recipes(cap, torch.version.cuda)
    desc = f"{torch.cuda.device_count()} x {', '.join(sorted(names))} (sm_{cap[0]}{cap[1]})"
    if not recipes:
        status = FAIL if s.fp8 else OK
        return Check("gpu", status, f"{desc}: no FP8 recipe runs on it{'; use --fp8=0' if s.fp8 else ''}")
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
                status = FAIL if s.fp8_backend == backend.name else WARN if s.fp8 or _gpu_wanted(s) else OK
                checks.append(Check(backend.library, status, f"not importable ({type(e).__name__}: {str(e)[:160]})"))
    return checks


def check_model_impl(s: Settings) -> Check:
    """The implementation --model_impl asks for can run here (auto: which one it will pick)."""
    from llama_fp8 import models

    device = torch_device(s.device)
    try:
        impl = models.resolve(s.model_impl, device)
    except ValueError as e:
        return Check("model_impl", FAIL, str(e))
    reason = impl.unavailable(device)
    if reason:
        return Check("model_impl", FAIL, f"--model_impl {impl.name}: {reason[:200]}")
    return Check("model_impl", OK, f"{s.model_impl} -> {impl.name} ({impl.description}) on {device.type}")


def check_fp8_features(s: Settings) -> Check:
    """The FP8 choice of the train flags, made by the one resolver (``precision.resolve``, without the hardware
    check: check_gpus reports what this node's GPUs run): the backend and recipe exist in the installed
    library (the recipe table's minimum versions); nothing to check without --fp8 1."""
    from llama_fp8 import models, precision

    cfg = s.train
    if cfg is None or not s.fp8:
        return Check("fp8_features", OK, "no FP8 asked for")
    cfg = dataclasses.replace(cfg, fp8=True, fp8_backend=s.fp8_backend, model_impl=s.model_impl)
    try:
        impl = models.resolve(cfg.model_impl, torch_device(s.device))
        choice = precision.resolve(cfg, impl, None, others=models.implementations())
    except ValueError as e:  # ConfigError: the resolver's own words
        return Check("fp8_features", FAIL, str(e))
    backend = next(b for b in impl.fp8_backends() if b.name == choice.backend)
    return Check("fp8_features", OK, f"{backend.name} {choice.recipe}{' + FP8 all-gather' if cfg.fp8_all_gather else ''}"
                 f" with {backend.library} {backend.library_version()}")


def check_layout(s: Settings) -> Check:
    """The mesh the train flags ask for (--dp_*, --tp_size, --cp_size) fits the allocation's tasks and the model."""
    from llama_fp8 import parallel

    cfg = s.train
    rank, _, tasks = task_position()
    if cfg is None:
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


def check_nccl(s: Settings) -> Check:
    """NCCL version of this torch build; missing NCCL is a FAIL only when GPUs are wanted."""
    import torch

    try:
        version = torch.cuda.nccl.version()
    except Exception as e:  # noqa: BLE001 - CPU builds raise at call time
        status = FAIL if s.device == "cuda" else OK
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
    except OSError as e:  # e.g. a libibverbs that does not match libefa (README: Troubleshooting)
        return Check("efa", FAIL, f"{len(devices)} EFA device(s) but the OFI plugin {plugin} does not load: {e}")
    net = os.environ.get("NCCL_NET")
    if not net or net.lower() not in nccl.OFI_NETWORKS:
        return Check("efa", WARN, f"{len(devices)} EFA device(s), plugin {plugin}, but NCCL_NET={net or 'unset'}: "
                     f"a plugin that fails to initialize falls back to TCP silently; export "
                     f"NCCL_NET='{nccl.OFI_NET_NAME}' (1.train_llama.sbatch does)")
    return Check("efa", OK, f"{len(devices)} EFA device(s) ({', '.join(devices[:4])}), OFI plugin {plugin} "
                 f"({how}), NCCL_NET={net}")


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


def check_writable(s: Settings) -> Check:
    """The checkpoint dir (or its nearest existing parent) accepts a file; nothing is left behind."""
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


def _looks_local(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or Path(value).expanduser().exists()


def check_path(name: str, value: str | None) -> Check:
    """A local dataset/tokenizer path must exist and be readable; hub names and `synthetic` are not fetched."""
    if value is None or value == "synthetic":
        return Check(name, OK, f"{value or 'default'} (nothing to check)")
    if not _looks_local(value):
        return Check(name, OK, f"{value}: hub name, not fetched by preflight")
    path = Path(value).expanduser()
    if not path.exists():
        return Check(name, FAIL, f"{path}: no such file or directory (--{name})")
    if not os.access(path, os.R_OK):
        return Check(name, FAIL, f"{path}: not readable (--{name})")
    return Check(name, OK, f"{path} readable")


def _gpu_wanted(s: Settings) -> bool:
    return s.device == "cuda"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llama_fp8 preflight", allow_abbrev=False,
                                usage="%(prog)s [own flags] [-- TRAIN_FLAGS...]",
                                description="Check GPUs/FP8, TE, torchao, NCCL, EFA, checkpoint dir, data paths.")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="as train --device (default auto)")
    p.add_argument("--fp8", choices=["0", "1"], help="FP8 wanted: a GPU without FP8 fails (default 0)")
    from llama_fp8.precision import recipes

    p.add_argument("--model_impl", help="as train --model_impl: the implementation that must be usable")
    p.add_argument("--fp8_backend", choices=["auto", *recipes.backends()], help="the backend that must import")
    p.add_argument("--dataset", help="synthetic, a hub name, or a local path (must exist)")
    p.add_argument("--tokenizer", help="hub name or local path (must exist)")
    p.add_argument("--checkpoint_dir", help="must be writable (default: train --run_dir, else runs)")
    net = p.add_argument_group("network test (all tasks of the job step)")
    net.add_argument("--network_test", choices=["auto", "0", "1"], default="auto",
                     help="all-reduce over every task: auto = when started as several tasks (default auto)")
    net.add_argument("--allreduce_mb", type=_positive(float), default=None,
                     help="all-reduce size in MiB (default 256 on GPU, 4 on CPU)")
    net.add_argument("--allreduce_iters", type=_positive(int), default=10, help="timed all-reduces (default 10)")
    net.add_argument("--timeout", type=_positive(float), default=300.0,
                     help="seconds to wait for every task to join (default 300)")
    p.add_argument("--report", help="write the result as JSON here (first task only)")
    return p


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def resolve(own: argparse.Namespace, train_args: list[str]) -> Settings:
    """Settings from own flags > train flags (parsed and validated like `train` does) > defaults.

    Raises llama_fp8.config.ConfigError for bad train flags (argparse-level errors exit 2).
    """
    from llama_fp8 import config

    cfg = config.parse_args(train_args) if train_args else None
    s = Settings()
    if cfg is not None:
        s = Settings(device=cfg.device, model_impl=cfg.model_impl, fp8=cfg.fp8, fp8_backend=cfg.fp8_backend,
                     dataset=cfg.dataset,
                     tokenizer=cfg.tokenizer,
                     checkpoint_dir=getattr(cfg, "checkpoint_dir", None) or cfg.run_dir or config.default_run_dir(),
                     paths={f: str(getattr(cfg, f)) for f, _ in mounts.PATH_FLAGS if getattr(cfg, f, None)},
                     train=cfg)
    s.device = own.device or s.device
    s.model_impl = own.model_impl or s.model_impl
    s.fp8 = own.fp8 == "1" if own.fp8 is not None else s.fp8
    s.fp8_backend = own.fp8_backend or s.fp8_backend
    s.dataset = own.dataset or s.dataset
    s.tokenizer = own.tokenizer or s.tokenizer
    s.checkpoint_dir = own.checkpoint_dir or s.checkpoint_dir
    for name in ("dataset", "tokenizer", "checkpoint_dir"):
        if getattr(own, name):
            s.paths[name] = getattr(own, name)
    return s


def run_checks(s: Settings) -> list[Check]:
    """Every check, in report order; a check that crashes is reported as FAIL, not raised."""
    checks = []
    for fn in (check_gpus, check_model_impl, check_fp8_backends, check_fp8_features, check_layout, check_nccl,
               check_efa, check_mounts, check_writable):
        try:
            out = fn(s)
        except Exception as e:  # noqa: BLE001 - report and keep going
            out = Check(fn.__name__.removeprefix("check_"), FAIL, f"check crashed: {type(e).__name__}: {e}")
        checks += out if isinstance(out, list) else [out]
    checks += [check_path("dataset", s.dataset), check_path("tokenizer", s.tokenizer)]
    return checks


def task_position(env: dict[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, local rank, tasks) of this process: torchrun's variables, else a Slurm step's, else (0, 0, 1)."""
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env.get("LOCAL_RANK", 0)), int(env["WORLD_SIZE"])
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", 0)), int(env.get("SLURM_NTASKS", 1))
    return 0, 0, 1


def node_summary(checks: list[Check]) -> str:
    failed = [c.name for c in checks if c.status == FAIL]
    warned = sum(c.status == WARN for c in checks)
    return (f"preflight on {netcheck.node_name()}: {len(checks) - len(failed) - warned} ok, {warned} warning(s), "
            f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}")


def torch_device(asked: str):
    """``--device`` as training will run it (``parallel.dist.device_type`` decides)."""
    import torch

    from llama_fp8.parallel.dist import device_type

    return torch.device(device_type(asked))


def network(own: argparse.Namespace, s: Settings, node_failed: list[str]) -> tuple[list[Check], netcheck.NetResult]:
    device = torch_device(s.device).type
    res = netcheck.run(device, own.allreduce_mb or netcheck.default_megabytes(device), own.allreduce_iters,
                       own.timeout, len(efa_devices()), node_failed)
    checks = [Check(name, status, message) for name, status, message in netcheck.result_lines(res)]
    for host, names in res.failed_nodes.items():
        checks.append(Check(f"node {host}", FAIL, f"failed: {', '.join(names)}"))
    return checks, res


def main(argv: list[str]) -> int:
    """Entry point of `python -m llama_fp8 preflight`: 0 when nothing failed, 1 otherwise, 2 on bad flags.
    With several tasks, every task returns the same code."""
    own_args, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    try:
        own = build_parser().parse_args(own_args)
        settings = resolve(own, train_args)
    except SystemExit as e:
        return int(e.code or 0)
    except ValueError as e:  # ConfigError is a ValueError
        print(f"preflight: error in the train flags: {e}", file=sys.stderr)
        return 2
    rank, local_rank, tasks = task_position()
    checks = run_checks(settings) if local_rank == 0 else []
    if checks:  # one write per node, so that nodes' blocks do not interleave in the job log
        print("\n".join([c.line() for c in checks] + [node_summary(checks)]), flush=True)
    node_failed = [c.name for c in checks if c.status == FAIL]
    report: dict = {"host": netcheck.node_name(), "checks": [c.__dict__ for c in checks]}
    failed = bool(node_failed)
    if own.network_test == "1" or (own.network_test == "auto" and tasks > 1):
        net_checks, res = network(own, settings, node_failed)
        failed = res.status == FAIL or bool(res.failed_nodes)
        report["network"] = res.to_dict()
        if rank == 0:
            verdict = "failed" if failed else "passed"
            print("\n".join([c.line() for c in net_checks] +
                            [f"preflight of job step: {res.nodes or '?'} node(s), {res.ranks or tasks} task(s): "
                             f"{verdict}"]), flush=True)
    if own.report and rank == 0:
        Path(own.report).parent.mkdir(parents=True, exist_ok=True)
        Path(own.report).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
