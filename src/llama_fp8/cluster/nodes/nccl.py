"""Which network NCCL really uses, from its own INFO lines, and whether that is acceptable on this node.

NCCL picks its network at communicator init: an external net plugin (aws-ofi-nccl on EFA), else its
internal IB transport, else TCP sockets. When the plugin does not load it falls back to sockets without
an error, which on an EFA cluster means many times slower training. The only proof of what was chosen is
NCCL's log (NCCL_DEBUG=INFO); this module parses it and decides.

The lines, as NCCL and aws-ofi-nccl print them (format strings; real captured lines are in
tests/cluster/nccl_logs/ with their sources):
- NCCL src/init.cc: ``INFO(NCCL_INIT, "Using network %s", comm->ncclNet->name)``; the plugin's name is
  "Libfabric" from aws-ofi-nccl 1.13 (commit 7c014f0d), "AWS Libfabric" before it or when NCCL_NET asks for
  that name (nvidia_plugin_name_fixup); the internal ones are "IB" and "Socket"; HPC-X's SHARP plugin "IBext".
- aws-ofi-nccl src/nccl_ofi_net.cpp: ``"Initializing " PACKAGE_STRING`` and
  ``"Selected provider is %s, fabric is %s (found %d nics)"`` (1.14+; "Selected Provider is %s (found %d nics)"
  before), every message prefixed with "NET/OFI ".
- NCCL net_socket.cc ``"NET/Socket : Using%s"`` and net_ib ``"NET/IB : Using%s %s; OOB %s:%s"``.
- Multi-node NVLink (NCCL src/init.cc, src/mnnvl.cc, src/transport/p2p.cc and nvls.cc, 2.21 to 2.30):
  ``"MNNVL busId 0x%lx fabric UUID %lx.%lx cliqueId 0x%x state %d healthMask 0x%x"`` (each rank's GPU),
  ``"MNNVL %d cliqueId %x cliqueSize %d cliqueRank %d"`` (+ ``" nvlDomainSize %d"`` from 2.28) once it is on,
  ``"comm %p rank %d nRanks %d nNodes %d localRanks %d localRank %d MNNVL %d"`` (every communicator),
  ``"Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/MNNVL"`` and ``"NVLS multicast support is %savailable on dev %d"``;
  the one loud failure is the WARN ``"MNNVL (cliqueSize %d) is available but not working on this system. ..."``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

# NCCL_NET value that makes NCCL fail instead of falling back to sockets when the OFI plugin is missing.
# "AWS Libfabric" works with every plugin version: <= 1.12 reports that name, >= 1.13 reports "Libfabric" but
# renames itself to "AWS Libfabric" when NCCL_NET asks for it (aws-ofi-nccl src/nccl_ofi_interface_nvidia.cpp,
# nvidia_plugin_name_fixup). NCCL compares the names with strcasecmp (src/init.cc) and, when none matches,
# fails the communicator init ("Error: network %s not found." / "Failed to initialize any NET plugin").
OFI_NET_NAME = "AWS Libfabric"
OFI_NETWORKS = ("libfabric", "aws libfabric", "ofi")
IB_NETWORKS = ("ib", "ibext")

# Where the plugin can be; the same order as scripts/image/nccl_net_plugin.sh (tests check they agree).
OFI_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/amazon/ofi-nccl/lib/{arch}-linux-gnu", "/opt/amazon/ofi-nccl/lib64",
            "/opt/amazon/aws-ofi-nccl/lib", "/opt/aws-ofi-nccl/lib", "/opt/aws-ofi-nccl/install/lib")
NET_NAMES = ("libnccl-net-ofi.so", "libnccl-net-aws-ofi.so", "libnccl-net.so")

_PREFIX = r"NCCL INFO\s+"
_NETWORK_RE = re.compile(_PREFIX + r"Using network (?P<name>.+?)\s*$")
_PROVIDER_RE = re.compile(r"NET/OFI Selected [Pp]rovider is (?P<provider>[\w.-]+)"
                          r"(?:, fabric is (?P<fabric>[\w.-]+))?(?: \(found (?P<nics>\d+) nics\))?")
_OFI_VERSION_RE = re.compile(r"NET/OFI Initializing aws-ofi-nccl (?P<version>\S+)")
_PLUGIN_PATH_RE = re.compile(r"(?:Successfully loaded external (?:network )?plugin|Plugin Path :)\s+(?P<path>\S+)")
_NCCL_VERSION_RE = re.compile(r"NCCL version (?P<version>[\w.+-]+)")
_SOCKET_RE = re.compile(r"NET/Socket : Using (?P<ifaces>.+?)\s*$")
_IB_RE = re.compile(r"NET/IB : Using (?P<devices>.+?)(?:\s*\[RO\])?; OOB")
_PLUGIN_FAIL_RE = re.compile(r"NET/Plugin\s*:?.*(?:[Nn]o plugin found|[Cc]ould not find|returned \d|dlerror|"
                             r"version `[^']+' not found|Failed to initialize)|"
                             r"NET/OFI .*(?:initialization failed|Initializing plugin failed|No eligible providers)")
_WARN_RE = re.compile(r"NCCL WARN (?P<text>.+?)\s*$")
_COMM_RE = re.compile(r"comm 0x[0-9a-fA-F]+ rank \d+ nRanks (?P<ranks>\d+) nNodes (?P<nodes>\d+) localRanks \d+ "
                      r"localRank \d+ MNNVL (?P<mnnvl>\d+)")
_CLIQUE_RE = re.compile(r"MNNVL (?P<on>\d+) cliqueId (?P<clique>[0-9a-fA-Fx]+) cliqueSize (?P<size>\d+) "
                        r"cliqueRank \d+(?: nvlDomainSize (?P<domain>\d+))?")
_FABRIC_RE = re.compile(r"MNNVL busId 0x[0-9a-fA-F]+ fabric UUID (?P<uuid>[0-9a-fA-F]+\.[0-9a-fA-F]+) "
                        r"cliqueId (?P<clique>0x[0-9a-fA-F]+) state (?P<state>\d+)")
_NVLS_RE = re.compile(r"NVLS multicast support is (?P<not>not )?available")
NVML_FABRIC_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED (nvml.h): what NCCL requires of every rank


@dataclass
class NcclNet:
    """What one process's NCCL log says about the network."""

    network: str | None = None
    """The name in "Using network X" (the last one, if several communicators were created)."""
    provider: str | None = None
    """libfabric provider aws-ofi-nccl selected ("efa"), when the OFI plugin initialized."""
    fabric: str | None = None
    nics: int | None = None
    plugin_version: str | None = None
    plugin_path: str | None = None
    nccl_version: str | None = None
    socket_interfaces: str | None = None
    ib_devices: str | None = None
    plugin_errors: list[str] = field(default_factory=list)
    """Lines saying the net plugin did not load or initialize (the reason behind a sockets fallback)."""
    warnings: list[str] = field(default_factory=list)
    mnnvl: int | None = None
    """The "MNNVL" of the last "comm ... MNNVL n" line: 1 when NCCL uses the NVLink domain between nodes."""
    clique: str | None = None
    clique_size: int | None = None
    fabric: str | None = None
    """This rank's GPU as NCCL read it: "UUID cliqueId state n" (UUID 0.0: no multi-node NVLink)."""
    fabric_state: int | None = None
    nvls: bool | None = None
    p2p_mnnvl: int = 0
    """Channels connected "via P2P/MNNVL" (through the NVLink domain)."""
    mnnvl_errors: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """ofi | ib | socket | other | unknown."""
        name = (self.network or "").strip().lower()
        if not name:
            return "unknown"
        if name in OFI_NETWORKS or name.startswith("libfabric"):
            return "ofi"
        if name in IB_NETWORKS or name.startswith("ibext"):
            return "ib"
        if name == "socket":
            return "socket"
        return "other"

    def describe(self) -> str:
        """One line: "AWS Libfabric / efa (aws-ofi-nccl 1.17.1, 32 NICs)", "Socket (eth0:10.0.0.1)", ..."""
        if self.network is None:
            return "unknown (no 'Using network' line in NCCL's log)"
        text = self.network + (f" / {self.provider}" if self.provider else "")
        extra = [f"aws-ofi-nccl {self.plugin_version}"] if self.plugin_version else []
        if self.nics:
            extra.append(f"{self.nics} NICs")
        if self.kind == "socket" and self.socket_interfaces:
            extra.append(self.socket_interfaces)
        if self.kind == "ib" and self.ib_devices:
            extra.append(self.ib_devices)
        return text + (f" ({', '.join(extra)})" if extra else "")


