"""Which ``transformer_engine_torch`` wheel a node can use, and how to compile one (standard library only:
install.py runs before anything of the kit is installed).

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
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
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
                 "from wheel.bdist_wheel import bdist_wheel", "from packaging.version import parse",
                 CUDNN_FRONTEND := "import importlib.metadata as m; m.distribution('nvidia-cudnn-frontend')")


def run_bounded(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
                capture: bool = True) -> subprocess.CompletedProcess:
    """``subprocess.run`` whose timeout holds: the command gets its own process group and, at the timeout, the whole
    group is killed (a plain run kills only its child, then waits for the output of any grandchild still holding
    it: an import that started a helper process, a pip that started a build). Raises TimeoutExpired after the kill."""
    import os
    import signal

    out = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if capture else None, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout or "", "")


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


def find_python(version: str) -> str | None:
    """A Python ``version`` that runs, found as find_cuda_home finds the toolkit: $PYTHON_BIN, pythonX.Y on PATH,
    pyenv's newest X.Y.*, /usr/bin, /usr/local/bin (a pyenv shim on PATH may exist without running: each candidate
    is asked for its version); None when none runs."""
    home = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [os.environ.get("PYTHON_BIN"), shutil.which(f"python{version}"),
                  *sorted(map(str, home.glob(f"versions/{version}.*/bin/python")), key=_version_key, reverse=True),
                  f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    for exe in filter(None, candidates):
        try:
            out = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        if out.returncode == 0 and out.stdout.strip() == version:
            return exe
    return None


def _version_key(path: str) -> tuple[int, ...]:
    m = re.search(r"versions/(\d+)\.(\d+)\.(\d+)", path)
    return tuple(map(int, m.groups())) if m else (0,)


def probe(python: str, env: dict[str, str], timeout: float = 300) -> tuple[list[Path], list[str]]:
    """Ask the node's Python, with the build's environment: the ``include/`` folders of the ``nvidia-*`` pip
    packages it sees (nvidia/cudnn/include, nvidia/nccl/include, nvidia/cu13/include, ...), and which of
    BUILD_IMPORTS fail there (one line each)."""
    code = "\n".join(f"try:\n    {line}\nexcept Exception as e:\n    failed.append({line!r} + ' -> ' + repr(e))"
                     for line in BUILD_IMPORTS)
    code = ("import importlib.util, json\nfailed = []\n" + code +
            "\nspec = importlib.util.find_spec('nvidia')\n"
            "roots = list(spec.submodule_search_locations or []) if spec else []\n"
            "print(json.dumps({'roots': roots, 'failed': failed}))")
    try:
        proc = run_bounded([python, "-c", code], timeout, env)
    except subprocess.TimeoutExpired:
        return [], [f"{python} did not answer the build probe in {timeout:.0f} s"]
    if proc.returncode != 0:
        return [], [f"{python} could not run the build probe: {proc.stdout.strip()[-500:]}"]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    dirs = [p for root in found["roots"] for p in sorted(Path(root).glob("*/include")) if p.is_dir()]
    return dirs, found["failed"]


@dataclass(frozen=True)
class BuildPlan:
    command: list[str]
    env: dict[str, str]  # only what the build adds to the environment
    problems: list[str]  # missing prerequisites, one line each


def build_plan(python: str, sdist: Path, wheel_dir: Path, target: Path, jobs: int | None,
               env: dict[str, str], probe_s: float = 300) -> BuildPlan:
    """The command and environment that build a wheel of ``sdist`` into ``wheel_dir``."""
    problems = []
    cuda_home = find_cuda_home(env)
    if cuda_home is None:
        problems.append("no CUDA toolkit (nvcc with include/cuda_runtime.h beside it): set CUDA_HOME to the "
                        "toolkit, or put its nvcc on PATH")
    add = dict(OFFLINE_ENV)
    add["PYTHONPATH"] = os.pathsep.join(x for x in (str(target), env.get("PYTHONPATH", "")) if x)
    nvidia_dirs, failed = probe(python, {**env, **add}, probe_s)
    problems += ["no nvidia-cudnn-frontend, whose headers the compile needs: make the kit with --with cudnn-frontend"
                 if x.startswith(CUDNN_FRONTEND) else f"the build cannot {x} (add the missing wheel to the kit)"
                 for x in failed]
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
