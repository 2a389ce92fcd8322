"""Restarts inside the allocation: torchrun's own elastic agent, with the decisions a training job needs.

torchrun (``torch.distributed.run``) already restarts the workers of every node when one fails, in a new
rendezvous round (``SimpleElasticAgent._invoke_run``). ``JobAgent`` is its ``LocalElasticAgent`` with four
decisions changed through the attributes and methods torch itself uses for them:

- **The restart budget is the job's**: torch counts restarts per agent (a failure on node B decrements only B's
  count, pytorch/pytorch#147064). Every restart is one new round of the shared rendezvous, so the round number
  is the job-wide count: on a failure ``_remaining_restarts`` becomes ``max_restarts - round``.
- **Deterministic failures are not restarted**: exit 2 (bad config or data), 3 (non-finite loss), 85
  (checkpoint saved after SIGUSR1/SIGTERM: the batch script requeues), or the same step failing in two attempts
  in a row. ``_remaining_restarts = 0`` sends ``_invoke_run`` to its stop branch, as torch does for a worker
  stuck in uninterruptible sleep.
- **SIGUSR1/SIGTERM stop restarts**: they mean a time limit or a preemption. The workers save and exit 85;
  a worker that was still starting dies of the signal, and the job exits 85 all the same (the latest complete
  checkpoint is the resume point). Workers are never started after such a signal.
- **A failed attempt is killed at once**: torch sends SIGTERM and waits 30 s (hard-coded for a restart) before
  SIGKILL. Our workers read SIGTERM as "save a checkpoint", which a broken attempt cannot do, and a stopped
  rank never handles it; a restart resumes from the latest complete checkpoint, so the workers get SIGKILL.

Each decision is one line on stderr (``llama-fp8 launch: ...``) saying what happened and what comes next; with
``LLAMA_FP8_OUTCOME_DIR`` set (the batch scripts) the final one is also written there for the batch script,
which requeues or not (``job_lib.sh`` ``lf_train``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from llama_fp8.errors import EXIT_BAD_CONFIG, EXIT_NONFINITE, EXIT_REQUEUE
from llama_fp8.telemetry import heartbeat

OUTCOME_ENV = "LLAMA_FP8_OUTCOME_DIR"
"""Folder where each node's launcher writes its final decision (``node<N>``: code, action, line). Actions: ``done``,
``fail`` (not requeued), ``requeue`` (a checkpoint was saved: always requeued), ``retry`` (requeue without a new
checkpoint: a signal during a restart, the rendezvous host lost; requeued at most MAX_REQUEUES times), ``closed``
(another node ended the job: its own line says why)."""
NOT_RESTARTED = {EXIT_BAD_CONFIG: "a bad flag, config or data file", EXIT_NONFINITE: "a non-finite loss",
                 EXIT_REQUEUE: "a checkpoint saved after SIGUSR1/SIGTERM"}
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
STILL_S = 10.0
"""A live rank without progress for this long when another rank fails is named as the one that stopped moving (a
rank that is merely slower notices a crashed peer within a second on gloo; a hung one never moves again)."""


def say(line: str) -> None:
    print(f"llama-fp8 launch: {line}", file=sys.stderr, flush=True)


class JobStop(Exception):
    """The job ends here with ``code`` (raised where torch offers no return path: before workers start)."""

    def __init__(self, code: int, action: str, line: str):
        super().__init__(line)
        self.code, self.action, self.line = code, action, line


def rendezvous_round(handler) -> int | None:
    """The round of the c10d/etcd dynamic rendezvous (0 for the first attempt, +1 per restart of the job), or None
    for a rendezvous without rounds. torch keeps it in the handler's state holder (no public accessor)."""
    value = getattr(getattr(getattr(handler, "_state_holder", None), "state", None), "round", None)
    return value if isinstance(value, int) else None


