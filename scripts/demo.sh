#!/usr/bin/env bash
# `make demo`: a CPU A/B run of the tiny preset, 2 ranks under torchrun, --fp8=0 then --fp8=1
# (torchao FP8, emulated on CPU), same seed and data; then the compare report of the two runs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
STEPS=${DEMO_STEPS:-100}
NPROC=${DEMO_NPROC:-2}
OUT=${DEMO_DIR:-runs/demo-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"

# Real text: docstrings of the Python standard library (ships with every CPython), packed into
# 128-token blocks by a 4096-token BPE tokenizer trained on it here; cached under runs/demo_data.
DATA=${DEMO_DATA:-runs/demo_data}
echo "== preparing the demo corpus and tokenizer in $DATA"
"$PY" -m llama_fp8.data.demo "$DATA" >/dev/null

# Training settings shared by both halves of the A/B pair: only --fp8 differs.
common=(--model tiny --device cpu --max_steps "$STEPS" --logging_freq 5 --seed 1234
        --dataset "$DATA/corpus" --tokenizer "$DATA/tokenizer" --num_workers 0
        --validation_freq 25 --validation_batches 4)
if [ -n "${DEMO_EXTRA:-}" ]; then
  read -r -a extra <<<"$DEMO_EXTRA"
  common+=(${extra[@]+"${extra[@]}"})  # the safe form: bash 4.2 calls an empty array unbound under set -u
fi

for fp8 in 0 1; do
  name=$([ "$fp8" = 1 ] && echo fp8 || echo bf16)
  echo "== training tiny on CPU with $NPROC ranks, --fp8=$fp8 -> $OUT/$name"
  "$VENV/bin/torchrun" --standalone --nproc_per_node "$NPROC" -m llama_fp8 train "${common[@]}" \
    --fp8 "$fp8" --run_dir "$OUT/$name" 2>"$OUT/$name.stderr" | tee "$OUT/$name.log" | grep -E '^Batch' | tail -n 3
done

echo
echo "== last lines"
for name in bf16 fp8; do
  echo "$name: $(grep -E '^Batch' "$OUT/$name.log" | tail -n 1)"
  echo "      metrics: $OUT/$name/metrics.jsonl  config: $OUT/$name/config.yaml"
done
if "$PY" -c "import llama_fp8.report.compare" 2>/dev/null; then
  echo
  "$PY" -m llama_fp8 compare "$OUT/bf16" "$OUT/fp8" --out "$OUT/report"
fi
