"""`python -m llama_fp8 launch TORCHRUN_ARGS`: torchrun that returns the workers' own exit code.

Plain torchrun turns every worker failure, including the requeue code 85, into exit code 1, so a
Slurm script could not tell "checkpoint saved, requeue me" from a crash. 1.train_llama.sbatch runs this
on each node:

    python -m llama_fp8 launch --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d ... -m llama_fp8 train ...
"""

from __future__ import annotations

import signal


def run_torchrun(torchrun_args: list[str]) -> int:
    """Run torchrun in-process and return the first failed worker's exit code (0 on success).

    SIGUSR1 is ignored by the agent itself: Slurm sends it to every process of the step; the workers
    handle it (save, exit 85) and the agent must outlive them to report that code.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    # A Python handler, not SIG_IGN: the workers (exec'd) get the default disposition back.
    signal.signal(signal.SIGUSR1, lambda signum, frame: None)
    try:
        torchrun_main(torchrun_args)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode  # killed by signal -N
    except SignalException as e:  # SIGTERM/SIGINT to the agent: workers were stopped
        return 128 + int(e.sigval)
    return 0


def main(argv: list[str]) -> int:
    return run_torchrun(argv)
