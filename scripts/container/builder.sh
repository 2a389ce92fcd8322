# shellcheck shell=bash
# The image builder that scripts/build_image.sh and scripts/container/standin/build.sh drive: docker, podman or
# buildah, whichever is there (docker only with a daemon that answers), or the one BUILDER names.

builder_pick() {  # prints the builder's name; exits naming what is missing
    local name
    if [[ -n "${BUILDER:-}" ]]; then
        case "$BUILDER" in
            docker | podman | buildah) ;;
            *) echo "error: BUILDER=$BUILDER: use docker, podman or buildah" >&2; exit 2 ;;
        esac
        command -v "$BUILDER" >/dev/null || { echo "error: BUILDER=$BUILDER but '$BUILDER' is not installed" >&2; exit 1; }
        if [[ "$BUILDER" == docker ]] && ! docker info >/dev/null 2>&1; then
            echo "error: BUILDER=docker but the Docker daemon does not answer (is it running? are you in the docker group?);" \
                "podman or buildah need no daemon" >&2
            exit 1
        fi
        echo "$BUILDER"
        return 0
    fi
    if command -v docker >/dev/null && docker info >/dev/null 2>&1; then echo docker; return 0; fi
    for name in podman buildah; do
        if command -v "$name" >/dev/null; then echo "$name"; return 0; fi
    done
    echo "error: no image builder: install docker (with its daemon), podman or buildah, or set BUILDER" >&2
    exit 1
}

# builder_build BUILDER BUILD_ARGS...: the build command. podman and buildah write OCI images by default, which
# have no SHELL: the Dockerfile's `SHELL ["/bin/bash", "-o", "pipefail", "-c"]` would be dropped with a warning
# and every RUN step would run in /bin/sh without pipefail. --format docker keeps it, and is the v2 schema 2 that
# Enroot imports. --layers (podman's default) reuses unchanged steps on the next build. --force-rm (podman's
# default, not buildah's): a step that fails leaves no working container, which would keep the image under it
# (a whole base's layers) in the storage until removed by hand.
builder_build() {
    local builder=$1
    shift
    case "$builder" in
        docker) docker build "$@" ;;
        podman) podman build --format docker --layers "$@" ;;
        buildah) buildah bud --format docker --layers --force-rm "$@" ;;
    esac
}

builder_has() {  # builder_has BUILDER IMAGE: whether the builder's storage holds IMAGE
    case "$1" in
        docker) docker image inspect "$2" >/dev/null 2>&1 ;;
        podman) podman image exists "$2" ;;
        buildah) buildah inspect --type image "$2" >/dev/null 2>&1 ;;
    esac
}
