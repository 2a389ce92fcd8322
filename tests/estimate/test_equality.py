"""The estimate equals a real run of the same configuration, to the byte.

"Real" here: the same program (``estimate.run.measure``: the training build path, a warm-up step and one
``train_step`` under the same tracker) on 2 real processes over gloo with real CPU tensors, and no fake-mode
correction; the estimate runs it as rank 0 of 2 in this one process on the fake process group with fake tensors.
One case is also compared with ``llama_fp8 train`` itself (2 steps, the second under the tracker): its plan,
data loader, optimizer and loop, not the estimate's set-up of them.
Both are measured by the same instrument (FSDPMemTracker), so any difference is the fake world's: a tensor the
fake run allocates that the real one does not, or the reverse. What the instrument itself cannot see on a GPU
is another question (estimate/terms.py, and the GPU test).

Compared: the peak, its split by kind and where it happens, the sharded parameters, gradients and optimizer
states as the optimizer step starts, the collectives (kind, mesh dimension, phase, calls, bytes) and the rank's
parameter elements, for every rank of the real run against the estimate (rank 0's: it stands for every rank, so a
rank that holds or sends more than rank 0 fails). One gloo artefact is kept out of the peak by the choice of shapes: gloo's reduce-scatter copies its
input into a buffer of its own, which the tracker sees when the work is waited on (NCCL has none); the shapes
below (a 4096-token vocabulary, 2 x 128 tokens) put the peak in the loss, far above that moment, as in any real
LLM configuration.
Another is measured away: gloo's worker thread can release a collective's buffer after the wait on it returned,
late on a busy machine, which only ever raises a real run's peak; each real configuration is tracked twice and
the lower peak kept (real_worker.py), so a real peak that is higher in one run of two for another reason is not seen
here (docs/estimate.md says so).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, cli_env

pytestmark = pytest.mark.slow

BASE = ["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "128",
        "--train_batch_size", "2", "--model_impl", "hf"]
CASES = {
    "bf16": [],
    "fp8": ["--fp8", "1"],
    "fp8-all-gather": ["--fp8", "1", "--fp8_all_gather", "1"],
    "ac-full": ["--activation_checkpointing", "full"],
    "ac-selective": ["--activation_checkpointing", "selective"],
    "tp2": ["--tp_size", "2"],
    "fp8-tp2": ["--fp8", "1", "--tp_size", "2"],
    "grad-accum-2": ["--grad_accum_steps", "2"],
}


RANKS = 2
TRAINED = "fp8-all-gather"  # the case also run as `llama_fp8 train` itself (FP8's prepare and post-step included)


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory) -> list[dict]:
    """Every case in one 2-process gloo job (one start-up for all), then `train` of one case in the same job: each
    rank's records, rank 0's first."""
    folder = tmp_path_factory.mktemp("real")
    configs = [BASE + extra for extra in CASES.values()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
           str(Path(__file__).with_name("real_worker.py")), str(folder), json.dumps(configs),
           json.dumps(BASE + CASES[TRAINED]), str(folder / "run")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=cli_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(RANKS)]


@pytest.fixture(scope="module")
def real(real_runs) -> dict[str, list[dict]]:
    """Case -> each rank's record of its real run."""
    return {case: [ranks["measured"][i] for ranks in real_runs] for i, case in enumerate(CASES)}


def fake_record(args: list[str]) -> dict:
    """The estimate's record: rank 0 of 2 on the fake process group, as `estimate` measures any job."""
    from real_worker import record

    from llama_fp8 import config
    from llama_fp8.estimate import build, fake, run

    with fake.process_group(RANKS):
        return record(run.measure(config.parse_args(args), build.env_for(RANKS, RANKS)))


@pytest.mark.parametrize("case", CASES)
def test_estimate_equals_the_real_run_to_the_byte(real, case):
    assert_equal_on_every_rank(fake_record(BASE + CASES[case]), real[case])


def assert_equal_on_every_rank(estimate: dict, ranks: list[dict]) -> None:
    """The estimate (rank 0's) against each real rank's record: the estimate stands for every rank of the job
    (FSDP2 pads every shard to the same size), so a rank that holds or sends more than rank 0 fails here."""
    assert len(ranks) == RANKS
    for rank, real_run in enumerate(ranks):
        try:
            assert_equal(estimate, real_run)
        except AssertionError as e:
            raise AssertionError(f"rank {rank}: {e}") from e


def assert_equal(estimate: dict, real_run: dict) -> None:
    estimate, real_run = dict(estimate), dict(real_run)
    # As the optimizer step starts, gloo may still hold the gradient norm's all-reduce buffer (84 bytes here) or may
    # have released it: it completes on its own thread, and the real run itself varies from run to run there.
    # The sharded state at that moment must match exactly; the activations of that moment are not compared.
    at_opt, real_at_opt = estimate.pop("at_optimizer"), real_run.pop("at_optimizer")
    for kind in ("Sharded Param", "Sharded Grad", "OptState", "Unsharded Param", "Unsharded Grad", "Buffer"):
        assert at_opt[kind] == real_at_opt[kind], kind
    for key, value in real_run.items():
        assert estimate[key] == value, key
    assert estimate["peak_bytes"] > 0 and estimate["collectives"]


def test_estimate_equals_a_tracked_step_of_train_itself(real_runs):
    """The estimate's own set-up (random-token batches made in the step, its optimizer and state, fused AdamW)
    against `llama_fp8 train --max_steps 2` with its second step under the same tracker: the plan, the build,
    the synthetic data loader, the CPU's (unfused) AdamW and the loop are training's own."""
    assert_equal_on_every_rank(fake_record(BASE + CASES[TRAINED]), [ranks["trained"] for ranks in real_runs])


def test_the_cases_differ_where_they_should(real):
    """The comparison is not vacuous: each option changes what the real run allocates or sends."""
    real = {case: ranks[0] for case, ranks in real.items()}
    bf16 = real["bf16"]
    assert real["ac-full"]["by_kind"]["Activation"] < real["ac-selective"]["by_kind"]["Activation"] \
        < bf16["by_kind"]["Activation"]
    assert real["tp2"]["peak_bytes"] < bf16["peak_bytes"]
    gathered = {c["phase"]: c["bytes"] for c in real["fp8-all-gather"]["collectives"] if c["kind"] == "all_gather"}
    plain = {c["phase"]: c["bytes"] for c in real["fp8"]["collectives"] if c["kind"] == "all_gather"}
    assert gathered["forward"] < plain["forward"]  # the FP8 layers' weights travel in one byte instead of two
    assert real["grad-accum-2"]["peak_bytes"] > bf16["peak_bytes"]  # unsharded gradients kept between micro-batches
