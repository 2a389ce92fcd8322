"""The batch script's side of the in-job restarts (scripts/slurm/job_lib.sh): ``lf_outcome`` reading the
launchers' decisions and counting requeues, the knobs' validation, and the per-node wrapper of the training
step (rendezvous settings). No Slurm needed: the functions read files and environment variables; srun is
replaced by a recorder."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from helpers import REPO


def outcome_rc(tmp_path: Path, files: dict[str, str], srun_rc: int, max_requeues: str | int = 3,
               restarts: int = 1) -> tuple[int, str]:
    """job_lib.sh's lf_outcome on these outcome files (``CODE ACTION CKPT FAILED EXCLUDE LINE``) and srun's code, in a job whose
    SLURM_RESTART_COUNT is ``restarts`` (0: its first run)."""
    folder = tmp_path / "out"
    folder.mkdir(exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    for name, text in files.items():
        (folder / name).write_text(text + "\n")
    script = (f'source {REPO}/scripts/slurm/job_lib.sh; LF_OUTCOME_DIR={folder}; lf_outcome {srun_rc}; '
              f'echo "rc=$?"')
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp_path, check=True,
                         env={**os.environ, "SLURM_JOB_ID": "77", "MAX_REQUEUES": str(max_requeues),
                              "SLURM_RESTART_COUNT": str(restarts)})
    return int(out.stdout.rsplit("rc=", 1)[1]), out.stdout + out.stderr


def counter(tmp_path: Path) -> list[str]:
    path = tmp_path / "logs" / "llama-fp8-requeues_77"
    return path.read_text().splitlines() if path.exists() else []


def test_lf_outcome_requeues_what_it_should_and_caps_the_rest(tmp_path):
    (tmp_path / "logs").mkdir()
    assert outcome_rc(tmp_path, {"node0": "0 done 8 - - ok", "node1": "0 done 8 - - ok"}, 0)[0] == 0
    # a deterministic failure on one node wins over the other node's requeue, and over srun's 143
    rc, out = outcome_rc(tmp_path, {"node0": "3 fail 4 - - rank 0: NaN", "node1": "85 requeue 4 - - saved"}, 143)
    assert rc == 3 and "rank 0: NaN; not requeued" in out
    # a checkpoint saved after a signal: always requeued, whatever srun said
    assert outcome_rc(tmp_path, {"node1": "85 requeue 6 - - saved"}, 143)[0] == 85
    # a launcher that failed by itself before deciding (it could not even start): its code, not requeued
    rc, out = outcome_rc(tmp_path, {}, 1)
    assert rc == 1 and "failed with code 1 before its launchers decided (the error is above); not requeued" in out
    # nothing saved (a lost rendezvous host, a launcher killed without a word): MAX_REQUEUES times, then no more
    rc, out = outcome_rc(tmp_path, {}, 137, max_requeues=2)
    assert rc == 85 and "requeue 1 of 2 (MAX_REQUEUES)" in out
    assert outcome_rc(tmp_path, {"node1": "86 retry - - - lost the rendezvous"}, 143, max_requeues=2)[0] == 85
    rc, out = outcome_rc(tmp_path, {"node1": "86 retry - - - lost the rendezvous"}, 143, max_requeues=2)
    assert rc == 143 and "not requeued: 2 requeue(s) without a new checkpoint already (MAX_REQUEUES=2)" in out
    assert len(counter(tmp_path)) == 2


def test_a_finished_node_and_a_closed_one_is_a_finished_job(tmp_path):
    """One node finished training (its launcher: done), the other's launcher found the rendezvous closed: the
    training is complete (every rank passed the final checkpoint), not "failed before its launchers decided"."""
    (tmp_path / "logs").mkdir()
    rc, out = outcome_rc(tmp_path, {"node0": "1 closed 8 - - another node ended the job (its line says why)",
                                    "node1": "0 done 8 - - training finished on every node"}, 1)
    assert rc == 0, out
    assert "training finished" in out and "before its launchers decided" not in out


def test_requeues_are_counted_from_the_latest_new_checkpoint(tmp_path):
    """MAX_REQUEUES bounds requeues *without a new checkpoint*: a requeue whose launchers report a later
    complete checkpoint than the last counted one starts the count again."""
    (tmp_path / "logs").mkdir()
    retry = {"node1": "86 retry {} - - lost the rendezvous"}

    def once(ckpt):
        return outcome_rc(tmp_path, {k: v.format(ckpt) for k, v in retry.items()}, 143, max_requeues=2)

    assert once(4)[0] == 85 and once(4)[0] == 85
    rc, out = once(6)
    assert rc == 85 and "requeue 1 of 2" in out, out  # step 6 saved since the last requeue: counted from 0
    assert once(6)[0] == 85
    rc, out = once(6)
    assert rc == 143 and "not requeued: 2 requeue(s) without a new checkpoint already" in out, out
    rc, out = once("-")  # a launcher that could not tell: never a reason to count again
    assert rc == 143, out


def test_a_requeue_that_cannot_be_counted_is_not_made(tmp_path):
    """logs/ not writable (here: a file in its place): the count cannot be kept, so the job is not requeued
    (an uncounted requeue could repeat forever)."""
    (tmp_path / "logs").write_text("not a folder")
    rc, out = outcome_rc(tmp_path, {"node1": "86 retry 4 - - lost the rendezvous"}, 143)
    assert rc == 143 and "not requeued" in out and "cannot be counted" in out, out


def test_a_counter_left_by_an_earlier_job_with_this_id_is_ignored(tmp_path):
    """A first run of a job (SLURM_RESTART_COUNT 0) finds a requeue count for its job id (a rebuilt cluster
    reuses ids): not this job's; it starts from 0."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "llama-fp8-requeues_77").write_text("4 requeue 1 of 2: old\n4 requeue 2 of 2: old\n")
    rc, out = outcome_rc(tmp_path, {"node1": "86 retry 4 - - lost the rendezvous"}, 143, max_requeues=2, restarts=0)
    assert rc == 85 and "requeue 1 of 2" in out, out
    assert len(counter(tmp_path)) == 1


