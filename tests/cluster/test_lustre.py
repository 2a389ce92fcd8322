"""FSx for Lustre before a job trains: the mount and its options (a stand-in mount table), the checkpoint folder's
stripe count against one rank's shard (a stand-in ``lfs``), and the test write whose LNet counters prove EFA (a
stand-in ``lnetctl`` whose counters move as the real ones would). Every pass, warning and failure, with its words."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from helpers import REPO, build_meta
from llama_fp8 import config
from llama_fp8.cluster.nodes import lustre, platform_checks, preflight

GIB = 2**30
# the mount options of an FSx for Lustre client as `findmnt` listed them in a public HyperPod setup log
FSX_OPTIONS = "rw,relatime,seclabel,checksum,flock,nouser_xattr,lruresize,lazystatfs,nouser_fid2path,verbose,encrypt"
PLAIN_1 = "stripe_count:  1 stripe_size:   1048576 pattern:       0 stripe_offset: -1\n"  # Lustre wiki, lfs getstripe -d
PFL = textwrap.dedent("""\
    lcm_layout_gen:    0
    lcm_mirror_count:  1
    lcm_entry_count:   3
        lcme_id:             N/A
        lcme_mirror_id:      N/A
        lcme_flags:          0
        lcme_extent.e_start: 0
        lcme_extent.e_end:   104857600
          stripe_count:  1       stripe_size:   1048576       pattern:       raid0       stripe_offset: -1

        lcme_id:             N/A
        lcme_mirror_id:      N/A
        lcme_flags:          0
        lcme_extent.e_start: 104857600
        lcme_extent.e_end:   10737418240
          stripe_count:  8       stripe_size:   1048576       pattern:       raid0       stripe_offset: -1

        lcme_id:             N/A
        lcme_mirror_id:      N/A
        lcme_flags:          0
        lcme_extent.e_start: 10737418240
        lcme_extent.e_end:   EOF
          stripe_count:  -1       stripe_size:   1048576       pattern:       raid0       stripe_offset: -1
    """)  # what lfs getstripe -d prints for the FSx guide's PFL (the directory layout format of lfs-getstripe(1))


def lnet_yaml(efa_send: int, tcp_send: int, efa: bool = True, status: str = "up") -> str:
    """``lnetctl net show -v`` with a tcp net and (``efa``) an EFA net of two NIs, in lnetctl's YAML layout."""
    nets = ["net:", "    - net type: lo", "      local NI(s):", "        - nid: 0@lo", "          status: up",
            "    - net type: tcp", "      local NI(s):", "        - nid: 10.1.1.61@tcp", "          status: up",
            "          statistics:", f"              send_count: {tcp_send}", f"              recv_count: {tcp_send}"]
    if efa:
        nets += ["    - net type: efa", "      local NI(s):"]
        for i, share in enumerate((efa_send, 0)):  # the second NI carries nothing: the counters are summed
            nets += [f"        - nid: 1.61.92.{i}@efa", f"          status: {status if i == 0 else 'up'}",
                     "          statistics:", f"              send_count: {share}", f"              recv_count: {share}"]
    return "\n".join(nets) + "\n"


@pytest.fixture
def fsx(tmp_path, monkeypatch):
    """A stand-in mount table with FSx at tmp/fsx, and stand-in lfs / lnetctl on PATH."""
    bin_dir, mnt = tmp_path / "bin", tmp_path / "fsx"
    bin_dir.mkdir()
    (mnt / "runs").mkdir(parents=True)
    (tmp_path / "local").mkdir()
    table = tmp_path / "mounts"
    table.write_text(f"/dev/nvme0n1p1 / ext4 rw,relatime 0 0\n10.1.1.67@tcp:/xeo3rbev {mnt} lustre {FSX_OPTIONS} 0 0\n")
    monkeypatch.setattr(lustre, "MOUNTS", str(table))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for var in ("SLURM_STEP_ID", "SLURM_PROCID", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)

    def tool(name: str, script: str) -> None:
        (bin_dir / name).write_text("#!/bin/bash\n" + script)
        (bin_dir / name).chmod(0o755)

    def lfs(text: str, code: int = 0) -> None:
        (tmp_path / "lfs.out").write_text(text)
        tool("lfs", f'echo "$*" >>{tmp_path}/lfs.calls\ncat {tmp_path}/lfs.out\nexit {code}\n')

    def lnetctl(before: str, after: str, code: int = 0) -> None:
        """Prints ``before`` on the first call and ``after`` on the next ones (the counters after the test)."""
        (tmp_path / "lnet.0").write_text(before)
        (tmp_path / "lnet.1").write_text(after)
        tool("lnetctl", f'[[ "$*" == "net show -v" ]] || exit 2\nn={tmp_path}/lnet.n\nif [[ -e $n ]]; then '
                        f'cat {tmp_path}/lnet.1; else touch $n; cat {tmp_path}/lnet.0; fi\nexit {code}\n')

    return {"mnt": mnt, "tmp": tmp_path, "lfs": lfs, "lnetctl": lnetctl, "bin": bin_dir}


