"""One process standing in for one rank of any world size: torch's fake process group and fake tensors.

- The process group is torch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``, which
  ``init_process_group`` imports itself for that backend): rank r of N with no other process; every collective
  returns at once with its output tensor allocated and untouched. The mesh, FSDP2's sharding and tensor
  parallelism see N ranks, so each tensor has the shape it has on rank r of a real job.
- The tensors are ``FakeTensorMode`` tensors on the CPU device: shapes, dtypes, strides and storages without
  data. CPU, not ``cuda``: on a CUDA-less torch fake ``cuda`` tensors send SDPA to the math path (a T x T score
  matrix per head) or abort, and ``fully_shard`` refuses a cuda mesh; CPU SDPA picks its flash kernel, whose
  memory (output and log-sum-exp saved for backward) is the GPU flash kernel's.

The model is built, converted and sharded on the meta device before fake mode is entered (as training does:
nothing is allocated by then); only the materialization and the steps run on fake tensors. Meta tensors are
not fake tensors, hence ``allow_non_fake_inputs`` (the meta parameters are the inputs of ``to_empty``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


@contextlib.contextmanager
def process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` on torch's fake backend, for the duration."""
    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process: the estimate needs its own (fake) one")
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tensor_mode():
    """The fake tensor mode the materialization and the steps run in."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)

