#!/bin/bash
# A/B: the same training run with --fp8=1 and --fp8=0, then the report (bf16 = A, the baseline; fp8 = B); or one job
# comparing every precision a GPU offers, each arm against BF16.
#   ./2.ab_fp8_vs_bf16.sh --model llama3.1-8b --max_steps 200
#   SBATCH_ARGS="--nodes=4 --partition=p5" IMAGE=$PWD/llama-fp8.sqsh ./2.ab_fp8_vs_bf16.sh --model llama2-7b
#   ./2.ab_fp8_vs_bf16.sh --repeats 3 --model llama3.1-8b --max_steps 200    # 3 pairs: noise band + intervals
#   ./2.ab_fp8_vs_bf16.sh --arms bf16,fp8,mxfp8,nvfp4 --repeats 2 --model llama3.1-8b   # Blackwell: every format
#   ./2.ab_fp8_vs_bf16.sh --arms shootout --repeats 2 --model llama3.1-8b   # every recipe, ranked at equal quality
# A leading --extra_steps PCT (or AB_EXTRA_STEPS; default 0) runs the FP8 arms PCT % longer on the baseline's LR
# schedule, so that the report's iso-loss speed-up finds where a candidate reaches BF16's final loss (same mode only).
# A leading --repeats R (or AB_REPEATS=R; default 1) runs R repeats in the same allocation, interleaved with the
# order reversed per repeat, repeat i with seed s_i = base + i - 1 (the last --seed given, else the default) for
# every arm. A leading --arms LIST (or AB_ARMS; default bf16,fp8) names the arms: bf16 (the baseline), fp8 (--fp8 1,
# the recipe the flags or auto pick) and --fp8_recipe names (mxfp8, nvfp4, tensorwise, current, ...), or the preset
# shootout: BF16, torchao tensorwise (FP8 all-gather) and rowwise, TE current and delayed scaling and MXFP8, each
# where the job's node runs it (llama_fp8.cluster.launch.shootout; same mode only). The other
# arguments go to every training run (`llama_fp8 train` flags); --fp8, the arm's recipe, --seed (R > 1) and --run_dir
# are set here. The exact command is kept in AB_DIR/ab_command.sh for `compare --repro`.
# AB_MODE:
#   same (default)  one job: both arms back to back in ONE allocation on the same nodes, one preflight, then the
#                   report (scripts/slurm/ab_job.sbatch). Node quality, network placement and image cannot differ
#                   between the arms, so the speed ratio measures FP8 and nothing else.
#   two-jobs        one independent training job per arm (1.train_llama.sbatch) and a report job after them: for
#                   runs too long for one allocation (one repeat, no preset). The report says "not the same hardware"
#                   when they differ. Each arm reads what --dataset names: give it a tokenized corpus (llama_fp8
#                   tokenize; the same mode tokenizes text once itself) so that the arms do not tokenize twice.
# Environment: SBATCH_ARGS (extra sbatch options for every job, the report job included, e.g. partition and
# account), SEGMENT (sbatch --segment=N for the training jobs: N nodes that must share one block of Slurm's
# topology/block, e.g. one GB200 NVL72 NVLink domain; Slurm 24.05+, docs/gb200.md), AB_DIR (default runs/ab_<date-time>), AB_ORDER (same mode: the arms' run order, e.g. "fp8 bf16"),
# AB_PRESET (same mode: ab, the default, compiles every arm alike where a backend needs it and turns FP8 all-gather
# on where a recipe allows it; none leaves the flags as given), SPARE_NODES (k spare nodes added to every training
# job's --nodes, which wait to take a failed node's place; a swap during an arm is recorded), plus
# everything 1.train_llama.sbatch reads (IMAGE, VENV, CONTAINER_MOUNTS, ...). With --mlflow_tracking_uri among the
# train arguments the report is also logged to MLflow (`llama_fp8 publish`: the A/B a parent run, the arms children).
set -euo pipefail

