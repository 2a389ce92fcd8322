"""The GPUs an estimate can be checked against: memory per GPU and the bandwidths its collectives are timed at.

Memory is what the CUDA driver reports as the device's total (nvidia-smi's ``memory.total``, the same number as
``torch.cuda.mem_get_info()[1]``), not the marketing "80 GB": the whole of it, before the CUDA context and the
driver's own reserve are taken out (those are a term of the estimate, ``terms.py``). Bandwidths are per GPU and
per direction: NVLink from the datasheet (its "900 GB/s" is both directions together), the network from the
instance's published network bandwidth shared by its GPUs. Both are stated ceilings: NCCL reaches less (its
nccl-tests report bus bandwidth), so the times an estimate prints are lower bounds. Imports nothing of the
package (the estimate flags read the names from here).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    nvlink_gbs: float  # GB/s per direction between GPUs of a node
    network_gbs: float  # GB/s per GPU between nodes
    source: str


_SMI = "nvidia-smi memory.total on that GPU"
_P5 = "AWS p5.48xlarge: 3200 Gbit/s EFA for 8 GPUs = 50 GB/s per GPU"
_P4 = "AWS p4d.24xlarge: 400 Gbit/s EFA for 8 GPUs = 6.25 GB/s per GPU"
GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("H100", 81559 * MIB, 450.0, 50.0,
        f"{_SMI} (H100 80GB HBM3: 81559 MiB); NVLink 900 GB/s both directions (NVIDIA H100 datasheet, SXM); {_P5}"),
    Gpu("H200", 143771 * MIB, 450.0, 50.0,
        f"{_SMI} (H200: 143771 MiB); NVLink 900 GB/s both directions (NVIDIA H200 datasheet, SXM); AWS p5en.48xlarge: "
        "3200 Gbit/s EFA for 8 GPUs = 50 GB/s per GPU"),
    Gpu("A100-80GB", 81920 * MIB, 300.0, 6.25,
        f"{_SMI} (A100-SXM4-80GB: 81920 MiB); NVLink 600 GB/s both directions (NVIDIA A100 datasheet, SXM); {_P4}"),
    Gpu("A100-40GB", 40960 * MIB, 300.0, 6.25,
        f"{_SMI} (A100-SXM4-40GB: 40960 MiB); NVLink 600 GB/s both directions (NVIDIA A100 datasheet, SXM); {_P4}"),
)}
DEFAULT_GPU = "H100"


def names() -> tuple[str, ...]:
    return tuple(GPUS)


def get(name: str, memory_gib: float | None = None) -> Gpu:
    """The GPU ``name`` (a key of GPUS), its memory replaced by ``memory_gib`` when given: any other GPU is
    described by its memory and the bandwidths of the named one."""
    gpu = GPUS[name]
    if memory_gib is None:
        return gpu
    return Gpu(f"{name} ({memory_gib:g} GiB)", int(memory_gib * GIB), gpu.nvlink_gbs, gpu.network_gbs,
               f"--gpu_memory_gib {memory_gib:g}; bandwidths of {name}: {gpu.source.split('; ', 1)[1]}")
