"""The GPUs an estimate can be checked against: memory per GPU and the bandwidths its collectives are timed at.

Memory is what PyTorch can allocate on the device: ``torch.cuda.get_device_properties().total_memory``, the "total
capacity" of its out-of-memory message, as published for each GPU (each row's source). It is less than nvidia-smi's
``memory.total`` (also stated) by what the driver and firmware keep (nvidia-smi's ``memory.reserved``): 551 MiB on an
H100 80GB HBM3. The CUDA context and NCCL's buffers come out of it (terms of the estimate, ``terms.py``). Where the
published numbers differ (driver versions, boards), the lowest is taken. Bandwidths are per GPU and per direction:
NVLink from the datasheet (its "900 GB/s" is both directions together), the network from the AWS instance's
published EFA bandwidth shared by its GPUs (``instance``). Both are stated ceilings: NCCL reaches less (its nccl-tests
report bus bandwidth), so the times an estimate prints are lower bounds. A node has ``gpus_per_node`` GPUs (4 on the
Grace Blackwell trays of GB200 / GB300 NVL72), and ``nvlink_domain_nodes`` nodes share one NVLink domain (18 on an
NVL72 rack: 72 GPUs; 1 elsewhere, where NVLink ends at the node). Imports nothing of the package (the estimate flags
read the names from here; ``python -m llama_fp8.estimate.gpus "NVIDIA GB200"`` prints the row of a device name for
the batch script's estimate).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int  # what PyTorch can allocate (total_memory)
    nvlink_gbs: float  # GB/s per direction between GPUs of one NVLink domain
    network_gbs: float  # GB/s per GPU between NVLink domains (EFA on AWS)
    source: str
    nvls: bool = False  # NVSwitch with NVLink SHARP: NCCL allocates NVLS buffers per communicator (terms.py)
    gpus_per_node: int = 8
    nvlink_domain_nodes: int = 1
    instance: str = ""  # the AWS instance type whose network figure is used


def domain_of(rank: int, gpus_per_node: int, gpu: Gpu) -> int:
    """The NVLink domain rank ``rank`` is in, ranks placed node by node and nodes domain by domain (what Slurm's
    topology/block with --segment gives: docs/gb200.md)."""
    return (rank // gpus_per_node) // gpu.nvlink_domain_nodes


_SMI = "nvidia-smi memory.total as listed in modal-labs/modal-client#2797"
_NVL5 = "NVLink 5: 1.8 TB/s both directions per GPU"
_GB_EFA = ("AWS p6e-gb200.36xlarge: 4 GPUs per instance, 28.8 Tbit/s EFAv4 per u-p6e-gb200x72 UltraServer of 72 GPUs "
           "= 400 Gbit/s = 50 GB/s per GPU (AWS P6e-GB200 UltraServers launch post; the EC2 specifications list "
           "3200 Gbit/s of network bandwidth per instance: the lower figure is taken)")
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
    Gpu("B200", 182630 * MIB, 900.0, 50.0,
        "178.35 GiB as PyTorch sees a B200 (its out-of-memory message's total capacity in published 8 x B200 logs, "
        f"178.35-178.36 GiB), 729 MiB less than its 183,359 MiB in nvidia-smi; {_NVL5} (NVIDIA DGX B200 / HGX B200 "
        "datasheets); AWS p6-b200.48xlarge: 3200 Gbit/s EFAv4 (8 x 400 Gbit/s) for 8 GPUs = 50 GB/s per GPU (AWS P6 "
        "instance page, EC2 accelerated computing specifications)", nvls=True, instance="p6-b200.48xlarge"),
    Gpu("B300", 274114 * MIB, 900.0, 100.0,
        "267.69 GiB as PyTorch sees a B300 (the device total in published 8 x B300 logs), 926 MiB less than its "
        f"275,040 MiB in nvidia-smi (\"NVIDIA B300 SXM6 AC\"); {_NVL5} (NVIDIA HGX B300 datasheet); AWS "
        "p6-b300.48xlarge: 6400 Gbit/s EFAv4 for 8 GPUs = 100 GB/s per GPU (AWS P6-B300 launch post)", nvls=True,
        instance="p6-b300.48xlarge"),
    Gpu("GB200", 188733 * MIB, 900.0, 50.0,
        "184.31 GiB as PyTorch sees a GB200 (its out-of-memory message's total capacity in published GB200 NVL72 "
        f"logs), 738 MiB less than its 189,471 MiB in nvidia-smi; {_NVL5}, 72 GPUs in one NVLink domain on 18 nodes of "
        f"4 (NVIDIA GB200 NVL72 datasheet); {_GB_EFA}", nvls=True, gpus_per_node=4, nvlink_domain_nodes=18,
        instance="p6e-gb200.36xlarge"),
    Gpu("GB300", 283136 * MIB, 900.0, 50.0,
        "276.50 GiB as PyTorch sees a GB300 (the total capacity torchtitan reports in published 16 x 4 GB300 logs), "
        f"1,072 MiB less than its 284,208 MiB in nvidia-smi; {_NVL5}, 72 GPUs in one NVLink domain on 18 nodes of 4 "
        "(NVIDIA GB300 NVL72 datasheet); network: no per-GPU EFA figure was found for AWS P6e-GB300, so P6e-GB200's "
        "400 Gbit/s = 50 GB/s per GPU is taken", nvls=True, gpus_per_node=4, nvlink_domain_nodes=18,
        instance="p6e-gb300.36xlarge"),
)}
# the instance types of the rows above whose sources name P5 / P4 (the rows' figures are unchanged)
GPUS.update({n: replace(GPUS[n], instance=i) for n, i in (("H100", "p5.48xlarge"), ("H200", "p5en.48xlarge"),
                                                           ("A100-80GB", "p4d.24xlarge"), ("A100-40GB", "p4d.24xlarge"))})
DEFAULT_GPU = "H100"


def names() -> tuple[str, ...]:
    return tuple(GPUS)


def get(name: str, memory_gib: float | None = None) -> Gpu:
    """The GPU ``name`` (a key of GPUS), its memory replaced by ``memory_gib`` when given: any other GPU is
    described by its memory and the bandwidths of the named one."""
    gpu = GPUS[name]
    if memory_gib is None:
        return gpu
    return replace(gpu, name=f"{name} ({memory_gib:g} GiB)", memory_bytes=int(memory_gib * GIB),
                   source=f"--gpu_memory_gib {memory_gib:g}; bandwidths of {name}: {gpu.source.split('; ', 1)[1]}")


def for_device(device_name: str) -> str | None:
    """The row of a CUDA device name ("NVIDIA GB200" -> GB200, "NVIDIA B300 SXM6 AC" -> B300, "NVIDIA A100-SXM4-80GB"
    -> A100-80GB): every dash-separated part of the row's name as a whole word, the longest names first (so that
    GB200 is not taken for B200); None for a GPU not in the table."""
    upper = device_name.upper()
    for name in sorted(GPUS, key=len, reverse=True):
        if all(re.search(rf"(?<![A-Z0-9]){re.escape(part)}(?![A-Z0-9])", upper) for part in name.upper().split("-")):
            return name
    return None


if __name__ == "__main__":  # the batch script's estimate (job_estimate.sh lf_estimate): the row of nvidia-smi's name
    print(for_device(" ".join(sys.argv[1:])) or "")
