"""Restarts inside the allocation: torchrun's own elastic agent, with the decisions a training job needs.

torchrun (``torch.distributed.run``) already restarts the workers of every node when one fails, in a new
rendezvous round (``SimpleElasticAgent._invoke_run``). ``JobAgent`` is its ``LocalElasticAgent`` with these
decisions changed through the attributes and methods torch itself uses for them:

- **The restart budget is the job's**: torch counts restarts per agent (a failure on node B decrements only B's
  count, pytorch/pytorch#147064). Every restart is one new round of the shared rendezvous, so the round number
  is the job-wide count: on a failure ``_remaining_restarts`` becomes ``max_restarts - round``.
- **Deterministic failures are not restarted**: exit 2 (bad config or data), 3 (non-finite loss), 85
  (checkpoint saved after SIGUSR1/SIGTERM: the batch script requeues), or the same step failing in two attempts
  in a row. ``_remaining_restarts = 0`` sends ``_invoke_run`` to its stop branch, as torch does for a worker
  stuck in uninterruptible sleep (whose 0 is kept: no restart onto a device the stuck process holds). A
  start-up failing twice in a row is the machine's more often than the code's (a GPU that does not initialize):
  not restarted in place, but requeued.
- **A failure after training finished is not a failure**: every rank writes ``finished`` once the final
  checkpoint is complete; a rank that dies after that (a segfault in teardown) ends the job as done, where
  torch would restart it while the other nodes wait 300 s in its exit barrier.
- **SIGUSR1/SIGTERM stop restarts**: they mean a time limit or a preemption. The workers save and exit 85;
  a worker that was still starting dies of the signal, and the job exits 85 all the same (the latest complete
  checkpoint is the resume point). Workers are never started after such a signal.
- **A failed attempt is killed at once**: torch sends SIGTERM and waits 30 s (hard-coded for a restart, and when
  the rendezvous is lost) before SIGKILL. Our workers read SIGTERM as "save a checkpoint", which a broken attempt
  cannot do, and a stopped rank never handles it; a restart resumes from the latest complete checkpoint, so the
  workers get SIGKILL.

Each decision is one line on stderr (``llama-fp8 launch: ...``) saying what happened and what comes next; with
``LLAMA_FP8_OUTCOME_DIR`` set (the batch scripts) the final one is also written there (``outcome.py``) for the batch script,
which requeues or not (``job_lib.sh`` ``lf_train``). The torch internals used here are checked before any worker
starts (``check_torch``, ``_round``, ``_check_workers``): without them the launcher stops with exit 2.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import time

import torch
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from llama_fp8.cluster.launch import progress
from llama_fp8.cluster.launch.outcome import say
from llama_fp8.errors import EXIT_BAD_CONFIG, EXIT_NONFINITE, EXIT_REQUEUE
from llama_fp8.telemetry import heartbeat

ATTEMPT_ENV = "LLAMA_FP8_ATTEMPT"
"""The workers' attempt in this launch: the rendezvous round (0 first; telemetry/goodput.py reads it)."""
NOT_RESTARTED = {EXIT_BAD_CONFIG: "a bad flag, config or data file", EXIT_NONFINITE: "a non-finite loss",
                 EXIT_REQUEUE: "a checkpoint saved after SIGUSR1/SIGTERM"}
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
KILL_WAIT_S = 5.0
"""How long a SIGKILLed worker is waited for (it exits in milliseconds unless stuck in uninterruptible sleep)."""
FINISH_WAIT_S = 60.0
"""How long the other local ranks may take to close their records after a rank that had finished training died."""


class JobStop(Exception):
    """The job ends here with ``code`` (raised where torch offers no return path: before workers start)."""

    def __init__(self, code: int, action: str, line: str):
        super().__init__(line)
        self.code, self.action, self.line = code, action, line


