#!/usr/bin/env bash
# Compile Transformer Engine's torch extension (transformer_engine_torch) from the kit's sdist against the
# node's torch and Python, on a connected machine of the node's CPU type, into KIT/built/ with a build record, so
# that the node installs it instead of compiling (install.py takes a wheel whose record names its exact torch).
#   bash scripts/offline/build_te_torch.sh KIT PYTHON_EXE TORCH_VERSION CUDA_HOME
# build_kit.py (make_kit.sh --build-te) finds PYTHON_EXE (a Python of the node's major.minor) and CUDA_HOME (the
# toolkit of nvcc, as te_wheel.find_cuda_home does). Downloads torch and its CUDA libraries (their headers: cuDNN,
# NCCL) into a throw-away virtual environment: several GB. MAX_JOBS: compile jobs (default 4).
set -euo pipefail
kit=$1 pybin=$2 torch=$3 cuda_home=$4
die() { echo "build_te_torch.sh: $*" >&2; exit 2; }
[[ -x $cuda_home/bin/nvcc ]] || die "$cuda_home/bin/nvcc: not a CUDA toolkit"
sdist=$(find "$kit" -maxdepth 1 -name 'transformer_engine_torch-*.tar.gz' | head -1)
[[ -n $sdist ]] || die "$kit holds no transformer_engine_torch sdist (make the kit first)"
mapfile -t core < <(find "$kit" -maxdepth 1 \( -name 'transformer_engine_cu*.whl' -o -name 'transformer_engine-[0-9]*.whl' \))
((${#core[@]} == 2)) || die "$kit holds no Transformer Engine wheels (its Python part and core)"
venv=$(mktemp -d)
trap 'rm -rf "$venv"' EXIT
"$pybin" -m venv "$venv/env"
env_py=$venv/env/bin/python
"$env_py" -m pip install -q "torch==$torch" "setuptools<82" wheel ninja packaging numpy pydantic einops onnxscript \
    nvidia-cudnn-frontend
"$env_py" -m pip install -q --no-deps ${core[@]+"${core[@]}"}
site=$("$env_py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
includes=$(find "$site/nvidia" -maxdepth 3 -type d -name include | paste -sd:)
out=$venv/wheel
env NVTE_FRAMEWORK=pytorch NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-4}" CUDA_HOME="$cuda_home" \
    PATH="$cuda_home/bin:$PATH" CPLUS_INCLUDE_PATH="$cuda_home/include:$includes${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}" \
    "$env_py" -m pip wheel -q --no-build-isolation --no-deps --wheel-dir "$out" "$sdist"
torch_version=$("$env_py" -c 'import torch; print(torch.__version__)')
py_tag=$("$env_py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
te_version=$(basename "$sdist" .tar.gz); te_version=${te_version#transformer_engine_torch-}
key=$(printf 'te%s-torch%s-%s' "$te_version" "$torch_version" "$py_tag" | tr -c 'A-Za-z0-9._\n-' _)
dest=$kit/built/$key
mkdir -p "$dest"
for whl in "$out"/*.whl; do
    cp "$whl" "$dest/"
    "$env_py" - "$dest/$(basename "$whl")" "$te_version" "$torch_version" "$py_tag" <<'PY'
import hashlib, json, sys
wheel, te, torch, py = sys.argv[1:]
record = {"te_version": te, "torch": torch, "python": py,
          "sha256": hashlib.sha256(open(wheel, "rb").read()).hexdigest(), "built_by": "build_te_torch.sh"}
open(wheel[: -len(".whl")] + ".build.json", "w").write(json.dumps(record, indent=1) + "\n")
PY
done
ls -l "$dest"
