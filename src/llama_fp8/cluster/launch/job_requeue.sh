# shellcheck shell=bash
# After the training step (sourced by job_lib.sh): the launchers' decisions, the requeue count, and the nodes a job
# leaves behind when it is requeued. Safe on bash 4.2 under `set -u` (see job_lib.sh).
#
# Files of a job, in logs/ (each cleared by the first run of a job id: a rebuilt cluster reuses ids):
#   llama-fp8-requeues_<job>  one line per requeue without a new checkpoint ("CHECKPOINT requeue N of CAP: why")
#   llama-fp8-nodes_<job>     one line per failure charged to a node ("NODE RUN.ROUND"), and per node to leave
#                             behind at once ("NODE exclude": a failed health check, a failed preflight on a requeue)
# Reads MAX_REQUEUES (default 3) and BAD_NODE_ACTION: exclude (default: the requeued job gets the node in its
# ExcNodeList), drain (scontrol drains it: needs Slurm operator rights; where refused, exclude), none.

LF_NODE_FAILURES=2  # llama_fp8/cluster/launch/decide.py NODE_FAILURES: failures after which a node is left behind

# ---- the launchers' decisions (LF_OUTCOME_DIR/node<N>: "CODE ACTION CHECKPOINT FAILED EXCLUDE LINE"), one line
# saying what happened and what comes next, and the code for the calling script. A failure that a restart cannot
# fix (ACTION fail) wins over a requeue; a checkpoint saved after a signal (requeue) is always requeued; a node that
# finished (done) means the training is complete (every rank passed the final checkpoint), whatever the others
# say; a requeue that saved nothing new (retry: a signal during a restart, the rendezvous host lost, a start-up
# failing twice, a node to leave behind; closed; a launcher killed without a word: srun's code >= 128) is requeued
# at most MAX_REQUEUES times without a new checkpoint, so that a node that breaks every attempt cannot requeue the
# job forever (Slurm requeues a node failure by itself: NODE_FAIL, --requeue); a launcher that failed by itself
# before deciding (srun's code < 128) is not requeued. FAILED (node@round, the failures charged to a node in this
# step) and EXCLUDE (nodes to leave behind at once) go to the job's nodes file, whatever the decision.
lf_outcome() {  # lf_outcome SRUN_RC -> return 0, 85 or the failure's code
    local rc=$1 f code action ckpt failed exclude line fail="" failcode=0 requeue="" retry="" finished="" closed=""
    local files=0 latest=""
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
        esac
    done
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
    lf_count_requeue "$rc" "${latest:--}" \
        "${retry:-${closed:+a launcher ended the job without a word ($closed)}}"
}

# A requeue without a new checkpoint, counted in logs/llama-fp8-requeues_<job>, one line per requeue ("CHECKPOINT
# requeue N of CAP: why"). The count starts again when the launchers report a later complete checkpoint than any
# counted requeue; a first run of the job (SLURM_RESTART_COUNT 0) ignores a count an earlier job with this id left
# (a rebuilt cluster reuses ids). A requeue that cannot be counted is not made.
lf_count_requeue() {  # lf_count_requeue SRUN_RC CHECKPOINT|- WHY -> return 85, or not requeued
    local rc=$1 latest=$2 line=$3 cap=${MAX_REQUEUES:-3} counter="$PWD/logs/llama-fp8-requeues_$SLURM_JOB_ID"
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
    if ! { echo "$latest requeue $((count + 1)) of $cap: $line" >>"$counter"; } 2>/dev/null; then
        echo "job $SLURM_JOB_ID: $line; not requeued: the requeue cannot be counted in $counter (MAX_REQUEUES bounds requeues only where logs/ is writable)"
        return "$no"
    fi
    echo "job $SLURM_JOB_ID: $line; requeue $((count + 1)) of $cap (MAX_REQUEUES)"
    return "$EXIT_REQUEUE"
}

# ---- nodes left behind -------------------------------------------------------------------------------------------
lf_nodes_file() { echo "$PWD/logs/llama-fp8-nodes_$SLURM_JOB_ID"; }

