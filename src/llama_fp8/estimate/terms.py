"""What the tracker cannot see on a GPU, as named terms with their sources, and the verdict.

The tracker counts the bytes of every tensor storage the step's ops create (exactly: tests/estimate compare it
with a real run). On a GPU, memory also goes to things that are not tensors of the step; each is a term here.
Terms marked "to calibrate" rest on defaults or documents, not on a measurement on a GPU yet: the GPU test
(tests/estimate/test_estimate_gpu.py, `pytest -m gpu`) measures the gap between the estimate and
``torch.cuda.max_memory_allocated``/``max_memory_reserved`` on the node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llama_fp8.estimate.gpus import GIB, MIB, Gpu, domain_of

CONTEXT_BYTES = 1 * GIB
NCCL_PER_COMMUNICATOR = 640 * MIB
NCCL_NVLS_PER_COMMUNICATOR = 288 * MIB  # on an NVSwitch node (H100, H200), for a group with 2+ GPUs of it
CUBLAS_WORKSPACE = 32 * MIB
ALLOCATOR_MARGIN = 0.20  # of the tracked peak


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    source: str
    calibrated: bool = False  # False: "to calibrate" (not measured on a GPU yet)
    added: bool = True  # False: stated only (it cannot be sized)
    any_implementation: bool = True  # the same for every model implementation of these shapes (the floor's)

    def to_dict(self) -> dict:
        return asdict(self)


def communicators(collectives: list[dict], group_ranks: dict[str, list[int]]) -> list[str]:
    """The NCCL communicators on this rank: one per mesh dimension whose collectives run over more than one rank,
    and the world's. Training creates the world's eagerly (``init_process_group`` with ``device_id``, parallel/
    dist.py); a mesh dimension over the whole world uses it (torch's DeviceMesh reuses the default group), every
    other group is a communicator of its own (split from the world's without sharing its buffers, NCCL's
    default)."""
    found = {c["dim"] for c in collectives if c["dim"] != "world" and len(group_ranks.get(c["dim"], [0, 1])) > 1}
    world = len(group_ranks.get("world", [0]))
    if world > 1 and not any(len(group_ranks.get(d, ())) == world for d in found):
        found.add("world")
    return sorted(found)


def nccl_bytes(comms: list[str], group_ranks: dict[str, list[int]], gpu: Gpu, gpus_per_node: int) -> int:
    """NCCL's buffers on this rank: ``NCCL_PER_COMMUNICATOR`` for each communicator, and on a GPU with NVLS the NVLS
    buffers of each communicator whose group has more than one GPU in this rank's NVLink domain (its node; the rack
    of an NVL72: NCCL uses NVLS across the domain once multi-node NVLink is on)."""
    total = 0
    for dim in comms:
        ranks = group_ranks.get(dim, [])
        same_domain = sum(1 for r in ranks if domain_of(r, gpus_per_node, gpu) == 0)  # rank 0's domain
        total += NCCL_PER_COMMUNICATOR + (NCCL_NVLS_PER_COMMUNICATOR if gpu.nvls and same_domain > 1 else 0)
    return total


def _tp_local_shape(weight) -> list[int]:
    """A weight's shape on one tensor-parallel rank once FSDP2 has all-gathered it (its "tp" shard only)."""
    shape = list(weight.shape)
    mesh = getattr(weight, "device_mesh", None)
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    for i, (name, placement) in enumerate(zip(names, getattr(weight, "placements", ()))):
        if name == "tp" and placement.is_shard():
            shape[placement.dim] //= mesh.size(i)
    return shape


def fp8_operand_copies(model, tokens: int) -> int:
    """Upper bound of a transient the tracker cannot see in torchao's FP8 matmul: the FP8 (one byte) copies of
    both operands of the largest FP8 linear (``tokens`` x its in + out features on one tensor-parallel rank), e.g.
    transposes made inside the tensor subclass's own dispatch, which the dispatch mode does not enter."""
    largest = 0
    for m in model.modules():
        if type(m).__name__ == "Float8Linear":
            out_f, in_f = _tp_local_shape(m.weight)
            largest = max(largest, tokens * (in_f + out_f))
    return largest