def parse(text: str) -> NcclNet:
    """Parse NCCL_DEBUG=INFO output (any prefix before "NCCL INFO": host:pid:tid [dev], rank labels, timestamps)."""
    out = NcclNet()
    for line in text.splitlines():
        if m := _NETWORK_RE.search(line):
            out.network = m["name"]
        elif m := _PROVIDER_RE.search(line):
            out.provider, out.fabric = m["provider"], m["fabric"]
            out.nics = int(m["nics"]) if m["nics"] else None
        elif m := _OFI_VERSION_RE.search(line):
            out.plugin_version = m["version"]
        elif m := _PLUGIN_PATH_RE.search(line):
            out.plugin_path = m["path"]
        elif (m := _NCCL_VERSION_RE.search(line)) and out.nccl_version is None:
            out.nccl_version = m["version"]
        elif m := _SOCKET_RE.search(line):
            out.socket_interfaces = m["ifaces"]
        elif m := _IB_RE.search(line):
            out.ib_devices = m["devices"]
        _parse_mnnvl(line, out)
        if _PLUGIN_FAIL_RE.search(line):
            out.plugin_errors.append(_after_prefix(line))
        elif m := _WARN_RE.search(line):
            out.warnings.append(m["text"])
    return out


def _parse_mnnvl(line: str, out: NcclNet) -> None:
    """The multi-node NVLink lines (module docstring) into ``out``."""
    if m := _COMM_RE.search(line):
        out.mnnvl = int(m["mnnvl"])
    elif m := _CLIQUE_RE.search(line):
        out.clique, out.clique_size = m["clique"], int(m["size"])
    elif m := _FABRIC_RE.search(line):
        out.fabric, out.fabric_state = f"{m['uuid']} cliqueId {m['clique']} state {m['state']}", int(m["state"])
    elif m := _NVLS_RE.search(line):
        out.nvls = not m["not"]
    elif "via P2P/MNNVL" in line:
        out.p2p_mnnvl += 1
    if "NCCL WARN" in line and "MNNVL" in line:
        out.mnnvl_errors.append(_after_prefix(line))


