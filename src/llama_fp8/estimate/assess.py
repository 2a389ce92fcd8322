"""One estimate: a measurement in a fake world of the job's size, the terms the tracker cannot see, the verdict
against the GPU, and the step's communication timed at the GPU's stated bandwidths."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llama_fp8.estimate import build, corrections, gpus, layers, run, terms
from llama_fp8.estimate.flags import EstimateOptions

# bus-bandwidth factors (NVIDIA nccl-tests, doc/PERFORMANCE.md): the bytes each rank moves per byte of the
# collective's whole buffer, on a ring of n ranks
_FACTOR = {"all_gather": lambda n: (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
           "all_to_all": lambda n: (n - 1) / n, "all_reduce": lambda n: 2 * (n - 1) / n}


@dataclass
class Estimate:
    cfg: object
    opts: EstimateOptions
    gpu: gpus.Gpu
    measurement: run.Measurement
    terms: list[terms.Term]
    verdict: terms.Verdict
    collectives: list[dict]  # the measurement's, with "ranks", "link", "gbs", "seconds"
    suggestions: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    floor: int = 0  # terms.floor: what any implementation of these shapes holds

    @property
    def fits(self) -> bool:
        return self.verdict.status != "does not fit"

    @property
    def decided(self) -> bool:
        """Whether "does not fit" is a verdict to stop a job on: the job's own implementation was estimated, or
        what any implementation holds (the floor) does not fit either."""
        return not self.measurement.decision.stand_in or self.floor > self.gpu.memory_bytes


def link_of(ranks: list[int], gpus_per_node: int, gpu: gpus.Gpu) -> tuple[str, float]:
    """(the link, GB/s per GPU and direction) for a group of ranks: "NVLink" within a node, "NVLink (multi-node)"
    within one NVLink domain of several nodes (GB200 / GB300 NVL72), "network" across domains."""
    if len({gpus.domain_of(r, gpus_per_node, gpu) for r in ranks}) > 1:
        return "network", gpu.network_gbs
    nodes = {r // gpus_per_node for r in ranks}
    return ("NVLink (multi-node)" if len(nodes) > 1 else "NVLink"), gpu.nvlink_gbs


def timed(collectives: list[dict], group_ranks: dict[str, list[int]], gpus_per_node: int,
          gpu: gpus.Gpu) -> list[dict]:
    out = []
    for c in collectives:
        ranks = group_ranks.get(c["dim"], [0])
        n = len(ranks)
        link, gbs = link_of(ranks, gpus_per_node, gpu)
        moved = c["bytes"] * _FACTOR.get(c["kind"], lambda n: 1.0)(n) if n > 1 else 0.0
        out.append({**c, "ranks": n, "link": link, "gbs": gbs, "seconds": moved / (gbs * 1e9)})
    return out


def estimate(cfg, opts: EstimateOptions, progress: run.Progress = lambda _: None) -> Estimate:
    """Measure ``cfg`` as rank 0 of ``opts.nodes`` x ``opts.gpus_per_node`` and judge it against ``opts.gpu``."""
    t0 = time.perf_counter()
    gpu = gpus.get(opts.gpu, opts.gpu_memory_gib)
    env = build.env_for(opts.world_size, opts.gpus_per_node)
    m = layers.measure(cfg, env, progress=progress)  # in a fake world of opts.world_size ranks
    found = terms.gpu_terms(m.collectives, m.group_ranks, m.fp8_operand_bytes, bool(cfg.compile), gpu,
                            opts.gpus_per_node)
    return Estimate(cfg, opts, gpu, m, found, terms.verdict(m.peak_bytes, found, gpu),
                    timed(m.collectives, m.group_ranks, opts.gpus_per_node, gpu), seconds=time.perf_counter() - t0,
                    floor=terms.floor(m.at_optimizer or {}, found))


CORRECTIONS = corrections.NAMES
