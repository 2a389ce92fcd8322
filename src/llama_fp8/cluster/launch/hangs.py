"""The launcher's hang watch (``JobAgent._monitor_workers`` calls ``look`` at every monitor interval): its local
ranks' progress shared with the other launchers (peers.py), a stall found against its phase's bound (watchdog.py),
the flight recorder of every rank dumped before the kill (bounded), the rank the others wait for named and the
failure charged to its node, then the workers killed: torch sees them failed, and the decision goes on as for a
crash (decide.py)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from llama_fp8.cluster.launch import peers, progress, watchdog
from llama_fp8.cluster.launch.outcome import say
from llama_fp8.telemetry import heartbeat

PUBLISH_S = 1.0
"""How often a launcher shares its ranks' progress with the others (and looks for a dump request)."""
DUMP_WAIT_S = 15.0
"""How long the launcher waits for every rank's flight-recorder dump before the kill (ranks that cannot answer,
stopped or not heard from, are not waited for)."""


def flight_recorder_on() -> bool:
    try:
        return int(os.environ.get("TORCH_FR_BUFFER_SIZE") or 0) > 0
    except ValueError:
        return False


@dataclass(frozen=True)
class Hang:
    line: str
    charged: str | None  # the node the hang is charged to (None: nobody stands out)
    point: tuple  # ("step", N) or ("startup", None): where the attempt stopped


class HangWatch:
    def __init__(self, agent, bounds: watchdog.Bounds):
        self.agent, self.bounds, self.memory = agent, bounds, watchdog.Memory()
        self.peers: peers.Peers | None = None
        self.hang: Hang | None = None
        self.started: float | None = None
        self._published = 0.0
        self._dump_touched = False

    def new_attempt(self, worker_group) -> None:
        self.hang, self.started, self._dump_touched = None, time.time(), False
        store = getattr(worker_group, "store", None)
        self.peers = None if store is None else peers.Peers(store, worker_group.group_rank,
                                                            worker_group.group_world_size)

    def _local(self) -> tuple[dict[int, dict], dict[int, dict]]:
        """(records, summaries) of the running local ranks; a rank without a record yet is in start-up."""
        recs = self.agent.progress()
        out_recs, out_sums = {}, {}
        for rank, proc in self.agent.ranked_procs().items():
            if proc.poll() is not None:
                continue
            rec = recs.get(rank) or {"rank": rank, "step": 0, "phase": "startup", "time": self.started or time.time(),
                                     "pid": proc.pid}
            out_recs[rank] = rec
            out_sums[rank] = {**peers.summary(rec, progress.proc_state(proc.pid)), "pid": proc.pid}
        return out_recs, out_sums

    def _share(self, summaries: dict[int, dict], force: bool = False) -> None:
        now = time.monotonic()
        if self.peers is None or (not force and now - self._published < PUBLISH_S):
            return
        self._published = now
        self.peers.publish(summaries)
        if self.peers.dump_asked():
            self._touch_dump()

    def _touch_dump(self) -> None:
        if not self._dump_touched:
            self._dump_touched = True
            (self.agent.progress_dir / heartbeat.DUMP_REQUEST).touch()

    def look(self) -> None:
        if not self.bounds.on or self.hang is not None:
            return
        recs, summaries = self._local()
        self._share(summaries)
        stalled = watchdog.stalls(recs, time.time(), self.bounds, self.memory, self.started)
        if stalled:
            self._decide(stalled)

    def _everyone(self, wait: float = 0.0) -> dict[int, dict]:
        """Every rank's summary: the other nodes' as they published them (waiting up to ``wait`` seconds for a node
        that has not published yet), this node's as they are now."""
        deadline = time.monotonic() + wait
        workers = getattr(self.agent._worker_group, "workers", None) or []
        world = workers[0].world_size if workers else 0
        while True:
            _, mine = self._local()
            self._share(mine, force=True)
            got = {**(self.peers.gather() if self.peers else {}), **mine}
            if len(got) >= world or time.monotonic() >= deadline:
                return got
            time.sleep(0.2)

    def _dump(self) -> str:
        """Ask every rank to dump its flight recorder and wait, at most DUMP_WAIT_S, for those that can answer."""
        self._touch_dump()
        if self.peers:
            self.peers.ask_dump()
        t0 = deadline = time.monotonic()
        deadline += DUMP_WAIT_S
        ranks = self._everyone()
        while time.monotonic() < deadline:
            ranks = self._everyone()
            waiting = [r for r, s in ranks.items() if not s.get("dumped") and s.get("state") not in watchdog.STOPPED
                       and time.time() - (heartbeat.number(s, "alive") or 0) < 4 * heartbeat.TICK_S]
            if not waiting:
                break
            time.sleep(0.2)
        done = sorted(r for r, s in ranks.items() if s.get("dumped") not in (None, "none"))
        return f"flight recorder dumped by {len(done)} of {len(ranks)} rank(s) in {time.monotonic() - t0:.1f} s"

    def _decide(self, stalled: list[watchdog.Stall]) -> None:
        dumped = self._dump() if flight_recorder_on() else None
        ranks = self._everyone(wait=2 * PUBLISH_S)
        late = watchdog.stalls(ranks, time.time(), self.bounds, self.memory, self.started)
        by_rank = {s.rank: s for s in [*late, *stalled]}
        names, how = watchdog.culprits(ranks, set(by_rank))
        behind, _ = watchdog.lag(ranks)
        step = max(s.step for s in stalled)
        point = ("step", step) if any(s.phase in ("step", "data", "eval", "save") for s in stalled) else \
            ("startup", None)
        if names:
            others = sorted(set(ranks) - set(names))
            # a rank named by its state (stopped) may not have passed its own bound yet (the rank waiting for it
            # can pass its bound a tick sooner): its line still tells how long it has gone without progress
            now = time.time()
            told = "; ".join(watchdog.describe(r, ranks[r], behind.get(r), by_rank.get(r) or watchdog.standing(
                r, ranks[r], now, self.bounds, self.memory, self.started)) for r in names)
            line = (f"a hang: {told}" + (f"; rank(s) {', '.join(map(str, others))} wait for it" if others else "")
                    + f" (named: {how})")
            hosts = {ranks[r].get("host") for r in names}
            charged = hosts.pop() if len(hosts) == 1 else None
        else:
            first = stalled[0]
            line = (f"a hang: every rank stopped moving at the same point ({len(ranks)} rank(s), e.g. "
                    f"{watchdog.describe(first.rank, ranks.get(first.rank, {}), None, first)}); none is behind the "
                    f"others: a stall outside the collectives (a file system that stopped answering, a deadlock) or "
                    f"a failure of the network")
            charged = None
        if dumped:
            line += f"; {dumped}"
        self.hang = Hang(line, charged, point)
        node = getattr(self.agent._worker_group, "group_rank", 0)
        if self.peers:
            self.peers.decide(f"node {node}: {line}", charged)
        say(f"node {node} ({peers.node_name()}): {line}; killing the workers (SIGKILL)")
        self.agent.kill_running()
