#!/bin/bash
# Find NCCL's OFI net plugin (aws-ofi-nccl) under a root folder and print its full path as the last line.
#   scripts/image/nccl_net_plugin.sh /            # in the image (the Dockerfile runs this)
#   scripts/image/nccl_net_plugin.sh --tuner /    # the OFI tuner that goes with it (see below)
# Exit 0 with the path; exit 1 naming every place looked at when there is no plugin at all.
#
# Where the plugin lands depends on who installed it (cited in tests/cluster/test_image.py too):
#   EFA installer 1.39-1.43 (aws-ofi-nccl <= 1.16, deb): /opt/amazon/ofi-nccl/lib/<arch>-linux-gnu/, i.e.
#       x86_64-linux-gnu, and aarch64-linux-gnu on arm64 (GB200) hosts and images (libnccl-net-ofi.so from 1.15 on,
#       with links libnccl-net.so, libnccl-ofi-tuner.so; <= 1.14 only a real libnccl-net.so) - aws-ofi-nccl
#       v1.16.3 contrib/debian-template/rules: MULTIARCH_DIR := dpkg-architecture -q DEB_HOST_MULTIARCH
#   EFA installer >= 1.44 (aws-ofi-nccl >= 1.17, deb): /opt/amazon/ofi-nccl/lib/ + /etc/ld.so.conf.d/100_ofinccl.conf
#       - aws-ofi-nccl commit 6eb0870a "packaging/deb: remove multi-arch from lib path"
#   RPM builds: /opt/amazon/ofi-nccl/lib64/ on both CPUs (contrib/fedora spec: %{_libdir} under the
#       /opt/amazon/ofi-nccl prefix; lib64 on x86_64 and aarch64 alike)
#   EFA installer 1.48 on an NGC base (libnccl-ofi-ngc-v1/v2/v3, built with --disable-nccl-net-library, so no
#       libnccl-net.so): v1 /opt/amazon/aws-ofi-nccl/lib/libnccl-net-aws-ofi.so, v2 /opt/amazon/aws-ofi-nccl/lib/
#       libnccl-net-ofi.so, v3 /opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so - aws-ofi-nccl commit ee7c5a43,
#       debian/libnccl-ofi-ngc-v{1,2,3}.install
#   NGC images that carry a plugin themselves: /opt/amazon/aws-ofi-nccl/lib/; source builds: /opt/aws-ofi-nccl/lib
# The first folder that holds a plugin wins, in the order above: the EFA installer's own (the one matching the
# libfabric it installed) before an older copy that came with the base image.
#
# --tuner: the tuner library next to the plugin. aws-ofi-nccl <= 1.15 ships it as a separate library
# (libnccl-ofi-tuner.so); >= 1.16 also exports the tuner from the net plugin itself, and the NGC packages name it
# libnccl-tuner-ofi.so / libnccl-tuner-aws-ofi.so. Without a separate file the net plugin is printed (NCCL >= 2.21
# finds the tuner symbols in it; a library without them only means NCCL's internal tuner, never an error).
# PLUGIN_ARCH: the CPU whose multiarch folder is searched (default uname -m; the tests look at aarch64 trees).
set -euo pipefail

usage() { echo "usage: $0 [--tuner] ROOT" >&2; exit 2; }
WANT=net
if [[ "${1:-}" == --tuner ]]; then WANT=tuner; shift; fi
[[ $# -eq 1 ]] || usage
ROOT=$(cd "$1" && pwd -P) || { echo "error: root folder $1 does not exist" >&2; exit 2; }
if [[ "$ROOT" == / ]]; then ROOT=""; fi  # the paths below start with "/"
ARCH=${PLUGIN_ARCH:-$(uname -m)}

DIRS=(
    /opt/amazon/ofi-nccl/lib
    "/opt/amazon/ofi-nccl/lib/$ARCH-linux-gnu"
    /opt/amazon/ofi-nccl/lib64
    /opt/amazon/aws-ofi-nccl/lib
    /opt/aws-ofi-nccl/lib
    /opt/aws-ofi-nccl/install/lib
)
# Per folder, the real library before the generic link name.
NET_NAMES=(libnccl-net-ofi.so libnccl-net-aws-ofi.so libnccl-net.so)
TUNER_NAMES=(libnccl-ofi-tuner.so libnccl-tuner-ofi.so libnccl-tuner-aws-ofi.so)

looked=()
for dir in "${DIRS[@]}"; do
    for name in "${NET_NAMES[@]}"; do
        path="$ROOT$dir/$name"
        looked+=("$path")
        # -e follows links: a dangling libnccl-net.so link (seen in images that moved the plugin) is no plugin.
        [[ -e "$path" ]] || continue
        if [[ "$WANT" == tuner ]]; then
            for tuner in "${TUNER_NAMES[@]}"; do
                if [[ -e "$ROOT$dir/$tuner" ]]; then
                    echo "$ROOT$dir/$tuner"
                    exit 0
                fi
            done
        fi
        echo "$path"
        exit 0
    done
done

echo "error: no aws-ofi-nccl net plugin under $1; looked for:" >&2
printf "  %s\n" ${looked[@]+"${looked[@]}"} >&2
echo "Install it with the AWS EFA installer (scripts/image/install_efa.sh) or point NCCL_NET_PLUGIN at it." >&2
exit 1
