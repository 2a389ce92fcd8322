"""The device mesh: its dimensions, validated up front, and the mesh itself.

One mesh, dimensions in the order (dp_replicate, dp_shard, cp, tp), innermost last: ranks of one
tensor-parallel group are neighbours (same node, NVLink), then context-parallel ranks, then the ranks
one replica shards over, then the replicas (across nodes). Every rank of one TP x CP group reads the same
batch; data-parallel ranks (dp_replicate x dp_shard) read disjoint ones. FSDP2 shards parameters over
dp_shard, or over dp_shard x cp flattened when context parallelism is on (the CP ranks of a group hold
different tokens, so their gradients are reduced like data parallelism's), replicated over dp_replicate
(HSDP).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from llama_fp8.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelDims:
    """``dp_replicate`` replicas (HSDP) x ``dp_shard`` ranks each shards over x ``cp`` context-parallel x ``tp``
    tensor-parallel ranks. A data-parallel size given as -1 is filled from the world size (in
    ``__post_init__``, before the object is used)."""

    dp_replicate: int
    dp_shard: int
    world_size: int
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("cp", "tp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name}_size {getattr(self, name)} is not valid; valid: a positive integer")
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
        if self.dp_replicate * self.dp_shard * self.cp * self.tp != self.world_size:
            raise ConfigError(f"--dp_replicate_size {self.dp_replicate} x --dp_shard_size {self.dp_shard} x "
                              f"--cp_size {self.cp} x --tp_size {self.tp} = "
                              f"{self.dp_replicate * self.dp_shard * self.cp * self.tp}, but the world size is "
                              f"{self.world_size}")

    def _fill(self, name: str, other: int) -> int:
        rest = other * self.cp * self.tp
        if self.world_size % rest:
            raise ConfigError(f"world size {self.world_size} is not divisible by {rest} (the other mesh sizes), so "
                              f"--{name}_size -1 has no whole value")
        return self.world_size // rest

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: how many different batches one step reads."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """Which batch ``rank`` reads: its (dp_replicate, dp_shard) coordinate, flattened (row-major mesh)."""
        return rank // (self.cp * self.tp)

    def cp_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.cp

    def groups(self, dim: str) -> list[list[int]]:
        """Every group of ranks along mesh dimension ``dim`` (ranks are laid out row-major over
        dp_replicate, dp_shard, cp, tp), e.g. every CP group of the world."""
        sizes = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp, "tp": self.tp}
        import torch

        grid = torch.arange(self.world_size).reshape(tuple(sizes.values()))
        axis = list(sizes).index(dim)
        return grid.movedim(axis, -1).reshape(-1, sizes[dim]).tolist()

    @property
    def shape(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the mesh dimensions: dp_shard always, the others when larger than 1."""
        dims = [("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)]
        return tuple((n, s) for n, s in dims if s > 1 or n == "dp_shard")

    @classmethod
    def from_config(cls, cfg, env) -> ParallelDims:
        world_size, local_world_size = env.world_size, env.local_world_size
        cp, tp = getattr(cfg, "cp_size", 1), getattr(cfg, "tp_size", 1)
        if cfg.sharding_strategy == "hybrid":
            if (cfg.dp_replicate_size, cfg.dp_shard_size) != (1, -1):
                raise ConfigError("--sharding_strategy hybrid sets the mesh itself; drop --dp_replicate_size/"
                                  "--dp_shard_size or use --sharding_strategy full with them")
            if local_world_size % (cp * tp):
                raise ConfigError(f"--sharding_strategy hybrid shards within a node, but --cp_size {cp} x --tp_size "
                                  f"{tp} does not divide the {local_world_size} ranks of a node")
            # Replicate across nodes, shard within a node: all-gathers stay on NVLink.
            dims = cls(world_size // local_world_size, local_world_size // (cp * tp), world_size, cp, tp)
        else:
            dims = cls(cfg.dp_replicate_size, cfg.dp_shard_size, world_size, cp, tp)
        if tp > 1 and local_world_size % tp:
            log.warning("--tp_size %d does not divide the %d ranks of a node: tensor-parallel groups cross nodes, "
                        "where every layer's collectives leave NVLink (slow); keep TP within a node", tp,
                        local_world_size)
        return dims


def check_shapes(cfg, dims: ParallelDims) -> None:
    """The model and batch shapes that the mesh must divide, checked before anything is built."""
    T = cfg.max_context_width
    if dims.tp > 1:
        for flag in ("num_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            if getattr(cfg, flag) % dims.tp:
                raise ConfigError(f"--{flag} {getattr(cfg, flag)} is not divisible by --tp_size {dims.tp} (tensor "
                                  f"parallelism splits it over the ranks)")
        if T % dims.tp:
            raise ConfigError(f"--max_context_width {T} is not divisible by --tp_size {dims.tp} (sequence "
                              f"parallelism splits the tokens over the tensor-parallel ranks)")
    if dims.cp > 1 and T % (2 * dims.cp * dims.tp):
        raise ConfigError(f"--max_context_width {T} is not divisible by 2 x --cp_size {dims.cp}"
                          f"{f' x --tp_size {dims.tp}' if dims.tp > 1 else ''} = {2 * dims.cp * dims.tp} (context "
                          f"parallelism cuts each sequence into 2 x cp equal chunks)")


def build_mesh(dims: ParallelDims, env):
    from torch.distributed.device_mesh import init_device_mesh

    names, sizes = zip(*dims.shape)
    return init_device_mesh(env.device.type, sizes, mesh_dim_names=names)


def fsdp_mesh(mesh, dims: ParallelDims):
    """The mesh FSDP2 shards over: dp_shard (x cp, flattened), with dp_replicate in front for HSDP."""
    shard = "dp_shard"
    if dims.cp > 1:
        shard = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shard)
    return mesh["dp_replicate", shard] if dims.hsdp else mesh[shard]
