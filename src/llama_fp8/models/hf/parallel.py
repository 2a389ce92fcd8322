"""Tensor and context parallelism for ``transformers.LlamaForCausalLM``: the plans ``parallelize()`` applies.

Tensor parallelism (Megatron-style, with sequence parallelism; the plan torchtitan applies to its Llama,
written for HF's module names): in each block q/k/v and gate/up are split by output features
(``ColwiseParallel``), o and down by input features (``RowwiseParallel``), their outputs reduce-scattered
along the sequence, so norms and residuals run on 1/tp of the tokens (``SequenceParallel``). The embedding
is split by vocabulary rows, the LM head by vocabulary columns, and its logits stay sharded for the loss
(``loss_parallel``); the training loss, computed by the head from its gathered input, combines the vocabulary
slices itself (parallel/loss.py). HF's attention reshapes with ``view(..., -1, head_dim)``, so it runs unchanged on
heads/tp local heads. The decoder layer calls its attention by keyword (``self_attn(hidden_states=...)``),
hence the keyword input layouts.

With torchao FP8 (tensorwise), the block's linears use torchao's FP8 styles, which all-gather and
reduce-scatter in FP8 (half the bytes). Those need NCCL: gloo has no float8 type, so where FP8 is
emulated (CPU) the plain styles run the same FP8 numerics with BF16 collectives.

Context parallelism: torch's ``context_parallel`` replaces SDPA with ring attention over the CP group; it
needs SDPA called with ``is_causal=True`` and no mask, and the flash/efficient/cuDNN kernels (CUDA). HF
builds a mask from position ids that are not 0..T-1 (the load-balanced chunks), so the model uses an
attention function of ours that always calls SDPA causally without one.
"""

from __future__ import annotations

import torch
from torch import nn

CP_ATTENTION = "llama_fp8_cp_sdpa"


def tensor_parallel_plan(model: nn.Module, fp8_collectives: bool) -> dict:
    """FQN -> ParallelStyle for ``parallelize_module`` on the TP mesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    colwise, rowwise, prepare = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if fp8_collectives:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        colwise, rowwise, prepare = Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": head_parallel(),
    }
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update({
            p + "input_layernorm": SequenceParallel(),
            p + "self_attn": prepare(input_kwarg_layouts={"hidden_states": Shard(1)},
                                     desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            p + "self_attn.q_proj": colwise(),
            p + "self_attn.k_proj": colwise(),
            p + "self_attn.v_proj": colwise(),
            p + "self_attn.o_proj": rowwise(output_layouts=Shard(1)),
            p + "post_attention_layernorm": SequenceParallel(),
            p + "mlp": prepare(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            p + "mlp.gate_proj": colwise(),
            p + "mlp.up_proj": colwise(),
            p + "mlp.down_proj": rowwise(output_layouts=Shard(1)),
        })
    return plan


def head_parallel():
    """The LM head split by vocabulary columns, its input gathered from the sequence shards and its logits left
    sharded (``loss_parallel``), as torchtitan's plan; given targets it returns the loss (parallel/loss.py, which
    combines the vocabulary slices itself), a plain tensor that passes through as it is."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    class HeadParallel(ColwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            if not isinstance(outputs, DTensor):  # the loss
                return outputs
            return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)

    return HeadParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)


def causal_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                **kwargs):
    """HF attention function for context parallelism: SDPA, causal, no mask (q, k, v: (B, heads, T, d))."""
    from transformers.integrations.sdpa_attention import repeat_kv

    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # explicit GQA: the CP ring ops take equal head counts
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling,
                                                           is_causal=True)
    return out.transpose(1, 2).contiguous(), None  # (B, T, heads, d), as HF's attention functions return


def use_causal_sdpa(model: nn.Module) -> None:
    """Register ``causal_sdpa`` with transformers and make ``model`` use it."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, causal_sdpa)
    model.set_attn_implementation(CP_ATTENTION)
