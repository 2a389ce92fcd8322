"""Hangs seen from the run's own pace: which rank stopped making progress, for how long its phase may last without
any, and which rank the others wait for.

The launcher looks at its workers' progress records (telemetry/heartbeat.py) at every monitor interval, not only
after a failure. A rank is **stalled** when it has made no progress (a phase, a step, a collective issued, the end
of a data wait) for longer than its phase's bound:

- a step: ``max(FACTOR x its recent step time, FLOOR_S)`` (the recent step time is the longest of its last 20
  steps, logging steps with their sync included);
- the first step of an attempt (compilation, warm-up), an evaluation, a save, start-up: ``max(FACTOR x the
  longest this job has measured for that phase, FLOOR_S)``; a save's duration is also known from the checkpoint
  the run resumed from (its manifest records it); a phase never measured in this job gets ``UNMEASURED_S``;
- a data wait: ``UNMEASURED_S`` (a Hub stream reconnecting is slow, not hung; the loader's own retries bound it);
- ``finished``: none (the rank is on its way out).

The factor is NVIDIA's resiliency extension's default safety factor on learned section timeouts (5); the floor
keeps short steps (a tiny model, a few milliseconds per step) from being called hung over a pause of the machine
(a page-cache flush, a busy host: seconds, not 15). Both and ``UNMEASURED_S`` are overridden through the
environment (``FACTOR_ENV``, ``FLOOR_ENV``, ``UNMEASURED_ENV``).

Which rank stopped first (``culprits``): a stopped process (SIGSTOP, a debugger) while others run is named first (its progress thread froze with it: its counts may be a tick stale). Otherwise, in SPMD training every
rank issues the same collectives in the same order, so the rank
the others wait for is the one that has issued fewer of them (``culprits``): behind the others in a process group
it shares with them, and ahead of nobody (a rank that waits inside a collective is ahead of the rank it waits for
in that group; in a multi-dimensional mesh a victim can also lag in another group, for it is blocked). When no rank
is behind (every rank inside the same collective: a network or NCCL failure, a kernel stuck on one GPU while the
CPUs ran ahead to the same point): with the flight recorder's entries (NCCL), a rank whose oldest
unfinished collective never started while the others' did (its GPU stuck in an earlier kernel); otherwise nobody
is named: every rank stopped at the same point (a file system that stopped answering them all, a deadlock).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from llama_fp8.telemetry import heartbeat

FACTOR, FLOOR_S, UNMEASURED_S = 5.0, 15.0, 1800.0
FACTOR_ENV, FLOOR_ENV, UNMEASURED_ENV = ("LLAMA_FP8_HANG_FACTOR", "LLAMA_FP8_HANG_FLOOR_S",
                                         "LLAMA_FP8_HANG_UNMEASURED_S")
STOPPED = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger"}
"""Process states that name a rank: a stopped process never moves again by itself. (Uninterruptible sleep is not
one: a process passes through it on every disk read; torch's own guard acts on one that stays in it.)"""
STATES = {**STOPPED, "D": "in uninterruptible sleep"}
PLACES = {"step": "in step {}", "data": "waiting for data in step {}", "eval": "evaluating step {}",
          "save": "saving step {}", "startup": "during start-up", "finished": "after training finished"}
MEASURED = {"eval": "evaluation", "save": "save", "startup": "start-up", "first_step": "first step"}


@dataclass(frozen=True)
class Bounds:
    factor: float = FACTOR
    floor_s: float = FLOOR_S
    unmeasured_s: float = UNMEASURED_S

    @classmethod
    def from_env(cls, env=None) -> Bounds:
        """The bounds with the environment's overrides; ValueError naming a variable that is not a number > 0
        (``FACTOR_ENV`` = 0 turns the hang detection off)."""
        env = os.environ if env is None else env
        values = {}
        for name, var, default in (("factor", FACTOR_ENV, FACTOR), ("floor_s", FLOOR_ENV, FLOOR_S),
                                   ("unmeasured_s", UNMEASURED_ENV, UNMEASURED_S)):
            text = env.get(var, "")
            try:
                value = float(text) if text else default
            except ValueError:
                value = -1.0
            if not value >= 0 or (value == 0 and name != "factor") or value == float("inf"):
                raise ValueError(f"{var}={text!r}: must be a number of seconds > 0 ({name}; default {default:g}"
                                 f"{'; 0 turns the hang detection off' if name == 'factor' else ''})")
            values[name] = value
        return cls(**values)

    @property
    def on(self) -> bool:
        return self.factor > 0


@dataclass
class Memory:
    """What this job has measured, across its attempts in this launcher: the longest duration of each phase."""

    longest: dict[str, float] = field(default_factory=dict)

    def learn(self, rec: dict) -> None:
        for key, value in {**(rec.get("took") if isinstance(rec.get("took"), dict) else {}),
                           "step": heartbeat.number(rec, "step_max_s")}.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
                self.longest[key] = max(self.longest.get(key, 0.0), float(value))


def bound(rec: dict, bounds: Bounds, memory: Memory) -> tuple[float | None, str]:
    """Seconds the rank of ``rec`` may go without progress in its phase, and how that was set (None: no bound)."""
    phase, f = rec.get("phase"), bounds.factor
    expect = rec.get("expect") if isinstance(rec.get("expect"), dict) else {}

    def learned(key: str, *more: float | None) -> tuple[float | None, str]:
        known = [v for v in (memory.longest.get(key), *more) if isinstance(v, (int, float)) and v > 0]
        if not known:
            return bounds.unmeasured_s, f"no {MEASURED.get(key, key)} measured yet in this job"
        took = max(known)
        return max(f * took, bounds.floor_s), f"{f:g} x the longest {MEASURED.get(key, key)} ({took:.1f} s), at " \
                                              f"least {bounds.floor_s:g} s"

    if phase == "finished":
        return None, "finished"
    if phase == "data":
        return bounds.unmeasured_s, "a data wait"
    if phase == "step":
        recent = heartbeat.number(rec, "step_max_s")
        if recent is None:  # the attempt's first step: compilation and warm-up
            return learned("first_step")
        return max(f * recent, bounds.floor_s), f"{f:g} x its recent step time ({recent:.2f} s), at least " \
                                                f"{bounds.floor_s:g} s"
    if phase in ("eval", "save"):
        took = rec.get("took") if isinstance(rec.get("took"), dict) else {}
        return learned(phase, took.get(phase), expect.get(phase))
    return learned("startup")


@dataclass(frozen=True)
class Stall:
    rank: int
    phase: str
    step: int
    still_s: float
    bound_s: float
    why: str

    def where(self) -> str:
        return PLACES.get(self.phase, "during start-up").format(self.step)


def standing(rank: int, rec: dict, now: float, bounds: Bounds, memory: Memory,
             started: float | None = None) -> Stall | None:
    """How long the rank of ``rec`` has gone without progress, and its phase's bound, past it or not (None: no
    time in the record, or no bound). ``started``: when this attempt's workers were started, the start of a
    start-up no record shows yet."""
    last = heartbeat.number(rec, "time")
    if last is None:
        return None
    if rec.get("phase") == "startup" and started is not None:
        last = max(last, started)
    limit, why = bound(rec, bounds, memory)
    if limit is None:
        return None
    step = rec.get("step") if isinstance(rec.get("step"), int) else 0
    return Stall(rank, str(rec.get("phase")), step, now - last, limit, why)


def stalls(records: dict[int, dict], now: float, bounds: Bounds, memory: Memory,
           started: float | None = None) -> list[Stall]:
    """The ranks of ``records`` without progress for longer than their phase's bound (``standing``)."""
    if not bounds.on:
        return []
    found = (standing(rank, rec, now, bounds, memory, started) for rank, rec in records.items())
    return [s for s in found if s is not None and s.still_s > s.bound_s]


def _seqs(summary: dict) -> dict[str, int]:
    seq = summary.get("seq")
    return {str(k): v for k, v in seq.items() if isinstance(v, int) and not isinstance(v, bool)} \
        if isinstance(seq, dict) else {}


def lag(ranks: dict[int, dict]) -> tuple[dict[int, int], set[int]]:
    """(rank -> how many collectives it is behind the furthest rank of a group, for ranks behind; the ranks ahead
    of another rank in some group) over the process groups two or more of ``ranks`` reported."""
    groups: dict[str, dict[int, int]] = {}
    for rank, summary in ranks.items():
        for name, n in _seqs(summary).items():
            groups.setdefault(name, {})[rank] = n
    behind: dict[int, int] = {}
    ahead: set[int] = set()
    for counts in groups.values():
        if len(counts) < 2:
            continue
        top, low = max(counts.values()), min(counts.values())
        for rank, n in counts.items():
            if n < top:
                behind[rank] = max(behind.get(rank, 0), top - n)
            if n > low:
                ahead.add(rank)
    return behind, ahead


def _never_started(ranks: dict[int, dict]) -> list[int]:
    """From the flight recorder's entries (``fr``: group -> [oldest unfinished collective, its state]): the ranks
    whose oldest unfinished collective of a group is only scheduled while another rank's same one has started."""
    started: dict[tuple[str, int], bool] = {}
    for summary in ranks.values():
        for name, entry in (summary.get("fr") or {}).items() if isinstance(summary.get("fr"), dict) else ():
            if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int):
                started[(name, entry[0])] = started.get((name, entry[0]), False) or entry[1] == "started"
    out = []
    for rank, summary in ranks.items():
        fr = summary.get("fr") if isinstance(summary.get("fr"), dict) else {}
        if any(isinstance(e, list) and len(e) == 2 and e[1] == "scheduled" and started.get((n, e[0]))
               for n, e in fr.items()):
            out.append(rank)
    return out


