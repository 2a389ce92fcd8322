"""The batch scripts under real Pyxis + Enroot on the 2-node local cluster, with the image built from
0.transformer-engine.dockerfile (test_container_build.py): training with preflight in the container, a restart
inside the allocation, a requeue, the outcome files the host side reads, the environment the workers get, and the
same-allocation A/B with its report.

One training job serves several tests (it takes minutes on 2 cores): IMAGE given as a relative path, 2 nodes x 1
rank, rank 1 killed once at step 2 (the launchers restart every rank in the allocation), every rank paused at
step 5 and sent USR1 (checkpoint, exit 85, `scontrol requeue`), the second run of the job resuming to step 8. A
probe (a sitecustomize.py on PYTHONPATH, the only host path the image's Python is given) records what every Python
process of every job step sees: its environment, whether it runs in the image, where llama_fp8 comes from."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from container_helpers import node_containers
from slurm_helpers import (
    REPO,
    SBATCH,
    SMALL,
    assert_completed,
    batch_lines,
    job_info,
    make_job_env,
    read_jsonl,
    release_requeued,
    sbatch,
    wait_job,
)

pytestmark = pytest.mark.container
STEPS = 8
PROBE = """# The container tests' probe (tests/cluster/test_container_jobs.py): what a job step's Python process sees.
import importlib.util, json, os, sys
if os.environ.get("SLURM_STEP_ID") is not None:
    spec = importlib.util.find_spec("llama_fp8")
    record = {{"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(),
              "llama_fp8": spec.origin if spec else None,
              "in_image": os.path.exists("/etc/llama-fp8/standin-base"),
              "requeue_mark": os.path.exists("{mark}"),
              "hf_home_is_dir": os.path.isdir(os.environ.get("HF_HOME", "/nonexistent"))}}
    name = "{{}}.{{}}.{{}}.json".format(os.environ.get("SLURM_RESTART_COUNT", "0"), os.environ["SLURM_STEP_ID"],
                                     os.getpid())
    with open(os.path.join("{folder}", name), "w") as f:
        json.dump(record, f)
