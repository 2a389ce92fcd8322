#!/usr/bin/env bash
# Make an offline kit for an air-gapped GPU node, on a machine with network (any CPU: pip downloads for the node's
# Python and platform): the wheels the node lacks, TE's core library pruned to the node's GPU, its torch
# extension's source (and, given or compiled here, the extension itself), and MANIFEST.json with the sha256 of
# every file. The builder is build_kit.py beside this script; its --help lists every option.
#
#   bash scripts/offline/make_kit.sh DIR --python 3.12 --torch 2.11.0 --arch sm_90 \
#        [--platform x86_64|aarch64] [--te 2.20.2|none] [--with cudnn-frontend] [--with datasets] \
#        [--te-torch-wheel WHEEL | --build-te] [--record FILE] [--dry-run]
#
# PYTHON: the Python that runs the builder and pip (default python3; any version: pip downloads for --python).
# DIR must be new or a kit made here (never overwrites anything else). Then carry DIR to the node and run
# scripts/offline/install_kit.sh there.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec "${PYTHON:-python3}" "$here/build_kit.py" "$@"
