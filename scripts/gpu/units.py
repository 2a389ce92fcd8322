"""What a GPU visit runs: units in a fixed order (steps pytest, train: the A/B matrix, memory: memprobe.py, estimate:
``llama_fp8 estimate`` of a cell against its measured memory), their command lines, and the visit's clock. Plans:
``first`` (one visit, by value) and ``all`` (then the rest, over later visits).

The clock (``VisitPlan``): 15 minutes of the node's time a visit, everything included; each command has a hard limit
and a budget a little below it (VISIT_SECONDS); the worst case (every command killed at its limit) is checked.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

STEPS, PLANS, SEED = ("pytest", "train", "memory", "estimate"), ("first", "all"), 1234

# name -> (train flags, seconds a cell takes on one H100). 1B: the CPU rehearsal's start-up and exit at their median
# (~21 s) + CUDA init and weights (~5 s) + the first and the FP8 check's profiled step (~10 s) + 40 steps of 7.4e13
# FLOPs at an assumed 35 % MFU of 989 TFLOPS (~9 s). 3B (AdamW states alone ~51 GB: checkpointing), 7B-8L: guesses.
MODELS: dict[str, tuple[tuple[str, ...], int]] = {
    "llama3.2-1b": (("--model", "llama3.2-1b", "--max_context_width", "4096"), 50),
    "llama3.2-3b": (("--model", "llama3.2-3b", "--max_context_width", "4096", "--activation_checkpointing", "full"),
                    150),
    "llama2-7b-8l": (("--model", "llama2-7b", "--num_layers", "8"), 150),
}
COMPILE_S = 60  # what --compile 1 adds to a cell (Inductor, cold cache): a guess
MEMORY_S = 30  # memprobe.py (rehearsal: 9-10 s without CUDA; + CUDA init, TE's FP8 step, NCCL init)
ESTIMATE_S = 55  # one `llama_fp8 estimate` of a 1B cell on the node's CPU (rehearsal: 44-71 s, median 54)
TE_TESTS_S = 90  # a TE value test set (rehearsal: 26-41 s of pytest start-up and TE import; + the tests on a GPU)


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
        return out + (["--compile", "1"] if self.compile else [])

    def fields(self) -> dict:
        return {"variant": self.name, "impl": self.impl, "fp8": self.fp8, "recipe": self.recipe, "compile": self.compile,
                "backend": self.backend}


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
_TE_GPU = "tests/models/te/test_te_gpu.py::"  # TE vs HF logits (RoPE with/without llama3 scaling; 4096 tokens)
TE_LOGITS_TESTS = (f"{_TE_GPU}test_te_logits_match_hf", f"{_TE_GPU}test_te_logits_match_hf_at_4096_tokens_through_"
                   "the_build_path")
TE_RESUME_TESTS = (f"{_TE_GPU}test_te_fp8_resume_matches_the_uninterrupted_run[delayed]",
                   f"{_TE_GPU}test_te_fp8_resume_matches_the_uninterrupted_run[current]")
PYTEST_SETS = (("te", ("tests/models/te",)),
               ("other", ("tests", "--ignore=tests/models/te", "--ignore=tests/estimate/test_estimate_gpu.py")),
               ("estimate", ("tests/estimate/test_estimate_gpu.py", "-s")))
# The headline: TE BF16 against TE FP8 (current scaling), the same implementation, in interleaved pairs (the A/B's
# own schedule: bf16 fp8, then fp8 bf16, pair i with seed SEED + i - 1), so that a node's drift lands on both arms.
HEADLINE_MODEL = "llama3.2-1b"
HEADLINE = (("te-bf16", 1), ("te-fp8-current", 1), ("te-fp8-current", 2), ("te-bf16", 2))


@dataclass(frozen=True)
class Options:  # what the verify flags decide
    device: str = "cuda"
    models: tuple[str, ...] = tuple(MODELS)
    max_steps: int = 40  # 10 warm-up + 30 timed steps
    warmup: int = 10
    logging_freq: int = 5
    train_batch_size: int = 2
    rehearse: bool = False  # a CPU rehearsal: training cells run as their CPU twins (rehearsal_twin)


@dataclass(frozen=True)
class Unit:
    id: str
    step: str
    estimate_s: float  # for the budget rule: a unit is not started with less left than this
    timeout_s: float  # its own limit: killed there, recorded as timeout
    info: dict = field(default_factory=dict)


def train_flags(opts: Options, model: str, variant: Variant, run_dir: Path, seed: int = SEED) -> list[str]:
    """Flags of one cell (after ``llama_fp8 train``): a model of MODELS, or a preset (``tiny`` for CPU tests)."""
    shape = MODELS[model][0] if model in MODELS else ("--model", model)
    return [*shape, "--seed", str(seed), "--device", opts.device, "--train_batch_size", str(opts.train_batch_size),
            "--max_steps", str(opts.max_steps), "--logging_freq", str(opts.logging_freq), "--run_dir", str(run_dir),
            "--dataset", "synthetic", *variant.flags()]


def rehearsal_twin(variant: Variant) -> tuple[str, Variant]:
    """What a CPU rehearsal runs for a training cell: the tiny preset, the HF model in place of TE (TE's kernels
    need CUDA), eager, torchao's FP8 tensorwise (emulated on CPU) in place of any FP8 recipe."""
    if not variant.fp8:
        return "tiny", VARIANT["hf-bf16"]
    return "tiny", Variant("hf-fp8-tensorwise-eager", "hf", True, "tensorwise")


