# shellcheck shell=bash
# Functions shared by the batch scripts (1.train_llama.sbatch, scripts/slurm/ab_job.sbatch); sourced inside
# the job, on its first node. Safe on bash 4.2 (Amazon Linux 2) under `set -u`: an array that can be empty
# is expanded as ${a[@]+"${a[@]}"} (bash < 4.4 calls "${a[@]}" of an empty array an unbound variable).
#
# Reads (all optional; docs/cluster.md: Environment variables): IMAGE, CONTAINER_MOUNTS, LLAMA_FP8_CONTAINER, KEEP_CONTAINER,
# HOST_PYTHON, VENV, REPO_DIR, DEVICE, NPROC_PER_NODE, RDZV_PORT, SKIP_PREFLIGHT, PREFLIGHT_REPORT, SKIP_ESTIMATE, IGNORE_ESTIMATE, NCCL_NET, SIGNAL_LEAD_S,
# MAX_RESTARTS, MAX_REQUEUES, SPARE_NODES, BAD_NODE_ACTION, CLUSTER_KIND.
# Sets: DEVICE DEVICE_ARGS NPROC_PER_NODE CPUS PY WHERE CONTAINER_ARGS RDZV_ADDR RDZV_PORT LF_NODE_ADDRS LF_OUTCOME_DIR,
# and the job's nodes (job_nodes.sh): LF_TRAIN_COUNT LF_ACTIVE LF_TRAINERS LF_SPARES.

# shellcheck disable=SC2034  # read by the scripts that source this file
EXIT_REQUEUE=85  # llama_fp8.errors.EXIT_REQUEUE: a checkpoint was saved after SIGUSR1/SIGTERM, requeue me
LF_EXTRA_PATHS=()  # NAME=PATH the calling script writes outside the run dir (AB_DIR): mounted or refused
LF_CONTAINER=""    # the Pyxis container name, once lf_setup_runtime chose one

lf_die() { echo "error: $*" >&2; exit 1; }

# sbatch exports the submitting shell's environment: a torchrun rank's variables left there (a job submitted from
# a notebook or a script launched by torchrun) would make every task of every step think it is rank 0 of 1.
# The steps below get theirs from srun (preflight) and torchrun (training).
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK ROLE_RANK TORCHELASTIC_RUN_ID

# ---- devices: GPUs per node are detected (never assumed); no GPU means CPU mode (gloo).
lf_gpus_per_node() {
    if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        echo "$SLURM_GPUS_ON_NODE"
    elif command -v nvidia-smi >/dev/null; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

lf_setup_devices() {
    local gpus
    gpus=$(lf_gpus_per_node)
    DEVICE=${DEVICE:-auto}
    DEVICE_ARGS=()  # an explicit DEVICE=cpu|cuda is passed on to training; `auto` lets training decide the same way
    if [[ "$DEVICE" != auto ]]; then DEVICE_ARGS=(--device "$DEVICE"); fi
    if [[ "$DEVICE" == auto ]]; then
        if ((gpus > 0)); then DEVICE=cuda; else DEVICE=cpu; fi
    fi
    if [[ "$DEVICE" == cuda ]]; then
        NPROC_PER_NODE=${NPROC_PER_NODE:-$gpus}
        # 3 (SkipCleanUp): on a timeout or an NCCL error the watchdog ends the process without aborting its
        # communicators (ncclCommAbort can itself hang: ProcessGroupNCCL.hpp); the launcher then restarts every rank.
        export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}
        export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
        # NCCL's flight recorder: the last collectives of the ranks that time out, dumped into the run folder's
        # comm_traces/ (training sets TORCH_FR_DUMP_TEMP_FILE there); `torch.distributed.flight_recorder` reads them.
        export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-20000}
        export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
    else
        NPROC_PER_NODE=${NPROC_PER_NODE:-2}
    fi
    CPUS=${SLURM_CPUS_ON_NODE:-1}
}

# ---- EFA (AWS): NCCL over libfabric through the aws-ofi-nccl plugin, only where EFA devices exist.
lf_efa_devices() {  # the number of InfiniBand devices bound to the efa driver
    local dev n=0
    for dev in /sys/class/infiniband/*; do
        if [[ "$(readlink -f "$dev/device/driver" 2>/dev/null)" == */efa ]]; then n=$((n + 1)); fi
    done
    echo "$n"
}

