# A stand-in for the NGC PyTorch base image, made on the machine that runs the image tests, where NGC's cannot be
# pulled. 0.transformer-engine.dockerfile builds on it only when the build argument STANDIN_BASE names it (tests),
# and its build records "base": "stand-in" in /opt/llama-fp8/image.json. It holds what that Dockerfile's steps
# check in NGC's image, and nothing for GPUs:
#   Python with pip and the CPU build of torch (NGC: its CUDA build);
#   /etc/pip/constraint.txt pinning what is installed (NGC ships one: the package install runs under it);
#   Transformer Engine's package record only, at the version the NGC table lists for the default tag (the
#     version proof reads it; `import transformer_engine` fails, as on any machine without TE);
#   libfabric (Debian's) at /opt/amazon/efa/lib and a stand-in aws-ofi-nccl library, so the EFA step takes its
#     "already in the base image" path (there is no NCCL here to load a plugin);
#   the CA certificates of the machine that built it (its package index may sit behind a TLS proxy);
#   PATH from the image's environment in a login shell, as on NGC's Ubuntu: Enroot starts one, and Debian's
#     /etc/profile would reset PATH there (the image's PATH entries would never reach a job).
# Built by scripts/container/standin/build.sh from a debootstrap root file system (rootfs.tar) and local wheels.
FROM scratch
ADD rootfs.tar /
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY wheels/ /tmp/wheels/
COPY libnccl-net-ofi.so /opt/amazon/aws-ofi-nccl/lib/libnccl-net-ofi.so
ARG TE_VERSION
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# NGC's system Python takes pip installs: Debian's "externally managed" marker goes. wheels/requirements.txt pins
# torch and numpy to the wheels beside it (build.sh wrote both).
# hadolint ignore=SC2016
RUN [ -n "${TE_VERSION}" ] && \
    rm -f /usr/lib/python3*/EXTERNALLY-MANAGED && \
    sed -i -e '/^if \[ "$(id -u)" -eq 0 \]; then$/,/^export PATH$/d' /etc/profile && \
    ! grep -q '^export PATH' /etc/profile && \
    pip install --no-cache-dir --no-index --find-links /tmp/wheels --requirement /tmp/wheels/requirements.txt && \
    rm -rf /tmp/wheels && \
    fabric="$(find /usr/lib -name libfabric.so.1 -print -quit)" && [ -n "$fabric" ] && \
    mkdir -p /opt/amazon/efa/lib && ln -s "$fabric" /opt/amazon/efa/lib/libfabric.so.1 && \
    record="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/transformer_engine-${TE_VERSION}.dist-info" && \
    mkdir -p "$record" && \
    printf 'Metadata-Version: 2.1\nName: transformer_engine\nVersion: %s\nSummary: %s\n' "${TE_VERSION}" \
        "stand-in record for the image tests: no Transformer Engine is installed" >"$record/METADATA" && \
    printf 'llama-fp8 stand-in\n' >"$record/INSTALLER" && : >"$record/RECORD" && \
    mkdir -p /etc/pip /etc/llama-fp8 && pip freeze >/etc/pip/constraint.txt && \
    printf 'torch %s (CPU), Transformer Engine record %s: the image tests stand-in for NGC PyTorch\n' \
        "$(python -c 'import torch; print(torch.__version__)')" "${TE_VERSION}" >/etc/llama-fp8/standin-base
# As Debian's base images: a command for tools that create a container before running anything (podman create).
CMD ["/bin/bash"]
