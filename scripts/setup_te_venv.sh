#!/usr/bin/env bash
# Build a virtualenv with the real Transformer Engine (TE) for the CPU structural test tier
# (`make test-te`: the tests marked `te`, in tests/models/te). No GPU is needed: TE imports and builds its modules on a CPU
# machine once torch.cuda.is_available is patched around construction (see tests/models/te).
#
# Recipe (issue 3): torch==2.14.1 (CUDA 13.0 build), transformer-engine-cu13 and transformer-engine
# wheels, and the transformer-engine-torch sdist compiled against that torch with
# --no-build-isolation --no-deps. The compiled wheel (~1 MB) is cached outside the repo, keyed by
# TE + torch + Python versions, so a second venv build skips the ~12 minute compile.
#
# Env overrides:
#   TE_VENV      venv path (default: <repo>/.venv-te)
#   TE_PYTHON    interpreter used to create the venv (default: python3)
#   CUDA_HOME    CUDA toolkit whose major version matches torch's (default: from nvcc on PATH)
#   MAX_JOBS     parallel compile jobs (default: 2)
#   TE_WHEEL_CACHE  wheel cache dir (default: ${XDG_CACHE_HOME:-$HOME/.cache}/llama-fp8/wheels)
set -euo pipefail

TE_VERSION=2.20.2
TORCH_VERSION=2.14.1
CUDA_MAJOR=13
# Runtime requirements of transformer-engine-torch (its build_tools/pytorch.py install_requirements)
# plus what our tests import. Installed explicitly because the sdist is installed with --no-deps.
TE_RUNTIME_DEPS=(einops onnxscript onnx packaging pydantic nvdlfw-inspect
    "nvidia-cudnn-frontend>=1.25.0" "importlib-metadata>=1.0")
TEST_DEPS=(pytest transformers safetensors pyyaml)
BUILD_DEPS=("setuptools>=61.0" wheel ninja packaging)

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${TE_VENV:-$repo_root/.venv-te}
python_bin=${TE_PYTHON:-python3}
log() { echo "[setup_te_venv] $*" >&2; }

# Succeeds when the venv already has the pinned torch + TE and the test dependencies.
venv_ready() {
    [[ -x "$venv/bin/python" ]] || return 1
    "$venv/bin/python" - "$TORCH_VERSION" "$TE_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
import torch  # must precede transformer_engine (libnccl is found through torch)
import transformer_engine.pytorch  # noqa: F401
import pytest, transformers, safetensors, yaml  # noqa: F401,E401
assert torch.__version__.split("+")[0] == sys.argv[1], torch.__version__
assert version("transformer_engine_torch") == sys.argv[2]
EOF
}

# CUDA toolkit root: $CUDA_HOME, else asked from nvcc (which may be a wrapper script).
find_cuda_home() {
    local top
    if [[ -n "${CUDA_HOME:-}" ]]; then
        top=$CUDA_HOME
    else
        command -v nvcc >/dev/null || return 1
        top=$(nvcc -dryrun -c -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
        [[ -n "$top" ]] || return 1
        top=$(cd "$top" && pwd -P)
    fi
    [[ -f "$top/include/cuda_runtime.h" ]] || return 1
    echo "$top"
}

# This repo's package, editable and without dependencies (which could pull another torch).
install_project() {
    local where
    where=$("$venv/bin/python" -c 'import llama_fp8, os; print(os.path.dirname(llama_fp8.__file__))' \
        2>/dev/null || true)
    [[ "$where" == "$repo_root/src/llama_fp8" ]] && return 0
    log "installing $repo_root (editable, --no-deps)"
    "$venv/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$repo_root"
}

if venv_ready; then
    install_project
    log "ready: $venv (torch $TORCH_VERSION, transformer-engine $TE_VERSION)"
    exit 0
fi

py_tag=$("$python_bin" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
cache_root=${TE_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-fp8/wheels}
wheel_dir="$cache_root/te${TE_VERSION}-torch${TORCH_VERSION}-${py_tag}"
mkdir -p "$wheel_dir"

# Every pip call is pinned to one torch so no dependency can pull a different (multi-GB) build.
constraints="$wheel_dir/constraints.txt"
echo "torch==$TORCH_VERSION" >"$constraints"
pip_install() { "$venv/bin/python" -m pip install --quiet -c "$constraints" "$@"; }

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating venv $venv with $python_bin"
    "$python_bin" -m venv "$venv"
fi
log "installing torch==$TORCH_VERSION (CUDA $CUDA_MAJOR build, several GB on first install)"
pip_install "torch==$TORCH_VERSION"
log "installing transformer-engine-cu$CUDA_MAJOR==$TE_VERSION, transformer-engine==$TE_VERSION"
pip_install "transformer-engine-cu$CUDA_MAJOR==$TE_VERSION" "transformer-engine==$TE_VERSION"
pip_install "${TE_RUNTIME_DEPS[@]}" "${TEST_DEPS[@]}" "${BUILD_DEPS[@]}"

shopt -s nullglob
cached=("$wheel_dir"/transformer_engine_torch-"$TE_VERSION"-*.whl)
if ((${#cached[@]} == 0)); then
    CUDA_HOME=$(find_cuda_home) || {
        log "error: no CUDA $CUDA_MAJOR.x toolkit found (nvcc not on PATH); set CUDA_HOME"
        exit 1
    }
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    include_path="$site/nvidia/cu$CUDA_MAJOR/include:$site/nvidia/cudnn/include:$site/nvidia/nccl/include"
    log "compiling transformer-engine-torch==$TE_VERSION (CUDA_HOME=$CUDA_HOME, ~12 min on 2 cores)"
    # NVTE_PYTORCH_FORCE_BUILD: without it setup.py first tries to download a prebuilt wheel.
    env CUDA_HOME="$CUDA_HOME" MAX_JOBS="${MAX_JOBS:-2}" NVTE_FRAMEWORK=pytorch \
        NVTE_PYTORCH_FORCE_BUILD=TRUE \
        CPLUS_INCLUDE_PATH="$include_path${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
        "$venv/bin/python" -m pip wheel --no-build-isolation --no-deps -c "$constraints" \
        --wheel-dir "$wheel_dir" "transformer-engine-torch==$TE_VERSION"
    cached=("$wheel_dir"/transformer_engine_torch-"$TE_VERSION"-*.whl)
    ((${#cached[@]} > 0)) || { log "error: no wheel produced in $wheel_dir"; exit 1; }
else
    log "using cached wheel ${cached[0]}"
fi
pip_install --no-deps "${cached[0]}"

if ! venv_ready; then
    log "error: $venv still cannot import torch + transformer_engine.pytorch; try:"
    log "  $venv/bin/python -c 'import torch, transformer_engine.pytorch'"
    exit 1
fi
install_project
log "ready: $venv"
