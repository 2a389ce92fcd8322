"""``llama-fp8 convert`` writes a Hugging Face folder that others on a shared file system can load: its files get the
permissions any file the user creates gets (0666 less the umask), not the owner-only 0600 that safetensors (0.6 and
later) gives the file it writes through a temporary file."""

from __future__ import annotations

import os
import stat

import torch

from llama_fp8 import convert


def test_the_exported_files_are_readable_as_the_users_umask_allows(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=16)
    old = os.umask(0o022)
    try:
        convert.save_hf(LlamaForCausalLM(cfg), tmp_path / "hf", torch.bfloat16)
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()}
    assert "model.safetensors" in modes and "config.json" in modes
    assert set(modes.values()) == {0o644}, modes
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert loaded.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
