"""The interface every model implementation fulfils (torchtitan's TrainSpec idea, at its smallest).

A run asks its implementation for everything that differs between implementations: how to build the
model on the meta device, where its decoder blocks are, how to initialize and check weights, how to
read and write Hugging Face checkpoints, how to checkpoint activations, what FSDP2 must do around it,
which FP8 backends it supports, and what it refuses. Nothing outside ``models/`` compares
implementation names; adding an implementation is one more subclass registered in ``models``.

Contract of a built model: ``model(input_ids=LongTensor (B, T))`` returns an object whose ``logits`` is
(B, T, V); ``decoder_layers(model)`` is an ``nn.ModuleList`` whose entries may be replaced (by
activation-checkpoint wrappers); ``model.get_input_embeddings()`` returns the token embedding. Training asks
``loss(model, inputs, targets)``, which by default is the cross entropy of those logits; the built-in
implementations compute it inside the model's forward from the hidden states, without the whole logits.

Every ``cfg`` is a resolved ``llama_fp8.config.TrainConfig``, read by attribute and never imported (the
config's parser asks this package's registry for ``--model_impl``'s choices; see ``models/common.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llama_fp8.errors import ConfigError

if TYPE_CHECKING:
    from llama_fp8.precision import Fp8Backend


class ModelImpl:
    """Defaults fit a Hugging Face-shaped Llama (``model.model.layers``); subclasses override what differs."""

    name: str = ""
    description: str = ""
    """Shown in ``--model_impl`` help: ``name (description)``."""
    auto_when: str = "otherwise"
    """When ``--model_impl auto`` picks it (help text); implementations are tried in registry order."""
    cast_block_inputs: bool = True
    """Whether FSDP2's mixed-precision policy may cast the floating inputs of a decoder block to the
    parameter dtype (False when a block takes inputs that must stay FP32)."""
    activation_checkpointing_modes: tuple[str, ...] = ("full", "selective")
    """The ``--activation_checkpointing`` modes it has besides ``none`` (``wrap_activation_checkpointing``)."""
    tensor_parallel: bool = False
    """Has a tensor-parallel plan (``apply_tensor_parallel``)."""
    context_parallel: bool = False
    """Supports context parallelism (``apply_context_parallel``)."""
    document_masking: bool = False
    """Keeps packed documents apart given the batch's position ids (``--doc_masking``; ``model_inputs``)."""
    why_not: dict[str, str] = {}
    """Why it lacks what the flag (``--activation_checkpointing``, ``--tp_size``, ``--cp_size``) asks for, and
    the way out: said by ``check``'s refusal of that flag."""

    # --- choice ------------------------------------------------------------------------------------
    def unavailable(self, device: torch.device) -> str | None:
        """Why this implementation cannot run on ``device`` here (None: it can)."""
        return None

    def auto_eligible(self, device: torch.device) -> bool:
        """Whether ``--model_impl auto`` should pick it on ``device``."""
        return self.unavailable(device) is None

    def fp8_backends(self) -> tuple[Fp8Backend, ...]:
        """FP8 backends that work with this implementation, the default (``--fp8_backend auto``) first."""
        return ()

    def gemm_shapes(self, cfg) -> list[tuple[str, int, int]]:
        """(name inside a decoder block, in features, out features) of each linear a block multiplies by, as this
        implementation builds it: what a block format's dimension rules are checked on (``precision/dims.py``)."""
        head_dim = cfg.hidden_width // cfg.num_heads
        h, q, kv, ffn = cfg.hidden_width, cfg.num_heads * head_dim, cfg.num_key_value_heads * head_dim, cfg.intermediate_size
        return [("self_attn.q_proj", h, q), ("self_attn.k_proj", h, kv), ("self_attn.v_proj", h, kv),
                ("self_attn.o_proj", q, h), ("mlp.gate_proj", h, ffn), ("mlp.up_proj", h, ffn), ("mlp.down_proj", ffn, h)]

    def check(self, cfg, device: torch.device) -> None:
        """Refuse (ConfigError naming the flag) what this implementation cannot do, before anything is built. The
        one place that refuses a parallelism or an activation checkpointing an implementation lacks (its
        ``why_not`` says why); a subclass adds what only it refuses."""
        if cfg.tp_size > 1 and not self.tensor_parallel:
            raise ConfigError(f"--tp_size {cfg.tp_size}: --model_impl {self.name} has no tensor-parallel plan"
                              f"{self._why('--tp_size')}")
        if cfg.cp_size > 1 and not self.context_parallel:
            raise ConfigError(f"--cp_size {cfg.cp_size}: --model_impl {self.name} has no context parallelism"
                              f"{self._why('--cp_size')}")
        if getattr(cfg, "doc_masking", False) and not self.document_masking:
            raise ConfigError(f"--doc_masking: --model_impl {self.name} cannot keep packed documents apart (it reads "
                              f"no position ids); use --doc_masking 0{self._why('--doc_masking')}")
        if cfg.activation_checkpointing not in ("none", *self.activation_checkpointing_modes):
            modes = ", ".join(["none", *self.activation_checkpointing_modes])
            raise ConfigError(f"--activation_checkpointing {cfg.activation_checkpointing} does not work with "
                              f"--model_impl {self.name}{self._why('--activation_checkpointing')}; valid with it: "
                              f"{modes}")

    def _why(self, flag: str) -> str:
        return f": {self.why_not[flag]}" if flag in self.why_not else ""

    # --- tensor and context parallelism (the plans parallelize() applies) ---------------------------------
    def apply_tensor_parallel(self, model: nn.Module, tp_mesh, cfg, fp8_collectives: bool) -> None:
        """Split the blocks' linears over ``tp_mesh`` (before FSDP2). Only called when ``check`` allowed TP."""
        raise NotImplementedError

    def apply_context_parallel(self, model: nn.Module, cp_mesh, cfg, dims) -> str:
        """Prepare the model for context parallelism over ``cp_mesh``; returns how a step's batch is cut:
        "torch" (torch's context_parallel cuts it and runs ring attention) or "split" (cut here, the model's
        attention exchanges keys and values itself). Only called when ``check`` allowed CP."""
        raise NotImplementedError

    def cp_rotate(self, cfg) -> str:
        """torch context parallelism: how key/value shards travel (set_rotate_method's name)."""
        return "allgather"

    def model_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
        """The forward's keyword inputs for a (B, T) batch of token ids, on the host (the loop moves every tensor to the
        device). ``position_ids`` (B, T): given with --doc_masking, restarting at 0 at each document; an implementation
        that keeps documents apart builds its attention mask (or sequence lengths) from them."""
        return {"input_ids": input_ids}

    def loss(self, model: nn.Module, inputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        """The mean cross entropy of the model's next-token predictions against ``targets`` (B, T) (aligned with
        the inputs, -100 ignored), with autograd. By default from the whole logits (``parallel/loss.py``
        ``cross_entropy``); the built-in implementations override it: their LM head (``parallel/loss.py``
        ``OutputHead``, an FSDP2 unit of its own) computes it in its forward without them."""
        from llama_fp8.parallel.loss import cross_entropy

        return cross_entropy(model(**inputs).logits, targets)

    # --- build and initialize ----------------------------------------------------------------------
    def build(self, cfg) -> nn.Module:
        """The model on the current default device (the caller makes that ``meta``)."""
        raise NotImplementedError

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return model.model.layers

    def embedding(self, model: nn.Module) -> nn.Module | None:
        """The token embedding (``parallelize`` shards it as an FSDP2 unit of its own unless the head shares it)."""
        return model.get_input_embeddings()

    def output_head(self, model: nn.Module) -> nn.Module | None:
        """The LM head (a unit of its own likewise)."""
        get = getattr(model, "get_output_embeddings", None)
        return get() if get is not None else None

    def materialize(self, model: nn.Module, device: torch.device, cfg) -> None:
        """Allocate the (sharded) meta model's tensors on ``device`` (values are set by ``init_weights``)."""
        model.to_empty(device=device)

    def init_weights(self, model: nn.Module, cfg, device: torch.device) -> None:
        """After ``to_empty``: every parameter (sharded or not), the same values on any world size."""
        from llama_fp8.models import common

        common.init_weights(model, cfg, blocks_of=lambda name, rows: self.init_blocks(name, rows, cfg))
        self.reset_buffers(model, device)

    def init_blocks(self, name: str, rows: int, cfg) -> list[tuple[str, int, int]] | None:
        """How to draw a parameter's rows: by default under its own name. A fused parameter is drawn as the
        HF tensors it stacks, each under its HF name, so every implementation starts from the same values."""
        names = self.key_to_hf(name)
        if len(names) == 1:
            return None if names[0] == name else [(names[0], 0, rows)]
        sizes, start, out = self.block_sizes(name, rows, cfg), 0, []
        for hf_name, n in zip(names, sizes, strict=True):
            out.append((hf_name, start, n))
            start += n
        return out

    def reset_buffers(self, model: nn.Module, device: torch.device) -> None:
        """Recompute non-persistent buffers, which ``to_empty`` leaves as garbage (also after a load)."""

    def check_weights(self, model: nn.Module, cfg) -> None:
        from llama_fp8.models import common

        common.check_weights(model, cfg)

    # --- sharding ------------------------------------------------------------------------------------
    def wrap_activation_checkpointing(self, layer: nn.Module, mode: str) -> nn.Module:
        from llama_fp8.parallel import activation_checkpointing

        return activation_checkpointing.wrap(layer, mode)

    @contextlib.contextmanager
    def sharding(self, model: nn.Module) -> Iterator[None]:
        """Around ``fully_shard`` of the whole model: put back what the swap to DTensors drops."""
        yield

    # --- Hugging Face checkpoints ------------------------------------------------------------------------
    def hf_to_key(self, name: str) -> tuple[str, int | None]:
        """HF tensor name -> (this model's parameter name, row block of a fused parameter or None)."""
        return name, None

    def key_to_hf(self, key: str) -> list[str]:
        """This model's parameter name -> the HF names stacked in it (along dim 0)."""
        return [key]

    def block_sizes(self, key: str, rows: int, cfg=None) -> list[int]:
        """Rows of each HF tensor stacked in ``key`` (equal blocks unless an implementation says otherwise)."""
        n = len(self.key_to_hf(key))
        return [rows // n] * n

    def load_hf(self, model: nn.Module, hf_dir: str) -> None:
        """Stream an HF safetensors checkpoint into the (sharded, materialized) model."""
        from llama_fp8.models import hf_io

        hf_io.load_into_model(model, hf_dir, self)

    def to_hf_state(self, state: dict[str, Any], cfg) -> dict[str, torch.Tensor]:
        """This model's full state dict -> HF ``LlamaForCausalLM`` names (for ``llama-fp8 convert``; a tied
        head keeps its ``lm_head.weight`` entry, as the HF model's own state dict does)."""
        from llama_fp8.models import hf_io

        return hf_io.to_hf_names(state, self, tie_word_embeddings=False)