lf_setup_efa() {
    if (($(lf_efa_devices) == 0)); then return 0; fi
    export FI_PROVIDER=${FI_PROVIDER:-efa}
    export FI_EFA_FORK_SAFE=${FI_EFA_FORK_SAFE:-1}  # dataloader workers fork; needed on older kernels
    export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^docker,lo,veth}
    # Name the network so NCCL fails at init when the OFI plugin does not load, instead of silently using TCP
    # sockets. "AWS Libfabric" is accepted by every aws-ofi-nccl version (llama_fp8/cluster/nodes/nccl.py).
    export NCCL_NET=${NCCL_NET:-AWS Libfabric}
}

# ---- the image: a .sqsh file must be an absolute path (Pyxis treats an image that does not start with "/" or
# "." as a registry name: pyxis_slurmstepd.c, strspn(image, "./")); recorded for the run's meta record.
lf_resolve_image() {
    if [[ -e "$IMAGE" ]]; then
        IMAGE=$(realpath "$IMAGE")
        export LLAMA_FP8_IMAGE="$IMAGE"
        LLAMA_FP8_IMAGE_SIZE=$(stat -c %s "$IMAGE")
        LLAMA_FP8_IMAGE_MTIME=$(date -u -d "@$(stat -c %Y "$IMAGE")" +%Y-%m-%dT%H:%M:%SZ)
        export LLAMA_FP8_IMAGE_SIZE LLAMA_FP8_IMAGE_MTIME
        if [[ -f "$IMAGE.sha256" && ! "$IMAGE" -nt "$IMAGE.sha256" ]]; then  # written by scripts/build_image.sh
            LLAMA_FP8_IMAGE_SHA256=$(cut -d' ' -f1 "$IMAGE.sha256")
            export LLAMA_FP8_IMAGE_SHA256
        fi
    elif [[ "$IMAGE" == *.sqsh || "$IMAGE" == *.squashfs ]]; then
        lf_die "IMAGE=$IMAGE: no such file (relative to $PWD)"
    else
        export LLAMA_FP8_IMAGE="$IMAGE"  # a registry image (nvcr.io#nvidia/pytorch:..., docker://...)
    fi
    export IMAGE
}

# ---- mounts: every path the run touches outside the repository is mounted (CONTAINER_MOUNTS unset) or refused
# (CONTAINER_MOUNTS set), here on the host before any srun. The check needs python3 >= 3.7 on this node; without
# it the repository and the working directory are mounted and preflight checks the rest inside the container.
lf_container_mounts() {  # lf_container_mounts TRAIN_ARGS... -> the --container-mounts value on stdout
    local py=${HOST_PYTHON:-python3} margs=() extra
    if [[ -n "${CONTAINER_MOUNTS:-}" ]]; then margs=(--mounts "$CONTAINER_MOUNTS"); fi
    for extra in ${LF_EXTRA_PATHS[@]+"${LF_EXTRA_PATHS[@]}"}; do margs+=(--path "$extra"); done
    if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 7))' 2>/dev/null; then
        echo "warning: no python3 >= 3.7 on $(hostname) (HOST_PYTHON): mount check left to preflight" >&2
        echo "${CONTAINER_MOUNTS:-$REPO_DIR:$REPO_DIR,$PWD:$PWD}"
        return 0
    fi
    PYTHONPATH="$REPO_DIR/src" "$py" -m llama_fp8.cluster.launch.mounts --repo "$REPO_DIR" --workdir "$PWD" \
        ${margs[@]+"${margs[@]}"} -- "$@"
}

