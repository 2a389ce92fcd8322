"""The FP8 recipes: one static table, read by the parser (choices and help), the resolver
(``precision.resolve``), preflight, the image's version pins and docs/fp8.md's recipe table
(``recipe_table_markdown``), so that none of them lists recipes by hand.

Every backend's rows are here as data (torchao's and Transformer Engine's, whose FP8 only exists with the
TE model): what each recipe needs in hardware, CUDA, library version, ``--compile`` and FP8 all-gather.
This module imports no FP8 library, no backend and no model, so that parsing flags needs none of them;
the backends (``precision/torchao.py``, ``models/te/fp8/precision.py``) read their rows from here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Capability = tuple[int, int]


@dataclass(frozen=True)
class Dims:
    """A block format's shape rules: every FP8 linear's in and out features (on one tensor-parallel rank), the
    tokens of a micro-batch (per context-parallel rank), the sequence alone (an implementation that blocks the
    sequence dimension) and, with FP8 all-gather, each weight shard's rows must be multiples of these (0: no rule)."""

    features: int = 0
    tokens: int = 0
    sequence: int = 0
    shard_rows: int = 0
    why: str = ""
    """Where the rule comes from (the library's check)."""


@dataclass(frozen=True)
class Recipe:
    """One ``--fp8_recipe``: which backend runs it and what it needs."""

    name: str
    backend: str
    description: str
    min_capability: Capability = (8, 9)
    """Lowest compute capability with the FP8 tensor cores this recipe uses (8.9: Ada, 9.0: Hopper)."""
    max_capability: Capability | None = None
    """First compute capability that no longer runs it (None: no upper bound)."""
    max_capability_why: str = ""
    """Where that upper bound comes from (the library's own check or its own tests), said in the refusal."""
    min_cuda: tuple[tuple[Capability, str], ...] = ()
    """(capability, CUDA version) pairs: on a GPU below that capability, at least that CUDA is needed."""
    min_library: str = "0"
    """Lowest version of the backend's library (torchao or Transformer Engine) that has the recipe."""
    fp8_all_gather_since: str | None = None
    """Library version from which ``--fp8_all_gather 1`` works with this recipe (None: never)."""
    compile: bool = True
    """Works under ``--compile 1``."""
    tensor_parallel: bool = False
    """Has FP8 tensor-parallel layers (``--tp_size > 1`` with FP8)."""
    emulated_on_cpu: bool = False
    """Runs (slowly, for its numerics) without FP8 hardware."""
    stateful: bool = False
    """Keeps scaling state across steps (an amax history), which checkpoints carry so that a resume continues
    with the same scales."""
    default: bool = False
    """What ``--fp8_recipe auto`` picks for this backend (when nothing else decides)."""
    auto_on: tuple[Capability, Capability] | None = None
    """Compute capabilities [from, to) on which ``auto`` prefers this recipe over the backend's default."""
    source: str = ""
    """Where the requirements come from."""
    format: str = "fp8"
    """The number format its GEMMs run in (``FORMATS``): which peak its MFU is measured against."""
    quantizes: str = "inputs, weights and output gradients of every decoder linear (the output head stays BF16)"
    """What it quantizes."""
    dims: Dims | None = None
    """Its dimension rules, refused before anything is built (None: layers that do not divide stay BF16)."""
    needs_compile: bool = False
    """Its published speed-ups need ``--compile 1`` (eager, it is slower than BF16)."""
    bf16_only: bool = False
    """Needs BF16 compute (``--bf16 1``)."""
    min_torch: str = "0"
    """Lowest PyTorch it runs with."""
    checkpoint: str = "BF16/FP32 weights and optimizer states, as a BF16 run"
    """What a checkpoint holds with it, and what of checkpoints it does not support."""
    prototype: bool = False
    """The library marks it a prototype (no backward-compatibility guarantee)."""

    def hardware_problem(self, capability: Capability, cuda: str | None) -> str:
        """Why this recipe cannot run on a GPU of ``capability`` with ``cuda`` (torch.version.cuda), or ''."""
        if capability < self.min_capability:
            return f"needs compute capability >= {_cap(self.min_capability)}"
        if self.max_capability is not None and capability >= self.max_capability:
            why = f" ({self.max_capability_why})" if self.max_capability_why else ""
            return (f"needs compute capability >= {_cap(self.min_capability)} and < "
                    f"{_cap(self.max_capability)}{why}")
        for below, version in self.min_cuda:
            if capability < below and (cuda is None or version_tuple(cuda) < version_tuple(version)):
                where = "" if below >= (99, 0) else f" on compute capability < {_cap(below)}"
                return f"needs CUDA >= {version}{where}"
        return ""


