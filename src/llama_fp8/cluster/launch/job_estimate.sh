# shellcheck shell=bash
# The memory estimate before training (sourced by job_lib.sh; lf_estimate is called by the batch scripts after
# preflight). Uses job_lib.sh's PY, CONTAINER_ARGS, CPUS and lf_die. Safe on bash 4.2 under `set -u`.

# ---- estimate: will the run fit the GPUs' memory? `llama_fp8 estimate` (a fake process group and fake tensors: no
# GPU needed) as one task on the first node, for this job's nodes x processes and the GPUs' memory as nvidia-smi
# reports it (an H100's, with a warning, when it reports none). "Does not fit" stops the job before the training step
# starts on every node, with the estimate's report and its suggestions (each estimated) in the job log: exit 4, and
# exit 5 (it does not fit as estimated through a stand-in for an implementation that cannot run there, e.g. the TE
# model: an approximation, said so). IGNORE_ESTIMATE=1 lets such a job go on anyway, with a warning. Anything else lets
# the job go on with a warning (2: flags it cannot estimate, which training reports itself; a crash, or 30 minutes
# without an answer: srun's step time limit). SKIP_ESTIMATE=1 skips it; skipped on CPU. From a login node:
# python -m llama_fp8 estimate --nodes N TRAIN_ARGS.
lf_estimate() {  # lf_estimate TRAIN_ARGS...
    local does_not_fit=4 stand_in=5  # llama_fp8.errors.EXIT_DOES_NOT_FIT, EXIT_STAND_IN_DOES_NOT_FIT
    if [[ "${SKIP_ESTIMATE:-0}" == 1 ]]; then
        echo "estimate: skipped (SKIP_ESTIMATE=1)"
        return 0
    fi
    if [[ "$DEVICE" != cuda ]]; then
        echo "estimate: skipped (device $DEVICE: no GPU memory to fit)"
        return 0
    fi
    local mib mem_args=() rc=0
    # What PyTorch can allocate: the total less what the driver and firmware keep (551 MiB on an H100; estimate/gpus.py),
    # or the total where the driver has no memory.reserved field
    mib=$(nvidia-smi --query-gpu=memory.total,memory.reserved --format=csv,noheader,nounits 2>/dev/null | head -n 1 |
        awk -F', *' '$1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ { print $1 - $2 }') || true
    if ! [[ "$mib" =~ ^[0-9]+$ ]]; then
        mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1 | tr -d ' ') || true
    fi
    if [[ "$mib" =~ ^[0-9]+$ ]]; then
        mem_args=(--gpu_memory_gib "$(awk -v m="$mib" 'BEGIN { print m / 1024 }')")
    else
        echo "warning: estimate: nvidia-smi reported no memory.total ('${mib}'): checking against an H100's memory" >&2
    fi
    # The GPU's row (its NVLink and network, its nodes' NVLink domain: GB200 NVL72) from nvidia-smi's name, with this
    # host's python3 (estimate/gpus.py imports nothing else); no row: the estimate's default bandwidths
    local name row src
    src=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../../.." && pwd)  # this library is src/llama_fp8/...
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) || true
    row=$(PYTHONPATH="$src" "${HOST_PYTHON:-python3}" -m llama_fp8.estimate.gpus "$name" 2>/dev/null) || true
    if [[ "$row" =~ ^[A-Z0-9-]+$ ]]; then mem_args+=(--gpu "$row"); fi
    srun --nodes=1 --ntasks=1 --cpus-per-task="$CPUS" --time=30 ${CONTAINER_ARGS[@]+"${CONTAINER_ARGS[@]}"} \
        "${PY[@]}" -m llama_fp8 estimate --nodes "$SLURM_JOB_NUM_NODES" --gpus_per_node "$NPROC_PER_NODE" \
        ${mem_args[@]+"${mem_args[@]}"} "$@" || rc=$?
    local verdict=""
    if ((rc == does_not_fit)); then
        verdict="this configuration does not fit the GPUs' memory"
    elif ((rc == stand_in)); then
        verdict="this configuration does not fit the GPUs' memory as estimated through a stand-in for the job's model"
        verdict+=" implementation (an approximation: the STAND-IN line above)"
    elif ((rc != 0)); then
        echo "warning: estimate could not decide (exit code $rc): training goes on" >&2
    fi
    if [[ -n "$verdict" && "${IGNORE_ESTIMATE:-0}" == 1 ]]; then
        echo "warning: estimate: $verdict (report above); IGNORE_ESTIMATE=1: training starts anyway" >&2
    elif [[ -n "$verdict" ]]; then
        lf_die "estimate: $verdict (report above, ending with what would make it fit); change the flags, or set" \
            "IGNORE_ESTIMATE=1 to start it anyway"
    fi
    return 0
}
