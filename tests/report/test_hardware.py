"""The A/B report's hardware and software block: each arm's node list, GPU and driver, image, library versions
and NCCL network, side by side, and "not the same hardware" when the arms ran on different nodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_compare import make_run, run_compare

from llama_fp8.report import hardware
from llama_fp8.telemetry import environment

H100 = {"nodes": "p5-[1-2]", "num_nodes": 2, "host": "p5-1", "cpu": "AMD EPYC 7R13", "gpu": "NVIDIA H100 80GB HBM3",
        "gpu_count": 8, "driver": "570.86.15", "torch": "2.10.0a0+b4e4ee81d3", "cuda": "13.1", "nccl": "2.28.9",
        "transformer_engine": "2.10.0", "torchao": "0.13.0", "python": "3.12.3",
        "nccl_net_requested": "AWS Libfabric", "nccl_net_plugin": "/opt/llama-fp8/nccl/libnccl-net-ofi.so",
        "image": "/fsx/llama-fp8.sqsh", "image_digest": "ab" * 32, "image_size": 21474836480,
        "image_mtime": "2026-11-01T10:00:00Z", "image_build": {"ngc_tag": "25.12-py3", "efa_installer": "1.49.0"},
        "nccl_network": "AWS Libfabric", "nccl_provider": "efa", "preflight_busbw_gbps": 362.4,
        "preflight_status": "OK"}


def with_environment(run_dir: Path, *envs: dict) -> None:
    """Give the run's meta record an environment; more envs = more attempts (a requeued run)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    meta = json.loads(lines[0])
    assert meta["type"] == "meta"
    metas = [json.dumps({**meta, "environment": env}) for env in envs]
    (run_dir / "metrics.jsonl").write_text("\n".join(metas[:1] + lines[1:21] + metas[1:] + lines[21:]) + "\n")


