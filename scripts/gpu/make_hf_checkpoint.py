"""Write a Hugging Face Llama checkpoint (config.json + safetensors, BF16) with random weights, in the shape
that the given train flags describe, with transformers' own ``save_pretrained``: the input of the
``--init_from_hf`` check (TE vs HF losses from the same weights).

    python scripts/gpu/make_hf_checkpoint.py OUT -- --model llama3.2-1b --max_context_width 4096 [--seed N]

The model is built on the GPU when there is one (initializing 1B parameters on the CPU takes a while).
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import LlamaForCausalLM

from llama_fp8 import config as config_mod
from llama_fp8.models.common import hf_config


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, train = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder to write (created)")
    args = p.parse_args(own)
    cfg = config_mod.parse_args(train)
    torch.manual_seed(cfg.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(hf_config(cfg))
    model.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {n / 1e9:.3f} B parameters, {cfg.num_layers} layers, vocab {cfg.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