export REPO_DIR=${REPO_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)}  # read by the batch scripts
export AB_REPEATS=${AB_REPEATS:-1} AB_ARMS=${AB_ARMS:-bf16,fp8} AB_EXTRA_STEPS=${AB_EXTRA_STEPS:-0}
while [[ "${1:-}" == --repeats* || "${1:-}" == --arms* || "${1:-}" == --extra_steps* ]]; do  # the A/B's own options
    case "$1" in
        --extra_steps) AB_EXTRA_STEPS=${2:-}; shift 2 || shift ;;
        --extra_steps=*) AB_EXTRA_STEPS=${1#--extra_steps=}; shift ;;
        --repeats) AB_REPEATS=${2:-}; shift 2 || shift ;;
        --repeats=*) AB_REPEATS=${1#--repeats=}; shift ;;
        --arms) AB_ARMS=${2:-}; shift 2 || shift ;;
        --arms=*) AB_ARMS=${1#--arms=}; shift ;;
        *) break ;;
    esac
done
[[ "$AB_REPEATS" =~ ^[1-9][0-9]?$|^100$ ]] || { echo "error: --repeats '$AB_REPEATS': a number of pairs from 1 to 100" >&2; exit 2; }
[[ "$AB_EXTRA_STEPS" =~ ^[0-9]{1,2}$|^100$ ]] || { echo "error: --extra_steps '$AB_EXTRA_STEPS': a percentage from 0 to 100" >&2; exit 2; }
# The names are checked by the schedule in the job (it knows the recipes); here their shape and the baseline.
# --arms shootout: the preset the job decides on its node (every FP8 recipe it runs against BF16).
if [[ "$AB_ARMS" != shootout && ( ! "$AB_ARMS" =~ ^[a-z0-9_]+(,[a-z0-9_]+)+$ || ",$AB_ARMS," != *,bf16,* ) ]]; then
    echo "error: --arms '$AB_ARMS': comma-separated arms with bf16 (the baseline) among them, e.g. bf16,fp8,mxfp8," \
        "or the preset shootout" >&2
    exit 2
