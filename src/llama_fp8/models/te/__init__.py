"""The Transformer Engine implementation: a Llama of ``te.TransformerLayer`` blocks (``model.py``), its
HF weight names (``weights.py``), its context parallelism (``parallel.py``), and TE's FP8 machinery in
``fp8/`` (recipes and checks, the precision backend, FP8 weights and state). Transformer Engine is imported
only when a model is built."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from llama_fp8.errors import ConfigError
from llama_fp8.models.spec import ModelImpl


class TEImpl(ModelImpl):
    name = "te"
    description = "Transformer Engine TransformerLayer blocks"
    auto_when = "when Transformer Engine imports on a CUDA machine"
    activation_checkpointing_modes = ("full",)
    why_not = {"--activation_checkpointing": "the TE model checkpoints whole blocks with TE's checkpoint",
               "--tp_size": "Transformer Engine's tensor parallelism keeps plain per-rank weight shards that FSDP2's "
                            "checkpoints would mix up (its DTensor support, NVIDIA/TransformerEngine#2713, is not "
                            "released); use --model_impl hf with --fp8_backend torchao for tensor parallelism, or "
                            "--tp_size 1"}
    context_parallel = True  # TE's own (set_context_parallel_group): models/te/parallel.py
    document_masking = True  # THD layers with the documents' cu_seqlens (model.py doc_seqlens)
    # Each block receives the RoPE angles (positions x inverse frequencies, up to ~T radians) as an FP32
    # input; FSDP2's mixed-precision policy would cast them to BF16 with the hidden states, which keeps 8
    # significant bits: at positions 2048-4096 the angles would be rounded to multiples of 16 rad. So the
    # blocks' inputs are not cast (as torchtitan does for the same reason, pytorch/torchtitan#2881). The
    # hidden states are BF16 anyway: the embedding's weight is all-gathered in BF16 by the root's policy.
    # Computing the angles inside each block would also work, at the cost of one table per block.
    cast_block_inputs = False

    def unavailable(self, device: torch.device) -> str | None:
        from llama_fp8.models.te.fp8.recipes import te_import

        try:  # "TE imports": its metadata alone can exist without a working extension
            te_import()
        except ImportError as e:
            return str(e)
        return None

    def auto_eligible(self, device: torch.device) -> bool:
        return device.type == "cuda" and self.unavailable(device) is None

    def fp8_backends(self):
        from llama_fp8.models.te.fp8.precision import TE

        return (TE,)

    def gemm_shapes(self, cfg) -> list[tuple[str, int, int]]:
        """TE's fused GEMMs: one QKV (``fuse_qkv_params``) and one fc1 of gate and up (model.py)."""
        head_dim = cfg.hidden_width // cfg.num_heads
        h, q, kv, ffn = cfg.hidden_width, cfg.num_heads * head_dim, cfg.num_key_value_heads * head_dim, cfg.intermediate_size
        return [("te_layer.self_attention.layernorm_qkv", h, q + 2 * kv), ("te_layer.self_attention.proj", q, h),
                ("te_layer.layernorm_mlp.fc1", h, 2 * ffn), ("te_layer.layernorm_mlp.fc2", ffn, h)]

    def check(self, cfg, device: torch.device) -> None:
        super().check(cfg, device)
        if cfg.cp_size > 1:
            check_context_parallel(cfg)
            if getattr(cfg, "doc_masking", False):
                raise ConfigError(f"--doc_masking with --cp_size {cfg.cp_size} and --model_impl {self.name}: TE's THD "
                                  "context parallelism needs every document padded to a multiple of 2 x cp_size "
                                  "tokens (cu_seqlens_padded) and cut per document, which fixed-length packed rows "
                                  "do not have here; use --cp_size 1 with --doc_masking, or --doc_masking 0")
        if device.type != "cuda":
            raise ConfigError(f"--model_impl {self.name} runs Transformer Engine's CUDA kernels and needs a CUDA GPU; "
                              "on CPU use --model_impl hf (or auto)")
        reason = self.unavailable(device)
        if reason:
            raise ConfigError(f"--model_impl {self.name}: {reason}")

    def build(self, cfg) -> nn.Module:
        from llama_fp8.models.common import hf_config
        from llama_fp8.models.te.model import build_te_llama

        try:
            return build_te_llama(hf_config(cfg), doc_masking=bool(getattr(cfg, "doc_masking", False)))
        except ImportError as e:
            raise ConfigError(f"--model_impl {self.name}: {e}") from None

    def model_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
        """With --doc_masking, the documents as THD sequence lengths (``doc_seqlens``, from the host's positions)."""
        if position_ids is None:
            return {"input_ids": input_ids}
        from llama_fp8.models.te.model import doc_seqlens

        cu_seqlens, max_seqlen = doc_seqlens(position_ids)
        return {"input_ids": input_ids, "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}

    def loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        return model(**inputs, targets=targets).loss

    def materialize(self, model: nn.Module, device: torch.device, cfg) -> None:
        """FP8-weight modules (``--fp8_all_gather 1``) through TE's reset_parameters, the rest by to_empty."""
        from llama_fp8.models.te.fp8 import params as fp8_params

        fp8_params.materialize(model, device, cfg, blocks_of=lambda name, rows: self.init_blocks(name, rows, cfg))

    def init_weights(self, model: nn.Module, cfg, device: torch.device) -> None:
        from llama_fp8.models import common
        from llama_fp8.models.te.fp8 import params as fp8_params

        # FP8 weights are set by materialize; every other weight is drawn under its HF name(s), so the TE model
        # starts from exactly the HF model's values (the HF-BF16 vs TE-FP8 comparison starts from one init).
        common.init_weights(model, cfg, skip=fp8_params.owned(model),
                            blocks_of=lambda name, rows: self.init_blocks(name, rows, cfg))

    def check_weights(self, model: nn.Module, cfg) -> None:
        from llama_fp8.models import common
        from llama_fp8.models.te.fp8 import params as fp8_params

        common.check_weights(model, cfg, skip=fp8_params.owned(model))  # quantized by TE from our values

    def wrap_activation_checkpointing(self, layer: nn.Module, mode: str) -> nn.Module:
        """TE's own checkpoint, which recomputes under the same FP8 autocast state."""
        from llama_fp8.models.te.model import te_checkpoint_wrap

        return layer if mode == "none" else te_checkpoint_wrap(layer)

    @contextlib.contextmanager
    def sharding(self, model: nn.Module) -> Iterator[None]:
        """fully_shard swaps parameters for DTensors and drops the attributes TE put on them; put them back."""
        from llama_fp8.models.te.model import restore_param_attrs, save_param_attrs

        attrs = save_param_attrs(model)
        yield
        restore_param_attrs(model, attrs)

    def hf_to_key(self, name: str) -> tuple[str, int | None]:
        from llama_fp8.models.te.weights import hf_to_te_key

        return hf_to_te_key(name)

    def key_to_hf(self, key: str) -> list[str]:
        from llama_fp8.models.te.weights import te_to_hf_keys

        return te_to_hf_keys(key)

    def block_sizes(self, key: str, rows: int, cfg=None) -> list[int]:
        """fc1: two halves; the fused QKV: q, k, v rows from the head counts (needs ``cfg``)."""
        from llama_fp8.models.common import hf_config
        from llama_fp8.models.te.weights import TEMapping

        return TEMapping(hf_config(cfg) if cfg is not None else None).block_sizes(key, rows)

    def apply_context_parallel(self, model: nn.Module, cp_mesh, cfg, dims) -> str:
        from llama_fp8.models.te.parallel import set_context_parallel

        set_context_parallel(model, cp_mesh, cfg.cp_comm_type, dims.groups("cp"))
        return "split"

    def to_hf_state(self, state, cfg):
        """TE names -> HF (fused QKV and fc1 split); the FP8 scaling buffers have no HF counterpart."""
        from llama_fp8.models.common import hf_config
        from llama_fp8.models.te import weights
        from llama_fp8.models.te.fp8 import state as fp8_state

        kept = {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] not in fp8_state.BUFFERS}
        return weights.te_state_to_hf(kept, hf_config(cfg))


def check_context_parallel(cfg) -> None:
    if cfg.cp_comm_type == "a2a" and (cfg.num_heads % cfg.cp_size or cfg.num_key_value_heads % cfg.cp_size):
        raise ConfigError(f"--cp_comm_type a2a spreads attention heads over the --cp_size {cfg.cp_size} ranks: "
                          f"--num_heads {cfg.num_heads} and --num_key_value_heads {cfg.num_key_value_heads} must be "
                          f"divisible by it; use --cp_comm_type p2p")
    if cfg.cp_comm_type == "a2a+p2p" and (cfg.cp_size % 2 or cfg.num_key_value_heads % 2):
        raise ConfigError(f"--cp_comm_type a2a+p2p runs a2a within pairs of context ranks: --cp_size {cfg.cp_size} "
                          f"and --num_key_value_heads {cfg.num_key_value_heads} must be even; use --cp_comm_type p2p")


IMPL = TEImpl()
