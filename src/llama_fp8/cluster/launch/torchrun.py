"""`python -m llama_fp8 launch TORCHRUN_ARGS`: torchrun with restarts a training job can use, returning the
workers' own exit code.

Plain torchrun turns every worker failure, including the requeue code 85, into exit code 1, so a Slurm script
could not tell "checkpoint saved, requeue me" from a crash; and its restarts (``--max_restarts``) would restart
a bad config or a NaN forever, count per node, and wait 30 s for a hung rank. This runs torchrun's own ``run`` in
this process with the agent of cluster/launch/elastic.py (``JobAgent``). 1.train_llama.sbatch runs it on each node:

    python -m llama_fp8 launch --nnodes=2 --nproc_per_node=8 --max_restarts=3 --rdzv_backend=c10d ... \\
        -m llama_fp8 train ...

Exit code: 0, the workers' code (2 bad config, 3 non-finite loss, 85 checkpoint saved: requeue, 1 or the code of a
crash once restarts are used up or the same step failed twice), 128 + N for a signal N to the launcher
(SIGINT, SIGHUP, SIGQUIT), 2 when this torch lacks what the launcher relies on, or ``EXIT_HOST_LOST`` when the
rendezvous could not go on (its host gone or unreachable, a node missing, its port taken on the first node).
Exit 1 is also what the requeued cases end with: a start-up that failed twice in a row (its crash's code), a
worker stuck in uninterruptible sleep, another node's launcher having closed the rendezvous; the outcome file
(``retry``/``closed``), not the code, tells the batch script to requeue.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import signal

from llama_fp8.cluster.launch import elastic, outcome
from llama_fp8.errors import EXIT_REQUEUE
from llama_fp8.telemetry import heartbeat

EXIT_HOST_LOST = 86
"""The rendezvous cannot go on (its host, the first node's launcher, is gone or unreachable, a node never joined,
or the first node cannot open its port): nothing in this allocation can restart the job; the batch script
requeues it (MAX_REQUEUES)."""
# Signals torch's agent turns into "stop the workers and exit". SIGTERM (Slurm's time limit, preemption, scancel)
# and SIGUSR1 are not among them: the workers save a checkpoint on them and the launcher reports their 85.
TORCH_HANDLED = "SIGINT,SIGHUP,SIGQUIT"


@contextlib.contextmanager
def _agent_class(cls):
    """torch's ``launch_agent`` builds its agent by the name ``LocalElasticAgent`` in its module: bind that name to
    our subclass while torchrun runs in this process (it takes the same arguments; ``elastic.check_torch``)."""
    from torch.distributed.launcher import api

    original = api.LocalElasticAgent
    api.LocalElasticAgent = cls
    try:
        yield
    finally:
        api.LocalElasticAgent = original


def _rdzv_conf(args) -> dict[str, str]:
    """--rdzv_conf (``key=value,...``) as torchrun reads it."""
    out = {}
    for item in (getattr(args, "rdzv_conf", "") or "").split(","):
        key, _, value = item.partition("=")
        if key.strip():
            out[key.strip()] = value.strip()
    return out


def _rendezvous_lost(e: Exception, args, started: bool) -> tuple[int, str, str]:
    """(code, action, line) for a rendezvous that could not go on, saying which case it is."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    conf, where = _rdzv_conf(args), getattr(args, "rdzv_endpoint", "")
    if isinstance(e, RendezvousTimeoutError):
        return (EXIT_HOST_LOST, "retry", f"not every node joined the rendezvous: a node did not join within "
                f"{conf.get('join_timeout', '600')} s (join_timeout; its launcher did not start, or died); this "
                f"allocation cannot run the job as it is, the batch script requeues it")
    cause = e.__cause__ or e
    if not started and conf.get("is_host", "").lower() in ("1", "true", "yes", "y"):
        # Not a lost host: this node is the host. Often a setting (a port another program holds), but it can be a
        # process of this job's previous run not yet gone: requeued, at most MAX_REQUEUES times, saying which.
        return (EXIT_HOST_LOST, "retry", f"could not open the rendezvous store at {where} on this node, the first "
                f"one ({type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}): another process "
                "holds the port (a process of this job's previous run not yet gone, or another program), or the "
                "address is not this node's; the batch script requeues the job, at most MAX_REQUEUES times; if it "
                "persists, set RDZV_PORT to a free port")
    return (EXIT_HOST_LOST, "retry", f"lost the rendezvous store at {where} ({type(e).__name__}): its host, the "
            f"first node's launcher, is gone or unreachable; this allocation cannot restart the job, the batch script "
            f"requeues it")


