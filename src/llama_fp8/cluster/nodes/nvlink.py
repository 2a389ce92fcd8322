"""The job's NVLink domain, decided after the preflight all-reduce from what every rank reported: its node's fabric
(``fabric.NodeFabric``, from the node check), its NCCL settings, and NCCL's own INFO lines (``nccl.parse``).

Three findings, one line ("nvlink_domain"):
- the settings that decide whether NCCL uses the domain (``fabric.SETTINGS``) differ between ranks: FAIL (NCCL
  decides per communicator from every rank's view: a mix turns it off or breaks the init);
- the nodes span more than one domain (ClusterUUID/CliqueId): WARN, traffic between the domains goes over the
  network; ``sbatch --segment`` (Slurm topology/block) keeps a job in one (docs/gb200.md);
- after the all-reduce, NCCL's "comm ... MNNVL n" line of every rank: 1 everywhere proves the domain carried the
  job's traffic between nodes; 0 on a job whose nodes all have multi-node NVLink is a FAIL that names what is
  missing (a node's fabric or IMEX, a setting that turns it off, NCCL older than 2.25.2, the first to support
  GB200 multi-node NVLink: NVIDIA Multi-Node Tuning Guide, "NVIDIA NCCL"). NCCL gives no error of its own there:
  it silently uses the network between trays (NCCL src/mnnvl.cc).
A job on nodes without multi-node NVLink gets no line unless its ranks disagree on a setting.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from llama_fp8.cluster.nodes import fabric, nccl

MIN_NCCL = (2, 25, 2)


@dataclass
class NvlinkResult:
    status: str
    message: str
    domains: dict[str, list[str]] = field(default_factory=dict)
    """Domain ("ClusterUUID/CliqueId") -> the hosts in it."""
    used: bool | None = None
    """NCCL used the domain between nodes (MNNVL 1 on every rank); None: not decided."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _hosts_by_domain(per_rank: list[dict]) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """(domain -> hosts, host -> its node's fabric report) from the ranks that checked their node."""
    nodes: dict[str, dict] = {}
    for r in per_rank:
        if r.get("fabric") is not None:
            nodes.setdefault(r["host"], r["fabric"])
    domains: dict[str, list[str]] = {}
    for host, node in nodes.items():
        for d in node.get("domains") or []:
            domains.setdefault(d, []).append(host)
    return domains, nodes


def settings_differ(per_rank: list[dict]) -> str | None:
    """"NAME=a on h1; NAME=b on h2" for the first setting the ranks do not agree on, else None."""
    for name in fabric.SETTINGS:
        seen: dict[str, list[str]] = {}
        for r in per_rank:
            value = (r.get("settings") or {}).get(name)
            seen.setdefault("unset" if value is None else value, []).append(r["host"])
        if len(seen) > 1:
            return "; ".join(f"{name}={v} on {', '.join(sorted(set(h))[:3])}" for v, h in sorted(seen.items()))
    return None


def decide(per_rank: list[dict], nets: list[nccl.NcclNet] | None) -> NvlinkResult | None:
    """The job's line (module docstring), or None when there is nothing to say about NVLink domains. ``nets``: each
    rank's parsed NCCL log (None: no NCCL, e.g. gloo on CPU, and nothing to prove)."""
    domains, nodes = _hosts_by_domain(per_rank)
    differ = settings_differ(per_rank)
    if not domains and differ is None:
        return None
    findings: list[tuple[str, str]] = []
    if differ:
        findings.append((fabric.FAIL, f"the ranks' NCCL settings differ ({differ}): every rank must have the same"))
    hosts = sorted({r["host"] for r in per_rank})
    used = None
    if domains:
        without = [h for h in hosts if h in nodes and not nodes[h].get("domains")]
        if len(domains) > 1:
            findings.append((fabric.WARN, f"the job's nodes span {len(domains)} NVLink domains ("
                             + "; ".join(f"{d}: {', '.join(h[:3])}{' ...' if len(h) > 3 else ''}"
                                         for d, h in sorted(domains.items()))
                             + "): traffic between them goes over the network; ask Slurm for one domain per "
                               "segment (sbatch --segment, topology/block: docs/gb200.md)"))
        if without:
            findings.append((fabric.FAIL, f"{', '.join(without[:4])} report no multi-node NVLink while "
                                          f"{len(hosts) - len(without)} node(s) do: NCCL then uses the domain for "
                                          "none of them"))
        if len(hosts) > 1 and nets is not None:
            status, message, used = proof(per_rank, nets, nodes)
            findings.append((status, message))
        elif len(hosts) == 1:
            findings.append((fabric.OK, f"one node in NVLink domain {next(iter(domains))}: nothing between nodes to "
                                        "prove"))
    status = fabric.worst(s for s, _ in findings)
    shown = [m for s, m in findings if s != fabric.OK] or [m for _, m in findings]
    return NvlinkResult(status, "; ".join(shown), domains, used)


def proof(per_rank: list[dict], nets: list[nccl.NcclNet], nodes: dict[str, dict]) -> tuple[str, str, bool | None]:
    """(status, line, used) from every rank's "comm ... MNNVL n" line after the all-reduce."""
    values = [n.mnnvl for n in nets]
    if any(v is None for v in values):
        missing = [i for i, v in enumerate(values) if v is None]
        version = _version(nets[missing[0]].nccl_version)
        why = (f"NCCL {nets[missing[0]].nccl_version} is older than 2.25.2, the first with GB200 multi-node NVLink"
               if version is not None and version < MIN_NCCL else "NCCL_DEBUG_SUBSYS without INIT?")
        return (fabric.WARN, f"could not tell whether NCCL used the NVLink domain: no 'comm ... MNNVL' line from "
                             f"rank(s) {missing[:8]} ({why})", None)
    if all(v == 1 for v in values):
        first = nets[0]
        channels = sum(n.p2p_mnnvl for n in nets)
        nvls = "" if first.nvls is None else f", NVLS {'available' if first.nvls else 'not available'}"
        return (fabric.OK, f"NCCL used the NVLink domain between nodes: MNNVL 1 on all {len(values)} ranks (clique "
                           f"{first.clique}, {first.clique_size} ranks in it, {channels} channel(s) via P2P/MNNVL"
                           f"{nvls})", True)
    off = [i for i, v in enumerate(values) if v != 1]
    turned_off = all((r.get("settings") or {}).get("NCCL_MNNVL_ENABLE") == "0" for r in per_rank)
    reasons = why_not(per_rank, nets, nodes)
    if turned_off:
        return (fabric.WARN, "NCCL_MNNVL_ENABLE=0: NCCL does not use the NVLink domain, traffic between nodes goes "
                             "over the network", False)
    return (fabric.FAIL, f"NCCL did not use the NVLink domain (MNNVL 0 on rank(s) {off[:8]}): traffic between nodes "
                         f"goes over the network; {'; '.join(reasons) or 'no cause found in the nodes checks'}",
            False)


def why_not(per_rank: list[dict], nets: list[nccl.NcclNet], nodes: dict[str, dict]) -> list[str]:
    """What keeps NCCL off the domain, as the ranks and their logs show it."""
    reasons = [f"{host}: {p}" for host, node in sorted(nodes.items()) for p in (node.get("problems") or [])[:1]]
    for r in per_rank:
        for status, message in fabric.settings_findings(r.get("settings") or {}, True):
            if status != fabric.OK and "keeps NCCL off" in message and f"{r['host']}: {message}" not in reasons:
                reasons.append(f"{r['host']}: {message}")
    for i, n in enumerate(nets):
        if n.fabric and (n.fabric.startswith("0.0 ") or n.fabric_state != nccl.NVML_FABRIC_COMPLETED):
            reasons.append(f"rank {i} on {per_rank[i]['host']}: NCCL read fabric UUID {n.fabric}")
            break
    version = _version(nets[0].nccl_version) if nets else None
    if version is not None and version < MIN_NCCL:
        reasons.append(f"NCCL {nets[0].nccl_version} is older than 2.25.2, the first with GB200 multi-node NVLink")
    return reasons[:4]


def _version(text: str | None) -> tuple[int, ...] | None:
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", text or "")
    return tuple(int(x) for x in m.groups()) if m else None
