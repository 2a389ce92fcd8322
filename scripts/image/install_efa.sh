#!/bin/bash
# Install AWS EFA userspace (libfabric, rdma-core) and the aws-ofi-nccl NCCL plugin into the image, unless the
# base image already has both. Run by 0.transformer-engine.dockerfile:
#   EFA_INSTALLER_VERSION=1.50.0 scripts/image/install_efa.sh
# Environment:
#   EFA_INSTALLER_VERSION  required; https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-changelog.html
#   EFA_INSTALLER_SHA256   optional: the tarball must have this digest
#   EFA_INSTALLER_ARGS     optional extra installer flags, e.g. "--disable-ngc" (installer >= 1.48 detects NGC
#                          bases and installs its NGC plugin packages; this asks for the standard ones) or
#                          "--enable-ngc" (>= 1.49, AWS's documented flag for NGC containers). Where the plugin
#                          lands does not matter: scripts/image/setup_nccl_plugin.sh finds it in every layout.
#   EFA_ARCH               optional: the image's CPU (default uname -m: x86_64, or aarch64 for GB200's Grace)
# One installer tarball serves both CPUs: its packages lie in DEBS/<distro>/<arch>/ and RPMS/<distro>/<arch>/
# (e.g. DEBS/UBUNTU2004/aarch64/libfabric1-aws_1.18.0amzn2.0_arm64.deb, as awsome-distributed-training's arm64
# nccl-tests image installs it) and efa_installer.sh picks the machine's; a tarball without the image's CPU is
# refused before the installer runs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
: "${EFA_INSTALLER_VERSION:?set EFA_INSTALLER_VERSION, e.g. 1.50.0}"
read -r -a EXTRA <<<"${EFA_INSTALLER_ARGS:-}"

ROOT=${EFA_ROOT:-/}  # where to look for an existing install (a fake root folder in the tests)
if compgen -G "${ROOT%/}/opt/amazon/efa/lib/libfabric.so*" >/dev/null &&
    plugin=$("$HERE/nccl_net_plugin.sh" "$ROOT" 2>/dev/null); then
    echo "EFA: libfabric and the OFI NCCL plugin ($plugin) are already in the base image: not installing"
    exit 0
fi

tmp=$(mktemp -d)
tarball="$tmp/aws-efa-installer-$EFA_INSTALLER_VERSION.tar.gz"
curl -fsSL --retry 3 -o "$tarball" "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz"
if [[ -n "${EFA_INSTALLER_SHA256:-}" ]]; then
    echo "$EFA_INSTALLER_SHA256  $tarball" | sha256sum -c -
fi
tar -xzf "$tarball" -C "$tmp"
arch=${EFA_ARCH:-$(uname -m)}
if ! compgen -G "$tmp/aws-efa-installer/DEBS/*/$arch" >/dev/null &&
    ! compgen -G "$tmp/aws-efa-installer/RPMS/*/$arch" >/dev/null; then
    echo "error: EFA installer $EFA_INSTALLER_VERSION has no packages for $arch (no DEBS/*/$arch or RPMS/*/$arch);" \
        "choose an installer release that ships $arch (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-changelog.html)" >&2
    exit 1
fi
echo "EFA installer $EFA_INSTALLER_VERSION: packages for $arch: $(cd "$tmp/aws-efa-installer" &&
    find DEBS RPMS -mindepth 2 -maxdepth 2 -type d -name "$arch" 2>/dev/null | sort | tr '\n' ' ')"
real_root=0
if [[ "$ROOT" == / ]]; then real_root=1; fi  # the package lists are the image's own only then (tests: a fake root)
if ((real_root)) && command -v apt-get >/dev/null; then apt-get update; fi
# -y: no prompts. --skip-kmod: the kernel module belongs to the host. --skip-limit-conf: ulimits come from the
# container runtime. --no-verify: no EFA device test (there is no device during `docker build`).
(cd "$tmp/aws-efa-installer" && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify ${EXTRA[@]+"${EXTRA[@]}"})
rm -rf "$tmp"
if ((real_root)); then rm -rf /var/lib/apt/lists/*; fi
echo "EFA installer $EFA_INSTALLER_VERSION: installed"
