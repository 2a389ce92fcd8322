"""``llama-fp8 train``: parse the flags, plan, build (``state.start``), run the loop, and turn the outcome into an
exit code (errors.py names the codes).

    flags -> TrainConfig -> RunPlan (frozen) -> TrainState -> loop -> exit code
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from llama_fp8 import checkpoint, faults, parallel
from llama_fp8 import config as config_mod
from llama_fp8.config import TrainConfig
from llama_fp8.errors import EXIT_BAD_CONFIG, EXIT_NONFINITE, EXIT_REQUEUE, AgreedError, ConfigError
from llama_fp8.telemetry import metrics
from llama_fp8.train import flight_recorder


def main(argv: list[str]) -> int:
    try:
        cfg = config_mod.parse_args(argv)
    except ConfigError as e:
        print(f"llama-fp8 train: error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    code = run(cfg)
    if code == EXIT_BAD_CONFIG and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Every rank has left its process groups (together, after an agreed error). Leave now, skipping
        # C++ static destructors: there gloo's threads were seen to abort ("terminate called without an
        # active exception", SIGABRT), turning the agreed exit 2 into a signal death on some ranks.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code)
    return code


def run(cfg: TrainConfig) -> int:
    """Run one training job in this process (one rank); returns the exit code."""
    flight_recorder.set_dump_path(cfg)
    try:
        env = parallel.init_distributed(cfg)
    except ConfigError as e:
        print(f"llama-fp8 train: error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    agreed = False
    try:
        metrics.setup_logging(env.is_main)
        train(cfg, env)
        return 0
    except AgreedError as e:  # every rank has it: reported once
        if env.is_main:
            print(f"llama-fp8 train: error: {e}", file=sys.stderr)
        agreed = True
        return EXIT_BAD_CONFIG
    except ConfigError as e:
        print(f"llama-fp8 train: error (rank {env.rank}): {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except faults.Preempted as e:
        if env.is_main:
            print(f"llama-fp8 train: {e} (exit code {EXIT_REQUEUE})", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    except faults.NonFinite as e:
        print(f"llama-fp8 train: error (rank {env.rank}): {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except RuntimeError as e:  # a collective that gave up after --process_group_timeout: one line, not a traceback
        msg = faults.collective_timeout_message(e, cfg.process_group_timeout)
        if msg is None:
            raise
        print(f"llama-fp8 train: error (rank {env.rank}): {msg}", file=sys.stderr)
        return 1
    finally:
        # After an agreed error every rank is here: leave together, so that no rank closes its connections
        # while another still has a message in flight (seen once as an abort at exit under load).
        parallel.destroy_distributed(barrier=agreed)
        checkpoint.lock.release_all()  # this job's checkpoint folder lock, if this rank holds it


def train(cfg: TrainConfig, env: parallel.DistEnv) -> dict:
    """Train; returns this rank's summary: logged (rank-averaged) losses and parameter counts."""
    from llama_fp8.train import build, loop, state

    s = state.start(cfg, env)
    try:
        losses = loop.loop(s)
    except torch.cuda.OutOfMemoryError:
        s.observer.out_of_memory()
        raise
    finally:
        s.close()
    if env.is_main:
        print(f"Training finished: {cfg.max_steps} steps, run dir {s.plan.run_dir}", flush=True)
    return {"losses": losses, "local_numel": build.local_numel(s.model), "num_params": s.size.num_params,
            "start_step": s.start_step}
