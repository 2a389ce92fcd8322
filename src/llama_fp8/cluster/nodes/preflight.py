"""`python -m llama_fp8 preflight`: is this job ready to train? One line per check, non-zero exit on failure.

    python -m llama_fp8 preflight --device cuda -- --model llama3.1-8b --fp8=1 --run_dir /fsx/runs/a

Train flags after `--` are parsed and validated exactly as `train` does (presets, --config YAML), and
the checks use the resolved values (device, fp8, fp8_backend, dataset, tokenizer, run dir); own flags
before `--` win.

1.train_llama.sbatch runs it as one task per GPU on every node (SKIP_PREFLIGHT=1 skips it). The first task of
each node checks the node (GPUs and FP8 recipes, TE/torchao, NCCL, EFA and the OFI plugin, the NVLink domain and
IMEX of GB200/GB300 trays, the container mounts, write access, FSx for Lustre, data paths); then all tasks run a
short all-reduce (netcheck.py) that reports the bus bandwidth and the network NCCL chose, fails when EFA devices
exist but NCCL is on TCP sockets, and proves from NCCL's lines that a shared NVLink domain was used (nvlink.py).
Every task exits with the same code. Started as a single process (no Slurm step, no torchrun) it checks this node
only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from llama_fp8.cluster.launch import mounts
from llama_fp8.cluster.nodes import netcheck
from llama_fp8.cluster.nodes.config_checks import (  # noqa: F401 - the checks, importable from here
    check_fp8_features,
    check_layout,
    check_model_impl,
    task_position,
    torch_device,
)
from llama_fp8.cluster.nodes.node_checks import (  # noqa: F401 - the checks, importable from here
    FAIL,
    OK,
    WARN,
    Check,
    Settings,
    check_efa,
    check_fp8_backends,
    check_gpus,
    check_mounts,
    check_nccl,
    check_node_health,
    check_path,
    check_writable,
    efa_devices,
    fp8_recipes,
)
from llama_fp8.cluster.nodes.platform_checks import check_lustre, check_nvlink  # noqa: F401 - importable from here


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m llama_fp8 preflight", allow_abbrev=False,
                                usage="%(prog)s [own flags] [-- TRAIN_FLAGS...]",
                                description="Check GPUs/FP8, TE, torchao, NCCL, EFA, the NVLink domain (GB200/GB300), "
                                            "checkpoint dir, FSx for Lustre, data paths.",
                                epilog="docs: docs/cluster.md")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="as train --device (default auto)")
    p.add_argument("--fp8", choices=["0", "1"], help="FP8 wanted: a GPU without FP8 fails (default 0)")
    from llama_fp8.precision import recipes

    p.add_argument("--model_impl", help="as train --model_impl: the implementation that must be usable")
    p.add_argument("--fp8_backend", choices=["auto", *recipes.backends()], help="the backend that must import")
    p.add_argument("--dataset", help="synthetic, a hub name, or a local path (must exist)")
    p.add_argument("--tokenizer", help="hub name or local path (must exist)")
    p.add_argument("--checkpoint_dir", help="must be writable (default: train --run_dir, else runs)")
    net = p.add_argument_group("network test (all tasks of the job step)")
    net.add_argument("--network_test", choices=["auto", "0", "1"], default="auto",
                     help="all-reduce over every task: auto = when started as several tasks (default auto)")
    net.add_argument("--allreduce_mb", type=_positive(float), default=None,
                     help="all-reduce size in MiB (default 256 on GPU, 4 on CPU)")
    net.add_argument("--allreduce_iters", type=_positive(int), default=10, help="timed all-reduces (default 10)")
    net.add_argument("--timeout", type=_positive(float), default=300.0,
                     help="seconds to wait for every task to join (default 300)")
    p.add_argument("--report", help="write the result as JSON here (first task only)")
    return p


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value
    return parse


def resolve(own: argparse.Namespace, train_args: list[str]) -> Settings:
    """Settings from the train flags (parsed and validated as `train` does; none: the defaults), with
    preflight's own flags applied on top as the same config fields, checked by the same rules.

    Raises llama_fp8.config.ConfigError for bad train flags (argparse-level errors exit 2).
    """
    from llama_fp8 import config

    cfg = config.parse_args(train_args)
    mine = {name: getattr(own, name) for name in ("device", "model_impl", "fp8_backend", "dataset", "tokenizer")
            if getattr(own, name)}
    if own.fp8 is not None:
        mine["fp8"] = own.fp8 == "1"
    if mine:
        cfg = config.resolve(dataclasses.replace(cfg, **mine))
    paths = {f: str(getattr(cfg, f)) for f, _ in mounts.PATH_FLAGS if train_args and getattr(cfg, f, None)}
    for name in ("dataset", "tokenizer", "checkpoint_dir"):
        if getattr(own, name):
            paths[name] = getattr(own, name)
    checkpoint_dir = own.checkpoint_dir or ((cfg.checkpoint_dir or cfg.run_dir or config.default_run_dir())
                                            if train_args else "runs")
    return Settings(cfg=cfg, train_given=bool(train_args), checkpoint_dir=checkpoint_dir, paths=paths)


def run_checks(s: Settings) -> list[Check]:
    """Every check, in report order; a check that crashes is reported as FAIL, not raised."""
    checks = []
    for fn in (check_gpus, check_model_impl, check_fp8_backends, check_fp8_features, check_layout, check_nccl,
               check_efa, check_nvlink, check_node_health, check_mounts, check_writable, check_lustre):
        try:
            out = fn(s)
        except Exception as e:  # noqa: BLE001 - report and keep going
            out = Check(fn.__name__.removeprefix("check_"), FAIL, f"check crashed: {type(e).__name__}: {e}")
        checks += out if isinstance(out, list) else [out]
    checks += [check_path("dataset", s.cfg.dataset), check_path("tokenizer", s.cfg.tokenizer)]
    return checks


def node_summary(checks: list[Check]) -> str:
    failed = [c.name for c in checks if c.status == FAIL]
    warned = sum(c.status == WARN for c in checks)
    return (f"preflight on {netcheck.node_name()}: {len(checks) - len(failed) - warned} ok, {warned} warning(s), "
            f"{len(failed)} failed{': ' + ', '.join(failed) if failed else ''}")


def network(own: argparse.Namespace, s: Settings, node_failed: list[str],
            node_fabric: dict | None = None) -> tuple[list[Check], netcheck.NetResult]:
    device = torch_device(s.cfg.device).type
    res = netcheck.run(device, own.allreduce_mb or netcheck.default_megabytes(device), own.allreduce_iters,
                       own.timeout, len(efa_devices()), node_failed, node_fabric)
    checks = [Check(name, status, message) for name, status, message in netcheck.result_lines(res)]
    for host, names in res.failed_nodes.items():
        checks.append(Check(f"node {host}", FAIL, f"failed: {', '.join(names)}"))
    return checks, res


def main(argv: list[str]) -> int:
    """Entry point of `python -m llama_fp8 preflight`: 0 when nothing failed, 1 otherwise, 2 on bad flags.
    With several tasks, every task returns the same code."""
    own_args, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    try:
        own = build_parser().parse_args(own_args)
        settings = resolve(own, train_args)
    except SystemExit as e:
        return int(e.code or 0)
    except ValueError as e:  # ConfigError is a ValueError
        print(f"preflight: error in the train flags: {e}", file=sys.stderr)
        return 2
    rank, local_rank, tasks = task_position()
    checks = run_checks(settings) if local_rank == 0 else []
    if checks:  # one write per node, so that nodes' blocks do not interleave in the job log
        print("\n".join([c.line() for c in checks] + [node_summary(checks)]), flush=True)
    node_failed = [c.name for c in checks if c.status == FAIL]
    report: dict = {"host": netcheck.node_name(), "checks": [c.__dict__ for c in checks]}
    failed = bool(node_failed)
    bad_nodes = [netcheck.node_name()] if node_failed else []
    if own.network_test == "1" or (own.network_test == "auto" and tasks > 1):
        node_fabric = next((c.data for c in checks if c.name == "nvlink_domain"), None)
        net_checks, res = network(own, settings, node_failed, node_fabric)
        failed = res.failed
        bad_nodes = sorted(res.failed_nodes)
        report["network"] = res.to_dict()
        if rank == 0:
            verdict = "failed" if failed else "passed"
            print("\n".join([c.line() for c in net_checks] +
                            [f"preflight of job step: {res.nodes or '?'} node(s), {res.ranks or tasks} task(s): "
                             f"{verdict}"]), flush=True)
    report["failed_nodes"] = bad_nodes
    if own.report and rank == 0:
        Path(own.report).parent.mkdir(parents=True, exist_ok=True)
        Path(own.report).write_text(json.dumps(report, indent=1, default=str) + "\n")
        # the nodes whose own checks failed, one per line: a requeued job leaves them behind (job_requeue.sh)
        listed = Path(f"{own.report}.failed")
        if bad_nodes:
            listed.write_text("".join(f"{n}\n" for n in bad_nodes))
        else:
            listed.unlink(missing_ok=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
