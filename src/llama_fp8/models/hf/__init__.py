"""The Hugging Face implementation: ``transformers.LlamaForCausalLM`` as it is. Its weights need no
mapping (HF names are its names); RoPE tables are non-persistent buffers recomputed after ``to_empty``."""

from __future__ import annotations

import torch
from torch import nn

from llama_fp8.models.spec import ModelImpl


class HFImpl(ModelImpl):
    name = "hf"
    description = "Hugging Face LlamaForCausalLM"
    auto_when = "otherwise"

    def fp8_backends(self):
        from llama_fp8.precision.torchao import TORCHAO

        return (TORCHAO,)

    def build(self, cfg) -> nn.Module:
        from transformers import LlamaForCausalLM

        from llama_fp8.models.common import hf_config

        return LlamaForCausalLM(hf_config(cfg))

    @torch.no_grad()
    def reset_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Recompute RoPE inverse frequencies (HF's LlamaRotaryEmbedding keeps them in non-persistent buffers)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        for module in model.modules():
            if hasattr(module, "rope_type") and hasattr(module, "inv_freq"):
                fn = (module.compute_default_rope_parameters if module.rope_type == "default"
                      else ROPE_INIT_FUNCTIONS[module.rope_type])
                inv_freq, scaling = fn(module.config, device=device)
                module.inv_freq = inv_freq.to(device)
                module.original_inv_freq = inv_freq.clone().to(device)
                module.attention_scaling = scaling


IMPL = HFImpl()
