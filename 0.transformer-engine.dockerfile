# Training image: NGC PyTorch (PyTorch, Transformer Engine, NCCL, cuDNN built together by NVIDIA)
# + AWS EFA (libfabric and the aws-ofi-nccl NCCL plugin) + this package.
# Build and import for Enroot/Pyxis: scripts/build_image.sh (docker build, then enroot import).
#
# Choosing versions:
#   NGC_TAG  an nvcr.io/nvidia/pytorch tag (YY.MM-py3). Its release notes list the PyTorch, Transformer
#            Engine, NCCL and CUDA versions, and the minimum host driver: pick one your nodes' driver supports.
#            Tags >= 25.03 ship /etc/pip/constraint.txt, used below so pip never replaces NGC's torch.
#   EFA_INSTALLER_VERSION  https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-changelog.html ;
#            the installer brings libfabric and aws-ofi-nccl (/opt/amazon/ofi-nccl). Match the host's
#            EFA driver generation (newer userspace on an older kernel module is generally fine).
ARG NGC_TAG=25.12-py3
FROM nvcr.io/nvidia/pytorch:${NGC_TAG}

ARG EFA_INSTALLER_VERSION=1.48.0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# EFA userspace + aws-ofi-nccl, only if the base image does not have them already.
#   --skip-kmod: the kernel module belongs to the host   --skip-limit-conf: ulimits come from the runtime
#   --no-verify: no GPG check inside the build (the version is pinned instead)
# hadolint ignore=DL3003,DL3008
RUN if [ -e /opt/amazon/efa/lib/libfabric.so ] && compgen -G "/opt/amazon/ofi-nccl/lib/libnccl-net*.so" >/dev/null; then \
        echo "EFA and aws-ofi-nccl: already in the base image"; \
    else \
        apt-get update && \
        curl -fsSL "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" | tar -xz -C /tmp && \
        cd /tmp/aws-efa-installer && \
        ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify && \
        cd / && rm -rf /tmp/aws-efa-installer /var/lib/apt/lists/*; \
    fi && \
    if ! compgen -G "/opt/amazon/ofi-nccl/lib/libnccl-net*.so" >/dev/null; then \
        echo "error: no aws-ofi-nccl plugin in /opt/amazon/ofi-nccl/lib (EFA installer ${EFA_INSTALLER_VERSION} too old?)" >&2; \
        exit 1; \
    fi

# NCCL finds the OFI plugin on the library path; on hosts without EFA it falls back to its own transports.
# Per-cluster settings (FI_PROVIDER, NCCL_SOCKET_IFNAME, NCCL_DEBUG) are set by 1.train_llama.sbatch.
ENV PATH=/opt/amazon/efa/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH}

WORKDIR /workspace/llama-fp8
COPY pyproject.toml README.md ./
COPY src ./src
COPY configs ./configs
COPY 1.train_llama.sbatch 2.ab_fp8_vs_bf16.sh ./

# 1) the package alone: --no-deps, so its `torch` requirement can never pull another torch build;
# 2) the dependencies NGC does not ship, under NGC's constraint file (pins torch, TE and their deps);
# 3) proof that torch and Transformer Engine are still the ones NGC built.
RUN versions() { python -c "import importlib.metadata as m; print(m.version('torch'), m.version('transformer_engine'))"; } && \
    before="$(versions)" && \
    pip install --no-cache-dir --no-deps . && \
    pip install --no-cache-dir --constraint /etc/pip/constraint.txt \
        "transformers>=4.57" "datasets>=3.0" "tokenizers>=0.20" "safetensors>=0.4" "pyyaml>=6.0" \
        "torchao>=0.12" "submitit>=1.5" "matplotlib>=3.7" "tensorboard>=2.14" && \
    after="$(versions)" && \
    if [ "$before" != "$after" ]; then echo "error: torch/TE changed: $before -> $after" >&2; exit 1; fi && \
    echo "torch / transformer_engine: $after"
