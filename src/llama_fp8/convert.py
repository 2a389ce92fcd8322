"""``llama-fp8 convert CKPT OUT``: a DCP checkpoint -> a Hugging Face Llama folder (config.json +
safetensors), whatever implementation trained it (its ``to_hf_state`` maps the names). The other
direction, ``--init_from_hf DIR``, is each implementation's ``load_hf`` (``models/hf_io.py``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from llama_fp8 import checkpoint, models
from llama_fp8 import config as config_mod
from llama_fp8.config import EXIT_BAD_CONFIG, ConfigError, TrainConfig
from llama_fp8.models.common import hf_config

log = logging.getLogger(__name__)


# --- export: DCP -> HF ------------------------------------------------------------------------------
def _checkpoint_path(path: Path) -> Path:
    if (path / checkpoint.MARKER).is_file():
        return path
    found = checkpoint.complete_checkpoints(path)
    if not found:
        raise ConfigError(f"{path}: neither a complete checkpoint (step_N with {checkpoint.MARKER}) nor a folder "
                          f"holding one")
    return found[-1][1]


def _s3_checkpoint(s3cfg, where):
    """The checkpoint at ``where`` (an S3 prefix holding a manifest, else the newest complete one under it)."""
    if any(p == where for _, p in checkpoint.places.complete(s3cfg, where.parent)):
        return where
    found = checkpoint.places.complete(s3cfg, where)
    if not found:
        raise ConfigError(f"{where}: neither a complete checkpoint (with {checkpoint.MARKER}) nor a prefix holding one")
    return found[-1][1]


def export_hf(ckpt, out: Path, dtype: torch.dtype, s3cfg=None) -> Path:
    """Write ``out`` as a Hugging Face Llama folder (config.json + safetensors) from a DCP checkpoint (a folder, or
    an s3:// prefix read with ``s3cfg``'s region and endpoint)."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaForCausalLM

    places = checkpoint.places
    where = places.location(ckpt)
    on_s3 = places.is_s3(where)
    path = _s3_checkpoint(s3cfg, where) if on_s3 else _checkpoint_path(where)
    problems = places.verify(s3cfg, path, 0, 1)  # sizes, checksums and structure, before anything is read
    if problems:
        raise ConfigError(f"{path} is damaged: {'; '.join(problems)}")
    saved = places.read_train_state(s3cfg, path)
    asked = {k: v for k, v in saved["config"].items() if k != "config"}
    cfg = config_mod.resolve(TrainConfig(**asked))
    # Checkpoints record the implementation that ran in their plan (older ones in the config itself).
    name = (saved.get("plan") or {}).get("model_impl") or cfg.model_impl
    impl = models.resolve(name, torch.device("cpu"))
    with torch.device("meta"):
        model = impl.build(cfg)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    # In place, into the model's tensors; the readers that never execute what they read (checkpoint/dcp_read.py).
    if on_s3:
        target = places.target(s3cfg, path)
        got = target.first(path, {})
        reader = target.reader(path, got["files"], got["dcp"])
    else:
        reader = checkpoint.dcp_read.SafeFileSystemReader(str(path))
    dcp.load(state, storage_reader=reader, planner=checkpoint.dcp_read.SafeLoadPlanner(), no_dist=True)
    hf = LlamaForCausalLM(hf_config(cfg))
    hf.load_state_dict(impl.to_hf_state(state["model"], cfg), strict=True)
    save_hf(hf, out, dtype)
    log.info("exported %s (%s, step %s) to %s", path, impl.name, path.name, out)
    return path


def save_hf(hf: torch.nn.Module, out: Path, dtype: torch.dtype) -> None:
    """``save_pretrained`` in safetensors, then every file it wrote gets the permissions of any file this user creates
    (0666 less the umask): safetensors (0.6 and later) writes through a temporary file, created owner-only (0600),
    and the export would be unreadable to the others who share the file system (and a job running as them)."""
    hf.to(dtype).save_pretrained(str(out), safe_serialization=True)
    umask = os.umask(0)
    os.umask(umask)
    for path in Path(out).iterdir():
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="llama-fp8 convert", allow_abbrev=False,
                                     description="Export a DCP checkpoint (step_N folder, or a checkpoint dir: its "
                                                 "latest complete one) to a Hugging Face folder.",
                                     epilog="docs: docs/checkpoints.md")
    parser.add_argument("checkpoint", help="step_N folder or --checkpoint_dir (or s3://bucket/prefix[/step_N])")
    parser.add_argument("--s3_region", help="region of an s3:// checkpoint's bucket (default: AWS_REGION)")
    parser.add_argument("--s3_endpoint", help="endpoint of an S3-compatible store (default: AWS_ENDPOINT_URL_S3)")
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
        s3cfg = argparse.Namespace(s3_region=args.s3_region, s3_endpoint=args.s3_endpoint, s3_threads=4,
                                   s3_prefix_strategy="auto", checkpoint_copy_dir=None)
        path = export_hf(args.checkpoint, out, torch.bfloat16 if args.dtype == "bf16" else torch.float32, s3cfg)
    except ConfigError as e:
        print(f"llama-fp8 convert: error: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    print(f"exported {path} -> {out}")
    return 0