"""
# A file the test puts into each node's container (from the host, into Enroot's copy of it) while the first run
# is paused: the second run sees it only if its container is the first run's.
MARK = "/.llama-fp8-first-run"
# What the submitting shell exports, by group: each must reach the workers inside the container.
NCCL = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1",
        "NCCL_NET_PLUGIN": "/opt/site/libnccl-net-site.so"}  # the image sets NCCL_NET_PLUGIN too: the user's wins
FI = {"FI_PROVIDER": "tcp", "FI_EFA_FORK_SAFE": "1", "FI_LOG_LEVEL": "warn"}
HF = {"HF_TOKEN": "hf_llama_fp8_test_not_a_token", "HF_HUB_OFFLINE": "1"}


@dataclass
class Trained:
    job: str
    dir: Path
    outside: Path
    image: Path
    info: dict[str, str]
    env: dict[str, str]
    containers_while_paused: dict[str, list[str]]

    @property
    def log(self) -> Path:
        return self.dir / "logs" / f"llama-fp8_{self.job}.out"

    @property
    def run(self) -> Path:
        return self.outside / "run"

    def probes(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted((self.dir / "probe").glob("*.json"))]

    def workers(self) -> list[dict]:
        return [p for p in self.probes() if "TORCHELASTIC_RUN_ID" in p["env"] and "RANK" in p["env"]]


def pause_and_signal(job: str, env: dict[str, str], faults: Path, log: Path) -> None:
    """As slurm_helpers.signal_while_paused (both ranks paused in step 5, then USR1), for a job whose first
    steps include a restart: the pause files appear only after it."""
    paused = [faults / f"paused.step.rank{r}" for r in (0, 1)]
    wait_job(job, env, timeout=900, until=lambda i: all(p.exists() for p in paused))
    assert all(p.exists() for p in paused), f"job {job} ended before its ranks paused: {log.read_text()[-3000:]}"
    subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True)
    deadline = time.monotonic() + 120
    while "received SIGUSR1" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.3)
    (faults / "release").touch()
    assert "received SIGUSR1" in log.read_text(), "no rank logged the USR1"


@pytest.fixture(scope="module")
def trained(pyxis, project_image, tmp_path_factory) -> Trained:
    folder = tmp_path_factory.mktemp("train")
    for sub in ("logs", "probe", "faults"):
        (folder / sub).mkdir()
    outside = Path(tempfile.mkdtemp(prefix="llama-fp8-outside-"))  # neither the repository nor the submit dir
    (outside / "hf").mkdir()
    (folder / "probe" / "sitecustomize.py").write_text(PROBE.format(folder=folder / "probe", mark=MARK))
    (folder / "llama-fp8.sqsh").symlink_to(project_image.sqsh)
    env = {k: v for k, v in make_job_env(pyxis).items() if k not in ("VENV", "PYTHONPATH")}
    env.update(NCCL, **FI, **HF, IMAGE="llama-fp8.sqsh", NPROC_PER_NODE="1", MAX_RESTARTS="2",
               PYTHONPATH=str(folder / "probe"), HF_HOME=str(outside / "hf"),
               HF_DATASETS_CACHE=str(outside / "hf" / "datasets"),
               CONTAINER_NAME="set-by-some-other-tool",  # must not name our container
               LLAMA_FP8_FAULT="kill@data:step=2:rank=1:once;pause@step:step=5:once",
               LLAMA_FP8_FAULT_DIR=str(folder / "faults"))
    args = [*SMALL, "--max_steps", str(STEPS), "--checkpoint_freq", "1", "--logging_freq", "1", "--fp8=0",
            "--process_group_timeout", "60",
            "--run_dir", str(outside / "run")]
    job = sbatch(["--nodes=2", SBATCH, *args], env, folder)
    log = folder / "logs" / f"llama-fp8_{job}.out"
    try:
        pause_and_signal(job, env, folder / "faults", log)
        seen = {node: node_containers(pyxis, node) for node in ("n1", "n2")}
        for node in ("n1", "n2"):  # Enroot's copy of this node's container, written from the host
            root = Path(pyxis.root) / "nodes" / node / "enroot" / "data" / f"pyxis_llama-fp8-{job}"
            if root.is_dir():
                (root / MARK.lstrip("/")).touch()
        release_requeued(job, env, timeout=300)
        info = wait_job(job, env, timeout=900)
        yield Trained(job, folder, outside, project_image.sqsh, info, env, seen)
    finally:
        subprocess.run(["scancel", job], env=env, check=False)
        shutil.rmtree(outside, ignore_errors=True)


def test_trains_and_resumes_through_a_restart_and_a_requeue(trained):
    """`Batch N Loss` lines up to the last step; a restart inside the allocation, then a requeue; the run's
    metrics on the host's folder with one start per attempt, resuming where each left off."""
    assert_completed(trained.info, trained.log)
    text = trained.log.read_text()
    assert sorted(set(batch_lines(trained.log))) == list(range(1, STEPS + 1))
    assert "restarting the workers of every node (restart 1 of the job, 1 of 2 without a new checkpoint)" in text
    assert f"requeueing job {trained.job}" in text and trained.info["Restarts"] == "1"
    records = read_jsonl(trained.run / "metrics.jsonl")
    starts = [r["start_step"] for r in records if r["type"] == "meta"]
    assert starts[0] == 0 and starts[-1] == 5 and len(starts) == 3, starts
    assert [r["step"] for r in records if r["type"] == "train"][-1] == STEPS


def test_the_host_side_reads_the_launchers_outcome_files(trained):
    """Each run of the job has its outcome folder on the host (written inside the container, on the submit
    dir's mount): the first says requeue, the second done; the batch script's decisions come from them."""
    first = trained.dir / "logs" / f"llama-fp8-outcome_{trained.job}.0"
    second = trained.dir / "logs" / f"llama-fp8-outcome_{trained.job}.1"
    assert sorted(p.name for p in first.iterdir()) == ["node0", "node1"]
    assert {p.read_text().split()[1] for p in first.iterdir()} == {"requeue"}
    assert {p.read_text().split()[1] for p in second.iterdir()} == {"done"}
    text = trained.log.read_text()
    assert f"job {trained.job}: training finished on every node" in text


def test_preflight_runs_inside_the_container_on_every_node(trained):
    preflight = [p for p in trained.probes() if "preflight" in p["argv"]]
    first = [p["env"]["SLURMD_NODENAME"] for p in preflight if p["env"].get("SLURM_RESTART_COUNT", "0") == "0"]
    assert sorted(first) == ["n1", "n2"]
    assert all(p["in_image"] for p in preflight)
    text = trained.log.read_text()
    assert "preflight on n1:" in text and "preflight on n2:" in text and "preflight of job step: 2 node(s)" in text
    assert re.search(r"\[  OK\] mounts: \d+ path\(s\) on mounts \(", text)