def settings(checkpoint_dir: Path, train: list[str] | None = None) -> preflight.Settings:
    return preflight.resolve(preflight.build_parser().parse_args(["--checkpoint_dir", str(checkpoint_dir)]),
                             train or [])


EIGHT_B = ["--model", "llama3.1-8b"]  # one rank's shard on 8 ranks: 12 bytes x 8.03 B / 8 = 11.2 GiB


def test_mount_table_and_the_deepest_mount():
    table = "a / ext4 rw 0 0\nfs@tcp:/x /fsx lustre rw,flock 0 0\n/dev/x /fsx/sub\\040dir xfs rw 0 0\n"
    entries = lustre.parse_mount_table(table)
    assert entries[2].target == "/fsx/sub dir"
    assert lustre.mount_of("/fsx/runs/a", entries).fstype == "lustre"
    assert lustre.mount_of("/fsx/sub dir/x", entries).fstype == "xfs"
    assert lustre.mount_of("/fsx2/a", entries).target == "/"  # components, not string prefixes
    assert lustre.lustre_mount("/fsx/runs", table).source == "fs@tcp:/x" and lustre.lustre_mount("/home", table) is None


def test_layouts_plain_and_progressive():
    assert lustre.parse_layout(PLAIN_1) == [(0, None, 1)]
    pfl = lustre.parse_layout(PFL)
    assert pfl == [(0, 104857600, 1), (104857600, 10737418240, 8), (10737418240, None, -1)]
    assert [lustre.stripe_count_at(pfl, s) for s in (2**20, 2 * 2**30, 11 * 2**30)] == [1, 8, -1]


def test_the_closed_form_parameter_count_is_the_models():
    for extra in ([], ["--num_key_value_heads", "2", "--tie_word_embeddings", "1"]):
        cfg = config.parse_args(["--model", "tiny", "--model_impl", "hf", *extra])
        assert lustre.llama_params(cfg) == sum(p.numel() for p in build_meta(cfg).parameters()), extra
    # Llama 3.1 8B has 8,030,261,248 parameters (its safetensors index: meta-llama/Llama-3.1-8B)
    assert lustre.shard_bytes(config.parse_args(EIGHT_B), 8) == 12 * 8_030_261_248 // 8


def test_off_lustre_there_is_nothing_to_check(fsx):
    check = platform_checks.check_lustre(settings(fsx["tmp"] / "local" / "ck"))
    assert check.status == "OK" and check.message == "checkpoint_dir not on Lustre (nothing to check)"


def test_all_good_reports_the_mount_the_stripes_and_lnet_over_efa(fsx, monkeypatch):
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    fsx["lfs"](PFL)
    fsx["lnetctl"](lnet_yaml(900, 100), lnet_yaml(1030, 104))
    check = platform_checks.check_lustre(settings(fsx["mnt"] / "runs" / "new", EIGHT_B))
    assert check.status == "OK", check.message
    assert f"checkpoint_dir on Lustre 10.1.1.67@tcp:/xeo3rbev at {fsx['mnt']} ({FSX_OPTIONS})" in check.message
    assert "a ~11.22 GiB checkpoint shard is striped over every OST" in check.message
    assert "LNet over EFA: the 64 MiB test moved efa send_count +130, recv_count +130 (tcp +4/+4)" in check.message
    assert (fsx["tmp"] / "lfs.calls").read_text().strip() == f"getstripe -d {fsx['mnt'] / 'runs'}"  # nearest folder
    assert not [p for p in (fsx["mnt"] / "runs").iterdir()]  # the test file is gone


def test_stripe_count_1_for_multi_gib_shards_warns_with_the_fix(fsx):
    fsx["lfs"](PLAIN_1)
    fsx["lnetctl"](lnet_yaml(0, 0, efa=False), lnet_yaml(0, 5, efa=False))
    check = platform_checks.check_lustre(settings(fsx["mnt"] / "runs", EIGHT_B))  # one rank: the whole 89.8 GiB
    assert check.status == "WARN"
    assert "each rank's checkpoint shard (~89.7 GiB) would be written to 1 OST (stripe count 1 in" in check.message
    assert f"lfs setstripe -E 100M -c 1 -E 10G -c 8 -E -1 -c -1 {fsx['mnt'] / 'runs'}" in check.message
    tiny = platform_checks.check_lustre(settings(fsx["mnt"] / "runs", ["--model", "tiny"]))  # small shards: fine
    assert tiny.status == "OK" and "striped over 1 OST(s)" in tiny.message
    assert "LNet has no EFA net: this client reaches the file system over TCP" in tiny.message


