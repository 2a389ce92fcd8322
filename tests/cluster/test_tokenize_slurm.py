"""scripts/slurm/tokenize.sbatch as a real Slurm array on the local cluster: two tasks share the shards, the last one
to finish writes the manifest, and the corpus is byte for byte the one a single local process makes."""

from __future__ import annotations

import json
import random
import subprocess
import time

import pytest
from slurm_helpers import REPO, TERMINAL, sbatch

from llama_fp8.data import demo as demo_data
from llama_fp8.data import tokenize as tk

pytestmark = pytest.mark.slurm


def array_states(job_id: str, env: dict[str, str]) -> dict[str, str]:
    """{array task id: state} of an array job (`scontrol -o show job` prints one line per task)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True,
                         timeout=30, check=False).stdout
    states = {}
    for line in out.splitlines():
        fields = dict(tok.partition("=")[::2] for tok in line.split() if "=" in tok)
        if fields.get("ArrayTaskId"):
            states[fields["ArrayTaskId"]] = f"{fields.get('JobState')} {fields.get('ExitCode')}"
    return states


def test_tokenize_as_a_slurm_array_makes_the_corpus_one_process_makes(job_env, tmp_path):
    rng = random.Random(3)
    words = "red green blue cyan magenta yellow black white".split()
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) for _ in range(90)]
    text = tmp_path / "text"
    text.mkdir()
    (text / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = demo_data.train_tokenizer(docs, 280, tmp_path / "tok")
    args = ["--dataset", str(text), "--tokenizer", str(tok), "--shard_docs", "20"]
    (tmp_path / "logs").mkdir()
    job = sbatch(["--array=0-1", str(REPO / "scripts" / "slurm" / "tokenize.sbatch"), *args, "--out",
                  str(tmp_path / "array")], job_env, tmp_path)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        states = array_states(job, job_env)
        if len(states) == 2 and all(s.split()[0] in TERMINAL for s in states.values()):
            break
        time.sleep(0.5)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.out")}
    assert states == {"0": "COMPLETED 0:0", "1": "COMPLETED 0:0"}, (states, logs)
    said = "\n".join(logs.values())
    assert "task 0 of 2: 3 of 5 shards" in said and "task 1 of 2: 2 of 5 shards" in said, said
    assert tk.main([*args, "--out", str(tmp_path / "local")]) == 0
    assert (tmp_path / "array" / "manifest.json").read_bytes() == (tmp_path / "local" / "manifest.json").read_bytes()
    assert tk.main(["--out", str(tmp_path / "array"), "--verify"]) == 0
