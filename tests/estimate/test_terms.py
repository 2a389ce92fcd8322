"""The terms the tracker cannot see and the verdict (estimate/terms.py): sized as their sources say, and the
three verdicts at their boundaries."""

from __future__ import annotations

import pytest

from llama_fp8 import config
from llama_fp8.estimate import build, fake, gpus, run, terms

GIB = 2**30


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_operand_copies_are_the_largest_fp8_linears_operands_on_one_tp_rank(tp):
    args = ["--model", "tiny", "--num_layers", "2", "--max_context_width", "128", "--train_batch_size", "2", "--fp8",
            "1", "--tp_size", str(tp)]
    with fake.process_group(8):
        m = run.measure(config.parse_args(args), build.env_for(8, 8))
    # tiny: hidden 128, intermediate 352; gate/up (colwise: 352/tp outputs) and down (rowwise: 352/tp inputs)
    assert m.fp8_operand_bytes == 2 * 128 * (128 + 352 // tp)
    with fake.process_group(8):
        plain = run.measure(config.parse_args(args[:-4]), build.env_for(8, 8))
    assert plain.fp8_operand_bytes == 0


def test_nccl_buffers_count_the_groups_with_more_than_one_rank():
    collectives = [{"dim": "dp_shard"}, {"dim": "tp"}, {"dim": "dp_replicate"}, {"dim": "dp_shard"}]
    groups = {"dp_shard": [0, 1, 2, 3], "tp": [0, 1], "dp_replicate": [0]}
    assert terms.communicators(collectives, groups) == ["dp_shard", "tp"]
    found = terms.gpu_terms(collectives, groups, 0, compiled=True, tracked=0)
    nccl = next(t for t in found if t.name.startswith("NCCL"))
    assert nccl.bytes == 2 * terms.NCCL_PER_COMMUNICATOR and "(dp_shard, tp)" in nccl.name
    compiled = next(t for t in found if t.name == "torch.compile")
    assert not compiled.added and compiled.bytes == 0
    assert not any(t.calibrated for t in found)  # nothing has been measured on a GPU yet


def test_the_verdicts_boundaries():
    gpu = gpus.get("H100", memory_gib=10)
    found = [terms.Term("a", GIB, "s"), terms.Term("b", 5 * GIB, "s", added=False)]
    tracked = 8 * GIB  # needed 9 GiB (the stated-only term is not added), margin 5 % = 0.4 GiB
    assert terms.verdict(tracked, found, gpu).status == "fits"
    assert terms.verdict(tracked, found, gpus.get("H100", memory_gib=9.2)).status == "tight"
    v = terms.verdict(tracked, found, gpus.get("H100", memory_gib=8.9))
    assert v.status == "does not fit" and v.needed == 9 * GIB and v.margin == int(0.05 * tracked)
