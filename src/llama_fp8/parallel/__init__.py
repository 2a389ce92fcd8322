"""Distributed execution: the process group (``dist``), the device mesh (``dims``), and sharding in one
fixed order (``parallelize``)."""

from llama_fp8.errors import AgreedError
from llama_fp8.parallel.context import StepContext
from llama_fp8.parallel.dims import ParallelDims, build_mesh, check_shapes
from llama_fp8.parallel.dist import (
           DistEnv,
           all_reduce_mean,
           destroy_distributed,
           init_distributed,
           on_every_rank,
)
from llama_fp8.parallel.parallelize import parallelize

__all__ = ["AgreedError", "DistEnv", "ParallelDims", "StepContext", "all_reduce_mean", "build_mesh", "check_shapes",
           "destroy_distributed", "init_distributed", "on_every_rank", "parallelize"]