def run_lib(script: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Source job_lib.sh under `set -euo pipefail` with srun replaced by a recorder (srun.calls) and run
    ``script``."""
    harness = f"""
set -euo pipefail
source {REPO}/scripts/slurm/job_lib.sh
srun() {{ printf '%s\\x1f' "$@" >>{tmp_path}/srun.calls; printf '\\x1e' >>{tmp_path}/srun.calls; }}
{script}
"""
    return subprocess.run(["bash", "-c", harness], capture_output=True, text=True, check=False, cwd=tmp_path,
                          env={**os.environ, **env})


def test_restart_and_requeue_knobs_must_be_counts(tmp_path):
    # "08" would read as a bad octal number in bash arithmetic: the requeue cap silently off
    for name, value in (("MAX_REQUEUES", "three"), ("MAX_RESTARTS", "-1"), ("MAX_REQUEUES", ""),
                        ("MAX_REQUEUES", "08"), ("MAX_RESTARTS", "010")):
        proc = run_lib("lf_check_knobs; echo checked", tmp_path, **{name: value})
        assert proc.returncode == 1 and "checked" not in proc.stdout, (name, value, proc.stdout)
        assert f"{name}={value}" in proc.stderr and "a whole number" in proc.stderr, proc.stderr
    assert "checked" in run_lib("lf_check_knobs; echo checked", tmp_path, MAX_REQUEUES="0", MAX_RESTARTS="5").stdout


def test_each_node_gives_torchrun_its_own_address_and_keeps_the_users_rendezvous_settings(tmp_path):
    """The per-node wrapper of the training step: this node's Slurm NodeAddr as torchrun's --local_addr (the
    workers' MASTER_ADDR is rank 0's, which torch otherwise takes from socket.getfqdn(), a name that need not
    resolve), and is_host appended to a PET_RDZV_CONF the user set (join_timeout, ...), not written over it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        "#!/bin/sh\ncase \"$*\" in\n  'show hostnames n[1-2]') printf 'n1\\nn2\\n';;\n"
        "  '-o show node n[1-2]') echo 'NodeName=n1 Arch=x86_64 NodeAddr=10.0.0.1 NodeHostName=h1'\n"
        "                         echo 'NodeName=n2 Arch=x86_64 NodeAddr=10.0.0.2 NodeHostName=h2';;\n"
        "  *) exit 1;;\nesac\n")
    (fake / "scontrol").chmod(0o755)
    (tmp_path / "logs").mkdir()
    script = ("lf_setup_rendezvous; SLURM_JOB_NUM_NODES=2 CPUS=1 NPROC_PER_NODE=1 DEVICE=cpu PY=(python) "
              "CONTAINER_ARGS=() DEVICE_ARGS=(); lf_train --model tiny || true")
    proc = run_lib(script, tmp_path, PATH=f"{fake}:{os.environ['PATH']}", SLURM_JOB_ID="7",
                   SLURM_JOB_NODELIST="n[1-2]")
    assert proc.returncode == 0, proc.stderr
    (call,) = [c.split("\x1f")[:-1] for c in (tmp_path / "srun.calls").read_text().split("\x1e")[:-1]]
    assert "--rdzv_endpoint=10.0.0.1:29507" in call, call
    wrapper = call.index("bash")
    launcher = call.index("-m", wrapper)
    assert call[wrapper + 1] == "-c" and call[launcher + 1:launcher + 3] == ["llama_fp8", "launch"], call
    for node, name, addr in ((0, "n1", "10.0.0.1"), (1, "n2", "10.0.0.2")):
        # the wrapper as srun runs it on that node, with `env` in place of the launcher (python -m llama_fp8 ...)
        task = subprocess.run(["bash", *call[wrapper + 1:launcher - 1], "env"], capture_output=True, text=True,
                              check=True, env={**os.environ, "SLURM_NODEID": str(node), "SLURMD_NODENAME": name,
                                               "PET_RDZV_CONF": "join_timeout=900"})
        got = dict(line.split("=", 1) for line in task.stdout.splitlines() if "=" in line)
        assert got["PET_RDZV_CONF"] == f"join_timeout=900,is_host={int(node == 0)}", got["PET_RDZV_CONF"]
        assert got.get("PET_LOCAL_ADDR") == addr, (node, got.get("PET_LOCAL_ADDR"))


