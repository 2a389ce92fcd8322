"""Pyxis + Enroot on the nodes of the local cluster (local_cluster.py up --container), and a local registry.

Each slurmd stands for a host of its own, so each gets its own Enroot state (data, cache, runtime and temp
folders under <cluster>/nodes/<node>/enroot). Pyxis passes Enroot none of the job's ENROOT_*_PATH variables and
keeps only slurmd's PATH (pyxis_slurmstepd.c, enroot_set_env), so the folders are chosen by a small `enroot`
that comes first on that node's slurmd PATH (<cluster>/nodes/<node>/bin/enroot). Job tasks and the host running
the tests reach the same wrappers through <cluster>/bin/enroot, which picks one by SLURMD_NODENAME ("head", the
submitting host, outside a job). Pyxis is loaded through plugstack.conf with use_enroot_load=1: a registry image
is then loaded into each node's own container instead of a squashfs file under the runtime_path that both slurmd
of this host would share. The registry (Debian's docker-registry) listens on 127.0.0.1 only, over plain HTTP
(hence ENROOT_ALLOW_HTTP on these nodes), with its storage inside the cluster folder.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

ENROOT_DIRS = ("data", "cache", "run", "tmp")
# Each node's Enroot state goes on a RAM file system when there is room, as a real node's on local NVMe: on these
# machines' disk (ext4 mounted with online discard) unpacking a ~2 GB image took 29 s and removing it 94 s,
# on /dev/shm 5 s and 1.3 s (measured on 2 cores under load). The state folders are symlinks into it.
RAM_DIR = Path("/dev/shm")
RAM_NEEDED = 12 << 30  # two nodes' containers of the tests' image, an import's layers, and headroom
# An uncompressed squashfs: `enroot import` of a ~2 GB image takes ~15 s instead of minutes with the default
# (-comp lzo -noD) on 2 cores; the file is ~25% bigger, which a test cluster does not mind.
SQUASH_OPTIONS = "-noI -noD -noF -noX -no-duplicates"


def node_wrapper(root: Path, node: str, enroot: Path) -> str:
    state = root / "nodes" / node / "enroot"
    return f"""#!/bin/sh
# Enroot of node {node} of the local cluster: its own state, as on a host of its own (scripts/slurm/local_pyxis.py).
export ENROOT_DATA_PATH={state}/data ENROOT_CACHE_PATH={state}/cache ENROOT_RUNTIME_PATH={state}/run
export ENROOT_TEMP_PATH={state}/tmp ENROOT_ALLOW_HTTP=yes ENROOT_SQUASH_OPTIONS='{SQUASH_OPTIONS}'
# Enroot runs its helpers (enroot-nsenter, enroot-switchroot, ...) from PATH: they are installed beside it.
export PATH={enroot.parent}:$PATH
exec {enroot} "$@"
"""


def dispatcher(root: Path, nodes: list[str]) -> str:
    names = "|".join([*nodes, "head"])
    return f"""#!/bin/sh
# `enroot` for job tasks (their node's, by SLURMD_NODENAME) and for the host running the tests ("head").
node=${{SLURMD_NODENAME:-head}}
case "$node" in
    {names}) exec {root}/nodes/"$node"/bin/enroot "$@" ;;
    *) echo "enroot: no node '$node' in the local cluster ({names})" >&2; exit 2 ;;
esac
"""


def state_base(root: Path) -> Path | None:
    """A folder on RAM_DIR for the nodes' Enroot state, or None (then it stays in the cluster folder)."""
    try:
        usage = shutil.disk_usage(RAM_DIR)
    except OSError:
        return None
    if usage.free < RAM_NEEDED:
        return None
    base = RAM_DIR / f"llama-fp8-enroot-{root.name}-{abs(hash(str(root))) % 10**8}"
    base.mkdir(mode=0o700, exist_ok=True)
    return base


def setup_nodes(root: Path, nodes: list[str], enroot: Path, pyxis_so: Path) -> Path:
    """Write the per-node wrappers, the dispatcher and plugstack.conf; return plugstack.conf's path."""
    ram = state_base(root)
    for node in [*nodes, "head"]:
        state = root / "nodes" / node / "enroot"
        state.parent.mkdir(parents=True, exist_ok=True)
        if ram is not None:
            (ram / node).mkdir(exist_ok=True)
            state.symlink_to(ram / node)
        for sub in ENROOT_DIRS:
            (state / sub).mkdir(parents=True, exist_ok=True)
        wrapper = root / "nodes" / node / "bin" / "enroot"
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        wrapper.write_text(node_wrapper(root, node, enroot))
        wrapper.chmod(0o755)
    generic = root / "bin" / "enroot"
    generic.parent.mkdir(exist_ok=True)
    generic.write_text(dispatcher(root, nodes))
    generic.chmod(0o755)
    plugstack = root / "plugstack.conf"
    plugstack.write_text(f"required {pyxis_so} runtime_path={root / 'pyxis'} use_enroot_load=1 "
                         "container_scope=global\n")
    return plugstack


def node_path(root: Path, node: str, path: str) -> str:
    """slurmd's PATH on `node`: its Enroot wrapper first (Pyxis finds `enroot` on it)."""
    return f"{root / 'nodes' / node / 'bin'}:{path}"


def start_registry(root: Path, port: int) -> int:
    """docker-registry on 127.0.0.1:port with its storage in root/registry; returns its PID once it answers."""
    folder = root / "registry"
    (folder / "data").mkdir(parents=True, exist_ok=True)
    config = folder / "config.yml"
    config.write_text(f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {folder / 'data'}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
""")
    log = (folder / "registry.log").open("w")
    proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"docker-registry exited with {proc.returncode}: "
                               f"{(folder / 'registry.log').read_text()[-800:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as answer:
                if answer.status == 200:
                    return proc.pid
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"docker-registry on 127.0.0.1:{port} did not answer within 30 s")


def containers(root: Path, node: str) -> list[str]:
    """`enroot list` on `node` (its containers: Pyxis's named ones are pyxis_<name>)."""
    wrapper = root / "nodes" / node / "bin" / "enroot"
    if not wrapper.exists():
        return []
    out = subprocess.run([str(wrapper), "list"], capture_output=True, text=True, timeout=60, check=False).stdout
    return out.split()


def remove_all(root: Path, nodes: list[str]) -> list[str]:
    """Remove every container of every node, then their state folders; returns what could not be removed."""
    left = []
    for node in [*nodes, "head"]:
        wrapper = root / "nodes" / node / "bin" / "enroot"
        for name in containers(root, node):
            subprocess.run([str(wrapper), "remove", "-f", name], capture_output=True, timeout=300, check=False)
        left += [f"{node}: container {name}" for name in containers(root, node)]
    mounted = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
               if line.split()[1].startswith(str(root) + "/")]
    left += [f"mount {m}" for m in mounted]
    if not left:
        ram = {(root / "nodes" / n / "enroot").resolve() for n in [*nodes, "head"]
               if (root / "nodes" / n / "enroot").is_symlink()}
        for state in ram:
            shutil.rmtree(state, ignore_errors=True)
        for base in {state.parent for state in ram}:
            with contextlib.suppress(OSError):
                base.rmdir()
        shutil.rmtree(root / "nodes", ignore_errors=True)
        shutil.rmtree(root / "registry" / "data", ignore_errors=True)
    return left
