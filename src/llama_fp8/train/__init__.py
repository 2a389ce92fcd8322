"""Training: ``cli`` (``llama-fp8 train``: flags -> exit code), ``state`` (everything a running job holds, built
once), ``build`` (model, optimizer, loaders), ``loop`` (the steps), ``observer`` (the loop's bookkeeping: heartbeat,
goodput, per-rank timing, profiler, fault points), ``flight_recorder`` (NCCL's dump path).

    flags -> TrainConfig -> RunPlan (frozen) -> TrainState -> loop -> exit code
"""

from llama_fp8.train.cli import main, run, train

__all__ = ["main", "run", "train"]