def train_unit(model: str, v: Variant, pair: int = 1) -> Unit:
    """One run of a matrix cell; ``pair`` > 1: the cell again in a later pair of an interleaved A/B."""
    base = MODELS.get(model, ((), 60))[1]
    estimate = 30 if v.expect == "refuse" else base + COMPILE_S * v.compile
    return Unit(f"train/{model}/synthetic/{v.name}" + (f"/pair{pair}" if pair > 1 else ""), "train", estimate, 480,
                {"model": model, "data": "synthetic", **v.fields(), "pair": pair, "seed": SEED + pair - 1})


def estimate_unit(cell: Unit) -> Unit:
    """``llama_fp8 estimate`` of a training cell (its own flags), set against that cell's measured memory."""
    return Unit(cell.id.replace("train/", "estimate/", 1), "estimate", ESTIMATE_S, 240, {**cell.info, "cell": cell.id})


def first_plan() -> list[Unit]:
    """A first visit by value: the headline, the memory terms and the estimate of its FP8 configuration, TE vs HF
    logits; then (a later visit, by the clock) the BF16 configuration's estimate and HF BF16 (-> TE FP8)."""
    head = [train_unit(HEADLINE_MODEL, VARIANT[v], pair) for v, pair in HEADLINE]
    return [*head, Unit("memory/terms", "memory", MEMORY_S, 180, {}), estimate_unit(head[1]),
            Unit("pytest/te-logits", "pytest", TE_TESTS_S, 300, {"args": list(TE_LOGITS_TESTS)}),
            estimate_unit(head[0]), train_unit(HEADLINE_MODEL, VARIANT["hf-bf16"])]


def plan(opts: Options, which: str = "all") -> list[Unit]:
    """Every unit of plan ``which``, in the order a visit runs them, each once."""
    units = first_plan()
    if which == "all":
        units += [Unit("pytest/te-resume", "pytest", TE_TESTS_S, 300, {"args": list(TE_RESUME_TESTS)})]
        units += [train_unit(HEADLINE_MODEL, VARIANT[v]) for v in ("hf-bf16-compile", "hf-fp8-tensorwise")]
        units += [Unit(f"pytest/{name}", "pytest", 300, 540, {"args": list(a)}) for name, a in PYTEST_SETS]
        units += [train_unit(model, v) for model in opts.models for v in VARIANTS]
    return [u for i, u in enumerate(units) if u.id not in {v.id for v in units[:i]}]  # each once, where first


def select(units: list[Unit], only: tuple[str, ...] | None, match: tuple[str, ...] | None) -> list[Unit]:
    """Units of the ``only`` steps whose id matches one of the ``match`` globs (None: any)."""
    return [u for u in units if (not only or u.step in only)
            and (not match or any(fnmatch.fnmatchcase(u.id, m) for m in match))]


