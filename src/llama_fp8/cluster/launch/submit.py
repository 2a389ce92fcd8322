"""`python -m llama_fp8 submit`: launch training on Slurm through submitit (no sbatch file).

    python -m llama_fp8 submit --nodes 2 --gpus_per_node 8 --partition p5 --wait -- --model llama3.1-8b --fp8=1

Own flags come first; everything after `--` goes to `python -m llama_fp8 train` unchanged (the same flags
as `sbatch 1.train_llama.sbatch ...`). One Slurm task per GPU (or --tasks_per_node on CPU); each task
takes its rank/world from Slurm's environment. With --image, tasks run in that Enroot image via Pyxis.
With --gpus_per_node the run is estimated here first (`llama_fp8 estimate`, no GPU needed) and not submitted
when it does not fit the GPUs' memory (exit code 4; also through a stand-in for the job's model implementation;
--estimate 0 submits without asking); anything else the estimate says or raises submits the job with a warning.

Requeue after a time-limit or preemption signal happens on the host, never in a task: a task may run in a
container without Slurm's client tools (`scontrol`). Slurm sends SIGUSR1 120 s before the limit; training
saves a checkpoint and the task exits with code 85 (leaving a marker file in the job's submitit folder); the
batch script's EXIT trap, installed by the ``setup`` lines below on the batch host, sees it and runs
``scontrol requeue``; the next attempt re-runs the same pickled task, which resumes from the checkpoint.
submitit's own signal handling (a handler that calls ``scontrol requeue`` from the task on its preemption
signal, and handlers that ignore SIGTERM) is switched off in the task before training starts.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_fp8.cluster.launch import mounts
from llama_fp8.config import EXIT_BAD_CONFIG, EXIT_REQUEUE, ConfigError, parse_args
from llama_fp8.errors import EXIT_DOES_NOT_FIT, EXIT_STAND_IN_DOES_NOT_FIT

REQUEUE_MARKER = "llama-fp8-requeue"
"""Written by task 0 into the job's submitit folder when training exited with EXIT_REQUEUE."""


def build_parser() -> argparse.ArgumentParser:
    """The submit command's own flags (train flags go after `--`)."""
    p = argparse.ArgumentParser(
        prog="python -m llama_fp8 submit",
        description="Submit `python -m llama_fp8 train TRAIN_FLAGS` to Slurm with submitit.",
        usage="%(prog)s [own flags] -- TRAIN_FLAGS...",
        epilog="docs: docs/cluster.md",
        allow_abbrev=False,
    )
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--gpus_per_node", type=int, default=0, help="GPUs per node; 0 = CPU job (default 0)")
    p.add_argument("--tasks_per_node", type=int, default=None,
                   help="processes per node (default: --gpus_per_node, or 1 on CPU)")
    p.add_argument("--cpus_per_task", type=int, default=None, help="CPUs per process (default: Slurm's)")
    p.add_argument("--partition", default=None, help="Slurm partition (default: the cluster default)")
    p.add_argument("--time", type=int, default=60, help="time limit in minutes (default 60)")
    p.add_argument("--image", default=None, help="Enroot .sqsh image; tasks run in it through Pyxis")
    p.add_argument("--container_mounts", default=None,
                   help="Pyxis mounts SRC:DST[,...]; a run path outside them is refused (default: the current dir, "
                        "--folder and every path the train flags name, each at its own place)")
    p.add_argument("--account", default=None, help="Slurm account")
    p.add_argument("--qos", default=None, help="Slurm quality of service")
    p.add_argument("--constraint", default=None, help="Slurm node features, e.g. p5.48xlarge")
    p.add_argument("--segment", type=int, default=None,
                   help="Slurm --segment: nodes that must share one block of the topology/block plugin, e.g. one "
                        "NVLink domain of a GB200 NVL72 rack (at most 18; Slurm 24.05+ with topology/block)")
    p.add_argument("--job_name", default="llama-fp8", help="Slurm job name (default llama-fp8)")
    p.add_argument("--folder", default="logs/submitit", help="submitit folder: logs and pickles (default logs/submitit)")
    p.add_argument("--python", default=None,
                   help="python on the nodes (default: this interpreter, or `python` with --image)")
    p.add_argument("--wait", action="store_true", help="stream the log and return the job's exit status")
    p.add_argument("--estimate", choices=["0", "1"], default="1",
                   help="1: with --gpus_per_node, estimate here first (llama_fp8 estimate) and do not submit a run "
                        "that does not fit the GPUs' memory (default 1)")
    p.add_argument("--estimate_gpu", default="H100",
                   help="the GPU the estimate checks against: a name llama_fp8 estimate --gpu takes (default H100)")
    return p


