"""`preflight` and `submit` without a cluster: flag parsing, check results on this CPU host, executor
parameters, and the torchrun wrapper that keeps the workers' exit code."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from standin import free_port

from helpers import cli_env
from llama_fp8.cluster.launch import submit
from llama_fp8.cluster.nodes import node_checks, preflight


def run_preflight(args: list[str], capsys) -> tuple[int, str]:
    rc = preflight.main(args)
    return rc, capsys.readouterr().out


def line_of(out: str, name: str) -> str:
    return next(ln for ln in out.splitlines() if f"] {name}:" in ln)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="expects a host without GPU")
def test_preflight_cpu_no_gpu_is_a_warning(tmp_path, capsys):
    rc, out = run_preflight(["--device", "cpu", "--", "--model", "tiny", "--run_dir", str(tmp_path / "r")], capsys)
    assert rc == 0, out
    assert line_of(out, "gpu").startswith("[WARN]") and "no GPU" in out
    assert line_of(out, "checkpoint_dir").startswith("[  OK]")
    assert "0 failed" in out.splitlines()[-1]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="expects a host without GPU")
def test_preflight_cuda_without_gpu_fails(capsys):
    rc, out = run_preflight(["--device", "cuda"], capsys)
    assert rc == 1
    assert line_of(out, "gpu").startswith("[FAIL]")
    assert "failed: gpu" in out.splitlines()[-1]


def test_preflight_names_the_failing_node_for_a_requeue_to_leave_behind(tmp_path, capsys, monkeypatch):
    """The report lists the nodes whose checks failed, and REPORT.failed has them one per line: a requeued job
    leaves them behind (job_requeue.sh lf_preflight_failed); a passing preflight removes an old list."""
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    report = tmp_path / "pre.json"
    rc, _ = run_preflight(["--device", "cuda", "--report", str(report)], capsys)
    assert rc == 1 and json.loads(report.read_text())["failed_nodes"] == ["n2"]
    assert (tmp_path / "pre.json.failed").read_text() == "n2\n"
    rc, _ = run_preflight(["--device", "cpu", "--report", str(report), "--", "--model", "tiny", "--run_dir",
                           str(tmp_path / "r")], capsys)
    assert rc == 0 and not (tmp_path / "pre.json.failed").exists()


def test_preflight_runs_the_sites_node_check_that_the_launcher_runs_before_a_restart(tmp_path, capsys, monkeypatch):
    """A node (a spare as much as a training node) that fails LLAMA_FP8_NODE_CHECK fails its preflight, named in
    REPORT.failed: the batch script never uses it (a spare's place is then taken by another node of the job)."""
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    monkeypatch.setenv("LLAMA_FP8_NODE_CHECK", "echo 'GPU 5: fell off the bus' >&2; exit 4")
    report = tmp_path / "pre.json"
    rc, out = run_preflight(["--device", "cpu", "--report", str(report), "--", "--model", "tiny", "--run_dir",
                             str(tmp_path / "r")], capsys)
    assert rc == 1 and (tmp_path / "pre.json.failed").read_text() == "n3\n", out
    assert line_of(out, "node health") == "[FAIL] node health: the node check (LLAMA_FP8_NODE_CHECK) failed with " \
        "exit 4: GPU 5: fell off the bus", out
    monkeypatch.setenv("LLAMA_FP8_NODE_CHECK", "true")
    rc, out = run_preflight(["--device", "cpu", "--report", str(report), "--", "--model", "tiny", "--run_dir",
                             str(tmp_path / "r")], capsys)
    assert rc == 0 and line_of(out, "node health").startswith("[  OK]"), out


def test_preflight_reads_train_flags(tmp_path, capsys):
    """Train flags after `--` are parsed like `train` does: a missing local dataset path fails."""
    rc, out = run_preflight(["--device", "cpu", "--", "--model", "tiny", "--dataset", str(tmp_path / "nope"),
                             "--run_dir", str(tmp_path / "r")], capsys)
    assert rc == 1
    assert line_of(out, "dataset").startswith("[FAIL]") and "no such file" in line_of(out, "dataset")


def test_preflight_unwritable_checkpoint_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, out = run_preflight(["--device", "cpu", "--checkpoint_dir", str(blocker / "ckpt")], capsys)
    assert rc == 1 and line_of(out, "checkpoint_dir").startswith("[FAIL]")


@pytest.mark.parametrize("argv", [["--bogus"], ["--device", "gpu"], ["--", "--modle", "tiny"]])
def test_preflight_bad_flags_exit_2(argv, capsys):
    assert preflight.main(argv) == 2


def test_fp8_recipes_by_capability():
    """From the one recipe table (precision/recipes.py): capability and CUDA rules."""
    assert preflight.fp8_recipes((8, 0), "12.4") == []  # A100
    ada = preflight.fp8_recipes((8, 9), "12.4")
    assert "te:delayed" in ada and "torchao:tensorwise" in ada and "te:mxfp8" not in ada and "te:block" not in ada
    assert preflight.fp8_recipes((8, 9), "12.0") == ["torchao:tensorwise", "torchao:rowwise"]  # TE needs 12.1 on Ada
    assert "te:block" in preflight.fp8_recipes((9, 0), "12.9") and "te:block" not in preflight.fp8_recipes((9, 0), "12.8")
    assert "te:mxfp8" in preflight.fp8_recipes((10, 0), "12.9")


def test_efa_detection(tmp_path):
    sysfs = tmp_path / "infiniband"
    for dev, driver in (("rdmap0s1", "efa"), ("mlx5_0", "mlx5_core")):
        (tmp_path / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (sysfs / dev / "device").mkdir(parents=True)
        (sysfs / dev / "device" / "driver").symlink_to(tmp_path / "drivers" / driver)
    assert preflight.efa_devices(str(sysfs)) == ["rdmap0s1"]


def a_real_shared_library() -> str:
    import torch

    return str(next(Path(torch.__file__).parent.glob("lib/libc10.so")))


@pytest.mark.parametrize(("plugin", "nccl_net", "status", "words"), [
    ("missing", "AWS Libfabric", "FAIL", "no aws-ofi-nccl plugin"),
    ("not-elf", "AWS Libfabric", "FAIL", "does not load"),
    ("real", None, "WARN", "NCCL_NET=unset"),
    ("real", "Socket", "WARN", "NCCL_NET=Socket"),
    ("real", "AWS Libfabric", "OK", "NCCL_NET=AWS Libfabric"),
])
def test_efa_check_needs_a_loadable_plugin_and_nccl_net(plugin, nccl_net, status, words, tmp_path, monkeypatch):
    """On an EFA node: the plugin NCCL_NET_PLUGIN names must exist and dlopen, and NCCL_NET must name the OFI
    network (else a plugin failure silently becomes TCP)."""
    monkeypatch.setattr(node_checks, "efa_devices", lambda: ["rdmap0s1", "rdmap1s1"])
    path = {"missing": str(tmp_path / "nope.so"), "real": a_real_shared_library()}.get(plugin)
    if plugin == "not-elf":
        path = str(tmp_path / "libnccl-net-ofi.so")
        Path(path).write_text("not a shared library")
    monkeypatch.setenv("NCCL_NET_PLUGIN", path)
    if nccl_net is None:
        monkeypatch.delenv("NCCL_NET", raising=False)
    else:
        monkeypatch.setenv("NCCL_NET", nccl_net)
    check = preflight.check_efa(preflight.Settings())
    assert check.status == status and words in check.message, check


# ---- submit -------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--nodez", "2", "--", "--model", "tiny"],        # unknown own flag
    ["--model", "tiny"],                              # train flag without `--`
    ["--nodes", "0", "--", "--model", "tiny"],        # impossible value
    ["--nodes", "1", "--", "--modle", "tiny"],        # bad train flag, caught before queueing
    ["--nodes", "1", "--", "--fp8", "2"],             # bad train value
])
def test_submit_bad_flags_exit_2(argv, capsys):
    assert submit.main(argv) == 2
    assert "error" in capsys.readouterr().err


