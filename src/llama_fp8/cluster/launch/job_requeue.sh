# shellcheck shell=bash
# After the training step (sourced by job_lib.sh): the launchers' decisions, the requeue count, and the requeue
# itself, leaving behind the nodes the job can run without (job_nodes.sh). Safe on bash 4.2 under `set -u`.
#
# Files of a job, in logs/ (each cleared by the first run of a job id: a rebuilt cluster reuses ids):
#   llama-fp8-requeues_<job>  one line per requeue without a new checkpoint ("CHECKPOINT requeue N of CAP: why")
# Reads MAX_REQUEUES (default 3) and BAD_NODE_ACTION (job_nodes.sh).

# ---- the launchers' decisions (LF_OUTCOME_DIR/node<N>: "CODE ACTION CHECKPOINT FAILED EXCLUDE LINE"), one line
# saying what happened and what comes next, and the code for the calling script. A failure that a restart cannot
# fix (ACTION fail) wins over a requeue; a checkpoint saved after a signal (requeue) is always requeued; a node that
# finished (done) means the training is complete (every rank passed the final checkpoint), whatever the others
# say; a requeue that saved nothing new (retry: a signal during a restart, the rendezvous host lost, a start-up
# failing twice, a node to leave behind; closed; a launcher killed without a word: srun's code >= 128) is requeued
# at most MAX_REQUEUES times without a new checkpoint, so that a node that breaks every attempt cannot requeue the
# job forever (Slurm requeues a node failure by itself: NODE_FAIL, --requeue), or run again in this allocation
# where a node to leave behind can be left to a spare, or cannot be left behind at all (lf_retry: LF_IN_PLACE=1);
# a launcher that failed by itself before deciding (srun's code < 128) is not requeued. A node that handed its
# place to a spare (left) and a spare never needed (spare) decide nothing for the job. FAILED
# (node@round:checkpoint, the failures charged to a node in this step) and EXCLUDE (nodes to leave behind at once)
# go to the job's nodes file, whatever the decision.
lf_outcome() {  # lf_outcome SRUN_RC -> return 0, 85 or the failure's code
    local rc=$1 f code action ckpt failed exclude line fail="" failcode=0 requeue="" retry="" finished="" closed=""
    local files=0 latest="" unused=""
    for f in "$LF_OUTCOME_DIR"/node*; do
        [[ -f "$f" ]] || continue
        files=$((files + 1))
        read -r code action ckpt failed exclude line <"$f" || true
        if [[ "$ckpt" =~ ^[0-9]+$ ]] && ((ckpt > ${latest:--1})); then latest=$ckpt; fi
        lf_note_nodes "$failed" "$exclude"
        case "$action" in
            fail) fail=$line; failcode=$code ;;
            requeue) requeue=$line ;;
            retry) retry=$line ;;
            done) finished=$line ;;
            closed) closed=$line ;;
            left) echo "job $SLURM_JOB_ID: $line"; lf_leave_nodes "$exclude" ;;
            spare) unused=1 ;;
        esac
    done
    lf_vanished "$files"
    # shellcheck disable=SC2034  # read by lf_run_training (job_lib.sh)
    LF_IN_PLACE=""
    if [[ -n "$fail" ]]; then
        echo "job $SLURM_JOB_ID: $fail; not requeued"
        return "$failcode"
    fi
    if [[ -n "$requeue" ]] || ((files == 0 && rc == EXIT_REQUEUE)); then  # no files: $LF_OUTCOME_DIR not writable
        echo "job $SLURM_JOB_ID: ${requeue:-training saved a checkpoint and exited 85}"
        return "$EXIT_REQUEUE"
    fi
    if [[ -n "$finished" ]]; then
        echo "job $SLURM_JOB_ID: $finished${retry:+ (another node then: $retry)}${closed:+ (another node then: $closed)}"
        return 0
    fi
    if [[ -z "$retry$closed" ]] && ((rc < 128)); then  # no decision and no signal: a launcher failed by itself
        if ((rc != 0)); then
            echo "job $SLURM_JOB_ID: the training step failed with code $rc before its launchers decided (the error is above); not requeued"
        fi
        return "$rc"
    fi
    retry=${retry:-${closed:+a launcher ended the job without a word ($closed)}}
    if [[ -n "${LF_SPARES:-}" && -z "$unused" ]]; then retry+="${retry:+; }no spare was left (SPARE_NODES=${SPARE_NODES:-0})"; fi
    lf_retry "$rc" "${latest:--}" "$retry"
}

