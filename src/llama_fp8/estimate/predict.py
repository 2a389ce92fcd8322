"""A prediction before the job queues: the step-time speed-up of each FP8 recipe over BF16 on a GPU, from the model's
GEMM shapes and published by-shape figures (gemm_figures.py, each with its source), and the time FP8 does not speed
up: attention, norms and elementwise work, the LM head (BF16 in every recipe) and communication.

One training step on one GPU (every micro-batch), the same in both precisions but for the decoder linears:

- decoder linears: per block, each of the implementation's GEMM shapes (``ModelImpl.gemm_shapes``, per tensor-parallel
  rank: a linear reading the hidden size is column-parallel, one writing it row-parallel) at M = micro-batch x
  sequence / context-parallel ranks tokens: 6 M K N FLOPs at the published BF16 throughput; in FP8 that time over
  the linear's published speed-up;
- the LM head: 6 M hidden vocab FLOPs at the BF16 throughput (no recipe converts it);
- attention: FlashAttention's count (4 B S^2 heads head_dim forward, halved for the causal mask, backward 2.5 times
  the forward) at FlashAttention-2's published share of the dense BF16 peak;
- norms, RoPE, SwiGLU and residual adds: the bytes they move (BF16 tensors of the hidden, attention and MLP widths,
  forward and twice that in backward) at the GPU's HBM bandwidth (its datasheet);
- full activation checkpointing: one more forward (x 4/3 on all of the above);
- communication: the estimate's collectives (a lower bound), overlapped with compute by FSDP2's prefetch: only what
  exceeds compute adds; a recipe that all-gathers weights in FP8 sends the decoder linears' share at half the bytes.

It cannot see: kernel fusion and scheduling of a real step (torch.compile's), the data loader, stragglers, the
optimizer step, launch overheads of small shapes, the library versions the figures were measured with, and any
GPU or recipe without published figures (then: no prediction, said so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from llama_fp8.estimate import gemm_figures
from llama_fp8.precision import recipes as recipe_table

RECIPES = ((recipe_table.TORCHAO, "tensorwise"), (recipe_table.TORCHAO, "rowwise"), (recipe_table.TE, "delayed"),
           (recipe_table.TE, "current"))
BACKEND_WORDS = {recipe_table.TORCHAO: "torchao", recipe_table.TE: "TE"}
ELEMENTWISE_WHY = ("bytes of norms, RoPE, SwiGLU and residual adds: 2 x (10 hidden + 2 (q + kv) + 3 ffn) per token "
                   "and block forward, 3x that with backward")


@dataclass
class Shapes:
    """What the prediction reads of a run's configuration (a TrainConfig, or config.yaml's ``asked`` mapping)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    accum: int = 1
    tp: int = 1
    cp: int = 1
    full_ac: bool = False
    compile: bool = False

    @classmethod
    def of(cls, cfg) -> Shapes:
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        return cls(int(get("hidden_width")), int(get("num_layers")), int(get("num_heads")),
                   int(get("num_key_value_heads") or get("num_heads")), int(get("intermediate_size")),
                   int(get("vocab_size")), int(get("max_context_width")), int(get("train_batch_size")),
                   int(get("grad_accum_steps") or 1), int(get("tp_size") or 1), int(get("cp_size") or 1),
                   str(get("activation_checkpointing")) == "full", bool(get("compile")))

    def as_config(self) -> SimpleNamespace:
        """The attributes ``ModelImpl.gemm_shapes`` reads."""
        return SimpleNamespace(hidden_width=self.hidden, num_heads=self.heads, num_key_value_heads=self.kv_heads,
                               intermediate_size=self.ffn)

    @property
    def tokens(self) -> int:
        """M: tokens of one micro-batch on one GPU."""
        return self.batch * self.seq // self.cp


@dataclass
class RecipePrediction:
    backend: str
    recipe: str
    impl: str = ""
    linears_s: float = 0.0
    step_s: float = 0.0
    speedup: float | None = None
    bound: str = "~"
    slower: list[str] = field(default_factory=list)
    figures: dict[str, gemm_figures.Figure] = field(default_factory=dict)
    shapes: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    why_none: str | None = None

    @property
    def name(self) -> str:
        return f"{BACKEND_WORDS[self.backend]} {self.recipe}"


