"""Checkpoints on S3 through the Amazon S3 Connector for PyTorch (``s3torchconnector[dcp]``, imported lazily): where
(``location``), the object operations with retries (``store``), the commit protocol without a rename (``commit``),
DCP's save and load through the connector's writer and reader (``save``, ``read``), and the background copy of a
file-system checkpoint to S3 (``copy``)."""

from llama_fp8.checkpoint.s3.location import S3Location, S3Options, is_s3
from llama_fp8.checkpoint.s3.store import ObjectStore

__all__ = ["ObjectStore", "S3Location", "S3Options", "is_s3"]
