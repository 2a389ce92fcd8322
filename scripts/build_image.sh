#!/bin/bash
# Build the training image and import it for Enroot/Pyxis:
#   scripts/build_image.sh                         # -> ./llama-fp8.sqsh
#   TAG=llama-fp8:25.12 OUT=/fsx/images/llama-fp8.sqsh scripts/build_image.sh --build-arg NGC_TAG=25.12-py3
# Extra arguments go to `docker build`. Put OUT on a file system every node can read.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TAG=${TAG:-llama-fp8:latest}
OUT=$(realpath -m "${OUT:-llama-fp8.sqsh}")

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

docker build -f "$REPO_DIR/0.transformer-engine.dockerfile" -t "$TAG" "$@" "$REPO_DIR"
rm -f "$OUT"  # enroot import refuses to overwrite
enroot import -o "$OUT" "dockerd://$TAG"

cat <<EOF
image: $OUT
next:  mkdir -p logs && IMAGE=$OUT sbatch 1.train_llama.sbatch --model llama3.1-8b --fp8=1
EOF
