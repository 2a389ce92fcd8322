# shellcheck shell=bash disable=SC2034  # LF_* variables: read by job_lib.sh, job_requeue.sh and the batch scripts
# The nodes of a job (sourced by job_lib.sh): which train and which wait as spares, which are left behind and how,
# and whether the job can run without a bad node before it is left behind. Safe on bash 4.2 under `set -u`.
#
# Reads SPARE_NODES (default 0: the job's last k nodes wait as spares; submit with --nodes=N+k), BAD_NODE_ACTION
# (auto: drain on HyperPod and ParallelCluster, whose drained nodes are replaced, exclude elsewhere; exclude, drain,
# reboot (HyperPod), none) and CLUSTER_KIND (auto: detected; hyperpod, parallelcluster, slurm).
# Files of a job, in logs/ (each cleared by the first run of a job id):
#   llama-fp8-nodes_<job>  one line per failure charged to a node ("NODE RUN.ROUND CHECKPOINT"), per node to leave
#                          behind at once ("NODE exclude": left to a spare, a failed health check or preflight), and
#                          per node this run of the job no longer uses ("NODE left RUN": a spare took its place)
#   llama-fp8-size_<job>   the number of training nodes N (the job's first run: its nodes less SPARE_NODES)

LF_NODE_FAILURES=2  # llama_fp8/cluster/launch/decide.py NODE_FAILURES: failures without a new checkpoint
LF_IN_PLACE="" LF_STEP_NODES=()
# What each cluster does with a node left behind (docs/reliability.md: Spare nodes): HyperPod replaces a node
# drained (State=FAIL) with the exact, case-sensitive reason Action:Replace, or reboots it with Action:Reboot
# (docs.aws.amazon.com/sagemaker/latest/dg/sagemaker-hyperpod-resiliency-slurm-replace-faulty-instance.html), any
# other reason leaves it drained; ParallelCluster's clustermgtd replaces a static node whose state is DRAIN or DOWN
# (docs.aws.amazon.com/parallelcluster/latest/ug/slurm-workload-manager-v3.html), keeping its name, so an exclusion
# would keep the job off the healthy replacement too.
LF_HYPERPOD_REPLACE="Action:Replace"
LF_HYPERPOD_REBOOT="Action:Reboot"

lf_is_hyperpod() { [[ -d /opt/sagemaker_cluster ]]; }

lf_cluster_kind() {  # hyperpod | parallelcluster | slurm (CLUSTER_KIND, else detected)
    local kind=${CLUSTER_KIND:-auto}
    if [[ "$kind" == auto ]]; then
        if lf_is_hyperpod; then
            kind=hyperpod
        elif [[ -d /opt/parallelcluster ]]; then
            kind=parallelcluster
        else
            kind=slurm
        fi
    fi
    echo "$kind"
}

lf_bad_node_action() {  # exclude | drain | reboot | none
    local action=${BAD_NODE_ACTION:-auto}
    if [[ "$action" == auto ]]; then
        case "$(lf_cluster_kind)" in
            hyperpod | parallelcluster) action=drain ;;
            *) action=exclude ;;
        esac
    fi
    echo "$action"
}

lf_check_node_knobs() {  # SPARE_NODES, BAD_NODE_ACTION, CLUSTER_KIND: checked before anything runs
    local spares=${SPARE_NODES:-0}
    [[ "$spares" =~ ^(0|[1-9][0-9]*)$ ]] ||
        lf_die "SPARE_NODES=$spares: must be a whole number >= 0 without leading zeros (default 0: no spare)"
    if ((spares > 0 && spares >= ${SLURM_JOB_NUM_NODES:-1})); then
        lf_die "SPARE_NODES=$spares: the job has ${SLURM_JOB_NUM_NODES:-1} node(s); submit with --nodes=N+$spares" \
            "(N training nodes and $spares spare(s))"
    fi
    case "${CLUSTER_KIND:-auto}" in
        auto | hyperpod | parallelcluster | slurm) ;;
        *) lf_die "CLUSTER_KIND=$CLUSTER_KIND: must be auto (default: detected), hyperpod, parallelcluster or slurm" ;;
    esac
    case "${BAD_NODE_ACTION:-auto}" in
        auto | exclude | drain | none) ;;
        reboot) [[ "$(lf_cluster_kind)" == hyperpod ]] ||
            lf_die "BAD_NODE_ACTION=reboot is HyperPod's $LF_HYPERPOD_REBOOT; this cluster is $(lf_cluster_kind)" \
                "(CLUSTER_KIND): use auto, exclude, drain or none" ;;
        *) lf_die "BAD_NODE_ACTION=$BAD_NODE_ACTION: must be auto (default), exclude, drain, reboot (HyperPod) or none" ;;
    esac
}

