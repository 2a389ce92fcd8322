"""The terms the tracker cannot see and the verdict (estimate/terms.py): sized as their sources say, and the
three verdicts at their boundaries."""

from __future__ import annotations

import pytest

from llama_fp8 import config
from llama_fp8.estimate import build, fake, gpus, run, terms

GIB = 2**30


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_operand_copies_are_the_largest_fp8_linears_operands_on_one_tp_rank(tp):
    args = ["--model", "tiny", "--num_layers", "2", "--max_context_width", "128", "--train_batch_size", "2",
            "--model_impl", "hf", "--fp8", "1", "--tp_size", str(tp)]
    with fake.process_group(8):
        m = run.measure(config.parse_args(args), build.env_for(8, 8))
    # tiny: hidden 128, intermediate 352; gate/up (colwise: 352/tp outputs) and down (rowwise: 352/tp inputs)
    assert m.fp8_operand_bytes == 2 * 128 * (128 + 352 // tp)
    with fake.process_group(8):
        plain = run.measure(config.parse_args(args[:-4]), build.env_for(8, 8))
    assert plain.fp8_operand_bytes == 0


def test_nccl_buffers_count_the_groups_with_more_than_one_rank_and_the_world():
    """A communicator per mesh dimension with collectives, and the world's: training creates it eagerly
    (init_process_group with device_id), and a mesh of 2+ dimensions splits its groups from it as communicators
    of their own; a 1-D mesh over the world uses the world's (torch's DeviceMesh reuses the default group)."""
    collectives = [{"dim": "dp_shard"}, {"dim": "tp"}, {"dim": "dp_replicate"}, {"dim": "dp_shard"}]
    groups = {"world": list(range(8)), "dp_shard": [0, 1, 2, 3], "tp": [0, 1], "dp_replicate": [0]}
    assert terms.communicators(collectives, groups) == ["dp_shard", "tp", "world"]
    found = terms.gpu_terms(collectives, groups, 0, compiled=True)
    nccl = next(t for t in found if t.name.startswith("NCCL"))
    assert nccl.bytes == 3 * terms.NCCL_PER_COMMUNICATOR and "(dp_shard, tp, world)" in nccl.name
    one_dim = {"world": list(range(8)), "dp_shard": list(range(8))}
    assert terms.communicators([{"dim": "dp_shard"}], one_dim) == ["dp_shard"]
    assert terms.communicators([], {"world": [0]}) == []  # one GPU: no communicator
    compiled = next(t for t in found if t.name == "torch.compile")
    assert not compiled.added and compiled.bytes == 0
    assert not any(t.calibrated for t in found)  # nothing has been measured on a GPU yet


def test_the_world_communicator_of_a_measured_two_dimensional_mesh_is_counted():
    args = ["--model", "tiny", "--num_layers", "2", "--max_context_width", "64", "--train_batch_size", "1",
            "--model_impl", "hf"]
    with fake.process_group(8):
        flat = run.measure(config.parse_args(args), build.env_for(8, 8))
        two_dim = run.measure(config.parse_args(args + ["--tp_size", "2"]), build.env_for(8, 8))
    assert terms.communicators(flat.collectives, flat.group_ranks) == ["dp_shard"]
    assert terms.communicators(two_dim.collectives, two_dim.group_ranks) == ["dp_shard", "tp", "world"]


def test_collective_times_are_bus_bytes_over_the_links_bandwidth():
    """time = bytes x NCCL's bus factor ((n-1)/n for all-gather, reduce-scatter and all-to-all, 2(n-1)/n for
    all-reduce; nccl-tests' doc/PERFORMANCE.md) / the GPU's bandwidth in GB/s (10^9 bytes), NVLink for a group
    inside a node, the network for one across nodes; a one-rank group moves nothing."""
    from llama_fp8.estimate import assess

    gpu = gpus.Gpu("X", 80 * GIB, nvlink_gbs=400.0, network_gbs=50.0, source="test")
    groups = {"dp_shard": list(range(8)), "dp_replicate": [0, 8, 16, 24], "tp": [0, 1], "solo": [0]}
    collectives = [{"kind": "all_gather", "dim": "dp_shard", "bytes": 8 * 10**9},
                   {"kind": "reduce_scatter", "dim": "dp_shard", "bytes": 16 * 10**9},
                   {"kind": "all_reduce", "dim": "dp_replicate", "bytes": 10**9},
                   {"kind": "all_to_all", "dim": "tp", "bytes": 10**9},
                   {"kind": "broadcast", "dim": "tp", "bytes": 10**9},
                   {"kind": "all_reduce", "dim": "solo", "bytes": 10**9}]
    out = assess.timed(collectives, groups, gpus_per_node=8, gpu=gpu)
    seconds = [c["seconds"] for c in out]
    assert seconds == pytest.approx([8 * 7 / 8 / 400,  # 7 GB over NVLink at 400 GB/s
                                     16 * 7 / 8 / 400,
                                     2 * 3 / 4 / 50,  # all-reduce over 4 nodes: 1.5 GB at 50 GB/s
                                     1 / 2 / 400,
                                     1 / 400,  # broadcast: factor 1
                                     0.0], rel=1e-12)
    assert [(c["ranks"], c["link"], c["gbs"]) for c in out] == [
        (8, "NVLink", 400.0), (8, "NVLink", 400.0), (4, "network", 50.0), (2, "NVLink", 400.0), (2, "NVLink", 400.0),
        (1, "NVLink", 400.0)]
    # the same dp_shard group spread over 2 nodes of 4 GPUs crosses the network
    assert assess.timed(collectives[:1], groups, gpus_per_node=4, gpu=gpu)[0]["seconds"] == pytest.approx(7 / 50)


def test_the_verdicts_boundaries():
    gpu = gpus.get("H100", memory_gib=10)
    found = [terms.Term("a", GIB, "s"), terms.Term("b", 5 * GIB, "s", added=False)]
    tracked = 8 * GIB  # needed 9 GiB (the stated-only term is not added), margin 5 % = 0.4 GiB
    assert terms.verdict(tracked, found, gpu).status == "fits"
    assert terms.verdict(tracked, found, gpus.get("H100", memory_gib=9.2)).status == "tight"
    v = terms.verdict(tracked, found, gpus.get("H100", memory_gib=8.9))
    assert v.status == "does not fit" and v.needed == 9 * GIB and v.margin == int(0.05 * tracked)
