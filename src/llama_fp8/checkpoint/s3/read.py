"""Reading an S3 checkpoint as safely as a folder (``safe_io``, ``dcp_read``): every key confined to the checkpoint's
prefix, every object read whole capped by its kind, every byte verified against the manifest before it is used,
nothing unpickled but through the allow-list.

The connector's ``S3StorageReader`` is the DCP reader here, with two of its methods replaced by ours: its
``read_metadata`` unpickles ``.metadata`` with a plain ``pickle.load`` (a planted object could run code) and its
``read_data`` hands DCP the bytes unverified. Ours fetch the same objects through the connector's client and ranged
reader, and verify each 4 MiB block against the manifest before a tensor is loaded from it.
"""

from __future__ import annotations

import torch

from llama_fp8.checkpoint import dcp_read, manifest, safe_io
from llama_fp8.checkpoint import files as rank_files
from llama_fp8.checkpoint.s3.location import S3Location, confined_key
from llama_fp8.checkpoint.s3.store import ObjectMissing, ObjectStore
from llama_fp8.checkpoint.safe_io import UnsafeCheckpointFile


def read_checked(store: ObjectStore, where: S3Location, want: dict | None, cap: int) -> bytes:
    """The bytes of the object ``where``, verified against its manifest entry ``want`` (capped only without one)."""
    if want is not None and int(want["bytes"]) > cap:
        raise UnsafeCheckpointFile(str(where), f"the manifest says {want['bytes']} bytes, more than the {cap} an object "
                                               f"of its kind may have; refused without reading it")
    try:
        data = store.read(where, cap if want is None else min(int(want["bytes"]), cap))
    except ObjectMissing:
        raise UnsafeCheckpointFile(str(where), "is missing (the manifest lists it)") from None
    except UnsafeCheckpointFile as e:
        if want is not None and "more than" in e.reason:  # longer than the manifest says: changed since
            raise UnsafeCheckpointFile(str(where), f"is longer than the {want['bytes']} bytes the manifest says "
                                                   f"(changed since it was saved); refused") from None
        raise
    if want is None:
        return data
    algorithm = next((a for a in safe_io.HASHERS if a in want), None)
    hasher = safe_io.HASHERS[algorithm]() if algorithm else None
    if hasher is not None:
        hasher.update(data)
    return safe_io.checked(str(where), data, want, cap, hasher, algorithm)


def read_manifest(store: ObjectStore, ckpt: S3Location) -> dict:
    """The manifest object ``COMPLETE`` (always version 2 or later on S3)."""
    try:
        text = store.read(ckpt / manifest.MARKER, safe_io.MAX_JSON).decode(errors="replace")
    except ObjectMissing:
        raise ValueError(f"{ckpt}/{manifest.MARKER}: missing (not a complete checkpoint)") from None
    return manifest.parse_manifest(text, ckpt, lambda name: confined_key(ckpt, name))


def read_train_state(store: ObjectStore, ckpt: S3Location, want: dict | None) -> dict:
    where = ckpt / manifest.TRAIN_STATE
    return manifest.parse_train_state(read_checked(store, where, want, safe_io.MAX_JSON), str(where))


def read_dcp_metadata(store: ObjectStore, ckpt: S3Location, want: dict | None):
    where = ckpt / ".metadata"
    return dcp_read.parse_dcp_metadata(read_checked(store, where, want, safe_io.MAX_METADATA), str(where),
                                       lambda name: confined_key(ckpt, name))


def read_rank_state(store: ObjectStore, ckpt: S3Location, rank: int, files: dict) -> dict:
    name = rank_files.RANK_FILE.format(rank)
    if name not in files:
        raise UnsafeCheckpointFile(str(ckpt / name), "is not in the checkpoint's manifest; refused")
    where = ckpt / name
    return rank_files.parse_rank_state(read_checked(store, where, files[name], safe_io.MAX_RANK_FILE), str(where))


class _Objects:
    """What ``SafeFileSystemReader.read_data`` asks of its file system, for the objects of one checkpoint."""

    def __init__(self, store: ObjectStore, ckpt: S3Location, files: dict) -> None:
        self.store, self.ckpt, self.files = store, ckpt, files

    def confine(self, name: str) -> str:
        return str(confined_key(self.ckpt, name))

    def blocks(self, name: str, want: dict, largest: int) -> safe_io.VerifiedBlocks:
        where = confined_key(self.ckpt, name)
        return safe_io.VerifiedBlocks(str(where), want, safe_io.HASHERS, largest, opener=lambda: self.store.open(where))

    def read_verified(self, name: str) -> torch.Tensor:
        want = self.files.get(name)
        if want is None:
            raise UnsafeCheckpointFile(self.confine(name), "is not in the checkpoint's manifest; refused")
        data = read_checked(self.store, confined_key(self.ckpt, name), want, 1 << 62)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def storage_reader(store: ObjectStore, ckpt: S3Location, files: dict, metadata):
    """The connector's DCP reader of ``ckpt`` with our verified reads (see the module's docstring)."""
    from s3torchconnector import S3ReaderConstructor
    from s3torchconnector.dcp import S3StorageReader

    class SafeS3StorageReader(S3StorageReader):
        read_metadata = dcp_read.SafeFileSystemReader.read_metadata
        read_data = dcp_read.SafeFileSystemReader.read_data
        _read_file = dcp_read.SafeFileSystemReader._read_file
        _commit = staticmethod(dcp_read.SafeFileSystemReader._commit)

    reader = SafeS3StorageReader(store.options.region, str(ckpt), reader_constructor=S3ReaderConstructor.sequential())
    reader.fs = _Objects(store, ckpt, files)
    reader.files, reader.metadata = files, metadata
    return reader
