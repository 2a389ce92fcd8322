#!/usr/bin/env bash
# Install the wheel kit into a target folder without network, compile TE's PyTorch extension only when no
# wheel in the kit fits this node's torch, print the versions block. See bootstrap.py for the options.
#   bash scripts/gpu/bootstrap.sh WHEELS_DIR [TARGET] [--no-build|--force-build] [--export DIR] [--dry-run]
# PYTHON: the node's PyTorch Python (default python3).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "${PYTHON:-python3}" "$here/bootstrap.py" "$@"
