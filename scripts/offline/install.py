"""Bring a bare GPU node up from an offline kit, without network (standard library only: it runs before
anything of the kit is installed). ``install_kit.sh`` checks the kit against its manifest and runs this;
a GPU visit (``scripts/gpu/visit.sh``) does the same first.

    python scripts/offline/install.py WHEELS_DIR [TARGET] [--no-build] [--force-build] [--export DIR]
                                      [--jobs N] [--build-timeout S] [--dry-run]

A kit (``scripts/offline/make_kit.sh DIR ...``) holds, at its top level, the wheels a bare node lacks (torchao,
Transformer Engine's Python part and core library, their small needs, datasets), the
``transformer_engine_torch`` source distribution, and usually a prebuilt ``transformer_engine_torch`` wheel.
Bootstrap installs every wheel into TARGET (default /tmp/site) with ``pip install --no-index --no-deps
--target``, picks the ``transformer_engine_torch`` wheel built for this node's torch, and checks that TE's
PyTorch extension imports, and runs one ``te.Linear`` forward and backward under FP8 current scaling on the GPU
(a pruned or mismatched core library fails there, not minutes later in the first TE run). When no wheel fits, or the one that should fit does not import, it compiles one from
the source distribution, saves it to WHEELS_DIR/built/<key>/ with a build record (and to --export DIR/<key>/,
e.g. under the output folder $OUT), so that the next visit installs it instead of compiling. Last, it prints
the versions block (versions.py).

A ``transformer_engine_torch`` wheel is C++ compiled against one torch: its file name says the TE version and
the Python, not the torch. So a wheel *matches* only when a build record beside it
(``<wheel name>.build.json``) says it was built for this TE version, this Python and exactly this torch
(``torch.__version__``, local part included), and the record's sha256 is the wheel's. A wheel without a record
is only a *candidate*: installed and kept if TE's PyTorch extension then imports, else one is compiled.

Compiling: TE's ``setup.py`` (transformer_engine_torch 2.20.2 sdist, ``setup.py`` and
``build_tools/utils.py``) reads ``NVTE_FRAMEWORK``, ``NVTE_PYTORCH_FORCE_BUILD=TRUE`` (else its
``bdist_wheel`` first tries to download a prebuilt wheel), ``MAX_JOBS``, ``CUDA_HOME``, and the
nvidia-cudnn-frontend distribution's ``include/`` (found through PYTHONPATH: the kit installs it into TARGET).
CUDA, cuDNN and NCCL headers come from the toolkit of nvcc and from the ``include/`` folders of the node's
``nvidia-*`` pip packages, given to the compiler through ``CPLUS_INCLUDE_PATH``.

Use TARGET with ``export PYTHONPATH=TARGET:$REPO/src``. Exit codes: 0 ready; 2 bad arguments or an unusable
kit (the message names the missing or conflicting wheel); 3 TE's PyTorch extension is not usable (it does not
import and was not compiled, or the compile failed): torchao and the HF model still work.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from kit import sha256  # the offline kit's own helpers (standard library only), in this folder

TE_TORCH = "transformer_engine_torch"
BUILT_DIR = "built"
RECORD_SUFFIX = ".build.json"
# Distributions a kit must provide (or the node must already have). TE's core wheel is
# transformer_engine_cu12 or _cu13, matched by prefix.
REQUIRED = ("torchao", "transformer_engine", "transformer_engine_cu*")

_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(?:-(?P<build>\d[^-]*))?-(?P<py>[^-]+)-(?P<abi>[^-]+)"
                    r"-(?P<plat>[^-]+)\.whl$")
_SDIST = re.compile(r"^(?P<name>.+)-(?P<version>\d[^-]*)\.tar\.gz$")


def normalize(name: str) -> str:
    """Distribution name as pip compares them (PEP 503, with '_' for the separator)."""
    return re.sub(r"[-_.]+", "_", name).lower()


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # normalized
    version: str
    py: str
    abi: str
    plat: str


def parse_wheel(path: Path) -> Wheel:
    """Wheel file name -> its parts (PEP 427); ValueError naming the file if it is not one."""
    m = _WHEEL.match(path.name)
    if m is None:
        raise ValueError(f"{path}: not a wheel file name (name-version-python-abi-platform.whl)")
    return Wheel(path, normalize(m["name"]), m["version"], m["py"], m["abi"], m["plat"])


def runs_on(wheel: Wheel, cp_tag: str, machine: str) -> bool:
    """Whether pip would install ``wheel`` on CPython ``cp_tag`` (e.g. cp312) on ``machine`` (x86_64)."""
    major, minor = cp_tag[2], int(cp_tag[3:])
    pys = wheel.py.split(".")
    abis = wheel.abi.split(".")
    py_ok = any(p in (cp_tag, f"py{major}", f"py{major}{minor}") for p in pys) or (
        "abi3" in abis and any(p.startswith(f"cp{major}") and int(p[3:] or 0) <= minor for p in pys))
    abi_ok = any(a in ("none", "abi3", cp_tag) for a in abis)
    plat_ok = any(p == "any" or p.endswith(machine) for p in wheel.plat.split("."))
    return py_ok and abi_ok and plat_ok


def record_path(wheel_path: Path) -> Path:
    return wheel_path.with_name(wheel_path.name[: -len(".whl")] + RECORD_SUFFIX)


def read_record(wheel_path: Path) -> dict | None:
    """The build record beside a wheel (written by build_te_torch.sh or by install.py), else None."""
    path = record_path(wheel_path)
    if path.is_file():
        return json.loads(path.read_text())
    return None


def build_key(te_version: str, torch_version: str, cp_tag: str) -> str:
    """Folder name under built/ for one build (only letters, digits, '.', '_' and '-', so that it can
    come back in the node's output folder $OUT)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"te{te_version}-torch{torch_version}-{cp_tag}")


@dataclass
class Kit:
    root: Path
    wheels: list[Wheel] = field(default_factory=list)  # top level, all but transformer_engine_torch
    te_torch: list[Wheel] = field(default_factory=list)  # top level and built/*/
    sdist: Path | None = None

    def find(self, pattern: str) -> list[Wheel]:
        """Top-level wheels whose normalized name matches ``pattern`` (a trailing * is a prefix match)."""
        if pattern.endswith("*"):
            return [w for w in self.wheels if w.name.startswith(pattern[:-1])]
        return [w for w in self.wheels if w.name == pattern]

    def te_version(self) -> str | None:
        te = self.find("transformer_engine")
        return te[0].version if te else None


def inventory(root: Path) -> Kit:
    """Read a kit folder. Only names are read here; nothing is installed or imported."""
    kit = Kit(root)
    for path in sorted(root.glob("*.whl")):
        wheel = parse_wheel(path)
        (kit.te_torch if wheel.name == TE_TORCH else kit.wheels).append(wheel)
    kit.te_torch += [parse_wheel(p) for p in sorted((root / BUILT_DIR).glob("*/*.whl"))]
    for path in sorted(root.glob("*.tar.gz")):
        m = _SDIST.match(path.name)
        if m and normalize(m["name"]) == TE_TORCH:
            kit.sdist = path
    return kit


def problems(kit: Kit, installed: set[str]) -> list[str]:
    """What makes this kit unusable, one line each (empty: fine). ``installed``: normalized names of the
    distributions the node's Python already has (a required one found there need not be in the kit)."""
    out = []
    for pattern in REQUIRED:
        have_node = any(n.startswith(pattern[:-1]) if pattern.endswith("*") else n == pattern for n in installed)
        if not kit.find(pattern) and not have_node:
            out.append(f"{kit.root} has no {pattern.replace('*', 'NN')} wheel ({pattern}-VERSION-*.whl) and this "
                       f"Python does not have it either")
    if not kit.te_torch and kit.sdist is None:
        out.append(f"{kit.root} has neither a {TE_TORCH} wheel ({TE_TORCH}-VERSION-*.whl) nor its source "
                   f"({TE_TORCH}-VERSION.tar.gz) to compile one")
    by_name: dict[str, set[str]] = {}
    for w in kit.wheels:
        by_name.setdefault(w.name, set()).add(w.path.name)
    for name, files in sorted(by_name.items()):
        if len(files) > 1:
            out.append(f"{kit.root} has {len(files)} wheels of {name} ({', '.join(sorted(files))}): keep one")
    te, cores = kit.find("transformer_engine"), kit.find("transformer_engine_cu*")
    if te and cores and te[0].version != cores[0].version:
        out.append(f"transformer_engine {te[0].version} and {cores[0].path.name} differ in version: TE refuses "
                   f"to load such a pair")
    return out


@dataclass(frozen=True)
class Choice:
    wheel: Wheel | None
    recorded: bool  # a build record says it was built for this torch
    notes: tuple[str, ...]


def choose_te_torch(kit: Kit, te_version: str, torch_version: str, cp_tag: str, machine: str) -> Choice:
    """The transformer_engine_torch wheel to install: one recorded for exactly this TE, Python and torch
    (newest build first), else an unrecorded one of this TE version and Python (checked by import later),
    else none (compile one). Every wheel passed over is named in ``notes`` with the reason."""
    recorded, unrecorded, notes = [], [], []
    for wheel in kit.te_torch:
        where = wheel.path.relative_to(kit.root)
        if wheel.version != te_version:
            notes.append(f"{where}: TE {wheel.version}, the kit's TE is {te_version}")
            continue
        if not runs_on(wheel, cp_tag, machine):
            notes.append(f"{where}: built for {wheel.py}/{wheel.plat}, this node is {cp_tag}/{machine}")
            continue
        rec = read_record(wheel.path)
        if rec is None:
            unrecorded.append(wheel)
            continue
        mismatch = [f"{k} {rec.get(k)!r} != {v!r}" for k, v in
                    (("te_version", te_version), ("torch", torch_version), ("python", cp_tag)) if rec.get(k) != v]
        if rec.get("sha256") not in (None, sha256(wheel.path)):
            mismatch.append("sha256 differs from its record")
        if mismatch:
            notes.append(f"{where}: {'; '.join(mismatch)}")
        else:
            recorded.append((rec.get("built", ""), wheel))
    if recorded:
        return Choice(max(recorded, key=lambda t: t[0])[1], True, tuple(notes))
    if unrecorded:
        return Choice(unrecorded[0], False, tuple(notes))
    return Choice(None, False, tuple(notes))


def save_build(wheel_file: Path, wheels_dir: Path, record: dict) -> Path:
    """Move a freshly built wheel to ``wheels_dir/built/<key>/`` and write its build record beside it.
    An earlier build with the same key is replaced (same TE, torch and Python: the newer one wins)."""
    key = build_key(record["te_version"], record["torch"], record["python"])
    dest_dir = wheels_dir / BUILT_DIR / key
    dest_dir.mkdir(parents=True, exist_ok=True)
    for old in dest_dir.glob("*"):
        old.unlink()
    dest = dest_dir / wheel_file.name
    dest.write_bytes(wheel_file.read_bytes())
    record_path(dest).write_text(json.dumps({**record, "sha256": sha256(dest)}, indent=1, sort_keys=True) + "\n")
    return dest



# Environment that keeps pip (and anything it starts) off the network.
OFFLINE_ENV = {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1",
               "PIP_CONFIG_FILE": os.devnull, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
# What TE's setup.py imports before it compiles anything (setuptools first: it may provide ``wheel``).
BUILD_IMPORTS = ("import setuptools", "import torch", "from torch.utils.cpp_extension import BuildExtension",
                 "from wheel.bdist_wheel import bdist_wheel", "from packaging.version import parse")


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def find_cuda_home(env: dict[str, str]) -> Path | None:
    """The CUDA toolkit that holds nvcc: $CUDA_HOME, else the nvcc on PATH, else /usr/local/cuda; the first
    whose root has include/cuda_runtime.h (an nvcc on PATH may be a wrapper script outside the toolkit)."""
    candidates = []
    if env.get("CUDA_HOME"):
        candidates.append(Path(env["CUDA_HOME"]) / "bin" / "nvcc")
    which = shutil.which("nvcc", path=env.get("PATH"))
    if which:
        candidates.append(Path(which))
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    for nvcc in candidates:
        root = nvcc.resolve().parent.parent
        if nvcc.is_file() and (root / "include" / "cuda_runtime.h").is_file():
            return root
    return None


def probe(python: str, env: dict[str, str]) -> tuple[list[Path], list[str]]:
    """Ask the node's Python, with the build's environment: the ``include/`` folders of the ``nvidia-*`` pip
    packages it sees (nvidia/cudnn/include, nvidia/nccl/include, nvidia/cu13/include, ...), and which of
    BUILD_IMPORTS fail there (one line each)."""
    code = "\n".join(f"try:\n    {line}\nexcept Exception as e:\n    failed.append({line!r} + ' -> ' + repr(e))"
                     for line in BUILD_IMPORTS)
    code = ("import importlib.util, json\nfailed = []\n" + code +
            "\nspec = importlib.util.find_spec('nvidia')\n"
            "roots = list(spec.submodule_search_locations or []) if spec else []\n"
            "print(json.dumps({'roots': roots, 'failed': failed}))")
    proc = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return [], [f"{python} could not run the build probe: {proc.stderr.strip()[-500:]}"]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    dirs = [p for root in found["roots"] for p in sorted(Path(root).glob("*/include")) if p.is_dir()]
    return dirs, found["failed"]


@dataclass(frozen=True)
class BuildPlan:
    command: list[str]
    env: dict[str, str]  # only what the build adds to the environment
    problems: list[str]  # missing prerequisites, one line each


def build_plan(python: str, sdist: Path, wheel_dir: Path, target: Path, jobs: int | None,
         env: dict[str, str]) -> BuildPlan:
    """The command and environment that build a wheel of ``sdist`` into ``wheel_dir``."""
    problems = []
    cuda_home = find_cuda_home(env)
    if cuda_home is None:
        problems.append("no CUDA toolkit (nvcc with include/cuda_runtime.h beside it): set CUDA_HOME to the "
                        "toolkit, or put its nvcc on PATH")
    add = dict(OFFLINE_ENV)
    add["PYTHONPATH"] = os.pathsep.join(x for x in (str(target), env.get("PYTHONPATH", "")) if x)
    nvidia_dirs, failed = probe(python, {**env, **add})
    problems += [f"the build cannot {x} (add the missing wheel to the kit)" for x in failed]
    includes = [str(p) for p in nvidia_dirs]
    if cuda_home is not None and (cuda_home / "include").is_dir():
        includes.insert(0, str(cuda_home / "include"))
    if not any(Path(p, "cudnn.h").is_file() for p in includes):
        problems.append("no cuDNN headers (cudnn.h): expected in nvidia/cudnn/include of the nvidia-cudnn-cu* pip "
                        "package, or in the CUDA toolkit's include/")
    add.update(NVTE_FRAMEWORK="pytorch", NVTE_PYTORCH_FORCE_BUILD="TRUE", MAX_JOBS=str(jobs or cpu_count()))
    if cuda_home is not None:
        add["CUDA_HOME"] = str(cuda_home)
        add["PATH"] = os.pathsep.join(x for x in (str(cuda_home / "bin"), env.get("PATH", "")) if x)
    for var in ("CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH"):
        add[var] = os.pathsep.join(x for x in (*includes, env.get(var, "")) if x)
    command = [python, "-m", "pip", "wheel", "--no-index", "--no-deps", "--no-build-isolation", "--no-cache-dir",
               "--wheel-dir", str(wheel_dir), str(sdist)]
    return BuildPlan(command, add, problems)


def describe(p: BuildPlan) -> str:
    """The plan as shell lines a person can read (and re-run by hand)."""
    import shlex

    lines = [f"export {k}={shlex.quote(v)}" for k, v in sorted(p.env.items())]
    lines.append(" ".join(shlex.quote(c) for c in p.command))
    return "\n".join(lines)


def build_record(te_version: str, torch_version: str, cp_tag: str, cuda: str | None, p: BuildPlan,
           seconds: float) -> dict:
    """What a build record says about the wheel it sits beside (choose_te_torch reads it)."""
    import datetime
    import platform

    return {"te_version": te_version, "torch": torch_version, "python": cp_tag, "cuda": cuda,
            "machine": platform.machine(), "host": platform.node(), "build_seconds": round(seconds, 1),
            "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "max_jobs": p.env.get("MAX_JOBS"), "python_executable": sys.executable}



HERE = Path(__file__).resolve().parent
MARKER = ".llama-fp8-install"  # written into TARGET: only a folder holding it is ever emptied
EXIT_BAD_KIT, EXIT_NO_TE = 2, 3
IMPORT_CHECK = ("import torch\nimport transformer_engine.pytorch\nimport importlib.metadata as m\n"
                "print('transformer_engine.pytorch imports; transformer_engine_torch', "
                "m.version('transformer_engine_torch'))")
# One te.Linear forward + backward on the GPU, under FP8 current scaling where the GPU has FP8 (SM >= 8.9):
# TE's kernels run, not just its import (TE >= 2.9 has te.autocast(recipe=...), older fp8_autocast(fp8_recipe=...)).
KERNEL_CHECK = """\
import sys, time, torch
if not torch.cuda.is_available():
    print("no CUDA device: TE's kernels not run"); sys.exit(0)
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8CurrentScaling
fp8 = torch.cuda.get_device_capability() >= (8, 9)
new = hasattr(te, "autocast")
context = (te.autocast if new else te.fp8_autocast)(**{"enabled": fp8, "recipe" if new else "fp8_recipe": Float8CurrentScaling()})
t0 = time.perf_counter()
layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
with context:
    y = layer(x)
y.float().square().mean().backward()
torch.cuda.synchronize()
ok = all(bool(torch.isfinite(t).all()) for t in (y, x.grad, layer.weight.grad))
how = "under FP8 current scaling" if fp8 else "in BF16 (this GPU has no FP8)"
print(f"te.Linear forward+backward {how} on {torch.cuda.get_device_name()}: finite {ok}, {time.perf_counter() - t0:.1f} s")
sys.exit(0 if ok else 1)
"""


class InstallError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def say(message: str) -> None:
    print(f"[install] {message}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="install.py", description=__doc__.splitlines()[0])
    p.add_argument("wheels_dir", metavar="WHEELS_DIR", help="the offline kit (scripts/offline/make_kit.sh DIR)")
    p.add_argument("target", metavar="TARGET", nargs="?", default="/tmp/site",
                   help="folder to install into (default /tmp/site); emptied first if an earlier install.py made it")
    p.add_argument("--no-build", action="store_true", help="never compile transformer_engine_torch (exit 3 instead)")
    p.add_argument("--force-build", action="store_true", help="compile transformer_engine_torch even if a wheel fits")
    p.add_argument("--export", metavar="DIR", help="also copy a freshly built wheel and its record to DIR/<key>/")
    p.add_argument("--jobs", type=int, help="parallel compile jobs (MAX_JOBS; default: the CPU cores)")
    p.add_argument("--build-timeout", type=float, default=480.0, help="seconds the compile may take (default 480)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the install and build commands (with their environment) and change nothing")
    args = p.parse_args(argv)
    if args.no_build and args.force_build:
        p.error("--no-build and --force-build contradict each other")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs {args.jobs}: must be >= 1")
    return args


@dataclass(frozen=True)
class Node:
    cp_tag: str
    machine: str
    torch: str | None
    cuda: str | None
    installed: frozenset[str]


def node_info() -> Node:
    """This Python: its tag, machine, torch (imported: the one TE's extension must match) and packages."""
    try:
        import torch

        torch_version, cuda = torch.__version__, torch.version.cuda
    except ImportError:
        torch_version = cuda = None
    names = frozenset(normalize(d.metadata["Name"] or "") for d in importlib.metadata.distributions())
    return Node(f"cp{sys.version_info[0]}{sys.version_info[1]}", platform.machine(), torch_version, cuda, names)


def child_env(target: Path) -> dict[str, str]:
    env = {**os.environ, **OFFLINE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(target), os.environ.get("PYTHONPATH", "")) if x)
    return env


def install_command(wheels: list[Path], target: Path) -> list[str]:
    # One pip call for all wheels: transformer_engine and transformer_engine_torch share the
    # transformer_engine/ folder, and a second --target install would replace that folder whole.
    return [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
            "--upgrade", "--target", str(target), *map(str, wheels)]


def prepare_target(target: Path) -> None:
    """Empty TARGET if an earlier install.py made it; refuse a non-empty folder it did not make."""
    if target.exists() and any(target.iterdir()):
        if not (target / MARKER).is_file():
            raise InstallError(f"TARGET {target} is not empty and was not made by install.py (no {MARKER}): "
                                 f"choose an empty or new folder", EXIT_BAD_KIT)
        shutil.rmtree(target)
    target.mkdir(parents=True, exist_ok=True)
    (target / MARKER).write_text("made by scripts/offline/install.py; emptied by its next run\n")


def install(wheels: list[Path], target: Path) -> None:
    prepare_target(target)
    say(f"installing {len(wheels)} wheels into {target}")
    t0 = time.perf_counter()
    proc = subprocess.run(install_command(wheels, target), env=child_env(target), capture_output=True, text=True)
    if proc.returncode != 0:
        raise InstallError(f"pip install failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}",
                             EXIT_BAD_KIT)
    say(f"installed in {time.perf_counter() - t0:.1f} s")


def import_check(target: Path) -> tuple[bool, str]:
    """Does TE's PyTorch extension import from TARGET with this node's torch? (ok, output)"""
    proc = subprocess.run([sys.executable, "-c", IMPORT_CHECK], env=child_env(target), capture_output=True,
                          text=True, timeout=600)
    text = (proc.stdout + proc.stderr).strip()
    return proc.returncode == 0, text.splitlines()[-1] if proc.returncode == 0 and text else text[-3000:]


def kernel_check(target: Path) -> tuple[bool, str]:
    """Do TE's kernels run (KERNEL_CHECK)? (ok, its last line or the error)"""
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=child_env(target), capture_output=True,
                          text=True, timeout=600)
    text = (proc.stdout + proc.stderr).strip()
    return proc.returncode == 0, text.splitlines()[-1] if proc.returncode == 0 and text else text[-3000:]


def build(kit: Kit, te_version: str, node: Node, target: Path, args: argparse.Namespace) -> Path:
    """Compile transformer_engine_torch into WHEELS_DIR/built/<key>/ (and --export); returns the wheel."""
    out_dir = Path(tempfile.mkdtemp(prefix="te-torch-wheel-"))
    bp = build_plan(sys.executable, kit.sdist, out_dir, target, args.jobs, dict(os.environ))
    if bp.problems:
        raise InstallError("cannot compile transformer_engine_torch:\n  " + "\n  ".join(bp.problems), EXIT_NO_TE)
    log = out_dir.with_suffix(".log")
    say(f"compiling {kit.sdist.name} against torch {node.torch} (MAX_JOBS={bp.env['MAX_JOBS']}, up to "
        f"{args.build_timeout:.0f} s; log {log})")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(bp.command, env={**os.environ, **bp.env}, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=args.build_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            raise InstallError(f"the compile took more than {args.build_timeout:.0f} s and was stopped "
                                 f"(--build-timeout); log {log}", EXIT_NO_TE) from None
    built = sorted(out_dir.glob(f"{TE_TORCH}-*.whl"))
    if rc != 0 or not built:
        raise InstallError(f"the compile failed (exit {rc}); last lines of {log}:\n"
                             + log.read_text()[-3000:], EXIT_NO_TE)
    seconds = time.perf_counter() - t0
    rec = build_record(te_version, node.torch, node.cp_tag, node.cuda, bp, seconds)
    dest = save_build(built[0], kit.root, rec)
    say(f"compiled in {seconds:.0f} s; kept as {dest}")
    if args.export:
        export = Path(args.export) / dest.parent.name
        export.mkdir(parents=True, exist_ok=True)
        for f in (dest, record_path(dest)):
            shutil.copy2(f, export / f.name)
        say(f"copied to {export} (bring it back into {kit.root / BUILT_DIR}/)")
    return dest


def versions_block(target: Path) -> None:
    subprocess.run([sys.executable, str(HERE / "versions.py")], env=child_env(target), check=False, timeout=300)


def check_kit(args: argparse.Namespace) -> tuple[Kit, Node, str]:
    root = Path(args.wheels_dir).resolve()
    if not root.is_dir():
        raise InstallError(f"WHEELS_DIR {args.wheels_dir}: not a folder (make a kit with "
                             f"scripts/offline/make_kit.sh {args.wheels_dir} --python X.Y --torch V --arch sm_NN)", EXIT_BAD_KIT)
    try:
        kit = inventory(root)
    except ValueError as e:
        raise InstallError(str(e), EXIT_BAD_KIT) from None
    node = node_info()
    issues = problems(kit, set(node.installed))
    if node.torch is None:
        issues.append(f"this Python ({sys.executable}) has no torch: run install.py with the node's PyTorch Python")
    if issues:
        raise InstallError("the kit cannot be used:\n  " + "\n  ".join(issues), EXIT_BAD_KIT)
    te_version = kit.te_version() or importlib.metadata.version("transformer_engine")
    return kit, node, te_version


def install_te(kit: Kit, wheels: list[Path], choice: Choice, te_version: str, node: Node, target: Path,
               args: argparse.Namespace) -> None:
    """Install the kit with the chosen TE extension; compile one when it does not import (unless --no-build)."""
    ok, message = False, "no wheel chosen"
    if choice.wheel is not None:
        install([*wheels, choice.wheel.path], target)
        ok, message = import_check(target)
        say(("TE: " if ok else "TE does not import with this wheel: ") + message)
    if ok:
        return
    if args.no_build:
        raise InstallError("transformer_engine_torch is not usable and --no-build was given", EXIT_NO_TE)
    if kit.sdist is None:
        raise InstallError(f"no {TE_TORCH}-{te_version}.tar.gz in the kit to compile", EXIT_NO_TE)
    install(wheels, target)  # the build finds TE's core and cudnn-frontend headers here
    dest = build(kit, te_version, node, target, args)
    install([*wheels, dest], target)
    ok, message = import_check(target)
    if not ok:
        raise InstallError(f"the compiled {dest.name} does not import either:\n{message}", EXIT_NO_TE)
    say("TE: " + message)


def run(args: argparse.Namespace) -> int:
    kit, node, te_version = check_kit(args)
    target = Path(args.target).resolve()
    say(f"kit {kit.root}: {len(kit.wheels)} wheels, TE {te_version}; node: {node.cp_tag}, torch {node.torch}")
    choice = Choice(None, False, ()) if args.force_build else choose_te_torch(
        kit, te_version, node.torch, node.cp_tag, node.machine)
    for note in choice.notes:
        say(f"not used: {note}")
    if choice.wheel is not None:
        how = "built for this torch (build record)" if choice.recorded else "no build record: kept only if it imports"
        say(f"{TE_TORCH}: {choice.wheel.path.relative_to(kit.root)} ({how})")
    elif kit.sdist is None:
        raise InstallError(f"no {TE_TORCH} wheel fits torch {node.torch} / {node.cp_tag} and the kit "
                             f"has no {TE_TORCH}-{te_version}.tar.gz to compile one", EXIT_BAD_KIT)
    wheels = [w.path for w in kit.wheels]
    if args.dry_run:
        return dry_run(kit, wheels, choice, target, args)
    try:
        install_te(kit, wheels, choice, te_version, node, target, args)
        ok, message = kernel_check(target)
        if not ok:  # the extension imports, its kernels fail (e.g. a core library without this GPU's code)
            raise InstallError(f"TE imports but its kernels do not run on this GPU:\n{message}", EXIT_NO_TE)
        say("TE kernels: " + message)
    finally:  # the versions block, also when TE is not usable: what the node has is worth knowing then too
        versions_block(target)
    say(f"ready: export PYTHONPATH={target}:$REPO/src")
    return 0


def dry_run(kit: Kit, wheels: list[Path], choice: Choice, target: Path,
            args: argparse.Namespace) -> int:
    import shlex

    chosen = [choice.wheel.path] if choice.wheel is not None else []
    say("dry run: would run\n" + " ".join(map(shlex.quote, install_command([*wheels, *chosen], target))))
    if choice.wheel is None or args.force_build:
        bp = build_plan(sys.executable, kit.sdist, Path(tempfile.gettempdir()) / "te-torch-wheel", target,
                               args.jobs, dict(os.environ))
        say("dry run: then compile with\n" + describe(bp))
        for problem in bp.problems:
            say(f"dry run: the compile would fail now: {problem}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return run(args)
    except InstallError as e:
        print(f"[install] error: {e}", file=sys.stderr, flush=True)
        return e.code


if __name__ == "__main__":
    sys.exit(main())
