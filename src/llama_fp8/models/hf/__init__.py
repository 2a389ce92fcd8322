"""The Hugging Face implementation: ``transformers.LlamaForCausalLM``, with a forward that can return the training
loss without the whole logits (``model.py``). Its weights need no mapping (HF names are its names); RoPE tables
are non-persistent buffers recomputed after ``to_empty``."""

from __future__ import annotations

import torch
from torch import nn

from llama_fp8.errors import ConfigError
from llama_fp8.models.spec import ModelImpl

# --cp_comm_type -> torch's context-parallel rotate method: "p2p" passes key/value shards around the CP ring
# (all-to-all between neighbours), "all_gather" gathers them all first.
TORCH_CP_ROTATE = {"p2p": "alltoall", "all_gather": "allgather"}


class HFImpl(ModelImpl):
    name = "hf"
    description = "Hugging Face LlamaForCausalLM"
    auto_when = "otherwise"
    tensor_parallel = context_parallel = True
    document_masking = True  # a block mask from the position ids (masks.py)

    def fp8_backends(self):
        from llama_fp8.precision.torchao import TORCHAO

        return (TORCHAO,)

    def check(self, cfg, device: torch.device) -> None:
        if cfg.tp_size > 1 and cfg.tie_word_embeddings:
            raise ConfigError(f"--tp_size {cfg.tp_size} with tied embeddings (--tie_word_embeddings 1, e.g. the "
                              "Llama 3.2 presets): the tensor-parallel plan splits the embedding by rows and the "
                              "LM head by columns, which one shared weight cannot be; use --tp_size 1 (FSDP) for it")
        if cfg.cp_size > 1:
            if getattr(cfg, "doc_masking", False):
                raise ConfigError(f"--doc_masking with --cp_size {cfg.cp_size}: torch's context parallelism runs SDPA "
                                  "causally without a mask on each rank's chunks, so packed documents would attend to "
                                  "each other; use --cp_size 1, or the TE model (--model_impl te: THD with cu_seqlens)")
            if device.type != "cuda":
                raise ConfigError(f"--cp_size {cfg.cp_size} with the Hugging Face model needs CUDA: torch's context "
                                  "parallelism runs the flash/efficient/cuDNN attention kernels only (none on CPU)")
            if cfg.cp_comm_type not in TORCH_CP_ROTATE:
                raise ConfigError(f"--cp_comm_type {cfg.cp_comm_type} is for the TE model; with --model_impl hf "
                                  f"use {' or '.join(TORCH_CP_ROTATE)}")
        super().check(cfg, device)

    def apply_tensor_parallel(self, model: nn.Module, tp_mesh, cfg, fp8_collectives: bool) -> bool:
        from torch.distributed.tensor.parallel import parallelize_module

        from llama_fp8.models.hf.parallel import tensor_parallel_plan

        parallelize_module(model, tp_mesh, tensor_parallel_plan(model, fp8_collectives))
        return True  # the LM head's logits stay sharded over the vocabulary: loss_parallel

    def apply_context_parallel(self, model: nn.Module, cp_mesh, cfg, dims) -> str:
        from llama_fp8.models.hf.parallel import use_causal_sdpa

        use_causal_sdpa(model)
        return "torch"

    def cp_rotate(self, cfg) -> str:
        return TORCH_CP_ROTATE[cfg.cp_comm_type]

    def model_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
        """Explicit positions (0..T-1 unless the batch's restart at each document, --doc_masking): with sequence
        parallelism HF would count positions from the sharded hidden states, and under context parallelism they are
        cut with the tokens. The document mask is built from them in the forward (``model.py``)."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        return {"input_ids": input_ids, "position_ids": position_ids.contiguous()}

    def build(self, cfg) -> nn.Module:
        from llama_fp8.models.common import hf_config
        from llama_fp8.models.hf.masks import FLEX
        from llama_fp8.models.hf.model import LlamaForTraining

        model = LlamaForTraining(hf_config(cfg), doc_masking=bool(getattr(cfg, "doc_masking", False)))
        if model.doc_masking and cfg.device != "cpu" and torch.cuda.is_available():
            model.set_attn_implementation(FLEX)  # a BlockMask skips the blocks outside every document
        return model

    def loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        return model(**inputs, targets=targets).loss

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