def test_one_named_container_per_node_recreated_after_the_requeue_and_removed(trained, pyxis):
    """The job's steps share one container per node, named from the job id (not from CONTAINER_NAME, which
    other tools set). The first run removes it before `scontrol requeue` (afterwards, in the EXIT trap, the
    requeue had already ended the job's steps: "could not remove", and the requeued run reused the old one) and
    the requeued run unpacks a fresh one; none is left when the job ends."""
    name = f"pyxis_llama-fp8-{trained.job}"
    assert trained.containers_while_paused == {"n1": [name], "n2": [name]}
    second = [p for p in trained.workers() if p["env"].get("SLURM_RESTART_COUNT", "0") == "1"]
    assert second and not any(p["requeue_mark"] for p in second), "the requeued run reused the first run's container"
    assert "could not remove container" not in trained.log.read_text()
    assert node_containers(pyxis, "n1") == [] and node_containers(pyxis, "n2") == []


def test_the_workers_run_the_images_code_in_the_submit_dir(trained):
    workers = trained.workers()
    assert sorted({(p["env"].get("SLURM_RESTART_COUNT", "0"), p["env"]["RANK"]) for p in workers}) == \
        [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    for p in workers:
        assert p["in_image"] and p["llama_fp8"].startswith("/usr/local/lib/python3"), p["llama_fp8"]
        assert p["cwd"] == str(trained.dir)


def worker_env(trained) -> list[dict[str, str]]:
    return [p["env"] for p in trained.workers()]


def test_nccl_variables_reach_the_workers(trained):
    """NCCL_* from the submitting shell, the plugin path included although the image sets one (Pyxis lets the
    image's value win unless the variable is named in --container-env)."""
    for env in worker_env(trained):
        assert {k: env.get(k) for k in NCCL} == NCCL
        assert env["NCCL_TUNER_PLUGIN"] == "/opt/llama-fp8/nccl/libnccl-tuner-ofi.so"  # not set here: the image's


def test_libfabric_variables_reach_the_workers(trained):
    for env in worker_env(trained):
        assert {k: env.get(k) for k in FI} == FI


def test_hugging_face_variables_reach_the_workers_and_hf_home_is_mounted(trained):
    for probe in trained.workers():
        env = probe["env"]
        assert {k: env.get(k) for k in HF} == HF
        assert env["HF_HOME"] == str(trained.outside / "hf") and probe["hf_home_is_dir"]
        assert env["HF_DATASETS_CACHE"] == str(trained.outside / "hf" / "datasets")


def test_the_runs_variables_reach_the_workers(trained):
    """What the batch script and the launcher set, and what the image decides (PATH, LD_LIBRARY_PATH)."""
    image = str(trained.image.resolve())
    digest = Path(f"{trained.image}.sha256").read_text().split()[0]
    for env in worker_env(trained):
        assert env["LLAMA_FP8_IMAGE"] == image and env["LLAMA_FP8_IMAGE_SHA256"] == digest
        assert env["LLAMA_FP8_PREFLIGHT"] == str(trained.dir / "logs" / f"llama-fp8-preflight_{trained.job}.json")
        mounts = env["LLAMA_FP8_CONTAINER_MOUNTS"].split(",")
        assert f"{REPO}:{REPO}" in mounts and f"{trained.dir}:{trained.dir}" in mounts
        sources = [m.split(":")[0] for m in mounts]
        for path in (trained.run, trained.outside / "hf"):  # mounted: the folder itself or its nearest existing one
            assert any(str(path) == s or str(path).startswith(s + "/") for s in sources), (path, mounts)
        assert env["LLAMA_FP8_FAULT"] == trained.env["LLAMA_FP8_FAULT"] and env["OMP_NUM_THREADS"] == "1"
        assert env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1"
        assert env["CONTAINER_NAME"] == "set-by-some-other-tool"
        assert env["PATH"].split(":")[0] == "/opt/amazon/efa/bin"  # the image's PATH, not the submitting shell's
        # the image's, and without an empty entry (the dynamic linker's current directory) on a base without one
        assert env["LD_LIBRARY_PATH"] == "/opt/llama-fp8/nccl/lib:/opt/amazon/efa/lib"
    meta = read_jsonl(trained.run / "metrics.jsonl")[0]["environment"]
    assert meta["image"] == image and meta["image_digest"] == digest and meta["image_build"]["base"] == "stand-in"
    assert meta["nccl_net_plugin"] == NCCL["NCCL_NET_PLUGIN"]


def test_same_allocation_ab_under_pyxis_writes_its_report(pyxis, project_image, job_env, tmp_path):
    """2.ab_fp8_vs_bf16.sh with IMAGE: one job, preflight, both arms and the report in the container; the report
    names the image and its stand-in base; no container is left."""
    ab = tmp_path / "ab"
    env = {k: v for k, v in job_env.items() if k not in ("VENV", "PYTHONPATH")}
    env.update(IMAGE=str(project_image.sqsh), SBATCH_ARGS="--nodes=1", NPROC_PER_NODE="2", AB_DIR=str(ab))
    # --compile=0: the A/B preset compiles both arms for torchao's FP8 on CPU, and Inductor's CPU code needs a C++
    # compiler that NGC's image has and the stand-in base has not (the preset itself runs in the host A/B test).
    proc = subprocess.run([str(REPO / "2.ab_fp8_vs_bf16.sh"), *SMALL, "--max_steps", "3", "--compile=0"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    job = next(ln.split()[2] for ln in proc.stdout.splitlines() if ln.startswith("ab job:"))
    info = wait_job(job, env, timeout=900)
    log = tmp_path / "logs" / f"llama-fp8-ab_{job}.out"
    assert_completed(info, log)
    text = log.read_text()
    assert f"image {project_image.sqsh} (container llama-fp8-{job}" in text
    assert text.count("preflight of job step: 1 node(s), 2 task(s): passed") == 1
    for name, fp8 in (("fp8", True), ("bf16", False)):
        assert yaml.safe_load((ab / name / "config.yaml").read_text())["asked"]["fp8"] is fp8
    summary = json.loads((ab / "report" / "summary.json").read_text())
    assert summary["environment"]["same_hardware"] is True
    report = (ab / "report" / "report.md").read_text()
    assert "stand-in for NGC 26.09-py3 (tests)" in report and str(project_image.sqsh) in report
    assert job_info(job, env)["NodeList"] in pyxis.nodes
    assert all(node_containers(pyxis, node) == [] for node in pyxis.nodes)


def test_image_mode_refuses_an_unmounted_path_before_any_srun(pyxis, project_image, job_env, tmp_path):
    """With CONTAINER_MOUNTS chosen by the user, a --run_dir outside them is refused on the host, naming it,
    before any step (results would otherwise vanish with the container): no container was created."""
    (tmp_path / "logs").mkdir()
    env = {k: v for k, v in job_env.items() if k not in ("VENV", "PYTHONPATH")}
    env.update(IMAGE=str(project_image.sqsh), CONTAINER_MOUNTS=f"{REPO}:{REPO},{tmp_path}:{tmp_path}")
    job = sbatch(["--nodes=1", SBATCH, *SMALL, "--run_dir", "/var/tmp/llama-fp8-lost-run"], env, tmp_path)
    info = wait_job(job, env, timeout=120)
    assert info["JobState"] == "FAILED", info
    text = (tmp_path / "logs" / f"llama-fp8_{job}.out").read_text()
    assert "error: --run_dir /var/tmp/llama-fp8-lost-run is outside the container mounts" in text
    assert "preflight" not in text
    assert node_containers(pyxis, "n1") == [] and node_containers(pyxis, "n2") == []


def test_gpu_selftest_test_step_runs_in_the_image(pyxis, project_image, job_env, tmp_path):
    """scripts/gpu_selftest.sbatch's second step, `pytest -q -m gpu tests -rs` in the image with the repository
    mounted, as the script runs it: on CPU every GPU test is skipped, so it must collect the whole suite and pass
    (the image had no pytest: the self-test the README asks for first on a new cluster failed there). Without
    pytest's cache, which would write into the repository."""
    script = (REPO / "scripts" / "gpu_selftest.sbatch").read_text()
    assert 'srun "${SRUN_ARGS[@]}" "${PY[@]}" -m pytest -q -m gpu tests -rs' in script
    env = {k: v for k, v in job_env.items() if k not in ("VENV", "PYTHONPATH")}
    proc = subprocess.run(["srun", "--nodes=1", "--ntasks=1", f"--container-image={project_image.sqsh}",
                           f"--container-mounts={REPO}:{REPO}", f"--container-workdir={REPO}",
                           "python", "-m", "pytest", "-q", "-m", "gpu", "tests", "-rs", "-p", "no:cacheprovider"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\d+ skipped, \d+ deselected", proc.stdout) and " error" not in proc.stdout