def _cap(c: Capability) -> str:
    return f"{c[0]}.{c[1]}"


def version_tuple(version: str) -> tuple[int, int, int]:
    """Leading ``major.minor[.patch]`` of a version such as ``2.10.0.dev0+abc`` -> (2, 10, 0)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if m is None:
        raise ValueError(f"cannot parse version {version!r} (expected major.minor[.patch])")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def older(version: str, minimum: str) -> bool:
    return version_tuple(version) < version_tuple(minimum)


TORCHAO = "torchao"
TE = "te"
# The Python package each backend needs, in the order ``backends()`` lists them.
LIBRARIES = {TORCHAO: "torchao", TE: "transformer_engine"}

_TORCHAO_SRC = "torchao/float8/config.py (Float8LinearRecipeName), torchao/float8/README.md"
_TE_SRC = ("TE transformer_engine/common/recipe/__init__.py (recipe classes per release), "
           "transformer_engine/pytorch/quantization.py check_*_support (hardware), NVIDIA/TransformerEngine#2245 "
           "(FP8 parameters under FSDP2)")
_TORCHAO_MX_SRC = ("torchao 0.18 torchao/prototype/moe_training/mxfp8_linear.py (MXFP8Linear, "
                   "KernelPreference.EMULATED, 1x32 blocks of float8_e4m3fn with E8M0 scales, all three GEMMs), "
                   "torchao/prototype/moe_training/tensor.py (its FSDP2 hooks all-gather the high-precision weight)")
_TORCHAO_NVFP4_SRC = ("torchao 0.18 torchao/prototype/moe_training/nvfp4_training (NVFP4Linear: Triton kernels only "
                      "(KernelPreference.TRITON), M, K, N divisible by 128, SM100, torch >= 2.10 with Triton)")
_TE_NVFP4_SRC = ("TE transformer_engine/common/recipe/__init__.py NVFP4BlockScaling (first in v2.8), "
                 "transformer_engine/pytorch/quantization.py _compute_nvfp4_support (compute capability >= 10.0), "
                 "transformer_engine/pytorch/tensor/nvfp4_tensor.py (is_quantizable: 16-element blocks; "
                 "fsdp_pre_all_gather since v2.15, NVIDIA/TransformerEngine#2797), "
                 "transformer_engine/pytorch/constants.py NVFP4_BLOCK_SCALING_SIZE")
_TE_MX_CC_WHY = ("Transformer Engine's own check, check_mxfp8_support: \"MXFP8 (for all gemm layouts) is not "
                 "supported on 12.0+ architectures yet\"")
# TE's NVFP4 check passes on 12.x, but its FSDP2 tests skip NVFP4 there as crashing; every run here is FSDP2.
_TE_NVFP4_CC_WHY = ("Transformer Engine's own FSDP2 tests skip NVFP4BlockScaling on SM 12.x as failing, "
                    "TransformerEngine/tests/pytorch/distributed/fsdp2_tests/conftest.py _check_nvfp4_support: \"failing on SM120 with "
                    "hadamard_transform_cast_fusion.cu:672 in function rht_gemm_ntt_w_sfc: CUDA Error: invalid "
                    "argument\"; every run here is FSDP2")
_TE_MX_DIMS = Dims(features=32, tokens=32, shard_rows=32,
                   why="TE MXFP8Quantizer.is_quantizable: last dim and the product of the others divisible by 32")
# TE versions: the first TE release that ships each recipe class; 2.0 is also the oldest TE whose APIs we use
# as written. FP8 parameters (quantized_model_init) under FSDP2 need TE's QuantizedTensor to implement
# fsdp_pre_all_gather / fsdp_post_all_gather: TE 2.10 for Float8Tensor (delayed, current) and MXFP8Tensor. NVFP4Tensor
# has them since 2.15, but TE's own FSDP2 test marked NVFP4 + FP4-initialized TransformerLayers failing until
# NVIDIA/TransformerEngine#2974 (which also fixed DCP loading of MXFP8/NVFP4 weights under FSDP2: a resume) removed
# that mark; #2974 is in the v2.16 tag (commit 1e94ebbc4, TransformerEngine/tests/pytorch/distributed/fsdp2_tests/run_fsdp2_model.py):
# 2.16 for NVFP4 here.
# Float8BlockwiseQTensor (block) has them since 2.14, but TE's own FSDP2 tests mark block + FP8 weights
# as failing (TransformerEngine/tests/pytorch/distributed/run_fsdp2_model.py), so the TE path refuses it: no FP8
# all-gather for block here. Recipe names are unique within a backend; mxfp8 and nvfp4 exist in both, so that an
# arm named by its format runs with whichever backend the model implementation has.
RECIPES: tuple[Recipe, ...] = (
    Recipe("tensorwise", TORCHAO, "one scale per tensor (dynamic)", min_library="0.12",
           fp8_all_gather_since="0.12", tensor_parallel=True, emulated_on_cpu=True, default=True, needs_compile=True,
           source=_TORCHAO_SRC),
    Recipe("rowwise", TORCHAO, "one scale per row of activations and weights (dynamic)", min_library="0.12",
           emulated_on_cpu=True, needs_compile=True, source=_TORCHAO_SRC),
    # A prototype of torchao; the dense MXFP8Linear module swap, emulated (torch ops, dequantized GEMMs) without
    # SM100. Not torchao's auto on Blackwell: tensorwise keeps FP8 all-gather, which torchao's MX path does not have.
    Recipe("mxfp8", TORCHAO, "E8M0 scale per 32 values (MXFP8, Blackwell; emulated elsewhere)",
           min_capability=(10, 0), min_library="0.18", emulated_on_cpu=True, needs_compile=True, format="mxfp8",
           quantizes="the three GEMMs of every decoder linear: input and weight, output gradient and weight, input "
                     "and output gradient, each in 1x32 blocks along the GEMM's reduction dimension",
           dims=Dims(features=32, tokens=32, why="torchao MXTensor.to_mx: 32-element blocks along each GEMM's "
                                                 "reduction dimension (features forward, tokens for the weight "
                                                 "gradient)"),
           prototype=True, source=_TORCHAO_MX_SRC),
    Recipe("nvfp4", TORCHAO, "E4M3 scale per 16 FP4 values + one FP32 scale per tensor, random Hadamard transform, "
           "stochastic rounding of gradients (NVFP4)", min_capability=(10, 0), min_library="0.18", min_torch="2.10",
           quantizes="the three GEMMs of every decoder linear: inputs and gradients in 1x16 blocks after a 16-point "
                     "random Hadamard transform (gradients stochastically rounded), weights in 2-D blocks",
           needs_compile=True, bf16_only=True, format="nvfp4",
           dims=Dims(features=128, tokens=128, sequence=128,
                     why="torchao nvfp4_mm_triton: M, K and N divisible by 128 (M read as the input's second-to-last "
                         "dimension: the sequence)"),
           checkpoint="BF16/FP32 weights plus each NVFP4 linear's Hadamard sign vector and stochastic-rounding seed "
                      "(buffers, drawn from --seed so that every rank and a resume agree)",
           prototype=True, source=_TORCHAO_NVFP4_SRC),
    Recipe("delayed", TE, "one scale per tensor from an amax history (delayed scaling)",
           min_cuda=(((9, 0), "12.1"),), min_library="2.0", fp8_all_gather_since="2.10", compile=False,
           stateful=True, checkpoint="adds each TE module's amax history and scales (FP8 state)", source=_TE_SRC),
    # TE's default on Hopper and Ada (TE's own default there is delayed scaling): stateless, so a resume is exact
    # with nothing to checkpoint; works under torch.compile; and each scale comes from this step's amax, so a sudden
    # activation spike cannot overflow a scale computed from an older history.
    Recipe("current", TE, "one scale per tensor from its current amax (current scaling)",
           min_cuda=(((9, 0), "12.1"),), min_library="2.2", fp8_all_gather_since="2.10", default=True,
           source=_TE_SRC),
    # TE's own range (transformer_engine/pytorch/quantization.py _compute_mxfp8_support, v2.16 ... 2.20): refused
    # from 12.0 ("MXFP8 (for all gemm layouts) is not supported on 12.0+ architectures yet"), runs from 10.0; and
    # auto there, as TE's own get_default_fp8_recipe: MXFP8 where check_mxfp8_support passes, Float8CurrentScaling
    # on 12.x.
    Recipe("mxfp8", TE, "E8M0 scale per 32 values (MXFP8, Blackwell)", min_capability=(10, 0),
           max_capability=(12, 0), max_capability_why=_TE_MX_CC_WHY, min_library="2.0", fp8_all_gather_since="2.10",
           auto_on=((10, 0), (12, 0)), format="mxfp8", dims=_TE_MX_DIMS, source=_TE_SRC),
    Recipe("block", TE, "scale per 1x128 activation / 128x128 weight block", min_capability=(9, 0),
           min_cuda=(((99, 0), "12.9"),), min_library="2.3", source=_TE_SRC),
    Recipe("nvfp4", TE, "E4M3 scale per 16 FP4 values (16x16 blocks for weights) + one FP32 scale per tensor, "
           "random Hadamard transform, stochastic rounding of gradients (NVFP4)", min_capability=(10, 0),
           max_capability=(12, 0), max_capability_why=_TE_NVFP4_CC_WHY,
           min_library="2.8", fp8_all_gather_since="2.16", bf16_only=True, format="nvfp4",
           quantizes="the GEMMs of every TE layer: weights in 16x16 blocks, inputs and gradients in 1x16 blocks, a "
                     "random Hadamard transform for the weight-gradient GEMM, gradients stochastically rounded",
           dims=Dims(features=16, tokens=16, shard_rows=16,
                     why="TE NVFP4Quantizer.is_quantizable and NVFP4Tensor.fsdp_pre_all_gather: 16-element blocks "
                         "(NVFP4_BLOCK_SCALING_SIZE)"),
           source=_TE_NVFP4_SRC),
)

FORMATS = {"fp8": "FP8 (E4M3/E5M2) with per-tensor or per-row scales", "mxfp8": "MXFP8: FP8 E4M3 with one E8M0 "
           "scale per 32 values", "nvfp4": "NVFP4: FP4 E2M1 with one E4M3 scale per 16 values and one FP32 scale "
           "per tensor"}
"""The number formats the recipes run their GEMMs in (``Recipe.format``)."""


def all_recipes() -> tuple[Recipe, ...]:
    """Every recipe of every backend, torchao's first."""
    return RECIPES


