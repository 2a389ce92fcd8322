"""Where an S3 checkpoint lives (``s3://bucket/prefix``) and how to reach it (region, endpoint, writer threads,
the prefix strategy), and the one client that talks to it: the Amazon S3 Connector for PyTorch's, which signs with
credentials from the usual AWS chain (environment, profile, instance or pod role) and never hands them to us.

A key is confined to its checkpoint the way a file name is confined to its folder (``safe_io.confined``): relative,
no empty, ``.`` or ``..`` segment, no backslash or NUL, at most ``MAX_DEPTH`` segments (the prefix strategies of the
connector put a shard one level down: ``0110000000/__3_0.distcp``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from llama_fp8.checkpoint.safe_io import UnsafeCheckpointFile

SCHEME = "s3://"
MAX_DEPTH = 3
PREFIX_STRATEGIES = ("auto", "default", "binary", "hex")
"""How DCP's shard keys are spread under a checkpoint's prefix (the connector's ``S3PrefixStrategyBase``)."""
SPREAD_FROM_RANKS = 16
"""``auto`` spreads the shard keys (hex) from this many ranks on; below, all shards share one prefix (see
docs/checkpoints.md: a prefix takes about 3,500 PUT/s before S3 answers 503 Slow Down)."""
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_SEGMENT = re.compile(r"^[A-Za-z0-9._\-=+]+$")


def is_s3(value) -> bool:
    return isinstance(value, (str, S3Location)) and str(value).startswith(SCHEME)


@dataclass(frozen=True)
class S3Location:
    """``s3://bucket/key`` (key without a trailing slash; "" is the bucket's root)."""

    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str, flag: str = "--checkpoint_dir") -> S3Location:
        if not uri.startswith(SCHEME):
            raise ValueError(f"{flag} {uri!r}: not an s3:// address")
        bucket, _, key = uri[len(SCHEME):].partition("/")
        key = key.strip("/")
        if not _BUCKET.match(bucket):
            raise ValueError(f"{flag} {uri!r}: {bucket!r} is not an S3 bucket name (3-63 lower-case letters, digits, "
                             f"dots and hyphens)")
        if key and any(not _SEGMENT.match(s) or s in (".", "..") for s in key.split("/")):
            raise ValueError(f"{flag} {uri!r}: the prefix may hold letters, digits and . _ - = + between slashes "
                             f"(no empty, '.' or '..' part)")
        return cls(bucket, key)

    def __truediv__(self, name: str) -> S3Location:
        return S3Location(self.bucket, f"{self.key}/{name}" if self.key else name)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> S3Location:
        return S3Location(self.bucket, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"


def confined_key(folder: S3Location, name) -> S3Location:
    """``folder / name`` if ``name`` is a relative key of at most MAX_DEPTH plain segments; UnsafeCheckpointFile if
    it could leave the checkpoint's prefix."""
    parts = name.split("/") if isinstance(name, str) else []
    if not parts or len(parts) > MAX_DEPTH or any(not _SEGMENT.match(p) or p in (".", "..") for p in parts):
        raise UnsafeCheckpointFile(f"{folder}/{name!s:.200}",
                                   f"the name {name!r:.200} is not a plain key inside the checkpoint's prefix (absolute, "
                                   f"with '..', an empty part or more than {MAX_DEPTH} levels); refused, nothing "
                                   f"outside was read")
    return folder / name


@dataclass(frozen=True)
class S3Options:
    """How to reach S3: the flags, else the usual AWS environment. ``endpoint``: an S3-compatible store or a test
    server (addressed path-style); None: AWS's endpoint of ``region``."""

    region: str
    endpoint: str | None = None
    threads: int = 4
    prefix_strategy: str = "auto"
    part_size: int = 8 << 20
    max_attempts: int = 10
    """Tries of one request by the CRT client (AWS_MAX_ATTEMPTS, the AWS SDKs' setting; the connector's default)."""

    @classmethod
    def from_config(cls, cfg) -> S3Options:
        region = getattr(cfg, "s3_region", None) or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if not region:
            raise ValueError("an s3:// checkpoint needs the bucket's region: --s3_region (or AWS_REGION in the "
                             "environment), e.g. --s3_region us-east-1")
        endpoint = (getattr(cfg, "s3_endpoint", None) or os.environ.get("AWS_ENDPOINT_URL_S3")
                    or os.environ.get("AWS_ENDPOINT_URL") or None)
        if endpoint and not re.match(r"^https?://[^/\s]+/?$", endpoint):
            raise ValueError(f"--s3_endpoint {endpoint!r}: expected http(s)://host[:port], e.g. http://127.0.0.1:8333")
        attempts = os.environ.get("AWS_MAX_ATTEMPTS", "10")
        if not attempts.isdigit() or int(attempts) < 1:
            raise ValueError(f"AWS_MAX_ATTEMPTS={attempts!r}: expected a whole number >= 1 (tries of one S3 request)")
        return cls(region=region, endpoint=endpoint.rstrip("/") if endpoint else None,
                   threads=int(getattr(cfg, "s3_threads", 4) or 4),
                   prefix_strategy=getattr(cfg, "s3_prefix_strategy", "auto") or "auto", max_attempts=int(attempts))

    def client(self):
        """The connector's S3 client (its CRT client is created on first use, once per process)."""
        s3 = _connector()
        from s3torchconnector._s3client import S3Client
        from s3torchconnector._user_agent import UserAgent

        config = s3.S3ClientConfig(force_path_style=self.endpoint is not None, part_size=self.part_size,
                                   max_attempts=self.max_attempts)
        return S3Client(self.region, endpoint=self.endpoint, user_agent=UserAgent(["llama-fp8"]),
                        s3client_config=config)

    def strategy(self, world: int):
        """The connector's prefix strategy for a save by ``world`` ranks."""
        from s3torchconnector import dcp as s3dcp

        name = self.prefix_strategy if self.prefix_strategy != "auto" else (
            "hex" if world >= SPREAD_FROM_RANKS else "default")
        if name == "default":
            return s3dcp.DefaultPrefixStrategy()
        cls = s3dcp.HexPrefixStrategy if name == "hex" else s3dcp.BinaryPrefixStrategy
        return cls(prefix_count=world)


def _connector():
    try:
        import s3torchconnector
        from s3torchconnector import dcp  # noqa: F401 - the [dcp] extra: tenacity
    except ImportError as e:
        raise ValueError(f"an s3:// checkpoint needs the Amazon S3 Connector for PyTorch: pip install "
                         f"'llama-fp8[s3]' ({e})") from e
    return s3torchconnector
