"""`python -m llama_fp8 preflight`: is this node ready to train? One line per check, non-zero exit on failure.

    python -m llama_fp8 preflight --device cuda -- --model llama3.1-8b --fp8=1 --run_dir /fsx/runs/a

Train flags after `--` are parsed and validated exactly as `train` does (presets, --config YAML), and
the checks use the resolved values (device, fp8, fp8_backend, dataset, tokenizer, run dir); own flags
before `--` win. 1.train_llama.sbatch runs this on
every node before training (SKIP_PREFLIGHT=1 skips it).
"""

from __future__ import annotations

import argparse
import glob
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

OK, WARN, FAIL = "OK", "WARN", "FAIL"
OFI_PLUGIN_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/amazon/ofi-nccl/lib64", "/opt/aws-ofi-nccl/lib", "/usr/local/lib")


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
    import torch

    from llama_fp8 import models

    device = torch.device("cuda" if s.device == "cuda" or (s.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    try:
        impl = models.resolve(s.model_impl, device)
    except ValueError as e:
        return Check("model_impl", FAIL, str(e))
    reason = impl.unavailable(device)
    if reason:
        return Check("model_impl", FAIL, f"--model_impl {impl.name}: {reason[:200]}")
    return Check("model_impl", OK, f"{s.model_impl} -> {impl.name} ({impl.description}) on {device.type}")


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


def ofi_plugin() -> str | None:
    """Path of NCCL's OFI net plugin (aws-ofi-nccl), searched on LD_LIBRARY_PATH and the usual prefixes."""
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(OFI_PLUGIN_DIRS)
    for d in dirs:
        hits = sorted(glob.glob(f"{d}/libnccl-net*.so*"))
        if hits:
            return hits[0]
    return None


def check_efa(_: Settings) -> Check:
    """EFA devices and, when present, the aws-ofi-nccl plugin (without it NCCL falls back to TCP sockets)."""
    devices = efa_devices()
    if not devices:
        return Check("efa", OK, "no EFA devices (NCCL uses its default transport)")
    plugin = ofi_plugin()
    if plugin is None:
        return Check("efa", FAIL, f"{len(devices)} EFA device(s) but no aws-ofi-nccl plugin (libnccl-net*.so) on "
                     "LD_LIBRARY_PATH or /opt/amazon/ofi-nccl/lib: NCCL would use TCP")
    return Check("efa", OK, f"{len(devices)} EFA device(s) ({', '.join(devices[:4])}), OFI plugin {plugin}")


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
    return p


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
                     checkpoint_dir=getattr(cfg, "checkpoint_dir", None) or cfg.run_dir or config.default_run_dir())
    s.device = own.device or s.device
    s.model_impl = own.model_impl or s.model_impl
    s.fp8 = own.fp8 == "1" if own.fp8 is not None else s.fp8
    s.fp8_backend = own.fp8_backend or s.fp8_backend
    s.dataset = own.dataset or s.dataset
    s.tokenizer = own.tokenizer or s.tokenizer
    s.checkpoint_dir = own.checkpoint_dir or s.checkpoint_dir
    return s


def run_checks(s: Settings) -> list[Check]:
    """Every check, in report order; a check that crashes is reported as FAIL, not raised."""
    checks = []
    for fn in (check_gpus, check_model_impl, check_fp8_backends, check_nccl, check_efa, check_writable):
        try:
            out = fn(s)
        except Exception as e:  # noqa: BLE001 - report and keep going
            out = Check(fn.__name__.removeprefix("check_"), FAIL, f"check crashed: {type(e).__name__}: {e}")
        checks += out if isinstance(out, list) else [out]
    checks += [check_path("dataset", s.dataset), check_path("tokenizer", s.tokenizer)]
    return checks


def main(argv: list[str]) -> int:
    """Entry point of `python -m llama_fp8 preflight`: 0 when nothing failed, 1 otherwise, 2 on bad flags."""
    own_args, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    try:
        settings = resolve(build_parser().parse_args(own_args), train_args)
    except SystemExit as e:
        return int(e.code or 0)
    except ValueError as e:  # ConfigError is a ValueError
        print(f"preflight: error in the train flags: {e}", file=sys.stderr)
        return 2
    checks = run_checks(settings)
    for c in checks:
        print(c.line())
    failed = [c.name for c in checks if c.status == FAIL]
    warned = sum(c.status == WARN for c in checks)
    print(f"preflight on {socket.gethostname()}: {len(checks) - len(failed) - warned} ok, {warned} warning(s), "
          f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
