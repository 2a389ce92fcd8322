#!/usr/bin/env python3
"""A throw-away Slurm cluster on this host, for testing the launchers for real.

    python scripts/slurm/local_cluster.py up --dir /tmp/slurm --nodes 2   # prints `export ...` lines
    eval "$(python scripts/slurm/local_cluster.py env --dir /tmp/slurm)"
    sbatch --nodes=2 1.train_llama.sbatch --model tiny --device cpu --max_steps 6
    python scripts/slurm/local_cluster.py down --dir /tmp/slurm

Everything lives in one directory: slurm.conf + cgroup.conf, state/spool/log/pid files, a private
munged socket and a `bin/sacct` stand-in (there is no accounting database; submitit needs sacct).
Daemons are stopped by the PIDs recorded at start-up. Needs root (munged runs as the munge user,
slurmd as root); missing packages are installed with apt-get (Debian/Ubuntu).
With --container, the nodes also run containers: Pyxis (plugstack.conf) and Enroot with each node's own state,
built from the container kit (container_kit.py), and a registry on 127.0.0.1 (local_pyxis.py); `down` then
removes every container and the registry too.
Standard library only, so it runs with any python3.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import container_kit  # noqa: E402 - beside this file
import local_pyxis  # noqa: E402

APT_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
REQUIRED_BINARIES = ["slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue", "munged", "munge"]
SLURMD_PORTS = (17001, 17002, 17003)
CPUS_PER_NODE = 2
HERE = Path(__file__).resolve().parent


class ClusterUnavailable(RuntimeError):
    """Raised when this host cannot run a local cluster (not root, no apt, daemon failed to start)."""


@dataclass
class Cluster:
    """What `up` started; saved as cluster.json so that `down` can stop it from another process."""

    root: str
    nodes: list[str]
    ctld_port: int
    munge_dir: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    enroot: str = ""
    """The Enroot binary the nodes' wrappers run (--container), else empty."""
    registry: str = ""
    """host:port of the local registry (--container)."""

    @property
    def container(self) -> bool:
        return bool(self.enroot)

    @property
    def conf(self) -> Path:
        return Path(self.root) / "slurm.conf"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for client commands: SLURM_CONF, and the sacct stand-in first on PATH."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = f"{Path(self.root) / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env

    def save(self) -> None:
        (Path(self.root) / "cluster.json").write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, root: str | Path) -> Cluster:
        path = Path(root) / "cluster.json"
        if not path.is_file():
            raise FileNotFoundError(f"no cluster.json in {root}: was `up` run with --dir {root}?")
        return cls(**json.loads(path.read_text()))


