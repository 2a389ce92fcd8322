"""FSDP2 around a model, in one fixed order: the only place that shards anything.

activation checkpointing -> torch.compile per block -> fully_shard per block -> fully_shard the root.
What differs per model implementation (its AC wrapper, whether FSDP2 may cast a block's inputs, what
must survive the swap to DTensors) comes from the implementation object.
"""

from __future__ import annotations

import torch
from torch import nn


def parallelize(model: nn.Module, impl, mesh, cfg) -> nn.Module:
    """Shard ``model`` (on meta, FP8-converted already) over ``mesh``. With --bf16 1, parameters are
    all-gathered in BF16 and gradients reduced in FP32."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    layers = impl.decoder_layers(model)
    for i, layer in enumerate(layers):
        layer = impl.wrap_activation_checkpointing(layer, cfg.activation_checkpointing)
        if cfg.compile:
            layer.compile()  # in place: parameter names (and checkpoints) stay the same
        layers[i] = layer
    root, block = {"mesh": mesh}, {"mesh": mesh}
    if cfg.bf16:
        root["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        block["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                  cast_forward_inputs=impl.cast_block_inputs)
    if cfg.cpu_offload:
        root["offload_policy"] = block["offload_policy"] = CPUOffloadPolicy()
    with impl.sharding(model):
        for i, layer in enumerate(layers):
            # The last block is needed first in backward: resharding it after forward would only make
            # backward gather it straight back.
            fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **block)
        fully_shard(model, reshard_after_forward=False, **root)
    return model
