#!/bin/bash
# A/B: the same training run with --fp8=1 and --fp8=0, then the report (bf16 = A, the baseline; fp8 = B).
#   ./2.ab_fp8_vs_bf16.sh --model llama3.1-8b --max_steps 200
#   SBATCH_ARGS="--nodes=4 --partition=p5" IMAGE=$PWD/llama-fp8.sqsh ./2.ab_fp8_vs_bf16.sh --model llama2-7b
#   ./2.ab_fp8_vs_bf16.sh --repeats 3 --model llama3.1-8b --max_steps 200    # 3 pairs: noise band + intervals
# A leading --repeats R (or AB_REPEATS=R; default 1) runs R pairs in the same allocation, interleaved with the
# order alternating per pair, pair i with seed s_i = base + i - 1 (the last --seed given, else the default) for
# both arms. The other arguments go to every training run (`llama_fp8 train` flags); --fp8, --seed (R > 1) and
# --run_dir are set here. The exact command is kept in AB_DIR/ab_command.sh for `compare --repro`.
# AB_MODE:
#   same (default)  one job: both arms back to back in ONE allocation on the same nodes, one preflight, then the
#                   report (scripts/slurm/ab_job.sbatch). Node quality, network placement and image cannot differ
#                   between the arms, so the speed ratio measures FP8 and nothing else.
#   two-jobs        two independent training jobs (1.train_llama.sbatch) and a report job after both: for runs
#                   too long for one allocation. The report says "not the same hardware" when they differ.
# Environment: SBATCH_ARGS (extra sbatch options for every job, the report job included, e.g. partition and
# account), AB_DIR (default runs/ab_<date-time>), AB_ORDER (same mode: "bf16 fp8" or "fp8 bf16"), plus
# everything 1.train_llama.sbatch reads (IMAGE, VENV, CONTAINER_MOUNTS, ...). With --mlflow_tracking_uri among the
# train arguments the report is also logged to MLflow (`llama_fp8 publish`: the A/B a parent run, the arms children).
set -euo pipefail

export REPO_DIR=${REPO_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}  # read by the batch scripts
export AB_REPEATS=${AB_REPEATS:-1}
if [[ "${1:-}" == --repeats ]]; then
    AB_REPEATS=${2:-}
    shift 2 || true
elif [[ "${1:-}" == --repeats=* ]]; then
    AB_REPEATS=${1#--repeats=}
    shift
fi
[[ "$AB_REPEATS" =~ ^[1-9][0-9]?$|^100$ ]] || { echo "error: --repeats '$AB_REPEATS': a number of pairs from 1 to 100" >&2; exit 2; }
export AB_DIR
AB_DIR=$(realpath -m "${AB_DIR:-runs/ab_$(date +%Y%m%d-%H%M%S)}")
AB_MODE=${AB_MODE:-same}
read -r -a EXTRA <<<"${SBATCH_ARGS:-}"
command -v sbatch >/dev/null || { echo "error: sbatch not found: run this on a Slurm login node" >&2; exit 1; }
if [[ -n "${IMAGE:-}" && -e "$IMAGE" ]]; then
    IMAGE=$(realpath "$IMAGE")  # a relative .sqsh would be taken for a registry name by Pyxis
    export IMAGE
fi
mkdir -p logs "$AB_DIR"
{  # the exact command, for `python -m llama_fp8 compare --repro` (it prints a script that re-runs the A/B)
    printf 'cd %q\n' "$PWD"
    for var in SBATCH_ARGS IMAGE AB_MODE AB_ORDER CONTAINER_MOUNTS VENV; do
        if [[ -n "${!var:-}" ]]; then printf '%s=%q ' "$var" "${!var}"; fi
    done
    printf '%q ' "$REPO_DIR/2.ab_fp8_vs_bf16.sh" --repeats "$AB_REPEATS" "$@"
    printf '\n'
} >"$AB_DIR/ab_command.sh"

if [[ "$AB_MODE" == same ]]; then
    JOB=$(sbatch --parsable ${EXTRA[@]+"${EXTRA[@]}"} "$REPO_DIR/scripts/slurm/ab_job.sbatch" "$@")
    cat <<EOF
ab job:     $JOB   log logs/llama-fp8-ab_$JOB.out   (both arms on the same nodes, ${AB_ORDER:-bf16 fp8})
pairs:      $AB_REPEATS (run dirs: $AB_DIR/bf16 $AB_DIR/fp8 for one pair, else $AB_DIR/pair<i>/<arm>)
report:     $AB_DIR/report/ (written by the same job)
watch:      squeue -j $JOB
EOF
    exit 0
fi
[[ "$AB_MODE" == two-jobs ]] || { echo "error: AB_MODE=$AB_MODE: use same or two-jobs" >&2; exit 2; }
((AB_REPEATS == 1)) || { echo "error: --repeats $AB_REPEATS needs AB_MODE=same (pairs in one allocation)" >&2; exit 2; }

submit_run() {  # submit_run NAME FP8 TRAIN_ARGS... -> prints the job id
    local name=$1 fp8=$2
    shift 2
    sbatch --parsable --job-name="llama-fp8-$name" ${EXTRA[@]+"${EXTRA[@]}"} "$REPO_DIR/1.train_llama.sbatch" \
        "$@" --fp8="$fp8" --run_dir="$AB_DIR/$name"
}
FP8_JOB=$(submit_run fp8 1 "$@")
BF16_JOB=$(submit_run bf16 0 "$@")

# The report job: afterany (also report a failed run); SBATCH_ARGS first (partition, account, ...), then one
# task on one node, which win over any --nodes/--ntasks in SBATCH_ARGS.
if [[ -n "${IMAGE:-}" ]]; then
    RUN=(srun --container-image="$IMAGE" --container-mounts="${CONTAINER_MOUNTS:-$REPO_DIR:$REPO_DIR,$AB_DIR:$AB_DIR}"
        python)
else
    RUN=(env PYTHONPATH="$REPO_DIR/src" "${VENV:-$REPO_DIR/.venv}/bin/python")
fi
WRAP=$(printf '%q ' "${RUN[@]}" -m llama_fp8 compare "$AB_DIR/bf16" "$AB_DIR/fp8" --out "$AB_DIR/report")
if [[ " $* " == *" --mlflow_tracking_uri"* ]]; then  # the report as an MLflow run too (docs/metrics.md)
    WRAP+="&& { $(printf '%q ' "${RUN[@]}" -m llama_fp8 publish "$AB_DIR/report")|| echo 'warning: llama_fp8 publish could not log the report to MLflow' >&2; }"
fi
REPORT_JOB=$(sbatch --parsable ${EXTRA[@]+"${EXTRA[@]}"} --job-name=llama-fp8-report --nodes=1 --ntasks=1 \
    --output=logs/%x_%j.out --dependency="afterany:$FP8_JOB:$BF16_JOB" --wrap="$WRAP")

cat <<EOF
fp8 job:    $FP8_JOB   log logs/llama-fp8-fp8_$FP8_JOB.out    run dir $AB_DIR/fp8
bf16 job:   $BF16_JOB   log logs/llama-fp8-bf16_$BF16_JOB.out   run dir $AB_DIR/bf16
report job: $REPORT_JOB   (after both) -> $AB_DIR/report/
watch: squeue -j $FP8_JOB,$BF16_JOB,$REPORT_JOB
EOF
