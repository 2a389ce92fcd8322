"""Restarts inside the allocation: torchrun's own elastic agent, with the decisions a training job needs.

torchrun (``torch.distributed.run``) already restarts the workers of every node when one fails, in a new
rendezvous round (``SimpleElasticAgent._invoke_run``). ``JobAgent`` is its ``LocalElasticAgent`` with these
decisions changed through the attributes and methods torch itself uses for them:

- **Hangs are seen from the run's own pace**, at every monitor interval (``watchdog.py``): a rank without progress
  for longer than its phase's bound is named with the rank the others wait for, the flight recorder of every rank
  is dumped first where it is on (bounded: ``DUMP_WAIT_S``), and the workers are killed and restarted as for a
  crash. The collective timeouts stay as the backstop.
- **The restart budget counts restarts without progress**, for the whole job: ``--max_restarts`` failures in a row
  without a new complete checkpoint between them end the job; a job that keeps advancing keeps going. Every
  restart is one new round of the shared rendezvous (torch counts per agent, pytorch/pytorch#147064).
- **Deterministic failures are not restarted**: exit 2 (bad config or data), 3 (non-finite loss), 85
  (checkpoint saved after SIGUSR1/SIGTERM: the batch script requeues), or the same step failing in two attempts
  in a row. A start-up failing twice in a row is the machine's more often than the code's: requeued.
- **A bad node is left behind**: each failure is charged to the node it happened on (the rank that failed first,
  or the rank the others waited for; not its victims); a node charged ``decide.NODE_FAILURES`` times without a new
  complete checkpoint between the failures, failing its health check (``health.py``) before a restart, or holding a
  worker in uninterruptible sleep, hands its place to a spare node of the allocation where one waits (``spares.py``:
  it leaves the rendezvous, the spare joins, no requeue); without a spare it ends the step with ``retry`` and the
  node named, and the batch script leaves it behind only where the job can run without it (``job_nodes.sh``).
- **A failure after training finished is not a failure**: a rank that dies after reporting ``finished`` ends the
  job as done, where torch would restart it while the other nodes wait 300 s in its exit barrier.
- **SIGUSR1/SIGTERM stop restarts**: a time limit or a preemption. The workers save and exit 85 (each awaited).
- **A failed attempt is killed at once**: torch sends SIGTERM and waits 30 s; our workers read SIGTERM as "save a
  checkpoint", which a broken attempt cannot do, and a stopped rank never handles it: they get SIGKILL.

Each decision is one line on stderr (``llama-fp8 launch: ...``) saying what happened and what comes next; with
``LLAMA_FP8_OUTCOME_DIR`` set (the batch scripts) the final one is also written there (``outcome.py``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import time

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from llama_fp8.cluster.launch import decide, health, peers, progress, spares, watchdog
from llama_fp8.cluster.launch.hangs import HangWatch
from llama_fp8.cluster.launch.outcome import NOT_RESTARTED, JobStop, exit_text, say
from llama_fp8.cluster.launch.torch_checks import check_torch, internals, rendezvous_round  # noqa: F401
from llama_fp8.errors import EXIT_BAD_CONFIG, EXIT_REQUEUE
from llama_fp8.telemetry import heartbeat

SAVED_ENV = "LLAMA_FP8_SAVED_CHECKPOINT"
"""checkpoint/resume.py TRUSTED_ENV: the latest checkpoint this job's workers saved, for a restart in the allocation."""
ATTEMPT_ENV = "LLAMA_FP8_ATTEMPT"
"""The workers' attempt in this launch: the rendezvous round (0 first; telemetry/goodput.py reads it)."""
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
KILL_WAIT_S = 5.0
"""How long a SIGKILLed worker is waited for (it exits in milliseconds unless stuck in uninterruptible sleep)."""
FINISH_WAIT_S = 60.0
"""How long the other local ranks may take to close their records after a rank that had finished training died."""
NODES_ENV = "LLAMA_FP8_NODES"
"""The attempt's training nodes, in node-rank order (telemetry/environment.py: the hardware the run ran on)."""
NODES_WAIT_S = 30.0
"""How long a launcher waits for the others to say which node they are, before starting its workers without it."""