def rows_of(backend: str) -> tuple[Recipe, ...]:
    return tuple(r for r in RECIPES if r.backend == backend)


def backends() -> tuple[str, ...]:
    return tuple(LIBRARIES)


def names() -> tuple[str, ...]:
    """Every ``--fp8_recipe`` name, once (mxfp8 and nvfp4 belong to both backends)."""
    return tuple(dict.fromkeys(r.name for r in RECIPES))


def get(name: str, backend: str | None = None) -> Recipe:
    """The row ``name`` of ``backend`` (or the one row of that name when no backend is given)."""
    rows = [r for r in RECIPES if r.name == name and backend in (None, r.backend)]
    if len(rows) != 1:
        of = f" of backend {backend}" if backend else ""
        raise KeyError(f"no single FP8 recipe {name!r}{of}; known: "
                       f"{', '.join(f'{r.backend}:{r.name}' for r in RECIPES)}")
    return rows[0]


def default_for(backend: str, compile: bool = False, capability: Capability | None = None) -> Recipe:
    """What ``--fp8_recipe auto`` means for ``backend`` (``auto_choice``)."""
    return auto_choice(backend, compile, capability)[0]


def auto_choice(backend: str, compile: bool = False, capability: Capability | None = None) -> tuple[Recipe, str]:
    """(the recipe ``--fp8_recipe auto`` picks for ``backend``, why): on a GPU of ``capability`` a row that names it
    in ``auto_on`` (TE's MXFP8 on 10.x), else the backend's default row; under ``--compile 1``, when that does not
    work with torch.compile, the backend's first recipe that does. The only place that decides the recipe default
    (``precision._choose_recipe`` asks it)."""
    rows = rows_of(backend)
    default = next(r for r in rows if r.default)
    for r in rows:
        lo_hi = r.auto_on
        if capability is not None and lo_hi and lo_hi[0] <= tuple(capability) < lo_hi[1] and (r.compile or not compile):
            return r, (f"auto: compute capability {_cap(capability)} runs {r.name} natively (auto prefers it from "
                       f"{_cap(lo_hi[0])} to below {_cap(lo_hi[1])}, as the library's own default does)")
    where = "no GPU seen" if capability is None else f"compute capability {_cap(capability)}"
    if compile and not default.compile:
        first = next(r for r in rows if r.compile)
        return first, f"auto: {backend}'s default {default.name} does not work under --compile 1; {where}"
    return default, f"auto: {backend}'s default ({where})"


