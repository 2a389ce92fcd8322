#!/usr/bin/env bash
# One command of a GPU visit on a node: install the offline kit (scripts/offline/install.py, which also runs one
# TE FP8 forward+backward), then run one slice of verify.py inside a time budget, results and logs written to
# $OUT (the output folder that comes back from the node).
#   bash scripts/gpu/visit.sh [verify.py flags]     e.g. --plan first     or     --match 'train/llama3.2-1b/*'
# Environment: WHEELS (the kit, default .whl; relative paths are the repo's), SITE (install target, default
# /tmp/site), VISIT_SECONDS (the whole command's budget, default 540), PYTHON (default python3), OUT (where
# results and logs go: the output folder that comes back from the node; default /tmp/llama-fp8-out), RESULTS
# (the node's own results file, default /tmp/llama-fp8-verify/results.jsonl: the repository's records are merged
# into it first, and a second command on the same node continues from it).
# Exit code: verify.py's (0 slice done, 10 budget ran out: run the same command again), or install.py's 2.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-/tmp/llama-fp8-out}
site=${SITE:-/tmp/site}
py=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
[[ $wheels == /* ]] || wheels="$repo/$wheels"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# A kit from scripts/offline/make_kit.sh carries a manifest: every file must match it before anything installs.
if [[ -f $wheels/MANIFEST.json ]] && ! "$py" "$repo/scripts/offline/kit.py" verify "$wheels"; then
    exit 2
fi
"$py" "$repo/scripts/offline/install.py" "$wheels" "$site" --export "$out/built" 2>&1 | tee "$out/install.log"
rc=${PIPESTATUS[0]}
if (( rc == 3 )); then
    echo "visit: Transformer Engine is not usable (see above); the torchao and HF runs go on, TE units will fail"
elif (( rc != 0 )); then
    echo "visit: install.py failed with exit code $rc"
    exit "$rc"
fi
export PYTHONPATH="$site:$repo/src${PYTHONPATH:+:$PYTHONPATH}"
budget=$(( ${VISIT_SECONDS:-540} - SECONDS - 15 ))
if (( budget < 60 )); then
    echo "visit: only ${budget} s left after the install: nothing started"
    exit 10
fi
"$py" "$repo/scripts/gpu/verify.py" --mirror "$out" --budget-seconds "$budget" \
    --results "${RESULTS:-/tmp/llama-fp8-verify/results.jsonl}" --merge-from "$repo/docs/gpu-results/results.jsonl" "$@"