def parse_submit(argv: list[str]) -> argparse.Namespace:
    args = submit.build_parser().parse_args(argv)
    submit.validate(args)
    return args


def test_submit_executor_parameters_gpu(tmp_path):
    image = tmp_path / "img.sqsh"
    image.write_text("")
    params = submit.executor_parameters(parse_submit(
        ["--nodes", "4", "--gpus_per_node", "8", "--partition", "p5", "--time", "90", "--account", "acct",
         "--qos", "high", "--constraint", "p5.48xlarge", "--image", str(image), "--folder", str(tmp_path)]))
    assert params["nodes"] == 4 and params["ntasks_per_node"] == 8 and params["gpus_per_node"] == 8
    assert (params["partition"], params["time"], params["account"], params["qos"], params["constraint"]) == \
        ("p5", 90, "acct", "high", "p5.48xlarge")
    assert params["srun_args"][0] == f"--container-image={image}"
    assert any(a.startswith("--container-mounts=") and str(tmp_path) in a for a in params["srun_args"])
    assert params["additional_parameters"]["signal"] == "USR1@120"


def test_submit_executor_parameters_cpu():
    params = submit.executor_parameters(parse_submit(["--tasks_per_node", "2"]))
    assert params["ntasks_per_node"] == 2 and "gpus_per_node" not in params and "srun_args" not in params
    assert "partition" not in params  # unset flags leave Slurm's defaults alone


