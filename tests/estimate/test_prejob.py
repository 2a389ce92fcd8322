"""Before a job starts: the batch script's ``lf_estimate`` (cluster/launch/job_estimate.sh) and ``submit``'s estimate stop a run
that does not fit, let everything else go on, and can be switched off. Shell-level: job_lib.sh sourced under
``set -euo pipefail`` with srun and nvidia-smi replaced (recorders, or srun running its command here: the real
estimate on this machine). The real-cluster run of 1.train_llama.sbatch is tests/cluster/test_real_cluster.py
(CPU mode: the estimate says it is skipped)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from helpers import REPO, cli_env
from llama_fp8 import config, errors
from llama_fp8.cluster.launch import submit

TINY = "--model tiny --num_layers 2 --max_context_width 128 --train_batch_size 2"


def run_lib(tmp_path, script: str, srun: str, smi_mib: str = "81559, 551", smi: str | None = None,
            **env: str) -> subprocess.CompletedProcess:
    """Source job_lib.sh with ``srun`` and ``nvidia-smi`` replaced (``smi``: its body; by default it prints
    ``smi_mib``), set what lf_setup would, run ``script``."""
    calls = tmp_path / "srun.calls"
    harness = f"""
set -euo pipefail
source {REPO}/scripts/slurm/job_lib.sh
srun() {{ printf '%s\\n' "$*" >>{calls}; {srun}; }}
nvidia-smi() {{ {smi or f'echo "{smi_mib}"'}; }}
SLURM_JOB_NUM_NODES=2 CPUS=2 NPROC_PER_NODE=8 DEVICE=cuda PY=({sys.executable}) CONTAINER_ARGS=()
{script}
echo TRAINING-WOULD-START
"""
    return subprocess.run(["bash", "-c", harness], capture_output=True, text=True, timeout=600,
                          env=cli_env(**env), cwd=REPO)


def srun_calls(tmp_path) -> list[str]:
    path = tmp_path / "srun.calls"
    return path.read_text().splitlines() if path.exists() else []


def test_the_estimate_step_gets_the_jobs_shape_and_the_gpus_memory(tmp_path):
    r = run_lib(tmp_path, f"lf_estimate {TINY}", srun="return 0")
    assert r.returncode == 0 and "TRAINING-WOULD-START" in r.stdout, r.stderr
    (call,) = srun_calls(tmp_path)
    assert call.startswith("--nodes=1 --ntasks=1 --cpus-per-task=2 --time=30 ")  # a hung estimate ends in 30 min
    # nvidia-smi's memory.total less memory.reserved (the driver's): 81,559 - 551 MiB, what PyTorch sees on an H100
    # with the estimate's suggestions: a run that does not fit stops with what would make it fit
    assert f"-m llama_fp8 estimate --nodes 2 --gpus_per_node 8 --gpu_memory_gib 79.1094 {TINY}" in call
    assert "warning" not in r.stderr
    old_driver = '[[ "$*" == *memory.reserved* ]] && { echo "not a valid field" >&2; return 2; }; echo 81559'
    run_lib(tmp_path, f"lf_estimate {TINY}", srun="return 0", smi=old_driver)  # no memory.reserved field: the total
    assert "--gpu_memory_gib 79.6475 " in srun_calls(tmp_path)[1]


def test_the_estimate_checks_against_the_row_of_the_nodes_gpu(tmp_path):
    """nvidia-smi's name picks the row (estimate/gpus.py for_device): a GB200 node is estimated with GB200's NVLink
    domain and 4 GPUs per node; a name not in the table leaves the default."""
    gb200 = '[[ "$*" == *name* ]] && { echo "NVIDIA GB200"; return 0; }; echo "189471, 738"'
    run_lib(tmp_path, f"lf_estimate {TINY}", srun="return 0", smi=gb200)
    assert f"--gpu_memory_gib 184.31 --gpu GB200 {TINY}" in srun_calls(tmp_path)[0]  # with the suggestions
    l40s = '[[ "$*" == *name* ]] && { echo "NVIDIA L40S"; return 0; }; echo "46068, 0"'
    run_lib(tmp_path, f"lf_estimate {TINY}", srun="return 0", smi=l40s)
    assert f"--gpu_memory_gib 44.9883 {TINY}" in srun_calls(tmp_path)[1]


def test_without_nvidia_smis_memory_the_estimate_says_which_gpu_it_checks_against(tmp_path):
    r = run_lib(tmp_path, f"lf_estimate {TINY}", srun="return 0", smi_mib="N/A")
    (call,) = srun_calls(tmp_path)
    assert r.returncode == 0 and "--gpu_memory_gib" not in call
    assert "nvidia-smi reported no memory.total ('N/A'): checking against an H100's memory" in r.stderr


def test_the_shell_and_python_agree_on_the_estimates_exit_codes():
    lib = (REPO / "src/llama_fp8/cluster/launch/job_estimate.sh").read_text()
    assert re.search(r"local does_not_fit=(\d+) stand_in=(\d+)", lib).groups() == (
        str(errors.EXIT_DOES_NOT_FIT), str(errors.EXIT_STAND_IN_DOES_NOT_FIT))


@pytest.mark.parametrize(("rc", "goes_on", "words"), [
    (errors.EXIT_DOES_NOT_FIT, False, "does not fit the GPUs' memory (report above, ending with what would make it fit)"),
    (errors.EXIT_BAD_CONFIG, True, "could not decide (exit code 2): training goes on"),
    # through a stand-in (the TE model of the default image, estimated through the HF one): it stops the job too
    (errors.EXIT_STAND_IN_DOES_NOT_FIT, False, "as estimated through a stand-in for the job's model implementation"),
    (1, True, "could not decide (exit code 1)"),
])
def test_a_run_that_does_not_fit_stops_the_job_and_nothing_else_does(tmp_path, rc, goes_on, words):
    r = run_lib(tmp_path, f"lf_estimate {TINY}", srun=f"return {rc}")
    assert ("TRAINING-WOULD-START" in r.stdout) == goes_on and (r.returncode == 0) == goes_on
    assert words in r.stderr
    assert goes_on or "set IGNORE_ESTIMATE=1 to start it anyway" in r.stderr


@pytest.mark.parametrize("rc", [errors.EXIT_DOES_NOT_FIT, errors.EXIT_STAND_IN_DOES_NOT_FIT])
def test_ignore_estimate_starts_a_run_that_does_not_fit_with_a_warning(tmp_path, rc):
    """The explicit way on: the estimate still runs and its report stays in the log; the job starts."""
    r = run_lib(tmp_path, f"lf_estimate {TINY}", srun=f"return {rc}", IGNORE_ESTIMATE="1")
    assert r.returncode == 0 and "TRAINING-WOULD-START" in r.stdout and len(srun_calls(tmp_path)) == 1
    assert "does not fit the GPUs' memory" in r.stderr and "IGNORE_ESTIMATE=1: training starts anyway" in r.stderr


@pytest.mark.parametrize(("env", "words"), [({"SKIP_ESTIMATE": "1"}, "skipped (SKIP_ESTIMATE=1)"),
                                            ({"DEVICE_OVERRIDE": "cpu"}, "skipped (device cpu")])
def test_it_can_be_switched_off_and_is_off_on_cpu(tmp_path, env, words):
    script = ("DEVICE=cpu; " if "DEVICE_OVERRIDE" in env else "") + f"lf_estimate {TINY}"
    r = run_lib(tmp_path, script, srun="return 4", **env)
    assert r.returncode == 0 and words in r.stdout and srun_calls(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize(("smi_mib", "starts"), [("81559, 551", True), ("1024, 0", False)])
def test_the_real_estimate_decides(tmp_path, smi_mib, starts):
    """srun runs its command here: the real estimate of the tiny model, against 80 GB and against 1 GiB (less than
    the CUDA context term alone)."""
    run_command = 'while [[ "$1" == --* ]]; do shift; done; "$@"'
    r = run_lib(tmp_path, f"lf_estimate {TINY}", srun=run_command, smi_mib=smi_mib)
    assert ("TRAINING-WOULD-START" in r.stdout) == starts, r.stderr[-2000:]
    assert ("fits:" in r.stdout) == starts and ("DOES NOT FIT" in r.stdout) == (not starts)


def readme_train_args() -> dict[str, list[str]]:
    """The train flags of the README's cluster steps 4 (the batch script) and 5 (the A/B, whose job estimates each arm
    with --fp8=0 and --fp8=1), as a user copies them."""
    lines = [ln.split("#")[0] for ln in (REPO / "README.md").read_text().splitlines()]
    step4 = next(ln for ln in lines if "sbatch 1.train_llama.sbatch" in ln)
    step5 = next(ln for ln in lines if "./2.ab_fp8_vs_bf16.sh" in ln)
    return {"step 4": shlex.split(step4.split("1.train_llama.sbatch", 1)[1]),
            **{f"step 5, --fp8={f}": [*shlex.split(step5.split("2.ab_fp8_vs_bf16.sh", 1)[1]), f"--fp8={f}"]
               for f in (0, 1)}}


def test_the_readme_names_a_preset_in_its_cluster_steps():
    args = readme_train_args()
    assert all("--model" in a and "--activation_checkpointing" not in a for a in args.values()), args
    assert args["step 4"][args["step 4"].index("--model") + 1] in config.available_presets()


@pytest.mark.slow
@pytest.mark.parametrize("step", ["step 4", "step 5, --fp8=0"])  # step 5's --fp8=1 arm is step 4's flags
def test_the_readmes_cluster_commands_fit_an_8_x_h100_node_by_the_pre_job_estimate(tmp_path, step):
    """The README's own commands, through the batch script's estimate step as the job runs it (srun runs its command
    here: the real estimate), for one node of 8 H100s as nvidia-smi reports them: the preset's defaults fit, and the job
    goes on to training. Before, the 8B preset checkpointed nothing and needed over 110 GiB per GPU, and the job
    only warned (a stand-in's "does not fit"): it would have run out of memory."""
    run_command = 'while [[ "$1" == --* ]]; do shift; done; "$@"'
    r = run_lib(tmp_path, "SLURM_JOB_NUM_NODES=1; lf_estimate " + shlex.join(readme_train_args()[step]),
                srun=run_command)
    assert "fits:" in r.stdout and "DOES NOT FIT" not in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0 and "TRAINING-WOULD-START" in r.stdout and "warning" not in r.stderr, r.stderr[-2000:]


def test_the_batch_script_estimates_after_preflight_and_before_training():
    lines = [ln.strip() for ln in (REPO / "1.train_llama.sbatch").read_text().splitlines()]
    order = [next(i for i, ln in enumerate(lines) if ln.startswith(step)) for step in
             ('lf_preflight "$@"', 'lf_estimate "$@"', 'lf_run_training "$@"')]
    assert order == sorted(order)
    lib = (REPO / "src/llama_fp8/cluster/launch/job_lib.sh").read_text()
    assert re.search(r'^source ".*/job_estimate\.sh"$', lib, re.M)  # the batch scripts' library brings lf_estimate
    assert re.search(r"^lf_estimate\(\) \{", (REPO / "src/llama_fp8/cluster/launch/job_estimate.sh").read_text(), re.M)


def test_the_ab_job_estimates_every_arm_after_preflight_and_before_the_first_run(tmp_path):
    """Each arm's first run is estimated with its own flags (a recipe arm's recipe), once, whatever the repeats."""
    lines = [ln.strip() for ln in (REPO / "scripts/slurm/ab_job.sbatch").read_text().splitlines()]
    order = [next(i for i, ln in enumerate(lines) if ln.startswith(step)) for step in
             ('lf_preflight "$@"', 'lf_estimate "$@"', 'lf_run_training "$@"')]
    assert order == sorted(order)
    start = max(i for i in range(order[1]) if lines[i].startswith("while read"))
    end = next(i for i in range(order[1], len(lines)) if lines[i].startswith("done"))
    loop = "\n".join(lines[start:end + 1]).replace('"$@"', TINY)  # the loop as the job runs it
    schedule = "schedule=$'pair1/bf16 0 5\\npair1/mxfp8 1 5 --fp8_recipe=mxfp8\\npair2/mxfp8 1 6 --fp8_recipe=mxfp8\\n" \
               "pair2/bf16 0 6'\n"
    r = run_lib(tmp_path, schedule + loop, srun="cat >/dev/null; return 0")  # srun eats stdin: the loop must not care
    assert r.returncode == 0, r.stderr
    assert [c.split(" estimate ")[1].split()[-2:] for c in srun_calls(tmp_path)] == [
        [TINY.split()[-1], "--fp8=0"], ["--fp8_recipe=mxfp8", "--fp8=1"]]
    r = run_lib(tmp_path, schedule + loop, srun='[[ "$*" == *--fp8=0* ]] && return 4; return 0')
    assert r.returncode != 0 and "TRAINING-WOULD-START" not in r.stdout  # one arm that does not fit stops the job


def test_submit_does_not_submit_a_run_that_does_not_fit(monkeypatch, capsys):
    from llama_fp8.estimate import cli

    asked, submitted = [], []
    monkeypatch.setattr(cli, "main", lambda argv: asked.append(argv) or cli.EXIT_DOES_NOT_FIT)
    monkeypatch.setattr(submit, "submit", lambda *a: submitted.append(a) or 0)
    argv = ["--nodes", "4", "--gpus_per_node", "8", "--estimate_gpu", "H200", "--", "--model", "tiny"]
    assert submit.main(argv) == 4 and submitted == []
    assert asked == [["--model", "tiny", "--nodes", "4", "--gpus_per_node", "8", "--gpu", "H200"]]  # with suggestions
    assert "not submitted" in capsys.readouterr().err
    monkeypatch.setattr(cli, "main", lambda argv: 0)
    assert submit.main(argv) == 0 and len(submitted) == 1
    monkeypatch.setattr(cli, "main", lambda argv: 2)  # cannot estimate: submitted, with a warning
    assert submit.main(argv) == 0 and len(submitted) == 2 and "could not decide" in capsys.readouterr().err
    monkeypatch.setattr(cli, "main", lambda argv: 5)  # does not fit through a stand-in: not submitted either
    assert submit.main(argv) == 4 and len(submitted) == 2
    err = capsys.readouterr().err
    assert "does not fit as estimated through a stand-in" in err and "not submitted" in err


def test_submit_submits_with_a_warning_when_the_estimate_fails_unexpectedly(monkeypatch, capsys):
    """An error the estimate did not foresee (not a flag it refuses) is the estimate's problem, not the job's: the
    job is submitted, with a warning naming the error and how to skip the estimate."""
    from llama_fp8.estimate import assess

    def broken(*args, **kwargs):
        raise RuntimeError("an op fake tensors cannot run")

    submitted = []
    monkeypatch.setattr(assess, "estimate", broken)
    monkeypatch.setattr(submit, "submit", lambda *a: submitted.append(a) or 0)
    assert submit.main(["--gpus_per_node", "8", "--", "--model", "tiny"]) == 0 and len(submitted) == 1
    err = capsys.readouterr().err
    assert "RuntimeError: an op fake tensors cannot run" in err and "--estimate 0" in err and "submitting" in err


def test_submit_estimate_switches(monkeypatch, capsys):
    from llama_fp8.estimate import cli

    monkeypatch.setattr(cli, "main", lambda argv: pytest.fail("estimated although switched off or CPU"))
    monkeypatch.setattr(submit, "submit", lambda *a: 0)
    assert submit.main(["--nodes", "2", "--gpus_per_node", "8", "--estimate", "0", "--", "--model", "tiny"]) == 0
    assert submit.main(["--nodes", "2", "--", "--model", "tiny"]) == 0  # a CPU job: nothing to fit
    assert submit.main(["--gpus_per_node", "8", "--estimate_gpu", "X1", "--", "--model", "tiny"]) == 2
    assert "--estimate_gpu 'X1' is not valid" in capsys.readouterr().err