SOURCES = {
    "context": "outside PyTorch's allocator (not in max_memory_reserved) but within the memory it sees (the GPU's "
               "row: the driver's own reserve is not counted there); its size depends on the driver, the CUDA version "
               "and lazy module loading (CUDA C++ Programming Guide, Lazy Loading); 1 GiB assumed",
    "nccl": "per communicator, allocated by NCCL outside PyTorch's allocator: buffers per channel, peer connection and "
            "protocol (SIMPLE's NCCL_BUFFSIZE, 4 MiB by default, LL, LL128); it grows with the channels NCCL opens for "
            "the link's bandwidth. Reported: 544 MB (2 GPUs) and 688 MB (4) per group on 4 x A100 NVLink "
            "(NVIDIA/nccl#964), about 1.6 GB for one communicator (NVIDIA/nccl#864). 640 MiB per communicator, and on "
            "NVSwitch nodes (H100, H200, B200, B300) 288 MiB more for the NVLS buffers of a group with 2+ GPUs of the "
            "node, or of the NVLink domain on GB200 / GB300 NVL72 (288 MiB "
            "per rank on 8 x H200: vllm-project/vllm#9699; NCCL_NVLS_ENABLE=0 saves it: "
            "NVIDIA/NeMo-Framework-Launcher#127)",
    "cublas": "allocated through PyTorch's allocator by the GEMM library, not by an op the tracker sees; PyTorch "
              "sizes it per cuBLAS handle and stream (the environment variable CUBLAS_WORKSPACE_CONFIG overrides it); "
              "the GPU visit's memory probe measures it; 32 MiB assumed",
    "fp8": "the dispatch mode does not enter a tensor subclass's own dispatch: one-byte copies of both operands of the "
           "largest FP8 linear (tokens x (in + out features)), an upper bound",
    "compile": "estimated eager; compiled blocks fuse elementwise ops and usually need less activation memory "
               "(torchtitan's published Llama 3.1 8B peak: 82.4 GiB eager, 77.0 GiB compiled), plus Inductor's own "
               "buffers",
}


def gpu_terms(collectives: list[dict], group_ranks: dict[str, list[int]], fp8_copies: int, compiled: bool,
              gpu: Gpu, gpus_per_node: int) -> list[Term]:
    """The terms of rank 0 of a job of ``gpus_per_node`` GPUs per node (``group_ranks``: its groups' ranks)."""
    comms = communicators(collectives, group_ranks)
    terms = [
        Term("CUDA context", CONTEXT_BYTES, SOURCES["context"]),
        Term(f"NCCL buffers ({', '.join(comms) or 'no communicator'})",
             nccl_bytes(comms, group_ranks, gpu, gpus_per_node), SOURCES["nccl"]),
        Term("cuBLAS workspace", CUBLAS_WORKSPACE, SOURCES["cublas"]),
    ]
    if fp8_copies:
        terms.append(Term("FP8 matmul operand copies inside torchao's tensor subclass (upper bound)", fp8_copies,
                          SOURCES["fp8"], any_implementation=False))
    if compiled:
        terms.append(Term("torch.compile", 0, SOURCES["compile"], added=False, any_implementation=False))
    return terms


HELD_BY_ANY = ("Sharded Param", "Sharded Grad", "OptState")
"""What every implementation of the same shapes holds as the optimizer step starts (the tracker's kinds)."""


