"""`python -m llama_fp8 launch TORCHRUN_ARGS`: torchrun with restarts a training job can use, returning the
workers' own exit code.

Plain torchrun turns every worker failure, including the requeue code 85, into exit code 1, so a Slurm script
could not tell "checkpoint saved, requeue me" from a crash; and its restarts (``--max_restarts``) would restart
a bad config or a NaN forever, count per node, and wait 30 s for a hung rank. This runs torchrun's own ``run`` in
this process with the agent of cluster/elastic.py (``JobAgent``). 1.train_llama.sbatch runs it on each node:

    python -m llama_fp8 launch --nnodes=2 --nproc_per_node=8 --max_restarts=3 --rdzv_backend=c10d ... \\
        -m llama_fp8 train ...

Exit code: 0, the workers' code (2 bad config, 3 non-finite loss, 85 checkpoint saved: requeue, 1 or the code of a
crash once restarts are used up or the same step failed twice), 128 + N for a signal N to the launcher
(SIGINT, SIGHUP, SIGQUIT), or ``EXIT_HOST_LOST`` when the rendezvous host went away.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal

from llama_fp8.cluster import elastic
from llama_fp8.errors import EXIT_REQUEUE

EXIT_HOST_LOST = 86
"""The rendezvous host (the first node's launcher) is gone: nothing in this allocation can restart the job."""
# Signals torch's agent turns into "stop the workers and exit". SIGTERM (Slurm's time limit, preemption, scancel)
# and SIGUSR1 are not among them: the workers save a checkpoint on them and the launcher reports their 85.
TORCH_HANDLED = "SIGINT,SIGHUP,SIGQUIT"


@contextlib.contextmanager
def _agent_class(cls):
    """torch's ``launch_agent`` builds its agent by the name ``LocalElasticAgent`` in its module: bind that name to
    our subclass while torchrun runs in this process (it takes the same arguments)."""
    from torch.distributed.launcher import api

    original = api.LocalElasticAgent
    api.LocalElasticAgent = cls
    try:
        yield
    finally:
        api.LocalElasticAgent = original


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
    args = torchrun.parse_args(torchrun_args)
    if hasattr(args, "signals_to_handle"):
        args.signals_to_handle = TORCH_HANDLED
    for sig in elastic.STOP_SIGNALS:  # Python handlers: the workers (exec'd) get the default disposition back
        signal.signal(sig, elastic.on_signal)
    elastic.JobAgent.signalled = None
    code, action, line = 0, "done", "training finished on every node"
    try:
        with _agent_class(elastic.JobAgent):
            torchrun.run(args)
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
        elastic.say(line)
    except SignalException as e:  # SIGINT/SIGHUP/SIGQUIT to the agent: workers were stopped
        code, action, line = 128 + int(e.sigval), "fail", f"stopped by {e.sigval.name}"
    except RendezvousClosedError:
        code, action, line = 1, "closed", "another node ended the job (its line says why)"
        elastic.say(line)
    except (RendezvousConnectionError, RendezvousTimeoutError, dist.DistNetworkError, dist.DistStoreError) as e:
        code, action = EXIT_HOST_LOST, "retry"
        line = (f"lost the rendezvous ({type(e).__name__}): its host, the first node's launcher, is gone; this "
                f"allocation cannot restart the job, the batch script requeues it")
        elastic.say(line)
    finally:
        agent = elastic.JobAgent.last
        if agent is not None:
            shutil.rmtree(agent.progress_dir, ignore_errors=True)
    elastic.write_outcome(code, action, line)
    return code


def main(argv: list[str]) -> int:
    return run_torchrun(argv)
