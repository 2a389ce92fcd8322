"""Training and validation batches: sources (hub, local files, synthetic), packing, the rank split and a
resumable loader. The interface the rest of the package uses is re-exported here; see ``loader.py``."""

from llama_fp8.data.loader import (
    DataStateError,
    Fingerprinted,
    PackedLoader,
    SyntheticLoader,
    ValLoader,
    build_train_loader,
    build_val_loader,
    synthetic_batch,
    to_batch,
    validate_data_config,
)

__all__ = ["DataStateError", "Fingerprinted", "PackedLoader", "SyntheticLoader", "ValLoader", "build_train_loader",
           "build_val_loader", "synthetic_batch", "to_batch", "validate_data_config"]
