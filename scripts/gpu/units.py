"""What a GPU visit runs, as a list of units in a fixed order, and the command line of each.

Steps, in order: pytest (``pytest -m gpu``, the TE tests first, then the rest: save/resume under each recipe is
one of them), bench (``benchmarks/bench_linear.py``), train (the A/B matrix through ``python -m llama_fp8
train``), profile (one configuration under the trainer's profiler). A unit's id names it in the results file;
``verify.py --match`` selects ids by glob.

Two plans: ``first`` (a first visit to a GPU node: the essentials in about 25 minutes of the node's time, in
three commands; ``first_visit_seconds`` adds it up) and ``all`` (everything, over later visits).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

STEPS = ("pytest", "bench", "train", "profile")
PLANS = ("first", "all")
SEED = 1234
TOKENS = 8192  # bench_linear rows: the training batch below (2 sequences of 4096)

# name -> (train flags, seconds a cell of it takes (start-up + 40 steps), a guess for the budget check). The three shapes:
# Llama 3.2 1B and 3B at 4096 tokens (3B with activation checkpointing: FP32 AdamW states alone take
# ~51 GB of the 80), and the AWS sample's Llama 2 7B shape cut to 8 layers.
MODELS: dict[str, tuple[tuple[str, ...], int]] = {
    "llama3.2-1b": (("--model", "llama3.2-1b", "--max_context_width", "4096"), 75),
    "llama3.2-3b": (("--model", "llama3.2-3b", "--max_context_width", "4096", "--activation_checkpointing", "full"),
                    150),
    "llama2-7b-8l": (("--model", "llama2-7b", "--num_layers", "8"), 150),
}
DATA = ("synthetic", "text")


@dataclass(frozen=True)
class Variant:
    name: str
    impl: str  # --model_impl
    fp8: bool
    recipe: str | None = None  # --fp8_recipe
    compile: bool = False
    expect: str = "run"  # run | refuse (must be refused: mxfp8 on Hopper) | may_refuse (where supported)

    @property
    def backend(self) -> str | None:
        return None if not self.fp8 else ("te" if self.impl == "te" else "torchao")

    def flags(self) -> list[str]:
        out = ["--model_impl", self.impl, "--fp8", "1" if self.fp8 else "0"]
        if self.fp8:
            out += ["--fp8_backend", self.backend, "--fp8_recipe", self.recipe]
        if self.compile:
            out += ["--compile", "1"]
        return out

    def fields(self) -> dict:
        return {"variant": self.name, "impl": self.impl, "fp8": self.fp8, "recipe": self.recipe,
                "compile": self.compile, "backend": self.backend}


# torchao's FP8 needs torch.compile to be fast, so HF FP8 runs compiled and has a compiled BF16 baseline;
# TE's layers are fused already and TE's delayed recipe refuses --compile 1: TE cells run eager.
VARIANTS = (
    Variant("hf-bf16", "hf", False),
    Variant("hf-bf16-compile", "hf", False, compile=True),
    Variant("hf-fp8-tensorwise", "hf", True, "tensorwise", compile=True),
    Variant("hf-fp8-rowwise", "hf", True, "rowwise", compile=True),
    Variant("te-bf16", "te", False),
    Variant("te-fp8-delayed", "te", True, "delayed"),
    Variant("te-fp8-current", "te", True, "current"),
    Variant("te-fp8-block", "te", True, "block", expect="may_refuse"),
    Variant("te-fp8-mxfp8", "te", True, "mxfp8", expect="refuse"),
)
VARIANT = {v.name: v for v in VARIANTS}
# The GPU test that compares TE and HF logits at 4096 tokens through the build path from a save_pretrained
# checkpoint (--init_from_hf): one of the first visit's TE value tests.
HF_INIT_TEST = "tests/models/te/test_te_gpu.py::test_te_logits_match_hf_at_4096_tokens_through_the_build_path"
# The estimate's GPU test last, as a unit of its own: llama_fp8 estimate against the node's own memory counters.
PYTEST_SETS = (("te", ("tests/models/te",)),
               ("other", ("tests", "--ignore=tests/models/te", "--ignore=tests/estimate/test_estimate_gpu.py")),
               ("estimate", ("tests/estimate/test_estimate_gpu.py", "-s")))
# The first visit's TE value tests: TE vs HF logits (RoPE with and without llama3 scaling; 4096 tokens through
# the build path), TE FP8 save/resume under current and delayed scaling.
_TE_GPU = "tests/models/te/test_te_gpu.py::"
TE_VALUE_TESTS = (f"{_TE_GPU}test_te_logits_match_hf", HF_INIT_TEST,
                  f"{_TE_GPU}test_te_fp8_resume_matches_the_uninterrupted_run[delayed]",
                  f"{_TE_GPU}test_te_fp8_resume_matches_the_uninterrupted_run[current]")
# The first visit's A/B core cells (seq 4096, synthetic data) and its one GEMM benchmark (the 3B shapes).
FIRST_CELLS = (("llama3.2-1b", ("hf-bf16", "hf-fp8-tensorwise", "te-bf16", "te-fp8-current")),
               ("llama3.2-3b", ("te-bf16", "te-fp8-current")))
FIRST_BENCH_MODEL = "llama3.2-3b"
# What each command of a visit pays besides its units (a guess, seconds): a fresh node start (the node is idle
# between commands) and the install (the kit with a prebuilt TE extension, one TE FP8 step, the versions probe).
NODE_START_S, INSTALL_S = 120, 45
VISIT_COMMAND_S = 540  # one command's budget (visit.sh VISIT_SECONDS)
BENCH_SETS = (("current", "tensorwise"), ("delayed", "rowwise"), ("block", "tensorwise"))


@dataclass(frozen=True)
class Options:
    """What the verify flags decide (and a few shapes that only tests change)."""

    device: str = "cuda"
    models: tuple[str, ...] = tuple(MODELS)
    data: tuple[str, ...] = DATA
    max_steps: int = 40  # synthetic cells: 10 warm-up + 30 timed steps
    text_steps: int = 100  # real-text cells: the loss goal is stated after 100 steps
    warmup: int = 10
    logging_freq: int = 5
    train_batch_size: int = 2
    profile_cell: str = "llama3.2-1b/synthetic/te-fp8-current"
    profile_steps: str = "21:23"


@dataclass(frozen=True)
class Unit:
    id: str
    step: str
    estimate_s: float  # for the budget check: a unit is not started with less left than this
    timeout_s: float  # its own limit: killed there, recorded as timeout
    info: dict = field(default_factory=dict)


def model_flags(name: str) -> tuple[str, ...]:
    """The issue's shapes by name; any other name is a preset (``tiny`` for CPU tests)."""
    return MODELS[name][0] if name in MODELS else ("--model", name)