def estimate_fits(args: argparse.Namespace, train_args: list[str]) -> bool:
    """``llama_fp8 estimate`` for this job's nodes and GPUs (its report, with what would make it fit, on stdout); False
    when the run does not fit (exit 4, or 5: as estimated through a stand-in for the job's model implementation, an
    approximation the report states), as the batch scripts' pre-job check decides. A run it cannot estimate (2) and
    an error of the estimate itself are submitted with a warning: training reports its own errors."""
    from llama_fp8.estimate import cli

    try:
        rc = cli.main([*train_args, "--nodes", str(args.nodes), "--gpus_per_node", str(args.gpus_per_node), "--gpu",
                       args.estimate_gpu])
    except Exception as e:  # noqa: BLE001 - the estimate's own failure is no reason to hold the job back
        print(f"llama-fp8 submit: warning: the estimate failed ({type(e).__name__}: {e}); submitting (--estimate 0 "
              f"skips it)", file=sys.stderr)
        return True
    if rc == EXIT_STAND_IN_DOES_NOT_FIT:
        print("llama-fp8 submit: it does not fit as estimated through a stand-in for the job's model implementation "
              "(report above), an approximation", file=sys.stderr)
    elif rc not in (0, EXIT_DOES_NOT_FIT):
        print(f"llama-fp8 submit: warning: the estimate could not decide (exit code {rc}); submitting",
              file=sys.stderr)
    return rc not in (EXIT_DOES_NOT_FIT, EXIT_STAND_IN_DOES_NOT_FIT)


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(own flags, train flags): train flags are everything after the first `--`."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def validate(args: argparse.Namespace) -> None:
    """ValueError naming the flag for impossible values."""
    for name in ("nodes", "time"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.gpus_per_node < 0:
        raise ValueError(f"--gpus_per_node must be >= 0, got {args.gpus_per_node}")
    if args.tasks_per_node is not None and args.tasks_per_node < 1:
        raise ValueError(f"--tasks_per_node must be >= 1, got {args.tasks_per_node}")
    if args.segment is not None and args.segment < 1:
        raise ValueError(f"--segment must be >= 1, got {args.segment}")
    if args.segment is not None and args.nodes > args.segment and args.nodes % args.segment:
        raise ValueError(f"--segment {args.segment} does not divide --nodes {args.nodes}: Slurm requires a node count "
                         "above the segment size to be a multiple of it (Topology Guide, --segment)")
    from llama_fp8.estimate import gpus  # the GPU table (imports nothing else)

    if args.estimate_gpu not in gpus.names():
        raise ValueError(f"--estimate_gpu {args.estimate_gpu!r} is not valid; valid: {', '.join(gpus.names())}")
    if args.image is not None and not Path(args.image).exists() and (
            args.image.endswith((".sqsh", ".squashfs")) or args.image.startswith(("/", "./", "../"))):
        raise ValueError(f"--image {args.image}: no such file (give a .sqsh path or a registry image)")


def image_argument(image: str) -> str:
    """An existing image file as an absolute path: Pyxis treats an image that does not start with "/" or "."
    as a registry name (pyxis_slurmstepd.c, strspn(image, "./")). Registry images are passed as they are."""
    return str(Path(image).resolve()) if Path(image).exists() else image


JOB_LIB = Path(__file__).with_name("job_lib.sh")
"""The batch scripts' steps (bash): the one owner of how a node is set up for a job."""


def shell_functions(text: str, *names: str) -> list[str]:
    """The definitions of bash functions ``names`` in ``text`` (a function runs from ``name() {`` to the first
    line that is ``}``), in the order asked."""
    lines = text.splitlines()
    out = []
    for name in names:
        start = next((i for i, ln in enumerate(lines) if ln.startswith(f"{name}() {{")), None)
        if start is None:
            raise ValueError(f"{JOB_LIB.name} defines no function {name}")
        end = lines.index("}", start)
        out += lines[start:end + 1]
    return out


def host_setup(folder: Path) -> list[str]:
    """Lines submitit puts in the batch script before its `srun` (bash, on the batch host where Slurm's client
    tools are): the batch scripts' own EFA/NCCL settings and rendezvous address (job_lib.sh's functions,
    copied in: the tasks may run in a container without them), and the requeue trap."""
    marker = f"{folder}/$SLURM_JOB_ID/{REQUEUE_MARKER}"
    return [
        "# llama-fp8: node setup from cluster/launch/job_lib.sh (the batch scripts' own functions)",
        *shell_functions(JOB_LIB.read_text(), "lf_efa_devices", "lf_setup_efa", "lf_setup_rendezvous"),
        "lf_setup_efa",
        "lf_setup_rendezvous",
        'export MASTER_ADDR="$RDZV_ADDR" MASTER_PORT="$RDZV_PORT"',
        "# llama-fp8: training saved a checkpoint and exited 85: requeue from here, where scontrol exists",
        "llama_fp8_requeue() {",
        "    llama_fp8_rc=$?",
        f'    if [ -e "{marker}" ] || [ "$llama_fp8_rc" -eq {EXIT_REQUEUE} ]; then',
        f'        rm -f "{marker}"',
        '        echo "llama-fp8: checkpoint saved (exit $llama_fp8_rc): requeueing job $SLURM_JOB_ID"',
        '        scontrol requeue "$SLURM_JOB_ID" && exit 0',
        "    fi",
        "}",
        "trap llama_fp8_requeue EXIT",
    ]


def executor_parameters(args: argparse.Namespace, train_args: list[str] | None = None) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for the parsed own flags (train flags: for the container mounts)."""
    train_args = train_args or []
    tasks = args.tasks_per_node or (args.gpus_per_node or 1)
    params: dict[str, Any] = {
        "job_name": args.job_name,
        "nodes": args.nodes,
        "ntasks_per_node": tasks,
        "time": args.time,
        "stderr_to_stdout": True,
        # USR1 120 s before the limit (training saves and asks for a requeue), like the sbatch.
        "additional_parameters": {"signal": "USR1@120", "requeue": True},
    }
    if args.gpus_per_node:
        params["gpus_per_node"] = args.gpus_per_node
    if args.segment is not None:  # submitit writes it as #SBATCH --segment=N
        params["additional_parameters"]["segment"] = args.segment
    for name in ("cpus_per_task", "partition", "account", "qos", "constraint"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    params["setup"] = host_setup(Path(args.folder).resolve())
    if args.image:
        params["srun_args"] = [f"--container-image={image_argument(args.image)}",
                               f"--container-mounts={container_mounts(args, train_args)}",
                               f"--container-workdir={Path.cwd()}"]
    return params


def container_mounts(args: argparse.Namespace, train_args: list[str]) -> str:
    """--container_mounts checked against every path the run touches (ValueError naming an uncovered one), or,
    when not given, the current dir, --folder and those paths mounted at their own place."""
    cwd = str(Path.cwd())
    paths = mounts.run_paths(mounts.train_path_values(train_args), cwd, dict(os.environ),
                             {"--folder": str(Path(args.folder).resolve())})
    if args.container_mounts:
        bad = mounts.problems(paths, mounts.parse_mounts(args.container_mounts))
        if bad:
            raise ValueError("; ".join(bad) + f" (--container_mounts {args.container_mounts})")
        return args.container_mounts
    base = [mounts.Mount(cwd, cwd)]
    return ",".join(m.spec() for m in mounts.auto_mounts(paths, base))


@dataclass
class TrainTask:
    """What submitit pickles and runs in every Slurm task: `llama_fp8.train.main(train_args)`."""

    train_args: list[str]

    def __call__(self) -> int:
        import submitit

        release_submitit_signals()
        env = submitit.JobEnvironment()
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:  # exported by host_setup's lines on the batch host (tasks may have no scontrol)
            raise RuntimeError(f"{' and '.join(missing)} not set: the batch script's setup lines (host_setup) did "
                               "not run before srun")
        os.environ.update(RANK=str(env.global_rank), WORLD_SIZE=str(env.num_tasks), LOCAL_RANK=str(env.local_rank),
                          LOCAL_WORLD_SIZE=str(env.num_tasks // env.num_nodes))
        from llama_fp8 import train

        try:
            rc = train.main(list(self.train_args))
        except SystemExit as e:  # argparse-style exits inside training
            rc = e.code if isinstance(e.code, int) else 1
        if rc == EXIT_REQUEUE:
            # No `scontrol` here (maybe a container): the batch script's trap requeues (host_setup). SystemExit
            # passes through submitit's `except Exception`, so this attempt writes no result: the client keeps
            # waiting for the requeued attempt instead of reading 85 as the job's result.
            if env.global_rank == 0:
                (Path(env.paths.folder) / REQUEUE_MARKER).touch()
            raise SystemExit(EXIT_REQUEUE)
        if rc != 0:
            raise RuntimeError(f"training exited with code {rc} on rank {env.global_rank}")
        return rc


def release_submitit_signals() -> None:
    """Undo the handlers submitit's process_job installed before calling the task (submitit/core/
    job_environment.py _handle_signals): on its preemption signal (USR2, or $SUBMITIT_PREEMPT_SIGNAL) one that
    runs `scontrol requeue` from the task, which fails without Slurm's tools and is not our requeue path, and
    on SIGTERM/SIGCONT ones that ignore the signal. Back to the defaults; training installs its own USR1/TERM
    handlers (faults.SignalWatch)."""
    from submitit.core.job_environment import JobEnvironment

    preempt = getattr(signal, "SIG" + JobEnvironment.USR_SIG, signal.SIGUSR2)
    for sig in (signal.SIGTERM, signal.SIGCONT, preempt):
        signal.signal(sig, signal.SIG_DFL)


def stream_until_done(job: Any, poll_s: float = 2.0) -> int:
    """Print the task-0 log as it grows until the job ends; return 0 if every task returned 0."""
    log, offset = Path(job.paths.stdout), 0
    while True:
        done = job.done()
        if log.is_file():
            with log.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        if done:
            break
        time.sleep(poll_s)
    try:
        codes = job.results()
    except Exception as e:  # noqa: BLE001 - any task failure, cancellation or missing result
        state = job.watcher.get_state(job.job_id, mode="force")
        print(f"job {job.job_id} failed ({state}): {' '.join(str(e).strip().splitlines()[-1:])}", file=sys.stderr)
        return 1
    return next((int(c) for c in codes if c), 0)


def submit(args: argparse.Namespace, train_args: list[str], params: dict[str, Any]) -> int:
    """Submit the job; print its id and log; with --wait, stream the log and return its status."""
    try:
        import submitit
    except ImportError as e:
        raise ImportError("`submit` needs submitit: pip install submitit") from e
    python = args.python or ("python" if args.image else sys.executable)
    executor = submitit.SlurmExecutor(folder=Path(args.folder) / "%j", python=python)
    executor.update_parameters(**params)
    job = executor.submit(TrainTask(train_args))
    print(f"submitted job {job.job_id}: train {shlex.join(train_args)}")
    print(f"log: {job.paths.stdout}")
    if not args.wait:
        return 0
    rc = stream_until_done(job)
    print(f"job {job.job_id} finished with exit status {rc}")
    return rc


def main(argv: list[str]) -> int:
    """Entry point of `python -m llama_fp8 submit`; returns the exit code."""
    own, train_args = split_argv(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(own)
        validate(args)
        parse_args(train_args)  # fail here, not after queueing: same parser as `train`
        params = executor_parameters(args, train_args)  # also refuses a path outside --container_mounts
    except SystemExit as e:  # argparse already printed the error naming the flag
        return int(e.code or 0)
    except ConfigError as e:
        print(f"llama-fp8 submit: error in the train flags: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except ValueError as e:
        print(f"llama-fp8 submit: error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if args.gpus_per_node and args.estimate == "1" and not estimate_fits(args, train_args):
        print("llama-fp8 submit: not submitted: the run does not fit the GPUs' memory (report above, ending with what "
              "would make it fit); change it, or --estimate 0 to submit anyway", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return submit(args, train_args, params)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
