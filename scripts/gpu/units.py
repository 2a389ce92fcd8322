"""What a GPU visit runs, as a list of units in a fixed order, and the command line of each.

Steps: pytest (``pytest -m gpu``, the TE tests first, then the rest: save/resume under each recipe is one of
them), bench (``benchmarks/bench_linear.py``), train (the A/B matrix through ``python -m llama_fp8 train``),
memory (what the node's memory holds besides tensors: memprobe.py), estimate (``python -m llama_fp8 estimate``
of a training cell, set against that cell's measured memory), profile (one configuration under the trainer's
profiler). A unit's id names it in the results file; ``verify.py --match`` selects ids by glob.

Two plans: ``first`` (a first visit to a GPU node: what fits one visit, 15 minutes of the node's time, in one
command and an optional short second, ordered by value; ``first_visit`` adds it up) and ``all`` (the first
visit's units, then everything else, over later visits).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

STEPS = ("pytest", "bench", "train", "memory", "estimate", "profile")
PLANS = ("first", "all")
SEED = 1234
TOKENS = 8192  # bench_linear rows: the training batch below (2 sequences of 4096)

# name -> (train flags, seconds a synthetic-data cell of it takes on one H100: start-up + 40 steps + exit). The
# issue's three shapes: Llama 3.2 1B and 3B at 4096 tokens (3B with activation checkpointing: FP32 AdamW states
# alone take ~51 GB of the 80), and the AWS sample's Llama 2 7B shape cut to 8 layers. 1B: the CPU rehearsal's
# fixed parts at their median, scale 1 (the trainer's start-up 8-35 s, median 18 s, and ~3 s of exit, on 2 shared
# cores: no credit for the node's faster, unshared cores) + CUDA/NCCL init and the weights on the GPU (~5 s) + the
# first step's and the FP8 check's profiled step's overheads (~10 s) + 40 steps of 7.4e13 FLOPs at an assumed 35 %
# MFU of 989 TFLOPS (0.21 s each, ~9 s): ~45 s (scripts/gpu/README.md, "The first visit"). 3B, 7B-8L: guesses.
MODELS: dict[str, tuple[tuple[str, ...], int]] = {
    "llama3.2-1b": (("--model", "llama3.2-1b", "--max_context_width", "4096"), 50),
    "llama3.2-3b": (("--model", "llama3.2-3b", "--max_context_width", "4096", "--activation_checkpointing", "full"),
                    150),
    "llama2-7b-8l": (("--model", "llama2-7b", "--num_layers", "8"), 150),
}
COMPILE_S = 60  # what --compile 1 adds to a cell (Inductor compiling the blocks, cold cache): a guess
MEMORY_S = 30  # memory/terms: memprobe.py (rehearsal: 9-10 s without CUDA; + CUDA init, TE's FP8 step, NCCL init)
ESTIMATE_S = 55  # one `llama_fp8 estimate` of a 1B cell on the node's CPU (rehearsal: 44-71 s, median 54; no GPU work)
TE_TESTS_S = 90  # a TE value test set (rehearsal: 26-41 s of pytest start-up and TE import; + the tests on a GPU)
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
# checkpoint (--init_from_hf): one of the TE value tests.
HF_INIT_TEST = "tests/models/te/test_te_gpu.py::test_te_logits_match_hf_at_4096_tokens_through_the_build_path"
# The estimate's GPU test last, as a unit of its own: llama_fp8 estimate against the node's own memory counters.
PYTEST_SETS = (("te", ("tests/models/te",)),
               ("other", ("tests", "--ignore=tests/models/te", "--ignore=tests/estimate/test_estimate_gpu.py")),
               ("estimate", ("tests/estimate/test_estimate_gpu.py", "-s")))
# The TE value tests: TE vs HF logits (RoPE with and without llama3 scaling; 4096 tokens through the build
# path), then TE FP8 save/resume under current and delayed scaling.
_TE_GPU = "tests/models/te/test_te_gpu.py::"
TE_LOGITS_TESTS = (f"{_TE_GPU}test_te_logits_match_hf", HF_INIT_TEST)
TE_RESUME_TESTS = (f"{_TE_GPU}test_te_fp8_resume_matches_the_uninterrupted_run[delayed]",
                   f"{_TE_GPU}test_te_fp8_resume_matches_the_uninterrupted_run[current]")
BENCH_SETS = (("current", "tensorwise"), ("delayed", "rowwise"), ("block", "tensorwise"))

# --- the first visit ---------------------------------------------------------------------------------------
# The headline: TE BF16 against TE FP8 (current scaling) on one model, the same implementation, in interleaved
# pairs (the A/B's own schedule, llama_fp8.cluster.launch.schedule: bf16 fp8, then fp8 bf16, pair i with seed
# SEED + i - 1), so that a node's slow drift (clocks, heat) lands on both arms; each run is a unit of its own, so
# a command cut short keeps the runs it finished.
HEADLINE_MODEL = "llama3.2-1b"
HEADLINE = (("te-bf16", 1), ("te-fp8-current", 1), ("te-fp8-current", 2), ("te-bf16", 2))
# What a visit pays besides its units (seconds): the node's start (1-2 minutes, counted in the visit's time),
# each command's install and verify.py's versions probe (the kit, TE's import, one TE FP8 forward+backward, the
# versions block: 59-71 s in the CPU rehearsal, where no kernel runs), the idle node between two commands (the
# results taken back, the next call), and the margin visit.sh leaves before its budget's end.
NODE_START_S, INSTALL_S, GAP_S, MARGIN_S = 120, 65, 30, 15
VISIT_S = 15 * 60  # one visit: the node's start, its idle time and every command
COMMANDS_S = (540, 180)  # the first visit's commands: the main one (9 minutes), an optional second on the warm node
VISIT_COMMAND_S = COMMANDS_S[0]  # one command's budget (visit.sh VISIT_SECONDS)


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
    rehearse: bool = False  # a CPU rehearsal: training cells run as their CPU twins (rehearsal_twin)


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
                demo: tuple[Path, Path] | None, seed: int = SEED) -> list[str]:
    """Flags of one A/B matrix cell (after ``python -m llama_fp8 train``)."""
    steps = opts.text_steps if data == "text" else opts.max_steps
    out = [*model_flags(model), "--seed", str(seed), "--device", opts.device, "--train_batch_size",
           str(opts.train_batch_size), "--max_steps", str(steps), "--logging_freq", str(opts.logging_freq),
           "--run_dir", str(run_dir), *variant.flags()]
    if data == "text":
        if demo is None:
            raise ValueError("a text cell needs the demo corpus (dataset dir, tokenizer dir)")
        out += ["--dataset", str(demo[0]), "--tokenizer", str(demo[1])]
    else:
        out += ["--dataset", "synthetic"]
    return out


def rehearsal_twin(variant: Variant) -> tuple[str, Variant]:
    """What a CPU rehearsal runs for a training cell: the tiny preset, on CPU, the HF model in place of TE (TE's
    kernels need CUDA), eager (a compile takes minutes on a few cores), torchao's FP8 tensorwise (emulated on CPU)
    in place of any FP8 recipe. The harness, the trainer and the records run end to end; the numbers mean
    nothing for a GPU."""
    if not variant.fp8:
        return "tiny", VARIANT["hf-bf16"]
    return "tiny", Variant("hf-fp8-tensorwise-eager", "hf", True, "tensorwise")


def profile_flags(opts: Options, run_dir: Path, demo: tuple[Path, Path] | None) -> list[str]:
    """The profiled matrix cell, run two steps past the profiled ones."""
    model, data, variant = opts.profile_cell.split("/")
    last = int(opts.profile_steps.split(":")[1])
    short = dataclasses.replace(opts, max_steps=last + 2, text_steps=last + 2)
    return train_flags(short, model, data, VARIANT[variant], run_dir, demo) + [
        "--profile_steps", opts.profile_steps, "--memory_snapshot", "1"]


def train_unit(model: str, data: str, v: Variant, pair: int = 1) -> Unit:
    """One run of a matrix cell; ``pair`` > 1: the cell again, in a later pair of an interleaved A/B (its own
    seed and id; pair 1 is the matrix's own cell)."""
    base = MODELS.get(model, ((), 60))[1]
    estimate = 30 if v.expect == "refuse" else base + COMPILE_S * v.compile + 30 * (data == "text")
    return Unit(f"train/{model}/{data}/{v.name}" + (f"/pair{pair}" if pair > 1 else ""), "train", estimate, 480,
                {"model": model, "data": data, **v.fields(), "pair": pair, "seed": SEED + pair - 1})


def bench_unit(te: str, ao: str, models: str | None = None) -> Unit:
    info = {"te_recipe": te, "torchao_recipe": ao, **({"models": models} if models else {})}
    return Unit(f"bench/te-{te}+torchao-{ao}" + (f"/{models}" if models else ""), "bench", 60 if models else 90, 400,
                info)


def estimate_unit(cell: Unit) -> Unit:
    """``llama_fp8 estimate`` of a training cell (its own flags), set against that cell's measured memory."""
    return Unit(cell.id.replace("train/", "estimate/", 1), "estimate", ESTIMATE_S, 240, {**cell.info, "cell": cell.id})


def first_plan() -> list[Unit]:
    """A first visit, in the order of what it is worth (issue: "GPU truth, take four"); the install comes first
    in every command (TE's import, one TE FP8 forward+backward, the versions block):
    the headline (TE BF16 vs TE FP8, interleaved pairs), the memory the node holds besides tensors and the
    estimate of the headline's two configurations against their measured memory, then HF BF16 (with the
    headline's TE FP8: HF BF16 -> TE FP8) and the TE vs HF logits tests; TE FP8 save/resume, the compiled torchao
    pair and the rest come in ``all``, after these (``after_first``)."""
    model, data = HEADLINE_MODEL, "synthetic"
    units = [train_unit(model, data, VARIANT[v], pair) for v, pair in HEADLINE]
    units += [Unit("memory/terms", "memory", MEMORY_S, 180, {})]
    units += [estimate_unit(u) for u in units[:2]]
    units.append(train_unit(model, data, VARIANT["hf-bf16"]))
    return units + [Unit("pytest/te-logits", "pytest", TE_TESTS_S, 300, {"args": list(TE_LOGITS_TESTS)})]


def after_first() -> list[Unit]:
    """What the first visit leaves of its last part, first in plan ``all``: TE FP8 save/resume, then the compiled
    torchao pair (HF BF16 compiled against torchao FP8 compiled: torchao's FP8 needs torch.compile to be fast)."""
    return [Unit("pytest/te-resume", "pytest", TE_TESTS_S, 300, {"args": list(TE_RESUME_TESTS)})] + [
        train_unit(HEADLINE_MODEL, "synthetic", VARIANT[v]) for v in ("hf-bf16-compile", "hf-fp8-tensorwise")]


def plan(opts: Options, which: str = "all") -> list[Unit]:
    """Every unit of plan ``which`` (``first`` or ``all``), in the order a visit runs them."""
    first = first_plan()
    if which == "first":
        return first
    later = after_first() + [Unit(f"pytest/{name}", "pytest", 300, 540, {"args": list(args)}) for name, args in PYTEST_SETS]
    later += [bench_unit(te, ao) for te, ao in BENCH_SETS]
    later += [train_unit(model, data, v) for model in opts.models for data in opts.data for v in VARIANTS]
    later.append(Unit(f"profile/{opts.profile_cell}", "profile", 150, 480, {"cell": opts.profile_cell}))
    out: dict[str, Unit] = {}
    for u in first + later:  # each unit once, where it comes first
        out.setdefault(u.id, u)
    return list(out.values())


def command_budget(command_s: float) -> float:
    """Seconds of units one visit.sh command of ``command_s`` runs: what is left after the install and the
    margin (visit.sh passes verify.py ``VISIT_SECONDS`` - its own time so far - the margin)."""
    return command_s - INSTALL_S - MARGIN_S


def pack(units: list[Unit], budgets: tuple[float, ...]) -> list[list[Unit]]:
    """How verify.py's budget rule splits ``units`` over commands with these unit budgets (by the estimates; the
    last budget repeats): a unit starts only when what is left covers its estimate, except the first of a
    command."""
    commands: list[list[Unit]] = []
    left = 0.0
    for u in units:
        if not commands or left < u.estimate_s:
            commands.append([])
            left = budgets[min(len(commands) - 1, len(budgets) - 1)]
        commands[-1].append(u)
        left -= u.estimate_s
    return commands


@dataclass(frozen=True)
class VisitBudget:
    commands: list[list[Unit]]  # the units each command runs, by the estimates
    command_s: list[float]  # each command's time: install + margin + its units
    total_s: float  # the visit: node start + commands + the idle gaps between them

    def lines(self) -> list[str]:
        out = [f"node start ~{NODE_START_S} s"]
        for i, (units, seconds) in enumerate(zip(self.commands, self.command_s), 1):
            limit = COMMANDS_S[i - 1] if i <= len(COMMANDS_S) else COMMANDS_S[-1]
            out.append(f"command {i}: ~{seconds:.0f} s of {limit} s (install ~{INSTALL_S} s, {len(units)} units "
                       f"~{sum(u.estimate_s for u in units):.0f} s, margin {MARGIN_S} s)")
        out.append(f"visit: ~{self.total_s:.0f} s = {self.total_s / 60:.1f} min of {VISIT_S / 60:.0f} "
                   f"(gaps between commands {GAP_S} s each)")
        return out


def first_visit(units: list[Unit] | None = None) -> VisitBudget:
    """What a first visit takes by the estimates: the node's start, then each command (install, margin, its units
    as verify.py's budget rule packs them into COMMANDS_S), with an idle gap between commands."""
    commands = pack(first_plan() if units is None else units, tuple(command_budget(c) for c in COMMANDS_S))
    seconds = [INSTALL_S + MARGIN_S + sum(u.estimate_s for u in c) for c in commands]
    return VisitBudget(commands, seconds, NODE_START_S + sum(seconds) + GAP_S * (len(commands) - 1))


def select(units: list[Unit], only: tuple[str, ...] | None, match: tuple[str, ...] | None) -> list[Unit]:
    """Units of the ``only`` steps (all when None) whose id matches one of the ``match`` globs (all when None)."""
    return [u for u in units if (not only or u.step in only)
            and (not match or any(fnmatch.fnmatchcase(u.id, m) for m in match))]
