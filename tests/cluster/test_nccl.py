"""Which network NCCL uses, from its own INFO lines (captured real logs in nccl_logs/, sources in each file),
the decision on an EFA node, the preflight's all-reduce summary and bandwidth, and the message a user sees."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from llama_fp8.cluster.nodes import nccl, netcheck, preflight

LOGS = Path(__file__).parent / "nccl_logs"


def log(name: str) -> str:
    return "\n".join(line for line in (LOGS / name).read_text().splitlines() if not line.startswith("#"))


@pytest.mark.parametrize(("name", "network", "kind", "provider", "extra"), [
    ("efa_libfabric.log", "Libfabric", "ofi", "efa", {"nics": 16}),
    ("aws_libfabric_old_name.log", "AWS Libfabric", "ofi", None, {}),
    ("efa_plugin_failed_socket.log", "Socket", "socket", None,
     {"nccl_version": "2.21.5+cuda12.8", "socket_interfaces": "[0]eth0:10.36.29.253<0>"}),
    ("socket_no_plugin.log", "Socket", "socket", None, {}),
    ("ib.log", "IB", "ib", None, {"nccl_version": "2.19.3+cuda12.3", "ib_devices": "[0]mlx5_0:1/IB"}),
    ("roce.log", "IB", "ib", None, {"ib_devices": "[0]mlx5_10:1/RoCE [1]mlx5_11:1/RoCE"}),
    ("ibext_sharp.log", "IBext_v6", "ib", None, {}),
    ("ngc_ibverbs_mismatch.log", None, "unknown", None, {}),
    ("efa_ofi_init.log", None, "unknown", None, {"plugin_version": "1.9.1-aws"}),
])
def test_parse_real_logs(name, network, kind, provider, extra):
    net = nccl.parse(log(name))
    assert (net.network, net.kind, net.provider) == (network, kind, provider)
    for key, value in extra.items():
        assert getattr(net, key) == value, key


def test_plugin_failures_are_collected_and_unrelated_plugins_are_not():
    """The reason behind a sockets fallback, as NCCL printed it; the profiler plugin's 'Could not find' is not a
    net plugin failure."""
    assert nccl.parse(log("efa_libfabric.log")).plugin_errors == []
    assert nccl.parse(log("socket_no_plugin.log")).plugin_errors[0].startswith(
        "NET/Plugin : Plugin load (libnccl-net.so) returned 2")
    ngc = nccl.parse(log("ngc_ibverbs_mismatch.log")).plugin_errors
    assert "IBVERBS_PRIVATE_34" in ngc[0] and ngc[1] == "NET/Plugin: Could not find: ofi"
    failed = nccl.parse(log("efa_plugin_failed_socket.log"))
    assert failed.plugin_errors[0] == "NET/OFI aws-ofi-nccl initialization failed"


def test_new_provider_line_format():
    """aws-ofi-nccl >= 1.14 (src/nccl_ofi_net.cpp): "Selected provider is %s, fabric is %s (found %d nics)"."""
    text = ("p5-1:10:20 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.17.1\n"
            "p5-1:10:20 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct (found 32 nics)\n"
            "p5-1:10:20 [0] NCCL INFO Successfully loaded external network plugin /opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so\n"
            "p5-1:10:20 [0] NCCL INFO Using network Libfabric\n")
    net = nccl.parse(text)
    assert (net.provider, net.fabric, net.nics, net.plugin_version) == ("efa", "efa-direct", 32, "1.17.1")
    assert net.plugin_path == "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so"
    assert net.describe() == "Libfabric / efa (aws-ofi-nccl 1.17.1, 32 NICs)"


@pytest.mark.parametrize(("name", "efa", "nodes", "status", "words"), [
    ("efa_libfabric.log", 16, 2, "OK", "Libfabric / efa"),
    ("aws_libfabric_old_name.log", 4, 2, "OK", "AWS Libfabric"),
    ("efa_plugin_failed_socket.log", 32, 2, "FAIL", "32 EFA device(s) but NCCL uses Socket"),
    ("ngc_ibverbs_mismatch.log", 32, 2, "WARN", "IBVERBS_PRIVATE_34"),
    ("ib.log", 8, 2, "FAIL", "instead of the aws-ofi-nccl plugin"),
    ("socket_no_plugin.log", 0, 2, "WARN", "TCP"),
    ("socket_no_plugin.log", 0, 1, "OK", "Socket"),
    ("ib.log", 0, 4, "OK", "IB"),
    ("ibext_sharp.log", 0, 4, "OK", "IBext_v6"),
])
def test_decide(name, efa, nodes, status, words):
    d = nccl.decide(nccl.parse(log(name)), efa_devices=efa, nodes=nodes)
    assert d.status == status and words in d.message, d


def test_the_sockets_message_says_why_and_what_to_do(monkeypatch):
    monkeypatch.setenv("NCCL_NET_PLUGIN", "/opt/llama-fp8/nccl/libnccl-net-ofi.so")
    d = nccl.decide(nccl.parse(log("efa_plugin_failed_socket.log")), efa_devices=32, nodes=2)
    assert d.status == "FAIL"
    assert "the aws-ofi-nccl plugin did not load" in d.message
    assert "NCCL_NET_PLUGIN=/opt/llama-fp8/nccl/libnccl-net-ofi.so" in d.message
    assert "NCCL said: NET/OFI aws-ofi-nccl initialization failed" in d.message
    assert "Creating new endpoint" in d.message  # the first NET/OFI warning: the actual cause
    assert "NCCL_NET='AWS Libfabric'" in d.message


def test_a_non_efa_provider_on_an_efa_node_fails():
    net = nccl.parse("x:1:1 [0] NCCL INFO NET/OFI Selected provider is tcp, fabric is tcp (found 1 nics)\n"
                     "x:1:1 [0] NCCL INFO Using network Libfabric\n")
    d = nccl.decide(net, efa_devices=4, nodes=2)
    assert d.status == "FAIL" and "FI_PROVIDER=efa" in d.message


def test_ofi_net_name_matches_every_plugin_version():
    """NCCL_NET must name the plugin whatever its version: "AWS Libfabric" is both the old name and the one
    the new plugin takes when asked (nvidia_plugin_name_fixup); NCCL compares case-insensitively."""
    assert nccl.OFI_NET_NAME.lower() in nccl.OFI_NETWORKS
    assert nccl.parse(log("aws_libfabric_old_name.log")).network.lower() == nccl.OFI_NET_NAME.lower()


# ---- the preflight all-reduce: bandwidth, agreement across ranks -----------------------------------------

def test_bus_bandwidth_is_nccl_tests_formula():
    """nccl-tests doc/PERFORMANCE.md: busbw = algbw * 2(n-1)/n for all-reduce; GB = 1e9 bytes."""
    algbw, busbw = netcheck.bus_bandwidth(nbytes=2 * 10**9, seconds=1.0, ranks=8)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(2.0 * 2 * 7 / 8)
    assert netcheck.bus_bandwidth(10**9, 1.0, 1) == (1.0, 1.0)


def rank(host, name, efa=32, wrong=0, failed=()):
    return {"host": host, "efa": efa, "wrong": wrong, "failed": list(failed), "log": log(name)}


def test_summary_all_ranks_on_efa():
    res = netcheck.summarize([rank("a", "efa_libfabric.log"), rank("b", "efa_libfabric.log")], "nccl",
                             256 * 2**20, 10, 0.01, 3.0)
    assert res.status == "OK" and res.nodes == 2 and res.network == "Libfabric" and res.provider == "efa"
    assert res.busbw_gbps == pytest.approx(256 * 2**20 / 0.01 / 1e9)  # 2 ranks: factor 1


def test_summary_one_node_on_sockets_fails_the_job():
    """One node whose plugin did not load fails the whole test, even though the others use EFA."""
    res = netcheck.summarize([rank("a", "efa_libfabric.log"), rank("b", "efa_plugin_failed_socket.log")],
                             "nccl", 2**20, 10, 0.01, 3.0)
    assert res.status == "FAIL" and "ranks use different networks" in res.message


def test_summary_wrong_values_and_failed_nodes():
    res = netcheck.summarize([rank("a", "ib.log", efa=0, wrong=5), rank("b", "ib.log", efa=0, failed=["gpu"])],
                             "nccl", 2**20, 10, 0.01, 3.0)
    assert res.status == "FAIL" and not res.values_ok and "wrong values on rank(s) [0]" in res.message
    assert res.failed_nodes == {"b": ["gpu"]}
    lines = netcheck.result_lines(res)
    assert [(n, s) for n, s, _ in lines] == [("all_reduce", "FAIL")]


def test_preflight_fails_with_the_message_when_efa_but_sockets(monkeypatch, capsys, tmp_path):
    """What a user sees: the network line with the reason, the job-step verdict, exit 1 on every task, and the
    JSON report (read by each run's meta record)."""
    res = netcheck.summarize([rank("p5-1", "efa_plugin_failed_socket.log"),
                              rank("p5-2", "efa_plugin_failed_socket.log")], "nccl", 256 * 2**20, 10, 0.05, 3.0)
    monkeypatch.setattr(netcheck, "run", lambda *a, **k: res)
    monkeypatch.setattr(preflight, "run_checks", lambda s: [preflight.Check("gpu", "OK", "8 x H100")])
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    report = tmp_path / "pf.json"
    rc = preflight.main(["--device", "cpu", "--report", str(report)])
    out = capsys.readouterr().out
    assert rc == 1
    line = next(ln for ln in out.splitlines() if "] network:" in ln)
    assert line.startswith("[FAIL] network: 32 EFA device(s) but NCCL uses Socket")
    assert "preflight of job step: 2 node(s), 2 task(s): failed" in out
    assert "[  OK] all_reduce: 256 MiB x 10 over 2 ranks on 2 node(s): busbw 5.37 GB/s" in out
    import json

    assert json.loads(report.read_text())["network"]["network"] == "Socket"


def test_network_test_runs_only_with_several_tasks_unless_asked(monkeypatch, capsys):
    called = []
    monkeypatch.setattr(netcheck, "run", lambda *a, **k: called.append(a) or netcheck.NetResult("OK", "ok"))
    monkeypatch.setattr(preflight, "run_checks", lambda s: [])
    for var in ("RANK", "WORLD_SIZE", "SLURM_STEP_ID", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    assert preflight.main(["--device", "cpu"]) == 0 and called == []
    assert preflight.main(["--device", "cpu", "--network_test", "1", "--allreduce_mb", "2", "--allreduce_iters",
                           "3", "--timeout", "7"]) == 0
    assert called[-1][:4] == ("cpu", 2.0, 3, 7.0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert preflight.main(["--device", "cpu", "--network_test", "0"]) == 0 and len(called) == 1
    assert preflight.main(["--device", "cpu"]) == 0 and len(called) == 2  # auto: several tasks


@pytest.mark.parametrize("argv", [["--allreduce_mb", "0"], ["--allreduce_iters", "-1"], ["--timeout", "x"],
                                  ["--network_test", "yes"]])
def test_network_flags_are_validated(argv):
    assert preflight.main(argv) == 2


def test_real_gloo_all_reduce_single_process(capsys):
    """The measuring code itself (one rank, gloo): values checked, bandwidth reported; the multi-node run is in
    test_real_cluster.py."""
    res = netcheck.run("cpu", 1.0, 3, 60.0, 0)
    assert res.status == "OK" and res.values_ok and res.backend == "gloo" and res.ranks == 1
    assert res.busbw_gbps > 0 and res.network == "gloo (TCP)"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_network_test_leaves_no_folder_behind(device, monkeypatch, tmp_path):
    """Each task's NCCL log folder goes when the test is over: a node that runs a preflight before every job
    must not gather a folder per task and job in its temporary folder. On a machine without a GPU the cuda test
    fails to form its group, which is a way out too."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_DEBUG_FILE"):
        monkeypatch.delenv(name, raising=False)
    import torch

    res = netcheck.run(device, 0.01, 1, 60.0, 0)
    assert res.status == ("OK" if device == "cpu" or torch.cuda.is_available() else "FAIL"), res
    assert list(tmp_path.iterdir()) == []


def test_slurm_tasks_bound_to_one_gpu_each_use_cuda0():
    """srun with a GPU per task: every task sees one GPU, so its device index is 0, not its SLURM_LOCALID."""
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
           "SLURM_NTASKS_PER_NODE": "8"}
    assert netcheck.slurm_task_env(env, gpus=1) == {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "0",
                                                    "LOCAL_WORLD_SIZE": "8"}
    assert netcheck.slurm_task_env(env, gpus=8)["LOCAL_RANK"] == "3"
    assert netcheck.slurm_task_env({**env, "RANK": "1"}, gpus=8) == {}  # torchrun already decided
    assert netcheck.slurm_task_env({"SLURM_PROCID": "0"}, gpus=8) == {}  # not inside a step