def test_submit_image_must_exist():
    with pytest.raises(ValueError, match="--image"):
        parse_submit(["--image", "missing.sqsh"])


def test_split_argv():
    assert submit.split_argv(["--nodes", "2", "--", "--model", "tiny", "--", "x"]) == \
        (["--nodes", "2"], ["--model", "tiny", "--", "x"])


@pytest.mark.parametrize("code", [pytest.param(0, marks=pytest.mark.slow), 85, 3])  # 0: over 2 s (the first)
def test_torchrun_wrapper_keeps_worker_exit_code(code, tmp_path):
    """Plain torchrun exits 1 for any worker failure; `launch` returns the worker's code
    (85 = checkpoint saved, requeue me, which 1.train_llama.sbatch acts on)."""
    script = tmp_path / "worker.py"
    script.write_text(f"import sys\nsys.exit({code})\n")
    # In a child process: torch's agent leaves the rendezvous store listening (on every address) until its process
    # ends, and the test worker lives on. Run in-process on a port in the jobs' range (29500 + job id % 1000), it
    # once held the port of a later Slurm job on this host, whose launcher then could not open its store.
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "llama_fp8", "launch", "--nnodes=1", "--nproc_per_node=1",
                           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=t", str(script)],
                          env=cli_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == code, proc.stderr[-3000:]
    with socket.socket() as s:  # nothing of the launcher's is left listening
        s.bind(("", port))



def test_submit_batch_script_requeues_on_the_host(tmp_path):
    """The setup lines submitit puts before its srun: valid bash, the batch scripts' own node setup (job_lib.sh's
    functions: one owner, nothing to keep in step) exporting the rendezvous address Slurm knows and the job's
    port, and the EXIT trap that requeues on the task's marker or exit code 85 (run here with a fake scontrol:
    the trap must call `scontrol requeue <job>` and exit 0)."""

    import submitit.slurm.slurm as sl

    params = submit.executor_parameters(parse_submit(["--folder", str(tmp_path / "sub")]))
    text = sl._make_sbatch_string(command="false", folder=tmp_path / "sub" / "%j",
                                  **{k: v for k, v in params.items() if k != "stderr_to_stdout"})
    assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0
    setup = "\n".join(params["setup"])
    lib = submit.JOB_LIB.read_text()
    for name in ("lf_efa_devices", "lf_setup_efa", "lf_setup_rendezvous"):  # the batch scripts' functions, verbatim
        body = "\n".join(submit.shell_functions(lib, name))
        assert body in setup and body.startswith(f"{name}() {{") and body.endswith("}")
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        "#!/bin/sh\ncase \"$*\" in\n  'show hostnames n1') echo n1;;\n"
        "  '-o show node n1') echo 'NodeName=n1 NodeAddr=10.1.2.3 State=IDLE';;\n"
        f"  *) echo \"$@\" >>{tmp_path}/scontrol.calls;;\nesac\n")
    (fake / "scontrol").chmod(0o755)
    marker = tmp_path / "sub" / "42" / submit.REQUEUE_MARKER
    marker.parent.mkdir(parents=True)
    for task_exit, with_marker, requeued in ((85, False, True), (0, True, True), (3, False, False)):
        if with_marker:
            marker.touch()
        script = setup + f"\necho \"rendezvous $MASTER_ADDR:$MASTER_PORT\"\nsh -c 'exit {task_exit}'\n"
        proc = subprocess.run(["bash", "-c", script], env={"PATH": f"{fake}:/usr/bin:/bin", "SLURM_JOB_ID": "42",
                                                           "SLURM_JOB_NODELIST": "n1"},
                              capture_output=True, text=True, check=False)
        calls = (tmp_path / "scontrol.calls").read_text() if (tmp_path / "scontrol.calls").exists() else ""
        assert "rendezvous 10.1.2.3:29542" in proc.stdout, proc.stdout + proc.stderr  # 29500 + job id % 1000
        assert ("requeue 42" in calls) is requeued, (task_exit, proc.stdout, proc.stderr)
        assert proc.returncode == (0 if requeued else task_exit)
        assert not marker.exists()
        (tmp_path / "scontrol.calls").unlink(missing_ok=True)


