#!/usr/bin/env bash
# One command of a GPU visit on a node: install the offline kit (scripts/offline/install.py: TE's import, one TE FP8
# forward+backward, the versions block), then run one slice of verify.py, all inside VISIT_SECONDS: every wait is
# cut to what is left of it, and results and logs are written to $OUT as they are made (a command killed at its
# limit still returns what it measured).
#   bash scripts/gpu/visit.sh [verify.py flags]     e.g. --plan first
# Environment: VISIT_SECONDS (this command's budget: the node's limit for it less 20 s; default 380, the first
# visit's first command, units.COMMANDS), WHEELS (the kit, default .whl), SITE (install target, default /tmp/site: a
# second command on the same node reuses an install of the same kit), PYTHON (default python3), OUT (default
# /tmp/llama-fp8-out), RESULTS (the node's own results file, default /tmp/llama-fp8-verify/results.jsonl).
# Exit code: verify.py's (0 slice done, 10 budget ran out: run again), or install.py's 2.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out=${OUT:-/tmp/llama-fp8-out}
site=${SITE:-/tmp/site}
py=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
[[ $wheels == /* ]] || wheels="$repo/$wheels"
budget=${VISIT_SECONDS:-380}
margin=15  # verify.py's budget ends this long before the command's (units.MARGIN_S)
if ! [[ $budget =~ ^[0-9]+$ ]] || (( budget < margin + 60 )); then
    echo "visit: VISIT_SECONDS '$budget': expected whole seconds, at least $((margin + 60))" >&2; exit 2
fi
left() { echo $((budget - margin - SECONDS)); }
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# A kit from scripts/offline/make_kit.sh carries a manifest: every file must match it before anything installs.
if [[ -f $wheels/MANIFEST.json ]] && ! timeout "$(left)" "$py" "$repo/scripts/offline/kit.py" verify "$wheels"; then
    exit 2
fi
"$py" "$repo/scripts/offline/install.py" "$wheels" "$site" --export "$out/built" --budget-seconds "$(left)" 2>&1 \
    | tee "$out/install.log"
rc=${PIPESTATUS[0]}
if (( rc == 3 )); then
    echo "visit: Transformer Engine is not usable (see above); the torchao and HF runs go on, TE units will fail"
elif (( rc != 0 )); then
    echo "visit: install.py failed with exit code $rc"
    exit "$rc"
fi
export PYTHONPATH="$site:$repo/src${PYTHONPATH:+:$PYTHONPATH}"
if (( $(left) < 60 )); then
    echo "visit: only $(left) s left after the install ($SECONDS s): nothing started"
    exit 10
fi
echo "visit: install took $SECONDS s; $(left) s for the units"
"$py" "$repo/scripts/gpu/verify.py" --mirror "$out" --budget-seconds "$(left)" \
    --results "${RESULTS:-/tmp/llama-fp8-verify/results.jsonl}" --merge-from "$repo/docs/gpu-results/results.jsonl" "$@"
rc=$?
echo "visit: this command took $SECONDS s of its $budget (exit $rc)"
exit "$rc"
