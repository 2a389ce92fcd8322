"""Hugging Face interop: ``llama-fp8 convert CKPT OUT`` (DCP checkpoint -> HF folder) and
``--init_from_hf DIR`` (HF safetensors -> our sharded model, each rank reading only its rows)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from torch import nn

from llama_fp8 import checkpoint
from llama_fp8 import config as config_mod
from llama_fp8 import model as model_mod
from llama_fp8.config import EXIT_BAD_CONFIG, ConfigError, TrainConfig

log = logging.getLogger(__name__)


# --- import: HF -> sharded model -------------------------------------------------------------------
def _hf_files(hf_dir: Path) -> dict[str, list[str]]:
    """{safetensors file: [tensor names]} of a single-file or sharded (index.json) HF checkpoint."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        by_file: dict[str, list[str]] = {}
        for name, file in json.loads(index.read_text())["weight_map"].items():
            by_file.setdefault(file, []).append(name)
        return by_file
    single = hf_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            return {"model.safetensors": list(f.keys())}
    raise ConfigError(f"--init_from_hf {hf_dir}: no model.safetensors or model.safetensors.index.json there")


def _write_rows(param: torch.Tensor, rows_of_full) -> None:
    """Copy this rank's rows of a full tensor into a (possibly sharded) parameter.
    ``rows_of_full(lo, hi)`` returns rows [lo, hi) of the full tensor."""
    local, row0 = model_mod._local_rows(param)
    if local.numel():
        local.copy_(rows_of_full(row0, row0 + local.shape[0]))


@torch.no_grad()
def load_hf_into_model(model: nn.Module, hf_dir: str, impl: str) -> None:
    """Stream an HF checkpoint into ``model`` (after to_empty), one file at a time; every parameter must be
    written exactly once and every tensor in the files must have a home, else an error names them."""
    from safetensors import safe_open

    root = Path(hf_dir)
    params = {model_mod.canonical_name(n): p for n, p in model.named_parameters()}  # tied weights appear once
    if impl == "te":
        from llama_fp8 import te_weights

        def write(te_key: str, rows: slice | None, tensor: torch.Tensor) -> None:
            part = tensor.to(params[te_key].dtype)
            if rows is None:
                _write_rows(params[te_key], lambda lo, hi: part[lo:hi])
                return
            local, row0 = model_mod._local_rows(params[te_key])
            lo, hi = max(rows.start, row0), min(rows.stop, row0 + local.shape[0])
            if lo < hi:  # the part of this slice (gate or up half of fc1) that this rank holds
                local[lo - row0:hi - row0].copy_(part[lo - rows.start:hi - rows.start])

        te_weights.load_hf_checkpoint_into_te(params, str(root), write=write)
        return
    missing = set(params)
    for file, names in _hf_files(root).items():
        with safe_open(str(root / file), "pt") as f:
            for name in names:
                if name not in params:
                    if name == "lm_head.weight" and "lm_head.weight" not in missing and _tied(model):
                        continue  # tied head: the embedding already carries it
                    raise ConfigError(f"--init_from_hf {hf_dir}: tensor {name} in {file} has no parameter in the "
                                      f"model (is the --model preset the checkpoint's architecture?)")
                p = params[name]
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != tuple(p.shape):
                    raise ConfigError(f"--init_from_hf {hf_dir}: {name} has shape {tuple(sl.get_shape())}, the model "
                                      f"expects {tuple(p.shape)}")
                _write_rows(p, lambda lo, hi, sl=sl, p=p: sl[lo:hi].to(p.dtype))
                missing.discard(name)
    if missing:
        raise ConfigError(f"--init_from_hf {hf_dir}: no tensor for {sorted(missing)[:5]}"
                          f"{' ...' if len(missing) > 5 else ''}")
    log.info("initialized from Hugging Face checkpoint %s", hf_dir)


def _tied(model: nn.Module) -> bool:
    return model.get_input_embeddings().weight is model.get_output_embeddings().weight


# --- export: DCP -> HF ------------------------------------------------------------------------------
def _checkpoint_path(path: Path) -> Path:
    if (path / checkpoint.MARKER).is_file():
        return path
    found = checkpoint.complete_checkpoints(path)
    if not found:
        raise ConfigError(f"{path}: neither a complete checkpoint (step_N with {checkpoint.MARKER}) nor a folder "
                          f"holding one")
    return found[-1][1]


def export_hf(ckpt: Path, out: Path, dtype: torch.dtype) -> Path:
    """Write ``out`` as a Hugging Face Llama folder (config.json + safetensors) from a DCP checkpoint."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    path = _checkpoint_path(ckpt)
    saved = json.loads((path / "train_state.json").read_text())["config"]
    cfg = config_mod.resolve(TrainConfig(**{k: v for k, v in saved.items() if k != "config"}))
    impl = cfg.model_impl if cfg.model_impl in ("hf", "te") else "hf"
    model = model_mod.build_model(cfg, impl).to_empty(device="cpu")
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)  # in place, into the model's tensors
    hf = LlamaForCausalLM(model_mod.hf_config(cfg)) if impl == "te" else model
    if impl == "te":
        from llama_fp8 import te_weights

        hf.load_state_dict(te_weights.te_state_to_hf(state["model"], bool(cfg.tie_word_embeddings)), strict=True)
    hf.to(dtype).save_pretrained(str(out), safe_serialization=True)
    log.info("exported %s (%s, step %s) to %s", path, impl, path.name, out)
    return path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llama-fp8 convert", allow_abbrev=False,
                                     description="Export a DCP checkpoint (step_N folder, or a checkpoint dir: its "
                                                 "latest complete one) to a Hugging Face folder.")
    parser.add_argument("checkpoint", help="step_N folder or --checkpoint_dir")
    parser.add_argument("out_dir", help="new folder for config.json + model.safetensors (must not exist or be empty)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weights dtype (default bf16)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        print(f"llama-fp8 convert: error: {out} is not empty; choose a new OUT_DIR (nothing was overwritten)",
              file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        path = export_hf(Path(args.checkpoint), out, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    except ConfigError as e:
        print(f"llama-fp8 convert: error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(f"exported {path} -> {out}")
    return 0
