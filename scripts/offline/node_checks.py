"""What the install asks the node, each wait bounded: TE's import and one FP8 step (at most CHECK_S each, and what
is left of --budget-seconds: ``Clock``), the versions block, the node's torch read without importing it. Standard
library only (install.py runs before anything of the kit is installed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from te_wheel import OFFLINE_ENV, run_bounded  # in this folder

HERE = Path(__file__).resolve().parent
EXIT_BAD_KIT, EXIT_NO_TE = 2, 3
NO_ANSWER = "no answer in"  # a check cut at its time
CHECK_S = 120.0  # at most, each check (TE's import, one FP8 step): TE imports in seconds, a GPU runs the step in one
IMPORT_CHECK = ("import torch\nimport transformer_engine.pytorch\nimport importlib.metadata as m\n"
                "print('transformer_engine.pytorch imports; transformer_engine_torch', "
                "m.version('transformer_engine_torch'))")
# One te.Linear forward + backward on the GPU, under FP8 current scaling where the GPU has FP8 (SM >= 8.9):
# TE's kernels run, not just its import (TE >= 2.9 has te.autocast(recipe=...), older fp8_autocast(fp8_recipe=...)).
KERNEL_CHECK = """\
import sys, time, torch
if not torch.cuda.is_available():
    print("no CUDA device: TE's kernels not run"); sys.exit(0)
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import Float8CurrentScaling
fp8 = torch.cuda.get_device_capability() >= (8, 9)
new = hasattr(te, "autocast")
context = (te.autocast if new else te.fp8_autocast)(**{"enabled": fp8, "recipe" if new else "fp8_recipe": Float8CurrentScaling()})
t0 = time.perf_counter()
layer = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
with context:
    y = layer(x)
y.float().square().mean().backward()
torch.cuda.synchronize()
ok = all(bool(torch.isfinite(t).all()) for t in (y, x.grad, layer.weight.grad))
how = "under FP8 current scaling" if fp8 else "in BF16 (this GPU has no FP8)"
print(f"te.Linear forward+backward {how} on {torch.cuda.get_device_name()}: finite {ok}, {time.perf_counter() - t0:.1f} s")
sys.exit(0 if ok else 1)
"""


class InstallError(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class Clock:
    """What is left of --budget-seconds (None: no bound); every wait of the install is cut to it."""

    def __init__(self, seconds: float | None = None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()

    def bound(self, own: float, what: str, code: int = EXIT_NO_TE) -> float:
        """``own`` cut to what is left; an error naming ``what`` when nothing is left."""
        left = self.left()
        if left is not None and left < 1:
            raise InstallError(f"no time left for {what} (--budget-seconds)", code)
        return own if left is None else min(own, left)


CLOCK = Clock()  # set by run() from --budget-seconds


def say(message: str) -> None:
    print(f"[install] {message}", flush=True)


def torch_versions() -> tuple[str | None, str | None]:
    """(torch.__version__, torch.version.cuda) of this Python's torch, read from its torch/version.py without
    importing torch (an import takes seconds to minutes on a busy node: outside any bound); (None, None) without."""
    build = torch_build()
    return build.get("__version__"), build.get("cuda")


def torch_build() -> dict[str, str | None]:
    """``__version__``, ``cuda``, ``hip`` and ``rocm`` of this Python's torch/version.py (None: the build has none of
    it), read without importing torch; {} without torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(folder) / "version.py").read_text()[:20_000]
        except OSError:
            continue
        found = dict(re.findall(r"^(__version__|cuda|hip|rocm)\s*(?::\s*[^=]+)?=\s*['\"]?([^'\"\n]*)['\"]?", text,
                                re.M))
        if found.get("__version__"):
            return {k: None if found.get(k) in (None, "", "None") else found[k] for k in ("__version__", "cuda", "hip",
                                                                                         "rocm")}
    return {}


def child_env(target: Path) -> dict[str, str]:
    env = {**os.environ, **OFFLINE_ENV}
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(target), os.environ.get("PYTHONPATH", "")) if x)
    return env


def check(target: Path, code: str, what: str) -> tuple[bool, str]:
    """Run ``code`` with TARGET on the path, at most CHECK_S (and what is left): (ok, its last line or the error)."""
    limit = CLOCK.bound(CHECK_S, what)
    try:
        proc = run_bounded([sys.executable, "-c", code], limit, child_env(target))
    except subprocess.TimeoutExpired:
        return False, f"{what}: {NO_ANSWER} {limit:.0f} s"
    text = proc.stdout.strip()
    return proc.returncode == 0, text.splitlines()[-1] if proc.returncode == 0 and text else text[-3000:]


def import_check(target: Path) -> tuple[bool, str]:
    """Does TE's PyTorch extension import from TARGET with this node's torch? (ok, output)"""
    return check(target, IMPORT_CHECK, "TE's import check")


def kernel_check(target: Path) -> tuple[bool, str]:
    """Do TE's kernels run (KERNEL_CHECK)? (ok, its last line or the error)"""
    return check(target, KERNEL_CHECK, "TE's kernel check")


def versions_block(target: Path) -> None:
    try:
        run_bounded([sys.executable, str(HERE / "versions.py")], CLOCK.bound(60, "the versions block"), child_env(target),
                    capture=False)
    except (subprocess.TimeoutExpired, InstallError) as e:  # the block is information: its loss stops nothing
        say(f"versions block not printed: {e}")