def fake_slurm(tmp_path: Path, drain_ok: bool = False, cluster: str = "n1 alloc\nn2 alloc\nn3 idle",
               excluded: str = "(null)") -> dict[str, str]:
    """scontrol, sbatch and sinfo replaced by recorders (slurm.calls, one call per line); `scontrol -o show job` says
    the job runs on n1 and n2 with ExcNodeList ``excluded`` (none yet by default); a drain is refused unless
    ``drain_ok`` (a user without operator rights); `sinfo -N` lists ``cluster`` (NAME STATE lines: by default a
    third node, idle)."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    calls = tmp_path / "slurm.calls"
    (fake / "scontrol").write_text(
        f"#!/bin/bash\necho \"scontrol $*\" >>{calls}\n"
        f"case \"$*\" in\n  '-o show job 77') echo 'JobId=77 JobState=RUNNING ExcNodeList={excluded} "
        "NodeList=n[1-2]';;\n"
        "  'show hostnames n[1-2]') printf 'n1\\nn2\\n';;\n"
        f"  update\\ NodeName=*) exit {0 if drain_ok else 1};;\nesac\nexit 0\n")
    (fake / "sbatch").write_text(f"#!/bin/bash\nprintf 'sbatch' >>{calls}\nfor a in \"$@\"; do printf ' [%s]' \"$a\" "
                                 f">>{calls}; done\necho >>{calls}\necho 4242\n")
    (fake / "sinfo").write_text(f"#!/bin/bash\necho \"sinfo $*\" >>{calls}\nprintf '{cluster}\\n'\n")
    for tool in ("scontrol", "sbatch", "sinfo"):
        (fake / tool).chmod(0o755)
    return {"PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1",
            "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}


def test_a_node_charged_twice_across_runs_is_left_behind_on_requeue(tmp_path):
    """The launchers' outcome files charge failures to nodes (node@round, each node's file repeating the job-wide
    list): once each in the job's nodes file. A node at LF_NODE_FAILURES (2) failures, or one to exclude at once,
    is left behind: the job is held on requeue, and a helper job sets its ExcNodeList and releases it. Before, a
    requeue carried no exclusion and the job could land on the same node again."""
    (tmp_path / "logs").mkdir()
    env = fake_slurm(tmp_path)
    outcome_dir = tmp_path / "out"
    outcome_dir.mkdir()
    (outcome_dir / "node0").write_text("1 retry 4 n2@0,n2@1 - node n2 has failed 2 times\n")
    (outcome_dir / "node1").write_text("1 closed 4 n2@0,n2@1 - another node ended the job\n")
    proc = run_lib(f"LF_OUTCOME_DIR={outcome_dir}; rc=0; lf_outcome 1 || rc=$?; echo rc=$rc; lf_requeue", tmp_path,
                   **env)
    assert proc.returncode == 0 and "rc=85" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "logs" / "llama-fp8-nodes_77").read_text().splitlines() == ["n2 1.0 -", "n2 1.1 -"]
    calls = (tmp_path / "slurm.calls").read_text()
    assert "scontrol requeuehold 77" in calls and "scontrol requeue 77\n" not in calls, calls
    assert "[--exclude=n2]" in calls and "[--partition=gpu]" in calls, calls
    assert "scontrol update JobId=77 ExcNodeList=n2 && scontrol release 77" in calls, calls
    assert "requeued without n2 (ExcNodeList=n2, set and released by job 4242)" in proc.stdout


def test_a_requeue_keeps_the_nodes_the_user_excluded(tmp_path):
    """A job submitted with --exclude=n7 (its ExcNodeList) that leaves n2 behind on requeue keeps n7 out too: the helper
    job sets ExcNodeList=n7,n2, not n2 alone (Slurm replaces the list: the user's own exclusion would be dropped)."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "llama-fp8-nodes_77").write_text("n2 exclude\n")
    proc = run_lib("lf_requeue", tmp_path, **fake_slurm(tmp_path, excluded="n7"))
    calls = (tmp_path / "slurm.calls").read_text()
    assert "scontrol update JobId=77 ExcNodeList=n7,n2 && scontrol release 77" in calls, calls
    assert "[--exclude=n2]" in calls and "ExcNodeList=n7,n2" in proc.stdout, proc.stdout


def test_failures_of_a_node_with_a_new_checkpoint_between_them_leave_nothing_behind(tmp_path):
    """The regression of issue 46, across requeues: n2 failed once in the job's first run (checkpoint step 88 the
    latest) and once in its second (step 95): two unrelated failures, not a bad node. Before, any two failures of a
    node in a job left it behind (ExcNodeList), and a two-node job on a two-node cluster stayed pending for good."""
    (tmp_path / "logs").mkdir()
    env = fake_slurm(tmp_path)
    outcome_dir = tmp_path / "out"
    outcome_dir.mkdir()
    for run, ckpt in ((0, 88), (1, 95)):
        (outcome_dir / "node0").write_text(f"86 retry {ckpt} n2@0:{ckpt} - lost the rendezvous\n")
        proc = run_lib(f"LF_OUTCOME_DIR={outcome_dir}; lf_outcome 143 || true; echo bad=$(lf_bad_nodes)", tmp_path,
                       **{**env, "SLURM_RESTART_COUNT": str(run)})
    assert "bad=\n" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "logs" / "llama-fp8-nodes_77").read_text().splitlines() == ["n2 0.0 88", "n2 1.0 95"]


