"""FP8 primary weights (``--fp8_all_gather 1`` with the TE model): TE modules built under
``quantized_model_init`` hold FP8 weights, which FSDP2 then all-gathers as FP8 bytes (half of BF16's).

Such a module cannot be materialized by ``to_empty`` and filled in place like a BF16 one: its weights are
``QuantizedTensor`` subclasses. TE's own FSDP2 path (its tests/pytorch/distributed/fsdp2_tests) builds on
meta, shards, then calls ``reset_parameters()``, which allocates each local shard, runs the parameter's
``init_fn`` on the high-precision values and quantizes them (reducing the amax over the shard group for
current scaling). We follow it, with one change: each parameter's ``init_fn`` is replaced by our own
sharding-independent init of exactly the part that shard holds (``models.common.init_part_``), so an FP8-
parameter run starts from the same values as its BF16 partner (before quantization). All other modules are
materialized by ``to_empty`` and initialized as usual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from llama_fp8.models.common import canonical_name, init_part_, local_part


def fp8_param_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """TE modules whose primary weights are FP8 (built under ``quantized_model_init``)."""
    for prefix, module in model.named_modules():
        if getattr(module, "primary_weights_in_fp8", False):
            yield prefix, module


def owned(model: nn.Module) -> set[int]:
    """Ids of the parameters that ``materialize`` initialized (TE's reset_parameters with our values)."""
    return {id(p) for _, m in fp8_param_modules(model) for p in m.parameters(recurse=False)}


def materialize(model: nn.Module, device: torch.device, cfg, blocks_of: Callable | None = None) -> int:
    """Allocate the sharded meta model: FP8-weight modules through TE's ``reset_parameters`` (initialized with
    our values; ``blocks_of`` as for ``common.init_weights``), every other module with ``to_empty``. Returns
    the number of FP8-weight modules."""
    count = 0
    for prefix, module in model.named_modules():
        if not getattr(module, "primary_weights_in_fp8", False):
            module.to_empty(device=device, recurse=False)
            continue
        for name, param in module.named_parameters(recurse=False):
            _, offset, shape = local_part(param)  # metadata only: works on a meta DTensor
            full = canonical_name(f"{prefix}.{name}" if prefix else name)
            blocks = blocks_of(full, param.shape[0]) if blocks_of and param.dim() >= 2 else None
            module.param_init_meta[name].init_fn = functools.partial(init_part_, offset=offset, full_shape=shape,
                                                                     name=full, cfg=cfg, blocks=blocks)
        module.reset_parameters()
        count += 1
    return count

