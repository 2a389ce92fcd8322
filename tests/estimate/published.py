"""Published peak memory of training configurations the estimator can express, and the program that produced them as
far as this repository can build it: the checks of the estimate's GPU terms and margin (test_published.py).

Source: torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan), Llama 3.1 on H100s with 96 GB
HBM2e, December 2024 builds; its "Memory(GiB)" is ``torch.cuda.memory_stats()["reserved_bytes.all.peak"]`` (the
caching allocator's reserved peak), the sequence length its train configs' ``seq_len = 8192`` unless the table says
otherwise, the batch sizes the tables' own. Rows with pipeline parallelism, context parallelism (estimated only on
CUDA) or asynchronous TP are left out: the estimator cannot express them.

The program torchtitan ran differs from ours where this repository has since saved memory, and those differences are
put back for this comparison (``TorchtitanLike``): its loss took the cross entropy of the whole logits in FP32 (its
Llama returned ``output(h).float()``), its root module held the embedding and the output head unsharded through
backward, and its selective checkpointing kept the outputs of every second matmul of a block (q, v, gate, down). What
remains different: its own Llama against transformers', and ``torch.compile`` (estimated eager: compiled blocks
need less, 82.4 against 77.0 GiB in its Table 1), and a 96 GB GPU's allocator cache.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

TORCHTITAN = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TORCHTITAN_KEEPS = ("q", "v", "gate", "down")  # its op-level policy: every second matmul recomputed


@dataclass(frozen=True)
class Published:
    name: str
    flags: tuple[str, ...]  # train flags (with --model_impl of the program torchtitan ran)
    nodes: int
    reserved_gib: float  # the published peak
    source: str
    compiled: bool = False  # estimated eager: the published run compiled its blocks


BASE = ("--model", "llama3.1-8b", "--max_context_width", "8192", "--train_batch_size", "2")
SELECTIVE = (*BASE, "--activation_checkpointing", "selective")
# The rows the allocator margin (terms.ALLOCATOR_MARGIN) was set from: in-sample.
ROWS = (
    Published("Llama 3.1 8B, 8 GPUs, FSDP, selective AC, 2 x 8192", SELECTIVE, 1, 82.4, f"{TORCHTITAN}, Table 1, FSDP"),
    Published("Llama 3.1 8B, 128 GPUs, FSDP, selective AC, 2 x 8192", SELECTIVE, 16, 67.0,
              f"{TORCHTITAN}, Table 3, FSDP"),
    Published("Llama 3.1 8B, 8 GPUs, FSDP, full AC, 1 x 32768, compile + Float8",
              ("--model", "llama3.1-8b", "--max_context_width", "32768", "--train_batch_size", "1",
               "--activation_checkpointing", "full", "--fp8", "1", "--compile", "1"), 1, 83.9,
              f"{TORCHTITAN}, Table 2, FSDP 8, CP 1", compiled=True),
    Published("Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8, full AC, 16 x 8192, compile + Float8",
              ("--model", "llama3.1-70b", "--max_context_width", "8192", "--train_batch_size", "16",
               "--activation_checkpointing", "full", "--tp_size", "8", "--fp8", "1", "--compile", "1"), 32, 71.9,
              f"{TORCHTITAN}, Table 4, 2D", compiled=True),
)
# The same tables' rows the margin was not set from (held out): the compiled runs of Tables 1 and 3, estimated eager
# (compiled blocks needed 5.4 and 5.0 GiB less than eager in those tables). "Float8" as in the rows above: torchao's
# tensorwise linears, FP8 all-gather not assumed (the tables do not say; it would only lower the published peak).
HELD_OUT = (
    Published("Llama 3.1 8B, 8 GPUs, FSDP, selective AC, 2 x 8192, compile", (*SELECTIVE, "--compile", "1"), 1, 77.0,
              f"{TORCHTITAN}, Table 1, FSDP + torch.compile", compiled=True),
    Published("Llama 3.1 8B, 8 GPUs, FSDP, selective AC, 2 x 8192, compile + Float8",
              (*SELECTIVE, "--fp8", "1", "--compile", "1"), 1, 76.8,
              f"{TORCHTITAN}, Table 1, FSDP + torch.compile + Float8", compiled=True),
    Published("Llama 3.1 8B, 128 GPUs, FSDP, selective AC, 2 x 8192, compile", (*SELECTIVE, "--compile", "1"), 16,
              62.0, f"{TORCHTITAN}, Table 3, FSDP + torch.compile", compiled=True),
    Published("Llama 3.1 8B, 128 GPUs, FSDP, selective AC, 2 x 8192, compile + Float8",
              (*SELECTIVE, "--fp8", "1", "--compile", "1"), 16, 61.8,
              f"{TORCHTITAN}, Table 3, FSDP + torch.compile + Float8", compiled=True),
)


# One NCCL communicator's device memory outside PyTorch's allocator, as published (the GPU test's band,
# test_estimate_gpu.py): the least, 544 MB for a group of 2 GPUs on 4 x A100 with NVLink after a 4 MB all-reduce
# (NVIDIA/nccl#964; 688 MB for 3 or 4 GPUs there), read as 10^6-byte MB, the lower reading; the most, about 1.6 GB
# for one communicator after an all-reduce (NVIDIA/nccl#864), read as GiB, the higher reading. On an NVSwitch node
# with NVLink SHARP NCCL may add its NVLS buffers, 288 MiB per rank on 8 x H200 (vllm-project/vllm#9699), to the
# most. The buffers behind these figures, from NCCL's source (src/init.cc computeBuffSizes, src/include/device.h):
# per channel and connection SIMPLE's NCCL_BUFFSIZE of 4 MiB, LL128's 120 x 640 x 8 steps x 8 B (4.69 MiB) and
# LL's 8 x 512 x 8 steps x 16 B (0.5 MiB), times the channels NCCL opens for the link (NVIDIA/nccl#864: "linearly
# tied to the number of channels").
NCCL_COMMUNICATOR_LEAST = 544 * 10**6
NCCL_COMMUNICATOR_MOST = int(1.6 * 2**30)
NCCL_NVLS_MOST = 288 * 2**20
NCCL_SOURCES = "NVIDIA/nccl#964 (544 MB, 2 x A100 NVLink), NVIDIA/nccl#864 (1.6 GB), vllm-project/vllm#9699 (NVLS)"


@contextlib.contextmanager
def torchtitan_like():
    """The Hugging Face implementation as torchtitan's program of December 2024 ran (module docstring), registered as
    ``--model_impl torchtitan-like`` while the context is open."""
    from llama_fp8 import models
    from llama_fp8.models.spec import ModelImpl
    from llama_fp8.parallel import activation_checkpointing

    hf = type(models.get("hf"))

    class TorchtitanLike(hf):
        name = "torchtitan-like"
        description = "the HF model as torchtitan's December 2024 program ran (tests only)"
        auto_when = "never"
        loss = ModelImpl.loss  # the cross entropy of the whole logits in FP32

        def auto_eligible(self, device):
            return False

        def embedding(self, model):
            return None  # embedding and head stay in the root, as torchtitan's were

    saved_registry, saved_keeps = dict(models._REGISTRY), activation_checkpointing.SELECTIVE_KEEPS
    models.register(TorchtitanLike())
    activation_checkpointing.SELECTIVE_KEEPS = TORCHTITAN_KEEPS
    try:
        yield
    finally:
        activation_checkpointing.SELECTIVE_KEEPS = saved_keeps
        models._REGISTRY.clear()
        models._REGISTRY.update(saved_registry)


def estimate(row: Published, impl: str = "torchtitan-like"):
    """The estimate of ``row`` on 8-GPU H100 nodes for implementation ``impl`` (an ``assess.Estimate``)."""
    from llama_fp8 import config
    from llama_fp8.estimate import assess
    from llama_fp8.estimate.flags import EstimateOptions

    cfg = config.parse_args([*row.flags, "--model_impl", impl])
    return assess.estimate(cfg, EstimateOptions(nodes=row.nodes, gpus_per_node=8, gpu="H100", suggest=False))


def ratio(e, row: Published) -> float:
    """The estimate with its margin over the published reserved peak."""
    return (e.verdict.needed + e.verdict.margin) / (row.reserved_gib * 2**30)


def passing_margins(e, row: Published, low: float, high: float) -> tuple[float, float]:
    """The margins m (a fraction of the tracked peak) that put ``row`` in the band: low <= (needed + m x tracked) /
    published <= high, solved for m from one estimate (the margin does not change the estimate, only the ratio)."""
    published, tracked = row.reserved_gib * 2**30, e.measurement.peak_bytes
    return (low * published - e.verdict.needed) / tracked, (high * published - e.verdict.needed) / tracked
