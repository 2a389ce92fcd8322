"""What ``JobAgent`` decides once torch reports its workers failed (elastic.py): done, fail, requeue, retry
(requeue, possibly without a node), or restart every node's workers in place; one line saying what happened and
what comes next."""

from __future__ import annotations

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from llama_fp8.cluster.launch import peers, progress, spares
from llama_fp8.cluster.launch.outcome import NOT_RESTARTED, JobStop, exit_text, say
from llama_fp8.errors import EXIT_REQUEUE
from llama_fp8.faults.transient import KINDS

MACHINE_KINDS = ("io", "network", "cuda_startup", "device_lost")
"""Transient classes charged to the node they happened on (a peer's failure is charged to that peer's node)."""
NODE_FAILURES = 2
"""Failures charged to one node without a new complete checkpoint between them, after which it is left behind
(to a spare, or by the batch script where the job can run without it). Two failures far apart, with training
going on between them, are not a bad node: a failure's count starts again with every new checkpoint."""


def without_progress(ckpt_at: dict[int, int | None], rnd: int, first: int = 0) -> int:
    """Failures in a row up to round ``rnd`` with the same latest complete checkpoint: the restarts without
    progress (a round this agent has no record of counts as one without; ``first``: the round this agent joined
    in, a spare's later one: the rounds before it are the others' to count)."""
    now, n = ckpt_at.get(rnd), 0
    for r in range(rnd, first - 1, -1):
        if r in ckpt_at and ckpt_at[r] != now:
            break
        n += 1
    return n


def charged_without_progress(agent, host: str) -> int:
    """The failures charged to ``host`` at the latest complete checkpoint of the latest failure: those without a
    new checkpoint between them."""
    if not agent.charges:
        return 0
    now = agent.ckpt_at.get(max(agent.charges))
    return sum(1 for r, h in agent.charges.items() if h == host and agent.ckpt_at.get(r) == now)


def window(agent) -> str:
    ckpt = agent.checkpoint
    return f"without a new checkpoint (the latest complete: {'none yet' if ckpt is None else f'step {ckpt}'})"


def _charged(agent, first, kind: str | None, theirs: dict | None) -> str | None:
    """The node a failure is charged to: a hang's culprit's; a crash or a transient failure of the machine: this
    node; a peer's failure: the node another launcher charged (None: nobody, e.g. a Python exception)."""
    if agent.watch.hang is not None:
        return agent.watch.hang.charged
    if first is None or first.pid in agent.killed:
        return theirs.get("charged") if theirs else None
    if kind == "peer":
        return theirs.get("charged") if theirs else None
    if first.exitcode < 0 or kind in MACHINE_KINDS:
        return peers.node_name()
    return None


def decide(agent, worker_group: WorkerGroup, result: RunResult, stuck: list[str], signalled) -> RunResult:
    """``signalled``: the stop signal the launcher received (None: none)."""
    recs = agent.progress()
    own = {r: f for r, f in result.failures.items() if f.pid not in agent.killed}
    failures = own or result.failures
    # The rank named is the one whose code the job ends with, when a code that is not restarted is among them: a
    # NaN (3) seen after a peer's saved 85 ends the job with 3, and the line says which rank.
    ending = {r: f for r, f in failures.items() if f.exitcode in NOT_RESTARTED and f.exitcode != EXIT_REQUEUE}
    first_rank, first = agent._first(ending or failures, recs)
    kind, said = progress.error_of(recs.get(first_rank, {})) if first is not None else (None, None)
    theirs = agent.watch.peers.decision() if agent.watch.peers else None
    theirs = theirs if theirs and theirs.get("node") != worker_group.group_rank else None
    if agent.watch.hang is not None:
        what = "the hang above"
    elif first is not None:
        shown = KINDS.get(kind) if kind else None
        what = f"rank {first_rank} ({exit_text(first.exitcode, shown)}" + (
            f": {said[:160]}" if said and first.exitcode not in NOT_RESTARTED else "") + ")"
        if (kind == "peer" or first.pid in agent.killed) and theirs:
            what += f", after another node's decision ({theirs['line'][:240]})"
    else:
        what = f"the workers ({result.state.name.lower()})"
    node = f"node {worker_group.group_rank} ({peers.node_name()})"
    if stuck:
        say(f"{node}: {'; '.join(stuck)}; the other ranks failed waiting for it")
    if own and all(recs.get(r, {}).get("phase") == "finished" for r in own):
        line = f"{node}: {what} after training finished (the final checkpoint is complete): nothing to redo"
        agent.decision = JobStop(0, "done", f"training finished on every node; {line}")
        say(f"{line}; not restarting, this node is done")
        return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in worker_group.workers})
    if result.state == WorkerState.UNHEALTHY:  # torch's guard: it has set the restarts to 0 itself
        line = (f"{node}: a worker stayed in uninterruptible sleep (D state) longer than "
                "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT: it holds its device, a restarted worker here would find "
                "it busy")
        if not agent.leave(line, peers.node_name()):
            agent.exclude.append(peers.node_name())
            agent.stop(1, "retry", f"{line}; not restarting, no spare waits; exit 1, the batch script leaves this "
                       "node behind where the job can run without it (at most MAX_REQUEUES times)")
        return result
    codes = {f.exitcode for f in failures.values()}
    point = agent.watch.hang.point if agent.watch.hang is not None else progress.failure_point(own or failures, recs)
    where = f"in step {point[1]}" if point[0] == "step" else "during start-up"
    deterministic = sorted(c for c in codes if c in NOT_RESTARTED and c != EXIT_REQUEUE)
    if deterministic:  # before the stop signal: a requeue would fail the same way
        code = deterministic[0]
        agent.stop(code, "fail", f"{node}: {what} {where}: a restart would fail the same way; not restarting, the "
                   f"job ends with exit {code}")
    elif signalled is not None:  # a time limit or preemption: requeue, never restart in place
        saved = EXIT_REQUEUE in codes
        agent.stop(EXIT_REQUEUE, "requeue" if saved else "retry", f"{node}: {what} after {signalled.name}: "
                   f"not restarting; exit 85, the batch script requeues the job, which resumes from "
                   f"{'that' if saved else 'the latest complete'} checkpoint")
    elif EXIT_REQUEUE in codes:
        agent.stop(EXIT_REQUEUE, "requeue", f"{node}: {what}: not restarting in place; the batch script requeues the "
                   f"job, which resumes from that checkpoint")
    else:
        budget(agent, worker_group, what, where, point, first, _charged(agent, first, kind, theirs))
    return result


