"""Training and validation batches: sources (hub, local files, synthetic, tokenized corpora), packing, the rank
split, the global sample order of a corpus and resumable loaders. The interface the rest of the package uses is
re-exported here; see ``loader.py``."""

from llama_fp8.data.corpus_loader import CorpusLoader
from llama_fp8.data.loader import (
    DataStateError,
    Fingerprinted,
    PackedLoader,
    SyntheticLoader,
    ValLoader,
    build_train_loader,
    build_val_loader,
    combine_fingerprints,
    synthetic_batch,
    to_batch,
    validate_data_config,
)

__all__ = ["CorpusLoader", "DataStateError", "Fingerprinted", "PackedLoader", "SyntheticLoader", "ValLoader",
           "build_train_loader", "build_val_loader", "combine_fingerprints", "synthetic_batch", "to_batch",
           "validate_data_config"]
