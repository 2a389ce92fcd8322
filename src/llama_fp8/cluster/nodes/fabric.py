"""This node's multi-node NVLink (GB200 / GB300 NVL72: 18 nodes of 4 GPUs in one NVLink domain): what the driver
reports per GPU, the IMEX service and its channel device, and the NCCL settings that decide whether NCCL uses it.

NCCL uses the domain between nodes only when all of these hold, and otherwise sends that traffic over the network
(EFA on AWS) without an error (NCCL src/mnnvl.cc ``ncclMnnvlCheck`` and src/init.cc, NCCL 2.25 to 2.30):
- every rank's GPU reports fabric state COMPLETED and a non-zero cluster UUID (NVML ``nvmlGpuFabricInfo``; what
  ``nvidia-smi -q`` prints in each GPU's "Fabric" block as State / Status / CliqueId / ClusterUUID); ranks share a
  domain when ClusterUUID and CliqueId match (NVIDIA/nccl#1301: the clique ID alone is not unique);
- ``NCCL_MNNVL_ENABLE`` is not 0 (0 off, 1 always check, 2 the default: check when the communicator spans nodes),
  cuMem is on (``NCCL_CUMEM_ENABLE`` not 0) and P2P is not disabled (``NCCL_P2P_DISABLE``/``NCCL_P2P_LEVEL=LOC``);
- the process can allocate fabric memory, which needs an IMEX channel device (/dev/nvidia-caps-imex-channels/
  channelN; NVIDIA IMEX guide, "IMEX Channels": not created by default), and export/import it, which needs the
  ``nvidia-imex`` daemon READY (``nvidia-imex-ctl -q`` prints the state; IMEX guide, "IMEX Service Command
  Service"). Only this last step fails loudly: "MNNVL (cliqueSize N) is available but not working on this system".
``NCCL_NVLS_ENABLE`` (0 off, 1 force, 2 the default) turns NVLink SHARP off when 0.

A job's nodes are compared with each other in ``nvlink.py``; what NCCL then did is read from its log there too.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

OK, WARN, FAIL = "OK", "WARN", "FAIL"
IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels"
PROC = "/proc"  # where the nvidia-imex process is looked for (module constants: tests point them at stand-ins)
IMEX_READY = "READY"
# What decides whether NCCL uses the domain (module docstring); every rank of a job must agree on them.
SETTINGS = ("NCCL_MNNVL_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE", "NCCL_P2P_DISABLE", "NCCL_P2P_LEVEL")
_CHOICES = {"NCCL_MNNVL_ENABLE": ("0", "1", "2"), "NCCL_NVLS_ENABLE": ("0", "1", "2")}
_FIELD_RE = re.compile(r"^\s*(State|Status|CliqueId|ClusterUUID)\s*:\s*(.*?)\s*$")
_PRODUCT_RE = re.compile(r"^\s*Product Name\s*:\s*(.*?)\s*$")


@dataclass(frozen=True)
class GpuFabric:
    """One GPU's "Fabric" block of ``nvidia-smi -q``."""

    state: str
    status: str = "N/A"
    clique: str = "N/A"
    cluster: str = "N/A"
    product: str = ""
    """The GPU's "Product Name" ("NVIDIA GB200")."""

    @property
    def supported(self) -> bool:
        return self.state not in ("N/A", "Not Supported", "")

    @property
    def rack_scale(self) -> bool:
        """A Grace Blackwell GPU (GB200, GB300) with a fabric: built to be in a multi-node domain, so a zero
        ClusterUUID there is a registration that failed (e.g. Status "Insufficient Resources": Azure/azhpc-images#506),
        where on an HGX node it only means the node's own NVSwitch fabric."""
        return self.supported and bool(re.search(r"\bGB\d{3}\b", self.product))

    @property
    def registered(self) -> bool:
        return self.multi_node and self.status in ("Success", "N/A")

    @property
    def multi_node(self) -> bool:
        """Registered in a multi-node domain: NCCL's test (state COMPLETED and a non-zero cluster UUID). A single
        HGX node's NVSwitch fabric also completes, with an all-zero UUID."""
        return self.state == "Completed" and self.cluster not in ("N/A", "") and bool(self.cluster.strip("0-"))

    @property
    def domain(self) -> str:
        return f"{self.cluster}/{self.clique}"


