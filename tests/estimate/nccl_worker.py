"""One rank of the GPU test's NCCL measurement (``torchrun --nproc_per_node 2 nccl_worker.py OUT.json``): the device
memory outside PyTorch's allocator that one NCCL communicator takes once it has run the collectives a training step
runs (all-gather, reduce-scatter, all-reduce of 64 MiB). Rank 0 writes each rank's bytes."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from llama_fp8.collector import leave


def outside_allocator(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def main(out: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    x = torch.ones(2**24, device=device)  # 64 MiB of FP32; the context and the allocator's pool exist from here
    before = outside_allocator(device)
    dist.init_process_group("nccl", device_id=device)  # eager, as training's (parallel/dist.py)
    gathered = torch.empty(world * x.numel(), device=device)
    dist.all_gather_into_tensor(gathered, x)
    dist.reduce_scatter_tensor(x, gathered)
    dist.all_reduce(x)
    used = outside_allocator(device) - before
    seen = [None] * world
    dist.all_gather_object(seen, used)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"bytes_per_rank": seen, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    leave(0)  # as `python -m llama_fp8` leaves: without the shutdown's collections