def supported_on(capability: Capability, cuda: str | None) -> list[Recipe]:
    """Recipes a GPU of this capability runs natively (whatever is installed)."""
    return [r for r in RECIPES if not r.hardware_problem(capability, cuda)]


def backend_help(first_backend: dict[str, str]) -> str:
    """``first_backend``: each model implementation's first FP8 backend (what ``auto`` picks with it)."""
    own = ", ".join(f"{impl}: {backend}" for impl, backend in first_backend.items())
    return f"FP8 library: {', '.join(backends())}; auto: the model implementation's first ({own})"


def recipe_help() -> str:
    parts = [f"{b}: " + "/".join(r.name for r in rows_of(b)) for b in backends()]
    defaults = " / ".join(f"{default_for(b).name} ({b})" for b in backends())
    on = ", ".join(f"{r.name} ({r.backend}) on {_cap(r.auto_on[0])}-{_cap(r.auto_on[1])}" for r in RECIPES
                   if r.auto_on)
    return f"{'; '.join(parts)}; auto: {defaults}" + (f"; but {on}" if on else "")


def library_of(backend: str) -> str:
    """The Python package an FP8 backend needs (``transformer_engine``, ``torchao``)."""
    return LIBRARIES.get(backend, backend)


def gpu_text(r: Recipe) -> str:
    gpu = f">= {_cap(r.min_capability)}" + (f", < {_cap(r.max_capability)}" if r.max_capability else "")
    for below, version in r.min_cuda:
        gpu += f"; CUDA >= {version}" + ("" if below >= (99, 0) else f" below {_cap(below)}")
    return gpu


