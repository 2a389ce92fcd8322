"""The terms the tracker cannot see and the verdict (estimate/terms.py): sized as their sources say, and the
three verdicts at their boundaries."""

from __future__ import annotations

import pytest

from llama_fp8 import config
from llama_fp8.estimate import build, fake, gpus, run, terms

GIB = 2**30


@pytest.mark.slow
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
    found = terms.gpu_terms(collectives, groups, 0, compiled=True, gpu=gpus.GPUS["A100-80GB"], gpus_per_node=8)
    nccl = next(t for t in found if t.name.startswith("NCCL"))
    assert nccl.bytes == 3 * 640 * 2**20 and "(dp_shard, tp, world)" in nccl.name
    one_dim = {"world": list(range(8)), "dp_shard": list(range(8))}
    assert terms.communicators([{"dim": "dp_shard"}], one_dim) == ["dp_shard"]
    assert terms.communicators([], {"world": [0]}) == []  # one GPU: no communicator
    compiled = next(t for t in found if t.name == "torch.compile")
    assert not compiled.added and compiled.bytes == 0
    assert not any(t.calibrated for t in found)  # nothing has been measured on a GPU yet


def test_nvls_buffers_on_nvswitch_gpus_for_groups_with_two_gpus_of_the_node():
    """H100 and H200 nodes (NVSwitch with NVLink SHARP): NCCL adds 288 MiB of NVLS buffers per rank to a communicator
    whose group has 2+ GPUs of the node (vllm-project/vllm#9699, 8 x H200); A100 nodes have none."""
    groups = {"world": list(range(16)), "dp_shard": list(range(16)), "dp_replicate": [0, 8], "tp": [0, 1]}
    comms = ["dp_replicate", "dp_shard", "tp"]
    mib = 2**20
    assert terms.nccl_bytes(comms, groups, gpus.GPUS["H100"], 8) == 640 * mib + 2 * (640 + 288) * mib
    assert terms.nccl_bytes(comms, groups, gpus.GPUS["H200"], 8) == 640 * mib + 2 * (640 + 288) * mib
    assert terms.nccl_bytes(comms, groups, gpus.GPUS["A100-80GB"], 8) == 3 * 640 * mib
    assert terms.nccl_bytes(comms, groups, gpus.GPUS["H100"], 1) == 3 * 640 * mib  # one GPU per node: no NVLS
    assert terms.nccl_bytes(comms, groups, gpus.get("H100", memory_gib=90), 8) == 640 * mib + 2 * (640 + 288) * mib


def test_the_gpus_memory_is_what_pytorch_sees_not_nvidia_smis_total():
    """nvidia-smi's memory.total includes what the driver keeps: 81,559 MiB on an H100 80GB HBM3, of which PyTorch
    can allocate 79.11 GiB (pytorch/torchtitan#1789); each row states both and its source."""
    mib = 2**20
    smi = {"H100": 81559, "H200": 143771, "A100-80GB": 81920, "A100-40GB": 40960, "B200": 183359, "B300": 275040,
           "GB200": 189471, "GB300": 284208}
    seen = {"H100": 79.11, "H200": 139.80, "A100-80GB": 79.15, "A100-40GB": 39.50, "B200": 178.35, "B300": 267.69,
            "GB200": 184.31, "GB300": 276.50}
    for name, gpu in gpus.GPUS.items():
        assert round(gpu.memory_bytes / GIB, 2) == seen[name], name
        assert gpu.memory_bytes < smi[name] * mib, name
        assert f"{smi[name]:,} MiB" in gpu.source and f"{seen[name]:.2f} GiB" in gpu.source, name
    assert gpus.GPUS["H100"].nvls and gpus.GPUS["H200"].nvls and not gpus.GPUS["A100-80GB"].nvls


@pytest.mark.slow
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
    gpu = gpus.get("H100", memory_gib=11)
    found = [terms.Term("a", GIB, "s"), terms.Term("b", 5 * GIB, "s", added=False)]
    tracked = 8 * GIB  # needed 9 GiB (the stated-only term is not added), margin 20 % = 1.6 GiB
    assert terms.verdict(tracked, found, gpu).status == "fits"
    assert terms.verdict(tracked, found, gpus.get("H100", memory_gib=10.5)).status == "tight"
    v = terms.verdict(tracked, found, gpus.get("H100", memory_gib=8.9))
    assert v.status == "does not fit" and v.needed == 9 * GIB and v.margin == int(0.20 * tracked)


def test_the_nccl_terms_lie_within_what_is_published_for_one_communicator():
    """The 640 MiB per communicator and the 288 MiB of NVLS buffers against their sources (tests/estimate/
    published.py): a term moved outside them fails here, on the CPU, before any GPU measures it."""
    from published import NCCL_COMMUNICATOR_LEAST, NCCL_COMMUNICATOR_MOST, NCCL_NVLS_MOST

    assert NCCL_COMMUNICATOR_LEAST <= terms.NCCL_PER_COMMUNICATOR <= NCCL_COMMUNICATOR_MOST
    assert terms.NCCL_NVLS_PER_COMMUNICATOR == NCCL_NVLS_MOST  # vllm-project/vllm#9699: nvlsPerRankSize 301989888
