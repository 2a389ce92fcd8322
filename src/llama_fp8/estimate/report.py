"""An estimate as the report a person reads, and as one JSON object for tools (the same numbers)."""

from __future__ import annotations

import dataclasses

from llama_fp8.estimate.assess import CORRECTIONS, Estimate
from llama_fp8.estimate.gpus import GIB
from llama_fp8.estimate.terms import MARGIN_WHY
from llama_fp8.telemetry import time_limit

# the tracker's kinds, in the order the report lists them, with the words it uses
KINDS = (("Activation", "activations (forward and recomputation)"), ("Temp", "temporaries (backward)"),
         ("OptState", "optimizer states"), ("Sharded Param", "parameters, sharded"),
         ("Unsharded Param", "parameters, all-gathered"), ("Sharded Grad", "gradients, sharded"),
         ("Unsharded Grad", "gradients, unsharded"), ("All Gather", "all-gather buffers"),
         ("Reduce Scatter", "reduce-scatter buffers"), ("Buffer", "buffers"), ("Inputs", "inputs"))


def gib(b: float) -> str:
    """GiB, or MiB below one GiB (so that a small model's numbers are not all 0.00)."""
    return f"{b / GIB:.2f} GiB" if abs(b) >= GIB else f"{b / 2**20:.1f} MiB"


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "transformers", "torchao"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def headline(e: Estimate) -> str:
    c, d = e.cfg, e.measurement.decision
    layout = " x ".join(f"{n} {s}" for n, s in d.dims.shape)
    accum = f", {c.grad_accum_steps} micro-batches" if c.grad_accum_steps > 1 else ""
    impl = d.impl.name if not d.stand_in else f"{d.job_impl.name}, estimated through {d.impl.name}"
    return (f"{c.model} ({e.measurement.num_params / 1e9:.2f} B parameters, --model_impl {impl}), "
            f"{e.opts.nodes} node(s) x {e.opts.gpus_per_node} GPUs = {e.opts.world_size} ({layout}); "
            f"{c.train_batch_size} x {c.max_context_width} tokens per GPU{accum}; {d.precision.name}; "
            f"activation checkpointing {c.activation_checkpointing}")


def text(e: Estimate) -> str:
    m = e.measurement
    lines = [f"llama-fp8 estimate: {headline(e)}"]
    if m.decision.stand_in:
        lines.append(f"STAND-IN: {m.decision.stand_in}")
    lines += [f"note: {n}" for n in m.decision.notes]
    lines += ["", "Per-GPU memory at the peak of a training step (rank 0; PyTorch's FSDPMemTracker on the training "
              "program, run in a fake process group with fake tensors):"]
    lines += [f"  {words:<42} {gib(m.by_kind.get(k, 0)):>12}" for k, words in KINDS if m.by_kind.get(k, 0)]
    lines.append(f"  {'tracked peak':<42} {gib(m.peak_bytes):>12}   at: {m.where.text(m.micro_batches)}")
    lines += ["", "What the tracker cannot see on a GPU ('to calibrate': not measured on a GPU yet; sources below):"]
    for i, t in enumerate(e.terms, 1):
        state = "" if t.calibrated else ", to calibrate"
        lines.append(f"  {'+' if t.added else ' '} {t.name:<40} {gib(t.bytes) if t.added else 'not added':>12}   "
                     f"[{i}{state}]")
    v = e.verdict
    shout = v.text.replace("does not fit", "DOES NOT FIT", 1) if v.status == "does not fit" else v.text
    lines += [f"  = {'needed':<40} {gib(v.needed):>12}",
              f"  + {'allocator margin':<40} {gib(v.margin):>12}   [{len(e.terms) + 1}, to calibrate]",
              "", f"Verdict against {e.gpu.name} ({gib(e.gpu.memory_bytes)}, {e.gpu.source.split(';')[0]}): {shout}"]
    if m.decision.stand_in:
        lines.append(floor_text(e))
    lines += ["", "Communication per step (rank 0's groups; bytes of the whole buffer: an all-gather's output, a "
              "reduce-scatter's input; time = bytes x NCCL's bus factor / the stated bandwidth: no latency, no "
              "overlap with compute, a lower bound):"]
    for c in e.collectives:
        lines.append(f"  {c['kind']:<15} {c['dim']:<13} {c['phase']:<15} {c['calls']:>5} calls {gib(c['bytes']):>12}"
                     f"   {c['ranks']} ranks, {c['link']} {c['gbs']:g} GB/s: {c['seconds'] * 1e3:.1f} ms")
    total = sum(c["seconds"] for c in e.collectives)
    lines.append(f"  {'total':<51} {gib(sum(c['bytes'] for c in e.collectives)):>18}   {total * 1e3:.1f} ms")
    lines += ["", checkpoint_text(e)]
    if e.cfg.fp8:
        from llama_fp8.estimate import predict

        lines += ["", predict.text(*predict.for_estimate(e))]
    if e.suggestions:
        lines += ["", "What would make it fit (each one estimated the same way):"]
        lines += [f"  {s['change']}: {s['verdict']}" for s in e.suggestions]
    lines += ["", "Sources:"] + [f"  [{i}] {t.source}" for i, t in enumerate(e.terms, 1)]
    lines.append(f"  [{len(e.terms) + 1}] {MARGIN_WHY}")
    lines += ["", f"Estimated in {e.seconds:.0f} s; fake-mode corrections: {'; '.join(CORRECTIONS)}; "
              + ", ".join(f"{k} {v}" for k, v in versions().items())]
    return "\n".join(lines)