def _torch_log_dir(agent, args) -> str | None:
    """The folder torch made for this launch's logs (``torchelastic_*`` in the temporary folder: one a job step and
    node, a folder per attempt in it), when nothing was asked to be logged there (no --log-dir, --redirects or
    --tee): what is in it, the workers' error files, has been read by the end of the launch. None otherwise."""
    if args.log_dir or str(getattr(args, "redirects", "0")) != "0" or str(getattr(args, "tee", "0")) != "0":
        return None
    root = getattr(getattr(agent, "_logs_specs", None), "root_log_dir", None)
    return root if root and os.path.basename(root).startswith("torchelastic_") else None


def run_torchrun(torchrun_args: list[str]) -> int:
    """Run torchrun in-process with ``JobAgent``; return the job's exit code (0 on success)."""
    import torch.distributed as dist
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    # Without it, every rendezvous round hands the workers the first round's store and peer addresses: a restart
    # then fails (gloo "connectFullMesh ... Connection refused") or hangs (pytorch/pytorch#135712, #167288).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    parser = torchrun.get_args_parser()  # torchrun.parse_args, with the page that explains this launcher
    parser.epilog = "docs: docs/reliability.md (crashes, hangs and lost nodes inside the allocation)"
    args = parser.parse_args(torchrun_args)
    if hasattr(args, "signals_to_handle"):
        args.signals_to_handle = TORCH_HANDLED
    for sig in elastic.STOP_SIGNALS:  # Python handlers: the workers (exec'd) get the default disposition back
        signal.signal(sig, elastic.on_signal)
    elastic.JobAgent.signalled = elastic.JobAgent.last = None
    elastic.JobAgent.is_host = bool(getattr(args, "standalone", False)) or \
        _rdzv_conf(args).get("is_host", "").lower() in ("1", "true", "yes", "y")
    saved_env = {k: os.environ.get(k) for k in (heartbeat.ENV, elastic.ATTEMPT_ENV, elastic.SAVED_ENV)}
    code, action, line = 0, "done", "training finished on every node"
    try:
        elastic.check_torch()
        with _agent_class(elastic.JobAgent):
            torchrun.run(args)
        agent = elastic.JobAgent.last
        if agent is None:  # check_torch passed, yet torch ran its own agent
            raise elastic.internals("launch_agent that builds its agent by the name LocalElasticAgent")
        if agent.decision is not None:  # done after a failure past the end, or torch's D-state stop
            code, action, line = agent.decision.code, agent.decision.action, agent.decision.line
    except ChildFailedError as e:
        agent = elastic.JobAgent.last
        if agent is not None and agent.decision is not None:
            code, action, line = agent.decision.code, agent.decision.action, agent.decision.line
        else:
            _, failure = e.get_first_failure()
            code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # killed by signal -N
            action, line = ("requeue" if code == EXIT_REQUEUE else "fail"), f"a worker failed: exit {code}"
    except elastic.JobStop as e:
        code, action, line = e.code, e.action, e.line
        if elastic.JobAgent.last is None or elastic.JobAgent.last.decision is not e:  # not said yet
            outcome.say(line)
    except SignalException as e:  # SIGINT/SIGHUP/SIGQUIT to the agent: workers were stopped
        code, action, line = 128 + int(e.sigval), "fail", f"stopped by {e.sigval.name}"
    except RendezvousClosedError:
        code, action, line = 1, "closed", "another node ended the job (its line says why)"
        outcome.say(line)
    except (RendezvousConnectionError, RendezvousTimeoutError, dist.DistNetworkError, dist.DistStoreError) as e:
        code, action, line = _rendezvous_lost(e, args, started=elastic.JobAgent.last is not None)
        outcome.say(line)
    finally:
        for key, value in saved_env.items():  # this process may launch again (tests): no stale folder, attempt
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        agent, checkpoint, failed, exclude = elastic.JobAgent.last, None, [], []
        if agent is not None:
            checkpoint, failed, exclude = agent.latest_checkpoint(), agent.failures(), agent.exclude
            shutil.rmtree(agent.progress_dir, ignore_errors=True)
            logs = _torch_log_dir(agent, args)
            if logs:
                shutil.rmtree(logs, ignore_errors=True)
        # The agent holds the rendezvous store in a reference cycle: released and collected now, the store closes its
        # own connections before its port. Left to the exit (`python -m llama_fp8` leaves without collecting:
        # collector.py), the kernel closed them in descriptor order and the store's port stayed in TIME-WAIT for a
        # minute, where a bind without SO_REUSEADDR fails.
        elastic.JobAgent.last = agent = None
        gc.collect()
    outcome.write_outcome(code, action, checkpoint, line, failed, exclude)
    return code


def main(argv: list[str]) -> int:
    return run_torchrun(argv)
