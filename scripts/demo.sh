#!/usr/bin/env bash
# `make demo`: a CPU A/B of the tiny preset, 2 ranks under torchrun: R pairs (DEMO_REPEATS or --repeats R,
# default 2) of --fp8=0 and --fp8=1 (torchao FP8, emulated on CPU), interleaved with the order alternating,
# pair i with seed 1234+i-1 for both arms (FP8 25 % more steps on BF16's LR schedule: DEMO_EXTRA_STEPS); then the
# compare report of all pairs (speed-up and iso-loss speed-up intervals, the BF16-vs-BF16 noise band, the verdict). DEMO_ARMS (default bf16,fp8) runs more arms the same way, each against
# BF16: DEMO_ARMS=bf16,tensorwise,mxfp8 compares torchao's FP8 and its MXFP8 (both emulated on CPU);
# DEMO_ARMS=shootout runs the recipe shoot-out (on a CPU: tensorwise, rowwise and MXFP8, emulated).
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS=${DEMO_REPEATS:-2}
if [ "${1:-}" = --repeats ]; then
  REPEATS=${2:?--repeats needs a number}
  shift 2
fi
[ $# -eq 0 ] || { echo "error: unknown argument(s) $*: the only option is --repeats R" >&2; exit 2; }
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
STEPS=${DEMO_STEPS:-100}
NPROC=${DEMO_NPROC:-2}
OUT=${DEMO_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
{  # the exact command, for `python -m llama_fp8 compare --repro` (it prints a script that re-runs the A/B)
  printf 'cd %q\n' "$PWD"
  for var in DEMO_STEPS DEMO_NPROC DEMO_DATA DEMO_EXTRA DEMO_ARMS DEMO_EXTRA_STEPS VENV; do
    if [ -n "${!var:-}" ]; then printf '%s=%q ' "$var" "${!var}"; fi
  done
  printf '%q ' bash scripts/demo.sh --repeats "$REPEATS"
  printf '\n'
} >"$OUT/ab_command.sh"

# Real text: docstrings of the Python standard library (ships with every CPython), packed into
# 128-token blocks by a 4096-token BPE tokenizer trained on it here; cached under runs/demo_data.
DATA=${DEMO_DATA:-runs/demo_data}
echo "== preparing the demo corpus and tokenizer in $DATA"
"$PY" -m llama_fp8.data.demo "$DATA" >/dev/null

# Training settings shared by every arm: only the precision differs.
common=(--model tiny --device cpu --max_steps "$STEPS" --logging_freq 5 --seed 1234
        --dataset "$DATA/corpus" --tokenizer "$DATA/tokenizer" --num_workers 0
        --validation_freq 25 --validation_batches 4)
if [ -n "${DEMO_EXTRA:-}" ]; then
  read -r -a extra <<<"$DEMO_EXTRA"
  common+=(${extra[@]+"${extra[@]}"})  # the safe form: bash 4.2 calls an empty array unbound under set -u
fi
# Tokenized once (cached under $DATA/tokenized), read by every arm: the same tokens, not tokenized per run.
"$PY" -m llama_fp8.cluster.launch.ab_data --out "$DATA/tokenized" --workers 1 -- ${common[@]+"${common[@]}"} >"$OUT/arm_args.bin"
mapfile -d '' -t common <"$OUT/arm_args.bin"

# The run order (alternating per pair) and seeds come from the same schedule as the Slurm A/B job.
# torch.distributed.run through this venv's python (what `torchrun` is), never a script whose #! may name
# another interpreter (a copied venv keeps its old path there).
ARMS=${DEMO_ARMS:-bf16,fp8}
# FP8 arms run DEMO_EXTRA_STEPS % more steps (default 25) on BF16's LR schedule, so that one whose loss tracks BF16's
# can reach BF16's final loss: the iso-loss speed-up (0: every arm the same steps).
schedule=$("$PY" -m llama_fp8.cluster.launch.schedule --repeats "$REPEATS" --arms "$ARMS" \
  --extra_steps "${DEMO_EXTRA_STEPS:-25}" -- ${common[@]+"${common[@]}"})
while read -r subdir fp8 seed extra <&3; do  # fd 3: the launcher cannot take the schedule from stdin
  read -r -a flags <<<"$extra"  # an arm's own flags (its --fp8_recipe); none for bf16 and fp8
  echo "== training tiny on CPU with $NPROC ranks, ${flags[*]+${flags[*]} }--fp8=$fp8 --seed $seed -> $OUT/$subdir"
  mkdir -p "$OUT/$subdir"
  "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m llama_fp8 train ${common[@]+"${common[@]}"} \
    ${flags[@]+"${flags[@]}"} --fp8 "$fp8" --seed "$seed" --run_dir "$OUT/$subdir" 2>"$OUT/$subdir.stderr" \
    | tee "$OUT/$subdir.log" | grep -E '^Batch' | tail -n 3
done 3<<<"$schedule"

echo
echo "== last lines"
while read -r subdir _; do
  echo "$subdir: $(grep -E '^Batch' "$OUT/$subdir.log" | tail -n 1)"
  echo "      metrics: $OUT/$subdir/metrics.jsonl  config: $OUT/$subdir/config.yaml"
done <<<"$schedule"
read -r -a runs <<<"$("$PY" -m llama_fp8.cluster.launch.schedule --repeats "$REPEATS" --arms "$ARMS" --compare \
  -- ${common[@]+"${common[@]}"})"
per_repeat=()  # arms per repeat, from the schedule (DEMO_ARMS=shootout: the arms this machine runs)
((${#runs[@]} / REPEATS == 2)) || per_repeat=(--arms "$((${#runs[@]} / REPEATS))")
echo
"$PY" -m llama_fp8 compare ${runs[@]+"${runs[@]/#/$OUT/}"} ${per_repeat[@]+"${per_repeat[@]}"} --out "$OUT/report"
