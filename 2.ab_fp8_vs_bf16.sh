#!/bin/bash
# A/B: the same training job twice, --fp8=1 and --fp8=0, then a report job when both have ended.
#   ./2.ab_fp8_vs_bf16.sh --model llama3.1-8b --max_steps 200
#   SBATCH_ARGS="--nodes=4 --partition=p5" IMAGE=$PWD/llama-fp8.sqsh ./2.ab_fp8_vs_bf16.sh --model llama2-7b
# Arguments go to both training runs (1.train_llama.sbatch forwards them to `llama_fp8 train`);
# --fp8 and --run_dir are set here. Environment: SBATCH_ARGS (extra sbatch options for the training jobs),
# AB_DIR (default runs/ab_<date-time>), plus everything 1.train_llama.sbatch reads (IMAGE, VENV, ...).
set -euo pipefail

export REPO_DIR=${REPO_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}  # read by 1.train_llama.sbatch
AB_DIR=$(realpath -m "${AB_DIR:-runs/ab_$(date +%Y%m%d-%H%M%S)}")
read -r -a EXTRA <<<"${SBATCH_ARGS:-}"
command -v sbatch >/dev/null || { echo "error: sbatch not found: run this on a Slurm login node" >&2; exit 1; }
mkdir -p logs "$AB_DIR"

submit_run() {  # submit_run NAME FP8 TRAIN_ARGS... -> prints the job id
    local name=$1 fp8=$2
    shift 2
    sbatch --parsable --job-name="llama-fp8-$name" "${EXTRA[@]}" "$REPO_DIR/1.train_llama.sbatch" \
        "$@" --fp8="$fp8" --run_dir="$AB_DIR/$name"
}
FP8_JOB=$(submit_run fp8 1 "$@")
BF16_JOB=$(submit_run bf16 0 "$@")

# The report: bf16 is the baseline (A), fp8 the candidate (B). afterany: also report a failed run.
COMPARE=(-m llama_fp8 compare "$AB_DIR/bf16" "$AB_DIR/fp8" --out "$AB_DIR/report")
if [[ -n "${IMAGE:-}" ]]; then
    RUN=(srun --container-image="$IMAGE" --container-mounts="${CONTAINER_MOUNTS:-$REPO_DIR:$REPO_DIR,$AB_DIR:$AB_DIR}"
        python "${COMPARE[@]}")
else
    RUN=(env PYTHONPATH="$REPO_DIR/src" "${VENV:-$REPO_DIR/.venv}/bin/python" "${COMPARE[@]}")
fi
REPORT_JOB=$(sbatch --parsable --job-name=llama-fp8-report --nodes=1 --ntasks=1 --output=logs/%x_%j.out \
    --dependency="afterany:$FP8_JOB:$BF16_JOB" --wrap="$(printf '%q ' "${RUN[@]}")")

cat <<EOF
fp8 job:    $FP8_JOB   log logs/llama-fp8-fp8_$FP8_JOB.out    run dir $AB_DIR/fp8
bf16 job:   $BF16_JOB   log logs/llama-fp8-bf16_$BF16_JOB.out   run dir $AB_DIR/bf16
report job: $REPORT_JOB   (after both) -> $AB_DIR/report/
watch: squeue -j $FP8_JOB,$BF16_JOB,$REPORT_JOB
EOF
