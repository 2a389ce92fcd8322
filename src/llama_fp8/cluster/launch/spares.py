"""Spare nodes inside the allocation (``SPARE_NODES=k``): the launcher of a spare waits next to the training
nodes' rendezvous, and joins it only when a training node is gone; the job goes on at the same world size from the
latest complete checkpoint, without a requeue.

How a spare waits: its launcher is started with the others (``LLAMA_FP8_SPARE=1``, torchrun's ``--nnodes=N``, the
same rendezvous) but does not join the rendezvous: it reads torch's rendezvous state (a read, no heartbeat) and the
small registry below in the rendezvous store, once a second. It joins in two cases:

- a **ticket**: a training node that is left behind (failed ``NODE_FAILURES`` times without a new checkpoint, failed
  its health check, a worker stuck in uninterruptible sleep) takes the next spare's ticket, writes why, and leaves
  the rendezvous without closing it (``leave``): the spare whose ticket it is joins at once;
- a **node that stopped answering** (its launcher gone, its host down): torch removes a participant whose heartbeats
  stopped (``keep_alive_interval`` x ``keep_alive_max_attempt``, 15 s by default) and the restarted round cannot
  fill. A round that has started after the full one and stays short of nodes for ``JOIN_ENV`` seconds (5 s) is
  taken by the spare whose turn it is (tickets in order: one spare per missing node).

Otherwise a restart is the training nodes' own (a spare never races them for a slot), and a spare never joins a
round it was not needed in. A spare joins like any node (torch's ``next_rendezvous``), so the round it completes
has the same size; its workers resume from the latest complete checkpoint like everyone's. The rendezvous host
(the first node, whose launcher holds the store) cannot leave: a job without it is the batch script's to restart.

Registry keys (in the rendezvous store, outside torch's round prefixes): ``count`` (spares registered; each spare's
ticket number is its index), ``name/<i>``, ``taken`` (tickets handed out), ``go/<i>`` (the swap: JSON with the node
left behind, why, and when it failed), ``host`` (the node whose launcher holds the store).
"""

from __future__ import annotations

import json
import os
import time

from llama_fp8.cluster.launch import peers

PREFIX = "llama-fp8/spare/"
SPARE_ENV = "LLAMA_FP8_SPARE"
"""1 on a spare node (the batch script's node wrapper sets it)."""
JOIN_ENV = "LLAMA_FP8_SPARE_JOIN_S"
JOIN_S = 5.0
"""How long a round that started after the full one may stay short of nodes before a spare takes the place of
the one missing (torch has already waited out that node's heartbeats when the round starts without it)."""
POLL_S = 1.0
SWAPS_ENV = "LLAMA_FP8_SWAPS"
"""The swaps since the workers' previous attempt (a JSON list), for training's records (telemetry/swaps.py)."""


def is_spare(env=None) -> bool:
    return (os.environ if env is None else env).get(SPARE_ENV) == "1"


def join_after(env=None) -> float:
    text = (os.environ if env is None else env).get(JOIN_ENV, "")
    try:
        value = float(text) if text else JOIN_S
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(f"{JOIN_ENV}={text!r}: must be a number of seconds >= 0 (default {JOIN_S:g})")
    return value


def _store(handler):
    """The rendezvous' own store (torch's c10d rendezvous keeps it in the handler; None: another rendezvous)."""
    return getattr(handler, "_store", None)


def _int(store, key: str) -> int:
    return int(store.add(PREFIX + key, 0))


def _record(store, i: int) -> dict | None:
    key = PREFIX + f"go/{i}"
    if not store.check([key]):
        return None
    try:
        rec = json.loads(store.get(key).decode(errors="replace"))
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def register(handler) -> int:
    """This spare's ticket number (1-based)."""
    store = _store(handler)
    index = int(store.add(PREFIX + "count", 1))
    store.set(PREFIX + f"name/{index}", peers.node_name())
    return index


def _claim(store, index: int | None) -> int | None:
    """Take the next ticket (``index``: only if it is that one); its number, or None when none is left."""
    count = _int(store, "count")
    while True:
        taken = _int(store, "taken")
        if taken >= count or (index is not None and taken != index - 1):
            return None
        if store.compare_set(PREFIX + "taken", str(taken), str(taken + 1)).decode() == str(taken + 1):
            return taken + 1


