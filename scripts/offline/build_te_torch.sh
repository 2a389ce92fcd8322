#!/usr/bin/env bash
# Compile Transformer Engine's torch extension (transformer_engine_torch) from the kit's sdist against the
# node's torch and Python, on a connected machine, into KIT/built/ with a build record, so that the node
# installs it instead of compiling (install.py takes a wheel whose record names its exact torch).
#   bash scripts/offline/build_te_torch.sh KIT PYTHON_VERSION TORCH_VERSION CUDA_MAJOR
# Needs: pythonX.Y on PATH (or PYTHON_BIN), CUDA_HOME with nvcc of that CUDA major; downloads torch and its
# CUDA libraries (their headers: cuDNN, NCCL) into a throw-away virtual environment. MAX_JOBS: compile jobs.
set -euo pipefail
kit=$1 python=$2 torch=$3 cuda=$4
die() { echo "build_te_torch.sh: $*" >&2; exit 2; }
pybin=${PYTHON_BIN:-$(command -v "python$python" || true)}
[[ -n $pybin ]] || die "python$python not found on PATH: install it or set PYTHON_BIN"
[[ -n ${CUDA_HOME:-} && -x $CUDA_HOME/bin/nvcc ]] || die "CUDA_HOME must point at a CUDA $cuda toolkit (bin/nvcc)"
sdist=$(find "$kit" -maxdepth 1 -name 'transformer_engine_torch-*.tar.gz' | head -1)
[[ -n $sdist ]] || die "$kit holds no transformer_engine_torch sdist (make the kit first)"
core=$(find "$kit" -maxdepth 1 \( -name "transformer_engine_cu$cuda-*.whl" -o -name 'transformer_engine-[0-9]*.whl' \))
[[ -n $core ]] || die "$kit holds no Transformer Engine wheels for CUDA $cuda"
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
"$pybin" -m venv "$venv/env"
env_py=$venv/env/bin/python
"$env_py" -m pip install -q "torch==$torch" "setuptools<82" wheel ninja packaging numpy
# shellcheck disable=SC2086  # core: the kit's TE wheels, one word each
"$env_py" -m pip install -q --no-deps $core
site=$("$env_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
includes=$(find "$site/nvidia" -maxdepth 3 -type d -name include | paste -sd:)
out=$venv/wheel
env NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-4}" \
    CPLUS_INCLUDE_PATH="$includes${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    "$env_py" -m pip wheel -q --no-build-isolation --no-deps --wheel-dir "$out" "$sdist"
torch_version=$("$env_py" -c 'import torch; print(torch.__version__)')
te_version=$(basename "$sdist" .tar.gz); te_version=${te_version#transformer_engine_torch-}
key=$(printf 'te%s-torch%s-cp%s' "$te_version" "$torch_version" "${python/./}" | tr -c 'A-Za-z0-9._\n-' _)
dest=$kit/built/$key
mkdir -p "$dest"
for whl in "$out"/*.whl; do
    cp "$whl" "$dest/"
    "$env_py" - "$dest/$(basename "$whl")" "$te_version" "$torch_version" "cp${python/./}" <<'PY'
import hashlib, json, sys
wheel, te, torch, py = sys.argv[1:]
record = {"te_version": te, "torch": torch, "python": py,
          "sha256": hashlib.sha256(open(wheel, "rb").read()).hexdigest(), "built_by": "build_te_torch.sh"}
open(wheel[: -len(".whl")] + ".build.json", "w").write(json.dumps(record, indent=1) + "\n")
PY
done
ls -l "$dest"
