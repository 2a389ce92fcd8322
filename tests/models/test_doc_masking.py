"""--doc_masking: a packed batch with the document mask gives the same per-document losses and gradients as the
documents run one by one (the Hugging Face model on CPU, SDPA; FlexAttention's BlockMask forward only: torch has no
FlexAttention backward on CPU), and the TE model hands its layers the documents as THD ``cu_seqlens`` (a stand-in
layer records them: TE's attention kernels need a GPU). What cannot keep documents apart is refused."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import FakeTransformerLayer
from llama_fp8 import config as C
from llama_fp8 import models
from llama_fp8.data.doc_mask import doc_fields
from llama_fp8.errors import ConfigError

T = 32
# rows of whole documents (lengths add up to T + 1 = 33 tokens per row), as a packed batch holds them
ROWS = [[9, 14, 10], [33], [4, 4, 20, 5]]


def build_hf(doc_masking: bool) -> tuple[torch.nn.Module, object]:
    cfg = C.parse_args(["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", str(T),
                        "--vocab_size", "128", "--doc_masking", str(int(doc_masking))])
    torch.manual_seed(0)
    impl = models.get("hf")
    model = impl.build(cfg).double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.fill_(1.0)
    return model, impl


def documents() -> tuple[list[list[torch.Tensor]], np.ndarray, np.ndarray]:
    """Each row's documents (token tensors), the (B, T+1) blocks and their document starts."""
    gen = torch.Generator().manual_seed(1)
    docs = [[torch.randint(0, 128, (n,), generator=gen) for n in row] for row in ROWS]
    blocks = np.stack([torch.cat(row).numpy() for row in docs])
    starts = np.zeros(blocks.shape, bool)
    for r, row in enumerate(ROWS):
        starts[r, np.cumsum([0, *row[:-1]])] = True
    return docs, blocks, starts


def per_token(model, impl, batch: dict) -> torch.Tensor:
    inputs = impl.model_inputs(batch["input_ids"], batch.get("position_ids"))
    logits = model(**inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none",
                           ignore_index=-100).view_as(batch["labels"])


def solo(model, impl, doc: torch.Tensor) -> torch.Tensor:
    """A document alone: its tokens predict its next tokens."""
    ids = doc[None]
    return per_token(model, impl, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})[0]


def packed_matches(model, impl, batch, docs) -> tuple[float, list[tuple[torch.Tensor, torch.Tensor]]]:
    losses = per_token(model, impl, batch)
    pairs = []
    for r, row in enumerate(docs):
        at = 0
        for doc in row:
            pairs.append((losses[r, at:at + len(doc) - 1], solo(model, impl, doc)))
            at += len(doc)
    return max(float((a - b).abs().max()) for a, b in pairs), pairs


def test_packed_documents_with_the_mask_give_each_documents_own_losses_and_gradients():
    model, impl = build_hf(doc_masking=True)
    docs, blocks, starts = documents()
    batch = doc_fields(blocks, starts)
    assert int((batch["labels"] == -100).sum()) == sum(len(r) - 1 for r in ROWS)  # no label crosses a document
    gap, _ = packed_matches(model, impl, batch, docs)
    assert gap < 1e-10, gap
    # gradients: the packed batch's summed loss against the sum of every document's own
    model.zero_grad()
    per_token(model, impl, batch).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for row in docs:
        for doc in row:
            solo(model, impl, doc).sum().backward()
    worst = max(float((packed[n] - p.grad).abs().max() / p.grad.abs().max()) for n, p in model.named_parameters())
    assert worst < 1e-10, worst
    # the training loss (the LM head's chunked path) is the mean over the same tokens
    inputs = impl.model_inputs(batch["input_ids"], batch["position_ids"])
    want = per_token(model, impl, batch)[batch["labels"] != -100].mean()
    assert float(impl.loss(model, inputs, batch["labels"])) == pytest.approx(float(want), rel=1e-6)  # FP32 head


def test_without_the_mask_packed_documents_see_each_other():
    model, impl = build_hf(doc_masking=False)
    docs, blocks, starts = documents()
    batch = doc_fields(blocks, starts)
    del batch["position_ids"]  # what a run without --doc_masking feeds: positions 0..T-1, no mask
    gap, _ = packed_matches(model, impl, batch, docs)
    assert gap > 1e-3, gap  # the test above can fail: here later documents attend to earlier ones


