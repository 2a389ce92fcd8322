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

The optimizer's FP32 master of an FP8 weight must start from those values too, not from the FP8-quantized weight
(under delayed scaling the init is even quantized at scale 1.0). Each materialized parameter therefore carries
``INITIAL_VALUES``: a function that recomputes its local part in FP32 with the same init (no copy is kept; TE's
own ``preserve_high_precision_init_val`` would keep one on the host for every FP8 weight).

``--fp8_exclude`` layers: the whole model is built under ``quantized_model_init``, so TE marks every GEMM module
for FP8 weights, also the excluded ones, which never run with FP8 on. Their weights would be stored in FP8
anyway (under delayed scaling at scale 1.0 forever, since their scale is only ever updated by an FP8 forward),
the opposite of "kept in high precision". ``keep_high_precision`` unmarks them before anything is allocated:
nothing is quantized while the model is on meta (TE defers ``reset_parameters``), so they are then materialized,
initialized and all-gathered as BF16 modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from torch import nn

from llama_fp8.models.common import canonical_name, init_part_, local_part

INITIAL_VALUES = "fp8_init_fn"  # attribute of a materialized FP8-module parameter: fills its local part


def fp8_param_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """TE modules whose primary weights are FP8 (built under ``quantized_model_init``)."""
    for prefix, module in model.named_modules():
        if getattr(module, "primary_weights_in_fp8", False):
            yield prefix, module


def keep_high_precision(model: nn.Module, prefixes: list[str]) -> list[str]:
    """Unmark for FP8 weights every TE module at or under the module names ``prefixes`` (the --fp8_exclude
    layers), before materialization. Returns the names of the modules unmarked."""
    out = []
    for name, module in fp8_param_modules(model):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            module.primary_weights_in_fp8 = False  # read by TE's reset_parameters and by materialize below
            module.preserve_high_precision_init_val = False
            out.append(name)
    return out


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
        for name, param in module.named_parameters(recurse=False):  # the Parameters reset_parameters put in
            setattr(param, INITIAL_VALUES, module.param_init_meta[name].init_fn)
        count += 1
    return count


def initial_values(param: torch.Tensor) -> torch.Tensor | None:
    """The FP32 values this rank's part of an FP8 weight was initialized with (before quantization), or None."""
    init_fn = getattr(param, INITIAL_VALUES, None)
    if init_fn is None:
        return None
    local = local_part(param)[0]
    values = torch.empty(tuple(local.shape), dtype=torch.float32, device=local.device)
    init_fn(values)
    return values