def test_a_bad_node_the_job_cannot_run_without_is_restarted_on_in_place(tmp_path):
    """n2 failed twice without a new checkpoint (step 4 the latest both times), no spare in the step, and the
    cluster has no other node (n1 and n2, both the job's): leaving n2 behind would strand the job in the queue.
    The training step restarts in place on n2 instead, counted like a requeue (MAX_REQUEUES), and says why.
    With an idle third node, the same failures leave n2 behind as before (requeued without it)."""
    (tmp_path / "logs").mkdir()
    outcome_dir = tmp_path / "out"
    outcome_dir.mkdir()
    (outcome_dir / "node0").write_text("137 retry 4 n2@0:4,n2@1:4 - node n2 has failed 2 times without a new checkpoint\n")
    (outcome_dir / "node1").write_text("1 closed 4 n2@0:4,n2@1:4 - another node ended the job\n")
    script = f"LF_OUTCOME_DIR={outcome_dir}; rc=0; lf_outcome 1 || rc=$?; echo rc=$rc in_place=${{LF_IN_PLACE:-0}}"
    proc = run_lib(script, tmp_path, **fake_slurm(tmp_path, cluster="n1 alloc\nn2 alloc"))
    assert "rc=85 in_place=1" in proc.stdout, proc.stdout + proc.stderr
    assert "restarting the training step in place on n2" in proc.stdout, proc.stdout
    assert "the job needs 2 node(s); without n2 Slurm could give it 1 (n1)" in proc.stdout, proc.stdout
    assert "(1 of 3 without a new checkpoint, MAX_REQUEUES)" in proc.stdout, proc.stdout
    assert "requeuehold" not in (tmp_path / "slurm.calls").read_text()
    (tmp_path / "slurm.calls").unlink()
    proc = run_lib(f"{script}; lf_requeue", tmp_path, **fake_slurm(tmp_path))
    assert "rc=85 in_place=0" in proc.stdout, proc.stdout + proc.stderr
    assert "scontrol requeuehold 77" in (tmp_path / "slurm.calls").read_text()