def train_flags(opts: Options, model: str, data: str, variant: Variant, run_dir: Path,
                demo: tuple[Path, Path] | None) -> list[str]:
    """Flags of one A/B matrix cell (after ``python -m llama_fp8 train``)."""
    steps = opts.text_steps if data == "text" else opts.max_steps
    out = [*model_flags(model), "--seed", str(SEED), "--device", opts.device, "--train_batch_size",
           str(opts.train_batch_size), "--max_steps", str(steps), "--logging_freq", str(opts.logging_freq),
           "--run_dir", str(run_dir), *variant.flags()]
    if data == "text":
        if demo is None:
            raise ValueError("a text cell needs the demo corpus (dataset dir, tokenizer dir)")
        out += ["--dataset", str(demo[0]), "--tokenizer", str(demo[1])]
    else:
        out += ["--dataset", "synthetic"]
    return out


def profile_flags(opts: Options, run_dir: Path, demo: tuple[Path, Path] | None) -> list[str]:
    """The profiled matrix cell, run two steps past the profiled ones."""
    model, data, variant = opts.profile_cell.split("/")
    last = int(opts.profile_steps.split(":")[1])
    short = dataclasses.replace(opts, max_steps=last + 2, text_steps=last + 2)
    return train_flags(short, model, data, VARIANT[variant], run_dir, demo) + [
        "--profile_steps", opts.profile_steps, "--memory_snapshot", "1"]


def train_unit(model: str, data: str, v: Variant) -> Unit:
    base = MODELS.get(model, ((), 60))[1]
    estimate = 30 if v.expect == "refuse" else base + 60 * v.compile + 30 * (data == "text")
    return Unit(f"train/{model}/{data}/{v.name}", "train", estimate, 480, {"model": model, "data": data, **v.fields()})


def bench_unit(te: str, ao: str, models: str | None = None) -> Unit:
    info = {"te_recipe": te, "torchao_recipe": ao, **({"models": models} if models else {})}
    return Unit(f"bench/te-{te}+torchao-{ao}" + (f"/{models}" if models else ""), "bench", 60 if models else 90, 400,
                info)


def first_plan() -> list[Unit]:
    """A first visit, in the order that proves the essentials first: the TE value tests, the 1B A/B core cells,
    the 3B TE cells (the MFU goal), one GEMM benchmark. (The versions block and one TE FP8 step come from the
    install.)"""
    units = [Unit("pytest/te-values", "pytest", 300, 540, {"args": list(TE_VALUE_TESTS)})]
    units += [train_unit(model, "synthetic", VARIANT[v]) for model, names in FIRST_CELLS for v in names]
    return units + [bench_unit("current", "tensorwise", FIRST_BENCH_MODEL)]


def plan(opts: Options, which: str = "all") -> list[Unit]:
    """Every unit of plan ``which`` (``first`` or ``all``), in the order a visit runs them."""
    if which == "first":
        return first_plan()
    units = [Unit(f"pytest/{name}", "pytest", 300, 540, {"args": list(args)}) for name, args in PYTEST_SETS]
    units += [bench_unit(te, ao) for te, ao in BENCH_SETS]
    units += [train_unit(model, data, v) for model in opts.models for data in opts.data for v in VARIANTS]
    units.append(Unit(f"profile/{opts.profile_cell}", "profile", 150, 480, {"cell": opts.profile_cell}))
    return units


def pack(units: list[Unit], command_s: float = VISIT_COMMAND_S - INSTALL_S) -> list[list[Unit]]:
    """How verify.py's budget rule splits ``units`` over commands of ``command_s`` seconds each (by their
    estimates): a unit starts only when what is left covers its estimate, except the first of a command."""
    commands: list[list[Unit]] = []
    left = 0.0
    for u in units:
        if not commands or left < u.estimate_s:
            commands.append([])
            left = command_s
        commands[-1].append(u)
        left -= u.estimate_s
    return commands


def first_visit_seconds(units: list[Unit] | None = None) -> tuple[int, float]:
    """(commands, node seconds) a first visit needs by the estimates: each command pays a node start and the
    install, then runs what fits."""
    commands = pack(first_plan() if units is None else units)
    return len(commands), sum(NODE_START_S + INSTALL_S + sum(u.estimate_s for u in c) for c in commands)


def select(units: list[Unit], only: tuple[str, ...] | None, match: tuple[str, ...] | None) -> list[Unit]:
    """Units of the ``only`` steps (all when None) whose id matches one of the ``match`` globs (all when None)."""
    return [u for u in units if (not only or u.step in only)
            and (not match or any(fnmatch.fnmatchcase(u.id, m) for m in match))]