def _after_prefix(line: str) -> str:
    """The message part of a log line (without "host:pid:tid [dev] NCCL INFO")."""
    for marker in ("NCCL INFO ", "NCCL WARN "):
        if marker in line:
            return line.split(marker, 1)[1].strip()
    return line.strip()


@dataclass
class Decision:
    status: str  # OK | WARN | FAIL
    message: str


def decide(net: NcclNet, efa_devices: int, nodes: int, nccl_net_env: str | None = None) -> Decision:
    """Is the network NCCL chose the right one for this node?

    - EFA devices present: only the OFI plugin (network Libfabric / AWS Libfabric) is acceptable; Socket or
      IB there is a FAIL naming why the plugin did not load (from NCCL's own lines).
    - No EFA: IB/OFI are fine; Socket is fine on one node (NVLink/shared memory carry the traffic) and a WARN
      across nodes (TCP is slow unless this cluster really has no RDMA network).
    - No "Using network" line at all: WARN (NCCL_DEBUG_FILE not honoured, or NCCL never initialized).
    """
    why = f"; NCCL said: {net.plugin_errors[0]}" if net.plugin_errors else ""
    ofi_warning = next((w for w in net.warnings if "NET/OFI" in w), None)
    if ofi_warning:
        why += f" ({ofi_warning})"
    if net.network is None:
        return Decision("WARN", "could not tell which network NCCL uses (no 'Using network' line)" + why)
    if efa_devices:
        if net.kind == "ofi":
            if net.provider and net.provider != "efa":
                return Decision("FAIL", f"{efa_devices} EFA device(s) but aws-ofi-nccl selected libfabric provider "
                                f"{net.provider!r}, not efa: set FI_PROVIDER=efa")
            return Decision("OK", f"{net.describe()}")
        hint = ("the aws-ofi-nccl plugin did not load" if net.kind == "socket" else
                f"NCCL chose {net.network!r} instead of the aws-ofi-nccl plugin")
        plugin = os.environ.get("NCCL_NET_PLUGIN", "unset")
        return Decision("FAIL", f"{efa_devices} EFA device(s) but NCCL uses {net.describe()}: {hint} "
                        f"(NCCL_NET_PLUGIN={plugin}){why}. Check the image's plugin (docs/cluster.md: Troubleshooting) "
                        f"and export NCCL_NET='{OFI_NET_NAME}' so NCCL fails instead of falling back")
    if net.kind == "socket" and nodes > 1:
        return Decision("WARN", f"NCCL uses {net.describe()} across {nodes} nodes: TCP, no RDMA network found")
    return Decision("OK", net.describe())


def find_plugin(root: str = "/", arch: str | None = None) -> str | None:
    """The OFI net plugin under ``root`` (the same search as scripts/image/nccl_net_plugin.sh), or None."""
    arch = arch or os.uname().machine
    for template in OFI_DIRS:
        folder = Path(root) / template.format(arch=arch).lstrip("/")
        for name in NET_NAMES:
            if (folder / name).exists():
                return str(folder / name)
    return None


def configured_plugin(env: dict[str, str] | None = None) -> tuple[str | None, str]:
    """(the plugin file NCCL will load, how it was found): NCCL_NET_PLUGIN when it is a path, else the search."""
    env = dict(os.environ if env is None else env)
    value = env.get("NCCL_NET_PLUGIN", "")
    if "/" in value:
        return (value if Path(value).exists() else None), f"NCCL_NET_PLUGIN={value}"
    if value.lower() == "none":
        return None, "NCCL_NET_PLUGIN=none (external plugins disabled)"
    found = find_plugin()
    how = f"NCCL_NET_PLUGIN={value} (NCCL loads libnccl-net-{value}.so)" if value else "search of the usual folders"
    return found, how
