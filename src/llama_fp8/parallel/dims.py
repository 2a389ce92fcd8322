"""The device mesh: its dimensions, validated up front, and the mesh itself."""

from __future__ import annotations

from dataclasses import dataclass

from llama_fp8.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """Data-parallel layout: ``dp_replicate`` replicas (HSDP) x ``dp_shard`` ranks each shards over.
    A size given as -1 is filled from the world size (in ``__post_init__``, before the object is used)."""

    dp_replicate: int
    dp_shard: int
    world_size: int

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard"):
            v = getattr(self, name)
            if v == 0 or v < -1:
                raise ConfigError(f"--{name}_size {v} is not valid; valid: a positive integer or -1 (fill)")
        if self.dp_replicate == -1 and self.dp_shard == -1:
            raise ConfigError("--dp_replicate_size and --dp_shard_size cannot both be -1")
        if self.dp_replicate == -1:
            object.__setattr__(self, "dp_replicate", self._fill("dp_replicate", self.dp_shard))
        if self.dp_shard == -1:
            object.__setattr__(self, "dp_shard", self._fill("dp_shard", self.dp_replicate))
        if self.dp_replicate * self.dp_shard != self.world_size:
            raise ConfigError(f"--dp_replicate_size {self.dp_replicate} x --dp_shard_size {self.dp_shard} = "
                              f"{self.dp_replicate * self.dp_shard}, but the world size is {self.world_size}")

    def _fill(self, name: str, other: int) -> int:
        if self.world_size % other:
            raise ConfigError(f"world size {self.world_size} is not divisible by {other}, so --{name}_size -1 "
                              f"has no whole value")
        return self.world_size // other

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @classmethod
    def from_config(cls, cfg, env) -> ParallelDims:
        world_size, local_world_size = env.world_size, env.local_world_size
        if cfg.sharding_strategy == "hybrid":
            if (cfg.dp_replicate_size, cfg.dp_shard_size) != (1, -1):
                raise ConfigError("--sharding_strategy hybrid sets the mesh itself; drop --dp_replicate_size/"
                                  "--dp_shard_size or use --sharding_strategy full with them")
            # Replicate across nodes, shard within a node: all-gathers stay on NVLink.
            return cls(world_size // local_world_size, local_world_size, world_size)
        return cls(cfg.dp_replicate_size, cfg.dp_shard_size, world_size)


def build_mesh(dims: ParallelDims, env):
    from torch.distributed.device_mesh import init_device_mesh

    device_type = env.device.type
    if dims.hsdp:
        return init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard),
                                mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(device_type, (dims.dp_shard,), mesh_dim_names=("dp_shard",))
