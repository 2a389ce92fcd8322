"""Compile Transformer Engine's PyTorch extension (``transformer_engine_torch``) from its source
distribution against this node's torch, without network.

What TE's ``setup.py`` reads (transformer_engine_torch 2.20.2 sdist, ``setup.py`` and
``build_tools/utils.py``): ``NVTE_FRAMEWORK`` (which framework extension to build),
``NVTE_PYTORCH_FORCE_BUILD=TRUE`` (else its ``bdist_wheel`` first tries to download a prebuilt wheel from
GitHub), ``MAX_JOBS`` (parallel compile jobs), ``CUDA_HOME`` (else nvcc is searched for), and the
nvidia-cudnn-frontend distribution's ``include/`` (found through PYTHONPATH: the kit installs it into the
target folder). CUDA, cuDNN and NCCL headers come from the CUDA toolkit of nvcc and from the ``include/``
folders of the node's ``nvidia-*`` pip packages, given to the compiler through ``CPLUS_INCLUDE_PATH``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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


def plan(python: str, sdist: Path, wheel_dir: Path, target: Path, jobs: int | None,
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


def record(te_version: str, torch_version: str, cp_tag: str, cuda: str | None, p: BuildPlan,
           seconds: float) -> dict:
    """What a build record says about the wheel it sits beside (gpu_kit reads it)."""
    import datetime
    import platform

    return {"te_version": te_version, "torch": torch_version, "python": cp_tag, "cuda": cuda,
            "machine": platform.machine(), "host": platform.node(), "build_seconds": round(seconds, 1),
            "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "max_jobs": p.env.get("MAX_JOBS"), "python_executable": sys.executable}