@dataclass
class Prediction:
    gpu: str
    shapes: Shapes
    linears: list[tuple[str, int, int, int]]  # (name, M, K, N) per block, per tensor-parallel rank
    bf16: dict[str, float] = field(default_factory=dict)  # seconds per step by part
    comm_s: float = 0.0
    recipes: list[RecipePrediction] = field(default_factory=list)
    why_none: str | None = None
    notes: list[str] = field(default_factory=list)


def linear_shapes(impl, s: Shapes) -> list[tuple[str, int, int, int]]:
    out = []
    for name, k, n in impl.gemm_shapes(s.as_config()):
        if k == s.hidden:
            n //= s.tp  # column-parallel: reads the hidden size, splits its outputs
        else:
            k //= s.tp  # row-parallel: writes the hidden size, splits its inputs
        out.append((name, s.tokens, k, n))
    return out


def bf16_parts(gpu: str, s: Shapes, linears) -> tuple[dict[str, float], dict[str, float]] | None:
    """(seconds per step of each part in BF16, seconds per step of each decoder linear) (module docstring); None
    without figures for ``gpu``."""
    from llama_fp8.telemetry import peaks

    base = gemm_figures.FIGURES_OF.get(gpu)
    if base is None:
        return None
    m, per_step = s.tokens, s.accum * (4 / 3 if s.full_ac else 1.0)  # full checkpointing: one more forward

    def gemm_s(mm: int, k: int, n: int) -> float:
        return 6 * mm * k * n / (gemm_figures.bf16_tflops(gpu, mm, k, n)[0] * 1e12)
    per_linear = {name: s.layers * gemm_s(mm, k, n) * per_step for name, mm, k, n in linears}
    head_dim, heads = s.hidden // s.heads, s.heads // s.tp
    attn_flops = 3.5 * 4 * s.batch * s.seq * (s.seq / s.cp) * heads * head_dim / 2
    peak = next(p.bf16 for p in peaks.PEAKS if p.sku.startswith(base))
    attn = attn_flops / (gemm_figures.ATTENTION_UTILIZATION[base] * peak * 1e12)
    q, kv, f = s.hidden // s.tp, s.kv_heads * head_dim // s.tp, s.ffn // s.tp
    elem = 3 * 2 * (10 * s.hidden + 2 * (q + kv) + 3 * f) * m / (gemm_figures.HBM_TBS[gpu] * 1e12)
    parts = {"decoder linears": sum(per_linear.values()),
             "LM head": gemm_s(m, s.hidden, s.vocab // s.tp) * s.accum,
             "attention": s.layers * attn * per_step, "norms and elementwise": s.layers * elem * per_step}
    return parts, per_linear


def predict(impls, s: Shapes, gpu: str, comm_s: float = 0.0, all_gather_s: float = 0.0,
            linear_param_share: float = 0.0, fp8_all_gather: frozenset[str] = frozenset()) -> Prediction:
    """Every recipe's predicted step-time speed-up over BF16 on ``gpu`` at ``s`` (module docstring), each recipe on
    the implementation of ``impls`` whose FP8 backend has it (its GEMM shapes: TE fuses QKV and gate/up); the first
    implementation's shapes and BF16 parts are the ones shown. ``comm_s``: communication seconds per step,
    ``all_gather_s`` of it the all-gathers, ``linear_param_share`` the decoder linears' share of the parameters;
    ``fp8_all_gather``: recipes that all-gather weights in FP8."""
    pred = Prediction(gpu, s, linear_shapes(impls[0], s), comm_s=comm_s)
    if gemm_figures.FIGURES_OF.get(gpu) is None:
        pred.why_none = (f"no published by-shape FP8 figures for {gpu} in estimate/gemm_figures.py"
                         + (f" (published end-to-end: {gemm_figures.PUBLISHED_E2E[gpu]})"
                            if gpu in gemm_figures.PUBLISHED_E2E else ""))
        return pred
    pred.bf16 = bf16_parts(gpu, s, pred.linears)[0]
    for impl in impls:
        backends = {b.name for b in impl.fp8_backends()}
        linears = linear_shapes(impl, s)
        parts, per_linear = bf16_parts(gpu, s, linears)
        compute = sum(parts.values())
        for backend, recipe in RECIPES:
            if backend not in backends or any(r.recipe == recipe for r in pred.recipes):
                continue
            rp = RecipePrediction(backend, recipe, impl=impl.name)
            _figures(rp, gpu, linears, per_linear)
            if rp.why_none is None:
                comm = comm_s - (all_gather_s * 0.5 * linear_param_share if recipe in fp8_all_gather else 0.0)
                rp.step_s = max(compute - parts["decoder linears"] + rp.linears_s, comm)
                rp.speedup = max(compute, comm_s) / rp.step_s
                bounds = {f.bound for f in rp.figures.values()}
                rp.bound = bounds.pop() if len(bounds) == 1 else "~"
            pred.recipes.append(rp)
    if gemm_figures.FIGURES_OF[gpu] == "H100":
        pred.notes.append(f"MXFP8 and NVFP4 need compute capability 10.x (Blackwell): not on {gpu}")
    return pred


def _figures(rp: RecipePrediction, gpu: str, linears, per_linear: dict[str, float]) -> None:
    for name, m, k, n in linears:
        fig = gemm_figures.lookup(rp.recipe, gpu, m, k, n)
        if fig is None:
            rp.why_none = f"no published figure for {rp.name} on {gpu}"
            return
        rp.figures[name], rp.shapes[name] = fig, (m, k, n)
        rp.linears_s += per_linear[name] / fig.value
        if fig.value < 1:
            rp.slower.append(name)


def exclude_flag(names: list[str]) -> str:
    """The --fp8_exclude that keeps these linears of every block in BF16."""
    return "--fp8_exclude '" + ",".join(f"model.layers.*.{n}" for n in names) + "'"


def warnings(pred: Prediction, torchao: bool) -> list[str]:
    """Where the payoff depends on a setting: torchao eager, a small micro-batch x sequence."""
    from llama_fp8.precision import EAGER_NOTE

    out = []
    if torchao and not pred.shapes.compile:
        out.append("torchao without --compile: the published figures are compiled; "
                   + EAGER_NOTE.format(recipe="tensorwise/rowwise", backend="torchao").split(": ", 1)[1])
    if pred.shapes.tokens < 8192:
        out.append(f"micro-batch x sequence = {pred.shapes.tokens} tokens per GPU (M of every GEMM): FP8's gain "
                   f"grows with M and falls below 1 for most shapes at M <= 2048 in the published tables; a larger "
                   f"--train_batch_size (or sequence) moves it up")
    return out


def _sign(bound: str) -> str:
    return {"<=": "<= ", ">=": ">= "}.get(bound, "")


def text(pred: Prediction, job_recipe: str | None = None) -> str:
    """The estimate's section: per recipe the predicted speed-up with the linears it expects slower, the BF16 step's
    parts, the warnings, the published end-to-end figure to compare with, and the sources."""
    lines = [f"Predicted step-time speed-up of FP8 over BF16 on {pred.gpu} (from published figures, not from a GPU run "
             f"of this code; estimate/predict.py):"]
    if pred.why_none:
        return "\n".join(lines + [f"  not predicted: {pred.why_none}"])
    s, b = pred.shapes, pred.bf16
    lines.append(f"  per GPU and step: {s.accum} x {s.tokens} tokens; BF16 {sum(b.values()):.3g} s = "
                 + " + ".join(f"{k} {v:.3g} s" for k, v in b.items())
                 + f"; communication {pred.comm_s * 1e3:.3g} ms, overlapped with compute (FSDP2 prefetch)")
    if pred.comm_s > sum(b.values()):
        lines.append("  communication-bound: the collectives take longer than the compute, so FP8's faster GEMMs do "
                     "not shorten the step; only an FP8 all-gather (half the decoder linears' bytes) does")
    for r in pred.recipes:
        mark = "  <- this run" if job_recipe and r.recipe == job_recipe else ""
        if r.speedup is None:
            lines.append(f"  {r.name:<18} not predicted: {r.why_none}{mark}")
            continue
        slower = (f"; slower in FP8: {', '.join(r.slower)} (keep them in BF16: {exclude_flag(r.slower)})"
                  if r.slower else "")
        lines.append(f"  {r.name:<18} {_sign(r.bound)}{r.speedup:.3g}x (decoder linears {r.linears_s:.3g} s, step "
                     f"{r.step_s:.3g} s, --model_impl {r.impl}){slower}{mark}")
    lines += [f"  note: {n}" for n in pred.notes]
    base = gemm_figures.FIGURES_OF[pred.gpu]
    if base in gemm_figures.PUBLISHED_E2E:
        lines.append(f"  published end-to-end, to compare with: {gemm_figures.PUBLISHED_E2E[base]} ({gemm_figures.E2E_SOURCE})")
    lines += [f"  WARNING: {w}" for w in warnings(pred, any(r.backend == recipe_table.TORCHAO for r in pred.recipes))]
    lines.append("  per linear of a block, (M, K, N) and the speed-up used:")
    for r in pred.recipes:
        if r.figures:
            lines.append(f"    {r.recipe}: " + ", ".join(
                f"{name} {r.shapes[name]} {_sign(f.bound)}{f.value:.3g}" for name, f in r.figures.items()))
    lines.append("  sources:")
    lines += [f"    - {src}" for src in dict.fromkeys(
        [gemm_figures.ROWWISE_SOURCE, gemm_figures.TENSORWISE_SOURCE, gemm_figures.TE_SOURCE,
         gemm_figures.ATTENTION_SOURCE, gemm_figures.HBM_SOURCE[pred.gpu], ELEMENTWISE_WHY])]
    return "\n".join(lines)


def to_dict(pred: Prediction) -> dict:
    return {"gpu": pred.gpu, "why_none": pred.why_none, "bf16_parts_s": pred.bf16, "comm_s": pred.comm_s,
            "tokens_per_micro_batch": pred.shapes.tokens, "notes": pred.notes,
            "recipes": [{"backend": r.backend, "recipe": r.recipe, "model_impl": r.impl, "speedup": r.speedup,
                         "bound": r.bound, "step_s": r.step_s, "decoder_linears_s": r.linears_s,
                         "slower_in_fp8": r.slower, "exclude": exclude_flag(r.slower) if r.slower else None,
                         "why_none": r.why_none,
                         "figures": {k: {"value": f.value, "how": f.how, "source": f.source}
                                     for k, f in r.figures.items()}} for r in pred.recipes],
            "warnings": warnings(pred, any(r.backend == recipe_table.TORCHAO for r in pred.recipes)) if not pred.why_none else []}


def for_estimate(e) -> tuple[Prediction, str | None]:
    """The prediction for an estimate (assess.Estimate): its configuration, GPU and collectives; with the recipe the
    job itself would run (None when it cannot be told)."""
    from llama_fp8 import models, precision
    from llama_fp8.errors import ConfigError
    from llama_fp8.precision import recipes

    job = e.measurement.decision.job_impl
    impls = [job, *(i for i in models.implementations() if i is not job)]
    shapes = Shapes.of(e.cfg)
    per_block = sum(k * n for _, k, n in job.gemm_shapes(e.cfg))
    share = min(1.0, shapes.layers * per_block / max(e.measurement.num_params, 1))
    gathers = sum(c["seconds"] for c in e.collectives if c["kind"] == "all_gather")
    with_ag = frozenset(r.name for r in recipes.RECIPES if r.fp8_all_gather_since)
    try:
        recipe = precision.choose(e.cfg, job, models.implementations())[1].name
    except ConfigError:
        recipe = None
    return predict(impls, shapes, e.gpu.name.split(" (")[0], sum(c["seconds"] for c in e.collectives), gathers, share,
                   with_ag), recipe
