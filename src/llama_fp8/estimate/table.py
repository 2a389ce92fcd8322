"""docs/estimate.md's "what fits" table: for every preset at its own sequence length and batch, the Hugging Face model
(``--model_impl hf``: the model the estimate runs; ``auto``'s TE model is estimated through it), the smallest
number of 8-GPU H100 nodes, and at that size the activation checkpointing with the least recomputation, whose
estimate fits (with the allocator margin). ``scripts/estimate_table.py`` runs the search (26 estimates: 14 minutes
on 2 cores) and writes the table between ``<!-- fit-table:start -->`` and ``<!-- fit-table:end -->``.

The table carries a fingerprint of what decides it: every preset's whole resolved configuration as the search
asks for it (the presets, and the train defaults they do not set: micro-batch, BF16, sharding, ...), the
search's settings, the GPU, the terms' sizes and margin, and ``REVISION``, raised by hand when the estimator's
counting changes (the code is not hashed: any edit would make the table stale). The library versions it was
made with are stated in the table, not fingerprinted: CI installs what the lower bounds in pyproject.toml allow.
tests/estimate/test_table.py recomputes the fingerprint (no estimate runs in CI) and fails when the table is
stale.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable

REVISION = 3  # 2: the NCCL term per communicator and the world's communicator; 3: the chunked loss, the selective policy,
# the embedding and head sharded on their own, the GPUs' memory as PyTorch sees it, NVLS
GPU = "H100"
GPUS_PER_NODE = 8
GPU_FIELDS = ("name", "memory_bytes", "nvlink_gbs", "network_gbs", "source", "nvls")
"""What the table's estimates read of the GPU row (its nodes and domain are GPUS_PER_NODE and one node here)."""
NODES = (1, 2, 4, 8, 16, 32, 64)
AC_SEARCH = ("full", "selective", "none")  # full first (the least memory), then less recomputation while it fits
MARKERS = ("<!-- fit-table:start -->", "<!-- fit-table:end -->")


def train_flags(preset: str, ac: str) -> list[str]:
    """The train command line of one estimate of the search."""
    return ["--model", preset, "--model_impl", "hf", "--activation_checkpointing", ac]


def _inputs() -> dict:
    from llama_fp8 import config
    from llama_fp8.estimate import gpus, terms

    gpu = {k: v for k, v in dataclasses.asdict(gpus.GPUS[GPU]).items() if k in GPU_FIELDS}
    return {"revision": REVISION, "gpu": gpu, "gpus_per_node": GPUS_PER_NODE,
            "nodes": NODES, "ac": AC_SEARCH,
            "terms": [terms.CONTEXT_BYTES, terms.NCCL_PER_COMMUNICATOR, terms.NCCL_NVLS_PER_COMMUNICATOR,
                      terms.CUBLAS_WORKSPACE, terms.ALLOCATOR_MARGIN],
            "presets": {name: dataclasses.asdict(config.parse_args(train_flags(name, AC_SEARCH[0])))
                        for name in config.available_presets()}}  # the other AC modes differ in that flag only


def fingerprint() -> str:
    return hashlib.sha256(json.dumps(_inputs(), sort_keys=True, default=str).encode()).hexdigest()[:16]


def versions() -> str:
    """The installed libraries the estimates run on (those every report states), as the table states them."""
    from llama_fp8.estimate import report

    return ", ".join(f"{name} {version}" for name, version in report.versions().items())


def search(preset: str, progress: Callable[[str], None] = lambda _: None) -> dict:
    """The smallest layout of ``preset`` that fits, as a table row (every estimate it took is counted)."""
    from llama_fp8 import config
    from llama_fp8.estimate import assess
    from llama_fp8.estimate.flags import EstimateOptions

    runs = 0

    def estimate(nodes: int, ac: str):
        nonlocal runs
        runs += 1
        progress(f"{preset}: {nodes} node(s), activation checkpointing {ac}")
        cfg = config.parse_args(train_flags(preset, ac))
        return assess.estimate(cfg, EstimateOptions(nodes=nodes, gpus_per_node=GPUS_PER_NODE, gpu=GPU, suggest=False))

    for nodes in NODES:
        best = estimate(nodes, AC_SEARCH[0])
        if best.verdict.status != "fits":
            continue
        for ac in AC_SEARCH[1:]:
            other = estimate(nodes, ac)
            if other.verdict.status != "fits":
                break
            best = other
        return _row(preset, best, runs)
    return {"preset": preset, "nodes": None, "estimates": runs}


def _row(preset: str, e, runs: int) -> dict:
    m = e.measurement
    return {"preset": preset, "params_b": round(m.num_params / 1e9, 2), "seq": e.cfg.max_context_width,
            "batch": e.cfg.train_batch_size, "nodes": e.opts.nodes, "ac": e.cfg.activation_checkpointing,
            "tracked_gib": round(m.peak_bytes / 2**30, 1), "needed_gib": round(e.verdict.needed / 2**30, 1),
            "margin_gib": round(e.verdict.margin / 2**30, 1), "peak_at": m.where.text(m.micro_batches),
            "estimates": runs, "seconds": round(e.seconds)}


def render(rows: list[dict], fp: str, made_with: str | None = None) -> str:
    lines = [f"<!-- fingerprint {fp} (estimate/table.py; scripts/estimate_table.py rewrites this table) -->",
             f"Estimated for the Hugging Face model (`--model_impl hf`), with {made_with or versions()}:", "",
             "| preset | parameters | sequence x batch per GPU | smallest fit (8 x H100 80GB per node) | activation "
             "checkpointing | needed (tracked peak) + margin, GiB | the peak is in |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["nodes"] is None:
            lines.append(f"| {r['preset']} | | | does not fit on {NODES[-1]} nodes, even with full checkpointing | "
                         f"| | |")
            continue
        params = f"{r['params_b']} B" if r["params_b"] >= 0.01 else "< 0.01 B"
        lines.append(f"| {r['preset']} | {params} | {r['seq']} x {r['batch']} | {r['nodes']} node(s), "
                     f"{r['nodes'] * GPUS_PER_NODE} GPUs | {r['ac']} | {r['needed_gib']} ({r['tracked_gib']}) + "
                     f"{r['margin_gib']} | {r['peak_at']} |")
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    start, end = MARKERS
    return re.sub(rf"({re.escape(start)}\n)(?:.*?\n)?({re.escape(end)})", lambda m: m.group(1) + block + "\n" +
                  m.group(2), text, flags=re.S)


def stale(text: str) -> str | None:
    """Why the table in ``text`` is stale (None: its fingerprint is current)."""
    start, end = MARKERS
    m = re.search(rf"{re.escape(start)}\n<!-- fingerprint (\w+) ", text)
    if m is None:
        return f"no table with a fingerprint between {start} and {end}"
    if m.group(1) != fingerprint():
        return f"the table was made from other inputs (fingerprint {m.group(1)}, now {fingerprint()})"
    return None