# A requeue without a new checkpoint, counted in logs/llama-fp8-requeues_<job>, one line per requeue ("CHECKPOINT
# requeue N of CAP: why"). The count starts again when the launchers report a later complete checkpoint than any
# counted requeue; a first run of the job (SLURM_RESTART_COUNT 0) ignores a count an earlier job with this id left
# (a rebuilt cluster reuses ids). A requeue that cannot be counted is not made.
lf_count_requeue() {  # lf_count_requeue SRUN_RC CHECKPOINT|- WHY [WHAT] -> return 85, or not requeued
    local rc=$1 latest=$2 line=$3 what=${4:-} cap=${MAX_REQUEUES:-3} counter="$PWD/logs/llama-fp8-requeues_$SLURM_JOB_ID"
    local count=0 best=-1 c _ no=$(($1 == 0 || $1 == EXIT_REQUEUE ? 1 : $1))
    line=${line:-"the training step ended with code $rc, a launcher killed before it decided (the first node's launcher or a node lost)"}
    [[ "$cap" =~ ^(0|[1-9][0-9]*)$ ]] || lf_die "MAX_REQUEUES=$cap: must be a whole number >= 0 without leading zeros"
    if ((${SLURM_RESTART_COUNT:-0} == 0)); then rm -f "$counter" 2>/dev/null; fi
    if [[ -f "$counter" ]]; then
        while read -r c _; do
            count=$((count + 1))
            if [[ "$c" =~ ^[0-9]+$ ]] && ((c > best)); then best=$c; fi
        done <"$counter"
    fi
    if [[ "$latest" =~ ^[0-9]+$ ]] && ((count > 0 && latest > best)); then
        echo "job $SLURM_JOB_ID: checkpoint step $latest is newer than the last requeue's: requeues without a new checkpoint counted from 0"
        count=0
        : >"$counter" 2>/dev/null || true
    fi
    if ((count >= cap)); then
        echo "job $SLURM_JOB_ID: $line; not requeued: $count requeue(s) without a new checkpoint already (MAX_REQUEUES=$cap)"
        return "$no"
    fi
    if ! { echo "$latest ${what:-requeue} $((count + 1)) of $cap: $line" >>"$counter"; } 2>/dev/null; then
        echo "job $SLURM_JOB_ID: $line; not requeued: the requeue cannot be counted in $counter (MAX_REQUEUES bounds requeues only where logs/ is writable)"
        return "$no"
    fi
    if [[ -n "$what" ]]; then
        echo "job $SLURM_JOB_ID: $line; $what ($((count + 1)) of $cap without a new checkpoint, MAX_REQUEUES)"
    else
        echo "job $SLURM_JOB_ID: $line; requeue $((count + 1)) of $cap (MAX_REQUEUES)"
    fi
    return "$EXIT_REQUEUE"
}

# ---- the requeue, leaving nodes behind ----------------------------------------------------------------------------
# A running job's ExcNodeList cannot be changed (slurmctld: "Job is no longer pending execution"), and this script
# dies with the job's requeue. So a helper job (one task for a few seconds, on any node but the bad ones) waits until
# this job is requeued and held (scontrol requeuehold), sets its ExcNodeList and releases it.
lf_release_script() {  # lf_release_script JOB NODES [NUM_NODES] -> the helper's script on stdout
    printf '%s\n' "for _ in \$(seq 300); do" \
        "  if scontrol -o show job $1 | grep -q 'JobState=PENDING'; then break; fi; sleep 2" \
        "done" \
        "scontrol update JobId=$1 ExcNodeList=$2${3:+ NumNodes=$3} && scontrol release $1 && echo 'job $1: released without $2'"
}

