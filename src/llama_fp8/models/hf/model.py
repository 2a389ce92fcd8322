"""``transformers.LlamaForCausalLM`` with one addition: given ``targets``, its forward returns the training loss,
which its LM head (``parallel/loss.py`` ``OutputHead``) computes from the final hidden states a chunk of tokens at
a time, never the whole logits. Without ``targets`` it is Hugging Face's forward, unchanged; the modules, parameter
names and checkpoints are Hugging Face's. With ``doc_masking`` (``--doc_masking``) its attention is limited to each
token's document, found from the position ids (``masks.py``)."""

from __future__ import annotations

import torch
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

from llama_fp8.models.hf.masks import document_mask
from llama_fp8.parallel.loss import OutputHead


class LlamaForTraining(LlamaForCausalLM):
    def __init__(self, config, doc_masking: bool = False):
        super().__init__(config)
        head = OutputHead(config.hidden_size, config.vocab_size, bias=False)
        head.weight = self.lm_head.weight  # the same Parameter: the embedding's, when they are tied
        self.lm_head = head
        self.doc_masking = doc_masking

    def forward(self, input_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, **kwargs) -> CausalLMOutputWithPast:
        """``targets`` (B, T): the token each position predicts (aligned with ``input_ids``, -100 ignored); the
        output's ``loss`` is their mean cross entropy and it has no ``logits``."""
        if self.doc_masking and position_ids is not None and kwargs.get("attention_mask") is None:
            kwargs["attention_mask"] = document_mask(position_ids, self.config._attn_implementation)
        if targets is None:
            return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
        hidden = self.model(input_ids=input_ids, position_ids=position_ids, **kwargs).last_hidden_state  # (B, T, H)
        return CausalLMOutputWithPast(loss=self.lm_head(hidden, targets=targets))
