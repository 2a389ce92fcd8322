#!/bin/bash
# Build the training image and import it for Enroot/Pyxis:
#   scripts/build_image.sh                         # -> ./llama-fp8.sqsh (+ llama-fp8.sqsh.sha256)
#   TAG=llama-fp8:26.09 OUT=/fsx/images/llama-fp8.sqsh scripts/build_image.sh --build-arg NGC_TAG=26.09-py3
#   scripts/build_image.sh --print-context         # the files docker would get, one per line (no docker needed)
#   scripts/build_image.sh --context-tar ctx.tar   # write that build context as a tar and stop
# Extra arguments go to `docker build`. Put OUT on a file system every node can read.
#
# The build context is an explicit list of regular files, streamed as a tar (`docker build -`): never the
# repository folder itself, which holds .venv, runs/, old .sqsh images (gigabytes sent to the daemon on every
# build) and the `configs` symlink, whose COPY behaviour differs between builders. Symlinked files are
# dereferenced (tar --dereference), so the image gets their content.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DOCKERFILE=0.transformer-engine.dockerfile
TAG=${TAG:-llama-fp8:latest}
OUT=$(realpath -m "${OUT:-llama-fp8.sqsh}")
# What the Dockerfile COPYs (tests/cluster/test_image.py checks that every COPY source is here).
CONTEXT=("$DOCKERFILE" pyproject.toml README.md 1.train_llama.sbatch 2.ab_fp8_vs_bf16.sh src scripts/image)

context_files() {  # the files of CONTEXT, relative to REPO_DIR, without caches and build leftovers
    (cd "$REPO_DIR" && find "${CONTEXT[@]}" \( -name __pycache__ -o -name '*.egg-info' \) -prune \
        -o \( -type f -o -type l \) ! -name '*.pyc' -print | LC_ALL=C sort)
}
context_tar() {  # context_tar FILE|-: the build context as a tar of regular files
    context_files | tar -C "$REPO_DIR" --dereference --no-recursion -cf "$1" -T -
}

case "${1:-}" in
    --print-context) context_files; exit 0 ;;
    --context-tar) [[ $# -eq 2 ]] || { echo "usage: $0 --context-tar FILE" >&2; exit 2; }
                   context_tar "$2"; exit 0 ;;
esac

need() {  # need COMMAND HINT: exit with a clear message when COMMAND is missing
    if ! command -v "$1" >/dev/null; then
        echo "error: '$1' not found. $2" >&2
        exit 1
    fi
}
need docker "Install Docker (or run this on a machine that has it, e.g. the head node)."
need enroot "Install Enroot: https://github.com/NVIDIA/enroot (it ships with AWS ParallelCluster/HyperPod Slurm AMIs)."
if ! docker info >/dev/null 2>&1; then
    echo "error: cannot talk to the Docker daemon (is it running? are you in the docker group?)" >&2
    exit 1
fi

context_tar - | docker build -f "$DOCKERFILE" -t "$TAG" "$@" -
rm -f "$OUT" "$OUT.sha256"  # enroot import refuses to overwrite
enroot import -o "$OUT" "dockerd://$TAG"
# The digest, once, next to the image: every run records it (metrics.jsonl meta -> the A/B report).
(cd "$(dirname "$OUT")" && sha256sum "$(basename "$OUT")" >"$OUT.sha256")

cat <<EOF
image: $OUT (sha256 $(cut -d' ' -f1 "$OUT.sha256"))
next:  mkdir -p logs && IMAGE=$OUT sbatch 1.train_llama.sbatch --model llama3.1-8b --fp8=1
EOF