# ---- where to run: the Enroot image through Pyxis (one named container per node for the whole job), or the
# repository's virtualenv.
lf_setup_runtime() {  # lf_setup_runtime TRAIN_ARGS...
    CONTAINER_ARGS=()
    if [[ -n "${IMAGE:-}" ]]; then
        local help
        help=$(srun --help 2>&1 || true)
        if [[ "$help" != *--container-image* ]]; then
            echo "error: IMAGE=$IMAGE is set but srun has no --container-image (Pyxis is not installed)." >&2
            lf_die "      Unset IMAGE to use the virtualenv $REPO_DIR/.venv, or install Pyxis + Enroot."
        fi
        lf_resolve_image
        local mounts
        mounts=$(lf_container_mounts "$@") || lf_die "the run would lose or miss the paths above (see docs/cluster.md: Troubleshooting)"
        export LLAMA_FP8_CONTAINER_MOUNTS="$mounts"  # preflight re-checks the resolved config against it
        # Named: the preflight step unpacks the image once per node and every later step reuses it. (Not taken
        # from $CONTAINER_NAME: container tools set that variable in many environments.)
        LF_CONTAINER=${LLAMA_FP8_CONTAINER:-llama-fp8-$SLURM_JOB_ID}
        CONTAINER_ARGS=(--container-image="$IMAGE" --container-name="$LF_CONTAINER"
            --container-mounts="$mounts" --container-workdir="$PWD")
        lf_container_env "$help"
        PY=(python)
        WHERE="image $IMAGE (container $LF_CONTAINER, mounts $mounts)"
        trap lf_remove_containers EXIT
        # A requeued run of the job (same id, same name) must not reuse what an earlier run left on a node: its
        # removal can be cut short by the requeue itself or by a lost node, and Pyxis would take a half-removed
        # or half-unpacked folder as the container. Unless it is kept on purpose, it goes before the first step.
        if ((${SLURM_RESTART_COUNT:-0} > 0)) && [[ "${KEEP_CONTAINER:-0}" != 1 ]]; then
            lf_remove_containers quiet || true
            LF_CONTAINER=${LLAMA_FP8_CONTAINER:-llama-fp8-$SLURM_JOB_ID}
        fi
    else
        VENV=${VENV:-$REPO_DIR/.venv}
        [[ -x "$VENV/bin/python" ]] || lf_die "no $VENV/bin/python: set VENV=/path/to/venv or IMAGE=/path/to/image.sqsh"
        PY=("$VENV/bin/python")
        WHERE="venv $VENV"
        export PYTHONPATH="$REPO_DIR/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
}

# Pyxis sets every exported variable in the container, but where the image sets one too (its ENV: this image sets
# NCCL_NET_PLUGIN and NCCL_TUNER_PLUGIN, NGC's sets more) the image's value wins, silently, unless --container-env
# names it (pyxis_slurmstepd.c, spank_import_container_env). The network settings exported here, by this script
# (lf_setup_efa, lf_setup_devices) or by the user, are meant to win: NCCL_*, FI_* and TORCH_NCCL_* are named.
lf_container_env() {  # lf_container_env SRUN_HELP: adds --container-env to CONTAINER_ARGS
    local names
    names=$(compgen -e | { grep -E '^(NCCL|FI|TORCH_NCCL)_' || true; } | paste -sd, -)
    [[ -n "$names" ]] || return 0
    if [[ "$1" == *--container-env* ]]; then
        CONTAINER_ARGS+=(--container-env="$names")
    else  # Pyxis < 0.15
        echo "warning: this Pyxis has no --container-env: where the image sets one of $names, its value wins" >&2
    fi
}

lf_remove_containers() {  # [quiet]: the job's named containers, on every node (Pyxis keeps named containers)
    local rc=$?
    if [[ "${KEEP_CONTAINER:-0}" != 1 && -n "$LF_CONTAINER" ]]; then
        # pyxis names them pyxis_<name> (container_scope=global) or pyxis_<jobid>_<name> (scope=job).
        if srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 bash -c "command -v enroot >/dev/null || exit 0;
            enroot list | grep -E '^pyxis_(${SLURM_JOB_ID}_)?${LF_CONTAINER}\$' | xargs -r -n 1 enroot remove -f" \
            >/dev/null 2>&1; then
            LF_CONTAINER=""  # removed: nothing left for the EXIT trap
        elif [[ "${1:-}" != quiet ]]; then
            echo "warning: could not remove container $LF_CONTAINER on every node" >&2
        fi
    fi
    return "$rc"
}

