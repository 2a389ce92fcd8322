"""The GPUs an estimate can be checked against: memory per GPU and the bandwidths its collectives are timed at.

Memory is what PyTorch can allocate on the device: ``torch.cuda.get_device_properties().total_memory``, the "total
capacity" of its out-of-memory message, as published for each GPU (each row's source). It is less than nvidia-smi's
``memory.total`` (also stated) by what the driver and firmware keep (nvidia-smi's ``memory.reserved``): 551 MiB on an
H100 80GB HBM3. The CUDA context and NCCL's buffers come out of it (terms of the estimate, ``terms.py``). Where the
published numbers differ (driver versions, boards), the lowest is taken. Bandwidths are per GPU and per direction:
NVLink from the datasheet (its "900 GB/s" is both directions together), the network from the instance's published
network bandwidth shared by its GPUs. Both are stated ceilings: NCCL reaches less (its nccl-tests report bus
bandwidth), so the times an estimate prints are lower bounds. Imports nothing of the package (the estimate flags
read the names from here).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int  # what PyTorch can allocate (total_memory)
    nvlink_gbs: float  # GB/s per direction between GPUs of a node
    network_gbs: float  # GB/s per GPU between nodes
    source: str
    nvls: bool = False  # NVSwitch with NVLink SHARP: NCCL allocates NVLS buffers per communicator (terms.py)


_SMI = "nvidia-smi memory.total as listed in modal-labs/modal-client#2797"
_P5 = "AWS p5.48xlarge: 3200 Gbit/s EFA for 8 GPUs = 50 GB/s per GPU"
_P4 = "AWS p4d.24xlarge: 400 Gbit/s EFA for 8 GPUs = 6.25 GB/s per GPU"
GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("H100", 81008 * MIB, 450.0, 50.0,
        "79.11 GiB as PyTorch sees an H100 80GB HBM3 (pytorch/torchtitan#1789, 73.32 GiB logged as 92.70 %, and "
        f"vllm-project/vllm#27508), 551 MiB less than its 81,559 MiB in nvidia-smi ({_SMI}); NVLink 900 GB/s both "
        f"directions (NVIDIA H100 datasheet, SXM); {_P5}", nvls=True),
    Gpu("H200", 143155 * MIB, 450.0, 50.0,
        "139.80 GiB as PyTorch sees an H200 (its out-of-memory message's total capacity in published 8 x H200 logs, "
        "139.80-139.81 GiB), 616 MiB less than its 143,771 MiB in nvidia-smi; NVLink 900 GB/s both directions (NVIDIA "
        "H200 datasheet, SXM); AWS p5en.48xlarge: 3200 Gbit/s EFA for 8 GPUs = 50 GB/s per GPU", nvls=True),
    Gpu("A100-80GB", 81050 * MIB, 300.0, 6.25,
        "79.15 GiB as PyTorch sees an A100-SXM4-80GB (its out-of-memory message's total capacity, 79.25 GiB in "
        f"levihsu/OOTDiffusion#235), of 81,920 MiB in nvidia-smi ({_SMI}); NVLink 600 GB/s both directions (NVIDIA "
        f"A100 datasheet, SXM); {_P4}"),
    Gpu("A100-40GB", 40448 * MIB, 300.0, 6.25,
        "39.50 GiB as PyTorch sees an A100 40GB (TianheWu/CoSeR#10, 39.59 GiB in raoyongming/DenseCLIP#52), of "
        f"40,960 MiB in nvidia-smi ({_SMI}); NVLink 600 GB/s both directions (NVIDIA A100 datasheet, SXM); {_P4}"),
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
               f"--gpu_memory_gib {memory_gib:g}; bandwidths of {name}: {gpu.source.split('; ', 1)[1]}", gpu.nvls)