lf_note_nodes() {  # lf_note_nodes FAILED EXCLUDE: "n2@0,n2@1" and "n3" (or -) into the job's nodes file, once each
    local file entry node line
    file=$(lf_nodes_file)
    if ((${SLURM_RESTART_COUNT:-0} == 0)) && [[ -z "${LF_NODES_FRESH:-}" ]]; then
        rm -f "$file" 2>/dev/null
        LF_NODES_FRESH=1
    fi
    for entry in ${1//,/ } ${2//,/ }; do
        [[ "$entry" == - || -z "$entry" ]] && continue
        node=${entry%@*}
        [[ "$node" =~ ^[A-Za-z0-9._-]+$ ]] || continue  # a node name, nothing else reaches scontrol
        if [[ "$entry" == *@* ]]; then line="$node ${SLURM_RESTART_COUNT:-0}.${entry#*@}"; else line="$node exclude"; fi
        grep -qxF "$line" "$file" 2>/dev/null || echo "$line" >>"$file" 2>/dev/null || true
    done
}

lf_bad_nodes() {  # the nodes to leave behind (comma-separated): excluded at once, or charged LF_NODE_FAILURES times
    local file
    file=$(lf_nodes_file)
    [[ -f "$file" ]] || return 0
    awk -v n="$LF_NODE_FAILURES" '$2 == "exclude" { bad[$1] = 1 } $2 != "exclude" { seen[$1]++ }
        END { for (k in seen) if (seen[k] >= n) bad[k] = 1; s = ""; for (k in bad) s = s (s ? "," : "") k; print s }' \
        "$file"
}

# A running job's ExcNodeList cannot be changed (slurmctld: "Job is no longer pending execution"), and this script
# dies with the job's requeue. So a helper job (one task for a few seconds, on any node but the bad ones) waits until
# this job is requeued and held (scontrol requeuehold), sets its ExcNodeList and releases it.
lf_release_script() {  # lf_release_script JOB NODES -> the helper's script on stdout
    printf '%s\n' "for _ in \$(seq 300); do" \
        "  if scontrol -o show job $1 | grep -q 'JobState=PENDING'; then break; fi; sleep 2" \
        "done" \
        "scontrol update JobId=$1 ExcNodeList=$2 && scontrol release $1 && echo 'job $1: released without $2'"
}

lf_requeue() {  # requeue this job (it resumes from its latest complete checkpoint), leaving its bad nodes behind
    local bad excluded helper old args=()
    # The containers go first, while the job still has its nodes (`scontrol requeue` ends every step at once:
    # removing them afterwards, in the EXIT trap, no longer can).
    lf_remove_containers || true
    bad=$(lf_bad_nodes)
    if [[ -z "$bad" || "${BAD_NODE_ACTION:-exclude}" == none ]]; then
        scontrol requeue "$SLURM_JOB_ID"
        return
    fi
    if [[ "${BAD_NODE_ACTION:-exclude}" == drain ]]; then
        if scontrol update NodeName="$bad" State=DRAIN Reason="failed in training (llama-fp8, Slurm job $SLURM_JOB_ID)"; then
            echo "job $SLURM_JOB_ID: drained $bad (BAD_NODE_ACTION=drain); requeueing"
            scontrol requeue "$SLURM_JOB_ID"
            return
        fi
        echo "warning: could not drain $bad (Slurm operator rights needed): leaving it out of this job instead" >&2
    fi
    old=$(scontrol -o show job "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*' | cut -d= -f2)
    excluded=$bad
    if [[ -n "$old" && "$old" != "(null)" ]]; then excluded="$old,$bad"; fi
    if [[ -n "${SLURM_JOB_PARTITION:-}" ]]; then args+=(--partition="$SLURM_JOB_PARTITION"); fi
    if [[ -n "${SLURM_JOB_ACCOUNT:-}" ]]; then args+=(--account="$SLURM_JOB_ACCOUNT"); fi
    if helper=$(sbatch --parsable --job-name="llama-fp8-release-$SLURM_JOB_ID" --nodes=1 --ntasks=1 --time=15 \
        --exclude="$bad" --output="$PWD/logs/llama-fp8-release_%j.out" ${args[@]+"${args[@]}"} \
        --wrap="$(lf_release_script "$SLURM_JOB_ID" "$excluded")"); then
        echo "job $SLURM_JOB_ID: requeued without $bad (ExcNodeList=$excluded, set and released by job ${helper%%;*})"
        scontrol requeuehold "$SLURM_JOB_ID"
    else
        echo "warning: could not submit the job that leaves $bad behind: requeueing without it excluded" >&2
        scontrol requeue "$SLURM_JOB_ID"
    fi
}

# A preflight that fails on a requeue, on nodes it names (the report's .failed file), leaves them behind instead of
# failing the job: a node that broke since the job last ran is the usual cause. On a first run it fails the job.
lf_preflight_failed() {  # lf_preflight_failed RC -> exits the script
    local rc=$1 nodes="" node failed="${LLAMA_FP8_PREFLIGHT:-}.failed"
    if ((${SLURM_RESTART_COUNT:-0} > 0)) && [[ -f "$failed" ]]; then
        while read -r node; do nodes+="${nodes:+,}$node"; done <"$failed"
    fi
    if [[ -z "$nodes" ]]; then
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
