""""Is FP8 really on?": after the first (warm-up) step, every FP8 run states and checks what runs in FP8.

- coverage: how many linear layers run in FP8, which stay in high precision and why (the output head,
  dims not divisible by 16, a user exception from --fp8_exclude), and the share of the model's linear
  FLOPs that run in FP8 (per token every linear costs in*out multiply-adds, so the share is by in*out);
- with --fp8_all_gather 1: the bytes FSDP2 all-gathered during one step, by dtype, read from the inputs it
  hands to its all-gather (a silent BF16 fallback shows up as 2x the bytes, and as the FP8 layers' weights
  in a 2-byte dtype);
- for Transformer Engine, coverage comes from each TE module's own state (``fp8``: whether its last forward ran
  under FP8 autocast), not from its name or the exclusion list;
- on CUDA, without emulation: what one profiled step ran. Every GEMM kernel seen is recorded (name, calls, time),
  each classed FP8 or not by its name (``gemm_kind``), with the count of torchao's FP8 matmul ops
  (``aten::_scaled_mm`` and friends) on the CPU side. This evidence decides nothing on its own: kernel names
  change with the CUDA libraries (CUDA 13's cuBLASLt names FP8 GEMMs ``nvjet_qq...``; under torch.compile an
  FP8 GEMM may be a Triton template) and none of them has been confirmed on a GPU by this project yet, while
  coverage and the all-gather dtypes already prove FP8. Without any FP8 evidence the record gets a note and the
  log a warning, naming the GEMM kernels that did run.

If FP8 was asked and is not on, the run stops (``Fp8NotOn``) naming what is off; --fp8_verify warn
logs the same message as a warning instead.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from llama_fp8.errors import ConfigError

log = logging.getLogger(__name__)

# GEMM kernels: cuBLASLt's nvjet (CUDA >= 12.8), cuBLAS/CUTLASS "...gemm..." (sm90_xmma_gemm_*, cutlass3x_*_gemm_*,
# ampere_*gemm*), Inductor's matmul templates (triton_tem_fused_mm_*, triton_tem_fused__scaled_mm_*). A kernel that
# only casts (TE's cast_transpose_*<..., __nv_fp8_e4m3>, Inductor's triton_poi_fused__to_copy_clamp_mul_*) is none.
GEMM_KERNEL = re.compile(r"nvjet_|gemm|triton_tem_fused_\w*mm", re.I)
# FP8 operands in a GEMM's name: "e4m3"/"e5m2" (cuBLAS, CUTLASS), "fp8"/"f8f8"/"float8", a scaled-mm template.
FP8_MARK = re.compile(r"e4m3|e5m2|fp8|f8f8|float8|scaled_mm", re.I)
# nvjet_[sm<arch>_]<type letters>_<tiles>...: one letter per type, the two operands' first (q is FP8: nvjet_qqtst_*
# has FP8 inputs, nvjet_tst_* BF16), as seen in CUDA 13 traces on Hopper; only the operands make an FP8 GEMM (a
# later letter may be the output's or the accumulator's type).
NVJET_TYPES = re.compile(r"nvjet_(?:sm\d+_)?([a-z]+)_")
SCALED_MM_OPS = ("aten::_scaled_mm", "aten::_scaled_mm_v2", "aten::_scaled_grouped_mm")  # torchao's FP8 matmuls
MAX_GEMMS_RECORDED = 30
CHECK_AFTER_STEP = 1  # the warm-up step; the next step is measured


class Fp8NotOn(ConfigError):
    """FP8 was asked for and is not (fully) on: exit code 2 with the message."""


@dataclass(frozen=True)
class LinearLayer:
    name: str
    flops: int  # in_features * out_features: this layer's multiply-adds per token
    fp8: bool
    reason: str | None  # why it stays in high precision (None when in FP8)


def coverage_record(layers: list[LinearLayer]) -> dict:
    """The numbers of the coverage line (metrics.jsonl ``type: fp8_check``)."""
    total = sum(layer.flops for layer in layers) or 1
    return {"fp8_linears": sum(layer.fp8 for layer in layers), "linears": len(layers),
            "fp8_flop_share": sum(layer.flops for layer in layers if layer.fp8) / total,
            "high_precision": {layer.name: layer.reason for layer in layers if not layer.fp8}}


def coverage_line(rec: dict) -> str:
    reasons: dict[str, list[str]] = defaultdict(list)
    for name, why in rec["high_precision"].items():
        reasons[why].append(name)
    kept = "; ".join(f"{why}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''} ({len(names)})"
                     for why, names in reasons.items())
    return (f"FP8 coverage: {rec['fp8_linears']}/{rec['linears']} linear layers in FP8, "
            f"{100 * rec['fp8_flop_share']:.1f} % of linear FLOPs; high precision: {kept or 'none'}")


def all_gather_line(by_dtype: dict[str, int]) -> str:
    parts = ", ".join(f"{dtype} {n / 2**20:.2f} MiB" for dtype, n in sorted(by_dtype.items()))
    return f"FSDP all-gather bytes per step (this rank's inputs): {parts or 'none'}"


class AllGatherMeter:
    """Counts the bytes FSDP2 all-gathers, by dtype, while active: it wraps FSDP2's ``foreach_all_gather``
    (the one function every FSDP2 parameter all-gather goes through) and reads the dtypes and sizes of the
    inputs it was handed, per parameter. ``fp8_weights``: parameter names that should travel in FP8."""

    def __init__(self, fp8_weights: set[str]):
        self.fp8_weights = fp8_weights
        self.by_dtype: dict[str, int] = defaultdict(int)
        self.not_fp8: set[str] = set()  # FP8 layers' weights that were gathered in another dtype
        self.seen_fp8: set[str] = set()  # FP8 layers' weights seen in an all-gather at all

    @contextlib.contextmanager
    def measure(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

        original = group_mod.foreach_all_gather

        def counting(fsdp_params, *args, **kwargs):
            result = original(fsdp_params, *args, **kwargs)
            if result is not None:
                self._count(fsdp_params, result.param_all_gather_input_dtypes,
                            result.param_all_gather_input_numels)
            return result

        group_mod.foreach_all_gather = counting
        try:
            yield self
        finally:
            group_mod.foreach_all_gather = original

    def _count(self, fsdp_params, dtypes, numels) -> None:
        for param, ds, ns in zip(fsdp_params, dtypes, numels, strict=True):
            for dtype, n in zip(ds, ns, strict=True):
                self.by_dtype[str(dtype).removeprefix("torch.")] += n * dtype.itemsize
            name = getattr(param, "_param_fqn", None)
            if name in self.fp8_weights:
                self.seen_fp8.add(name)
                if not any(d.itemsize == 1 for d in ds):
                    self.not_fp8.add(name)


def gemm_kind(name: str) -> str | None:
    """``"fp8"`` for a GEMM kernel whose name shows FP8 operands, ``"other"`` for any other GEMM, None for a
    kernel that is not a GEMM (casts, elementwise, attention, communication)."""
    if not GEMM_KERNEL.search(name):
        return None
    types = NVJET_TYPES.search(name)
    if types:
        return "fp8" if "q" in types.group(1)[:2] else "other"
    return "fp8" if FP8_MARK.search(name) else "other"


def _on_gpu(event) -> bool:
    kind = getattr(event, "device_type", None)
    return kind == torch.autograd.DeviceType.CUDA or "cuda" in str(kind).lower()


def evidence(events) -> dict:
    """What one profiled step ran (``events``: the profiler's ``key_averages()``): every GEMM kernel with its calls
    and time (most time first, FP8 or not by name) and the CPU-side calls of torchao's FP8 matmul ops."""
    gemms = []
    for e in events:
        kind = gemm_kind(e.key) if _on_gpu(e) else None
        if kind is not None:
            gemms.append({"name": e.key[:300], "calls": int(e.count), "ms": round(e.device_time_total / 1e3, 3),
                          "fp8": kind == "fp8"})
    gemms.sort(key=lambda g: -g["ms"])
    scaled = sum(int(e.count) for e in events if not _on_gpu(e) and e.key in SCALED_MM_OPS)
    return {"gemm_kernels": gemms[:MAX_GEMMS_RECORDED], "gemm_kernel_names": len(gemms),
            "fp8_gemm_kernels": sum(g["fp8"] for g in gemms), "scaled_mm_calls": scaled}


def evidence_line(ev: dict) -> str:
    top = ", ".join(f"{g['name'][:60]} x{g['calls']} {g['ms']:.1f} ms" for g in ev["gemm_kernels"][:3])
    return (f"GEMM kernels in the profiled step: {ev['gemm_kernel_names']} ({ev['fp8_gemm_kernels']} named as FP8); "
            f"aten::_scaled_mm calls: {ev['scaled_mm_calls']}" + (f"; most time: {top}" if top else ""))


def evidence_notes(ev: dict) -> list[str]:
    """A note (never a problem) when nothing in the profiled step names an FP8 GEMM."""
    if ev["fp8_gemm_kernels"] or ev["scaled_mm_calls"]:
        return []
    seen = ", ".join(g["name"][:80] for g in ev["gemm_kernels"][:5]) or "none"
    return [f"no GEMM kernel named as FP8 and no aten::_scaled_mm in the profiled step; the names are not confirmed "
            f"on a GPU yet, so this decides nothing (coverage and all-gather dtypes do); GEMM kernels seen: {seen}"]


UNEXPECTED = ("not converted", "ran without FP8")  # reasons that mean a layer should be in FP8 and is not


def problems(cov: dict, all_gather: bool, meter: AllGatherMeter | None) -> list[str]:
    """What is off, in words (empty: FP8 is on as asked)."""
    out = []
    if cov["fp8_linears"] == 0:
        out.append(f"no linear layer runs in FP8 (0/{cov['linears']})")
    unexpected = [n for n, why in cov["high_precision"].items() if why.startswith(UNEXPECTED)]
    if unexpected:
        out.append(f"{len(unexpected)} layer(s) that should run in FP8 do not: {', '.join(unexpected[:5])}")
    if all_gather and meter is not None and meter.by_dtype:  # one rank: FSDP2 all-gathers nothing to check
        # 1-byte payloads: torchao hands FSDP2 float8 tensors, Transformer Engine its FP8 bytes as uint8
        fp8_bytes = sum(n for d, n in meter.by_dtype.items() if "float8" in d or d == "uint8")
        if meter.not_fp8 or fp8_bytes == 0:
            names = ", ".join(sorted(meter.not_fp8)[:3])
            out.append(f"--fp8_all_gather 1 but FSDP2 all-gathered FP8 layers' weights in high precision "
                       f"({names or 'no 1-byte inputs at all'}; {all_gather_line(meter.by_dtype)})")
    return out


class Verifier:
    """Driven by the runtime's ``post_step``: arms the measurements after the warm-up step, reads them after
    the next one, then checks once. ``layers`` is a function returning the coverage list."""

    def __init__(self, layers, fp8_weights, all_gather: bool, profile: bool, mode: str):
        """``profile``: profile the measured step (real FP8 only: emulation runs no FP8 GEMM)."""
        self.layers, self.fp8_weights, self.all_gather = layers, fp8_weights, all_gather
        self.profile, self.mode = profile, mode
        self.steps, self.pending, self.done, self.error = 0, [], False, None
        self._stack: contextlib.ExitStack | None = None
        self._meter: AllGatherMeter | None = None
        self._prof = None

    def after_step(self, model: nn.Module) -> None:
        self.steps += 1
        if self.done:
            return
        if self.steps == CHECK_AFTER_STEP:
            self._arm(model)
        elif self.steps == CHECK_AFTER_STEP + 1:
            self._finish(model)

    def _arm(self, model: nn.Module) -> None:
        self._stack = contextlib.ExitStack()
        # Measured with or without --fp8_all_gather (a BF16 all-gather is the baseline the FP8 one halves).
        self._meter = AllGatherMeter(self.fp8_weights(model))
        self._stack.enter_context(self._meter.measure())
        if self.profile:
            from torch.profiler import ProfilerActivity, profile

            # CPU: torchao's matmul ops; CUDA: the kernels (where there is a GPU)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = self._stack.enter_context(profile(activities=activities))

    def _finish(self, model: nn.Module) -> None:
        self._stack.close()
        self.done = True
        cov = coverage_record(self.layers(model))
        rec = {"type": "fp8_check", "step": self.steps, **cov}
        lines = [coverage_line(cov)]
        if self._meter is not None and self._meter.by_dtype:
            rec["all_gather_bytes"] = dict(self._meter.by_dtype)
            rec["fp8_weights_all_gathered"] = len(self._meter.seen_fp8)  # names matched: the per-weight check ran
            lines.append(all_gather_line(self._meter.by_dtype))
        notes = []
        if self._prof is not None:
            ev = evidence(self._prof.key_averages())
            rec.update(ev)
            lines.append(evidence_line(ev))
            notes = evidence_notes(ev)
            for note in notes:
                log.warning("FP8 check: %s", note)
        issues = problems(cov, self.all_gather, self._meter)
        rec["problems"], rec["notes"] = issues, notes
        self.pending.append((rec, "\n".join(lines)))
        if issues:
            msg = "FP8 was asked for but is not on: " + "; ".join(issues)
            if self.mode != "warn":
                self.error = Fp8NotOn(msg + " (--fp8_verify warn makes this a warning)")
            else:
                log.warning("%s", msg)

    def report(self, write) -> None:
        """Hand the check's record to ``write(rec, line)`` (rank 0's metrics.jsonl and log), then stop the
        run if FP8 is not on (the record is written first, so the run folder says why)."""
        pending, self.pending = self.pending, []
        for rec, line in pending:
            write(rec, line)
        if self.error is not None:
            error, self.error = self.error, None
            raise error
