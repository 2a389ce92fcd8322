# What tests/cluster/test_container_build.py builds with scripts/build_image.sh (DOCKERFILE=...) along each path
# to Enroot: small, but it checks what the path must keep.
ARG BASE
FROM ${BASE}
# The builder must keep the Dockerfile's SHELL (an OCI image has none: podman and buildah then drop it and RUN in
# /bin/sh without pipefail): with pipefail the left side's failure fails the pipe.
SHELL ["/bin/sh", "-o", "pipefail", "-c"]
# hadolint ignore=DL4006
RUN if false | true; then echo dropped; else echo kept; fi >/shell
COPY pyproject.toml /llama-fp8/pyproject.toml
WORKDIR /llama-fp8
ENV LLAMA_FP8_ROUTE=1
