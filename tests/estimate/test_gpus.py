"""The Blackwell rows of the estimate's GPU table (B200, B300, GB200, GB300): memory as PyTorch sees it below
nvidia-smi's total, NVLink 5, EFA per GPU of the AWS instance, 4 GPUs per GB200/GB300 node and 18 nodes per NVLink
domain; the links and NVLS buffers an NVL72 rack gives a job; a device name to its row; and Llama 3.1 70B on a full
rack of 18 GB200 nodes x 4 GPUs estimated to a verdict."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import cli_env
from llama_fp8.estimate import assess, cli, gpus, terms

MIB, GIB = gpus.MIB, gpus.GIB
# name: (nvidia-smi memory.total in MiB, the lowest total capacity PyTorch reported in GiB, EFA Gbit/s per GPU,
# GPUs per node, nodes per NVLink domain): the figures each row's source names
ROWS = {"B200": (183359, 178.35, 400, 8, 1), "B300": (275040, 267.69, 800, 8, 1),
        "GB200": (189471, 184.31, 400, 4, 18), "GB300": (284208, 276.50, 400, 4, 18)}


@pytest.mark.parametrize("name", list(ROWS))
def test_each_blackwell_row_holds_its_sourced_figures(name):
    smi, torch_gib, efa_gbit, per_node, domain = ROWS[name]
    g = gpus.GPUS[name]
    assert g.memory_bytes == int(torch_gib * 1024) * MIB < smi * MIB  # what PyTorch sees: less than nvidia-smi's
    assert f"{smi:,} MiB in nvidia-smi" in g.source and f"{torch_gib:.2f} GiB as PyTorch sees" in g.source
    assert g.nvlink_gbs == 900.0 and "1.8 TB/s both directions" in g.source  # NVLink 5, per direction
    assert g.network_gbs == efa_gbit / 8 and g.instance.split(".")[0] in g.source.lower()  # "p6-b200", "p6e-gb300"
    assert (g.gpus_per_node, g.nvlink_domain_nodes, g.nvls) == (per_node, domain, True)


def test_every_row_names_its_instance_and_the_older_rows_are_unchanged():
    assert {n: g.instance for n, g in gpus.GPUS.items()} == {
        "H100": "p5.48xlarge", "H200": "p5en.48xlarge", "A100-80GB": "p4d.24xlarge", "A100-40GB": "p4d.24xlarge",
        "B200": "p6-b200.48xlarge", "B300": "p6-b300.48xlarge", "GB200": "p6e-gb200.36xlarge",
        "GB300": "p6e-gb300.36xlarge"}
    assert (gpus.GPUS["H100"].gpus_per_node, gpus.GPUS["H100"].nvlink_domain_nodes) == (8, 1)
    other = gpus.get("GB200", memory_gib=180)  # another memory keeps the row's nodes, domain and bandwidths
    assert (other.memory_bytes, other.gpus_per_node, other.nvlink_domain_nodes) == (180 * GIB, 4, 18)
    assert other.source.startswith("--gpu_memory_gib 180; bandwidths of GB200: NVLink 5")


@pytest.mark.parametrize(("device", "row"), [
    ("NVIDIA GB200", "GB200"), ("NVIDIA B200", "B200"), ("NVIDIA B300 SXM6 AC", "B300"), ("NVIDIA GB300", "GB300"),
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("NVIDIA L40S", None), ("", None)])
def test_a_device_name_finds_its_row_and_gb200_is_not_b200(device, row):
    assert gpus.for_device(device) == row
    out = subprocess.run([sys.executable, "-m", "llama_fp8.estimate.gpus", device], capture_output=True, text=True,
                         env=cli_env(), check=True).stdout
    assert out.strip() == (row or "")


def test_an_nvl72_rack_is_one_nvlink_domain_and_two_racks_are_two():
    gb200, h100 = gpus.GPUS["GB200"], gpus.GPUS["H100"]
    assert assess.link_of(list(range(72)), 4, gb200) == ("NVLink (multi-node)", 900.0)
    assert assess.link_of([0, 1, 2, 3], 4, gb200) == ("NVLink", 900.0)
    assert assess.link_of([0, 72], 4, gb200) == ("network", 50.0)  # rank 72 is on node 18: the next rack
    assert assess.link_of([0, 8], 8, h100) == ("network", 50.0)
    # NVLS buffers for a group with several GPUs of rank 0's NVLink domain: one GPU per node still has 17 peers there
    one_per_node = {"dp": list(range(0, 72, 4))}
    assert terms.nccl_bytes(["dp"], one_per_node, gb200, 4) == terms.NCCL_PER_COMMUNICATOR + \
        terms.NCCL_NVLS_PER_COMMUNICATOR
    assert terms.nccl_bytes(["dp"], {"dp": [0, 8, 16]}, h100, 8) == terms.NCCL_PER_COMMUNICATOR


@pytest.mark.slow
def test_llama_70b_on_18_gb200_nodes_of_4_gets_a_verdict(capsys):
    """One NVL72 rack: 72 ranks, the FSDP group inside the NVLink domain, GB200's memory decides."""
    code = cli.main(["--model", "llama3.1-70b", "--model_impl", "hf", "--max_context_width", "512",
                     "--train_batch_size", "1", "--activation_checkpointing", "full", "--nodes", "18", "--gpu", "GB200",
                     "--suggest", "0", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert code == 0 and d["verdict"]["status"] == "fits" and d["verdict"]["memory"] == gpus.GPUS["GB200"].memory_bytes
    assert (d["gpus_per_node"], d["world_size"], d["mesh"]) == (4, 72, {"dp_shard": 72})
    assert {(c["link"], c["gbs"]) for c in d["collectives"]} == {("NVLink (multi-node)", 900.0)}
    nccl = next(t for t in d["terms"] if t["name"].startswith("NCCL buffers"))
    assert nccl["bytes"] == terms.NCCL_PER_COMMUNICATOR + terms.NCCL_NVLS_PER_COMMUNICATOR
    assert 60e9 < d["num_params"] < 80e9 and d["verdict"]["needed"] < d["verdict"]["memory"]