def ensure_installed(install: bool = True) -> None:
    """Install slurm-wlm/munge with apt-get when a binary is missing; raise ClusterUnavailable if impossible."""
    missing = [b for b in REQUIRED_BINARIES if shutil.which(b) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable(f"missing {', '.join(missing)} and not root (cannot apt-get install)")
    if not install or shutil.which("apt-get") is None:
        raise ClusterUnavailable(f"missing {', '.join(missing)} and no apt-get to install {APT_PACKAGES}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ClusterUnavailable(f"`{' '.join(cmd)}` failed (rc {proc.returncode}): {proc.stderr.strip()[-500:]}")


def free_port(preferred: int | None = None) -> int:
    """`preferred` when nothing listens on it, else a free port chosen by the kernel."""
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise AssertionError("unreachable: port 0 always binds")


def write_configs(cluster: Cluster, slurmd_ports: list[int]) -> None:
    """slurm.conf (single host, cons_tres, linuxproc, no accounting) and the cgroup.conf slurmd 22.05 needs."""
    root = Path(cluster.root)
    host = socket.gethostname().split(".")[0]
    node_lines = [
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} "
        f"Boards=1 SocketsPerBoard=1 CoresPerSocket={CPUS_PER_NODE} ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN"
        for name, port in zip(cluster.nodes, slurmd_ports, strict=True)
    ]
    conf = f"""# generated by scripts/slurm/local_cluster.py
ClusterName=llamafp8
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={cluster.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={cluster.munge_dir}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
# keep finished jobs visible to `scontrol show job` (the sacct stand-in reads them)
MinJobAge=3600
KillWait=10
SchedulerType=sched/backfill
# schedule every second instead of every minute: tests wait on it (a job released from a hold starts at the next pass)
SchedulerParameters=sched_interval=1,bf_interval=1
{f"PlugStackConfig={root / 'plugstack.conf'}" if cluster.container else ""}
{chr(10).join(node_lines)}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
# a second partition on the same nodes: tests check that --partition reaches every job of a script
PartitionName=alt Nodes=ALL Default=NO MaxTime=INFINITE State=UP
"""
    (root / "slurm.conf").write_text(conf)
    # slurmd 22.05 loads a cgroup plugin even with proctrack/linuxproc and fails without this file.
    (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _wait_for(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    """Poll `predicate` every 0.5 s; raise ClusterUnavailable naming `what` (and the log tail) on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    tail = log.read_text()[-1500:] if log is not None and log.is_file() else ""
    raise ClusterUnavailable(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")


def _read_pid(path: Path) -> int:
    _wait_for(lambda: path.is_file() and path.read_text().strip().isdigit(), 15, f"pid file {path}")
    return int(path.read_text().strip())


def start_munged(cluster: Cluster) -> None:
    """A private munged (own socket/pid/log) running as the munge user, so a host munged is never touched.

    Its directory is outside the cluster dir, whose parents (e.g. pytest's 0700 tmp) munge may not traverse.
    """
    mdir = Path(cluster.munge_dir)
    mdir.chmod(0o755)  # munged requires the socket directory to be searchable by all
    munge_user = pwd.getpwnam("munge")
    os.chown(mdir, munge_user.pw_uid, munge_user.pw_gid)
    sock = mdir / "munge.socket"
    cmd = ["runuser", "-u", "munge", "--", "munged", f"--socket={sock}", f"--pid-file={mdir / 'munged.pid'}",
           f"--log-file={mdir / 'munged.log'}", f"--seed-file={mdir / 'munged.seed'}"]
    proc = _run(cmd)
    if proc.returncode != 0:
        raise ClusterUnavailable(f"munged failed to start (rc {proc.returncode}): {proc.stderr.strip()}")
    cluster.pids["munged"] = _read_pid(mdir / "munged.pid")
    check = subprocess.run(f"munge -n -S {sock} | unmunge -S {sock}", shell=True, capture_output=True, check=False)
    if check.returncode != 0:
        raise ClusterUnavailable(f"munge -n | unmunge failed: {check.stderr.decode().strip()}")


def start_slurm(cluster: Cluster) -> None:
    """slurmctld, then one slurmd per node (`slurmd -N name`), then wait until every node is idle."""
    root = Path(cluster.root)
    env = cluster.env()
    proc = _run(["slurmctld", "-f", str(cluster.conf)], env=env)
    if proc.returncode != 0:
        raise ClusterUnavailable(f"slurmctld failed (rc {proc.returncode}): {proc.stderr.strip()}")
    cluster.pids["slurmctld"] = _read_pid(root / "run" / "slurmctld.pid")
    for name in cluster.nodes:
        node_env = dict(env, PATH=local_pyxis.node_path(root, name, env["PATH"])) if cluster.container else env
        proc = _run(["slurmd", "-f", str(cluster.conf), "-N", name], env=node_env)
        if proc.returncode != 0:
            raise ClusterUnavailable(f"slurmd -N {name} failed (rc {proc.returncode}): {proc.stderr.strip()}")
        cluster.pids[f"slurmd.{name}"] = _read_pid(root / "run" / f"slurmd.{name}.pid")
    cluster.save()

    def all_idle() -> bool:
        out = _run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env).stdout.split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        return all(states.get(n) == "idle" for n in cluster.nodes)

    _wait_for(all_idle, 60, f"nodes {cluster.nodes} to become idle", log=root / "log" / "slurmctld.log")


def install_sacct_standin(cluster: Cluster) -> None:
    """bin/sacct -> scripts/slurm/sacct (answers submitit's sacct query from `scontrol show job`)."""
    bindir = Path(cluster.root) / "bin"
    bindir.mkdir(exist_ok=True)
    target = bindir / "sacct"
    shutil.copy(HERE / "sacct", target)
    target.chmod(0o755)


def up(root: str | Path, nodes: int = 1, install: bool = True, container: bool = False) -> Cluster:
    """Bring a cluster up in `root` (created, must not exist or be empty). Tears down what started on failure.
    container: Pyxis + Enroot on the nodes and a local registry (container_kit.KitMissing without the kit)."""
    if nodes not in (1, 2, 3):
        raise ValueError(f"--nodes must be 1, 2 or 3, got {nodes}")
    if os.geteuid() != 0:
        raise ClusterUnavailable("a local Slurm needs root (slurmd runs jobs as any user; munged as munge)")
    ensure_installed(install)
    try:
        tools = container_kit.prepare(install) if container else None
    except container_kit.KitError as e:
        raise ClusterUnavailable(str(e)) from e
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if any(root.iterdir()):
        raise ValueError(f"--dir {root} is not empty: use a fresh directory")
    root.chmod(0o755)  # munged (munge user) must traverse it
    for sub in ("state", "spool", "run", "log"):
        (root / sub).mkdir()
    ports = [free_port(p) for p in SLURMD_PORTS[:nodes]]
    cluster = Cluster(root=str(root), nodes=[f"n{i + 1}" for i in range(nodes)], ctld_port=free_port(None),
                      munge_dir=tempfile.mkdtemp(prefix="llama-fp8-munge-", dir="/tmp"))
    install_sacct_standin(cluster)
    if tools is not None:
        cluster.enroot = str(tools.enroot)
        local_pyxis.setup_nodes(root, cluster.nodes, tools.enroot, tools.pyxis_so)
    write_configs(cluster, ports)
    try:
        if tools is not None:
            port = free_port(None)
            cluster.pids["registry"] = local_pyxis.start_registry(root, port)
            cluster.registry = f"127.0.0.1:{port}"
        start_munged(cluster)
        cluster.save()
        start_slurm(cluster)
    except BaseException:
        down(cluster)
        raise
    return cluster


def alive(pid: int) -> bool:
    """Whether a process with this PID exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _stop_pid(pid: int, timeout: float = 15) -> None:
    """SIGTERM, wait, then SIGKILL."""
    if not alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


def down(cluster: Cluster | str | Path, timeout: float = 60) -> list[str]:
    """Cancel every job, wait for the queue to drain (job steps survive a shutdown), stop daemons by PID; with
    containers, remove every node's containers and the registry's storage. Returns what was left behind."""
    if not isinstance(cluster, Cluster):
        cluster = Cluster.load(cluster)
    env = cluster.env()
    if "slurmctld" in cluster.pids and alive(cluster.pids["slurmctld"]):
        _run(["scancel", "--full", "--user", pwd.getpwuid(os.geteuid()).pw_name], env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _run(["squeue", "-h", "-o", "%i"], env=env).stdout.strip():
            time.sleep(1)
        _run(["scontrol", "shutdown"], env=env)
    for _, pid in sorted(cluster.pids.items(), key=lambda kv: kv[0] == "munged"):  # munged last
        _stop_pid(pid)
    cluster.pids.clear()
    if cluster.munge_dir:
        shutil.rmtree(cluster.munge_dir, ignore_errors=True)
    left = local_pyxis.remove_all(Path(cluster.root), cluster.nodes) if cluster.container else []
    cluster.save()
    return left


def main(argv: list[str] | None = None) -> int:
    """CLI: up | down | env."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["up", "down", "env"])
    parser.add_argument("--dir", required=True, help="cluster directory (fresh for `up`)")
    parser.add_argument("--nodes", type=int, default=1, choices=[1, 2, 3],
                        help="slurmd daemons (n1, n2, n3: a third one lets a 2-node job leave a node behind)")
    parser.add_argument("--no-install", action="store_true", help="do not apt-get install missing packages")
    parser.add_argument("--container", action="store_true",
                        help="Pyxis + Enroot on the nodes and a registry on 127.0.0.1 (needs the container kit)")
    args = parser.parse_args(argv)
    try:
        cluster = (up(args.dir, args.nodes, not args.no_install, args.container) if args.action == "up"
                   else Cluster.load(args.dir))
    except (ClusterUnavailable, container_kit.KitMissing, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.action == "down":
        left = down(cluster)
        print(f"stopped the cluster in {cluster.root}" + "".join(f"\nleft behind: {x}" for x in left))
        return 1 if left else 0
    env = cluster.env()
    print(f"export SLURM_CONF={env['SLURM_CONF']}\nexport PATH={env['PATH']}")
    if cluster.registry:
        print(f"export LOCAL_REGISTRY={cluster.registry}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