def dims_text(r: Recipe) -> str:
    """The dimension rules in words ('' when layers that do not divide simply stay BF16)."""
    if r.dims is None:
        return "features not divisible by 16 stay BF16" if r.backend == TORCHAO else ""
    d, parts = r.dims, []
    if d.features:
        parts.append(f"in/out features % {d.features}")
    if d.tokens:
        parts.append(f"micro-batch tokens % {d.tokens}")
    if d.sequence:
        parts.append(f"sequence % {d.sequence}")
    if d.shard_rows:
        parts.append(f"FP8 all-gather: rows per shard % {d.shard_rows}")
    return ", ".join(parts) + " (refused otherwise)"


def recipe_table_markdown() -> str:
    """docs/fp8.md's FP8 recipe table."""
    rows = ["| `--fp8_recipe` | backend | format | GPU (compute capability) | minimum library | FP8 all-gather | "
            "`--compile 1` | dimension rules | what it scales |", "|---|---|---|---|---|---|---|---|---|"]
    for r in all_recipes():
        gpu = gpu_text(r) + (" (emulated on CPU)" if r.emulated_on_cpu else "")
        gather = f"since {r.fp8_all_gather_since}" if r.fp8_all_gather_since else "no"
        lib = f"{library_of(r.backend)} >= {r.min_library}" + (f", torch >= {r.min_torch}" if r.min_torch != "0" else "")
        tags = (" (default)" if r.default else "") + (" (prototype)" if r.prototype else "")
        rows.append(f"| `{r.name}`{tags} | {r.backend} | {r.format} | {gpu} | {lib} | {gather} | "
                    f"{'yes' if r.compile else 'no'} | {dims_text(r) or '-'} | {r.description} |")
    return "\n".join(rows)


SUPPORTED = "supported by the library (not run here)"
"""A GPU column's word where the library has the kernels: nothing of this repository has run on a GPU yet (the GPU
visits' records, docs/gpu-results.md, are where a run would be stated)."""


def where_it_runs(r: Recipe, capability: Capability | None) -> str:
    """SUPPORTED, 'emulated' (run here, on CPU) or 'refused' for a GPU of ``capability`` (None: a CPU); CUDA version
    aside."""
    if capability is None or capability < r.min_capability:
        return "emulated" if r.emulated_on_cpu else "refused"
    if r.max_capability is not None and capability >= r.max_capability:
        return "refused"
    return SUPPORTED


GPU_COLUMNS = (("CPU", None), ("Ada/Hopper (8.9/9.0)", (9, 0)), ("Blackwell (10.0)", (10, 0)))


def formats_table_markdown() -> str:
    """docs/fp8.md's table of formats x implementations x GPUs: what runs where and under which rules."""
    head = " | ".join(name for name, _ in GPU_COLUMNS)
    rows = [f"| format | `--fp8_backend` `--fp8_recipe` | {head} | what it quantizes | dimension rules | FP8 all-gather | "
            "checkpoint |", "|" + "---|" * (6 + len(GPU_COLUMNS))]
    for fmt in FORMATS:
        for r in (x for x in RECIPES if x.format == fmt):
            runs = " | ".join(where_it_runs(r, cap) for _, cap in GPU_COLUMNS)
            gather = f"{library_of(r.backend)} >= {r.fp8_all_gather_since}" if r.fp8_all_gather_since else "no (BF16)"
            rows.append(f"| {fmt} | `{r.backend}` `{r.name}` | {runs} | {r.quantizes} | {dims_text(r) or '-'} | "
                        f"{gather} | {r.checkpoint} |")
    return "\n".join(rows)