lf_requeue() {  # requeue this job (it resumes from its latest complete checkpoint), leaving its bad nodes behind
    local bad excluded helper old action cap names size="" args=()
    # The containers go first, while the job still has its nodes (`scontrol requeue` ends every step at once:
    # removing them afterwards, in the EXIT trap, no longer can).
    lf_remove_containers || true
    bad=$(lf_bad_nodes)
    action=$(lf_bad_node_action)
    if [[ -z "$bad" || "$action" == none ]]; then
        scontrol requeue "$SLURM_JOB_ID"
        return
    fi
    if [[ "$action" == drain || "$action" == reboot ]]; then
        if lf_drain "$bad" "$action"; then
            scontrol requeue "$SLURM_JOB_ID"
            return
        fi
        echo "warning: could not drain $bad (Slurm operator rights needed): leaving it out of this job instead$(
            [[ "$(lf_cluster_kind)" == parallelcluster ]] && echo "; ParallelCluster replaces it only once drained," \
                "and the exclusion keeps the job off the replacement (same name): clear it with scontrol update" \
                "JobId=$SLURM_JOB_ID ExcNodeList=")" >&2
    fi
    # Fewer nodes than asked where the cluster has no more without the bad ones (spares used up): never below N.
    lf_nodes_known
    read -r cap names < <(lf_capacity "$bad")
    if ((cap < SLURM_JOB_NUM_NODES && cap >= ${LF_TRAIN_COUNT:-$SLURM_JOB_NUM_NODES})); then size=$cap; fi
    old=$(scontrol -o show job "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*' | cut -d= -f2)
    excluded=$bad
    if [[ -n "$old" && "$old" != "(null)" ]]; then excluded="$old,$bad"; fi
    if [[ -n "${SLURM_JOB_PARTITION:-}" ]]; then args+=(--partition="$SLURM_JOB_PARTITION"); fi
    if [[ -n "${SLURM_JOB_ACCOUNT:-}" ]]; then args+=(--account="$SLURM_JOB_ACCOUNT"); fi
    if helper=$(sbatch --parsable --job-name="llama-fp8-release-$SLURM_JOB_ID" --nodes=1 --ntasks=1 --time=15 \
        --exclude="$bad" --output="$PWD/logs/llama-fp8-release_%j.out" ${args[@]+"${args[@]}"} \
        --wrap="$(lf_release_script "$SLURM_JOB_ID" "$excluded" "$size")"); then
        echo "job $SLURM_JOB_ID: requeued without $bad (ExcNodeList=$excluded${size:+, $size node(s): $names}, set and" \
            "released by job ${helper%%;*})"
        scontrol requeuehold "$SLURM_JOB_ID"
    else
        echo "warning: could not submit the job that leaves $bad behind: requeueing without it excluded" >&2
        scontrol requeue "$SLURM_JOB_ID"
    fi
}

# A preflight that fails on nodes it names (the report's .failed file) leaves them behind instead of failing the job
# where the job can train without them: in this allocation when enough of its nodes passed (a spare that fails
# its preflight is never used; the others are checked again without it), else on a requeue (a node that broke
# since the job last ran is the usual cause). On a first run without spares to spare it fails the job.
lf_preflight_failed() {  # lf_preflight_failed RC TRAIN_ARGS... -> returns 0 (checked again without them) or exits
    local rc=$1 nodes="" node failed="${LLAMA_FP8_PREFLIGHT:-}.failed" left=0
    shift
    lf_nodes_known
    if [[ -f "$failed" ]]; then
        while read -r node; do
            lf_in_list "$node" "$LF_ACTIVE" && nodes+="${nodes:+,}$node"
        done <"$failed"
    fi
    for node in ${LF_ACTIVE//,/ }; do lf_in_list "$node" "$nodes" || left=$((left + 1)); done
    if [[ -n "$nodes" ]] && ((left >= LF_TRAIN_COUNT && left < $(tr ',' '\n' <<<"$LF_ACTIVE" | grep -c .))); then
        lf_leave_nodes "$nodes"
        lf_setup_nodes
        echo "job $SLURM_JOB_ID: preflight failed on $nodes: left behind, never used in this job; checking the" \
            "$left other node(s) again"
        lf_say_nodes
        lf_preflight "$@" || lf_preflight_failed $? "$@"
        return 0
    fi
    if [[ -z "$nodes" ]] || ((${SLURM_RESTART_COUNT:-0} == 0)); then
        echo "job $SLURM_JOB_ID: preflight failed (code $rc, the checks above); not requeued"
        exit "$rc"
    fi
    lf_note_nodes - "$nodes"
    local counted=0
    lf_count_requeue "$rc" - "preflight failed on $nodes after a requeue" || counted=$?
    if ((counted != EXIT_REQUEUE)); then exit "$rc"; fi
    lf_requeue
    exit 0
}
