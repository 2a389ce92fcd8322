"""What the launchers of one job tell each other through the rendezvous store (the c10d store every node's
launcher already shares for the round): each node's ranks as its launcher sees them (``publish`` / ``gather``),
a request that every rank dump its flight recorder (``ask_dump`` / ``dump_asked``), and the decision a launcher
took for the round (``decide`` / ``decision``: its line and the node the failure is charged to), which the others
repeat instead of blaming their own ranks, who failed only because they were killed or left waiting.

Keys live under the round's prefix (torch gives every rendezvous round its own), so a restart starts clean. A
store that does not answer (its host gone) makes every call here a no-op: torch's own rendezvous code reports that.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import timedelta

PREFIX = "llama-fp8/"
MAX_BYTES = 1 << 20
SUMMARY_KEYS = ("step", "phase", "time", "since", "alive", "seq", "pid", "state", "host", "fr", "dumped", "step_max_s",
                "took", "expect")


def node_name() -> str:
    """This node's name as Slurm knows it (what ``--exclude`` and ``ExcNodeList`` take), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def summary(rec: dict, state: str) -> dict:
    """The part of a rank's progress record the other launchers need, with its process state and node."""
    return {**{k: rec[k] for k in SUMMARY_KEYS if k in rec}, "state": state, "host": node_name()}


class Peers:
    def __init__(self, store, node: int, nodes: int):
        self.store, self.node, self.nodes = store, node, nodes

    def _set(self, key: str, value: str) -> None:
        try:
            self.store.set(PREFIX + key, value)
        except Exception:  # noqa: BLE001 - a lost store is torch's to report
            pass

    def _get(self, key: str) -> str | None:
        try:
            if not self.store.check([PREFIX + key]):
                return None
            value = self.store.get(PREFIX + key)
        except Exception:  # noqa: BLE001
            return None
        return value.decode(errors="replace") if len(value) <= MAX_BYTES else None

    def _json(self, key: str):
        text = self._get(key)
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None

    def publish(self, ranks: dict[int, dict]) -> None:
        self._set(f"ranks/{self.node}", json.dumps({str(r): s for r, s in ranks.items()}))

    def gather(self) -> dict[int, dict]:
        """Global rank -> summary, from every node that has published (this one's included)."""
        out: dict[int, dict] = {}
        for node in range(self.nodes):
            got = self._json(f"ranks/{node}")
            for rank, s in (got.items() if isinstance(got, dict) else ()):
                if rank.isdigit() and isinstance(s, dict):
                    out[int(rank)] = s
        return out

    def ask_dump(self) -> None:
        self._set("dump", str(self.node))

    def dump_asked(self) -> bool:
        return self._get("dump") is not None

    def decide(self, line: str, charged: str | None) -> None:
        """This node's decision for the round: its line, and the node it charges the failure to (None: none)."""
        self._set("decision", json.dumps({"node": self.node, "line": line, "charged": charged}))

    def decision(self) -> dict | None:
        got = self._json("decision")
        return got if isinstance(got, dict) and isinstance(got.get("line"), str) else None

    def names(self, wait_s: float) -> list[str] | None:
        """Every node's name in node-rank order, once each launcher has said its own (None: not every one within
        ``wait_s``; they all say it as they start their workers)."""
        self._set(f"node/{self.node}", node_name())
        keys = [PREFIX + f"node/{n}" for n in range(self.nodes)]
        try:
            self.store.wait(keys, timedelta(seconds=wait_s))
            return [self.store.get(k).decode(errors="replace")[:200] for k in keys]
        except Exception:  # noqa: BLE001 - a launcher gone meanwhile: the workers start without the list
            return None
