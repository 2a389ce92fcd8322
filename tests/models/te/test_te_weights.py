"""The HF <-> TE weight names on CPU, without TE: the mapping, the streaming loader and its errors.

The HF checkpoints are real ones written by ``transformers.save_pretrained`` for a tiny GQA Llama.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import tiny_llama_config as tiny_config
from llama_fp8.models.te import weights as te_weights
from llama_fp8.models.te.weights import expected_te_shapes, load_hf_checkpoint_into_te, te_state_to_hf


def save_hf(tmp_path: Path, name: str, **kw) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(**{k: v for k, v in kw.items() if k != "max_shard_size"}))
    out = tmp_path / name
    model.save_pretrained(out, max_shard_size=kw.get("max_shard_size", "50GB"))
    return out, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    # Every tensor is larger than 1 KB, so each one lands in its own shard.
    return save_hf(tmp_path_factory.mktemp("hf"), "sharded", max_shard_size="1KB")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("hf"), "single")


def zeros_target(cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    return {k: torch.zeros(s) for k, s in expected_te_shapes(cfg).items()}


# --------------------------------------------------------------------------- mapping


def test_sharded_checkpoint_puts_gate_and_up_in_different_shards(sharded):
    hf_dir, _ = sharded
    weight_map = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2
    assert (
        weight_map["model.layers.0.mlp.gate_proj.weight"] != weight_map["model.layers.0.mlp.up_proj.weight"]
    )


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_hf_to_te_to_hf_is_exact(layout, request):
    hf_dir, hf_state = request.getfixturevalue(layout)
    target = zeros_target(tiny_config())
    loaded = load_hf_checkpoint_into_te(target, hf_dir)
    assert sorted(loaded) == sorted(hf_state)  # every tensor exactly once
    back = te_state_to_hf(target, tiny_config())
    assert set(back) == set(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(back[name], tensor), name


def test_fc1_is_gate_then_up_and_qkv_is_q_then_k_then_v(single):
    hf_dir, hf = single
    target = zeros_target(tiny_config())
    load_hf_checkpoint_into_te(target, hf_dir)
    p = "model.layers.1."
    fc1 = target[p + "te_layer.layernorm_mlp.fc1_weight"]
    assert torch.equal(fc1, torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]))
    qkv = target[p + "te_layer.self_attention.layernorm_qkv.weight"]  # GQA: q 64 rows, k and v 32 each
    assert qkv.shape == (128, 64)
    assert torch.equal(qkv, torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
    assert torch.equal(
        target[p + "te_layer.layernorm_mlp.layer_norm_weight"],
        hf[p + "post_attention_layernorm.weight"],
    )


def test_write_callback_gets_one_call_per_hf_tensor_with_row_slices(sharded):
    hf_dir, hf = sharded
    shapes = {k: torch.empty(s, device="meta") for k, s in expected_te_shapes(tiny_config()).items()}
    calls = []
    load_hf_checkpoint_into_te(shapes, hf_dir, write=lambda key, rows, t: calls.append((key, rows, t.shape)))
    assert len(calls) == len(hf)
    fc1 = [
        (rows, shape)
        for key, rows, shape in calls
        if key == "model.layers.0.te_layer.layernorm_mlp.fc1_weight"
    ]
    assert sorted((r.start, r.stop) for r, _ in fc1) == [(0, 80), (80, 160)]
    qkv = [rows for key, rows, _ in calls if key == "model.layers.0.te_layer.self_attention.layernorm_qkv.weight"]
    assert sorted((r.start, r.stop) for r in qkv) == [(0, 64), (64, 96), (96, 128)]  # unequal blocks, by shape
    assert all(rows is None for key, rows, _ in calls if not key.endswith(("fc1_weight", "qkv.weight")))


def test_tied_embeddings_single_file(tmp_path):
    hf_dir, hf = save_hf(tmp_path, "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(hf_dir / "model.safetensors")
    target = zeros_target(tiny_config(tie_word_embeddings=True))
    target["lm_head.weight"] = target["model.embed_tokens.weight"]  # tied, as in the model
    load_hf_checkpoint_into_te(target, hf_dir)
    back = te_state_to_hf(target, tiny_config(tie_word_embeddings=True), tie_word_embeddings=True)
    assert "lm_head.weight" not in back
    assert torch.equal(back["model.embed_tokens.weight"], hf["model.embed_tokens.weight"])


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor_is_named(single, tmp_path):
    hf_dir = _rewrite(single[0], tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_hf_checkpoint_into_te(zeros_target(tiny_config()), hf_dir)


def test_unexpected_tensor_is_named_and_nothing_is_written(single, tmp_path):
    hf_dir = _rewrite(
        single[0],
        tmp_path / "u",
        lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.ones(2)}),
    )
    target = zeros_target(tiny_config())
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra\.weight'"):
        load_hf_checkpoint_into_te(target, hf_dir)
    assert all(not t.any() for t in target.values())  # names are checked before any data is read


def test_checkpoint_with_more_layers_than_model(single):
    target = zeros_target(tiny_config(num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        load_hf_checkpoint_into_te(target, single[0])


def test_shape_mismatch_is_reported(single):
    target = zeros_target(tiny_config())
    target["model.layers.0.te_layer.layernorm_mlp.fc1_weight"] = torch.zeros(2 * 81, 64)
    target["model.layers.1.te_layer.self_attention.layernorm_qkv.weight"] = torch.zeros(128, 65)
    target["model.layers.1.te_layer.self_attention.proj.weight"] = torch.zeros(64, 63)
    with pytest.raises(ValueError) as e:
        load_hf_checkpoint_into_te(target, single[0])
    msg = str(e.value)
    assert re.search(r"gate_proj\.weight \(80 rows\) \+ model\.layers\.0\.mlp\.up_proj\.weight \(80 rows\) = 160 "
                     r"rows, but model\.layers\.0\.te_layer\.layernorm_mlp\.fc1_weight has 162", msg), msg
    assert re.search(r"layers\.1\.self_attn\.k_proj\.weight has shape \(32, 64\), the model expects \(rows, 65\)",
                     msg), msg
    assert "model.layers.1.self_attn.o_proj.weight has shape (64, 64), the model expects (64, 63)" in msg


def test_no_checkpoint_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint_into_te({}, tmp_path)


def test_key_functions_reject_unknown_names():
    assert te_weights.hf_to_te_key("model.layers.3.mlp.up_proj.weight") == (
        "model.layers.3.te_layer.layernorm_mlp.fc1_weight",
        1,
    )
    with pytest.raises(ValueError, match="rotary"):
        te_weights.hf_to_te_key("model.rotary.weight")
    with pytest.raises(ValueError, match="unexpected TE key"):
        te_state_to_hf({"model.layers.0.te_layer.foo": torch.zeros(1)}, tiny_config())
