"""DCP's save to S3 through the connector's ``S3StorageWriter``, hashing every byte on its way up (as
``writer.HashingFileSystemWriter`` does for a file): the manifest gets each object's size, checksum and block
digests without reading a byte back from S3."""

from __future__ import annotations

import threading
from contextlib import contextmanager

from llama_fp8 import faults
from llama_fp8.checkpoint.s3.location import S3Location, S3Options
from llama_fp8.checkpoint.writer import _HashingStream, _no_zip_crc


def storage_writer(options: S3Options, ckpt: S3Location, hasher, world: int, step: int | None = None):
    """The connector's DCP writer of ``ckpt`` (``options.threads`` upload threads per rank, the prefix strategy for
    ``world`` ranks) whose ``digests`` maps each key it wrote (relative to ``ckpt``) to (bytes, digest, blocks)."""
    from s3torchconnector.dcp import S3FileSystem, S3StorageWriter

    class HashingS3FileSystem(S3FileSystem):
        def __init__(self) -> None:
            super().__init__(options.region, s3_client=options.client())
            self.root, self.lock, self.digests = str(ckpt), threading.Lock(), {}

        @contextmanager
        def create_stream(self, path, mode: str):
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            with super().create_stream(path, mode) as raw, _no_zip_crc():
                stream = _HashingStream(raw, hasher)
                yield _Announced(stream, step) if str(path).endswith(".distcp") else stream
                if stream.sequential:
                    with self.lock:
                        self.digests[self.relative(path)] = (stream.nbytes, stream.hexdigest(),
                                                             stream.block_digests())

        def rename(self, path, new_path) -> None:  # .metadata.tmp -> .metadata: a copy and a delete on S3
            super().rename(path, new_path)
            with self.lock:
                if self.relative(path) in self.digests:
                    self.digests[self.relative(new_path)] = self.digests.pop(self.relative(path))

        def relative(self, path) -> str:
            return str(path)[len(self.root) + 1:]

    class HashingS3StorageWriter(S3StorageWriter):
        @property
        def digests(self) -> dict:
            return self.fs.digests

    writer = HashingS3StorageWriter(options.region, str(ckpt), prefix_strategy=options.strategy(world),
                                    thread_count=options.threads)
    writer.fs = HashingS3FileSystem()  # the connector's writer builds a client without an endpoint: ours has it
    return writer


class _Announced:
    """A shard's stream that passes the ``save.uploading`` fault point once, after its first bytes are sent."""

    def __init__(self, stream, step: int | None) -> None:
        self._stream, self._step, self._told = stream, step, False

    def write(self, data) -> int:
        n = self._stream.write(data)
        if not self._told:
            self._told = True
            faults.at("save.uploading", self._step)
        return n

    def __getattr__(self, name: str):
        return getattr(self._stream, name)