def budget(agent, worker_group: WorkerGroup, what: str, where: str, point: tuple, first, charged: str | None) -> None:
    """A crash, a hang or a transient failure: restart every node's workers, unless it repeats at the same step,
    start-up fails twice, a node has failed NODE_FAILURES times, or the restarts without progress are used up."""
    rnd, spec = agent._round(), worker_group.spec
    node = f"node {worker_group.group_rank} ({peers.node_name()})"
    code = 1 if first is None else first.exitcode if first.exitcode > 0 else 128 - first.exitcode
    before, agent.failed_at[rnd] = agent.failed_at.get(rnd - 1), point
    agent.ckpt_at[rnd] = agent.checkpoint
    if charged:
        agent.charges[rnd] = charged
    count = charged_without_progress(agent, charged) if charged else 0
    streak = without_progress(agent.ckpt_at, rnd, agent.first_round or 0)
    if point[0] == "step" and before == point:
        agent.stop(code, "fail", f"{node}: {what} {where} again after a restart: the failure is deterministic (data, "
                   f"model or code, not the machine); not restarting, the job ends with exit {code}")
    elif point[0] == "startup" and before is not None and before[0] == "startup":
        agent.stop(code, "retry", f"{node}: {what} during start-up again after a restart: more often the machine (a "
                   f"GPU that does not initialize, memory a killed process still holds) than the code; not "
                   f"restarting in place; exit {code}, the batch script requeues the job (at most MAX_REQUEUES times "
                   f"without a new checkpoint)" + (f", without {charged}" if charged else ""))
    elif charged and count >= NODE_FAILURES and not _to_a_spare(agent, node, f"{what} {where}", charged, count):
        agent.stop(code, "retry", f"{node}: {what} {where}: node {charged} has failed {count} times {window(agent)}: "
                   f"no spare waits in this step; the batch script leaves {charged} behind where the job can run "
                   f"without it (a spare of the allocation, or nodes Slurm can give the requeued job), else it "
                   f"restarts the training step in place on it, saying why")
    elif agent.decision is not None:  # this node left its place to a spare
        pass
    elif streak > spec.max_restarts:
        budget_line = (f"the job's {spec.max_restarts} restart(s) without a new checkpoint are used up"
                       if spec.max_restarts else "restarts are off (--max_restarts 0)")
        agent.stop(code, "fail", f"{node}: {what} {where}; {budget_line}: not restarting, the job ends with exit "
                   f"{code}")
    else:
        agent._remaining_restarts = spec.max_restarts - streak + 1  # _invoke_run takes one off as it restarts
        charge = f"; charged to node {charged} ({count} of {NODE_FAILURES} {window(agent)})" if charged else ""
        if charged and count >= NODE_FAILURES:
            charge += ": it is left behind and a spare takes its place"
        say(f"{node}: {what} {where}{charge}; restarting the workers of every node (restart {rnd + 1} of the job, "
            f"{streak} of {spec.max_restarts} without a new checkpoint), resuming from the latest complete "
            f"checkpoint")


def _to_a_spare(agent, node: str, what: str, charged: str, count: int) -> bool:
    """A node charged NODE_FAILURES times without progress: this node hands its place to a spare and leaves
    (``agent.leave``), another node restarts its workers with the spare; False when no spare takes it."""
    if charged == peers.node_name():
        return agent.leave(f"{node}: {what}: this node has failed {count} times {window(agent)}", charged)
    return spares.available(agent._worker_group.spec.rdzv_handler, charged)


def check_before_restart(agent, worker_group: WorkerGroup, problem: str | None) -> None:
    """A node that fails its health check before its workers restart is left behind: to a spare where one waits
    (``agent.leave``: JobStop ``left``), else JobStop (retry) with the node in the outcome's exclusions."""
    if problem is None:
        return
    host = peers.node_name()
    line = f"node {worker_group.group_rank} ({host}): {problem}: failed its health check before a restart"
    if not agent.leave(line, host):
        agent.exclude.append(host)
        line += (f"; not restarting its workers, no spare waits; the batch script leaves {host} behind where the job "
                 "can run without it, else it restarts the training step in place")
        agent.decision = JobStop(1, "retry", line)
        say(line)
    raise agent.decision