def test_lnet_fell_back_to_tcp_warns(fsx):
    fsx["lfs"](PFL)
    fsx["lnetctl"](lnet_yaml(900, 100), lnet_yaml(900, 4200))
    check = platform_checks.check_lustre(settings(fsx["mnt"] / "runs"))
    assert check.status == "WARN"
    assert "the 64 MiB test moved no EFA counter (tcp send_count +4100, recv_count +4100): Lustre fell back to TCP" \
        in check.message
    assert "shard size unknown without train flags" not in check.message  # an OK finding is not shown with a warning


@pytest.mark.parametrize(("setup", "status", "words"), [
    ("lfs_fails", "FAIL", "lfs getstripe -d {runs} failed (Cannot send after transport endpoint shutdown)"),
    ("efa_down", "FAIL", "1 of LNet's 2 EFA NI(s) are down: Lustre falls back to TCP"),
    ("write_fails", "FAIL", "the 64 MiB test write in {runs} failed: No space left on device"),
    ("no_tools", "WARN", "stripe count not checked: lfs not found on PATH"),
    ("lnetctl_fails", "WARN", "LNet not checked: lnetctl net show -v failed"),
])
def test_each_failure_and_missing_tool(fsx, monkeypatch, setup, status, words):
    fsx["lfs"](PFL)
    if setup == "lfs_fails":  # a client whose connection to the servers is gone (ESHUTDOWN)
        (fsx["bin"] / "lfs").write_text("#!/bin/bash\necho 'Cannot send after transport endpoint shutdown' >&2\nexit 5\n")
    fsx["lnetctl"](lnet_yaml(900, 100, status="down" if setup == "efa_down" else "up"), lnet_yaml(1000, 100),
                   code=1 if setup == "lnetctl_fails" else 0)
    if setup == "write_fails":
        def full(folder, nbytes=lustre.TEST_BYTES):
            raise OSError(28, "No space left on device")
        monkeypatch.setattr(lustre, "test_io", full)
    if setup == "no_tools":
        (fsx["bin"] / "lfs").unlink()
        (fsx["bin"] / "lnetctl").unlink()
        monkeypatch.setenv("PATH", str(fsx["bin"]))
    check = platform_checks.check_lustre(settings(fsx["mnt"] / "runs"))
    assert check.status == status and words.format(runs=fsx["mnt"] / "runs") in check.message, check.message
    if setup == "no_tools":
        assert "LNet not checked: lnetctl not found on PATH" in check.message


def test_only_the_data_on_lustre_is_reported_without_a_write(fsx):
    data = fsx["mnt"] / "c4"
    data.mkdir()
    check = platform_checks.check_lustre(settings(fsx["tmp"] / "local", ["--model", "tiny", "--dataset", str(data)]))
    assert check.status == "OK" and "dataset on Lustre 10.1.1.67@tcp:/xeo3rbev" in check.message
    assert "only the data is on Lustre" in check.message and not (fsx["tmp"] / "lfs.calls").exists()


def test_the_test_io_writes_reads_and_removes_its_file(tmp_path):
    lustre.test_io(tmp_path, nbytes=3 * 2**20)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError):
        lustre.test_io(tmp_path / "missing")


# ---- the host's tools, where the image has none (job_lib.sh lf_lustre_on_hosts) ---------------------------------

def test_in_an_image_without_lustre_tools_the_host_step_is_named(fsx, monkeypatch):
    monkeypatch.setenv("PATH", str(fsx["bin"]))  # no lfs, no lnetctl: an image
    monkeypatch.setenv(lustre.ON_HOST_ENV, "1")
    check = platform_checks.check_lustre(settings(fsx["mnt"] / "runs", ["--model", "tiny"]))
    assert check.status == "OK"
    assert "stripe count: checked with the host's Lustre tools after this step" in check.message
    assert "LNet over EFA: checked with the host's Lustre tools after this step" in check.message
    assert check.data["folder"] == str(fsx["mnt"] / "runs") and check.data["shard_bytes"] > 0


