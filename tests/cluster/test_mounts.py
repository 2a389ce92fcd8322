"""Pyxis mounts: every path a containerized run reads or writes is mounted, or the launch is refused naming it.

The check runs on the login/head node with its own python3 (stdlib only, Python >= 3.7), before any srun;
preflight repeats it inside the container on the resolved config.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_helpers import REPO

from llama_fp8.cluster.launch import mounts
from llama_fp8.cluster.launch.mounts import Mount, RunPath
from llama_fp8.cluster.nodes import preflight

MOUNTS_PY = REPO / "src/llama_fp8/cluster/launch/mounts.py"


def test_parse_pyxis_mount_syntax():
    got = mounts.parse_mounts("/fsx:/fsx,/scratch/data:/data:ro+rprivate, /home/u ,")
    assert got == [Mount("/fsx", "/fsx"), Mount("/scratch/data", "/data", "ro+rprivate"), Mount("/home/u", "/home/u")]
    assert got[1].read_only and not got[0].read_only and got[1].spec() == "/scratch/data:/data:ro+rprivate"


def test_mount_for_uses_path_components_not_string_prefixes():
    ms = mounts.parse_mounts("/fsx:/fsx,/fsx/runs:/fsx/runs")
    assert mounts.mount_for("/fsx2/runs/a", ms) is None
    assert mounts.mount_for("/fsx/runs/a", ms).target == "/fsx/runs"  # the deepest mount
    assert mounts.mount_for("/fsx", ms).target == "/fsx"


def test_run_paths_from_train_flags_and_environment(tmp_path):
    (tmp_path / "data").mkdir()
    values = mounts.train_path_values(["--model", "tiny", "--run_dir=/scratch/r", "--dataset", "./data",
                                       "--tokenizer", "meta-llama/Llama-3.1-8B", "--init_from_hf", "/models/l8b",
                                       "--checkpoint_dir", "ckpt", "--resume_from_checkpoint", "auto"])
    paths = mounts.run_paths(values, str(tmp_path), {"HF_HOME": "/cache/hf", "SLURM_JOB_ID": "9"},
                             {"AB_DIR": "/fsx/ab"})
    got = {(p.what, p.path, p.write) for p in paths}
    assert got == {("--run_dir", "/scratch/r", True), ("--checkpoint_dir", f"{tmp_path}/ckpt", True),
                   ("--dataset", f"{tmp_path}/data", False), ("--init_from_hf", "/models/l8b", False),
                   ("HF_HOME", "/cache/hf", True), ("AB_DIR", "/fsx/ab", True)}
    # the hub tokenizer and `auto` are not paths; without --run_dir the default is runs/job_<id> here
    default = mounts.run_paths({}, "/work", {"SLURM_JOB_ID": "9"})
    assert [(p.what, p.path) for p in default] == [("--run_dir", "/work/runs/job_9")]


def test_problems_name_each_lost_or_missing_path():
    paths = [RunPath("--run_dir", "/scratch/r", True), RunPath("--dataset", "/data/c4", False),
             RunPath("--checkpoint_dir", "/fsx/ck", True), RunPath("HF_HOME", "/fsx/hf", True)]
    bad = mounts.problems(paths, mounts.parse_mounts("/fsx:/fsx:ro"))
    assert bad == ["--run_dir /scratch/r is outside the container mounts: written there stays in the container "
                   "and is lost when the job ends",
                   "--dataset /data/c4 is outside the container mounts: it does not exist inside the container",
                   "--checkpoint_dir /fsx/ck is on the read-only mount /fsx:/fsx:ro",
                   "HF_HOME /fsx/hf is on the read-only mount /fsx:/fsx:ro"]


def test_auto_mounts(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "runs").mkdir()
    paths = [RunPath("--dataset", str(tmp_path / "data"), False),
             RunPath("--run_dir", str(tmp_path / "runs/new/a"), True)]
    got = mounts.auto_mounts(paths, [Mount("/repo", "/repo")])
    assert [m.spec() for m in got] == ["/repo:/repo", f"{tmp_path}/data:{tmp_path}/data",
                                       f"{tmp_path}/runs:{tmp_path}/runs"]  # the run dir's nearest existing folder
    with pytest.raises(ValueError, match="--dataset .*/nope: no such file"):
        mounts.auto_mounts([RunPath("--dataset", str(tmp_path / "nope"), False)], [])
    with pytest.raises(ValueError, match="would have to mount /"):
        mounts.auto_mounts([RunPath("--run_dir", "/nonexistent-top/r", True)], [])


def cli(args: list[str], env: dict[str, str] | None = None, python: str = sys.executable):
    """The module as 1.train_llama.sbatch runs it on the host: `python3 -m llama_fp8.cluster.launch.mounts`."""
    return subprocess.run([python, "-m", "llama_fp8.cluster.launch.mounts", *args], capture_output=True, text=True,
                          check=False, env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin", **(env or {})})


def test_cli_refuses_an_unmounted_run_dir_with_user_mounts(tmp_path):
    proc = cli(["--repo", str(REPO), "--workdir", str(REPO), "--mounts", f"{REPO}:{REPO}", "--",
                "--model", "tiny", "--run_dir", "/scratch/run1"])
    assert proc.returncode == 1 and proc.stdout == ""
    assert "error: --run_dir /scratch/run1 is outside the container mounts" in proc.stderr
    assert f"CONTAINER_MOUNTS={REPO}:{REPO}" in proc.stderr


def test_cli_computes_mounts_for_every_path(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "cfg.yaml").write_text(f"run_dir: {tmp_path}/runs/from_yaml\n")
    work = tmp_path / "work"
    work.mkdir()
    proc = cli(["--repo", str(REPO), "--workdir", str(work), "--path", f"AB_DIR={tmp_path}/runs/ab", "--",
                "--config", str(tmp_path / "cfg.yaml")], env={"HF_HOME": str(tmp_path / "hf")})
    assert proc.returncode == 0, proc.stderr
    got = proc.stdout.strip().split(",")
    assert got == [f"{REPO}:{REPO}", f"{work}:{work}",
                   f"{tmp_path}/runs:{tmp_path}/runs",  # the YAML's run_dir (not there yet): nearest existing folder
                   f"{tmp_path}/cfg.yaml:{tmp_path}/cfg.yaml", f"{tmp_path}/hf:{tmp_path}/hf"]  # AB_DIR: in runs/


def test_cli_bad_flags():
    assert cli(["--workdir", "/x"]).returncode == 2
    assert cli(["--repo", "/r", "--workdir", "/w", "--path", "AB_DIR"]).returncode == 2


def test_host_module_runs_on_old_python3():
    """Login nodes: Amazon Linux 2 has Python 3.7. Grammar of 3.7 and standard-library imports only (PyYAML
    only inside a function, optional)."""
    tree = ast.parse(MOUNTS_PY.read_text(), feature_version=(3, 7))
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0] for n in top for a in n.names}
    assert names <= {"__future__", "argparse", "os", "sys", "dataclasses", "pathlib"}, names
    for init in (REPO / "src/llama_fp8/__init__.py", REPO / "src/llama_fp8/cluster/__init__.py"):  # run first
        tree = ast.parse(init.read_text(), feature_version=(3, 7))
        assert not [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], f"{init}: imports"


def test_preflight_checks_the_resolved_config_inside_the_container(tmp_path, monkeypatch):
    """In a container (LLAMA_FP8_CONTAINER_MOUNTS set by job_lib.sh), a path from the resolved config that is
    not on a mount fails preflight, naming it."""
    monkeypatch.setenv(mounts.MOUNTS_ENV, f"{tmp_path}/repo:{tmp_path}/repo")
    monkeypatch.chdir(tmp_path)
    s = preflight.resolve(preflight.build_parser().parse_args([]),
                          ["--model", "tiny", "--run_dir", f"{tmp_path}/repo/run", "--checkpoint_dir", "/elsewhere/ck"])
    check = preflight.check_mounts(s)
    assert check.status == "FAIL" and "--checkpoint_dir /elsewhere/ck is outside the container mounts" in check.message
    s = preflight.resolve(preflight.build_parser().parse_args([]), ["--model", "tiny", "--run_dir", f"{tmp_path}/repo/r"])
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    assert preflight.check_mounts(s).status == "OK"
    monkeypatch.delenv(mounts.MOUNTS_ENV)
    assert preflight.check_mounts(s).status == "OK"


def test_image_path_is_absolute_for_submit(tmp_path, monkeypatch):
    from llama_fp8.cluster.launch import submit

    (tmp_path / "img.sqsh").write_text("")
    monkeypatch.chdir(tmp_path)
    assert submit.image_argument("img.sqsh") == str(tmp_path / "img.sqsh")
    assert submit.image_argument("nvcr.io#nvidia/pytorch:25.12-py3") == "nvcr.io#nvidia/pytorch:25.12-py3"
    assert Path(submit.image_argument("./img.sqsh")).is_absolute()


# Every string field of TrainConfig that is not a path, or is one inside another path: each new string field must be
# put here or in mounts.PATH_FLAGS, the one list of what a container must mount.
NOT_PATHS = {"model", "model_type", "model_impl", "fp8_backend", "fp8_recipe", "fp8_exclude", "fp8_verify",
             "fp8_amax_compute_algo", "lr_decay_style", "optimizer", "dataset_config_name", "text_field", "sharding_strategy", "cp_comm_type",
             "activation_checkpointing", "device", "nan_policy", "wandb_project", "wandb_mode", "otlp_endpoint",
             "mlflow_experiment", "mlflow_run_name", "profile_steps", "profile_ranks",
             "checkpoint_copy_dir", "s3_region", "s3_endpoint", "s3_prefix_strategy",  # an s3:// copy: no mount
             "skip_samples"}  # sample ranges to skip
INSIDE_DATASET = {"data_files", "val_data_files"}  # globs inside --dataset: its mount holds them


def test_every_path_flag_of_train_is_in_the_one_list_the_mounts_come_from():
    """A flag that names a file or folder (or a store on a file system: MLflow's) is in PATH_FLAGS, written or read.
    Before, --prometheus_textfile_dir and --mlflow_tracking_uri were not: a textfile run stopped with exit 2 in the
    container, and an MLflow file store was lost with it."""
    import dataclasses
    import typing

    from llama_fp8.config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    strings = {f.name for f in dataclasses.fields(TrainConfig) if str in (typing.get_args(hints[f.name]) or
                                                                          (hints[f.name],))}
    listed = dict(mounts.PATH_FLAGS)
    assert strings - NOT_PATHS - INSIDE_DATASET == set(listed), "classify the new flag: a path (PATH_FLAGS) or not"
    written = {f for f, write in listed.items() if write}
    assert written == {"run_dir", "checkpoint_dir", "tensorboard_dir", "prometheus_textfile_dir",
                       "mlflow_tracking_uri"}


def test_the_textfile_folder_and_a_local_mlflow_store_are_mounted(tmp_path):
    (tmp_path / "textfile").mkdir()
    (tmp_path / "mlflow").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    args = ["--repo", str(REPO), "--workdir", str(work), "--", "--model", "tiny", "--run_dir", str(work / "r"),
            "--prometheus_textfile_dir", str(tmp_path / "textfile")]
    for uri, mounted in ((f"file://{tmp_path}/mlflow/mlruns", f"{tmp_path}/mlflow"),  # a folder MLflow creates
                         (f"sqlite:///{tmp_path}/mlflow/runs.db", f"{tmp_path}/mlflow"),  # the database's folder
                         (f"{tmp_path}/mlflow", f"{tmp_path}/mlflow")):  # a plain path: MLflow's file store
        proc = cli([*args, "--mlflow_tracking_uri", uri])
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().split(",") == [f"{REPO}:{REPO}", f"{work}:{work}",
                                                  f"{tmp_path}/textfile:{tmp_path}/textfile", f"{mounted}:{mounted}"]
    proc = cli([*args, "--mlflow_tracking_uri", "http://127.0.0.1:5000"])  # a server: nothing to mount
    assert proc.stdout.strip().split(",")[3:] == [], proc.stdout
    given = cli(["--repo", str(REPO), "--workdir", str(work), "--mounts", f"{REPO}:{REPO},{work}:{work}", "--",
                 *args[5:], "--mlflow_tracking_uri", f"sqlite:///{tmp_path}/mlflow/runs.db"])
    assert given.returncode == 1
    assert f"--prometheus_textfile_dir {tmp_path}/textfile is outside the container mounts" in given.stderr
    assert f"--mlflow_tracking_uri {tmp_path}/mlflow is outside the container mounts" in given.stderr


@pytest.mark.parametrize(("uri", "path"), [
    ("file:///fsx/mlruns", "/fsx/mlruns"), ("file:mlruns", "/w/mlruns"), ("sqlite:////fsx/db/mlflow.db", "/fsx/db"),
    ("sqlite:///mlflow.db", "/w"), ("mlruns", "/w/mlruns"), ("/fsx/mlruns", "/fsx/mlruns"),
    ("http://host:5000", None), ("https://h/x", None), ("databricks", None), ("postgresql://u@h/db", None),
    ("arn:aws:sagemaker:us-east-1:1:mlflow-tracking-server/x", None), ("sqlite://", None)])
def test_which_mlflow_tracking_uris_are_a_folder_to_mount(uri, path):
    got = [p.path for p in mounts.run_paths({"run_dir": "/w/r", "mlflow_tracking_uri": uri}, "/w", {})][1:]
    assert got == ([path] if path else [])


def test_the_docs_list_of_mounted_paths_is_the_one_list():
    text = (REPO / "docs" / "cluster.md").read_text()
    block = text.split("<!-- mounted-paths:start -->\n")[1].split("<!-- mounted-paths:end -->")[0]
    assert block == mounts.paths_markdown() + "\n", "run: python scripts/update_docs.py"


def test_every_corpus_of_a_data_blend_is_a_path_to_mount():
    values = mounts.train_path_values(["--data_blend", "0.7:/fsx/web,0.3:/lustre/code"])
    paths = mounts.run_paths(values, "/work", {"SLURM_JOB_ID": "9"})
    assert {(p.what, p.path, p.write) for p in paths if p.what == "--data_blend"} == {
        ("--data_blend", "/fsx/web", False), ("--data_blend", "/lustre/code", False)}