def culprits(ranks: dict[int, dict], stalled: set[int] | None = None) -> tuple[list[int], str]:
    """The ranks the others wait for, and how they were found: ``stopped`` (a stopped process while others run:
    its own record froze with it, up to a tick stale), ``behind`` (fewer collectives issued), ``flight recorder``
    (NCCL), ``stalled`` (the only ranks past their bound while the others still move), or ``all`` (no rank stands
    out: nobody named). ``ranks``: global rank -> summary (``seq``, ``state``, optionally ``fr``); ``stalled``: the
    ranks past their bound."""
    stopped = sorted(r for r, s in ranks.items() if s.get("state") in STOPPED)
    if stopped and len(stopped) < len(ranks):
        return stopped, "stopped"
    if len(stopped) == len(ranks):  # every process frozen: their counts froze up to a tick apart, compare nothing
        return [], "all"
    behind, ahead = lag(ranks)
    first = sorted(r for r in behind if r not in ahead)
    if first:
        return first, "behind"
    if behind:
        return sorted(behind), "behind"
    never = _never_started(ranks)
    if never and len(never) < len(ranks):
        return sorted(never), "flight recorder"
    if stalled and len(set(stalled) & set(ranks)) < len(ranks):
        return sorted(set(stalled) & set(ranks)), "stalled"
    return [], "all"


def describe(rank: int, summary: dict, behind: int | None, stall: Stall | None) -> str:
    """``rank 1 (n2, pid 123): stopped (SIGSTOP) in step 5, 2 collective(s) behind the others, no progress for
    16 s (bound 15 s: ...)``."""
    where = f"{summary.get('host', '?')}, pid {summary.get('pid', '?')}"
    how = STATES.get(summary.get("state"), "")
    place = stall.where() if stall else PLACES.get(summary.get("phase"), "during start-up").format(summary.get("step"))
    parts = [f"rank {rank} ({where}): {how + ' ' if how else ''}{place}"]
    if behind:
        parts.append(f"{behind} collective(s) behind the others")
    if stall is not None:
        parts.append(f"no progress for {stall.still_s:.0f} s (bound {stall.bound_s:.0f} s: {stall.why})")
    return ", ".join(parts)