# --- the visit's clock -----------------------------------------------------------------------------------------
VISIT_S = 15 * 60  # the node's time for a visit, everything included
VISIT_WORST_S = 780  # what the plan may take at worst: 2 minutes kept back
NODE_START_S = 120  # the node's start (1-2 minutes)
# Carrying the working tree and the kit in (up to 64 MiB) and the output folder back: not measured here, an
# allowance per command
TRANSFER_IN_S, TRANSFER_OUT_S = 30, 15
GAP_S = 10  # the second command is sent at once (the node stays warm ~30 s after a command)
RELEASE_S = 10  # the node handed back at once after the last command, not left idle
SECOND_MIN_LEFT_S = 240  # the second command only when this much of the visit is left (a new start needs 4 min)
END_S = 20  # a command's own budget ends this long before its hard limit: logs bundled, exit before the kill
MARGIN_S = 15  # verify.py's budget ends this long before the command's (visit.sh)
INSTALL_S = 65  # the first install: the kit, TE's import, one TE FP8 step, versions (rehearsal: 59-71 s)
REUSE_S = 25  # a later command on the same node: the kit's manifest matches, only TE's import is checked


@dataclass(frozen=True)
class Command:
    limit_s: int  # the node's hard limit for the command (it is killed there)
    install_s: int  # what its install takes by the estimates

    @property
    def budget_s(self) -> int:  # visit.sh's VISIT_SECONDS
        return self.limit_s - END_S

    @property
    def units_s(self) -> int:  # what verify.py has for units
        return self.budget_s - self.install_s - MARGIN_S

    def worst_s(self) -> int:  # carried in, killed at its limit, the output carried back
        return TRANSFER_IN_S + self.limit_s + TRANSFER_OUT_S


COMMANDS = (Command(400, INSTALL_S), Command(150, REUSE_S))  # the first visit: the main command, a short second


@dataclass(frozen=True)
class VisitPlan:
    commands: list[list[Unit]]  # the units each command runs, by the estimates

    def worst_s(self) -> int:
        """The visit at worst: the node's start, each command killed at its limit with its transfers, the gap
        before the second, the node handed back."""
        used = COMMANDS[:len(self.commands)]
        return NODE_START_S + sum(c.worst_s() for c in used) + GAP_S * (len(used) - 1) + RELEASE_S

    def left_before_second_s(self) -> int:  # the visit after the first command at its worst
        return VISIT_S - NODE_START_S - COMMANDS[0].worst_s()

    def lines(self) -> list[str]:
        out = [f"node start ~{NODE_START_S} s; transfers ~{TRANSFER_IN_S} s in, ~{TRANSFER_OUT_S} s out a command"]
        for i, (units, c) in enumerate(zip(self.commands, COMMANDS), 1):
            out.append(f"command {i}: limit {c.limit_s} s (VISIT_SECONDS={c.budget_s}): install ~{c.install_s} s, "
                       f"{len(units)} units ~{sum(u.estimate_s for u in units):.0f} s of {c.units_s} s")
        out.append(f"visit at worst: {self.worst_s()} s of {VISIT_S} (the plan's bound {VISIT_WORST_S}); the second "
                   f"command only with >= {SECOND_MIN_LEFT_S} s left (after the first at worst: "
                   f"{self.left_before_second_s()} s)")
        return out


def pack(units: list[Unit], budgets: tuple[int, ...]) -> list[list[Unit]]:
    """How verify.py's budget rule splits ``units`` over commands with these unit budgets (by the estimates; the
    last budget repeats): a unit starts only when what is left covers its estimate, except the first of a command."""
    commands: list[list[Unit]] = []
    left = 0.0
    for u in units:
        if not commands or left < u.estimate_s:
            commands.append([])
            left = budgets[min(len(commands) - 1, len(budgets) - 1)]
        commands[-1].append(u)
        left -= u.estimate_s
    return commands


def first_visit(units: list[Unit] | None = None) -> VisitPlan:
    """The first visit: its units packed into COMMANDS by the estimates, only as many commands as COMMANDS has."""
    packed = pack(first_plan() if units is None else units, tuple(c.units_s for c in COMMANDS))
    return VisitPlan(packed[:len(COMMANDS)])