def proc_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R running, S sleeping, T stopped, D uninterruptible, Z exited),
    or "?" when it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


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
        self.progress_dir = Path(tempfile.mkdtemp(prefix="llama-fp8-progress-"))
        self.failed_at: dict[int, tuple] = {}  # rendezvous round -> where that attempt failed on this node
        self.decision: JobStop | None = None  # why this agent stopped (None: success or torch's own stop)
        self.killed: set[int] = set()  # pids this agent killed (their -9 is not a failure of their own)

    # --- where things stand ---------------------------------------------------------------------------------
    def _round(self) -> int:
        value = rendezvous_round(self._worker_group.spec.rdzv_handler)
        spec = self._worker_group.spec
        return value if value is not None else spec.max_restarts - self._remaining_restarts

    def _procs(self) -> dict[int, object]:
        """local rank -> Popen of the running attempt ({} when torch keeps them otherwise)."""
        handlers = getattr(getattr(self, "_pcontext", None), "subprocess_handlers", None) or {}
        return {lr: h.proc for lr, h in handlers.items() if hasattr(h, "proc")}

    def _describe_stuck(self) -> list[str]:
        """Local workers alive while another worker failed, and stopped (SIGSTOP, a debugger, uninterruptible
        sleep) or without progress for ``STILL_S``: the ranks that stopped moving, with the step they were in."""
        progress, now, out = heartbeat.read(self.progress_dir), time.time(), []
        for lr, proc in self._procs().items():
            if proc.poll() is not None:
                continue
            worker = self._worker_group.workers[lr]
            rec = progress.get(worker.global_rank)
            still = now - rec["time"] if rec else None
            state = proc_state(proc.pid)
            how = {"T": "stopped (SIGSTOP)", "t": "stopped by a debugger", "D": "in uninterruptible sleep"}.get(state)
            if how is None and (still is None or still < STILL_S):
                continue
            where = (f"in step {rec['step']}" if rec and rec["phase"] == "step" else "before its first step") + (
                f", no progress for {still:.0f} s" if still is not None else "")
            out.append(f"rank {worker.global_rank} (pid {proc.pid}) stopped moving: {how or f'state {state}'} {where}")
        return out

    def _failure_point(self, result: RunResult) -> tuple:
        """Where this attempt failed on this node: the step the failed ranks were in (or start-up, with the
        step it resumed from), from their progress files."""
        progress = heartbeat.read(self.progress_dir)
        recs = [progress[r] for r in result.failures if r in progress]
        if not recs:
            return ("startup", None)
        phase = "step" if any(r["phase"] == "step" for r in recs) else "startup"
        return (phase, max(r["step"] for r in recs if r["phase"] == phase))

    # --- torch's extension points ------------------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup):
        if JobAgent.signalled is not None:  # no new attempt after a time-limit or preemption signal
            raise JobStop(EXIT_REQUEUE, "retry", f"{JobAgent.signalled.name} arrived during a restart: no new "
                          "checkpoint to save; exit 85 so that the job is requeued and resumes from the latest "
                          "complete checkpoint")
        for old in self.progress_dir.glob("rank*"):
            old.unlink(missing_ok=True)
        os.environ[heartbeat.ENV] = str(self.progress_dir)  # the workers inherit the agent's environment
        self.killed.clear()
        return super()._start_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._kill_running()
        super()._stop_workers(worker_group)  # torch's bookkeeping (watchdog, health check); nothing left to signal

    def _kill_running(self) -> None:
        for proc in self._procs().values():
            if proc.poll() is None:
                self.killed.add(proc.pid)
                try:  # the worker leads its own process group (torch starts it in a new session)
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        if worker_group.state == WorkerState.HEALTHY:  # another node failed and waits in the next round
            stuck = self._describe_stuck()
            say(f"node {worker_group.group_rank}: another node's workers failed and are restarting; restarting "
                f"this node's workers with them" + (f" ({'; '.join(stuck)})" if stuck else ""))
        super()._restart_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        crashed = [p for p in self._procs().values() if p.poll() not in (None, 0, *NOT_RESTARTED)]
        stuck: list[str] = []
        if crashed and JobAgent.signalled is None:
            # A crash: the others' work since the last checkpoint is lost either way; don't give them torch's
            # SIGTERM (our workers would try to save) and 30 s, and see first which of them stopped moving.
            stuck = self._describe_stuck()
            self._kill_running()
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self._decide(worker_group, result, stuck)
        return result

    # --- the decision ------------------------------------------------------------------------------------------
    def _decide(self, worker_group: WorkerGroup, result: RunResult, stuck: list[str]) -> None:
        own = {r: f for r, f in result.failures.items() if f.pid not in self.killed}
        failures = own or result.failures
        first_rank, first = min(failures.items(), key=lambda kv: kv[1].timestamp) if failures else (None, None)
        what = (f"rank {first_rank} ({exit_text(first.exitcode)})" if first is not None
                else f"the workers ({result.state.name.lower()})")
        node = f"node {worker_group.group_rank} ({socket.gethostname()})"
        codes = {f.exitcode for f in failures.values()}
        rnd, spec = self._round(), worker_group.spec
        point = self._failure_point(result)
        where = f"in step {point[1]}" if point[0] == "step" else "during start-up"
        if stuck:
            say(f"{node}: {'; '.join(stuck)}; the other ranks failed waiting for it")
        if JobAgent.signalled is not None:  # a time limit or preemption: requeue, never restart in place
            saved = EXIT_REQUEUE in codes
            self._stop(EXIT_REQUEUE, "requeue" if saved else "retry", f"{node}: {what} after "
                       f"{JobAgent.signalled.name}: not restarting; exit 85, the batch script requeues the job, which "
                       f"resumes from {'that' if saved else 'the latest complete'} checkpoint")
            return
        deterministic = sorted(c for c in codes if c in NOT_RESTARTED and c != EXIT_REQUEUE)
        if deterministic:
            code = deterministic[0]
            self._stop(code, "fail", f"{node}: {what} {where}: a restart would fail the same way; not restarting, "
                       f"the job ends with exit {code}")
            return
        if EXIT_REQUEUE in codes:
            self._stop(EXIT_REQUEUE, "requeue", f"{node}: {what}: not restarting in place; the batch script requeues "
                       f"the job, which resumes from that checkpoint")
            return
        self.failed_at[rnd] = point
        code = 1 if first is None else first.exitcode if first.exitcode > 0 else 128 - first.exitcode
        if self.failed_at.get(rnd - 1) == point:
            self._stop(code, "fail", f"{node}: {what} {where} again after a restart: the failure is deterministic "
                       f"(data, model or code, not the machine); not restarting, the job ends with exit {code}")
            return
        left = spec.max_restarts - rnd
        if left <= 0:
            budget = (f"the job's {spec.max_restarts} restart(s) are used up" if spec.max_restarts else
                      "restarts are off (--max_restarts 0)")
            self._stop(code, "fail", f"{node}: {what} {where}; {budget}: not restarting, the job ends with exit "
                       f"{code}")
            return
        self._remaining_restarts = left  # _invoke_run takes one off as it restarts
        say(f"{node}: {what} {where}; restarting the workers of every node (restart {rnd + 1} of "
            f"{spec.max_restarts} for the job), resuming from the latest complete checkpoint")

    def _stop(self, code: int, action: str, line: str) -> None:
        self._remaining_restarts = 0
        self.decision = JobStop(code, action, line)
        say(line)


def on_signal(signum, frame) -> None:
    """SIGUSR1/SIGTERM to the launcher: a time limit or preemption. Slurm signals the workers too (every
    process of the step); they save a checkpoint and exit 85. Passed on to the workers once, for a signal
    sent to the launcher alone; the launcher itself outlives them to report their exit code."""
    first = JobAgent.signalled is None
    JobAgent.signalled = JobAgent.signalled or signal.Signals(signum)
    if not first:
        return
    say(f"received {signal.Signals(signum).name}: the workers save a checkpoint and exit 85; no restart after this")
    agent = JobAgent.last
    for proc in (agent._procs().values() if agent is not None else ()):
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass


def write_outcome(code: int, action: str, line: str) -> None:
    """This node's final decision for the batch script (``OUTCOME_ENV``): ``CODE ACTION LINE``."""
    folder = os.environ.get(OUTCOME_ENV)
    if not folder:
        return
    name = f"node{os.environ.get('SLURM_NODEID', socket.gethostname())}"
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
        tmp = Path(folder) / f".{name}.tmp"
        tmp.write_text(f"{code} {action} {line}\n")
        tmp.replace(Path(folder) / name)
    except OSError as e:
        say(f"warning: could not write the outcome to {folder} ({e.strerror or e})")