class JobAgent(LocalElasticAgent):
    """torch's LocalElasticAgent with hang detection, a job-wide budget of restarts without progress, no restart
    after a deterministic failure or a stop signal, bad nodes left behind, SIGKILL for a failed attempt, and one
    line per decision (module docstring)."""

    signalled: signal.Signals | None = None  # set by the launcher's signal handler (on_signal)
    last: JobAgent | None = None  # the agent of this process, for the launcher's exit code
    is_host = False  # this launcher holds the rendezvous store (is_host): it cannot leave it to a spare

    def __init__(self, *args, **kwargs):
        try:
            bounds = watchdog.Bounds.from_env()
            self.spare_wait_s = spares.join_after() if spares.is_spare() else None
        except ValueError as e:
            raise JobStop(EXIT_BAD_CONFIG, "fail", f"{e}; not starting the workers") from None
        super().__init__(*args, **kwargs)
        JobAgent.last = self
        _quiet_after_a_stop(self._worker_group.spec.rdzv_handler)
        self.progress_dir = progress.folder()
        self.watch = HangWatch(self, bounds)
        self.failed_at: dict[int, tuple] = {}  # rendezvous round -> where that attempt failed on this node
        self.decision: JobStop | None = None  # why this agent stopped (None: success or torch's own stop)
        self.killed: set[int] = set()  # pids this agent killed (their -9 is not a failure of their own)
        self.forwarded: set[int] = set()  # pids a stop signal was passed on to
        self.seen_exit: dict[int, float] = {}  # pid -> when this agent first saw it exited (monotonic)
        self.checkpoint: int | None = None  # the latest complete checkpoint a local worker reported
        self.ckpt_at: dict[int, int | None] = {}  # round -> the latest complete checkpoint when it failed
        self.charges: dict[int, str] = {}  # round -> the node its failure was charged to
        self.exclude: list[str] = []  # nodes to leave behind at once (a failed health check)
        self.restarts = 0  # restarts this agent went through (a static rendezvous has no rounds)
        self.gpus_at_start: int | None = None
        self.first_round: int | None = None  # the round this agent's workers first started in (a spare: later)
        self.swaps_seen = 0  # spare tickets this agent has passed on to its workers

    # --- where things stand ---------------------------------------------------------------------------------
    def _round(self) -> int:
        value = rendezvous_round(self._worker_group.spec.rdzv_handler)
        if value is not None:
            return value
        if isinstance(self._worker_group.spec.rdzv_handler, DynamicRendezvousHandler):  # it has rounds: moved
            raise internals("rendezvous round in DynamicRendezvousHandler._state_holder.state.round")
        return self.restarts  # a static rendezvous: this agent's own count

    def _procs(self) -> dict[int, object]:
        """local rank -> Popen of the running attempt ({} when torch keeps them otherwise)."""
        handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", None) or {}
        return {lr: h.proc for lr, h in handlers.items() if hasattr(h, "proc")}

    def ranked_procs(self) -> dict[int, object]:
        """Global rank -> Popen of the running attempt."""
        return {self._worker_group.workers[lr].global_rank: proc for lr, proc in self._procs().items()}

    def _check_workers(self) -> None:
        """Every started worker visible as a process (SIGKILL, naming and signal forwarding need them)."""
        if len(self._procs()) != self._worker_group.spec.local_world_size:
            self._pcontext.close(signal.SIGKILL, 5)
            raise internals("worker processes in _pcontext.subprocess_handlers[local_rank].proc")

    def progress(self) -> dict[int, dict]:
        """The local workers' progress records; keeps the latest complete checkpoint any of them reported and
        what they measured (the hang bounds learn from it)."""
        recs = heartbeat.read(self.progress_dir)
        for rec in recs.values():
            ckpt = rec.get("ckpt")
            if isinstance(ckpt, int) and not isinstance(ckpt, bool) and ckpt > (self.checkpoint or -1):
                self.checkpoint = ckpt
            self.watch.memory.learn(rec)
        return recs

    def _describe_stuck(self) -> list[str]:
        """The local ranks that stopped moving while another worker failed (progress.stuck_ranks): past their
        phase's bound, with the default factor when the hang detection itself is off."""
        bounds = self.watch.bounds if self.watch.bounds.on else dataclasses.replace(self.watch.bounds,
                                                                                    factor=watchdog.FACTOR)
        return progress.stuck_ranks(self.ranked_procs(), self.progress(), time.time(), bounds, self.watch.memory)

    def _first(self, failures: dict, recs: dict) -> tuple:
        """The failure that came first: the one this agent saw first (torch's timestamps are whole seconds), among
        those seen at the same look one that is not a peer's (a rank that failed because another did), a death by
        a signal (a peer's exit 1 is often the consequence), then rank."""
        if not failures:
            return None, None
        return min(failures.items(), key=lambda kv: (
            self.seen_exit.get(kv[1].pid, math.inf), progress.error_of(recs.get(kv[0], {}))[0] == "peer",
            kv[1].exitcode >= 0, kv[1].timestamp, kv[0]))

    # --- torch's extension points ------------------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup):
        if JobAgent.signalled is not None:  # no new attempt after a time-limit or preemption signal
            raise JobStop(EXIT_REQUEUE, "retry", f"{JobAgent.signalled.name} arrived during a restart: no new "
                          "checkpoint to save; exit 85 so that the job is requeued and resumes from the latest "
                          "complete checkpoint")
        attempt = self._round()
        self.progress()  # the previous attempt's last word on checkpoints, before its files go
        for old in [*self.progress_dir.glob("rank*"), self.progress_dir / heartbeat.DUMP_REQUEST]:
            old.unlink(missing_ok=True)
        if self.gpus_at_start is None:
            self.gpus_at_start = health.gpu_count()
        os.environ[heartbeat.ENV] = str(self.progress_dir)  # the workers inherit the agent's environment
        os.environ[ATTEMPT_ENV] = str(attempt)
        # The checkpoint this job saved: resumed with one verified read, unless the previous attempt failed in its
        # start-up (a load of it that failed: then it is checked in full, with the fallback to an older one).
        trust = self.checkpoint is not None and attempt > 0 and self.failed_at.get(attempt - 1, ("",))[0] != "startup"
        os.environ[SAVED_ENV] = str(self.checkpoint) if trust else ""
        self.killed.clear()
        self.forwarded.clear()
        self.seen_exit.clear()
        self.watch.new_attempt(worker_group)
        if self.first_round is None:
            self.first_round = attempt
            if JobAgent.is_host:
                spares.mark_host(worker_group.spec.rdzv_handler, peers.node_name())
        self._tell_workers()
        pids = super()._start_workers(worker_group)
        self._check_workers()
        if JobAgent.signalled is not None:  # it arrived while they started, before on_signal could see them
            self.forward(JobAgent.signalled)
        return pids

    def _tell_workers(self) -> None:
        """What the workers record about this attempt: its training nodes (the hardware a run ran on) and the swaps
        to a spare since their previous attempt."""
        names = self.watch.peers.names(NODES_WAIT_S) if self.watch.peers else None
        os.environ[NODES_ENV] = ",".join(names) if names else ""
        new, self.swaps_seen = spares.swaps(self._worker_group.spec.rdzv_handler, self.swaps_seen)
        os.environ[spares.SWAPS_ENV] = json.dumps(new) if new else ""

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        if self.spare_wait_s is not None and self.first_round is None:
            self._stand_by()
        super()._rendezvous(worker_group)

    def _stand_by(self) -> None:
        """A spare node: wait until a training node's place is handed over, then join (spares.py); JobStop (0,
        ``spare``) when the job ended without needing it."""
        handler = self._worker_group.spec.rdzv_handler
        if not isinstance(handler, DynamicRendezvousHandler):
            raise JobStop(EXIT_BAD_CONFIG, "fail", "a spare node needs torch's c10d rendezvous (--rdzv_backend=c10d)")
        node = peers.node_name()
        index = spares.register(handler)
        say(f"node {node}: a spare (number {index}); it passed the same preflight as the training nodes and waits "
            f"outside the rendezvous until a training node is left behind or stops answering")
        try:
            rec = spares.standby(handler, index, self.spare_wait_s)
        except (RuntimeError, OSError, RendezvousError) as e:  # torch's DistNetworkError is a RuntimeError
            # The store's host (the first node's launcher) ended: at the end of the training step as a rule, or with
            # its node; either way this spare cannot join, and the training nodes' own outcomes decide the job.
            # Before, the spare ended 86 ("lost the rendezvous store") after every job that did not need it.
            spares.keep_open(handler)
            raise JobStop(0, "spare", f"node {node}: a spare, not used: the rendezvous store went away while it "
                          f"waited ({type(e).__name__}: its host's launcher ended, with the training step or its "
                          "node; the training nodes' outcomes decide the job)") from None
        if rec is None:
            spares.keep_open(handler)
            raise JobStop(0, "spare", f"node {node}: a spare, not needed: the job's rendezvous closed (the training "
                          "step ended) while it waited")
        out = f"the place of {rec['out']}" if rec.get("out") else "a place"
        say(f"node {node}: a spare, takes {out} ({rec['why']}): joining the rendezvous; its workers resume from the "
            f"latest complete checkpoint with the others, at the same world size (no requeue)")

    def leave(self, line: str, exclude: str) -> bool:
        """Hand this node's place to a spare and leave the rendezvous without closing it (spares.py): True when a
        spare took it (the decision is then ``left``, code 0: nothing of the job failed), False when none waits or
        this node holds the rendezvous store."""
        handler = self._worker_group.spec.rdzv_handler
        if JobAgent.is_host:
            return False
        rec = spares.take(handler, exclude, line, time.time())
        if rec is None:
            return False
        self.kill_running()
        self.exclude.append(exclude)
        self._remaining_restarts = 0
        self.decision = JobStop(0, "left", f"{line}; left behind: spare {rec['in']} takes its place at the next "
                                "rendezvous (no requeue), this node's launcher ends")
        say(self.decision.line)
        spares.leave(handler)
        return True

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self.kill_running()
        super()._stop_workers(worker_group)  # torch's bookkeeping (watchdog, health check); nothing left to signal

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, *rest, **named) -> None:
        # torch's run() ends with this, SIGTERM and 30 s, also when the rendezvous is lost: a save that cannot
        # complete without the lost ranks. Only a stop signal (the workers save) or torch's own signal path
        # (SIGINT/SIGHUP/QUIT, passed on as such) keep torch's grace. What else torch passes goes on as it came:
        # torch 2.13 adds a timeout, torch 2.11 takes none.
        if death_sig == signal.SIGTERM and JobAgent.signalled is None:
            self.kill_running()
        super()._shutdown(death_sig, *rest, **named)

    def _finished(self, local_ranks: list[int]) -> bool:
        """Whether these local ranks had reported the `finished` phase (the run's last checkpoint complete)."""
        recs = self.progress()
        workers = self._worker_group.workers
        return all(recs.get(workers[lr].global_rank, {}).get("phase") == "finished" for lr in local_ranks)

    def _wait_running(self, seconds: float, procs: list | None = None) -> None:
        """Reap the workers that end within ``seconds`` (all of them together)."""
        deadline = time.monotonic() + seconds
        for proc in self._procs().values() if procs is None else procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass

    def kill_running(self) -> None:
        running = [p for p in self._procs().values() if p.poll() is None]
        for proc in running:
            self.killed.add(proc.pid)
            try:  # the worker leads its own process group (torch starts it in a new session)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        # Reap them (milliseconds) before torch looks: one it finds alive gets its SIGTERM and a wait. A process in
        # uninterruptible sleep does not die of SIGKILL: after KILL_WAIT_S it is left to torch's own close.
        self._wait_running(KILL_WAIT_S, running)

    def forward(self, sig: signal.Signals) -> None:
        """Pass a stop signal on to the running workers, once each."""
        for proc in self._procs().values():
            if proc.poll() is None and proc.pid not in self.forwarded:
                self.forwarded.add(proc.pid)
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        decide.check_before_restart(self, worker_group, health.problem(self.gpus_at_start))
        rnd = self._round()
        self.ckpt_at.setdefault(rnd, self.checkpoint)
        theirs = self.watch.peers.decision() if self.watch.peers else None
        if theirs and theirs.get("charged") and rnd not in self.charges:
            self.charges[rnd] = str(theirs["charged"])
        if worker_group.state == WorkerState.HEALTHY:  # another node failed and waits in the next round
            stuck = self._describe_stuck()
            said = f" ({theirs['line'][:300]})" if theirs and theirs.get("node") != worker_group.group_rank else ""
            say(f"node {worker_group.group_rank} ({peers.node_name()}): another node's workers failed and are "
                f"restarting{said}; restarting this node's workers with them" + (f" ({'; '.join(stuck)})"
                                                                                 if stuck else ""))
        self.restarts += 1
        super()._restart_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        crashed, codes = self._crashed(), [p.poll() for p in self._procs().values()]
        if JobAgent.signalled is not None and None in codes and any(codes) and not crashed:
            # After a stop signal each worker saves and exits by itself; torch's poll below would close the others
            # (SIGTERM) on the first exit it sees, a saved 85, and a NaN's 3 on its way would be lost (the job
            # requeued into it). Bounded; not after a crash (the others may wait in a collective for the dead rank).
            self._wait_running(FINISH_WAIT_S)
            self._crashed()  # the exit times of those that ended while we waited
        if not crashed and JobAgent.signalled is None:
            self.watch.look()  # a hang: named, dumped, killed (then torch sees the workers failed)
            if self.watch.hang is None:
                # Torch's poll below closes every worker (SIGTERM) on the first failure it sees: a worker that died
                # while the watch looked is seen here first, or a finished run's other ranks lose their last records.
                crashed = self._crashed()
        stuck: list[str] = []
        if crashed and JobAgent.signalled is None:
            if self._finished(crashed):
                # Training is over (the final checkpoint is complete): the others are closing their metrics and
                # goodput records, nothing is lost by letting them end by themselves (bounded).
                self._wait_running(FINISH_WAIT_S)
            else:
                # A crash: the others' work since the last checkpoint is lost either way; don't give them torch's
                # SIGTERM (our workers would try to save) and 30 s, and see first which of them stopped moving.
                stuck = self._describe_stuck()
                self.kill_running()
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return decide.decide(self, worker_group, result, stuck, JobAgent.signalled)
        return result

    def _crashed(self) -> list[int]:
        """The local ranks that died of a crash (not 0, not a code that is not restarted); each exit's time noted."""
        now = time.monotonic()
        for proc in self._procs().values():
            if proc.pid not in self.seen_exit and proc.poll() is not None:
                self.seen_exit[proc.pid] = now
        return [lr for lr, p in self._procs().items() if p.poll() not in (None, 0, *NOT_RESTARTED)]

    def stop(self, code: int, action: str, line: str) -> None:
        self._remaining_restarts = 0
        self.decision = JobStop(code, action, line)
        say(line)

    def latest_checkpoint(self) -> int | None:
        self.progress()
        return self.checkpoint

    def failures(self) -> list[str]:
        """The failures of this training step charged to a node, as ``node@round:checkpoint`` (the outcome's FAILED;
        the latest complete checkpoint when it failed, ``-``: none yet): the batch script counts a node's failures
        without a new checkpoint between them across requeues, as the launcher does within a step."""
        return [f"{host}@{rnd}:{'-' if self.ckpt_at.get(rnd) is None else self.ckpt_at[rnd]}"
                for rnd, host in sorted(self.charges.items())]