def test_one_failure_per_node_leaves_nothing_behind_and_a_first_run_forgets_an_old_list(tmp_path):
    (tmp_path / "logs").mkdir()
    env = fake_slurm(tmp_path)
    (tmp_path / "logs" / "llama-fp8-nodes_77").write_text("n5 0.0\nn5 0.1\n")  # an earlier job with this id
    outcome_dir = tmp_path / "out"
    outcome_dir.mkdir()
    (outcome_dir / "node0").write_text("86 retry 4 n1@0 - lost the rendezvous\n")
    proc = run_lib(f"LF_OUTCOME_DIR={outcome_dir}; lf_outcome 143 || true; echo bad=$(lf_bad_nodes); lf_requeue",
                   tmp_path, **{**env, "SLURM_RESTART_COUNT": "0"})
    assert "bad=\n" in proc.stdout, proc.stdout + proc.stderr
    calls = (tmp_path / "slurm.calls").read_text().splitlines()
    assert "scontrol requeue 77" in calls and not [c for c in calls if "requeuehold" in c or "sbatch" in c], calls


def test_bad_node_action_drain_and_its_fallback(tmp_path):
    """BAD_NODE_ACTION=drain drains the node where Slurm allows it (an operator), and falls back to leaving it out
    of this job where it does not."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "llama-fp8-nodes_77").write_text("n3 exclude\n")
    proc = run_lib("lf_requeue", tmp_path, BAD_NODE_ACTION="drain", **fake_slurm(tmp_path, drain_ok=True))
    calls = (tmp_path / "slurm.calls").read_text()
    assert "scontrol update NodeName=n3 State=DRAIN" in calls and "scontrol requeue 77" in calls, calls
    (tmp_path / "slurm.calls").unlink()
    proc = run_lib("lf_requeue", tmp_path, BAD_NODE_ACTION="drain", **fake_slurm(tmp_path, drain_ok=False))
    calls = (tmp_path / "slurm.calls").read_text()
    assert "could not drain n3" in proc.stderr and "scontrol requeuehold 77" in calls, calls
    assert run_lib("lf_check_knobs", tmp_path, BAD_NODE_ACTION="reboot").returncode == 1


def test_a_preflight_that_fails_on_a_requeue_leaves_its_nodes_behind(tmp_path):
    """Preflight failed on n2 on a requeued job: n2 is excluded and the job requeued (counted in MAX_REQUEUES),
    not failed. On the job's first run the same failure fails the job (a setting is the likelier cause)."""
    (tmp_path / "logs").mkdir()
    report = tmp_path / "logs" / "pre.json"
    (tmp_path / "logs" / "pre.json.failed").write_text("n2\n")
    proc = run_lib("lf_preflight_failed 1", tmp_path, LLAMA_FP8_PREFLIGHT=str(report), **fake_slurm(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "preflight failed on n2 after a requeue; requeue 1 of 3" in proc.stdout, proc.stdout
    assert "scontrol requeuehold 77" in (tmp_path / "slurm.calls").read_text()
    first = run_lib("lf_preflight_failed 1", tmp_path, LLAMA_FP8_PREFLIGHT=str(report),
                    **{**fake_slurm(tmp_path), "SLURM_RESTART_COUNT": "0"})
    assert first.returncode == 1 and "preflight failed (code 1, the checks above); not requeued" in first.stdout


# ---- spare nodes, HyperPod and ParallelCluster (job_nodes.sh) ---------------------------------------------------------
def three_nodes(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A job on n1..n3 (the fake `scontrol show hostnames` knows n[1-3]; sinfo: the three are the job's)."""
    env = fake_slurm(tmp_path, cluster="n1 alloc\\nn2 alloc\\nn3 alloc")
    script = tmp_path / "bin" / "scontrol"
    script.write_text(script.read_text().replace("  'show hostnames n[1-2]')", "  'show hostnames n[1-3]') printf "
                                                 "'n1\\nn2\\nn3\\n';;\n  'show hostnames n[1-2]')"))
    return {**env, "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_NUM_NODES": "3", "SLURM_RESTART_COUNT": "0", **extra}


def test_spare_nodes_wait_in_the_training_step_and_only_they_are_told_so(tmp_path):
    """SPARE_NODES=1 on three nodes: the launchers get --nnodes=2 (the world the job trains at), srun starts one on
    each of the three (--no-kill instead of --kill-on-bad-exit: a node lost must not end the step the spare saves),
    the rendezvous is the first training node's, and the per-node wrapper marks n3 alone as the spare."""
    (tmp_path / "logs").mkdir()
    env = three_nodes(tmp_path, SPARE_NODES="1")
    script = ("LF_NODE_ADDRS='n1=10.0.0.1 n2=10.0.0.2 n3=10.0.0.3'; RDZV_PORT=29507 CPUS=1 NPROC_PER_NODE=1 "
              "DEVICE=cpu PY=(python) CONTAINER_ARGS=() DEVICE_ARGS=(); lf_setup_nodes; lf_say_nodes; "
              "lf_train --model tiny || true")
    proc = run_lib(script, tmp_path, **env)
    assert proc.returncode == 0, proc.stderr
    assert "training on n1,n2; spare(s) n3: they pass the same preflight and wait" in proc.stdout, proc.stdout
    (call,) = [c.split("\x1f")[:-1] for c in (tmp_path / "srun.calls").read_text().split("\x1e")[:-1]]
    assert {"--nodes=3", "--nodelist=n1,n2,n3", "--no-kill", "--nnodes=2", "--rdzv_endpoint=10.0.0.1:29507"} <= \
        set(call) and "--kill-on-bad-exit=1" not in call, call
    assert (tmp_path / "logs" / "llama-fp8-size_77").read_text().strip() == "2"
    wrapper = call.index("bash")
    launcher = call.index("-m", wrapper)
    for name, spare in (("n1", None), ("n2", None), ("n3", "1")):
        task = subprocess.run(["bash", *call[wrapper + 1:launcher - 1], "env"], capture_output=True, text=True,
                              check=True, env={**os.environ, "SLURM_NODEID": "0", "SLURMD_NODENAME": name})
        got = dict(line.split("=", 1) for line in task.stdout.splitlines() if "=" in line)
        assert got.get("LLAMA_FP8_SPARE") == spare, (name, got.get("LLAMA_FP8_SPARE"))


def test_node_knobs_are_checked_before_anything_runs(tmp_path):
    for env, words in ((dict(SPARE_NODES="one"), "SPARE_NODES=one: must be a whole number"),
                       (dict(SPARE_NODES="2", SLURM_JOB_NUM_NODES="2"), "submit with --nodes=N+2"),
                       (dict(CLUSTER_KIND="gke"), "CLUSTER_KIND=gke: must be auto"),
                       (dict(BAD_NODE_ACTION="replace"), "BAD_NODE_ACTION=replace: must be auto (default), exclude"),
                       (dict(BAD_NODE_ACTION="reboot", CLUSTER_KIND="slurm"), "reboot is HyperPod's Action:Reboot")):
        proc = run_lib("lf_check_knobs; echo checked", tmp_path, **env)
        assert proc.returncode == 1 and "checked" not in proc.stdout and words in proc.stderr, (env, proc.stderr)
    ok = run_lib("lf_check_knobs; echo checked", tmp_path, SPARE_NODES="1", SLURM_JOB_NUM_NODES="3",
                 BAD_NODE_ACTION="reboot", CLUSTER_KIND="hyperpod")
    assert "checked" in ok.stdout, ok.stderr


def test_hyperpod_replaces_what_it_is_drained_with_its_exact_reason(tmp_path):
    """On HyperPod (CLUSTER_KIND, else /opt/sagemaker_cluster) a node left behind is set to FAIL with the exact,
    case-sensitive reason HyperPod acts on: Action:Replace by default (BAD_NODE_ACTION auto means drain there),
    Action:Reboot with BAD_NODE_ACTION=reboot; any other reason would leave it drained and never replaced. The job
    log says what was done and why. On ParallelCluster the default drains too (clustermgtd replaces a drained
    static node); where Slurm refuses the drain the warning says what the exclusion then costs."""
    (tmp_path / "logs").mkdir()
    nodes = tmp_path / "logs" / "llama-fp8-nodes_77"
    for action, reason in (("auto", "Action:Replace"), ("reboot", "Action:Reboot")):
        nodes.write_text("n3 exclude\n")
        proc = run_lib("lf_requeue", tmp_path, CLUSTER_KIND="hyperpod", BAD_NODE_ACTION=action,
                       **fake_slurm(tmp_path, drain_ok=True))
        calls = (tmp_path / "slurm.calls").read_text()
        assert f"scontrol update NodeName=n3 State=FAIL Reason={reason}\n" in calls, calls
        assert "scontrol requeue 77" in calls and "requeuehold" not in calls, calls
        assert f'n3 set to FAIL with reason "{reason}" (hyperpod: HyperPod {"replaces" if action == "auto" else "reboots"} ' \
            "a node drained with this exact, case-sensitive reason)" in proc.stdout, proc.stdout
        (tmp_path / "slurm.calls").unlink()
    proc = run_lib("lf_requeue", tmp_path, CLUSTER_KIND="parallelcluster", **fake_slurm(tmp_path, drain_ok=False))
    calls = (tmp_path / "slurm.calls").read_text()
    assert "scontrol update NodeName=n3 State=DRAIN Reason=failed in training" in calls, calls
    assert "ParallelCluster replaces it only once drained" in proc.stderr and "requeuehold 77" in calls, proc.stderr


def test_a_hyperpod_job_relying_on_auto_resume_is_warned_below_120_minutes(tmp_path):
    script = "lf_check_time_limit; echo ok"
    short = run_lib(script, tmp_path, CLUSTER_KIND="hyperpod", SLURM_JOB_ID="77", SLURM_JOB_START_TIME="1000",
                    SLURM_JOB_END_TIME=str(1000 + 3600))
    assert "relies on HyperPod's auto-resume with a time limit of 60 min: a node replacement takes 20-30 min, ask " \
           "for at least 120 min" in short.stderr, short.stderr
    for kind, minutes in (("hyperpod", 120), ("slurm", 60)):
        quiet = run_lib(script, tmp_path, CLUSTER_KIND=kind, SLURM_JOB_ID="77", SLURM_JOB_START_TIME="1000",
                        SLURM_JOB_END_TIME=str(1000 + 60 * minutes))
        assert quiet.stderr == "" and "ok" in quiet.stdout, (kind, quiet.stderr)


def test_a_bad_first_node_is_left_to_a_spare_of_the_allocation_by_starting_the_step_again(tmp_path):
    """n1 (the rendezvous host: its launcher cannot hand its place over inside the step) failed twice without a
    new checkpoint; the job has a spare (n3): the step starts again in the allocation on n2 and n3, no requeue."""
    (tmp_path / "logs").mkdir()
    outcome_dir = tmp_path / "out"
    outcome_dir.mkdir()
    (outcome_dir / "node0").write_text("137 retry 6 n1@0:6,n1@1:6 - node n1 has failed 2 times\n")
    (outcome_dir / "node1").write_text("1 closed 6 n1@0:6,n1@1:6 - another node ended the job\n")
    (outcome_dir / "node2").write_text("0 spare - - - node n3: a spare, not needed\n")
    script = (f"lf_setup_nodes; LF_OUTCOME_DIR={outcome_dir}; rc=0; lf_outcome 1 || rc=$?; "
              "echo rc=$rc in_place=${LF_IN_PLACE:-0}; lf_setup_nodes; echo trainers=$LF_TRAINERS spares=$LF_SPARES")
    proc = run_lib(script, tmp_path, **three_nodes(tmp_path, SPARE_NODES="1"))
    assert "rc=85 in_place=1" in proc.stdout and "trainers=n2,n3 spares=\n" in proc.stdout, proc.stdout + proc.stderr
    assert "leaving n1 behind: the training step starts again in this allocation on n2,n3 (a spare takes its " \
           "place, no requeue); restart of the training step (1 of 3 without a new checkpoint" in proc.stdout


def test_a_node_whose_launcher_vanished_in_a_spare_step_is_not_started_again_here(tmp_path):
    """A step with a spare: n2's launcher wrote nothing (killed with its host) while n1's and n3's did. n2 is not
    used again in this allocation (a later step trains on n1 and n3), and a requeue does not exclude it: whether it
    is down is Slurm's to know. No unused spare reported: the line says none was left."""
    (tmp_path / "logs").mkdir()
    outcome_dir = tmp_path / "out"
    outcome_dir.mkdir()
    (outcome_dir / "node0").write_text("86 retry 6 - - not every node joined the rendezvous\n")
    (outcome_dir / "node2").write_text("1 closed 6 - - another node ended the job\n")
    script = (f"lf_setup_nodes; LF_OUTCOME_DIR={outcome_dir}; rc=0; lf_outcome 1 || rc=$?; echo rc=$rc; "
              "lf_setup_nodes; echo trainers=$LF_TRAINERS spares=${LF_SPARES:-none} bad=$(lf_bad_nodes)")
    proc = run_lib(script, tmp_path, **three_nodes(tmp_path, SPARE_NODES="1"))
    assert "n2 stopped answering in the training step (no decision from its launcher): not used again" in proc.stdout
    assert "not every node joined the rendezvous; no spare was left (SPARE_NODES=1); requeue 1 of 3" in proc.stdout
    assert "rc=85" in proc.stdout and "trainers=n1,n3 spares=none bad=\n" in proc.stdout, proc.stdout + proc.stderr


def test_a_spare_that_fails_its_preflight_is_never_used(tmp_path):
    """Preflight fails on n3 (a spare) on the job's first run: n3 is left out, the other nodes are checked again
    (a second preflight step on n1,n2 only), and the job goes on without a spare instead of failing."""
    (tmp_path / "logs").mkdir()
    report = tmp_path / "logs" / "pre.json"
    (tmp_path / "logs" / "pre.json.failed").write_text("n3\n")
    script = ("CPUS=1 NPROC_PER_NODE=1 DEVICE=cpu PY=(python) CONTAINER_ARGS=() RDZV_PORT=29507; lf_setup_nodes; "
              "lf_preflight_failed 1 --model tiny; echo went on trainers=$LF_TRAINERS spares=${LF_SPARES:-none}")
    proc = run_lib(script, tmp_path, LLAMA_FP8_PREFLIGHT=str(report), **three_nodes(tmp_path, SPARE_NODES="1"))
    assert proc.returncode == 0 and "went on trainers=n1,n2 spares=none" in proc.stdout, proc.stdout + proc.stderr
    assert "preflight failed on n3: left behind, never used in this job; checking the 2 other node(s) again" \
        in proc.stdout
    (call,) = [c.split("\x1f")[:-1] for c in (tmp_path / "srun.calls").read_text().split("\x1e")[:-1]]
    assert "--nodelist=n1,n2" in call and "preflight" in call, call
