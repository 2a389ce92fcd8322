"""What ``Checkpointer`` does differently when ``--checkpoint_dir`` is an ``s3://`` prefix: the same steps (prepare,
each rank's files, DCP's shards, the agreement, the manifest last, retention, the load), on objects."""

from __future__ import annotations

import logging
from pathlib import Path

from llama_fp8.checkpoint import manifest, restore
from llama_fp8.checkpoint.s3 import commit, save
from llama_fp8.checkpoint.s3 import read as s3read
from llama_fp8.checkpoint.s3.location import S3Location, S3Options
from llama_fp8.checkpoint.s3.store import ObjectStore
from llama_fp8.checkpoint.safe_io import UnsafeCheckpointFile
from llama_fp8.errors import ConfigError

log = logging.getLogger("llama_fp8.checkpoint")


class S3Target:
    def __init__(self, root: S3Location, options: S3Options) -> None:
        self.root, self.options, self.store = root, options, ObjectStore(options)

    # --- save ----------------------------------------------------------------------------------
    def begin(self, step: int, sweep: bool) -> S3Location:
        return commit.begin(self.store, self.root, step, sweep)

    def put(self, ckpt: S3Location, name: str, data: bytes) -> None:
        self.store.write(ckpt / name, data)

    def writer(self, ckpt: S3Location, hasher, world: int):
        return save.storage_writer(self.options, ckpt, hasher, world, int(ckpt.name.removeprefix("step_")))

    def read_metadata(self, ckpt: S3Location):
        return s3read.read_dcp_metadata(self.store, ckpt, None)

    def sums(self, ckpt: S3Location, names: list[str]) -> dict[str, dict]:
        """Size and checksum of objects the writer did not hash on their way up (read back)."""
        out = {}
        for name in names:
            data = self.store.read(ckpt / name, 1 << 62)
            out[name] = manifest.entry(*manifest.digest_bytes(data))
        return out

    def publish(self, ckpt: S3Location, step: int, world: int, files: dict[str, dict], save_s: float,
                keep: int) -> list[S3Location]:
        """Rank 0, once every rank's objects are written: check them against DCP's metadata and the listing, write
        the manifest; returns the checkpoints ``keep`` retires (deleted in the background by ``retire``)."""
        meta = s3read.read_dcp_metadata(self.store, ckpt, files.get(".metadata"))
        manifest.check_against_metadata(ckpt, files, meta)
        commit.publish(self.store, ckpt, step, world, files, save_s)
        done = commit.complete(self.store, self.root)
        replaced = self.root / f"step_{step}{commit.REPLACED}"  # the earlier attempt's, now superseded
        return [p for _, p in done[:-keep]] + [replaced] if keep > 0 else [replaced]

    def retire(self, ckpt: S3Location) -> None:
        try:
            commit.remove_ours(self.store, ckpt)
        except Exception as e:  # noqa: BLE001 - a background deletion; the next sweep retries it
            log.warning("could not delete retired checkpoint %s (%s); the next run's first save retries", ckpt, e)

    def discard(self, ckpt: S3Location) -> None:
        """A failed save's objects (best effort: with S3 unreachable, the next run's first save removes them)."""
        try:
            commit.remove_ours(self.store, ckpt)
        except Exception as e:  # noqa: BLE001
            log.warning("could not remove the objects of the failed save %s (%s): never loaded (no manifest), "
                        "removed by the next run's first save", ckpt, e)

    def intact(self) -> str:
        try:
            done = commit.complete(self.store, self.root)
        except Exception as e:  # noqa: BLE001 - S3 unreachable: say so instead of guessing
            return f"the complete checkpoints under {self.root} could not be listed now ({e})"
        return f"the latest complete checkpoint ({done[-1][1]}) is intact" if done else \
            "there is no earlier complete checkpoint"

    # --- load ----------------------------------------------------------------------------------
    def first(self, ckpt: S3Location, state: dict) -> dict:
        """The manifest's files, train_state.json and DCP's metadata (checked to fit ``state``)."""
        files = s3read.read_manifest(self.store, ckpt)["files"]
        meta = s3read.read_train_state(self.store, ckpt, _entry(files, manifest.TRAIN_STATE, ckpt))
        try:
            dcp_meta = s3read.read_dcp_metadata(self.store, ckpt, _entry(files, ".metadata", ckpt))
        except UnsafeCheckpointFile as e:
            raise ConfigError(f"cannot resume from {ckpt}: {e}") from None
        return {"files": files, "meta": meta, "dcp": restore.fits(ckpt, state, dcp_meta)}

    def reader(self, ckpt: S3Location, files: dict, dcp_meta):
        return s3read.storage_reader(self.store, ckpt, files, dcp_meta)

    def rank_state(self, ckpt: S3Location, rank: int, files: dict) -> dict:
        try:
            return s3read.read_rank_state(self.store, ckpt, rank, files)
        except UnsafeCheckpointFile as e:
            raise ConfigError(f"cannot resume from {ckpt}: {e}") from None

    def recorded_save_s(self, ckpt: S3Location) -> float | None:
        try:
            value = s3read.read_manifest(self.store, ckpt).get("save_s")
        except Exception:  # noqa: BLE001 - a hint for the hang bound; absent is fine
            return None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else None


def _entry(files: dict, name: str, ckpt) -> dict:
    if name not in files:
        raise UnsafeCheckpointFile(str(ckpt / name), "is not in the checkpoint's manifest; refused")
    return files[name]


def location(value) -> S3Location | Path:
    """An ``s3://`` string as an S3Location; anything else as a Path."""
    if isinstance(value, (S3Location, Path)):
        return value
    return S3Location.parse(value) if str(value).startswith("s3://") else Path(value)
