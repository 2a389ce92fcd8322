"""The estimate against the GPU's own counters (`pytest -m gpu`; skipped without CUDA). Not run on a GPU yet.

One process on one GPU runs the configuration for real through the estimate's own measurement (the training
build, a warm-up step, one tracked step; the tracker there sees CUDA tensors, rounded to 512 B blocks), with
``torch.cuda.reset_peak_memory_stats()`` just before the tracked step; the estimate runs the same configuration
on the CPU with fake tensors. Stated and checked:

- the tracker on the GPU sees what the fake run sees (within the allocator's 512 B rounding per tensor);
- ``torch.cuda.max_memory_allocated()`` of the step is at least the estimate's tracked peak, and the gap is what
  the estimate's allocator-side terms (cuBLAS workspace, FP8 operand copies) claim to cover, within 5 % of the peak;
- ``torch.cuda.max_memory_reserved()`` stays below the tracked peak + those terms + the allocator margin (the
  verdict's assumption);
- the CUDA context (total - free - reserved after the step; the total as PyTorch sees it, without the driver's own
  reserve) is within 2x of its term;
- the GPU's memory as PyTorch sees it is its row's in estimate/gpus.py (within 0.15 GiB: drivers differ), when the
  GPU is one of the table's;
- with 2 GPUs, the memory one NCCL communicator takes outside the allocator after a step's collectives is within
  what is published for one communicator (tests/estimate/published.py: 544 MB for 2 A100s with NVLink to about
  1.6 GB, and 288 MiB more for NVLS buffers where the GPU's row has NVLS), the range the 640 MiB term was chosen
  from; the least is not checked on a GPU outside estimate/gpus.py's table, all NVLink parts (NCCL opens fewer
  channels, hence fewer buffers, over PCIe). Skipped with one GPU.

Each number is printed (``-s`` shows it) and goes into the assertion message when one fails: these are the
"to calibrate" terms' first measurement.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SHAPE = ["--model", "llama3.2-1b", "--num_layers", "2", "--max_context_width", "2048", "--train_batch_size", "2",
         "--model_impl", "hf"]


def gpu_run(args: list[str]) -> dict:
    """The real step on this GPU, as rank 0 of 1, with the CUDA allocator's peaks of the tracked step."""
    from llama_fp8 import config, parallel
    from llama_fp8.estimate import run

    seen: dict = {}

    class CudaPeaks(run.StepTracker):
        def __enter__(self):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            torch.cuda.synchronize()
            seen.update(allocated=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved())
            free, total = torch.cuda.mem_get_info()
            seen["outside_allocator"] = total - free - torch.cuda.memory_reserved()

    cfg = config.parse_args([*args, "--device", "cuda"])
    env = parallel.init_distributed(cfg)
    original = run.StepTracker
    run.StepTracker = CudaPeaks
    try:
        m = run.measure(cfg, env, fake_run=False)
    finally:
        run.StepTracker = original
        parallel.destroy_distributed()
    return {"tracked": m.peak_bytes, **seen}


@pytest.mark.parametrize("variant", [[], ["--fp8", "1"], ["--activation_checkpointing", "full"]],
                         ids=["bf16", "fp8", "ac-full"])
def test_estimate_against_max_memory_allocated_and_reserved(variant):
    from llama_fp8 import config
    from llama_fp8.estimate import assess, terms
    from llama_fp8.estimate.flags import EstimateOptions

    args = SHAPE + variant
    est = assess.estimate(config.parse_args(args), EstimateOptions(nodes=1, gpus_per_node=1))
    real = gpu_run(args)
    allocator_terms = sum(t.bytes for t in est.terms if t.added and ("cuBLAS" in t.name or "FP8" in t.name))
    tracked = est.measurement.peak_bytes
    numbers = (f"estimate tracked {tracked}, GPU tracker {real['tracked']}, max allocated {real['allocated']} "
               f"(gap {real['allocated'] - tracked:+d}, allocator-side terms {allocator_terms}), max reserved "
               f"{real['reserved']} (estimate + terms + margin {tracked + allocator_terms + est.verdict.margin}), "
               f"outside the allocator {real['outside_allocator']} (term {terms.CONTEXT_BYTES})")
    print(numbers)
    assert abs(real["tracked"] - tracked) <= 0.01 * tracked, numbers
    assert real["allocated"] >= tracked, numbers
    assert abs(real["allocated"] - tracked - allocator_terms) <= 0.05 * tracked, numbers
    assert real["reserved"] <= tracked + allocator_terms + est.verdict.margin, numbers
    assert terms.CONTEXT_BYTES / 2 <= real["outside_allocator"] <= 2 * terms.CONTEXT_BYTES, numbers



def test_the_gpus_memory_as_pytorch_sees_it_is_its_rows():
    from llama_fp8.estimate import gpus

    props = torch.cuda.get_device_properties(0)
    name = gpus.for_device(props.name)  # the row of this device name (H100, ..., B200, GB200)
    row = gpus.GPUS[name] if name else None
    if row is None:
        pytest.skip(f"{props.name} is not a GPU of estimate/gpus.py")
    print(f"{props.name}: total_memory {props.total_memory} bytes, the row's {row.memory_bytes}")
    assert abs(props.total_memory - row.memory_bytes) <= 0.15 * 2**30, (props.name, props.total_memory)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: a communicator between two ranks")
def test_one_nccl_communicator_against_its_term(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from published import NCCL_COMMUNICATOR_LEAST, NCCL_COMMUNICATOR_MOST, NCCL_NVLS_MOST, NCCL_SOURCES

    from llama_fp8.estimate import gpus, terms

    out = tmp_path / "nccl.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(Path(__file__).with_name("nccl_worker.py")), str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(out.read_text())
    row = gpus.GPUS.get(gpus.for_device(torch.cuda.get_device_name(0)) or "")
    least = NCCL_COMMUNICATOR_LEAST if row else 0
    most = NCCL_COMMUNICATOR_MOST + (NCCL_NVLS_MOST if row is None or row.nvls else 0)
    numbers = (f"NCCL {d['nccl']}: one communicator of 2 ranks, outside the allocator: {d['bytes_per_rank']} bytes "
               f"per rank (term {terms.NCCL_PER_COMMUNICATOR}; published {least} to {most}: {NCCL_SOURCES})")
    print(numbers)
    for used in d["bytes_per_rank"]:
        assert least <= used <= most, numbers
