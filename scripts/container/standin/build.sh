#!/bin/bash
# Build the stand-in for the NGC PyTorch base (standin.dockerfile) with the image builder and print its name as
# the last line; when the builder already holds it, only print the name.
#   scripts/container/standin/build.sh                    # -> localhost/llama-fp8-standin:<key>
#   BUILDER=buildah PYTHON=.venv/bin/python scripts/container/standin/build.sh
# Then: STANDIN=$(scripts/container/standin/build.sh | tail -n 1)
#       scripts/build_image.sh --build-arg STANDIN_BASE="$STANDIN"
# Needs root (debootstrap), a C compiler (the stand-in OFI library) and network access to the Debian mirror and
# the package index that PYTHON's pip uses. PYTHON (default: the repository's .venv) gives the torch version
# (its own: a CPU build), the wheels and the Transformer Engine version of the default NGC tag
# (llama_fp8.cluster.ngc). The key in the name covers everything the image is made of, so a changed recipe
# builds a new one.
# Environment: BUILDER, PYTHON, DEBIAN_MIRROR (default http://deb.debian.org/debian), STANDIN_CACHE (the root
# file system and the wheels, reused across builds; default <LLAMA_FP8_CONTAINER_CACHE or
# ~/.cache/llama-fp8/container>/standin).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$HERE/../../.." && pwd)
# shellcheck source=scripts/container/builder.sh
source "$HERE/../builder.sh"
builder=$(builder_pick)
PY=${PYTHON:-$REPO_DIR/.venv/bin/python}
CACHE=${STANDIN_CACHE:-${LLAMA_FP8_CONTAINER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/llama-fp8/container}/standin}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm  # its python3 is 3.11: the wheels below are for that
PYVER=3.11
PACKAGES=python3,python3-pip,python-is-python3,ca-certificates,libfabric1
CA=/etc/ssl/certs/ca-certificates.crt

[[ -x "$PY" ]] || { echo "error: PYTHON=$PY is not a python (run make install, or set PYTHON)" >&2; exit 1; }
[[ -f "$CA" ]] || { echo "error: no $CA on this machine (the stand-in takes its CA certificates)" >&2; exit 1; }
torch=$("$PY" -c 'import torch; print(torch.__version__)')
te=$(PYTHONPATH="$REPO_DIR/src" "$PY" -c \
    'from llama_fp8.cluster import ngc; print(ngc.release(ngc.DEFAULT_TAG).transformer_engine.value)')
key=$( {
    sha256sum "$HERE/standin.dockerfile" "$CA" | cut -d' ' -f1
    echo "$SUITE $PACKAGES torch=$torch te=$te"
} | sha256sum | cut -c1-16)
name=localhost/llama-fp8-standin:$key
if builder_has "$builder" "$name"; then
    echo "stand-in base: $name (already built)"
    echo "$name"
    exit 0
fi
mkdir -p "$CACHE"
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT

# The root file system: Debian's minimal base with Python, cached by its package list (debootstrap: ~1 min).
rootfs="$CACHE/rootfs-$SUITE-$(echo "$PACKAGES" | sha256sum | cut -c1-12).tar"
if [[ ! -f "$rootfs" ]]; then
    echo "stand-in base: debootstrap $SUITE ($PACKAGES) from $MIRROR"
    debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ctx/root" "$MIRROR" >"$ctx/debootstrap.log" 2>&1 ||
        { tail -n 20 "$ctx/debootstrap.log" >&2; echo "error: debootstrap failed (log above)" >&2; exit 1; }
    rm -rf "$ctx/root/usr/share/doc" "$ctx/root/usr/share/man" "$ctx/root/usr/share/locale" \
        "$ctx/root/var/cache/apt/"*.bin "$ctx/root/var/cache/apt/archives/"*.deb "$ctx/root/var/lib/apt/lists/"*
    tar -C "$ctx/root" --numeric-owner -cf "$rootfs.tmp" .
    mv "$rootfs.tmp" "$rootfs"
    rm -rf "$ctx/root"
fi
ln "$rootfs" "$ctx/rootfs.tar" 2>/dev/null || cp "$rootfs" "$ctx/rootfs.tar"
cp "$CA" "$ctx/ca-certificates.crt"

# torch as installed here (the CPU build) and numpy, for the stand-in's Python; cached by torch version.
wheels="$CACHE/wheels-$torch-cp${PYVER/./}"
if [[ ! -f "$wheels/requirements.txt" ]]; then
    rm -rf "$wheels"
    "$PY" -m pip download -q --only-binary=:all: --python-version "$PYVER" --platform "manylinux_2_28_$(uname -m)" \
        -d "$wheels.tmp" "torch==$torch" numpy
    numpy=$(find "$wheels.tmp" -name 'numpy-*.whl' -printf '%f\n' | cut -d- -f2)
    printf 'torch==%s\nnumpy==%s\n' "$torch" "$numpy" >"$wheels.tmp/requirements.txt"
    mv "$wheels.tmp" "$wheels"
fi
mkdir "$ctx/wheels"
ln "$wheels"/* "$ctx/wheels/" 2>/dev/null || cp "$wheels"/* "$ctx/wheels/"

# A shared library where aws-ofi-nccl's would be: it only has to exist and load (nothing here loads NCCL).
echo 'const char llama_fp8_standin_ofi_plugin[] = "stand-in: no NCCL on this image";' |
    cc -shared -fPIC -x c -o "$ctx/libnccl-net-ofi.so" -

echo "stand-in base: building $name (torch $torch, Transformer Engine record $te) with $builder"
builder_build "$builder" -f "$HERE/standin.dockerfile" --build-arg TE_VERSION="$te" -t "$name" "$ctx"
echo "$name"