# ---- failures charged to nodes ----------------------------------------------------------------------------------
lf_nodes_file() { echo "$PWD/logs/llama-fp8-nodes_$SLURM_JOB_ID"; }

lf_note_nodes() {  # lf_note_nodes FAILED EXCLUDE: "n2@0:4,n2@1:4" and "n3" (or -) into the job's nodes file, once each
    local file entry node rest ckpt line
    file=$(lf_nodes_file)
    if ((${SLURM_RESTART_COUNT:-0} == 0)) && [[ -z "${LF_NODES_FRESH:-}" ]]; then
        rm -f "$file" 2>/dev/null
        LF_NODES_FRESH=1
    fi
    for entry in ${1//,/ } ${2//,/ }; do
        [[ "$entry" == - || -z "$entry" ]] && continue
        node=${entry%%@*}
        [[ "$node" =~ ^[A-Za-z0-9._-]+$ ]] || continue  # a node name, nothing else reaches scontrol
        if [[ "$entry" == *@* ]]; then
            rest=${entry#*@} ckpt=-
            if [[ "$rest" == *:* ]]; then ckpt=${rest#*:} rest=${rest%%:*}; fi
            [[ "$rest" =~ ^[0-9]+$ && "$ckpt" =~ ^(-|[0-9]+)$ ]] || continue
            line="$node ${SLURM_RESTART_COUNT:-0}.$rest $ckpt"
        else
            line="$node exclude"
        fi
        grep -qxF "$line" "$file" 2>/dev/null || echo "$line" >>"$file" 2>/dev/null || true
    done
}

# The nodes to leave behind (comma-separated): excluded at once, or charged LF_NODE_FAILURES times at the job's
# latest checkpoint (failures with a new complete checkpoint between them are not counted together: issue 46).
lf_bad_nodes() {
    local file
    file=$(lf_nodes_file)
    [[ -f "$file" ]] || return 0
    awk -v n="$LF_NODE_FAILURES" '
        $2 == "left" { next }
        $2 == "exclude" { bad[$1] = 1; next }
        { c = ($3 ~ /^[0-9]+$/) ? $3 + 0 : -1; at[NR] = c; who[NR] = $1; if (c > top) top = c }
        BEGIN { top = -1 }
        END { for (i in who) if (at[i] == top) seen[who[i]]++
              for (k in seen) if (seen[k] >= n) bad[k] = 1
              s = ""; for (k in bad) s = s (s ? "," : "") k; print s }' "$file"
}

lf_in_list() { [[ ",$2," == *",$1,"* ]]; }  # lf_in_list NODE COMMA_LIST

lf_leave_nodes() {  # lf_leave_nodes NODES: this run of the job stops using them (a spare of it takes their place)
    local node file
    file=$(lf_nodes_file)
    lf_note_nodes - "$1"
    for node in ${1//,/ }; do
        grep -qxF "$node left ${SLURM_RESTART_COUNT:-0}" "$file" 2>/dev/null ||
            echo "$node left ${SLURM_RESTART_COUNT:-0}" >>"$file" 2>/dev/null || true
    done
}

# In a step with spares, a node whose launcher wrote no decision while others did stopped answering (its launcher or
# its host gone; a spare took its place, or the step ended for it): this run of the job does not start it again.
# It is not excluded from a requeued job (Slurm knows whether it is down). node<N> is the step's N-th node.
lf_vanished() {  # lf_vanished FILES_WRITTEN
    local i=0 node gone=""
    [[ -n "${LF_SPARES:-}" ]] && (($1 > 0)) || return 0
    for node in ${LF_ACTIVE//,/ }; do
        [[ -f "$LF_OUTCOME_DIR/node$i" ]] || gone+="${gone:+,}$node"
        i=$((i + 1))
    done
    [[ -n "$gone" ]] || return 0
    echo "job $SLURM_JOB_ID: $gone stopped answering in the training step (no decision from its launcher): not used" \
        "again in this allocation"
    for node in ${gone//,/ }; do echo "$node left ${SLURM_RESTART_COUNT:-0}" >>"$(lf_nodes_file)" 2>/dev/null || true; done
}

lf_left_nodes() {  # the nodes this run of the job no longer uses (comma-separated)
    local file
    file=$(lf_nodes_file)
    [[ -f "$file" ]] || return 0
    awk -v run="${SLURM_RESTART_COUNT:-0}" '$2 == "left" && $3 == run { s = s (s ? "," : "") $1 } END { print s }' "$file"
}

lf_addr() {  # lf_addr NODE -> its Slurm NodeAddr (LF_NODE_ADDRS: lf_setup_rendezvous), else its name
    local kv
    for kv in ${LF_NODE_ADDRS-}; do
        if [[ "${kv%%=*}" == "$1" ]]; then
            echo "${kv#*=}"
            return
        fi
    done
    echo "$1"
}

# ---- the nodes of this run: training nodes first, then spares ----------------------------------------------------
# LF_TRAIN_COUNT (N), LF_ACTIVE (this run's nodes not left behind, in Slurm's order), LF_TRAINERS (the first N of
# them: the first node hosts the rendezvous), LF_SPARES (the rest), all comma-separated.
lf_setup_nodes() {
    local size_file="$PWD/logs/llama-fp8-size_$SLURM_JOB_ID" n="" node bad active="" i=0
    if ((${SLURM_RESTART_COUNT:-0} > 0)) && [[ -f "$size_file" ]]; then read -r n <"$size_file" || true; fi
    if ! [[ "$n" =~ ^[1-9][0-9]*$ ]]; then
        n=$((SLURM_JOB_NUM_NODES - ${SPARE_NODES:-0}))
        echo "$n" >"$size_file" 2>/dev/null || true
    fi
    LF_TRAIN_COUNT=$n
    bad=$(lf_left_nodes)
    for node in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do
        lf_in_list "$node" "$bad" || active+="${active:+,}$node"
    done
    LF_ACTIVE=$active LF_TRAINERS="" LF_SPARES=""
    for node in ${active//,/ }; do
        if ((i < n)); then LF_TRAINERS+="${LF_TRAINERS:+,}$node"; else LF_SPARES+="${LF_SPARES:+,}$node"; fi
        i=$((i + 1))
    done
    if ((i < n)); then
        lf_die "the job has $i usable node(s) ($active), it trains on $n: submit with more nodes or fewer SPARE_NODES"
    fi
    LF_STEP_NODES=(--nodes="$i" --nodelist="$active")  # every step: the training nodes and the spares
}

lf_nodes_known() { [[ -n "${LF_TRAIN_COUNT:-}" ]] || lf_setup_nodes; }

lf_say_nodes() {
    if [[ -n "$LF_SPARES" ]]; then
        echo "job $SLURM_JOB_ID: training on $LF_TRAINERS; spare(s) $LF_SPARES: they pass the same preflight and wait" \
            "to take the place of a training node that fails (SPARE_NODES=${SPARE_NODES:-0})"
    elif ((${SPARE_NODES:-0} > 0)); then
        echo "job $SLURM_JOB_ID: training on $LF_TRAINERS; no spare left (SPARE_NODES=$SPARE_NODES): a failed node is" \
            "restarted on if it comes back, else the job is requeued"
    fi
}

# ---- can the job run without some nodes? ----------------------------------------------------------------------------
# The nodes a requeued job could have now without EXCLUDED: this job's own other nodes (freed by the requeue) and
# the partition's idle nodes, none drained, down or failing, none in its ExcNodeList. (Slurm may still place it
# elsewhere later: this is what is there now.)
lf_capacity() {  # lf_capacity EXCLUDED -> "COUNT NODE,NODE,..."
    local excluded=$1 old own="" node state n=0 names=""
    old=$(scontrol -o show job "$SLURM_JOB_ID" 2>/dev/null | grep -o 'ExcNodeList=[^ ]*' | cut -d= -f2 || true)
    [[ "$old" == "(null)" ]] && old=""
    own=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | paste -sd, -)
    while read -r node state; do
        [[ -n "$node" ]] || continue
        lf_in_list "$node" "$excluded" && continue
        lf_in_list "$node" "$names" && continue
        if [[ -n "$old" ]] && lf_in_list "$node" "$(scontrol show hostnames "$old" 2>/dev/null | paste -sd, -)"; then
            continue
        fi
        case "$state" in *drain* | *drng* | *down* | *fail* | *maint* | *unk* | *"*"*) continue ;; esac
        if lf_in_list "$node" "$own" || [[ "$state" == idle* ]]; then
            n=$((n + 1))
            names+="${names:+,}$node"
        fi
    done < <(sinfo -h -N ${SLURM_JOB_PARTITION:+-p "$SLURM_JOB_PARTITION"} -o '%N %t' 2>/dev/null)
    echo "$n ${names:--}"
}

# A retry of the training step that asked to leave nodes behind (a node charged twice without a new checkpoint, a
# failed health check, no spare waiting in the step): leave them behind only where the job can run without them.
# Sets LF_IN_PLACE=1 when the step is to run again in this allocation: without them (a spare of the allocation
# takes their place: the rendezvous host itself cannot hand its place over inside the step), or, where the
# cluster has no node for the job without them, in place on them. Either is counted like a requeue without a new
# checkpoint (MAX_REQUEUES), so that a node that breaks every attempt cannot keep the job going forever.
lf_retry() {  # lf_retry SRUN_RC CHECKPOINT|- WHY -> 85 (LF_IN_PLACE=1: run the step again here) or not requeued
    local rc=$1 ckpt=$2 why=$3 bad left now="" rest="" node cap count names
    LF_IN_PLACE=""
    lf_nodes_known
    bad=$(lf_bad_nodes) left=$(lf_left_nodes)  # left: out of this allocation's steps already (a spare took over)
    for node in ${LF_ACTIVE//,/ }; do
        lf_in_list "$node" "$left" && continue
        if lf_in_list "$node" "$bad"; then now+="${now:+,}$node"; else rest+="${rest:+,}$node"; fi
    done
    if [[ -z "$now" ]]; then
        lf_count_requeue "$rc" "$ckpt" "$why"
        return
    fi
    count=$(tr ',' '\n' <<<"$rest" | grep -c . || true)
    if ((count >= LF_TRAIN_COUNT)); then
        LF_IN_PLACE=1
        lf_leave_nodes "$now"
        lf_count_requeue "$rc" "$ckpt" "$why; leaving $now behind: the training step starts again in this allocation on \
$(cut -d, -f1-"$LF_TRAIN_COUNT" <<<"$rest") (a spare takes its place, no requeue)" "restart of the training step"
        return
    fi
    read -r cap names < <(lf_capacity "$bad")
    if ((cap >= LF_TRAIN_COUNT)); then
        lf_count_requeue "$rc" "$ckpt" "$why; leaving $now behind: Slurm has $cap node(s) for the requeued job ($names)"
        return
    fi
    LF_IN_PLACE=1
    lf_count_requeue "$rc" "$ckpt" "$why; restarting the training step in place on $now: the job needs $LF_TRAIN_COUNT \
node(s); without $now Slurm could give it $cap ($names), and a requeue without it would wait in the queue for a node" \
        "restart in place"
}

# ---- what happens to a node left behind --------------------------------------------------------------------------
# Drained with the reason the cluster acts on: HyperPod's Action:Replace (Action:Reboot with BAD_NODE_ACTION=reboot),
# free text elsewhere. Needs Slurm operator rights; returns non-zero where Slurm refuses.
lf_drain() {  # lf_drain NODES ACTION
    local reason="failed in training (llama-fp8, Slurm job $SLURM_JOB_ID)" state=DRAIN why
    if [[ "$(lf_cluster_kind)" == hyperpod ]]; then
        state=FAIL reason=$LF_HYPERPOD_REPLACE
        if [[ "$2" == reboot ]]; then reason=$LF_HYPERPOD_REBOOT; fi
    fi
    scontrol update NodeName="$1" State="$state" Reason="$reason" || return
    case "$(lf_cluster_kind)/$reason" in
        hyperpod/"$LF_HYPERPOD_REBOOT") why="HyperPod reboots a node drained with this exact, case-sensitive reason" ;;
        hyperpod/*) why="HyperPod replaces a node drained with this exact, case-sensitive reason" ;;
        parallelcluster/*) why="ParallelCluster's clustermgtd replaces a drained static node, keeping its name" ;;
        *) why="BAD_NODE_ACTION=$2: no new job is placed on it until an administrator resumes it" ;;
    esac
    echo "job $SLURM_JOB_ID: $1 set to $state with reason \"$reason\" ($(lf_cluster_kind): $why)"
}

# On HyperPod the training step carries --auto-resume=1: HyperPod replaces a faulty node and runs the step again, and
# a replacement takes 20-30 minutes (awsome-distributed-training's HyperPod notes). A job that relies on it with a
# time limit under 120 minutes may spend most of it waiting for the replacement.
LF_AUTO_RESUME_MIN_S=7200
lf_check_time_limit() {
    local start=${SLURM_JOB_START_TIME:-} end=${SLURM_JOB_END_TIME:-}
    [[ "$(lf_cluster_kind)" == hyperpod && "$start" =~ ^[0-9]+$ && "$end" =~ ^[0-9]+$ ]] || return 0
    if ((end - start < LF_AUTO_RESUME_MIN_S)); then
        echo "warning: job $SLURM_JOB_ID relies on HyperPod's auto-resume with a time limit of $(((end - start) / 60))" \
            "min: a node replacement takes 20-30 min, ask for at least $((LF_AUTO_RESUME_MIN_S / 60)) min (--time)" \
            "or keep a spare node (SPARE_NODES)" >&2
    fi
}
