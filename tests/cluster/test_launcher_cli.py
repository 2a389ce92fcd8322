"""`preflight` and `submit` without a cluster: flag parsing, check results on this CPU host, executor
parameters, and the torchrun wrapper that keeps the workers' exit code."""

from __future__ import annotations

import argparse
import os

import pytest

from llama_fp8.cluster import launch, preflight, submit


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


def test_efa_detection_and_plugin(tmp_path, monkeypatch):
    sysfs = tmp_path / "infiniband"
    for dev, driver in (("rdmap0s1", "efa"), ("mlx5_0", "mlx5_core")):
        (tmp_path / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (sysfs / dev / "device").mkdir(parents=True)
        (sysfs / dev / "device" / "driver").symlink_to(tmp_path / "drivers" / driver)
    assert preflight.efa_devices(str(sysfs)) == ["rdmap0s1"]
    lib = tmp_path / "ofi"
    lib.mkdir()
    (lib / "libnccl-net-ofi.so").write_text("")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(lib))
    assert preflight.ofi_plugin() == str(lib / "libnccl-net-ofi.so")


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


@pytest.mark.parametrize("code", [0, 85, 3])
def test_torchrun_wrapper_keeps_worker_exit_code(code, tmp_path, monkeypatch):
    """Plain torchrun exits 1 for any worker failure; `launch` returns the worker's code
    (85 = checkpoint saved, requeue me, which 1.train_llama.sbatch acts on)."""
    script = tmp_path / "worker.py"
    script.write_text(f"import sys\nsys.exit({code})\n")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port = 29400 + os.getpid() % 500 + code
    rc = launch.main(["--nnodes=1", "--nproc_per_node=1", "--rdzv_backend=c10d",
                      f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=t", str(script)])
    assert rc == code

