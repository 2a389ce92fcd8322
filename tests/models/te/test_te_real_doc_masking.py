"""--doc_masking with the real Transformer Engine (``make test-te``; no GPU): our TE Llama builds THD layers with a
padding-causal mask, whose forward takes the ``cu_seqlens`` and ``max_seqlen`` arguments our model hands them. TE's
attention kernels need a GPU: the equality of packed and one-by-one documents is shown for the Hugging Face model
(tests/models/test_doc_masking.py) and would run for this one on a GPU node (not run here)."""

from __future__ import annotations

import inspect
from unittest import mock

import pytest
import torch
import transformer_engine.pytorch as te  # torch first: TE finds libnccl through torch

from helpers import tiny_llama_config as tiny_config
from llama_fp8 import models
from llama_fp8.models.te import model as te_llama

pytestmark = pytest.mark.te


def test_doc_masking_builds_thd_layers_whose_forward_takes_our_arguments():
    with mock.patch.object(torch.cuda, "is_available", return_value=True), torch.device("meta"):
        model = te_llama.build_te_llama(tiny_config(), doc_masking=True)
        plain = te_llama.build_te_llama(tiny_config())
    layer = model.model.layers[0].te_layer
    assert isinstance(layer, te.TransformerLayer)
    assert (layer.attn_input_format, layer.self_attn_mask_type) == ("thd", "padding_causal")
    assert layer.self_attention.qkv_format == "thd"
    assert (plain.model.layers[0].te_layer.attn_input_format, plain.model.layers[0].te_layer.self_attn_mask_type) == \
        ("bshd", "causal")
    accepted = inspect.signature(layer.forward).parameters
    ids = torch.zeros(2, 8, dtype=torch.long)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]])
    inputs = models.get("te").model_inputs(ids, positions)
    assert inputs["cu_seqlens"].tolist() == [0, 3, 8, 10, 16] and inputs["max_seqlen"] == 6
    # what our decoder layer (model.py) passes its TE layer: every name is one TE's forward has
    seen = {}

    class Recorder(torch.nn.Module):
        def forward(self, hidden, **kw):
            seen.update(kw)
            return hidden

    block = model.model.layers[0]
    block.te_layer = Recorder()
    block(torch.zeros(16, 64), torch.zeros(8, 1, 1, 16), inputs["cu_seqlens"], inputs["max_seqlen"])
    assert set(seen) == {"cu_seqlens_q", "cu_seqlens_kv", "max_seqlen_q", "max_seqlen_kv", "rotary_pos_emb"}
    assert set(seen) <= set(accepted), set(seen) - set(accepted)
    assert torch.equal(seen["cu_seqlens_q"], inputs["cu_seqlens"]) and seen["max_seqlen_kv"] == 6
