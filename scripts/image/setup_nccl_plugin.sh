#!/bin/bash
# Make the image's static NCCL settings point at the OFI plugin wherever the installer put it.
#   scripts/image/setup_nccl_plugin.sh /      (0.transformer-engine.dockerfile; a fake root in the tests)
# Docker ENV is fixed when the Dockerfile is written, the plugin's folder is only known now, so this creates
# what the ENV names (all under ROOT):
#   /opt/llama-fp8/nccl/libnccl-net-ofi.so   -> the plugin file       (ENV NCCL_NET_PLUGIN, a full path)
#   /opt/llama-fp8/nccl/libnccl-tuner-ofi.so -> the OFI tuner         (ENV NCCL_TUNER_PLUGIN)
#   /opt/llama-fp8/nccl/lib                  -> the plugin's folder   (first on ENV LD_LIBRARY_PATH)
#   /etc/ld.so.conf.d/000_llama-fp8-ofi-nccl.conf: that folder and /opt/amazon/efa/lib (+ ldconfig when ROOT=/)
#   /opt/llama-fp8/nccl/plugin.env: NCCL_NET_PLUGIN_FILE=..., NCCL_TUNER_PLUGIN_FILE=... (recorded in image.json)
# Fails (the build with it) only when there is no plugin at all.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
[[ $# -eq 1 ]] || { echo "usage: $0 ROOT" >&2; exit 2; }
ROOT=$(cd "$1" && pwd -P)
if [[ "$ROOT" == / ]]; then ROOT=""; fi

plugin=$("$HERE/nccl_net_plugin.sh" "$1" | tail -n 1)
tuner=$("$HERE/nccl_net_plugin.sh" --tuner "$1" | tail -n 1)
inside() { echo "${1#"$ROOT"}"; }  # the path as the image sees it

links="$ROOT/opt/llama-fp8/nccl"
mkdir -p "$links" "$ROOT/etc/ld.so.conf.d"
ln -sfn "$(inside "$plugin")" "$links/libnccl-net-ofi.so"
ln -sfn "$(inside "$tuner")" "$links/libnccl-tuner-ofi.so"
ln -sfn "$(dirname "$(inside "$plugin")")" "$links/lib"
printf '%s\n' "$(dirname "$(inside "$plugin")")" /opt/amazon/efa/lib >"$ROOT/etc/ld.so.conf.d/000_llama-fp8-ofi-nccl.conf"
printf 'NCCL_NET_PLUGIN_FILE=%s\nNCCL_TUNER_PLUGIN_FILE=%s\n' "$(inside "$plugin")" "$(inside "$tuner")" \
    >"$links/plugin.env"
if [[ -z "$ROOT" ]] && command -v ldconfig >/dev/null; then ldconfig; fi
echo "NCCL OFI plugin: $(inside "$plugin") (tuner $(inside "$tuner")), linked from /opt/llama-fp8/nccl"