def test_same_allocation_runs_are_the_same_hardware(tmp_path, capsys):
    make_run(tmp_path / "bf16", "bf16", peak=989.4, seed=1)
    make_run(tmp_path / "fp8", "fp8-te-current", peak=989.4, seed=2)
    with_environment(tmp_path / "bf16", H100)
    with_environment(tmp_path / "fp8", H100)
    rc, summary, report = run_compare(str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--out", str(tmp_path / "o"))
    assert rc == 0
    env = summary["environment"]
    assert env["same_hardware"] is True and env["same_software"] is True and env["a"]["nodes"] == "p5-[1-2]"
    assert "## Hardware and software" in report and "Hardware: same hardware" in report
    assert "not the same hardware" not in report
    row = next(ln for ln in report.splitlines() if ln.startswith("| NCCL network |"))
    assert row.count("AWS Libfabric / efa, preflight busbw 362.4 GB/s (NCCL_NET=AWS Libfabric)") == 2
    image = next(ln for ln in report.splitlines() if ln.startswith("| image |"))
    assert "`/fsx/llama-fp8.sqsh`, sha256 abababababababab..., 20.00 GiB" in image and "NGC 25.12-py3" in image
    assert ("hardware: same (p5-[1-2], 8 x NVIDIA H100 80GB HBM3 per node (H100 SXM: 989.4 dense BF16 TFLOPS))"
            in capsys.readouterr().out)
    assert "| NVLink domain |" not in report  # nodes without multi-node NVLink: no such row


def test_different_nodes_and_driver_say_not_the_same_hardware(tmp_path, capsys):
    make_run(tmp_path / "bf16", "bf16", peak=989.4, seed=1)
    make_run(tmp_path / "fp8", "fp8-te-current", peak=989.4, seed=2)
    with_environment(tmp_path / "bf16", H100)
    with_environment(tmp_path / "fp8", {**H100, "nodes": "p5-[7-8]", "driver": "550.90.07", "nccl": "2.27.3"})
    rc, summary, report = run_compare(str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--out", str(tmp_path / "o"))
    env = summary["environment"]
    assert rc == 0 and env["same_hardware"] is False and env["same_software"] is False
    assert env["hardware_differences"] == ["nodes: p5-[1-2] vs p5-[7-8]", "driver: 570.86.15 vs 550.90.07"]
    assert env["software_differences"] == ["nccl: 2.28.9 vs 2.27.3"]
    assert "**not the same hardware**: nodes: p5-[1-2] vs p5-[7-8]; driver: 570.86.15 vs 550.90.07" in report
    assert "**not the same software**: nccl: 2.28.9 vs 2.27.3" in report
    assert "hardware: NOT THE SAME: nodes: p5-[1-2] vs p5-[7-8]" in capsys.readouterr().out


def test_a_requeued_run_shows_every_attempts_nodes(tmp_path):
    make_run(tmp_path / "bf16", "bf16", seed=1)
    make_run(tmp_path / "fp8", "fp8-te-current", seed=2)
    with_environment(tmp_path / "bf16", H100)
    with_environment(tmp_path / "fp8", H100, {**H100, "nodes": "p5-[3-4]"})
    _, summary, report = run_compare(str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--out", str(tmp_path / "o"))
    assert summary["environment"]["b"]["nodes"] == "p5-[1-2] then p5-[3-4]"
    assert summary["environment"]["same_hardware"] is False


def test_runs_without_an_environment_say_not_recorded(tmp_path, capsys):
    make_run(tmp_path / "a", "bf16")
    make_run(tmp_path / "b", "fp8")
    _, summary, report = run_compare(str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "o"))
    assert summary["environment"]["same_hardware"] is None
    assert "Hardware: not recorded for both runs" in report
    assert "hardware: not recorded" in capsys.readouterr().out


# ---- the description itself (telemetry/environment.py) ---------------------------------------------------

def test_describe_on_this_host(tmp_path):
    import torch

    pre = tmp_path / "pf.json"
    pre.write_text(json.dumps({"network": {"network": "gloo (TCP)", "busbw_gbps": 1.5, "status": "OK"}}))
    env = {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "LLAMA_FP8_IMAGE": "/fsx/x.sqsh",
           "LLAMA_FP8_IMAGE_SIZE": "1024", "LLAMA_FP8_IMAGE_MTIME": "2026-11-01T10:00:00Z",
           "LLAMA_FP8_IMAGE_SHA256": "cd" * 32, "LLAMA_FP8_PREFLIGHT": str(pre), "NCCL_NET": "AWS Libfabric"}
    d = environment.describe("cpu", env)
    assert d["nodes"] == "n[1-2]" and d["num_nodes"] == 2 and d["torch"] == torch.__version__
    assert d["gpu"] is None and d["gpu_count"] == 0 and d["cuda"] == torch.version.cuda
    assert (d["image"], d["image_size"], d["image_digest"]) == ("/fsx/x.sqsh", 1024, "cd" * 32)
    assert (d["nccl_network"], d["preflight_busbw_gbps"], d["nccl_net_requested"]) == ("gloo (TCP)", 1.5,
                                                                                         "AWS Libfabric")
    assert d["torchao"] is not None and json.dumps(d)  # JSON-serialisable: it goes to metrics.jsonl


def test_driver_version_from_proc_file(tmp_path):
    f = tmp_path / "version"
    f.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build  "
                 "(dvs-builder@U16-I3-C03-1)  Thu Jan 23 21:06:41 UTC 2025\nGCC version:  gcc version 12.3.0\n")
    assert environment.driver_version(str(f)) == "570.86.15"


def test_describe_never_raises_on_a_broken_preflight_file(tmp_path):
    (tmp_path / "pf.json").write_text("{not json")
    d = environment.describe("cpu", {"LLAMA_FP8_PREFLIGHT": str(tmp_path / "pf.json")})
    assert d["nccl_network"] is None


GB200 = {**H100, "nodes": "gb-[1-18]", "gpu": "NVIDIA GB200", "gpu_count": 4, "cpu": "ARM Neoverse-V2 (aarch64)",
         "nvlink_domains": 1, "nvlink_used": True}


def test_gb200_runs_show_their_nvlink_domain_and_compare_it(tmp_path, capsys):
    make_run(tmp_path / "bf16", "bf16", peak=2500.0, seed=1)
    make_run(tmp_path / "fp8", "fp8-te-current", peak=2500.0, seed=2)
    with_environment(tmp_path / "bf16", GB200)
    with_environment(tmp_path / "fp8", {**GB200, "nvlink_domains": 2, "nvlink_used": False})
    _, summary, report = run_compare(str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--out", str(tmp_path / "o"))
    env = summary["environment"]
    assert env["hardware_differences"] == ["nvlink_domains: 1 vs 2"]
    assert env["software_differences"] == ["nvlink_used: True vs False"]
    row = next(ln for ln in report.splitlines() if ln.startswith("| NVLink domain |"))
    assert row == ("| NVLink domain | 1 multi-node NVLink domain, NCCL used it between nodes | 2 multi-node NVLink "
                   "domains, NCCL did NOT use it between nodes |")
    assert "| GPU | 4 x NVIDIA GB200 per node (GB200: 2500 dense BF16 TFLOPS) |" in report
    assert "| CPU | ARM Neoverse-V2 (aarch64) |" in report
    # a run from before the NVLink line (no value) is not "not the same" for that alone
    old = {k: v for k, v in GB200.items() if k not in ("nvlink_domains", "nvlink_used")}
    assert hardware.compare_environments([GB200], [old])["same_hardware"] is True


def test_the_cpu_of_an_arm_node_is_named(tmp_path):
    """aarch64's /proc/cpuinfo has no "model name": the implementer and part say which core (Grace: Neoverse-V2)."""
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd sve2\nCPU implementer\t: 0x41\n"
                 "CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd4f\nCPU revision\t: 0\n")
    assert environment.cpu_model(str(f)) == "ARM Neoverse-V2 (aarch64)"
    f.write_text(f.read_text().replace("0xd4f", "0xd99"))
    assert environment.cpu_model(str(f)) == "ARM part 0xd99 (aarch64)"


def test_the_preflight_reports_nvlink_domains_go_to_the_description(tmp_path):
    pre = tmp_path / "pf.json"
    pre.write_text(json.dumps({"network": {"network": "Libfabric", "status": "OK", "nvlink": {
        "status": "OK", "message": "m", "domains": {"u/4026": ["gb-1", "gb-2"]}, "used": True}}}))
    d = environment.describe("cpu", {"LLAMA_FP8_PREFLIGHT": str(pre)})
    assert (d["nvlink_domains"], d["nvlink_used"]) == (1, True)


@pytest.mark.parametrize("key", [k for k in environment.HARDWARE_KEYS if k not in environment.IF_BOTH])
def test_every_hardware_key_is_compared(key):
    other = {**H100, key: "something else"}
    env = hardware.compare_environments([H100], [other])
    assert env["same_hardware"] is False and env["hardware_differences"][0].startswith(key + ":")


def test_the_same_nodes_in_another_rendezvous_order_are_the_same_hardware():
    """`llama-fp8 launch` records an attempt's nodes in node-rank order, the order they joined the rendezvous: the
    two arms of one allocation came out as n2,n1 and n1,n2, and the report said "NOT THE SAME" (the local cluster's
    same-allocation A/B failed so). The same machines are the same hardware; another machine is not."""
    a = [{"nodes": "n2,n1", "gpu": None}]
    assert hardware.compare_environments(a, [{"nodes": "n1,n2", "gpu": None}])["same_hardware"] is True
    other = hardware.compare_environments(a, [{"nodes": "n1,n3", "gpu": None}])
    assert other["same_hardware"] is False and other["b"]["nodes"] == "n1,n3"
    runs = [("pair1/bf16", a, []), ("pair1/fp8", [{"nodes": "n1,n2"}], []), ("pair2/bf16", [{"nodes": "n3,n1"}], [])]
    assert hardware.other_hardware(runs) == ["pair2/bf16: nodes n1,n3"]
    assert hardware.node_set("p5-[1-4]") == "p5-[1-4]"

