"""The report's Reproduce block and ``compare --repro``: what ran (code, image, versions, Slurm jobs and
nodes, commands) per run, and a bash script that re-runs the same A/B.

The A/B launchers (2.ab_fp8_vs_bf16.sh, scripts/demo.sh) keep their exact command in ``ab_command.sh`` at
the top of the A/B folder; runs record their own flags, git state and Slurm job in the meta record
(``repro``, see telemetry/repro.py) and image and versions in ``environment``. Without ``ab_command.sh``
(runs started by hand) the script re-runs each run's training command, then the report.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llama_fp8.report.runs import Run

COMMAND_FILE = "ab_command.sh"
MAX_COMMAND_BYTES = 64 << 10
VERSION_KEYS = ("torch", "cuda", "nccl", "transformer_engine", "torchao", "python")


def run_info(run: Run) -> dict[str, Any]:
    """One run's row of the Reproduce block (None where the run did not record it)."""
    rep = run.meta.get("repro") if isinstance(run.meta.get("repro"), dict) else {}
    env = run.environments[-1] if run.environments else {}
    argv = rep.get("argv") if isinstance(rep.get("argv"), list) else None
    parent = run.source.resolve().parent.parent.name  # AB_DIR/pair<i>/<arm>: name the pair too
    name = f"{parent}/{run.name}" if parent.startswith("pair") else run.name
    return {"run": name, "source": str(run.source), "git_commit": rep.get("git_commit"),
            "git_dirty": rep.get("git_dirty"), "image": env.get("image"), "image_sha256": env.get("image_digest"),
            "versions": {k: env.get(k) for k in VERSION_KEYS if env.get(k)},
            "slurm_job_id": rep.get("slurm_job_id"), "nodes": rep.get("slurm_nodelist") or env.get("nodes"),
            "command": _command(argv, run.meta.get("world_size")) if argv else None}


def _command(argv: list[Any], world_size: Any) -> str:
    """The training command; several ranks under torchrun on one node (multi-node runs come from a launcher,
    whose own command is in ab_command.sh)."""
    if isinstance(world_size, int) and world_size > 1:
        return shlex.join(["torchrun", "--standalone", f"--nproc_per_node={world_size}", "-m", "llama_fp8",
                           *map(str, argv)])
    return shlex.join(["python", "-m", "llama_fp8", *map(str, argv)])


def ab_command(runs: list[Run]) -> tuple[Path, str] | None:
    """The launcher's recorded command: ``ab_command.sh`` in the runs' A/B folder (up to two levels above
    the first run's folder: AB_DIR/bf16 or AB_DIR/pair1/bf16). Size-capped; None when absent."""
    folder = runs[0].source.resolve().parent  # the run dir (or a log file's folder)
    for cand in (folder.parent / COMMAND_FILE, folder.parent.parent / COMMAND_FILE):
        if cand.is_file() and cand.stat().st_size <= MAX_COMMAND_BYTES:
            return cand, cand.read_text(errors="replace")
    return None


def collect(pairs: list[tuple[Run, Run]]) -> dict[str, Any]:
    runs = [r for p in pairs for r in p]
    found = ab_command(runs)
    infos = [run_info(r) for r in runs]
    commits = {i["git_commit"] for i in infos if i["git_commit"]}
    return {"runs": infos, "ab_command_file": str(found[0]) if found else None,
            "ab_command": found[1] if found else None,
            "git_commit": commits.pop() if len(commits) == 1 else None, "git_commits_differ": len(commits) > 1,
            "git_dirty": any(i["git_dirty"] for i in infos)}


def markdown(rep: dict[str, Any]) -> list[str]:
    lines = ["## Reproduce", ""]
    commit = rep["git_commit"] or ("**differs between runs**" if rep["git_commits_differ"] else "not recorded")
    lines += [f"- code: git commit `{commit}`" + (" **with uncommitted changes** (not reproducible from the "
                                                   "commit alone)" if rep["git_dirty"] else ""),
              "- re-run: `python -m llama_fp8 compare <the same runs> --repro > rerun.sh`", ""]
    if rep["ab_command"]:
        lines += [f"Launcher command ({Path(rep['ab_command_file']).name}):", "", "```bash",
                  rep["ab_command"].rstrip(), "```", ""]
    lines += ["| run | Slurm job | nodes | image (sha256) | versions | command |", "|---|---|---|---|---|---|"]
    for i in rep["runs"]:
        image = f"{i['image']} ({i['image_sha256'] or 'no digest'})" if i["image"] else "n/a"
        vers = ", ".join(f"{k} {v}" for k, v in i["versions"].items()) or "n/a"
        cmd = f"`{i['command']}`" if i["command"] else "n/a"
        lines.append(f"| {i['run']} | {i['slurm_job_id'] or 'n/a'} | {i['nodes'] or 'n/a'} | {image} | {vers} | {cmd} |")
    return lines + [""]


def script(rep: dict[str, Any], compare_args: list[str]) -> str:
    """A bash script that re-runs the A/B: at the recorded commit, the launcher's command, or each run's
    training command followed by the report."""
    out = ["#!/bin/bash", "# Re-runs the A/B recorded in these runs (python -m llama_fp8 compare --repro).",
           "set -euo pipefail"]
    if rep["git_commit"]:
        out += [f"# code: git commit {rep['git_commit']}" + (" (the runs had uncommitted changes: they are not "
                                                             "in this commit)" if rep["git_dirty"] else ""),
                f'if [ "$(git rev-parse HEAD)" != {shlex.quote(rep["git_commit"])} ]; then',
                f'    echo "check out {rep["git_commit"]} first (git checkout {rep["git_commit"]})" >&2; exit 1',
                "fi"]
    if rep["ab_command"]:
        out += ["# the launcher's command, as recorded", *rep["ab_command"].rstrip().splitlines()]
        return "\n".join(out) + "\n"
    missing = [i["run"] for i in rep["runs"] if not i["command"]]
    if missing:
        raise ValueError(f"cannot write a re-run script: no recorded command for run(s) {', '.join(missing)} "
                         "(plain logs, or runs from a version that did not record it)")
    out += ["# each run's training command, pair by pair (baseline first), then the report"]
    out += [i["command"] for i in rep["runs"]]
    out.append(shlex.join(["python", "-m", "llama_fp8", "compare", *compare_args]))
    return "\n".join(out) + "\n"
