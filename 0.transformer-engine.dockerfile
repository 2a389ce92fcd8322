# Training image: NGC PyTorch (PyTorch, Transformer Engine, NCCL, cuDNN built together by NVIDIA)
# + AWS EFA (libfabric and the aws-ofi-nccl NCCL plugin) + this package.
# Build and import for Enroot/Pyxis with scripts/build_image.sh: it sends docker exactly the files listed by
# `scripts/build_image.sh --print-context` (no symlinks, no .venv, no old .sqsh).
#
# Choosing versions (docs/cluster.md: Image versions; the table lives in src/llama_fp8/cluster/ngc.py):
#   NGC_TAG  an nvcr.io/nvidia/pytorch tag (YY.MM-py3); its release notes list PyTorch, Transformer Engine,
#            NCCL, CUDA and the host driver it needs. The build prints the real versions and fails when the
#            image cannot run our defaults (llama_fp8.cluster.ngc check-image).
#   EFA_INSTALLER_VERSION  the AWS EFA installer whose aws-ofi-nccl release names that NCCL
#            (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-changelog.html).
#   --platform linux/amd64 | linux/arm64 (scripts/build_image.sh PLATFORM=...): NGC publishes the PyTorch image for
#            both (which tags have an arm64 image: ngc.py's table); GB200/GB300 hosts are Grace, aarch64. The builder
#            sets TARGETARCH, the EFA step installs the installer's packages for that CPU, and check-image fails
#            when the image is not of the platform asked for. An arm64 build needs an arm64 host or binfmt emulation.
#   STANDIN_BASE  tests only, never set it for a real image: the name of the stand-in for the NGC base that
#            scripts/container/standin/build.sh makes on a machine that cannot pull NGC's (Python, CPU torch, the
#            files the steps below check). The build stops when it names any other image.
ARG NGC_TAG=26.09-py3
ARG STANDIN_BASE=
FROM ${STANDIN_BASE:-nvcr.io/nvidia/pytorch:${NGC_TAG}}

ARG NGC_TAG
ARG STANDIN_BASE
# amd64 or arm64: set by BuildKit, podman and buildah from --platform (empty with docker's legacy builder)
ARG TARGETARCH
ARG EFA_INSTALLER_VERSION=1.50.0
ARG EFA_INSTALLER_SHA256=
ARG EFA_INSTALLER_ARGS=
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# EFA + aws-ofi-nccl (skipped when the base has both), then links at fixed paths to wherever the plugin landed:
# the installer's layout changed across versions and NGC bases (scripts/image/nccl_net_plugin.sh lists them).
# What this step did stays in the image (/opt/llama-fp8/efa.log): a cached rebuild does not print it again.
COPY scripts/image/ /opt/llama-fp8/scripts/
RUN { if [ -n "${STANDIN_BASE}" ]; then \
        [ -f /etc/llama-fp8/standin-base ] || { echo "error: STANDIN_BASE=${STANDIN_BASE} is not the tests' stand-in" \
            "for the NGC base (scripts/container/standin/build.sh): leave STANDIN_BASE unset" >&2; exit 1; }; \
        echo "base: ${STANDIN_BASE}, the tests' stand-in for NGC ${NGC_TAG}: $(cat /etc/llama-fp8/standin-base)"; \
    fi && \
    EFA_INSTALLER_VERSION="${EFA_INSTALLER_VERSION}" EFA_INSTALLER_SHA256="${EFA_INSTALLER_SHA256}" \
        EFA_INSTALLER_ARGS="${EFA_INSTALLER_ARGS}" /opt/llama-fp8/scripts/install_efa.sh && \
    /opt/llama-fp8/scripts/setup_nccl_plugin.sh /; } 2>&1 | tee /opt/llama-fp8/efa.log

# NCCL loads exactly this plugin file: NCCL_NET_PLUGIN as a full path (NCCL >= 2.21.5 takes a path; the NGC
# base may set NCCL_NET_PLUGIN to another plugin, e.g. HPC-X's, and the NGC plugin packages ship no
# libnccl-net.so for the default lookup). The tuner is named too although NCCL >= 2.21 finds it in the net
# plugin: aws-ofi-nccl <= 1.15 ships it as a separate library, NCCL 2.19-2.20 only loads a named tuner, and a
# base image's own NCCL_TUNER_PLUGIN must not win. Its folder and libfabric's come first on the library path.
# NCCL_NET (fail instead of falling back to TCP) is set per node by 1.train_llama.sbatch, only where EFA
# devices exist, like FI_PROVIDER and NCCL_SOCKET_IFNAME.
ENV NCCL_NET_PLUGIN=/opt/llama-fp8/nccl/libnccl-net-ofi.so \
    NCCL_TUNER_PLUGIN=/opt/llama-fp8/nccl/libnccl-tuner-ofi.so \
    LD_LIBRARY_PATH=/opt/llama-fp8/nccl/lib:/opt/amazon/efa/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}} \
    PATH=/opt/amazon/efa/bin:${PATH}

WORKDIR /workspace/llama-fp8
# 1) the dependencies NGC does not ship, under NGC's constraint file (it pins torch, TE and their dependencies),
#    before the code: a rebuild after a code change reuses this layer instead of installing them again (pytest:
#    the GPU self-test, scripts/gpu_selftest.sbatch, runs the repository's tests in the image);
# 2) the package alone: --no-deps, so its `torch` requirement can never pull another torch build;
# 3) proof that torch and Transformer Engine are still the ones NGC built (before 1 and after 2), that the
#    presets were installed, and the image's own record of its versions (read by every run's metrics.jsonl
#    meta record).
RUN python -c "import importlib.metadata as m; print(m.version('torch'), m.version('transformer_engine'))" \
        >/opt/llama-fp8/base-versions && \
    pip install --no-cache-dir --constraint /etc/pip/constraint.txt \
        "transformers>=4.57" "datasets>=3.0" "tokenizers>=0.20" "safetensors>=0.4" "pyyaml>=6.0" \
        "torchao>=0.12" "submitit>=1.5" "matplotlib>=3.7" "tensorboard>=2.14" "pytest>=7.0"
# Real files only: the repository's `configs` is a symlink into src/ (the presets are package data), so it is
# recreated here as the same relative link instead of being copied.
COPY pyproject.toml README.md ./
# s3:// checkpoints (docs/checkpoints.md): the Amazon S3 Connector for PyTorch with its DCP extra, under NGC's
# constraint (its torch requirement is met by NGC's torch; the check below proves torch unchanged).
RUN pip install --no-cache-dir --constraint /etc/pip/constraint.txt "s3torchconnector[dcp]>=1.5"
COPY src ./src
COPY 1.train_llama.sbatch 2.ab_fp8_vs_bf16.sh ./
RUN ln -s src/llama_fp8/configs configs && \
    pip install --no-cache-dir --no-deps . && \
    before="$(cat /opt/llama-fp8/base-versions)" && \
    after="$(python -c "import importlib.metadata as m; print(m.version('torch'), m.version('transformer_engine'))")" && \
    if [ "$before" != "$after" ]; then echo "error: torch/TE changed: $before -> $after" >&2; exit 1; fi && \
    python -c "import llama_fp8.config as c; assert 'llama3.1-8b' in c.available_presets(), c.available_presets()" && \
    python -m llama_fp8.cluster.ngc check-image --tag "${NGC_TAG}" --efa "${EFA_INSTALLER_VERSION}" \
        --plugin-env /opt/llama-fp8/nccl/plugin.env --out /opt/llama-fp8/image.json ${TARGETARCH:+--platform "${TARGETARCH}"}
