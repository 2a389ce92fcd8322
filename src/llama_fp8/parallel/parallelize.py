"""Tensor parallelism, context parallelism and FSDP2 around a model, in one fixed order: the only place that
shards anything.

(FP8 conversion on meta, done before) -> tensor parallelism -> context parallelism -> activation
checkpointing -> torch.compile per block -> fully_shard per block -> fully_shard the embedding and the LM head
(each a unit of its own, unless they share their weight) -> fully_shard the root.

TP first, so that FSDP2 shards the TP-local weights further (2-D DTensors); FSDP2 runs on the data-parallel
part of the mesh only (never a mesh with tp in it). What differs per model implementation (its TP plan, its
CP mechanism, its AC wrapper, whether FSDP2 may cast a block's inputs, what must survive the swap to
DTensors) comes from the implementation object.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

from llama_fp8.parallel.context import StepContext
from llama_fp8.parallel.dims import ParallelDims, fsdp_mesh

log = logging.getLogger(__name__)


def parallelize(model: nn.Module, impl, mesh, cfg, dims: ParallelDims | None = None,
                fp8_collectives: bool = False) -> StepContext:
    """Shard ``model`` (on meta, FP8-converted already) over ``mesh`` (``build_mesh(dims)``; without ``dims``,
    a data-parallel mesh used as is). With --bf16 1, parameters are all-gathered in BF16 and gradients
    reduced in FP32. ``fp8_collectives``: TP may all-gather in FP8 (torchao tensorwise on NCCL). Returns what
    every training step runs inside."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    context = StepContext()
    if dims is not None and dims.tp > 1:
        context.loss_parallel = impl.apply_tensor_parallel(model, mesh["tp"], cfg, fp8_collectives)
        log.info("tensor parallel over %d ranks%s", dims.tp, " (FP8 collectives)" if fp8_collectives else "")
    if dims is not None and dims.cp > 1:
        context.cp_mesh = mesh["cp"]
        context.cp_mode = impl.apply_context_parallel(model, mesh["cp"], cfg, dims)
        context.cp_rotate = impl.cp_rotate(cfg)
        log.info("context parallel over %d ranks (%s, %s)", dims.cp, context.cp_mode, cfg.cp_comm_type)
    layers = impl.decoder_layers(model)
    for i, layer in enumerate(layers):
        layer = impl.wrap_activation_checkpointing(layer, cfg.activation_checkpointing)
        if cfg.compile:
            layer.compile()  # in place: parameter names (and checkpoints) stay the same
        layers[i] = layer
    dp_mesh = mesh if dims is None else fsdp_mesh(mesh, dims)
    root, block = {"mesh": dp_mesh}, {"mesh": dp_mesh}
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
        shard_ends(model, impl, root)
        fully_shard(model, reshard_after_forward=False, **root)
    return context


def shard_ends(model: nn.Module, impl, root: dict) -> None:
    """The embedding and the LM head as FSDP2 units of their own (as torchtitan shards them), so that neither is
    held unsharded through the blocks' backward, where the peak is, as the root's parameters are (it reshards at
    the very end of backward): the embedding is resharded after its forward and gathered again when its gradient
    arrives, last; the head keeps its weight from its forward (the loss) to its backward, which runs first, and
    its gradient is reduce-scattered right after. A head that shares the embedding's weight stays with the root."""
    from torch.distributed.fsdp import fully_shard

    embedding, head = impl.embedding(model), impl.output_head(model)
    if embedding is None or head is None or embedding.weight is head.weight:
        return
    fully_shard(embedding, reshard_after_forward=True, **root)
    fully_shard(head, reshard_after_forward=False, **root)
    # nn.Embedding returns a view (its lookup reshaped), which FSDP2 warns about on every run: an in-place op on it
    # would drop the hook that gathers the weight for backward. Neither model changes it in place (the blocks add
    # their residuals out of place); the two-rank tests train the same as one rank.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor")
