"""Agreement on 2 ranks (torchrun, gloo): with every checkpoint damaged, or one named that is damaged, every
rank ends in the agreed exit 2 together - never a SIGABRT ("terminate called without an active exception")
from a rank that closed its connections while another still talked to it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from ckpt_kit import BASE

from helpers import REPO, cli_env, run_cli
from llama_fp8 import checkpoint as K


def flip(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("damaged", ["__1_0.distcp", "rank1.safetensors", "COMPLETE"])
def test_every_checkpoint_damaged_on_two_ranks_ends_in_the_agreed_exit(tmp_path, damaged, hostile):
    b = tmp_path / "b"
    args = ["train", *BASE, "--run_dir", str(b), "--checkpoint_freq", "2"]
    r = run_cli([*args, "--max_steps", "4"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    for _, folder in K.complete_checkpoints(b / "checkpoints"):
        flip(folder / damaged)
    # `llama-fp8 launch`: torchrun that returns the first failed worker's own exit code (as the sbatch runs it)
    r = subprocess.run([sys.executable, "-m", "llama_fp8", "launch", "--standalone", "--nproc_per_node=2", "-m",
                        "llama_fp8", *args, "--max_steps", "6"], capture_output=True, text=True, env=cli_env(),
                       cwd=REPO, timeout=300)
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", r.stderr)]
    assert r.returncode == 2 and codes and set(codes) <= {2}, (r.returncode, codes, r.stderr[-3000:])
    assert "terminate called" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "no sound checkpoint to resume from" in r.stderr and r.stderr.count("llama-fp8 train: error") == 1
    assert sorted(p.name for p in (b / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        ["step_2.broken", "step_4.broken"]  # set aside, nothing deleted
    hostile(f"launcher exit {r.returncode}, worker exit codes {codes}; one \"no sound checkpoint to resume from\" "
            f"message; step_2.broken, step_4.broken kept")
