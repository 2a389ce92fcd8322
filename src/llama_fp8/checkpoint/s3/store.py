"""The object operations a checkpoint needs (list, read capped, open for ranged reads, write, delete, copy),
through the connector's S3 client, each retried on a transient failure.

The client (the AWS CRT) already retries a 503 Slow Down, a 500 or a dropped connection up to 10 times with its own
backoff. What outlasts that is tried again ``RETRY_PAUSES`` later (a server restarting, a network partition healing),
then raised as the transient class (``faults.TransientError``, exit 75: the launcher restarts and the run resumes
from the latest complete checkpoint). A refused request (Forbidden, no such bucket) is a setting: raised at once as
a ValueError naming the address, never as a transient failure. Messages name the address, never a credential.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from llama_fp8 import faults
from llama_fp8.checkpoint.s3.location import S3Location, S3Options
from llama_fp8.checkpoint.safe_io import UnsafeCheckpointFile
from llama_fp8.faults.transient import TransientError

log = logging.getLogger("llama_fp8.checkpoint")
T = TypeVar("T")
RETRY_PAUSES = (1.0, 4.0)
"""Pauses between our own tries of a request the client gave up on for a transient reason."""
READ_BUFFER = 64 << 20
"""Bytes one ranged GET fetches ahead when a shard is read forward (the client splits it into parallel parts)."""
_NOT_FOUND = ("not found", "nosuchkey", "no such key", "404")


class ObjectMissing(FileNotFoundError):
    """The object does not exist (a 404): a checkpoint's missing piece, not a failure of S3."""


class ObjectStore:
    """One S3 client for the process (the connector's client recreates its CRT client after a fork)."""

    def __init__(self, options: S3Options, sleep=time.sleep) -> None:
        self.options, self._client, self._sleep = options, None, sleep

    @property
    def client(self):
        if self._client is None:
            self._client = self.options.client()
        return self._client

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        for pause in (*RETRY_PAUSES, None):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below: missing, transient, or a setting
                text = str(e).lower()
                if type(e).__name__ == "S3Exception" and any(w in text for w in _NOT_FOUND):
                    raise ObjectMissing(f"{what}: no such object") from None
                if isinstance(e, (TransientError, UnsafeCheckpointFile, ValueError)) and \
                        type(e).__name__ != "S3Exception":
                    raise
                if faults.kind_of(e) is None:
                    raise ValueError(f"{what}: S3 refused the request ({_one_line(e)}); check the bucket, the "
                                     f"region (--s3_region), the endpoint (--s3_endpoint) and the IAM permissions "
                                     f"(docs/checkpoints.md)") from None
                if pause is None:
                    raise TransientError("network", f"{what}: {_one_line(e)} (after the client's retries and "
                                                    f"{len(RETRY_PAUSES)} more)") from None
                log.warning("%s: %s; trying again in %.0f s", what, _one_line(e), pause)
                self._sleep(pause)
        raise AssertionError("unreachable")

    # --- reading -------------------------------------------------------------------------------
    def list(self, where: S3Location) -> dict[str, int]:
        """{key relative to ``where``: size} of every object under ``where/`` (all levels)."""
        prefix = f"{where.key}/" if where.key else ""

        def run() -> dict[str, int]:
            out = {}
            for page in self.client.list_objects(where.bucket, prefix):
                out.update({info.key[len(prefix):]: int(info.size) for info in page.object_info})
            return out

        return self._call(f"listing {where}/", run)

    def children(self, where: S3Location) -> list[str]:
        """The names of the "folders" right under ``where/`` (common prefixes, without the slash)."""
        prefix = f"{where.key}/" if where.key else ""

        def run() -> list[str]:
            out = []
            for page in self.client.list_objects(where.bucket, prefix, "/"):
                out += [p[len(prefix):].rstrip("/") for p in page.common_prefixes]
            return out

        return self._call(f"listing {where}/", run)

    def size(self, where: S3Location) -> int:
        return int(self._call(f"reading {where}", lambda: self.client.head_object(where.bucket, where.key)).size)

    def read(self, where: S3Location, cap: int) -> bytes:
        """The whole object, if it has at most ``cap`` bytes (its size is asked first, then at most ``cap`` + 1
        bytes are read: an object replaced by a larger one meanwhile is refused too)."""
        size = self.size(where)
        if size > cap:
            raise UnsafeCheckpointFile(str(where), f"is {size} bytes, more than the {cap} an object of its kind may "
                                                   f"have; refused without reading it")

        def run() -> bytes:
            from s3torchconnector import S3ReaderConstructor

            reader = self.client.get_object(where.bucket, where.key,
                                            reader_constructor=S3ReaderConstructor.range_based(buffer_size=0))
            return reader.read(cap + 1)

        data = self._call(f"reading {where}", run)
        if len(data) > cap:
            raise UnsafeCheckpointFile(str(where), f"grew past {cap} bytes while being read; refused")
        return data

    def open(self, where: S3Location):
        """A seekable reader of the object fetching ``READ_BUFFER`` bytes per ranged GET (its size is asked once)."""
        from s3torchconnector import S3ReaderConstructor

        size = self.size(where)  # a missing object is named here (ObjectMissing), not deep inside a read
        return _Retried(self, where, self.client.get_object(
            where.bucket, where.key, reader_constructor=S3ReaderConstructor.range_based(buffer_size=READ_BUFFER)),
            size)

    # --- writing -------------------------------------------------------------------------------
    def write(self, where: S3Location, data: bytes) -> None:
        def run() -> None:
            with self.client.put_object(where.bucket, where.key) as w:
                w.write(data)

        self._call(f"writing {where}", run)

    def delete(self, where: S3Location) -> None:
        self._call(f"deleting {where}", lambda: self.client.delete_object(where.bucket, where.key))

    def copy(self, src: S3Location, dst: S3Location) -> None:
        """A server-side copy (no byte passes through this process)."""
        self._call(f"copying {src} to {dst}", lambda: self.client.copy_object(src.bucket, src.key, dst.bucket,
                                                                                dst.key))


class _Retried:
    """A reader whose reads are retried like any request (a transient failure re-reads the same range)."""

    def __init__(self, store: ObjectStore, where: S3Location, reader, size: int) -> None:
        self.store, self.where, self.reader, self.size, self._pos = store, where, reader, size, 0

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = self.reader.seek(offset, whence)
        return self._pos

    def readinto(self, buf) -> int:
        def run() -> int:
            self.reader.seek(self._pos)
            return self.reader.readinto(buf)

        got = self.store._call(f"reading {self.where}", run)
        self._pos += got
        return got

    def close(self) -> None:
        self.reader.close()


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]