def parse_fabric(text: str) -> list[GpuFabric]:
    """Every GPU's Fabric block in ``nvidia-smi -q`` output, in order (fields missing from a driver stay N/A)."""
    gpus: list[GpuFabric] = []
    current: dict[str, str] | None = None
    product = ""
    for line in text.splitlines():
        if (m := _PRODUCT_RE.match(line)) and current is None:
            product = m[1]
        if line.strip() == "Fabric":
            if current is not None:
                gpus.append(_fabric(current))
            current = {"Product": product}
            continue
        if current is None:
            continue
        m = _FIELD_RE.match(line)
        if m and m[1] not in current:
            current[m[1]] = m[2]
        elif line.strip() and not line.startswith(" " * 8) and not m:
            gpus.append(_fabric(current))  # the next section of the GPU (less indented): the block has ended
            current = None
    if current is not None:
        gpus.append(_fabric(current))
    return gpus


def _fabric(fields: dict[str, str]) -> GpuFabric:
    return GpuFabric(fields.get("State", "N/A"), fields.get("Status", "N/A"), fields.get("CliqueId", "N/A"),
                     fields.get("ClusterUUID", "N/A"), fields.get("Product", ""))


def query_fabric(timeout: float = 60.0) -> tuple[list[GpuFabric], str | None]:
    """(each GPU's fabric, None) from ``nvidia-smi -q``, or ([], why it could not be read)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "no nvidia-smi on PATH"
    try:
        proc = subprocess.run([smi, "-q"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi -q: {type(e).__name__}: {e}"
    if proc.returncode != 0:
        return [], f"nvidia-smi -q exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}"
    return parse_fabric(proc.stdout), None


def imex_channels(folder: str | None = None) -> list[str]:
    """The IMEX channel devices this process can see (character devices named channelN; Slurm's switch/nvidia_imex
    gives each job its own N, so any N counts)."""
    folder = folder or IMEX_CHANNELS
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        if re.fullmatch(r"channel\d+", name):
            try:
                if stat.S_ISCHR(os.stat(Path(folder, name)).st_mode):
                    found.append(name)
            except OSError:
                continue
    return found


def imex_daemon(proc: str | None = None, timeout: float = 20.0) -> tuple[str, str]:
    """(OK | WARN | FAIL, what was seen) of the nvidia-imex daemon: its own state from ``nvidia-imex-ctl -q``
    where the tool is here (on the host), else the process in /proc (an Enroot container shares the host's PID
    namespace unless ENROOT_UNSHARE_PID is set: enroot conf/enroot.conf.in)."""
    proc = proc or PROC
    ctl = shutil.which("nvidia-imex-ctl")
    if ctl:
        try:
            out = subprocess.run([ctl, "-q"], capture_output=True, text=True, timeout=timeout, check=False)
            state = (out.stdout.strip().splitlines() or [""])[-1].strip()
        except (OSError, subprocess.TimeoutExpired) as e:
            state = f"{type(e).__name__}"
        if state == IMEX_READY:
            return OK, "nvidia-imex READY"
        return FAIL, f"nvidia-imex-ctl -q says {state or 'nothing'!r}, not READY (nvidia-imex-ctl -N shows the domain)"
    pids = _processes(proc, "nvidia-imex")
    if pids:
        return OK, f"nvidia-imex running (pid {pids[0]}; nvidia-imex-ctl not here to ask its state)"
    if _process_name(proc, "1") in ("systemd", "init"):  # the host's PID namespace: the daemon would be seen
        return FAIL, "no nvidia-imex process on this node (systemctl start nvidia-imex; IMEX guide: Deployment)"
    return WARN, ("no nvidia-imex process visible: this process has its own PID namespace, so the daemon cannot be "
                  "seen from here; the all-reduce below proves whether IMEX works")


def _process_name(proc: str, pid: str) -> str:
    try:
        return Path(proc, pid, "comm").read_text().strip()
    except OSError:
        return ""


def _processes(proc: str, name: str) -> list[str]:
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return []
    return [p for p in sorted(pids, key=int) if _process_name(proc, p) == name]


def settings(env: dict[str, str] | None = None) -> dict[str, str | None]:
    """The NCCL settings of SETTINGS as this process has them (None: unset)."""
    env = dict(os.environ if env is None else env)
    return {name: env.get(name) for name in SETTINGS}


def settings_findings(values: dict[str, str | None], multi_node: bool) -> list[tuple[str, str]]:
    """(status, why) for each setting that is invalid, or that keeps NCCL off this node's NVLink domain."""
    out = []
    for name, choices in _CHOICES.items():
        if values.get(name) is not None and values[name] not in choices:
            out.append((FAIL, f"{name}={values[name]} is not valid; valid: {', '.join(choices)} (NCCL docs: "
                              "Environment Variables)"))
    if not multi_node:
        if values.get("NCCL_MNNVL_ENABLE") == "1":
            out.append((WARN, "NCCL_MNNVL_ENABLE=1 but this node's GPUs are in no multi-node NVLink domain"))
        return out
    off = {"NCCL_MNNVL_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0", "NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "LOC"}
    for name, value in off.items():
        if values.get(name) == value:
            out.append((WARN, f"{name}={value} keeps NCCL off the NVLink domain: traffic between nodes goes over "
                              "the network (unset it)"))
    if values.get("NCCL_NVLS_ENABLE") == "0":
        out.append((WARN, "NCCL_NVLS_ENABLE=0 turns NVLink SHARP off: slower all-reduce and reduce-scatter"))
    return out


@dataclass
class NodeFabric:
    """What this node reports to the job-level comparison (JSON-able: it is gathered over the job step)."""

    domains: list[str] = field(default_factory=list)
    """"ClusterUUID/CliqueId" of each multi-node GPU (empty: no multi-node NVLink)."""
    gpus: int = 0
    problems: list[str] = field(default_factory=list)
    """The node check's FAIL findings: the reasons NCCL would not use the domain from this node."""

    @property
    def multi_node(self) -> bool:
        return bool(self.domains)


def worst(statuses) -> str:
    statuses = list(statuses)
    return FAIL if FAIL in statuses else WARN if WARN in statuses else OK


def assess(gpus: list[GpuFabric], channels: list[str], daemon: tuple[str, str],
           values: dict[str, str | None]) -> tuple[str, str, NodeFabric]:
    """(status, one line, what the node reports) from its GPUs' fabric, IMEX channels, daemon and NCCL settings."""
    multi = [g for g in gpus if g.multi_node]
    expected = [g for g in gpus if g.multi_node or g.rack_scale]
    node = NodeFabric(domains=sorted({g.domain for g in multi}), gpus=len(gpus))
    findings = settings_findings(values, bool(expected))
    if not expected:
        local = [g for g in gpus if g.supported]
        what = (f"NVSwitch fabric within the node on {len(local)} GPU(s) (ClusterUUID zero)" if local and
                all(g.state == "Completed" for g in local) else f"fabric {gpus[0].state if gpus else 'N/A'}")
        findings.insert(0, (OK, f"no multi-node NVLink: {what}"))
    else:
        findings[:0] = _domain_findings(gpus, expected, node)
        if channels:
            findings.append((OK, f"IMEX channel {', '.join(channels[:2])}"))
        else:
            findings.append((FAIL, f"no IMEX channel device in {IMEX_CHANNELS}: NCCL cannot allocate fabric memory "
                                   "and stops ('MNNVL ... is available but not working'); create channel0 "
                                   "(NVreg_CreateImexChannel0=1 or mknod: IMEX guide, IMEX Channels) or give the "
                                   "container the device (Slurm switch/nvidia_imex, Pyxis --container-mounts)"))
        findings.append(daemon)
    status = worst(s for s, _ in findings)
    node.problems = [m for s, m in findings if s == FAIL]
    shown = [m for s, m in findings if s != OK] or [m for _, m in findings]
    return status, "; ".join(shown), node


def _domain_findings(gpus: list[GpuFabric], expected: list[GpuFabric], node: NodeFabric) -> list[tuple[str, str]]:
    """The node's GPUs all registered, with one domain (the line names it)."""
    pending = [f"GPU {i} State {g.state}, Status {g.status}, ClusterUUID {g.cluster}" for i, g in enumerate(gpus)
               if g in expected and not g.registered]
    if pending:
        return [(FAIL, f"{'; '.join(pending[:4])}: the NVLink fabric registration has not completed, and NCCL then "
                       "uses no NVLink domain for the whole job (nvidia-smi -q, Fabric; the Fabric Manager / NMX "
                       "partition of this tray)")]
    if len(node.domains) > 1:
        return [(FAIL, f"this node's GPUs report {len(node.domains)} NVLink domains ({', '.join(node.domains)}): a "
                       "tray belongs to one partition; reset the GPUs after a partition change")]
    return [(OK, f"multi-node NVLink: {len(expected)} GPU(s) in domain {node.domains[0]} (ClusterUUID/CliqueId)")]


def check(values: dict[str, str | None] | None = None) -> tuple[str, str, NodeFabric | None]:
    """The node check: (status, line, what the node reports; None where nvidia-smi could not be read)."""
    gpus, error = query_fabric()
    if error is not None:
        return (WARN if "no nvidia-smi" not in error else OK), f"NVLink fabric not read: {error}", None
    values = settings() if values is None else values
    multi = any(g.multi_node or g.rack_scale for g in gpus)
    channels = imex_channels() if multi else []
    daemon = imex_daemon() if multi else (OK, "")
    return assess(gpus, channels, daemon, values)
