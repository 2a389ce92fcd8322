"""The attributes of TrainConfig that the data pipeline reads, as the data tests set them."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Cfg:
    """The attributes of TrainConfig that the data pipeline reads (defaults of the data tests)."""

    dataset: str = "synthetic"
    dataset_config_name: str | None = None
    text_field: str = "text"
    data_files: str | None = None
    val_data_files: str | None = None
    val_fraction: float = 0.0
    tokenizer: str | None = None
    max_context_width: int = 32
    train_batch_size: int = 4
    val_batch_size: int = 2
    seed: int = 7
    num_workers: int = 0
    vocab_size: int = 512
    validation_batches: int = 3
    streaming: bool = True
    data_blend: str | None = None
    skip_samples: str | None = None
    doc_masking: bool = False