def floor(at_optimizer: dict[str, int], terms: list[Term]) -> int:
    """Bytes a GPU holds whatever the model implementation saves for backward: the sharded parameters, gradients
    and AdamW states as the optimizer step starts (every implementation of these shapes has the same parameters;
    the TE model's FP8 primary weights add FP32 masters) and the terms that do not depend on the implementation.
    Through a stand-in the activations are an approximation; this part is not."""
    return sum(at_optimizer.get(k, 0) for k in HELD_BY_ANY) + sum(
        t.bytes for t in terms if t.added and t.any_implementation)


def terms_table_markdown() -> str:
    """docs/estimate.md's table of the terms (generated: reference.py), from the same sizes and sources."""
    rows = [("CUDA context", f"{CONTEXT_BYTES / GIB:g} GiB", "context"),
            ("NCCL buffers", f"{NCCL_PER_COMMUNICATOR / MIB:g} MiB per communicator (each mesh dimension with "
                             f"collectives, and the world's), {NCCL_NVLS_PER_COMMUNICATOR / MIB:g} MiB more with NVLS",
             "nccl"),
            ("cuBLAS workspace", f"{CUBLAS_WORKSPACE / MIB:g} MiB", "cublas"),
            ("FP8 matmul operand copies (torchao)", "tokens x (in + out) bytes of the largest FP8 linear", "fp8"),
            ("torch.compile (`--compile 1`)", "not added: stated", "compile")]
    out = ["| term | size | source | status |", "|---|---|---|---|"]
    out += [f"| {name} | {size} | {SOURCES[key]} | to calibrate |" for name, size, key in rows]
    out.append(f"| allocator margin (on top: the verdict's margin) | {ALLOCATOR_MARGIN:.0%} of the tracked peak | "
               f"{MARGIN_WHY.split(': ', 1)[1].split(', to calibrate. ', 1)[1]} | to calibrate |")
    return "\n".join(out)


@dataclass(frozen=True)
class Verdict:
    status: str  # fits | tight | does not fit
    needed: int  # tracked peak + the added terms
    margin: int  # the allocator margin on top
    memory: int  # the GPU's
    text: str

    def to_dict(self) -> dict:
        return asdict(self)


MARGIN_WHY = (f"allocator margin: {ALLOCATOR_MARGIN:.0%} of the tracked peak, to calibrate. PyTorch's caching "
              "allocator reserves more than it hands out (blocks rounded to 512 B, 2 MiB and larger segments, "
              "fragmentation; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True reduces it), and an out-of-memory "
              "error is about reserved memory, not allocated. Published peaks, reserved over allocated: 1.27 "
              "(meta-llama/llama-cookbook#41: 19.36 over 15.22 GB, FSDP on 4 x A100), 1.12-1.17 for torchtitan's "
              "H100 tables (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md) over this estimate's "
              "needed memory of the same programs (tests/estimate/published.py)")


def size_text(b: float) -> str:
    """GiB with one decimal, or MiB below one GiB (a small run's margin is not "0.0 GiB")."""
    return f"{b / GIB:.1f} GiB" if abs(b) >= GIB else f"{b / MIB:.1f} MiB"


def verdict(tracked: int, terms: list[Term], gpu: Gpu) -> Verdict:
    needed = tracked + sum(t.bytes for t in terms if t.added)
    margin = int(ALLOCATOR_MARGIN * tracked)
    mem = gpu.memory_bytes
    gib = size_text
    if needed + margin <= mem:
        status, text = "fits", (f"fits: {gib(needed)} + {gib(margin)} margin of {gib(mem)} ({gpu.name}), "
                                f"{gib(mem - needed - margin)} to spare")
    elif needed <= mem:
        status, text = "tight", (f"tight: {gib(needed)} fits {gib(mem)} ({gpu.name}) but not with the "
                                 f"{gib(margin)} margin: it may run out of memory from fragmentation")
    else:
        status, text = "does not fit", (f"does not fit: {gib(needed)} needed, {gib(mem)} on {gpu.name} "
                                        f"({gib(needed - mem)} over, before the {gib(margin)} margin)")
    return Verdict(status, needed, margin, mem, text)
