"""The NVLink-domain preflight (GB200 / GB300 NVL72): this node's fabric as ``nvidia-smi -q`` reports it, the IMEX
channel device and daemon, the NCCL settings; then, over the job, one domain, settings that agree, and NCCL's own
"MNNVL" lines proving it used the domain. Stand-ins replace nvidia-smi, nvidia-imex-ctl, the device folder and /proc;
NCCL's lines are real (nccl_logs/gb200_*.log) or NCCL's format strings (nccl.py's docstring)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llama_fp8.cluster.nodes import fabric, nccl, netcheck, nvlink, platform_checks, preflight

LOGS = Path(__file__).parent / "nccl_logs"
UUID = "9c6f5af3-53bf-49b5-a436-b66766c413c3"  # a GB200 node's ClusterUUID and CliqueId (leptonai/gpud#1106)
OTHER = "50000000-0000-0000-0000-000000000004"
ZERO = "00000000-0000-0000-0000-000000000000"
GOOD = ("Completed", "Success", "4026", UUID)


def smi_q(product: str, fabrics: list[tuple[str, str, str, str]]) -> str:
    """``nvidia-smi -q`` with one section per GPU, laid out as nvidia-smi prints it (the Fabric block: State, Status,
    CliqueId, ClusterUUID, Health; the NVIDIA MNNVL guide's ``nvidia-smi -q | grep -A5 Fabric``)."""
    out = ["==============NVSMI LOG==============", "", f"Attached GPUs                             : {len(fabrics)}"]
    for i, (state, status, clique, cluster) in enumerate(fabrics):
        out += [f"GPU 0000000{i}:01:00.0", f"    Product Name                          : {product}",
                "    Product Architecture                  : Blackwell", "    Voltage",
                "        Graphics                          : 915.000 mV", "    Fabric",
                f"        State                             : {state}",
                f"        Status                            : {status}",
                f"        CliqueId                          : {clique}",
                f"        ClusterUUID                       : {cluster}", "        Health",
                "            Bandwidth                     : Full", "    Processes                             : None"]
    return "\n".join(out) + "\n"


def log(name: str) -> str:
    return "\n".join(line for line in (LOGS / name).read_text().splitlines() if not line.startswith("#"))


# ---- this node --------------------------------------------------------------------------------------------------

def test_fabric_blocks_parse_per_gpu_with_their_product():
    gpus = fabric.parse_fabric(smi_q("NVIDIA GB200", [GOOD] * 3 + [("In Progress", "N/A", "N/A", "N/A")]))
    assert len(gpus) == 4 and gpus[0] == fabric.GpuFabric("Completed", "Success", "4026", UUID, "NVIDIA GB200")
    assert [g.multi_node for g in gpus] == [True, True, True, False] and gpus[3].rack_scale
    assert gpus[0].domain == f"{UUID}/4026"


@pytest.mark.parametrize(("product", "block", "multi", "rack"), [
    ("NVIDIA H100 80GB HBM3", ("N/A", "N/A", "N/A", "N/A"), False, False),  # no fabric at all
    ("NVIDIA H100 80GB HBM3", ("Completed", "Success", "0", ZERO), False, False),  # an HGX node's own NVSwitch
    ("NVIDIA GB200", ("Completed", "Insufficient Resources", "0", ZERO), False, True),  # Azure/azhpc-images#506
])
def test_what_counts_as_multi_node_nvlink(product, block, multi, rack):
    (gpu,) = fabric.parse_fabric(smi_q(product, [block]))
    assert (gpu.multi_node, gpu.rack_scale) == (multi, rack)


READY = (fabric.OK, "nvidia-imex READY")
UNSET = dict.fromkeys(fabric.SETTINGS)


def test_a_registered_tray_with_imex_passes_and_reports_its_domain():
    status, line, node = fabric.assess(fabric.parse_fabric(smi_q("NVIDIA GB200", [GOOD] * 4)), ["channel0"], READY,
                                       UNSET)
    assert status == "OK" and f"4 GPU(s) in domain {UUID}/4026" in line and "channel0" in line and "READY" in line
    assert node.domains == [f"{UUID}/4026"] and node.problems == [] and node.multi_node


@pytest.mark.parametrize(("fabrics", "channels", "daemon", "values", "status", "words"), [
    ([GOOD, ("In Progress", "N/A", "N/A", "N/A")], ["channel0"], READY, {}, "FAIL",
     "GPU 1 State In Progress, Status N/A, ClusterUUID N/A: the NVLink fabric registration has not completed"),
    ([("Completed", "Insufficient Resources", "0", ZERO)], ["channel0"], READY, {}, "FAIL",
     "GPU 0 State Completed, Status Insufficient Resources"),
    ([GOOD, ("Completed", "Success", "7", OTHER)], ["channel0"], READY, {}, "FAIL", "report 2 NVLink domains"),
    ([GOOD], [], READY, {}, "FAIL", "no IMEX channel device in /dev/nvidia-caps-imex-channels"),
    ([GOOD], ["channel0"], (fabric.FAIL, "nvidia-imex-ctl -q says 'WAITING_FOR_PEERS', not READY"), {}, "FAIL",
     "WAITING_FOR_PEERS"),
    ([GOOD], ["channel0"], READY, {"NCCL_MNNVL_ENABLE": "3"}, "FAIL", "NCCL_MNNVL_ENABLE=3 is not valid; valid: 0, 1, 2"),
    ([GOOD], ["channel0"], READY, {"NCCL_MNNVL_ENABLE": "0"}, "WARN", "NCCL_MNNVL_ENABLE=0 keeps NCCL off"),
    ([GOOD], ["channel0"], READY, {"NCCL_CUMEM_ENABLE": "0"}, "WARN", "NCCL_CUMEM_ENABLE=0 keeps NCCL off"),
    ([GOOD], ["channel0"], READY, {"NCCL_P2P_DISABLE": "1"}, "WARN", "NCCL_P2P_DISABLE=1 keeps NCCL off"),
    ([GOOD], ["channel0"], READY, {"NCCL_NVLS_ENABLE": "0"}, "WARN", "NCCL_NVLS_ENABLE=0 turns NVLink SHARP off"),
])
def test_each_node_failure_and_warning_names_its_cause(fabrics, channels, daemon, values, status, words):
    got, line, node = fabric.assess(fabric.parse_fabric(smi_q("NVIDIA GB200", fabrics)), channels, daemon,
                                    {**UNSET, **values})
    assert got == status and words in line, line
    assert (status == "FAIL") == bool(node.problems)


def test_nodes_without_multi_node_nvlink_pass_unless_a_setting_asks_for_it():
    h100 = fabric.parse_fabric(smi_q("NVIDIA H100 80GB HBM3", [("Completed", "Success", "0", ZERO)] * 8))
    status, line, node = fabric.assess(h100, [], READY, UNSET)
    assert status == "OK" and "no multi-node NVLink: NVSwitch fabric within the node on 8 GPU(s)" in line
    assert not node.multi_node
    status, line, _ = fabric.assess(h100, [], READY, {**UNSET, "NCCL_MNNVL_ENABLE": "1"})
    assert status == "WARN" and "NCCL_MNNVL_ENABLE=1 but this node's GPUs are in no multi-node NVLink domain" in line


@pytest.fixture
def node(tmp_path, monkeypatch):
    """Stand-ins for nvidia-smi and nvidia-imex-ctl (on PATH), the IMEX device folder and /proc."""
    bin_dir, dev, proc = tmp_path / "bin", tmp_path / "dev", tmp_path / "proc"
    for d in (bin_dir, dev, proc / "1", proc / "4242"):
        d.mkdir(parents=True)
    (proc / "1" / "comm").write_text("systemd\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setattr(fabric, "IMEX_CHANNELS", str(dev))
    monkeypatch.setattr(fabric, "PROC", str(proc))
    monkeypatch.setattr(platform_checks, "_has_gpu", lambda: True)
    for name in fabric.SETTINGS:
        monkeypatch.delenv(name, raising=False)

    def tool(name: str, text: str, code: int = 0) -> None:
        (bin_dir / name).write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}EOF\nexit {code}\n")
        (bin_dir / name).chmod(0o755)

    return {"tool": tool, "dev": dev, "proc": proc}


def test_the_node_check_reads_the_stand_ins(node):
    node["tool"]("nvidia-smi", smi_q("NVIDIA GB200", [GOOD] * 4))
    (node["proc"] / "4242" / "comm").write_text("nvidia-imex\n")
    (node["dev"] / "channel0").symlink_to("/dev/null")  # a character device, as the driver's channel is
    check = platform_checks.check_nvlink(preflight.Settings())
    assert check.status == "OK" and "nvidia-imex running (pid 4242" in check.message
    assert check.data == {"domains": [f"{UUID}/4026"], "gpus": 4, "problems": []}
    node["tool"]("nvidia-imex-ctl", "WAITING_FOR_PEERS\n")  # the daemon's own word wins over the process list
    check = platform_checks.check_nvlink(preflight.Settings())
    assert check.status == "FAIL" and "nvidia-imex-ctl -q says 'WAITING_FOR_PEERS', not READY" in check.message
    node["tool"]("nvidia-imex-ctl", "READY\n")
    assert platform_checks.check_nvlink(preflight.Settings()).status == "OK"


def test_no_channel_device_or_daemon_fails_naming_it(node):
    node["tool"]("nvidia-smi", smi_q("NVIDIA GB200", [GOOD] * 4))
    (node["dev"] / "channel0").write_text("")  # a plain file is no channel
    check = platform_checks.check_nvlink(preflight.Settings())
    assert check.status == "FAIL" and "no IMEX channel device" in check.message
    assert "no nvidia-imex process on this node" in check.message  # /proc/1 is systemd: the host's PID namespace
    (node["proc"] / "1" / "comm").write_text("bash\n")  # a container with its own PID namespace cannot see it
    (node["dev"] / "channel0").unlink()
    (node["dev"] / "channel3").symlink_to("/dev/null")  # Slurm's switch/nvidia_imex gives a job its own channel
    check = platform_checks.check_nvlink(preflight.Settings())
    assert check.status == "WARN" and "own PID namespace" in check.message and "channel3" not in check.message


def test_nvidia_smi_missing_or_failing(node, monkeypatch):
    node["tool"]("nvidia-smi", "Failed to initialize NVML: Driver/library version mismatch\n", code=9)
    check = platform_checks.check_nvlink(preflight.Settings())
    assert check.status == "WARN" and "nvidia-smi -q exited 9: Failed to initialize NVML" in check.message
    monkeypatch.setenv("PATH", str(Path(node["dev"])))  # nothing on PATH
    check = platform_checks.check_nvlink(preflight.Settings())
    assert check.status == "WARN" and "no nvidia-smi on PATH" in check.message and check.data is None
    monkeypatch.setattr(platform_checks, "_has_gpu", lambda: False)
    assert platform_checks.check_nvlink(preflight.Settings()).status == "OK"  # a CPU node: nothing to read


# ---- NCCL's lines ------------------------------------------------------------------------------------------------

def test_nccl_mnnvl_lines_parse_from_real_gb200_logs():
    on, off = nccl.parse(log("gb200_mnnvl.log")), nccl.parse(log("gb200_mnnvl_off.log"))
    assert (on.mnnvl, on.clique, on.clique_size, on.p2p_mnnvl, on.fabric_state) == (1, "2786", 4, 1, 3)
    assert on.fabric == "a44167d15423d758.7d6b24c07d32e7b3 cliqueId 0x2786 state 3"
    assert (off.mnnvl, off.p2p_mnnvl) == (0, 0)
    h100 = nccl.parse("h:1:1 [0] NCCL INFO MNNVL busId 0xe000 fabric UUID 0.0 cliqueId 0x0 state 3 healthMask 0x0\n"
                      "h:1:1 [0] NCCL INFO NVLS multicast support is not available on dev 0\n")
    assert h100.fabric.startswith("0.0 ") and h100.nvls is False and h100.mnnvl is None


# ---- the job -----------------------------------------------------------------------------------------------------

def rank(host, name="gb200_mnnvl.log", domains=(f"{UUID}/4026",), problems=(), checked=True, **settings):
    return {"host": host, "efa": 0, "wrong": 0, "failed": [], "log": log(name),
            "fabric": {"domains": list(domains), "gpus": 4, "problems": list(problems)} if checked else None,
            "settings": {**UNSET, **settings}}


def decide(ranks):
    return nvlink.decide(ranks, [nccl.parse(r["log"]) for r in ranks])


def test_every_rank_on_mnnvl_proves_the_domain_was_used():
    ranks = [rank("gb-1"), rank("gb-1", checked=False), rank("gb-2"), rank("gb-2", checked=False)]
    res = decide(ranks)
    assert res.status == "OK" and res.used is True and res.domains == {f"{UUID}/4026": ["gb-1", "gb-2"]}
    assert "NCCL used the NVLink domain between nodes: MNNVL 1 on all 4 ranks (clique 2786" in res.message


def test_mnnvl_off_on_a_job_in_one_domain_fails_naming_what_is_missing():
    ranks = [rank("gb-1"), rank("gb-2", "gb200_mnnvl_off.log", problems=["no IMEX channel device in /dev/x"])]
    res = decide(ranks)
    assert res.status == "FAIL" and res.used is False
    assert "NCCL did not use the NVLink domain (MNNVL 0 on rank(s) [1])" in res.message
    assert "gb-2: no IMEX channel device in /dev/x" in res.message
    # a setting that turns it off, named with its host
    res = decide([rank("gb-1", NCCL_CUMEM_ENABLE="0"), rank("gb-2", "gb200_mnnvl_off.log", NCCL_CUMEM_ENABLE="0")])
    assert res.status == "FAIL" and "gb-1: NCCL_CUMEM_ENABLE=0 keeps NCCL off" in res.message
    # NCCL too old for GB200 multi-node NVLink
    old = log("gb200_mnnvl_off.log") + "\nx:1:1 [0] NCCL INFO NCCL version 2.23.4+cuda12.6\n"
    ranks = [rank("gb-1", "gb200_mnnvl_off.log"), rank("gb-2", "gb200_mnnvl_off.log")]
    ranks[0]["log"] = old
    res = decide(ranks)
    assert "NCCL 2.23.4+cuda12.6 is older than 2.25.2" in res.message


def test_mnnvl_turned_off_on_purpose_warns():
    res = decide([rank(h, "gb200_mnnvl_off.log", NCCL_MNNVL_ENABLE="0") for h in ("gb-1", "gb-2")])
    assert res.status == "WARN" and "NCCL_MNNVL_ENABLE=0: NCCL does not use the NVLink domain" in res.message


def test_settings_that_differ_between_ranks_fail():
    res = decide([rank("gb-1"), rank("gb-2", NCCL_NVLS_ENABLE="0")])
    assert res.status == "FAIL" and "NCCL_NVLS_ENABLE=0 on gb-2; NCCL_NVLS_ENABLE=unset on gb-1" in res.message
    # also without any NVLink domain (H100 nodes): a mix is reported
    plain = [rank(h, "efa_libfabric.log", domains=()) for h in ("p5-1", "p5-2")]
    assert nvlink.decide(plain, [nccl.parse(r["log"]) for r in plain]) is None
    plain[1]["settings"]["NCCL_MNNVL_ENABLE"] = "0"
    assert nvlink.decide(plain, [nccl.parse(r["log"]) for r in plain]).status == "FAIL"


def test_nodes_in_two_domains_warn_with_the_segment_option():
    res = decide([rank("gb-1"), rank("gb-19", domains=(f"{OTHER}/7",))])
    assert res.status == "WARN" and res.used is True
    assert f"the job's nodes span 2 NVLink domains ({OTHER}/7: gb-19; {UUID}/4026: gb-1)" in res.message
    assert "sbatch --segment" in res.message


def test_a_node_without_the_domain_among_nodes_with_it_fails():
    res = decide([rank("gb-1"), rank("gb-2", "gb200_mnnvl_off.log", domains=())])
    assert res.status == "FAIL" and "gb-2 report no multi-node NVLink while 1 node(s) do" in res.message


def test_no_mnnvl_line_is_a_warning_and_one_node_has_nothing_to_prove():
    ranks = [rank("gb-1"), rank("gb-2")]
    ranks[1]["log"] = "x:1:1 [0] NCCL INFO Using network IB\n"
    res = decide(ranks)
    assert res.status == "WARN" and "no 'comm ... MNNVL' line from rank(s) [1]" in res.message
    ranks[1]["log"] = log("ib.log")  # NCCL 2.19.3: no multi-node NVLink for GB200 yet
    res = decide(ranks)
    assert res.status == "WARN" and "NCCL 2.19.3+cuda12.3 is older than 2.25.2" in res.message
    res = decide([rank("gb-1"), rank("gb-1", checked=False)])
    assert res.status == "OK" and "one node in NVLink domain" in res.message and res.used is None


def test_the_nccl_warning_is_the_reason_when_the_all_reduce_fails():
    """NCCL stops when fabric memory cannot be allocated: its WARN (src/mnnvl.cc's format) is the reason given."""
    text = ("gb-1:1:1 [0] NCCL INFO comm 0x1 rank 0 nRanks 8 nNodes 2 localRanks 4 localRank 0 MNNVL 0\n"
            "gb-1:1:1 [0] NCCL WARN MNNVL (cliqueSize 8) is available but not working on this system. Check the IMEX "
            "channel configuration (/dev/nvidia-caps-imex-channels). Set NCCL_MNNVL_ENABLE=0 to ignore this issue.\n")
    net = nccl.parse(text)
    assert net.mnnvl_errors[0].startswith("MNNVL (cliqueSize 8) is available but not working")


def test_preflight_prints_the_nvlink_line_and_fails_the_step(monkeypatch, capsys, tmp_path):
    ranks = [rank("gb-1"), rank("gb-2", "gb200_mnnvl_off.log", problems=["GPU 2 State In Progress"])]
    res = netcheck.summarize(ranks, "nccl", 2**20, 10, 0.01, 3.0)
    assert res.nvlink["status"] == "FAIL" and res.failed
    assert ("nvlink_domain", "FAIL") in [(n, s) for n, s, _ in netcheck.result_lines(res)]
    seen = {}
    monkeypatch.setattr(netcheck, "run", lambda *a, **k: seen.setdefault("args", a) and res)
    monkeypatch.setattr(preflight, "run_checks", lambda s: [preflight.Check("nvlink_domain", "OK", "fine",
                                                                          {"domains": ["d"], "gpus": 4, "problems": []})])
    for var, value in {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}.items():
        monkeypatch.setenv(var, value)
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert preflight.main(["--device", "cpu", "--report", str(tmp_path / "pf.json")]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] nvlink_domain: NCCL did not use the NVLink domain" in out and "gb-2: GPU 2 State In Progress" in out
    assert seen["args"][-1] == {"domains": ["d"], "gpus": 4, "problems": []}  # the node check's findings go along