def test_the_host_step_reads_the_folder_and_shard_from_the_report(fsx, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SLURMD_NODENAME", "gb-3")
    report = tmp_path / "pf.json"
    report.write_text(json.dumps({"checks": [{"name": "lustre", "status": "OK", "message": "m",
                                              "data": {"folder": str(fsx["mnt"] / "runs"), "shard_bytes": 4 * GIB}}]}))
    fsx["lfs"](PLAIN_1)
    fsx["lnetctl"](lnet_yaml(900, 100), lnet_yaml(900, 4200))
    assert lustre.main(["--from_report", str(report)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[WARN] lustre (host gb-3): each rank's checkpoint shard (~4.0 GiB) would be written to 1 OST")
    assert "Lustre fell back to TCP" in out
    fsx["lnetctl"](lnet_yaml(900, 100, status="down"), lnet_yaml(900, 100))
    (fsx["tmp"] / "lnet.n").unlink()
    assert lustre.main(["--from_report", str(report)]) == 1  # a FAIL fails the step
    assert "[FAIL] lustre (host gb-3)" in capsys.readouterr().out
    report.write_text(json.dumps({"checks": [{"name": "lustre", "status": "OK", "message": "not on Lustre"}]}))
    assert lustre.main(["--from_report", str(report)]) == 0 and capsys.readouterr().out == ""  # nothing to do
    assert lustre.main(["--from_report", str(tmp_path / "missing.json")]) == 0


def test_the_module_runs_on_an_old_hosts_python3():
    """Login and compute hosts may have Python 3.7 (Amazon Linux 2) without PyYAML: 3.7's grammar, stdlib only."""
    import ast
    import sys

    for path in (REPO / "src/llama_fp8/cluster/nodes/lustre.py", REPO / "src/llama_fp8/cluster/nodes/__init__.py"):
        tree = ast.parse(path.read_text(), feature_version=(3, 7))
        names = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                 for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        assert names <= set(sys.stdlib_module_names) | {"__future__"}, (path, names)


def run_preflight_step(tmp_path: Path, lfs: bool, preflight_rc: int = 0) -> tuple[subprocess.CompletedProcess, list]:
    """job_lib.sh's lf_preflight with srun recorded (and returning ``preflight_rc`` for the preflight step)."""
    calls, bin_dir = tmp_path / "srun.calls", tmp_path / "hostbin"
    bin_dir.mkdir(exist_ok=True)
    if lfs:
        (bin_dir / "lfs").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "lfs").chmod(0o755)
    harness = f"""
set -euo pipefail
source {REPO}/scripts/slurm/job_lib.sh
srun() {{ printf '%s\\n' "$*" >>{calls}; if [[ "$*" == *"llama_fp8 preflight"* ]]; then return {preflight_rc}; fi; }}
scontrol() {{ if [[ "$*" == "show hostnames n[1-2]" ]]; then printf 'n1\\nn2\\n'; fi; }}
SLURM_JOB_NUM_NODES=2 SLURM_JOB_ID=7 SLURM_JOB_NODELIST='n[1-2]' CPUS=2 NPROC_PER_NODE=4 DEVICE=cuda PY=(python)
CONTAINER_ARGS=() RDZV_ADDR=n1 RDZV_PORT=29500 IMAGE=/fsx/img.sqsh PREFLIGHT_REPORT={tmp_path}/pf.json
mkdir -p logs
lf_setup_nodes  # as lf_setup does before preflight: the job's training nodes and spares
rc=0; lf_preflight --model tiny || rc=$?
echo "rc=$rc on_host=${{LLAMA_FP8_LUSTRE_ON_HOST:-0}}"
"""
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    proc = subprocess.run(["bash", "-c", harness], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    return proc, calls.read_text().splitlines() if calls.exists() else []


def test_the_batch_script_checks_lustre_with_the_hosts_tools_after_preflight(tmp_path):
    proc, calls = run_preflight_step(tmp_path, lfs=True)
    assert "rc=0 on_host=1" in proc.stdout, proc.stderr
    assert len(calls) == 2 and "-m llama_fp8 preflight" in calls[0]
    assert calls[1] == (f"--nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 env PYTHONPATH={REPO / 'src'} python3 -m "
                        f"llama_fp8.cluster.nodes.lustre --from_report {tmp_path / 'pf.json'}")
    no_lfs, failed = tmp_path / "no_lfs", tmp_path / "failed"
    no_lfs.mkdir()
    failed.mkdir()
    proc, calls = run_preflight_step(no_lfs, lfs=False)
    assert "rc=0 on_host=0" in proc.stdout and len(calls) == 1  # no lfs on this host: preflight's own finding stands
    proc, calls = run_preflight_step(failed, lfs=True, preflight_rc=3)
    assert "rc=3 on_host=1" in proc.stdout and len(calls) == 1  # a failed preflight keeps its code, no host step