# ---- rendezvous: c10d store on the first node, a port derived from the job id.
lf_setup_rendezvous() {
    local first line name addr
    first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    # Node names need not resolve (and differ from addresses on many clusters): ask Slurm for the addresses of
    # the job's nodes, in one call ("NAME=ADDR ..."; each node's launcher takes its own: lf_train).
    LF_NODE_ADDRS="" RDZV_ADDR=""
    while read -r line; do
        name="" addr=""
        if [[ "$line" =~ (^|[[:space:]])NodeName=([^[:space:]]+) ]]; then name=${BASH_REMATCH[2]}; fi
        if [[ "$line" =~ (^|[[:space:]])NodeAddr=([^[:space:]]+) ]]; then addr=${BASH_REMATCH[2]}; fi
        if [[ -n "$name" && -n "$addr" ]]; then LF_NODE_ADDRS+="$name=$addr "; fi
        if [[ "$name" == "$first" ]]; then RDZV_ADDR=$addr; fi
    done < <(scontrol -o show node "$SLURM_JOB_NODELIST")
    if [[ -z "$RDZV_ADDR" ]]; then RDZV_ADDR=$first; fi
    RDZV_PORT=${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
}

# ---- preflight on every node, one task per GPU (per process slot on CPU): node checks, then an all-reduce over
# all of them that reports its bus bandwidth and the network NCCL chose. Its JSON report goes to every run's
# metrics.jsonl meta record (LLAMA_FP8_PREFLIGHT). SKIP_PREFLIGHT=1 skips it.
lf_preflight() {  # lf_preflight TRAIN_ARGS...
    lf_nodes_known
    if [[ "${SKIP_PREFLIGHT:-0}" == 1 ]]; then
        echo "preflight: skipped (SKIP_PREFLIGHT=1)"
        return 0
    fi
    export LLAMA_FP8_PREFLIGHT=${PREFLIGHT_REPORT:-$PWD/logs/llama-fp8-preflight_$SLURM_JOB_ID.json}
    mkdir -p "$(dirname "$LLAMA_FP8_PREFLIGHT")"
    # FSx for Lustre: the image has no Lustre client tools; where this host has them, preflight leaves the stripe
    # count and the LNet proof to lf_lustre_on_hosts (llama_fp8/cluster/nodes/lustre.py)
    if [[ -n "${IMAGE:-}" ]] && command -v lfs >/dev/null; then export LLAMA_FP8_LUSTRE_ON_HOST=1; fi
    local per_task=$((CPUS / NPROC_PER_NODE))
    MASTER_ADDR="$(lf_addr "${LF_ACTIVE%%,*}")" MASTER_PORT=$((RDZV_PORT + 1)) \
        LLAMA_FP8_TRAIN_TASKS=$((LF_TRAIN_COUNT * NPROC_PER_NODE)) \
        srun "${LF_STEP_NODES[@]}" --ntasks-per-node="$NPROC_PER_NODE" --cpus-per-task=$((per_task > 0 ? per_task : 1)) \
        --kill-on-bad-exit=1 ${CONTAINER_ARGS[@]+"${CONTAINER_ARGS[@]}"} \
        "${PY[@]}" -m llama_fp8 preflight --device "$DEVICE" --report "$LLAMA_FP8_PREFLIGHT" -- "$@" || return $?
    lf_lustre_on_hosts
}

# The FSx for Lustre findings preflight could not make in the image (lfs, lnetctl), made on every node with the
# host's tools and python3 (stdlib only) for the folder and shard size preflight reported; nothing when the run's
# checkpoint folder is not on Lustre. A FAIL (lfs not answering, an EFA NI down, the test write failing) fails it.
lf_lustre_on_hosts() {
    [[ "${LLAMA_FP8_LUSTRE_ON_HOST:-0}" == 1 ]] || return 0
    local src
    src=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../../.." && pwd)  # this library is src/llama_fp8/...
    srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 env PYTHONPATH="$src" \
        "${HOST_PYTHON:-python3}" -m llama_fp8.cluster.nodes.lustre --from_report "$LLAMA_FP8_PREFLIGHT"
}

# ---- training: one `llama_fp8 launch` per node: torchrun's elastic agent (llama_fp8/cluster/launch/elastic.py). When a
# worker dies or fails it restarts the workers of every node in this allocation, which resume from the latest
# complete checkpoint, up to MAX_RESTARTS times for this training step (the srun below: a requeued job, and each
# arm of the A/B job, start with the full count again); exit 2 (bad config or data), 3 (non-finite loss), the
# same step failing twice and a SIGUSR1/SIGTERM are never restarted. The first node's launcher hosts the
# rendezvous (is_host, explicit: names and addresses need not match); losing it ends the step, and the job is
# requeued.
lf_check_knobs() {  # MAX_RESTARTS and MAX_REQUEUES are counts, the node knobs too (job_nodes.sh): before anything runs
    local name value
    for name in MAX_RESTARTS MAX_REQUEUES; do
        value=${!name-3}
        [[ "$value" =~ ^(0|[1-9][0-9]*)$ ]] ||
            lf_die "$name=$value: must be a whole number >= 0 without leading zeros (default 3; 0 turns it off)"
    done
    lf_check_node_knobs
}

# The per-node wrapper of the training step, run by srun on each node with the address map as $1: this node's
# Slurm address for torchrun's --local_addr (the workers' MASTER_ADDR is rank 0's node's: torch otherwise takes
# socket.getfqdn(), a name that need not resolve), and is_host (node 0 hosts the rendezvous store) added to any
# --rdzv_conf the user set in PET_RDZV_CONF (e.g. join_timeout=900).
# shellcheck disable=SC2016  # expanded by the task's shell, on its node
# A node named in $2 (comma-separated, or "none") is a spare: its launcher waits (LLAMA_FP8_SPARE, spares.py).
LF_NODE_WRAPPER='addr=""
for kv in $1; do if [[ "${kv%%=*}" == "${SLURMD_NODENAME-}" ]]; then addr=${kv#*=}; fi; done
if [[ ",$2," == *",${SLURMD_NODENAME-},"* ]]; then export LLAMA_FP8_SPARE=1; fi
shift 2
if [[ -n "$addr" ]]; then export PET_LOCAL_ADDR="$addr"; fi
export PET_RDZV_CONF="${PET_RDZV_CONF:+$PET_RDZV_CONF,}is_host=$((SLURM_NODEID == 0))"
exec "$@"'

lf_train() {  # lf_train TRAIN_ARGS... ; returns 0, 85 (requeue me, or LF_IN_PLACE=1: run it again) or a code (lf_outcome)
    local resume=() rc attempt addrs=${LF_NODE_ADDRS-} kill=(--kill-on-bad-exit=1) endpoint
    if [[ -z "$addrs" ]]; then addrs=none; fi  # no map: torchrun finds its own address
    lf_nodes_known
    if [[ "$(lf_cluster_kind)" == hyperpod ]]; then
        # SageMaker HyperPod: replace faulty nodes and resume. An srun flag (sbatch rejects it), and it only
        # applies to the step that carries it: the training step.
        resume=(--auto-resume=1)
    fi
    # With spares, a node whose launcher dies (its host gone) must not end the step: the others restart with a
    # spare in its place. --no-kill also keeps the step going when Slurm sets that node DOWN (with sbatch --no-kill).
    if [[ -n "$LF_SPARES" ]]; then kill=(--no-kill); fi
    # Each node's launcher writes its final decision here (code, action, checkpoint, one line); srun's own exit
    # code cannot carry it: it is 143 as soon as one node ends before the others (--kill-on-bad-exit). One folder
    # and one rendezvous id per run of the job (SLURM_RESTART_COUNT) and per start of the step in it: a launcher of
    # an earlier one that is still going away can neither write into this one's decisions nor join its rendezvous.
    LF_STEP_RUN=$((${LF_STEP_RUN:-0} + 1))
    attempt="${SLURM_JOB_ID}.${SLURM_RESTART_COUNT:-0}"
    if ((LF_STEP_RUN > 1)); then attempt+=".$LF_STEP_RUN"; fi
    LF_OUTCOME_DIR="$PWD/logs/llama-fp8-outcome_$attempt"
    rm -rf "$LF_OUTCOME_DIR"
    mkdir -p "$LF_OUTCOME_DIR"
    lf_say_nodes
    endpoint="$(lf_addr "${LF_TRAINERS%%,*}"):$RDZV_PORT"  # the first training node's launcher hosts it
    LLAMA_FP8_OUTCOME_DIR="$LF_OUTCOME_DIR" LLAMA_FP8_CLUSTER_KIND="$(lf_cluster_kind)" \
        srun "${LF_STEP_NODES[@]}" --ntasks-per-node=1 --cpus-per-task="$CPUS" "${kill[@]}" \
        ${CONTAINER_ARGS[@]+"${CONTAINER_ARGS[@]}"} ${resume[@]+"${resume[@]}"} \
        bash -c "$LF_NODE_WRAPPER" lf_node "$addrs" "${LF_SPARES:-none}" \
        "${PY[@]}" -m llama_fp8 launch \
        --nnodes="$LF_TRAIN_COUNT" --nproc_per_node="$NPROC_PER_NODE" --max_restarts="${MAX_RESTARTS:-3}" \
        --rdzv_backend=c10d --rdzv_endpoint="$endpoint" --rdzv_id="$attempt" \
        -m llama_fp8 train ${DEVICE_ARGS[@]+"${DEVICE_ARGS[@]}"} "$@"
    rc=$?
    lf_outcome "$rc"
}

# The training step, run again in this allocation when lf_outcome says so (LF_IN_PLACE: a node left to a spare of
# the allocation, or a bad node the job cannot run without), each time counted in MAX_REQUEUES.
# Each start takes the job's nodes as they are now: a node left to a spare (the step's own swap) stays out.
lf_run_training() {  # lf_run_training TRAIN_ARGS... -> 0, 85 (requeue me) or a failure's code
    local rc
    unset LLAMA_FP8_STEP_AGAIN
    while :; do
        rc=0
        lf_setup_nodes
        lf_train "$@" || rc=$?
        if ((rc != EXIT_REQUEUE)) || [[ -z "${LF_IN_PLACE:-}" ]]; then return "$rc"; fi
        export LLAMA_FP8_STEP_AGAIN=1  # training continues this step's run folder (telemetry/goodput.py)
    done
}

# ---- the time limit's lead (llama_fp8/telemetry/time_limit.py): how long before the end Slurm's warning comes, for
# training and the estimate to compare with the save time. SIGNAL_LEAD_S wins; else SBATCH_SIGNAL (sbatch's own
# variable, when the job was submitted with it); else this script's #SBATCH --signal line (Slurm runs a copy of it:
# $0). A --signal given on sbatch's command line does not reach the job: set SIGNAL_LEAD_S with it.
lf_signal_lead() {
    local spec lead=${SIGNAL_LEAD_S:-}
    if [[ -z "$lead" ]]; then
        spec=${SBATCH_SIGNAL:-$(grep -m 1 -oE '^#SBATCH[[:space:]]+--signal=[^[:space:]]+' "$0" 2>/dev/null | cut -d= -f2 || true)}
        if [[ "$spec" =~ @([0-9]+)$ ]]; then lead=${BASH_REMATCH[1]}; elif [[ -n "$spec" ]]; then lead=60; fi
    fi
    [[ -z "$lead" || "$lead" =~ ^[0-9]+$ ]] || lf_die "SIGNAL_LEAD_S=$lead: must be whole seconds"
    if [[ -n "$lead" ]]; then export LLAMA_FP8_SIGNAL_LEAD_S=$lead; fi
}

lf_setup() {  # lf_setup TRAIN_ARGS...: everything before the first srun
    lf_check_knobs
    lf_signal_lead
    lf_setup_devices
    lf_setup_efa
    lf_setup_runtime "$@"
    lf_setup_rendezvous
    lf_setup_nodes
    echo "job $SLURM_JOB_ID: $SLURM_JOB_NUM_NODES node(s) x $NPROC_PER_NODE process(es), device $DEVICE," \
        "rendezvous $(lf_addr "${LF_TRAINERS%%,*}"):$RDZV_PORT, $WHERE, cluster $(lf_cluster_kind)," \
        "BAD_NODE_ACTION=$(lf_bad_node_action)"
    lf_say_nodes
    lf_check_time_limit
    if [[ -n "${NCCL_NET:-}" ]]; then echo "EFA: $(lf_efa_devices) device(s), NCCL_NET=$NCCL_NET"; fi
}

# The job's nodes (training, spares, left behind), then the launchers' decisions after the training step, the
# requeue count and the requeue.
# shellcheck source=src/llama_fp8/cluster/launch/job_nodes.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/job_nodes.sh"
# shellcheck source=src/llama_fp8/cluster/launch/job_requeue.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/job_requeue.sh"
# shellcheck source=src/llama_fp8/cluster/launch/job_estimate.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/job_estimate.sh"
