"""The shell scripts survive bash 4.2 (Amazon Linux 2 login and compute nodes) and HyperPod's rules.

bash < 4.4 treats "${a[@]}" of an array without elements as an unbound variable under `set -u` (bash CHANGES,
bash-4.4-beta2, "Using ${a[@]} or ${a[*]} with an array without any assigned elements when the nounset option
is enabled no longer throws an unbound variable error"). No bash 4.2 here, so the rule is checked statically:
an array that can be empty (declared empty, filled by `read -a`/`mapfile`, or assigned conditionally from
nothing) may only be expanded as ${a[@]+"${a[@]}"}.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from slurm_helpers import REPO

SHELL_FILES = sorted({*REPO.glob("*.sh"), *REPO.glob("*.sbatch"), *REPO.glob("scripts/**/*.sh"),
                      *REPO.glob("scripts/**/*.sbatch")})

_ASSIGN = re.compile(r"(?:^|[\s;(])(?:local\s+(?:-a\s+)?|declare\s+-a\s+)?([A-Za-z_]\w*)(\+?)=\(()", re.M)
_READ_ARRAY = re.compile(r"\bread\b[^;|&]*\s-a\s+([A-Za-z_]\w*)|\b(?:mapfile|readarray)\b[^;|&]*?\s([A-Za-z_]\w*)\s*(?:<|$)")
_DECLARE_EMPTY = re.compile(r"\b(?:local|declare)\s+-a\s+([A-Za-z_]\w*)\s*(?:$|;)")
_EXPANSION = re.compile(r"\$\{(!?)([A-Za-z_]\w*)\[[@*]\]([^}]*)\}")


def _body(rest: str) -> str:
    """The text inside the parentheses of `name=(...)` (single line; continuation lines are joined first)."""
    depth, out = 1, []
    for ch in rest:
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            break
        out.append(ch)
    return "".join(out).strip()


def possibly_empty_arrays(text: str) -> set[str]:
    """Arrays with at least one assignment that can leave them empty."""
    code = "\n".join(line.split(" #", 1)[0] for line in text.replace("\\\n", " ").splitlines()
                     if not line.lstrip().startswith("#"))
    empty = set()
    for m in _ASSIGN.finditer(code):
        name, plus = m.group(1), m.group(2)
        if not plus and not _body(code[m.start(3):]):  # the literal may span lines
            empty.add(name)
    for m in _READ_ARRAY.finditer(code):
        empty.add(m.group(1) or m.group(2))
    empty.update(_DECLARE_EMPTY.findall(code))
    return empty


def unsafe_expansions(text: str) -> list[str]:
    """`${a[@]}` / `${a[*]}` / `${!a[@]}` of a possibly-empty array outside the ${a[@]+...} guard."""
    empty = possibly_empty_arrays(text)
    bad = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("#"):
            continue
        for m in _EXPANSION.finditer(line):
            bang, name, tail = m.groups()
            guarded = tail.startswith("+")
            if name in empty and not guarded:
                bad.append(f"line {n}: {m.group(0)} ({name} can be empty)")
    return bad


def test_checker_catches_the_bash42_failure_modes():
    """The checker itself: flags what aborts on bash 4.2, passes the guarded and never-empty forms."""
    bad = 'x=()\nif c; then x=(--a b); fi\ncmd "${x[@]}"\nread -r -a y <<<"$Y"\ncmd "${y[@]}"\n'
    assert [b.split(":")[0] for b in unsafe_expansions(bad)] == ["line 3", "line 5"]
    good = ('x=()\ncmd ${x[@]+"${x[@]}"}\nz=(a b)\nz+=(c)\ncmd "${z[@]}"\necho "${#x[@]}"\n'
            'for i in ${x[@]+"${x[@]}"}; do :; done\n')
    assert unsafe_expansions(good) == []


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_no_empty_array_expansion_that_breaks_bash42(path: Path):
    assert not unsafe_expansions(path.read_text()), "\n".join(unsafe_expansions(path.read_text()))


def test_the_old_train_script_pattern_is_caught():
    """1.train_llama.sbatch had `DEVICE_ARGS=()` ... `train "${DEVICE_ARGS[@]}" "$@"` (DEVICE=auto leaves it
    empty): exactly what the checker must refuse."""
    old = 'DEVICE_ARGS=()\nif [[ "$DEVICE" != auto ]]; then DEVICE_ARGS=(--device "$DEVICE"); fi\n' \
          'srun python -m llama_fp8 train "${DEVICE_ARGS[@]}" "$@"\n'
    assert unsafe_expansions(old) == ['line 3: ${DEVICE_ARGS[@]} (DEVICE_ARGS can be empty)']


def test_auto_resume_is_an_srun_flag_only():
    """HyperPod's --auto-resume=1: never an #SBATCH directive nor an sbatch option (sbatch rejects it)."""
    for path in SHELL_FILES:
        for n, line in enumerate(path.read_text().replace("\\\n", " ").splitlines(), 1):
            if "--auto-resume" in line:
                assert not line.startswith("#SBATCH"), f"{path.name}:{n}"
                assert not re.search(r"\bsbatch\b[^|;]*--auto-resume", line), f"{path.name}:{n}"


def run_lib(script: str, tmp_path: Path, hyperpod: bool) -> list[list[str]]:
    """Source scripts/slurm/job_lib.sh under `set -euo pipefail` with srun replaced by a recorder; return the
    argument lists srun got."""
    calls = tmp_path / "srun.calls"
    harness = f"""
set -euo pipefail
source {REPO}/scripts/slurm/job_lib.sh
srun() {{ printf '%s\\x1f' "$@" >>{calls}; printf '\\x1e' >>{calls}; }}
scontrol() {{ if [[ "$*" == "show hostnames n[1-2]" ]]; then printf 'n1\\nn2\\n'; fi; }}
lf_is_hyperpod() {{ {'true' if hyperpod else 'false'}; }}
SLURM_JOB_NUM_NODES=2 SLURM_JOB_NODELIST='n[1-2]' SLURM_JOB_ID=7 CPUS=4 NPROC_PER_NODE=2 DEVICE=cpu RDZV_PORT=29507
RDZV_ADDR=10.0.0.1 LF_NODE_ADDRS='n1=10.0.0.1 n2=10.0.0.2'
PY=(python) CONTAINER_ARGS=() DEVICE_ARGS=() PWD={tmp_path}
{script}
"""
    proc = subprocess.run(["bash", "-c", harness], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return [c.split("\x1f")[:-1] for c in calls.read_text().split("\x1e")[:-1]] if calls.exists() else []


def test_auto_resume_reaches_the_training_step_only(tmp_path):
    """On HyperPod the training srun carries --auto-resume=1, the preflight srun does not; elsewhere neither.
    Empty DEVICE_ARGS/CONTAINER_ARGS expand to nothing (no empty argument, no unbound-variable abort)."""
    (tmp_path / "hp").mkdir()
    preflight_call, train_call = run_lib("lf_preflight --model tiny; lf_train --model tiny", tmp_path / "hp",
                                         hyperpod=True)
    assert "--auto-resume=1" in train_call and "--auto-resume=1" not in preflight_call
    assert "" not in train_call and train_call[-3:] == ["train", "--model", "tiny"]
    (tmp_path / "plain").mkdir()
    plain = run_lib("lf_train --model tiny", tmp_path / "plain", hyperpod=False)
    assert not any("--auto-resume" in a for a in plain[0])