def _quiet_after_a_stop(handler) -> None:
    """torch's agent asks the rendezvous store, while its workers run, whether nodes wait to join (to restart them
    with the newcomers). After a stop signal no restart follows: the workers save and exit 85. The first node's
    launcher, which holds the store, may by then have ended with its own workers, and the question would lose the
    store and make this node's requeue a lost host (exit 86, a requeue charged to MAX_REQUEUES). So none is said to
    wait once the signal is in."""
    asked = handler.num_nodes_waiting

    def num_nodes_waiting() -> int:
        return 0 if JobAgent.signalled is not None else asked()

    handler.num_nodes_waiting = num_nodes_waiting


def on_signal(signum, frame) -> None:
    """SIGUSR1/SIGTERM to the launcher: a time limit or preemption. Slurm signals the workers too (every
    process of the step); they save a checkpoint and exit 85. Passed on to the workers once, for a signal
    sent to the launcher alone (also to workers that were starting: ``_start_workers``); the launcher itself
    outlives them to report their exit code."""
    first = JobAgent.signalled is None
    JobAgent.signalled = JobAgent.signalled or signal.Signals(signum)
    if not first:
        return
    say(f"received {signal.Signals(signum).name}: the workers save a checkpoint and exit 85; no restart after this")
    if JobAgent.last is not None:
        JobAgent.last.forward(JobAgent.signalled)


__all__ = ["ATTEMPT_ENV", "STOP_SIGNALS", "JobAgent", "JobStop", "check_torch", "exit_text",
           "internals", "on_signal"]