@pytest.mark.slow  # FlexAttention's eager kernel: ~10 s here
def test_flex_attention_block_mask_gives_the_same_losses(monkeypatch):
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as hf_flex

    from llama_fp8.models.hf import masks

    # transformers compiles flex_attention (minutes on a CPU); the eager kernel computes the same thing
    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kw: flex_attention(q, k, v, **kw))
    model, impl = build_hf(doc_masking=True)
    model.set_attn_implementation(masks.FLEX)
    docs, blocks, starts = documents()
    batch = doc_fields(blocks, starts)
    with torch.no_grad():  # torch has no FlexAttention backward on CPU
        gap, _ = packed_matches(model, impl, batch, docs)
    assert gap < 1e-10, gap
    from torch.nn.attention.flex_attention import create_mask

    block = masks.flex_mask(batch["position_ids"])  # the BlockMask's mask is the dense one SDPA takes
    assert torch.equal(create_mask(block.mask_mod, 3, 1, T, T, device="cpu"), masks.sdpa_mask(batch["position_ids"]))


def test_te_model_hands_its_layers_the_documents_as_thd_cu_seqlens(monkeypatch):
    from llama_fp8.models.common import hf_config
    from llama_fp8.models.te import model as te_llama

    monkeypatch.setattr(te_llama, "te_import", lambda: types.SimpleNamespace(TransformerLayer=FakeTransformerLayer))
    cfg = C.parse_args(["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", str(T),
                        "--vocab_size", "128", "--doc_masking", "1"])
    model = te_llama.build_te_llama(hf_config(cfg), doc_masking=True)
    layer = model.model.layers[0].te_layer
    assert (layer.kw["attn_input_format"], layer.kw["self_attn_mask_type"]) == ("thd", "padding_causal")
    plain = te_llama.build_te_llama(hf_config(cfg)).model.layers[0].te_layer
    assert (plain.kw["attn_input_format"], plain.kw["self_attn_mask_type"]) == ("bshd", "causal")
    for p in model.parameters():
        torch.nn.init.normal_(p, 0, 0.02)
    _, blocks, starts = documents()
    batch = doc_fields(blocks, starts)
    inputs = models.get("te").model_inputs(batch["input_ids"], batch["position_ids"])
    # documents start at 0, 9, 23 (row 0), 32 (row 1), 64, 68, 72, 92 (row 2); the last of a row ends with it
    assert inputs["cu_seqlens"].tolist() == [0, 9, 23, 32, 64, 68, 72, 92, 96]
    assert inputs["cu_seqlens"].dtype == torch.int32 and inputs["max_seqlen"] == 32
    out = model(**inputs, targets=batch["labels"])
    seen = layer.seen_kwargs[-1]
    assert seen["hidden_shape"] == (3 * T, cfg.hidden_width)  # THD: the rows' tokens as one sequence
    assert torch.equal(seen["cu_seqlens_q"], inputs["cu_seqlens"]) and seen["max_seqlen_kv"] == 32
    assert out.loss.isfinite() and models.get("te").model_inputs(batch["input_ids"]) == {"input_ids": batch["input_ids"]}


def test_what_cannot_keep_documents_apart_is_refused():
    cp = ["--model", "tiny", "--doc_masking", "1", "--cp_size", "2"]
    with pytest.raises(ConfigError, match="torch's context parallelism runs SDPA causally without a mask"):
        models.get("hf").check(C.parse_args([*cp, "--model_impl", "hf"]), torch.device("cuda"))
    with pytest.raises(ConfigError, match="TE's THD context parallelism needs every document padded"):
        models.get("te").check(C.parse_args([*cp, "--model_impl", "te"]), torch.device("cuda"))
    impl = models.ModelImpl()
    impl.name = "plain"
    with pytest.raises(ConfigError, match="--doc_masking: --model_impl plain cannot keep packed documents apart"):
        impl.check(C.parse_args(["--model", "tiny", "--doc_masking", "1"]), torch.device("cpu"))