def test_train_task_exits_85_with_a_marker_and_no_scontrol(tmp_path, monkeypatch):
    """Inside the task: no `scontrol` call (it may not exist there); rank 0 leaves the marker and the task
    raises SystemExit(85), which submitit's `except Exception` lets through (no result written)."""
    import types

    import submitit

    from llama_fp8 import train

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    fake_env = types.SimpleNamespace(hostnames=["n1"], job_id="42", global_rank=0, num_tasks=1, local_rank=0,
                                     num_nodes=1, paths=types.SimpleNamespace(folder=tmp_path))
    monkeypatch.setattr(submitit, "JobEnvironment", lambda: fake_env)
    monkeypatch.setattr(train, "main", lambda argv: 85)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29542")
    with pytest.raises(SystemExit) as e:
        submit.TrainTask(["--model", "tiny"])()
    assert e.value.code == 85 and (tmp_path / submit.REQUEUE_MARKER).exists() and calls == []


def test_submitit_signal_handlers_are_released():
    """submitit installs a `scontrol requeue` handler on its preemption signal and ignores SIGTERM/SIGCONT
    (job_environment._handle_signals); the task puts the defaults back before training."""
    import signal

    from submitit.core.job_environment import JobEnvironment

    preempt = getattr(signal, "SIG" + JobEnvironment.USR_SIG)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGCONT, preempt)}
    try:
        for s in saved:
            signal.signal(s, lambda *_: None)
        submit.release_submitit_signals()
        assert all(signal.getsignal(s) is signal.SIG_DFL for s in saved)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_submit_refuses_a_run_dir_outside_its_container_mounts(tmp_path, capsys):
    image = tmp_path / "img.sqsh"
    image.write_text("")
    rc = submit.main(["--image", str(image), "--container_mounts", f"{tmp_path}:{tmp_path}", "--folder",
                      str(tmp_path / "sub"), "--", "--model", "tiny", "--run_dir", "/scratch/lost"])
    assert rc == 2 and "--run_dir /scratch/lost is outside the container mounts" in capsys.readouterr().err


def settings_for(*train_flags: str) -> preflight.Settings:
    import argparse as ap

    own = ap.Namespace(device="cpu", model_impl=None, fp8=None, fp8_backend=None, dataset=None, tokenizer=None,
                       checkpoint_dir=None)
    return preflight.resolve(own, ["--model", "tiny", *train_flags])


