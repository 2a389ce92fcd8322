"""``llama-fp8 train``: parse the flags, plan, build (``state.start``), run the loop, and turn the outcome into an
exit code (errors.py names the codes).

    flags -> TrainConfig -> RunPlan (frozen) -> TrainState -> loop -> exit code
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys

import torch

from llama_fp8 import checkpoint, collector, faults, parallel
from llama_fp8 import config as config_mod
from llama_fp8.config import TrainConfig
from llama_fp8.errors import (
    EXIT_BAD_CONFIG,
    EXIT_NONFINITE,
    EXIT_REQUEUE,
    EXIT_TRANSIENT,
    AgreedError,
    ConfigError,
)
from llama_fp8.faults.transient import AgreedTransient
from llama_fp8.telemetry import goodput, heartbeat, metrics
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
    """Run one training job in this process (one rank); returns the exit code. Every way out says what ended it in
    the launcher's progress file (``Heartbeat.failed``): its class and one line."""
    goodput.startup.mark("imports")  # the interpreter, torch and the package, up to here
    flight_recorder.set_dump_path(cfg)
    beat = heartbeat.Heartbeat(int(os.environ.get("RANK", "0") or 0))
    beat.beat(0, "startup")
    try:
        env = parallel.init_distributed(cfg)
    except ConfigError as e:
        print(f"llama-fp8 train: error: {e}", file=sys.stderr)
        beat.failed(None, str(e))
        return EXIT_BAD_CONFIG
    except Exception as e:  # noqa: BLE001 - CUDA failing to start, the store unreachable: this node, not the config
        return _transient_or_raise(e, beat, rank=None)
    beat.start_watch()
    goodput.startup.mark("process_group")
    agreed = False
    try:
        metrics.setup_logging(env.is_main)
        train(cfg, env, beat)
        return 0
    except AgreedTransient as e:  # a peer's failure, or a checkpoint read every rank saw fail: reported once
        if env.is_main:
            print(f"llama-fp8 train: error: {faults.KINDS.get(e.kind, e.kind)}: {e}; {RESTART_HINT}", file=sys.stderr)
        beat.failed(e.kind, str(e))
        agreed = True
        return EXIT_TRANSIENT
    except AgreedError as e:  # every rank has it: reported once
        if env.is_main:
            print(f"llama-fp8 train: error: {e}", file=sys.stderr)
        beat.failed(None, str(e))
        agreed = True
        return EXIT_BAD_CONFIG
    except ConfigError as e:
        print(f"llama-fp8 train: error (rank {env.rank}): {e}", file=sys.stderr)
        beat.failed(None, str(e))
        return EXIT_BAD_CONFIG
    except faults.Preempted as e:
        if env.is_main:
            print(f"llama-fp8 train: {e} (exit code {EXIT_REQUEUE})", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    except faults.NonFinite as e:
        print(f"llama-fp8 train: error (rank {env.rank}): {e}", file=sys.stderr)
        beat.failed(None, str(e))
        return EXIT_NONFINITE
    except Exception as e:  # noqa: BLE001 - the transient class is one line and exit 75; anything else re-raised
        msg = faults.collective_timeout_message(e, cfg.process_group_timeout) if isinstance(e, RuntimeError) else None
        if msg is not None:  # a collective that gave up after --process_group_timeout: a peer's, one line
            print(f"llama-fp8 train: error (rank {env.rank}): {msg}", file=sys.stderr)
            beat.failed("peer", msg)
            return EXIT_TRANSIENT
        return _transient_or_raise(e, beat, rank=env.rank)
    finally:
        beat.close()
        # After an agreed error every rank is here: leave together, so that no rank closes its connections
        # while another still has a message in flight (seen once as an abort at exit under load).
        with contextlib.suppress(Exception):  # a peer already gone must not turn the exit code into a traceback
            parallel.destroy_distributed(barrier=agreed)
        checkpoint.lock.release_all()  # this job's checkpoint folder lock, if this rank holds it


RESTART_HINT = ("the machine or a service, not the config (exit 75): the launcher restarts the workers, counting "
                "the failure against this node")


def _transient_or_raise(e: BaseException, beat: heartbeat.Heartbeat, rank: int | None) -> int:
    """Exit 75 with one line for a transient failure (``faults.transient``); any other exception is re-raised
    (exit 1 with its traceback), its line written to the progress file first."""
    kind = faults.kind_of(e)
    line = faults.describe(e)
    beat.failed(kind, line)
    if kind is None:
        raise e
    where = f"rank {rank}" if rank is not None else f"rank {os.environ.get('RANK', '0')}"
    print(f"llama-fp8 train: error ({where}, {socket.gethostname()}): {line}; {RESTART_HINT}", file=sys.stderr)
    return EXIT_TRANSIENT


def train(cfg: TrainConfig, env: parallel.DistEnv, beat: heartbeat.Heartbeat | None = None) -> dict:
    """Train; returns this rank's summary: logged (rank-averaged) losses and parameter counts. ``beat``: this rank's
    progress file for the launcher (one is made here when not given)."""
    from llama_fp8.train import build, loop, state

    with collector.paused():  # the start-up: transformers' import, the model, a checkpoint read (collector.py)
        s = state.start(cfg, env, beat or heartbeat.Heartbeat(env.rank))
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
