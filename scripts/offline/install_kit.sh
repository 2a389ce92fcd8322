#!/usr/bin/env bash
# Install an offline kit (from make_kit.sh) on the air-gapped GPU node, without network: check every file
# against MANIFEST.json, then install the wheels into TARGET with the node's own torch, use (or, with no
# wheel built for this torch, compile) TE's torch extension, and print the versions block.
#   bash scripts/offline/install_kit.sh KIT [TARGET] [install.py flags: --no-build | --force-build | --dry-run]
# TARGET defaults to ./site-packages-kit; afterwards: export PYTHONPATH=TARGET:$PYTHONPATH.
# PYTHON: the node's Python with CUDA torch (default python3). Exit: 0 ready, 2 bad kit, 3 TE unusable.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
py=${PYTHON:-python3}
(($# >= 1)) || { echo "usage: install_kit.sh KIT [TARGET] [--no-build|--force-build|--dry-run]" >&2; exit 2; }
kit=$1; shift
target=site-packages-kit
if (($#)) && [[ $1 != -* ]]; then target=$1; shift; fi
"$py" "$here/kit.py" verify "$kit"
exec "$py" "$here/install.py" "$kit" "$target" "$@"
