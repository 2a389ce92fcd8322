#!/bin/bash
# Build the training image and import it for Enroot/Pyxis, with docker, podman or buildah (no daemon needed):
#   scripts/build_image.sh                         # -> ./llama-fp8.sqsh (+ llama-fp8.sqsh.sha256)
#   BUILDER=podman scripts/build_image.sh          # the builder: docker when its daemon answers, else podman,
#                                                  # else buildah, unless BUILDER names one
#   REGISTRY=registry.example.com:5000 scripts/build_image.sh   # push there, import from there
#   TAG=llama-fp8:26.09 OUT=/fsx/images/llama-fp8.sqsh scripts/build_image.sh --build-arg NGC_TAG=26.09-py3
#   PLATFORM=linux/arm64 scripts/build_image.sh    # GB200/GB300 (Grace): an arm64 image, imported as aarch64; on an
#                                                  # arm64 host, or an x86 one with binfmt emulation (qemu-user)
#   scripts/build_image.sh --print-context         # the files the builder would get, one per line (no builder needed)
#   PLATFORM=linux/arm64 scripts/build_image.sh --print-plan   # the build and import commands, run nothing
#   scripts/build_image.sh --context-tar ctx.tar   # write that build context as a tar and stop
# DOCKERFILE: another Dockerfile of the repository (a relative path), built with the same context and imported
# the same way. Extra arguments go to the builder's build command (e.g. --isolation chroot for buildah/podman where RUN steps
# fail under crun: docs/container.md). Put OUT on a file system every node can read.
#
# How the image reaches Enroot (`enroot import`, docs/container.md):
#   docker   dockerd://TAG: from the Docker daemon's images
#   podman   podman://TAG: from podman's image storage
#   buildah  an image archive: pushed (Docker v2 schema 2, uncompressed) into a temporary folder, served read-only
#            on 127.0.0.1 by scripts/container/serve_image.py for docker://127.0.0.1:PORT#TAG, then deleted
#   REGISTRY=HOST[:PORT] (any builder): pushed there, imported from docker://HOST[:PORT]#NAME:TAG;
#            http://HOST[:PORT] for a registry without TLS (e.g. one on this host). PUSH_ARGS: extra arguments for
#            the push (e.g. --creds, or --disable-compression for a registry on this host).
#
# The build context is an explicit list of regular files: never the repository folder itself, which holds .venv,
# runs/, old .sqsh images (gigabytes sent to the builder on every build) and the `configs` symlink, whose COPY
# behaviour differs between builders. Symlinked files are dereferenced (tar --dereference): the image gets their
# content.
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DOCKERFILE=${DOCKERFILE:-0.transformer-engine.dockerfile}
[[ "$DOCKERFILE" != /* && "$DOCKERFILE" != *..* && -f "$REPO_DIR/$DOCKERFILE" ]] || {
    echo "error: DOCKERFILE=$DOCKERFILE: a Dockerfile inside the repository, relative to it" >&2
    exit 2
}
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

# The image's platform: the builder gets --platform, enroot imports that CPU's image (--arch: else it takes the host's
# from a multi-arch source), and a host that can run neither natively nor under emulation stops here, not mid-build.
PLATFORM=${PLATFORM:-}
platform_args=() arch_args=()
if [[ -n "$PLATFORM" ]]; then
    case "$PLATFORM" in
        linux/amd64) want=x86_64 ;;
        linux/arm64) want=aarch64 ;;
        *) echo "error: PLATFORM=$PLATFORM: use linux/amd64 or linux/arm64 (GB200/GB300)" >&2; exit 2 ;;
    esac
    platform_args=(--platform "$PLATFORM")
    arch_args=(--arch "$want")
    binfmt=${BINFMT_DIR:-/proc/sys/fs/binfmt_misc}
    if [[ "$(uname -m)" != "$want" ]] && ! compgen -G "$binfmt/qemu-$want*" >/dev/null; then
        echo "error: PLATFORM=$PLATFORM on this $(uname -m) host: no $want emulation ($binfmt/qemu-$want not" \
            "registered). Build on an $want host (e.g. a Graviton instance), or register qemu-user-static binfmt" \
            "handlers first" >&2
        exit 2
    fi
fi
if [[ "${1:-}" == --print-plan ]]; then  # what would run, with the platform in every step; nothing is built
    shift
    echo "build: $DOCKERFILE -t $TAG ${platform_args[*]+${platform_args[*]}} $*"
    echo "import: enroot import ${arch_args[*]+${arch_args[*]}} -o $OUT"
    exit 0
fi

# shellcheck source=scripts/container/builder.sh
source "$REPO_DIR/scripts/container/builder.sh"
command -v enroot >/dev/null || {
    echo "error: 'enroot' not found. Install Enroot: https://github.com/NVIDIA/enroot (it ships with AWS" \
        "ParallelCluster/HyperPod Slurm AMIs)." >&2
    exit 1
}
builder=$(builder_pick)
registry=${REGISTRY:-}
insecure=""
if [[ "$registry" == http://* ]]; then insecure=1; registry=${registry#http://}; fi
registry=${registry#https://}
registry=${registry%/}
read -r -a push_args <<<"${PUSH_ARGS:-}"
name=${TAG%:*}
[[ "$name" != "$TAG" && "${TAG##*:}" != */* ]] || { echo "error: TAG=$TAG: give a name and a tag, e.g. llama-fp8:latest" >&2; exit 2; }
tag=${TAG##*:}
name=${name##*/}  # the repository name without a registry host: llama-fp8

work=$(mktemp -d)
server=""
cleanup() {
    if [[ -n "$server" ]]; then kill "$server" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

echo "build: $TAG from $DOCKERFILE with $builder${PLATFORM:+ for $PLATFORM}"
if [[ "$builder" == docker ]]; then
    context_tar - | docker build ${platform_args[@]+"${platform_args[@]}"} -f "$DOCKERFILE" -t "$TAG" "$@" -
else
    mkdir "$work/context"
    context_tar - | tar -C "$work/context" -xf -
    builder_build "$builder" ${platform_args[@]+"${platform_args[@]}"} -f "$work/context/$DOCKERFILE" -t "$TAG" "$@" \
        "$work/context"
fi

rm -f "$OUT" "$OUT.sha256"  # enroot import refuses to overwrite
enroot_import() {  # enroot_import URI [VAR=VALUE...]: the image at URI into $OUT
    echo "import: $1 -> $OUT${PLATFORM:+ ($PLATFORM)}"
    env "${@:2}" enroot import ${arch_args[@]+"${arch_args[@]}"} -o "$OUT" "$1"
}
if [[ -n "$registry" ]]; then
    remote="$registry/$name:$tag"
    echo "push: $TAG -> $remote"
    if [[ "$builder" == docker ]]; then
        docker tag "$TAG" "$remote"
        docker push ${push_args[@]+"${push_args[@]}"} "$remote"
    else
        "$builder" push --format v2s2 ${insecure:+--tls-verify=false} ${push_args[@]+"${push_args[@]}"} \
            "$TAG" "docker://$remote"
    fi
    enroot_import "docker://$registry#$name:$tag" ${insecure:+ENROOT_ALLOW_HTTP=yes}
elif [[ "$builder" == docker ]]; then
    enroot_import "dockerd://$TAG"
elif [[ "$builder" == podman ]]; then
    # Enroot's podman:// import removes its temporary container with `docker rm` (its exit trap, whatever the
    # engine): without a Docker daemon that fails, the import exits 1 after writing the image and the container
    # stays. A `docker` that is podman, for this one command, lets the trap do its work.
    mkdir "$work/bin"
    printf '#!/bin/sh\nexec podman "$@"\n' >"$work/bin/docker"
    chmod +x "$work/bin/docker"
    enroot_import "podman://$TAG" PATH="$work/bin:$PATH"
else
    echo "archive: $TAG -> $work/image (uncompressed: it never leaves this host)"
    buildah push --format v2s2 --disable-compression ${push_args[@]+"${push_args[@]}"} "$TAG" "dir:$work/image"
    python3 "$REPO_DIR/scripts/container/serve_image.py" "$work/image" "$name:$tag" >"$work/port" &
    server=$!
    for _ in $(seq 100); do
        [[ -s "$work/port" ]] && break
        kill -0 "$server" 2>/dev/null || { echo "error: serve_image.py stopped (message above)" >&2; exit 1; }
        sleep 0.1
    done
    [[ -s "$work/port" ]] || { echo "error: serve_image.py did not start within 10 s" >&2; exit 1; }
    enroot_import "docker://127.0.0.1:$(cat "$work/port")#$name:$tag" ENROOT_ALLOW_HTTP=yes
fi
# The digest, once, next to the image: every run records it (metrics.jsonl meta -> the A/B report).
(cd "$(dirname "$OUT")" && sha256sum "$(basename "$OUT")" >"$OUT.sha256")

cat <<EOF
image: $OUT (sha256 $(cut -d' ' -f1 "$OUT.sha256"))
next:  mkdir -p logs && IMAGE=$OUT sbatch 1.train_llama.sbatch --model llama3.1-8b --fp8=1
EOF
