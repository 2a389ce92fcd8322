#!/usr/bin/env bash
# Make an offline kit for an air-gapped GPU node, on a machine with network: the wheels the node lacks
# (Transformer Engine's Python part and its core library pruned to the node's GPU architecture, its torch
# extension's source, torchao, their small needs, datasets), optionally TE's torch extension compiled for
# the node's torch and Python, and MANIFEST.json with the sha256 of every file.
#
#   bash scripts/offline/make_kit.sh DIR --python 3.12 --torch 2.11.0 --arch sm_90 \
#        [--te 2.20.2] [--torchao 0.18.0] [--cuda 13] [--build-te] [--dry-run]
#
# --python / --torch: the node's Python (major.minor) and torch version (its CUDA build is what PyPI serves);
# --arch: the node's GPU (sm_90: H100/H200, sm_100: B200; repeat for several); --cuda: the CUDA major of TE's
# core wheel (transformer_engine_cu12 or _cu13, matching the node's torch); --build-te: also compile TE's torch
# extension here (needs nvcc of that CUDA, CUDA_HOME; takes a while on few cores), else the node compiles it
# (install.py does). DIR must be new or a kit made by this script (never overwrites anything
# else). Then carry DIR to the node and run scripts/offline/install_kit.sh there.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}
usage="usage: make_kit.sh DIR --python 3.12 --torch 2.11.0 --arch sm_90 [--arch ...] [--te V] [--torchao V] [--cuda 12|13] [--build-te] [--dry-run]"
die() { echo "make_kit.sh: $*" >&2; exit 2; }

dir="" python="" torch="" te=2.20.2 torchao=0.18.0 cuda=13 build=0 dry=0
archs=()
while (($#)); do
    case $1 in
        --python|--torch|--arch|--te|--torchao|--cuda)
            (($# >= 2)) || die "$1 needs a value; $usage"
            case $1 in
                --python) python=$2 ;; --torch) torch=$2 ;; --arch) archs+=("$2") ;;
                --te) te=$2 ;; --torchao) torchao=$2 ;; --cuda) cuda=$2 ;;
            esac
            shift 2 ;;
        --build-te) build=1; shift ;;
        --dry-run) dry=1; shift ;;
        -h|--help) echo "$usage"; exit 0 ;;
        -*) die "unknown flag $1; $usage" ;;
        *) [[ -z $dir ]] || die "one DIR only (got $dir and $1); $usage"; dir=$1; shift ;;
    esac
done
[[ -n $dir ]] || die "DIR is missing; $usage"
[[ $python =~ ^3\.[0-9]+$ ]] || die "--python '${python}': expected the node's Python as major.minor, e.g. 3.12"
[[ $torch =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "--torch '${torch}': expected the node's torch version, e.g. 2.11.0"
((${#archs[@]})) || die "--arch is missing: the node's GPU architecture, e.g. sm_90 (H100/H200) or sm_100 (B200)"
for a in ${archs[@]+"${archs[@]}"}; do
    [[ $a =~ ^sm_[0-9]{2,3}a?$ ]] || die "--arch '$a': expected sm_NN as in nvcc, e.g. sm_90 (H100/H200) or sm_100 (B200)"
done
[[ $cuda == 12 || $cuda == 13 ]] || die "--cuda '$cuda': 12 or 13 (the CUDA major of the node's torch)"
for v in "$te" "$torchao"; do [[ $v =~ ^[0-9][0-9A-Za-z.+-]*$ ]] || die "version '$v': expected e.g. 2.20.2"; done
if [[ -e $dir && ! -d $dir ]]; then die "$dir exists and is not a folder"; fi
if [[ -d $dir && -n $(ls -A "$dir") && ! -f $dir/MANIFEST.json ]]; then
    die "$dir is not empty and holds no MANIFEST.json: not a kit made here; give a new folder"
fi

cp_tag="cp${python/./}"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
run() { if ((dry)); then printf '%q ' "$@"; echo; else "$@"; fi; }
download() {
    run "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$python" --implementation cp \
        "${plat[@]}" "$@"
}

((dry)) || mkdir -p "$dir"
# Pure-Python and small wheels the node lacks (its image has torch, triton, transformers, safetensors, pyyaml).
download -d "$dir" "torchao==$torchao" "transformer_engine==$te" pydantic pydantic_core typing_extensions \
    typing_inspection annotated_types importlib_metadata nvidia-cudnn-frontend nvdlfw-inspect datasets dill multiprocess \
    s3torchconnector==1.5.0 s3torchconnectorclient==1.5.0 tenacity  # s3:// checkpoints: the S3 Connector for PyTorch
# TE's torch extension as source: compiled for the node's torch, here (--build-te) or on the node.
run "$py" "$here/kit.py" sdist transformer_engine_torch "$te" "$dir"
# TE's core library: GPU code for every architecture (~280 MB); keep the node's, repack.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
download -d "$work" "transformer_engine_cu${cuda}==$te"
run "$py" -m wheel unpack -d "$work/u" "$work/transformer_engine_cu${cuda}-$te-*.whl"
if ((dry)); then
    echo "$py $here/kit.py prune $work/u/.../libtransformer_engine.so ${archs[*]+${archs[*]}}"
else
    lib=$(find "$work/u" -name 'libtransformer_engine.so*' -type f | head -1)
    [[ -n $lib ]] || die "transformer_engine_cu${cuda}==$te holds no libtransformer_engine.so"
    "$py" "$here/kit.py" prune "$lib" ${archs[@]+"${archs[@]}"}
    "$py" -m wheel pack -d "$dir" "$work"/u/transformer_engine_cu"${cuda}"-*
fi
if ((build)); then
    run bash "$here/build_te_torch.sh" "$dir" "$python" "$torch" "$cuda"
fi
run "$py" "$here/kit.py" manifest "$dir" --python "$python" --torch "$torch" --arch "$(IFS=,; echo "${archs[*]+${archs[*]}}")" --te "$te" \
    --torchao "$torchao"
((dry)) || { ls -l "$dir"; du -sh "$dir"; }
echo "make_kit.sh: kit for $cp_tag, torch $torch, ${archs[*]+${archs[*]}} in $dir"