def internals(what: str) -> JobStop:
    """The stop for a torch without an internal this launcher relies on (exit 2: no restart, no requeue)."""
    return JobStop(EXIT_BAD_CONFIG, "fail", f"torch {torch.__version__} has no {what}, which llama-fp8 launch "
                   "relies on for its restart decisions (written against torch 2.13); not starting the workers. "
                   "Use a torch this version of llama-fp8 supports, or plain torchrun (no job-wide restart budget)")


def check_torch() -> None:
    """torch's ``launch_agent`` must build its agent by the name ``LocalElasticAgent`` of its own module, which
    ``launch.py`` binds to ``JobAgent``; otherwise the job would run with torch's plain restarts."""
    from torch.distributed.launcher import api

    fn = getattr(api, "launch_agent", None)
    code = getattr(fn, "__code__", None)
    if not (hasattr(api, "LocalElasticAgent") and code is not None and "LocalElasticAgent" in code.co_names
            and getattr(fn, "__globals__", None) is vars(api)):
        raise internals("launch_agent that builds torch.distributed.launcher.api.LocalElasticAgent by that name")


def rendezvous_round(handler) -> int | None:
    """The round of the c10d/etcd dynamic rendezvous (0 for the first attempt, +1 per restart of the job), or None
    when it cannot be read. torch keeps it in the handler's state holder (no public accessor)."""
    value = getattr(getattr(getattr(handler, "_state_holder", None), "state", None), "round", None)
    return value if isinstance(value, int) else None


def exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}" + (f" ({NOT_RESTARTED[code]})" if code in NOT_RESTARTED else "")


