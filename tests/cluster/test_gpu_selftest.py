"""scripts/gpu_selftest.sbatch checks the training image, as the docs say: without IMAGE it refuses to test the CPU
.venv that `make install` made (unless a virtualenv is named on purpose), and with IMAGE every step runs in it. The
script runs here with srun and nvidia-smi replaced by recorders."""

from __future__ import annotations

import os
import subprocess

from slurm_helpers import REPO


def run_selftest(tmp_path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "srun.calls"
    (bin_dir / "srun").write_text(f"#!/bin/bash\necho \"$*\" >>{calls}\n")
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    for tool in ("srun", "nvidia-smi"):
        (bin_dir / tool).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("IMAGE", "VENV", "CONTAINER_MOUNTS")}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_selftest.sbatch")], capture_output=True, text=True,
                          env={**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "5",
                               "REPO_DIR": str(REPO), **env}, cwd=tmp_path, timeout=60)
    return proc, calls.read_text().splitlines() if calls.exists() else []


def test_without_an_image_it_refuses_to_test_the_cpu_virtualenv(tmp_path):
    proc, calls = run_selftest(tmp_path)
    assert proc.returncode != 0 and calls == []
    assert "IMAGE" in proc.stderr and "llama-fp8.sqsh" in proc.stderr and "VENV" in proc.stderr, proc.stderr


def test_with_an_image_every_step_runs_in_it(tmp_path):
    image = tmp_path / "llama-fp8.sqsh"
    image.write_text("")
    proc, calls = run_selftest(tmp_path, IMAGE=str(image))
    assert proc.returncode == 0, proc.stderr
    steps = [c for c in calls if "enroot" not in c]
    assert len(steps) == 3 and all(f"--container-image={image}" in c for c in steps), calls


def test_a_virtualenv_named_on_purpose_is_tested(tmp_path):
    proc, calls = run_selftest(tmp_path, VENV="/opt/gpu-venv")
    assert proc.returncode == 0, proc.stderr
    assert calls and all("/opt/gpu-venv/bin/python" in c and "--container-image" not in c for c in calls), calls
    assert "testing the virtualenv /opt/gpu-venv, not an image" in proc.stdout


def test_every_docs_command_of_the_self_test_names_the_image():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "scripts" / "gpu" / "README.md"]
    for page in pages:
        for line in page.read_text().splitlines():
            for at in [i for i in range(len(line)) if line.startswith("sbatch scripts/gpu_selftest.sbatch", i)]:
                assert line[:at].rstrip().endswith(".sqsh"), f"{page.name}: {line.strip()[:120]}"