def checkpoint_bytes(e: Estimate) -> tuple[float, float]:
    """(bytes of one rank's checkpoint: its sharded parameters and optimizer states, bytes per node)."""
    per_rank = float(e.measurement.by_kind.get("Sharded Param", 0) + e.measurement.by_kind.get("OptState", 0))
    return per_rank, per_rank * e.opts.gpus_per_node


def checkpoint_text(e: Estimate) -> str:
    """The checkpoint's size, its predicted save time, and whether the time limit's lead covers it."""
    per_rank, per_node = checkpoint_bytes(e)
    save_s = time_limit.predicted_save_s(per_node)
    need = time_limit.lead_needed(save_s)
    line = (f"Checkpoint: {gib(per_rank)} per GPU, {gib(per_node)} per node (parameters and optimizer states); at "
            f"{time_limit.NODE_WRITE_GBPS:g} GB/s of writes per node (an assumption: measure it) a save takes "
            f"~{save_s:.0f} s, so the time-limit warning (#SBATCH --signal=USR1@LEAD) needs LEAD >= a step + "
            f"{need:.0f} s (1.5 x the save + 30 s)")
    warning = time_limit.check(time_limit.lead_from_env(), save_s, None, "predicted", time_limit.limit_from_env())
    return line + (f"\nWARNING: {warning}" if warning else "")


FLOOR_WHAT = ("the sharded parameters, gradients and optimizer states as the optimizer step starts, and the terms "
              "that do not depend on the implementation")


def floor_text(e: Estimate) -> str:
    """Through a stand-in: what any implementation holds, and whether that alone decides."""
    held = f"Whatever the implementation saves for backward, it holds {gib(e.floor)} ({FLOOR_WHAT})"
    if e.floor > e.gpu.memory_bytes:
        return f"{held}: more than the GPU's {gib(e.gpu.memory_bytes)}, so it does not fit whatever the implementation"
    return (f"{held}: that fits the GPU's {gib(e.gpu.memory_bytes)}; the verdict above rests on the stand-in's "
            f"activations")


def to_dict(e: Estimate) -> dict:
    m = e.measurement
    return {
        "model": e.cfg.model, "model_impl": m.decision.impl.name, "job_model_impl": m.decision.job_impl.name,
        "stand_in": m.decision.stand_in,
        "notes": list(m.decision.notes), "precision": m.decision.precision.name,
        "nodes": e.opts.nodes, "gpus_per_node": e.opts.gpus_per_node, "world_size": e.opts.world_size,
        "mesh": dict(m.decision.dims.shape), "train_batch_size": e.cfg.train_batch_size,
        "max_context_width": e.cfg.max_context_width, "grad_accum_steps": e.cfg.grad_accum_steps,
        "activation_checkpointing": e.cfg.activation_checkpointing, "num_params": m.num_params,
        "gpu": dataclasses.asdict(e.gpu),
        "peak_bytes": m.peak_bytes, "peak_by_kind": dict(m.by_kind),
        "peak_at": {**dataclasses.asdict(m.where), "micro_batches": m.micro_batches},
        "terms": [t.to_dict() for t in e.terms], "margin_why": MARGIN_WHY,
        "verdict": e.verdict.to_dict(), "collectives": e.collectives,
        "floor": {"bytes": e.floor, "what": FLOOR_WHAT, "decides": e.decided and bool(m.decision.stand_in)},
        "suggestions": e.suggestions, "seconds": round(e.seconds, 1),
        "checkpoint": {"bytes_per_gpu": checkpoint_bytes(e)[0], "bytes_per_node": checkpoint_bytes(e)[1],
                       "predicted_save_s": time_limit.predicted_save_s(checkpoint_bytes(e)[1]),
                       "node_write_gbps": time_limit.NODE_WRITE_GBPS, "signal_lead_s": time_limit.lead_from_env()},
        "corrections": list(CORRECTIONS), "versions": versions(),
        "prediction": _prediction(e),
    }


def _prediction(e: Estimate) -> dict | None:
    """The FP8 speed-up prediction (``--fp8 1`` only), as JSON."""
    if not e.cfg.fp8:
        return None
    from llama_fp8.estimate import predict

    pred, recipe = predict.for_estimate(e)
    return {**predict.to_dict(pred), "job_recipe": recipe}