def _hand_over(store, ticket: int, out: str | None, why: str, failed_at: float) -> dict:
    name = store.get(PREFIX + f"name/{ticket}").decode(errors="replace")
    rec = {"ticket": ticket, "in": name, "out": out, "why": why, "failed_at": failed_at}
    store.set(PREFIX + f"go/{ticket}", json.dumps(rec))
    return rec


def take(handler, node: str, why: str, failed_at: float) -> dict | None:
    """A training node that is left behind hands its place to the next spare: the swap record, or None when no
    spare is waiting (or the rendezvous is not one that has spares)."""
    store = _store(handler)
    if store is None:
        return None
    try:
        ticket = _claim(store, None)
        return None if ticket is None else _hand_over(store, ticket, node, why, failed_at)
    except Exception:  # noqa: BLE001 - a store that does not answer: no spare to count on
        return None


def mark_host(handler, node: str) -> None:
    """The node whose launcher holds the store: it cannot hand its place to a spare (the store would go with it)."""
    store = _store(handler)
    if store is not None:
        store.set(PREFIX + "host", node)


def available(handler, node: str) -> bool:
    """Whether node ``node`` leaving would be filled by a spare: one is waiting, or its ticket is already out (not
    for the node that holds the store)."""
    store = _store(handler)
    if store is None:
        return False
    try:
        if store.check([PREFIX + "host"]) and store.get(PREFIX + "host").decode(errors="replace") == node:
            return False
        taken = _int(store, "taken")
        if _int(store, "count") > taken:
            return True
        return any((_record(store, i) or {}).get("out") == node for i in range(1, taken + 1))
    except Exception:  # noqa: BLE001
        return False


def swaps(handler, seen: int) -> tuple[list[dict], int]:
    """The swap records after ticket ``seen``, and the number of tickets now out."""
    store = _store(handler)
    if store is None:
        return [], seen
    try:
        taken = _int(store, "taken")
        return [r for i in range(seen + 1, taken + 1) if (r := _record(store, i))], taken
    except Exception:  # noqa: BLE001
        return [], seen


def _view(handler):
    """torch's rendezvous state as the store has it (read only: this process is no participant)."""
    holder = handler._state_holder
    holder.sync()
    return holder.state


def standby(handler, index: int, join_s: float, clock=time.monotonic, sleep=time.sleep) -> dict | None:
    """Wait as spare ``index`` until a place is handed over (the swap record) or the rendezvous closes (None)."""
    store = _store(handler)
    size = handler.settings.max_nodes
    full_round, short_since, broken_at = None, None, None  # broken_at: when the full round first came apart
    while True:
        rec = _record(store, index)
        if rec is not None:
            return rec
        state = _view(handler)
        if state.closed:
            return None
        now = clock()
        if state.complete and len(state.participants) >= size:
            full_round, short_since, broken_at = state.round, None, None
            sleep(POLL_S)
            continue
        broken_at = now if broken_at is None else broken_at  # the others restarting: seconds after the failure
        if full_round is not None and state.round > full_round and \
                len(state.participants) + len(state.wait_list) < size:
            short_since = now if short_since is None else short_since
            if now - short_since >= join_s and _claim(store, index) == index:
                return _hand_over(store, index, None, f"a node stopped answering: round {state.round} of the "
                                  f"rendezvous stayed {size - len(state.participants)} node(s) short for "
                                  f"{now - short_since:.0f} s after torch dropped it", time.time() - (now - broken_at))
        else:
            short_since = None
        sleep(POLL_S)


def leave(handler) -> bool:
    """Leave the rendezvous without closing it (torch's launcher closes it for every node when its agent ends:
    ``launch_agent``'s ``shutdown``): this node's place is then free for a spare at once, instead of after its
    heartbeats lapse. torch has no public call for it: its own exit step of ``next_rendezvous``."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    handler.shutdown = lambda: True  # the others go on: the rendezvous stays open
    op, run = getattr(dr, "_RendezvousExitOp", None), getattr(getattr(handler, "_op_executor", None), "run", None)
    stop = getattr(handler, "_stop_heartbeats", None)
    if op is None or run is None or stop is None:
        return False  # its heartbeats lapse instead (15 s), then torch drops it
    try:
        stop()
        run(op(), time.monotonic() + 30)
        return True
    except Exception:  # noqa: BLE001 - a store that does not answer: the same lapse
        return False


def keep_open(handler) -> None:
    """A spare that was never needed ends without closing the rendezvous (it was never part of it)."""
    handler.shutdown = lambda: True
