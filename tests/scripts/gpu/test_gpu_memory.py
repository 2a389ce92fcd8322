"""The first visit's memory units on CPU: the nvidia-smi sampler (a fake nvidia-smi on PATH), memprobe.py's
terms from its stages and its answer without CUDA, the estimate unit (a fake estimate's JSON set against the
cell's measured memory: each difference the record states), and the results page's memory and headline sections."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import memory
import memprobe
import pytest
import results
import runs
import sections as visit_sections
import units
import verify
from test_gpu_steps import KEY, context, fake_program

GIB, MIB = 2**30, 2**20


def fake_smi(tmp_path: Path, used: list[int], total: int = 81559) -> Path:
    """An nvidia-smi that answers a query once with used[0], and with -lms prints used[1:] then waits."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "nvidia-smi"
    exe.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys, time
        used = {used!r}
        if "-lms" not in sys.argv:
            print(f"{{used[0]}}, {total}")
            sys.exit(0)
        for u in used[1:]:
            print(f"{{u}}, {total}", flush=True)
        print("812", flush=True)  # a line cut off by the kill
        time.sleep(60)
        """))
    exe.chmod(0o755)
    return bin_dir


def test_the_sampler_keeps_the_reading_before_and_the_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_smi(tmp_path, [600, 900, 70000, 65000])}{os.pathsep}{os.environ['PATH']}")
    with memory.SmiSampler(tmp_path / "smi.csv", period_ms=100) as smi:
        for _ in range(100):  # until the fake has printed its lines
            if len(memory.parse((tmp_path / "smi.csv").read_text())) >= 3:
                break
            import time
            time.sleep(0.05)
    assert smi.fields() == {"smi_used_idle_mib": 600, "smi_used_peak_mib": 70000, "smi_total_mib": 81559,
                            "smi_samples": 4}  # the cut line "812" has no total but is a reading
    assert smi.proc.poll() is not None  # stopped with the command


def test_without_nvidia_smi_the_fields_are_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with memory.SmiSampler(tmp_path / "smi.csv") as smi:
        pass
    assert smi.fields() == {"smi_used_idle_mib": None, "smi_used_peak_mib": None, "smi_total_mib": None,
                            "smi_samples": 0}


def test_memprobe_terms_are_the_differences_of_its_stages():
    def stage(name, used, reserved, **extra):
        return {"stage": name, "device_used": used * MIB, "reserved": reserved * MIB, "allocated": 0, **extra}

    stages = [{"stage": "before CUDA", "smi_used_mib": 500}, stage("context", 1000, 2),
              stage("cublas", 1200, 130, workspace_in_allocator=32 * MIB), stage("te", 1500, 300),
              stage("nccl", 1700, 300)]
    assert memprobe.terms(stages) == {"context_and_driver": 998 * MIB, "cublas_workspace": 32 * MIB,
                                      "cublas_code_outside": 72 * MIB, "te_outside": 130 * MIB,
                                      "nccl_one_rank_outside": 200 * MIB}
    skipped = stages[:3] + [{"stage": "te", "skipped": "no TE"}, stage("nccl", 1300, 130)]
    assert memprobe.terms(skipped)["nccl_one_rank_outside"] == 100 * MIB  # against the last stage measured


@pytest.mark.slow
def test_memprobe_without_cuda_says_so_and_the_unit_is_skipped(tmp_path):
    proc = subprocess.run([sys.executable, str(Path(memprobe.__file__))], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1])["cuda"] is False
    rec = memory.run_memory(context(tmp_path), units.Unit("memory/terms", "memory", 30, 120))
    assert rec["status"] == "skipped" and "no CUDA" in rec["message"]
    probe = {"cuda": True, "stages": [], "terms": {"context_and_driver": 5}}
    fake = fake_program(tmp_path, f"print('log line'); print({json.dumps(json.dumps(probe))})\n")
    rec = memory.run_memory(context(tmp_path, fake), units.Unit("memory/terms", "memory", 30, 120))
    assert rec["status"] == "passed" and rec["probe"]["terms"] == {"context_and_driver": 5}


def estimate_json(tracked: int, needed: int, margin: int, status: str = "fits") -> dict:
    return {"peak_bytes": tracked, "peak_by_kind": {"Activation": 1}, "model_impl": "hf", "stand_in": "TE via HF",
            "precision": "bf16", "seconds": 30.0,
            "terms": [{"name": "CUDA context and driver reserve", "bytes": GIB, "added": True},
                      {"name": "torch.compile", "bytes": 0, "added": False}],
            "verdict": {"status": status, "needed": needed, "margin": margin, "memory": 80 * GIB}}


def test_the_estimate_unit_sets_the_estimate_against_the_cells_runs(tmp_path):
    """The estimate's tracked peak against the largest max_memory_allocated of the cell's runs on this GPU (both
    pairs), the allocator's reserve against the margin, nvidia-smi's peak outside the allocator."""
    est = estimate_json(20 * GIB, 21 * GIB, GIB)
    fake = fake_program(tmp_path, f"print('[estimate] progress', file=sys.stderr)\nprint({json.dumps(json.dumps(est))})\n")
    ctx = context(tmp_path, fake)
    [bf16] = [u for u in units.first_plan() if u.id == "estimate/llama3.2-1b/synthetic/te-bf16"]
    for unit, alloc, smi in (("train/llama3.2-1b/synthetic/te-bf16", 21.0, 25000),
                             ("train/llama3.2-1b/synthetic/te-bf16/pair2", 20.5, 26000),
                             ("train/llama3.2-1b/synthetic/te-fp8-current", 30.0, 40000)):  # another cell: not used
        ctx.store.append({"key": KEY, "gpu": ctx.gpu, "unit": unit, "kind": "train", "status": "passed",
                          "mem_peak_gib": alloc, "mem_reserved_peak_gib": 22.0, "smi_used_peak_mib": smi,
                          "smi_used_idle_mib": 500, "alloc_retries": 0})
    rec = memory.run_estimate(ctx, bf16)
    assert rec["status"] == "passed", rec
    assert rec["estimate"]["tracked_peak"] == 20 * GIB and rec["estimate"]["terms"] == {
        "CUDA context and driver reserve": GIB}
    assert rec["measured"]["runs"] == ["train/llama3.2-1b/synthetic/te-bf16", "train/llama3.2-1b/synthetic/te-bf16/pair2"]
    assert rec["measured"]["max_allocated"] == 21 * GIB and rec["measured"]["smi_used_peak"] == 26000 * MIB
    assert rec["against"] == {"allocated_minus_tracked": GIB, "allocated_vs_tracked_pct": 5.0,
                              "reserved_minus_allocated": GIB, "margin_claimed": GIB,
                              "outside_allocator": 26000 * MIB - 22 * GIB,
                              "device_peak_minus_claim": 26000 * MIB - 22 * GIB}
    argv = shlex_split(rec["command"])
    assert argv[argv.index("--gpu") + 1] == "H100" and argv[argv.index("--device") + 1] == "cuda"
    assert argv[argv.index("--model_impl") + 1] == "te" and "--json" in argv


def shlex_split(command: str) -> list[str]:
    import shlex

    return shlex.split(command)


def test_an_estimate_that_does_not_fit_is_recorded_and_a_refused_one_fails(tmp_path):
    unit = next(u for u in units.first_plan() if u.step == "estimate")
    est = estimate_json(90 * GIB, 91 * GIB, 4 * GIB, "does not fit")
    ctx = context(tmp_path, fake_program(tmp_path, f"print({json.dumps(json.dumps(est))}); sys.exit(4)\n"))
    rec = memory.run_estimate(ctx, unit)
    assert rec["status"] == "passed" and rec["estimate"]["verdict"] == "does not fit" and rec["measured"] is None
    ctx = context(tmp_path, fake_program(tmp_path, "print('llama-fp8 estimate: error: --gpu X', file=sys.stderr)\n"
                                                   "sys.exit(2)\n"))
    rec = memory.run_estimate(ctx, unit)
    assert rec["status"] == "failed" and "--gpu X" in rec["message"]


def test_the_estimates_gpu_is_the_nodes():
    assert memory.estimate_gpu("NVIDIA H200") == "H200"
    assert memory.estimate_gpu("NVIDIA H100 80GB HBM3") == "H100"
    assert memory.estimate_gpu("no GPU") == "H100"
    assert memory.estimate_gpu("NVIDIA GB200") == "GB200" and memory.estimate_gpu("NVIDIA B200") == "B200"


# --- the results page ----------------------------------------------------------------------------------------
def headline_records() -> list[dict]:
    recs = []
    for unit in units.first_plan()[:4]:
        fp8, pair = unit.info["fp8"], unit.info["pair"]
        rate = (3.0 if fp8 else 2.0) * (1.1 if pair == 2 else 1.0)  # pair 2 both faster: the ratio stays 1.5
        recs.append({"key": KEY, "gpu": "NVIDIA H100 80GB HBM3", "unit": unit.id, "kind": "train", "status": "passed",
                     **unit.info, "samples_per_sec": rate, "tokens_per_sec_per_device": rate * 4096,
                     "mfu_vs_bf16_peak": 0.4, "mem_peak_gib": 21.0, "last_loss": 10.5, "last_step": 40,
                     "num_params": 1.24e9, "seq_len": 4096, "global_batch_size": 2,
                     "losses": [[5, 11.9], [40, 10.5 if not fp8 else 10.52]],
                     "fp8_check": {"fp8_linears": 112, "linears": 113, "fp8_flop_share": 0.9, "problems": [],
                                   "gemm_kernel_names": 9, "fp8_gemm_kernels": 6} if fp8 else None})
    return recs


def test_the_headline_section_states_each_pair_and_the_geometric_mean(tmp_path):
    latest = results.latest(headline_records())
    point, n = visit_sections.headline_speedup(latest)
    assert n == 2 and abs(point - 1.5) < 1e-12
    page = "\n".join(visit_sections.headline_section(latest))
    assert "TE FP8 / TE BF16 samples/s: 1.500x** (geometric mean over 2 pairs)" in page
    assert "| 2 | te-fp8-current | 3.300 |" in page and "112/113 linears in FP8, 90.0 % of linear FLOPs; 6 of 9" in page
    assert "| 40 | 10.5000 | 10.5200 | 10.5000 | 10.5200 |" in page  # the loss over the first steps, per pair
    assert visit_sections.headline_section({}) == ["Not measured."]


def test_the_memory_section_shows_the_terms_and_each_estimate_against_its_runs():
    probe = {"key": KEY, "gpu": "g", "unit": "memory/terms", "kind": "memory", "status": "passed",
             "probe": {"terms": {"context_and_driver": 600 * MIB, "cublas_workspace": 32 * MIB}}}
    est = {"key": KEY, "gpu": "g", "unit": "estimate/llama3.2-1b/synthetic/te-bf16", "kind": "estimate",
           "status": "passed", "variant": "te-bf16",
           "estimate": {"tracked_peak": 20 * GIB, "needed": 21 * GIB, "margin": GIB, "verdict": "fits"},
           "measured": {"max_allocated": 21 * GIB, "max_reserved": 22 * GIB, "smi_used_peak": 23 * GIB},
           "against": {"allocated_minus_tracked": GIB, "allocated_vs_tracked_pct": 5.0,
                       "reserved_minus_allocated": GIB, "outside_allocator": GIB}}
    latest = results.latest([probe, est])
    page = "\n".join(visit_sections.memory_section(latest))
    assert "| context and driver | 600 MiB |" in page and "| cublas workspace | 32 MiB |" in page
    assert ("| te-bf16 | 20.00 GiB | 22.00 GiB | fits | 21.00 GiB | 1.00 GiB (+5.0 %) | 22.00 GiB | 1.00 GiB | "
            "23.00 GiB | 1.00 GiB |") in page
    assert visit_sections.memory_section({}) == ["Not measured."]


def test_the_headlines_later_pairs_stay_out_of_the_matrix_tables():
    page = "\n".join(visit_sections.train_section(results.latest(headline_records())))
    assert page.count("| te-bf16 |") == 1 and page.count("| te-fp8-current |") == 1


def test_verify_runs_the_memory_steps():
    assert verify.RUNNERS["memory"] is memory.run_memory and verify.RUNNERS["estimate"] is memory.run_estimate
    assert runs.MEASURED >= {"memory", "estimate"}


def test_the_logs_archive_brings_back_the_samples(tmp_path):
    import tarfile

    work = tmp_path / "work"
    (work / "logs").mkdir(parents=True)
    (work / "logs" / "train_x.log").write_text("log")
    (work / "logs" / "train_x.smi.csv").write_text("600, 81559\n")
    verify.bundle_logs(work, tmp_path / "out")
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["logs/train_x.log", "logs/train_x.smi.csv"]