fi
read -r -a ARM_LIST <<<"${AB_ARMS//,/ }"
export AB_DIR
AB_DIR=$(realpath -m "${AB_DIR:-runs/ab_$(date +%Y%m%d-%H%M%S)}")
AB_MODE=${AB_MODE:-same}
read -r -a EXTRA <<<"${SBATCH_ARGS:-}"
TRAIN_EXTRA=()  # the training jobs' own options (placement): not the report job's
if [[ -n "${SEGMENT:-}" ]]; then
    [[ "$SEGMENT" =~ ^[1-9][0-9]{0,3}$ ]] || { echo "error: SEGMENT='$SEGMENT': a number of nodes >= 1 (sbatch --segment)" >&2; exit 2; }
    nodes=""  # the node count SBATCH_ARGS asks for, if it says (else the batch script's #SBATCH --nodes)
    for ((i = 0; i < ${#EXTRA[@]}; i++)); do
        case "${EXTRA[$i]}" in
            --nodes=*) nodes=${EXTRA[$i]#--nodes=} ;;
            --nodes | -N) nodes=${EXTRA[$((i + 1))]:-} ;;
            -N*) nodes=${EXTRA[$i]#-N} ;;
        esac
    done
    # Slurm's rule (Topology Guide, --segment): a node count above the segment size must be a multiple of it
    if [[ "$nodes" =~ ^[0-9]+$ ]] && ((nodes > SEGMENT && nodes % SEGMENT != 0)); then
        echo "error: SEGMENT=$SEGMENT does not divide the $nodes nodes of SBATCH_ARGS: Slurm requires a node count" \
            "above the segment size to be a multiple of it" >&2
        exit 2
    fi
    TRAIN_EXTRA=(--segment="$SEGMENT")
fi
command -v sbatch >/dev/null || { echo "error: sbatch not found: run this on a Slurm login node" >&2; exit 1; }
# SPARE_NODES=k: every training job asks for its N nodes (SBATCH_ARGS' --nodes, else the scripts' 2) plus k spares,
# which wait in the allocation to take the place of a node that fails (docs/reliability.md: Spare nodes).
TRAIN_NODES=()
[[ "${SPARE_NODES:-0}" =~ ^(0|[1-9][0-9]*)$ ]] ||
    { echo "error: SPARE_NODES=${SPARE_NODES}: a whole number of spare nodes >= 0 (default 0)" >&2; exit 2; }
if ((${SPARE_NODES:-0} > 0)); then
    n=2
    for ((i = 0; i < ${#EXTRA[@]}; i++)); do
        case "${EXTRA[i]}" in
            --nodes=*) n=${EXTRA[i]#--nodes=} ;;
            --nodes | -N) n=${EXTRA[i + 1]:-} ;;
            -N*) n=${EXTRA[i]#-N} ;;
        esac
    done
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "error: SBATCH_ARGS --nodes '$n': give a node count for SPARE_NODES" >&2; exit 2; }
    TRAIN_NODES=(--nodes=$((n + SPARE_NODES)))
    export SPARE_NODES
fi
if [[ -n "${IMAGE:-}" && -e "$IMAGE" ]]; then
    IMAGE=$(realpath "$IMAGE")  # a relative .sqsh would be taken for a registry name by Pyxis
    export IMAGE
fi
mkdir -p logs "$AB_DIR"
{  # the exact command, for `python -m llama_fp8 compare --repro` (it prints a script that re-runs the A/B)
    printf 'cd %q\n' "$PWD"
    for var in SBATCH_ARGS SEGMENT SPARE_NODES IMAGE AB_MODE AB_ORDER AB_PRESET CONTAINER_MOUNTS VENV; do
        if [[ -n "${!var:-}" ]]; then printf '%s=%q ' "$var" "${!var}"; fi
    done
    ARMS_ARG=()
    [[ "$AB_ARMS" == bf16,fp8 ]] || ARMS_ARG=(--arms "$AB_ARMS")
    [[ "$AB_EXTRA_STEPS" == 0 ]] || ARMS_ARG+=(--extra_steps "$AB_EXTRA_STEPS")
    printf '%q ' "$REPO_DIR/2.ab_fp8_vs_bf16.sh" --repeats "$AB_REPEATS" ${ARMS_ARG[@]+"${ARMS_ARG[@]}"} "$@"
    printf '\n'
} >"$AB_DIR/ab_command.sh"

if [[ "$AB_MODE" == same ]]; then
    JOB=$(sbatch --parsable ${EXTRA[@]+"${EXTRA[@]}"} ${TRAIN_EXTRA[@]+"${TRAIN_EXTRA[@]}"} ${TRAIN_NODES[@]+"${TRAIN_NODES[@]}"} \
        "$REPO_DIR/scripts/slurm/ab_job.sbatch" "$@")
    cat <<EOF
ab job:     $JOB   log logs/llama-fp8-ab_$JOB.out   (every arm on the same nodes, ${AB_ORDER:-${AB_ARMS//,/ }})
pairs:      $AB_REPEATS (run dirs: $AB_DIR/bf16 $AB_DIR/fp8 for one pair of bf16,fp8, else $AB_DIR/pair<i>/<arm>)
report:     $AB_DIR/report/ (written by the same job)
watch:      squeue -j $JOB
EOF
    exit 0
fi
[[ "$AB_MODE" == two-jobs ]] || { echo "error: AB_MODE=$AB_MODE: use same or two-jobs" >&2; exit 2; }
((AB_REPEATS == 1)) || { echo "error: --repeats $AB_REPEATS needs AB_MODE=same (pairs in one allocation)" >&2; exit 2; }
[[ "$AB_ARMS" != shootout ]] || { echo "error: --arms shootout needs AB_MODE=same (its node decides the arms)" >&2; exit 2; }
[[ "$AB_EXTRA_STEPS" == 0 ]] || { echo "error: --extra_steps needs AB_MODE=same (the schedule sets each arm's steps)" >&2; exit 2; }

submit_run() {  # submit_run NAME TRAIN_ARGS... -> prints the job id (an arm other than bf16/fp8 names its recipe)
    local name=$1 flags
    shift
    case "$name" in
        bf16) flags=(--fp8=0) ;;
        fp8) flags=(--fp8=1) ;;
        *) flags=(--fp8_recipe="$name" --fp8=1) ;;
    esac
    sbatch --parsable --job-name="llama-fp8-$name" ${EXTRA[@]+"${EXTRA[@]}"} ${TRAIN_EXTRA[@]+"${TRAIN_EXTRA[@]}"} \
        ${TRAIN_NODES[@]+"${TRAIN_NODES[@]}"} "$REPO_DIR/1.train_llama.sbatch" "$@" "${flags[@]}" --run_dir="$AB_DIR/$name"
}
JOBS=() DIRS=("$AB_DIR/bf16")
for arm in "${ARM_LIST[@]}"; do
    [[ "$arm" == bf16 ]] || DIRS+=("$AB_DIR/$arm")
done
AFTER=""  # the arms' job ids, colon-separated (the report's dependency)
for arm in "${ARM_LIST[@]}"; do
    job=$(submit_run "$arm" "$@")
    JOBS+=("$job")
    AFTER+="${AFTER:+:}$job"
done
COMPARE_ARMS=()
((${#ARM_LIST[@]} == 2)) || COMPARE_ARMS=(--arms "${#ARM_LIST[@]}")

# The report job: afterany (also report a failed run); SBATCH_ARGS first (partition, account, ...), then one
# task on one node, which win over any --nodes/--ntasks in SBATCH_ARGS.
if [[ -n "${IMAGE:-}" ]]; then
    RUN=(srun --container-image="$IMAGE" --container-mounts="${CONTAINER_MOUNTS:-$REPO_DIR:$REPO_DIR,$AB_DIR:$AB_DIR}"
        python)
else
    RUN=(env PYTHONPATH="$REPO_DIR/src" "${VENV:-$REPO_DIR/.venv}/bin/python")
fi
WRAP=$(printf '%q ' "${RUN[@]}" -m llama_fp8 compare "${DIRS[@]}" ${COMPARE_ARMS[@]+"${COMPARE_ARMS[@]}"} \
    --out "$AB_DIR/report")
if [[ " $* " == *" --mlflow_tracking_uri"* ]]; then  # the report as an MLflow run too (docs/metrics.md)
    WRAP+="&& { $(printf '%q ' "${RUN[@]}" -m llama_fp8 publish "$AB_DIR/report")|| echo 'warning: llama_fp8 publish could not log the report to MLflow' >&2; }"
fi
REPORT_JOB=$(sbatch --parsable ${EXTRA[@]+"${EXTRA[@]}"} --job-name=llama-fp8-report --nodes=1 --ntasks=1 \
    --output=logs/%x_%j.out --dependency="afterany:$AFTER" --wrap="$WRAP")

for i in "${!ARM_LIST[@]}"; do
    printf '%-11s %s   log logs/llama-fp8-%s_%s.out   run dir %s\n' "${ARM_LIST[$i]} job:" "${JOBS[$i]}" \
        "${ARM_LIST[$i]}" "${JOBS[$i]}" "$AB_DIR/${ARM_LIST[$i]}"
done
cat <<EOF
report job: $REPORT_JOB   (after every arm) -> $AB_DIR/report/
watch: squeue -j ${AFTER//:/,},$REPORT_JOB
EOF