class JobAgent(LocalElasticAgent):
    """torch's LocalElasticAgent with a job-wide restart budget, no restart after a deterministic failure or a
    stop signal, SIGKILL for a failed attempt, and one line per decision (module docstring)."""

    signalled: signal.Signals | None = None  # set by the launcher's signal handler (on_signal)
    last: JobAgent | None = None  # the agent of this process, for the launcher's exit code

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        JobAgent.last = self
        self.progress_dir = progress.folder()
        self.failed_at: dict[int, tuple] = {}  # rendezvous round -> where that attempt failed on this node
        self.decision: JobStop | None = None  # why this agent stopped (None: success or torch's own stop)
        self.killed: set[int] = set()  # pids this agent killed (their -9 is not a failure of their own)
        self.forwarded: set[int] = set()  # pids a stop signal was passed on to
        self.seen_exit: dict[int, float] = {}  # pid -> when this agent first saw it exited (monotonic)
        self.checkpoint: int | None = None  # the latest complete checkpoint a local worker reported

    # --- where things stand ---------------------------------------------------------------------------------
    def _round(self) -> int:
        spec = self._worker_group.spec
        value = rendezvous_round(spec.rdzv_handler)
        if value is not None:
            return value
        if isinstance(spec.rdzv_handler, DynamicRendezvousHandler):  # it has rounds: torch moved them
            raise internals("rendezvous round in DynamicRendezvousHandler._state_holder.state.round")
        return spec.max_restarts - self._remaining_restarts  # a static rendezvous: torch's own count

    def _procs(self) -> dict[int, object]:
        """local rank -> Popen of the running attempt ({} when torch keeps them otherwise)."""
        handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", None) or {}
        return {lr: h.proc for lr, h in handlers.items() if hasattr(h, "proc")}

    def _check_workers(self) -> None:
        """Every started worker visible as a process (SIGKILL, naming and signal forwarding need them)."""
        if len(self._procs()) != self._worker_group.spec.local_world_size:
            self._pcontext.close(signal.SIGKILL, 5)
            raise internals("worker processes in _pcontext.subprocess_handlers[local_rank].proc")

    def _progress(self) -> dict[int, dict]:
        """The local workers' progress records; keeps the latest complete checkpoint any of them reported."""
        recs = heartbeat.read(self.progress_dir)
        for rec in recs.values():
            ckpt = rec.get("ckpt")
            if isinstance(ckpt, int) and not isinstance(ckpt, bool) and ckpt > (self.checkpoint or -1):
                self.checkpoint = ckpt
        return recs

    def _describe_stuck(self) -> list[str]:
        """The local ranks that stopped moving while another worker failed (progress.stuck_ranks)."""
        procs = {self._worker_group.workers[lr].global_rank: proc for lr, proc in self._procs().items()}
        return progress.stuck_ranks(procs, self._progress(), time.time())

    def _first(self, failures: dict) -> tuple:
        """The failure that came first: the one this agent saw first (torch's timestamps are whole seconds), among
        those seen at the same look a death by a signal (a peer's exit 1 is often the consequence), then rank."""
        if not failures:
            return None, None
        return min(failures.items(), key=lambda kv: (self.seen_exit.get(kv[1].pid, math.inf), kv[1].exitcode >= 0,
                                                     kv[1].timestamp, kv[0]))

    # --- torch's extension points ------------------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup):
        if JobAgent.signalled is not None:  # no new attempt after a time-limit or preemption signal
            raise JobStop(EXIT_REQUEUE, "retry", f"{JobAgent.signalled.name} arrived during a restart: no new "
                          "checkpoint to save; exit 85 so that the job is requeued and resumes from the latest "
                          "complete checkpoint")
        attempt = self._round()
        self._progress()  # the previous attempt's last word on checkpoints, before its files go
        for old in self.progress_dir.glob("rank*"):
            old.unlink(missing_ok=True)
        os.environ[heartbeat.ENV] = str(self.progress_dir)  # the workers inherit the agent's environment
        os.environ[ATTEMPT_ENV] = str(attempt)
        self.killed.clear()
        self.forwarded.clear()
        self.seen_exit.clear()
        pids = super()._start_workers(worker_group)
        self._check_workers()
        if JobAgent.signalled is not None:  # it arrived while they started, before on_signal could see them
            self.forward(JobAgent.signalled)
        return pids

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._kill_running()
        super()._stop_workers(worker_group)  # torch's bookkeeping (watchdog, health check); nothing left to signal

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # torch's run() ends with this, SIGTERM and 30 s, also when the rendezvous is lost: a save that cannot
        # complete without the lost ranks. Only a stop signal (the workers save) or torch's own signal path
        # (SIGINT/SIGHUP/QUIT, passed on as such) keep torch's grace.
        if death_sig == signal.SIGTERM and JobAgent.signalled is None:
            self._kill_running()
        super()._shutdown(death_sig, timeout)

    def _finished(self, local_ranks: list[int]) -> bool:
        """Whether these local ranks had reported the `finished` phase (the run's last checkpoint complete)."""
        recs = self._progress()
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

    def _kill_running(self) -> None:
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
        if worker_group.state == WorkerState.HEALTHY:  # another node failed and waits in the next round
            stuck = self._describe_stuck()
            say(f"node {worker_group.group_rank}: another node's workers failed and are restarting; restarting "
                f"this node's workers with them" + (f" ({'; '.join(stuck)})" if stuck else ""))
        super()._restart_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        now = time.monotonic()
        for proc in self._procs().values():
            if proc.pid not in self.seen_exit and proc.poll() is not None:
                self.seen_exit[proc.pid] = now
        crashed = [lr for lr, p in self._procs().items() if p.poll() not in (None, 0, *NOT_RESTARTED)]
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
                self._kill_running()
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return self._decide(worker_group, result, stuck)
        return result

    # --- the decision ------------------------------------------------------------------------------------------
    def _decide(self, worker_group: WorkerGroup, result: RunResult, stuck: list[str]) -> RunResult:
        own = {r: f for r, f in result.failures.items() if f.pid not in self.killed}
        failures = own or result.failures
        first_rank, first = self._first(failures)
        what = (f"rank {first_rank} ({exit_text(first.exitcode)})" if first is not None
                else f"the workers ({result.state.name.lower()})")
        node = f"node {worker_group.group_rank} ({socket.gethostname()})"
        progress_recs = self._progress()
        if stuck:
            say(f"{node}: {'; '.join(stuck)}; the other ranks failed waiting for it")
        if own and all(progress_recs.get(r, {}).get("phase") == "finished" for r in own):
            line = f"{node}: {what} after training finished (the final checkpoint is complete): nothing to redo"
            self.decision = JobStop(0, "done", f"training finished on every node; {line}")
            say(f"{line}; not restarting, this node is done")
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={w.global_rank: None for w in worker_group.workers})
        if result.state == WorkerState.UNHEALTHY:  # torch's guard: it has set the restarts to 0 itself
            self._stop(1, "retry", f"{node}: a worker stayed in uninterruptible sleep (D state) longer than "
                       "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT: it holds its device, a restarted worker here "
                       "would find it busy; not restarting; exit 1, the batch script requeues the job (at most "
                       "MAX_REQUEUES times)")
            return result
        codes = {f.exitcode for f in failures.values()}
        point = progress.failure_point(own or failures, progress_recs)
        where = f"in step {point[1]}" if point[0] == "step" else "during start-up"
        deterministic = sorted(c for c in codes if c in NOT_RESTARTED and c != EXIT_REQUEUE)
        if deterministic:  # before the stop signal: a requeue would fail the same way
            code = deterministic[0]
            self._stop(code, "fail", f"{node}: {what} {where}: a restart would fail the same way; not restarting, "
                       f"the job ends with exit {code}")
        elif JobAgent.signalled is not None:  # a time limit or preemption: requeue, never restart in place
            saved = EXIT_REQUEUE in codes
            self._stop(EXIT_REQUEUE, "requeue" if saved else "retry", f"{node}: {what} after "
                       f"{JobAgent.signalled.name}: not restarting; exit 85, the batch script requeues the job, which "
                       f"resumes from {'that' if saved else 'the latest complete'} checkpoint")
        elif EXIT_REQUEUE in codes:
            self._stop(EXIT_REQUEUE, "requeue", f"{node}: {what}: not restarting in place; the batch script requeues "
                       f"the job, which resumes from that checkpoint")
        else:
            self._budget(worker_group, what, where, point, first)
        return result

    def _budget(self, worker_group: WorkerGroup, what: str, where: str, point: tuple, first) -> None:
        """A crash or an exit 1: restart every node's workers, unless it repeats or the job's budget is spent."""
        rnd, spec = self._round(), worker_group.spec
        node = f"node {worker_group.group_rank} ({socket.gethostname()})"
        code = 1 if first is None else first.exitcode if first.exitcode > 0 else 128 - first.exitcode
        before, self.failed_at[rnd] = self.failed_at.get(rnd - 1), point
        if point[0] == "step" and before == point:
            self._stop(code, "fail", f"{node}: {what} {where} again after a restart: the failure is deterministic "
                       f"(data, model or code, not the machine); not restarting, the job ends with exit {code}")
        elif point[0] == "startup" and before is not None and before[0] == "startup":
            self._stop(code, "retry", f"{node}: {what} during start-up again after a restart: more often the "
                       f"machine (a GPU that does not initialize, memory a killed process still holds) than the "
                       f"code; not restarting in place; exit {code}, the batch script requeues the job (at most "
                       f"MAX_REQUEUES times without a new checkpoint)")
        elif spec.max_restarts - rnd <= 0:
            budget = (f"the job's {spec.max_restarts} restart(s) are used up" if spec.max_restarts else
                      "restarts are off (--max_restarts 0)")
            self._stop(code, "fail", f"{node}: {what} {where}; {budget}: not restarting, the job ends with exit "
                       f"{code}")
        else:
            self._remaining_restarts = spec.max_restarts - rnd  # _invoke_run takes one off as it restarts
            say(f"{node}: {what} {where}; restarting the workers of every node (restart {rnd + 1} of "
                f"{spec.max_restarts} for the job), resuming from the latest complete checkpoint")

    def _stop(self, code: int, action: str, line: str) -> None:
        self._remaining_restarts = 0
        self.decision = JobStop(code, action, line)
        say(line)

    def latest_checkpoint(self) -> int | None:
        self._progress()
        return self.checkpoint


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