def test_fp8_features_name_the_library_version_they_need(monkeypatch):
    """The recipe table's minimum versions, against the installed (here: pretended) library versions."""
    from llama_fp8.models.te.fp8.precision import TE
    from llama_fp8.precision.torchao import TORCHAO

    assert preflight.check_fp8_features(settings_for()).status == "OK"  # no FP8 asked
    monkeypatch.setattr(TORCHAO, "library_version", lambda: "0.11.0")
    got = preflight.check_fp8_features(settings_for("--fp8", "1"))
    assert (got.status, got.message) == ("FAIL", "--fp8_recipe tensorwise needs torchao >= 0.12 (installed: torchao "
                                                  "0.11.0)")
    monkeypatch.setattr(TE, "library_version", lambda: "2.9.0")
    got = preflight.check_fp8_features(settings_for("--fp8", "1", "--model_impl", "te", "--fp8_all_gather", "1"))
    assert got.status == "FAIL" and "--fp8_all_gather 1 needs transformer_engine >= 2.10" in got.message
    monkeypatch.setattr(TE, "library_version", lambda: "2.2.0")
    got = preflight.check_fp8_features(settings_for("--fp8", "1", "--model_impl", "te", "--fp8_recipe", "block"))
    assert got.status == "FAIL" and "--fp8_recipe block needs transformer_engine >= 2.3" in got.message
    monkeypatch.setattr(TE, "library_version", lambda: "2.20.2")
    got = preflight.check_fp8_features(settings_for("--fp8", "1", "--model_impl", "te"))
    assert (got.status, got.message) == ("OK", "te current with transformer_engine 2.20.2")


def test_layout_is_checked_against_the_allocation(monkeypatch):
    for key in ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    got = preflight.check_layout(settings_for("--tp_size", "2", "--tie_word_embeddings", "0"))
    assert (got.status, got.message) == ("OK", "dp_shard 2 x tp 2 = 4 rank(s); 2 data-parallel")
    got = preflight.check_layout(settings_for("--tp_size", "3"))
    assert got.status == "FAIL" and "world size 4 is not divisible by 3" in got.message and "4 task(s)" in got.message
    got = preflight.check_layout(settings_for("--tp_size", "2", "--num_key_value_heads", "1"))
    assert got.status == "FAIL" and "--num_key_value_heads 1 is not divisible by --tp_size 2" in got.message
    # spare nodes: the preflight step has 6 tasks (3 nodes), the job trains on 4 (LLAMA_FP8_TRAIN_TASKS)
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("LLAMA_FP8_TRAIN_TASKS", "4")
    got = preflight.check_layout(settings_for("--tp_size", "2", "--tie_word_embeddings", "0"))
    assert (got.status, got.message) == ("OK", "dp_shard 2 x tp 2 = 4 rank(s); 2 data-parallel"), got


def test_preflight_and_training_agree_on_what_is_a_local_path(tmp_path, monkeypatch):
    """One test of "local path or hub name" (data.files.is_local): a data file name that does not exist is a
    missing local file for preflight as it is for the loader, not a hub name preflight waves through."""
    from llama_fp8.data import files

    monkeypatch.chdir(tmp_path)
    for value in ("corpus.jsonl", "./corpus", str(tmp_path / "nope")):
        assert files.is_local(value)
        got = preflight.check_path("dataset", value)
        assert got.status == "FAIL" and "no such file or directory" in got.message, got
    assert not files.is_local("allenai/c4") and preflight.check_path("dataset", "allenai/c4").status == "OK"
    (tmp_path / "corpus.jsonl").write_text('{"text": "a"}\n')
    assert preflight.check_path("dataset", "corpus.jsonl").status == "OK"


def test_train_task_needs_the_rendezvous_from_the_batch_script(monkeypatch):
    """The task takes MASTER_ADDR/MASTER_PORT from the batch script's setup lines (job_lib.sh's
    lf_setup_rendezvous) and works out no address of its own: without them it stops, saying so."""
    import types

    import submitit

    fake_env = types.SimpleNamespace(hostnames=["n1"], job_id="42", global_rank=0, num_tasks=1, local_rank=0,
                                     num_nodes=1, paths=types.SimpleNamespace(folder="."))
    monkeypatch.setattr(submitit, "JobEnvironment", lambda: fake_env)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("MASTER_PORT", "29542")
    with pytest.raises(RuntimeError, match="MASTER_ADDR not set: the batch script's setup lines"):
        submit.TrainTask(["--model", "tiny"])()
