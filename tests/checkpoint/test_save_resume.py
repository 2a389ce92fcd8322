"""Checkpoints and faults with real runs: exact resume, other world size, interrupted saves, keep_last_k,
SIGUSR1 -> save + requeue code, SIGKILL of a rank, NaN guard, HF export and import."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import (
    REPO,
    build_meta,
    cli_env,
    local_text_flags,
    read_metrics,
    run_cli,
    train_records,
    wait_for,
    worker_pids,
)
from llama_fp8 import checkpoint as K
from llama_fp8 import config as C
from llama_fp8 import train as T
from llama_fp8.config import EXIT_NONFINITE, EXIT_REQUEUE

BASE = ["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32",
        "--train_batch_size", "2", "--logging_freq", "1", "--lr_decay_iters", "8", "--seed", "3"]


def run(run_dir: Path, *args: str) -> int:
    return T.run(C.parse_args([*BASE, "--run_dir", str(run_dir), *args]))


def losses_by_step(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in train_records(run_dir)}


@pytest.mark.slow
@pytest.mark.parametrize("async_save", ["0", "1"])
def test_resume_reproduces_the_uninterrupted_run_bitwise(tmp_path, async_save, monkeypatch):
    assert run(tmp_path / "a", "--max_steps", "8") == 0
    b = tmp_path / "b"
    calls, real_async_save = [], K.dcp.async_save
    monkeypatch.setattr(K.dcp, "async_save", lambda *a, **kw: (calls.append(1), real_async_save(*a, **kw))[1])
    assert run(b, "--max_steps", "4", "--checkpoint_freq", "4", "--async_checkpoint", async_save) == 0
    assert len(calls) == (1 if async_save == "1" else 0)  # --async_checkpoint picks DCP's background save
    assert [s for s, _ in K.complete_checkpoints(b / "checkpoints")] == [4]
    assert run(b, "--max_steps", "8", "--checkpoint_freq", "4", "--async_checkpoint", async_save) == 0
    full, resumed = losses_by_step(tmp_path / "a"), losses_by_step(b)
    # Bitwise on CPU: same weights, optimizer moments, LR step and data position; same kernels.
    assert [resumed[s] for s in range(5, 9)] == [full[s] for s in range(5, 9)]
    metas = [r for r in read_metrics(b) if r["type"] == "meta"]
    assert [m["start_step"] for m in metas] == [0, 4]
    assert (b / "config.resume_step_4.yaml").is_file()


@pytest.fixture
def text_data(tmp_path, monkeypatch) -> list[str]:
    pytest.importorskip("datasets")
    return local_text_flags(tmp_path, monkeypatch)


@pytest.mark.slow
def test_resume_on_local_text_with_workers_reproduces_the_uninterrupted_run_bitwise(tmp_path, text_data):
    data = [*text_data, "--num_workers", "2"]
    assert run(tmp_path / "a", *data, "--max_steps", "7") == 0
    b = tmp_path / "b"
    # Step 3 is odd: with 2 workers serving batches round-robin, the resume starts mid-cycle.
    assert run(b, *data, "--max_steps", "3", "--checkpoint_freq", "3") == 0
    assert [s for s, _ in K.complete_checkpoints(b / "checkpoints")] == [3]
    loader = K.read_rank_file(b / "checkpoints" / "step_3", 0)["loader"]
    assert loader["kind"] == "packed" and loader["consumed"] == 3 and len(loader["workers"]) == 2
    assert run(b, *data, "--max_steps", "7", "--checkpoint_freq", "3") == 0
    full, resumed = losses_by_step(tmp_path / "a"), losses_by_step(b)
    assert [resumed[s] for s in range(4, 8)] == [full[s] for s in range(4, 8)]
    assert [m["start_step"] for m in read_metrics(b) if m["type"] == "meta"] == [0, 3]


@pytest.mark.slow
def test_resume_with_other_data_settings_is_refused_and_the_checkpoint_kept(tmp_path, text_data, capsys):
    b = tmp_path / "b"
    assert run(b, *text_data, "--max_steps", "2", "--checkpoint_freq", "2") == 0
    capsys.readouterr()
    for flag, value, saved in (("--max_context_width", "16", "32"), ("--seed", "4", "3"),
                               ("--num_workers", "2", "1")):
        assert run(b, *text_data, "--max_steps", "4", "--checkpoint_freq", "2", flag, value) == C.EXIT_BAD_CONFIG
        err = capsys.readouterr().err
        assert f"cannot resume from {b / 'checkpoints' / 'step_2'}" in err, err
        assert f"saved with {flag}={saved}" in err and f"this run has {value}" in err.replace(f"{flag}=", ""), err
    assert [s for s, _ in K.complete_checkpoints(b / "checkpoints")] == [2]
    assert len(train_records(b)) == 2  # nothing appended by the refused attempts
    # Another batch size is fine: the saved position holds whole T+1 blocks, batched by the new B.
    assert run(b, *text_data, "--max_steps", "4", "--checkpoint_freq", "2", "--train_batch_size", "3") == 0
    assert [r["step"] for r in train_records(b)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_fp8_and_bf16_runs_read_the_same_tokens_and_compare_checks_it(tmp_path, text_data):
    pytest.importorskip("torchao")
    from llama_fp8.report import compare

    common = [*text_data, "--max_steps", "4", "--num_workers", "1"]
    # each run a process of its own, as on a cluster: its data-loader worker is forked from a training process, not
    # from a test process that hundreds of earlier tests loaded libraries into (a worker forked from one such
    # process once died of a segmentation fault at its first batch)
    for name, extra in (("bf16", ["--fp8", "0"]), ("fp8", ["--fp8", "1"]), ("other_seed", ["--seed", "4"])):
        proc = run_cli(["train", *BASE, "--run_dir", str(tmp_path / name), *common, *extra])
        assert proc.returncode == 0, proc.stderr[-3000:]

    def prints(name: str) -> list[tuple[int, int, str]]:
        return [(r["data_from_step"], r["step"], r["data_crc32"]) for r in train_records(tmp_path / name)]

    assert prints("bf16") == prints("fp8") and [p[:2] for p in prints("bf16")] == [(s, s) for s in range(1, 5)]
    assert all(a[2] != b[2] for a, b in zip(prints("bf16"), prints("other_seed"))), "another seed, other batches"
    same = compare.compare(compare.build_parser().parse_args(
        [str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--out", str(tmp_path / "r1"), "--loss_tolerance", "100"]))
    assert same["data"] == {"windows_compared": 4, "same": True, "first_different_step": None}
    assert same["verdict"] == "PASS" and "Same training data: yes" in (tmp_path / "r1" / "report.md").read_text()
    other = compare.compare(compare.build_parser().parse_args(
        [str(tmp_path / "bf16"), str(tmp_path / "other_seed"), "--out", str(tmp_path / "r2"),
         "--loss_tolerance", "100"]))
    assert other["data"]["same"] is False and other["data"]["first_different_step"] == 1
    assert other["verdict"] == "FAIL" and "trained on different data" in other["verdict_line"]


def test_interrupted_save_is_ignored_and_previous_stays_loadable(tmp_path):
    b = tmp_path / "b"
    assert run(b, "--max_steps", "4", "--checkpoint_freq", "2") == 0
    ck = b / "checkpoints"
    half = ck / "step_6.tmp"             # a save killed half-way: partial files, no marker
    shutil.copytree(ck / "step_4", half)
    (half / K.MARKER).unlink()
    (half / "__0_0.distcp").write_bytes(b"trunc")
    unmarked = ck / "step_8"             # even a final name without the marker is not trusted
    shutil.copytree(half, unmarked)
    assert K.find_resume("auto", ck) == ck / "step_4"
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        K.find_resume(str(unmarked), ck)
    assert run(b, "--max_steps", "6", "--checkpoint_freq", "2") == 0
    assert [r for r in read_metrics(b) if r["type"] == "meta"][-1]["start_step"] == 4
    assert not half.exists()             # the next save cleaned the interrupted one up
    assert [s for s, _ in K.complete_checkpoints(ck)] == [4, 6]   # keep_last_k 2 (step_8 is not complete)


@pytest.mark.slow
def test_keep_last_k_and_resume_none(tmp_path):
    b = tmp_path / "b"
    assert run(b, "--max_steps", "5", "--checkpoint_freq", "1", "--keep_last_k", "2") == 0
    assert [s for s, _ in K.complete_checkpoints(b / "checkpoints")] == [4, 5]
    # An explicit step folder resumes from there; `none` refuses to write over the existing metrics.
    assert run(b, "--max_steps", "6", "--resume_from_checkpoint", str(b / "checkpoints" / "step_4")) == 0
    assert [r for r in read_metrics(b) if r["type"] == "meta"][-1]["start_step"] == 4
    assert run(b, "--max_steps", "6", "--resume_from_checkpoint", "none") == 2


def test_nan_stops_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_FP8_FAULT_NAN_AT_STEP", "5")
    b = tmp_path / "b"
    assert run(b, "--max_steps", "8", "--checkpoint_freq", "2") == EXIT_NONFINITE
    assert "non-finite loss or gradient norm at step 5" in capsys.readouterr().err
    assert [s for s, _ in K.complete_checkpoints(b / "checkpoints")] == [2, 4]
    assert not list((b / "checkpoints").glob("step_6*"))
    state = K.read_rank_file(b / "checkpoints" / "step_4", 0)
    assert state["loader"]["step"] == 4


def test_nan_skip_policy_skips_and_counts(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_FP8_FAULT_NAN_AT_STEP", "3")
    assert run(tmp_path / "s", "--max_steps", "5", "--nan_policy", "skip") == 0
    losses = losses_by_step(tmp_path / "s")
    assert losses[3] != losses[3] and all(losses[s] == losses[s] for s in (4, 5))  # NaN only at step 3
    assert run(tmp_path / "t", "--max_steps", "5", "--nan_policy", "skip", "--max_nan_skips", "0") == EXIT_NONFINITE


@pytest.mark.slow
def test_hf_export_gives_the_trained_models_logits(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from llama_fp8 import models

    b = tmp_path / "b"
    assert run(b, "--max_steps", "3", "--checkpoint_freq", "3") == 0
    r = run_cli(["convert", str(b / "checkpoints"), str(tmp_path / "hf"), "--dtype", "fp32"], timeout=180)
    assert r.returncode == 0, r.stderr
    umask = os.umask(0)
    os.umask(umask)  # what convert inherits: its files are readable as any file the user makes (not 0600)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "hf").iterdir()} == {
        p.name: 0o666 & ~umask for p in (tmp_path / "hf").iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32)
    # The reference: the raw DCP state, read by torch's own converter, in an independently built model.
    dcp_to_torch_save(str(b / "checkpoints" / "step_3"), str(tmp_path / "raw.pt"))
    raw = torch.load(tmp_path / "raw.pt", weights_only=False)["model"]
    cfg = C.parse_args([*BASE])
    ref = build_meta(cfg).to_empty(device="cpu")
    ref.load_state_dict(raw)
    models.get("hf").reset_buffers(ref, torch.device("cpu"))
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, ref(input_ids=ids).logits)
    again = run_cli(["convert", str(b / "checkpoints"), str(tmp_path / "hf")], timeout=180)
    assert again.returncode == 2 and "is not empty" in again.stderr   # nothing overwritten
    shard = b / "checkpoints" / "step_3" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit would export wrong weights without a word
    shard.write_bytes(bytes(data))
    damaged = run_cli(["convert", str(b / "checkpoints"), str(tmp_path / "hf2")], timeout=180)
    assert damaged.returncode == 2 and f"{shard}: checksum" in damaged.stderr, damaged.stderr[-2000:]


def make_hf_checkpoint(path: Path, **shape) -> dict[str, torch.Tensor]:
    from transformers import LlamaForCausalLM

    from llama_fp8.models.common import hf_config

    cfg = C.parse_args([*BASE, *[f"--{k}={v}" for k, v in shape.items()]])
    torch.manual_seed(11)
    hf = LlamaForCausalLM(hf_config(cfg))
    hf.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")  # several shards
    return {k: v.clone() for k, v in hf.state_dict().items()}


def test_init_from_hf_loads_every_weight(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    want = make_hf_checkpoint(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    b = tmp_path / "b"
    assert run(b, "--max_steps", "1", "--lr", "0", "--min_lr", "0", "--weight_decay", "0", "--checkpoint_freq", "1",
               "--init_from_hf", str(tmp_path / "hf")) == 0
    dcp_to_torch_save(str(b / "checkpoints" / "step_1"), str(tmp_path / "raw.pt"))
    got = torch.load(tmp_path / "raw.pt", weights_only=False)["model"]
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_init_from_hf_shape_mismatch_names_the_tensor(tmp_path, capsys):
    make_hf_checkpoint(tmp_path / "hf", intermediate_size=384)
    assert run(tmp_path / "b", "--max_steps", "1", "--init_from_hf", str(tmp_path / "hf")) == 2
    import re

    err = capsys.readouterr().err
    assert re.search(r"mlp\.(gate|up|down)_proj\.weight has shape \((384, 128|128, 384)\), the model expects", err), err


# --- real processes ----------------------------------------------------------------------------------
def spawn(args: list[str], nproc: int) -> subprocess.Popen:
    # `llama-fp8 launch` is torchrun that keeps the workers' exit code (85 survives), as the sbatch uses it.
    cmd = [sys.executable, "-m", "llama_fp8", "launch", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "llama_fp8", "train", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=REPO)


@pytest.mark.slow
def test_sigusr1_to_one_rank_saves_and_exits_with_the_requeue_code(tmp_path):
    b = tmp_path / "b"
    p = spawn([*BASE, "--run_dir", str(b), "--max_steps", "10000", "--lr_decay_iters", "10000"], 2)
    try:
        wait_for(lambda: (b / "metrics.jsonl").is_file() and len(train_records(b)) >= 2, 240, "two logged steps")
        pids = worker_pids(p.pid)
        assert set(pids) == {0, 1}, pids
        os.kill(pids[1], signal.SIGUSR1)      # only one rank hears it: both must stop at the same step
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == EXIT_REQUEUE, err[-3000:]
    (step, path), = K.complete_checkpoints(b / "checkpoints")
    assert step == train_records(b)[-1]["step"] and sorted(x.name for x in path.glob("rank*")) == \
        ["rank0.safetensors", "rank1.safetensors"]
    (good,) = [m for m in read_metrics(b) if m["type"] == "goodput"]  # a planned stop: not a failure's restart
    assert good["ended"] == "signal" and good["saves"] >= 1, good
    r = run_cli(["train", *BASE, "--run_dir", str(b), "--max_steps", str(step + 2)], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["start_step"] for m in read_metrics(b) if m["type"] == "meta"] == [0, step]


@pytest.mark.slow
def test_sigkill_of_one_rank_fails_fast_and_the_rerun_resumes(tmp_path):
    b = tmp_path / "b"
    p = spawn([*BASE, "--run_dir", str(b), "--max_steps", "10000", "--lr_decay_iters", "10000",
               "--checkpoint_freq", "2", "--process_group_timeout", "30"], 2)
    try:
        wait_for(lambda: len(K.complete_checkpoints(b / "checkpoints")) >= 1, 240, "a complete checkpoint")
        os.kill(worker_pids(p.pid)[1], signal.SIGKILL)
        t0 = time.time()
        p.communicate(timeout=90)
        elapsed = time.time() - t0
    finally:
        p.kill()
    assert p.returncode != 0 and elapsed < 90
    last = K.complete_checkpoints(b / "checkpoints")[-1][0]
    r = run_cli(["train", *BASE, "--run_dir", str(b), "--max_steps", str(last + 1), "--checkpoint_freq", "2"],
                nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["start_step"] for m in read_metrics(b) if m["type"] == "meta"][-1] == last


@pytest.mark.slow
def test_resume_with_a_different_world_size(tmp_path):
    """Saved by 2 ranks x batch 2, resumed by 1 rank x batch 4: same global batch, same samples."""
    full = tmp_path / "full"
    assert run_cli(["train", *BASE, "--run_dir", str(full), "--max_steps", "8"], nproc=2).returncode == 0
    b = tmp_path / "b"
    r = run_cli(["train", *BASE, "--run_dir", str(b), "--max_steps", "4", "--checkpoint_freq", "4"], nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli(["train", *BASE, "--run_dir", str(b), "--max_steps", "8", "--train_batch_size", "4"], nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    a, c = losses_by_step(full), losses_by_step(b)
    # BF16 compute, different reduction order between 2 shards and 1: relative tolerance 2e-3.
    assert [c[s] for s in range(5, 9)] == pytest.approx([a[s] for s in range(5, 9)], rel=2e-3)
    assert json.loads((b / "checkpoints" / "step_4" / "train_state.json").read_text())["world_size"] == 2


def test_checkpoint_dir_flag_puts_checkpoints_there(tmp_path):
    b, ck = tmp_path / "b", tmp_path / "shared" / "ckpts"
    assert run(b, "--max_steps", "2", "--checkpoint_freq", "2", "--checkpoint_dir", str(ck)) == 0
    assert [s for s, _ in K.complete_checkpoints(ck)] == [2] and not (b / "checkpoints").exists()
    assert C.load_yaml(str(b / "config.yaml"))["checkpoint_dir"] == str(ck)


def test_process_group_timeout_reaches_the_process_group(monkeypatch):
    import datetime

    import torch.distributed as dist

    from llama_fp8 import parallel

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: seen.update(kw))
    parallel.init_distributed(C.parse_args([*BASE, "--process_group_timeout", "42"]))
    assert seen["timeout"] == datetime.timedelta(seconds=42)


# --- safe formats, fault hooks, side groups ------------------------------------------------------------
def test_per_rank_state_round_trips_exactly_without_pickles(tmp_path):
    import random

    import numpy as np

    from llama_fp8.checkpoint import checkpointer, files

    state = {"loader": {"version": 1, "kind": "packed", "consumed": 7, "settings": {"seed": 3, "data_files": None},
                        "workers": [None, {"remainder": torch.arange(5, dtype=torch.int32), "offset": 0,
                                           "pending": torch.empty((0, 33), dtype=torch.int32),
                                           "reader": {"epoch": 1, "hf": {"shard": [0, 2], "done": False, "x": 0.1}}}]},
             "rng": checkpointer._rng_state()}
    files.write_rank_state(tmp_path / "rank0.safetensors", state)
    assert b"\x80\x04" not in (tmp_path / "rank0.safetensors").read_bytes()[:64]  # not a pickle
    back = files.read_rank_state(tmp_path / "rank0.safetensors")
    w = back["loader"]["workers"][1]
    assert back["loader"]["workers"][0] is None and back["loader"]["settings"] == {"seed": 3, "data_files": None}
    assert torch.equal(w["remainder"], state["loader"]["workers"][1]["remainder"]) and w["pending"].shape == (0, 33)
    assert w["reader"] == {"epoch": 1, "hf": {"shard": [0, 2], "done": False, "x": 0.1}}
    assert isinstance(back["rng"]["python"], tuple) and back["rng"]["python"] == random.getstate()
    assert back["rng"]["numpy"][1].dtype == np.uint32 and np.array_equal(back["rng"]["numpy"][1],
                                                                         np.random.get_state()[1])
    expect = torch.rand(3), random.random(), np.random.rand()
    checkpointer._set_rng_state(back["rng"])  # the RNG streams continue exactly as if never saved
    assert (torch.equal(torch.rand(3), expect[0]), random.random(), np.random.rand()) == (True, *expect[1:])
    with pytest.raises(TypeError, match="no safe file format"):
        files.write_rank_state(tmp_path / "x.safetensors", {"loader": object()})


def test_legacy_rank_file_loads_but_a_pickled_callable_is_refused(tmp_path):
    import numpy as np

    from llama_fp8.checkpoint import files

    good = {"loader": {"kind": "synthetic", "step": 3}, "rng": {"numpy": np.random.get_state()}}
    torch.save(good, tmp_path / "rank0.pt")
    assert files.read_legacy_rank_state(tmp_path / "rank0.pt")["loader"] == {"kind": "synthetic", "step": 3}
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    torch.save({"loader": Payload(), "rng": {}}, tmp_path / "rank1.pt")
    with pytest.raises(K.UnsafeCheckpointFile, match=r"rank1.pt: refused: .*posix.system"):
        files.read_legacy_rank_state(tmp_path / "rank1.pt")
    assert not marker.exists()


def test_dcp_metadata_is_read_with_an_allow_list(tmp_path):
    import pickle

    from llama_fp8.checkpoint import dcp_read

    b = tmp_path / "b"
    assert run(b, "--max_steps", "1", "--checkpoint_freq", "1") == 0
    step = b / "checkpoints" / "step_1"
    with open(step / ".metadata", "rb") as f:
        want = pickle.load(f)  # our own file, read the unsafe way once for the comparison
    got = dcp_read.read_dcp_metadata(step)
    assert got.state_dict_metadata == want.state_dict_metadata and got.storage_data == want.storage_data
    marker = tmp_path / "ran"
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / ".metadata").write_bytes(
        b"cposix\nsystem\n(" + f"Vtouch {marker}\n".encode() + b"tR.")  # protocol 0: posix.system("touch ...")
    with pytest.raises(K.UnsafeCheckpointFile, match="global posix.system is not allowed"):
        dcp_read.read_dcp_metadata(tmp_path / "evil")
    assert not marker.exists()


class _ByName:
    """Pickles as ``getattr(target, name)``: how Python 3.11.2 (Debian 12's) pickles an enum member."""

    def __init__(self, target, name):
        self.target, self.name = target, name

    def __reduce__(self):
        return getattr, (self.target, self.name)


def test_dcp_metadata_with_enum_members_pickled_by_name_is_read(tmp_path):
    """Python 3.11.2 (Debian 12's; not 3.11.7 nor 3.12) pickles an enum member as ``builtins.getattr(cls, name)``:
    DCP metadata written there holds its memory-format enum that way, and the allow-list refused every
    checkpoint's read-back (found running the image on a Debian-based base under Pyxis). ``getattr`` is taken for
    exactly that, an enum member of an allowed class by its name, and refused for anything else."""
    import enum
    import io
    import pathlib
    import pickle

    from torch.distributed.checkpoint.metadata import (
        _MEM_FORMAT_ENCODING,
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from llama_fp8.checkpoint import dcp_read

    class Python3112Pickler(pickle.Pickler):
        def reducer_override(self, obj):
            return (getattr, (type(obj), obj.name)) if isinstance(obj, enum.Enum) else NotImplemented

    def write(folder: str, obj) -> pathlib.Path:
        buf = io.BytesIO()
        Python3112Pickler(buf, protocol=4).dump(obj)
        (tmp_path / folder).mkdir()
        (tmp_path / folder / ".metadata").write_bytes(buf.getvalue())
        return tmp_path / folder

    chunk = ChunkStorageMetadata(torch.Size([0]), torch.Size([2]))
    meta = Metadata(state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16),
                                                                      torch.Size([2]), [chunk])}, storage_data={})
    folder = write("by-name", meta)
    assert b"getattr" in (folder / ".metadata").read_bytes()
    got = dcp_read.read_dcp_metadata(folder)
    assert got.state_dict_metadata == meta.state_dict_metadata
    assert got.state_dict_metadata["w"].properties.memory_format == torch.contiguous_format
    for i, (target, name) in enumerate([(pathlib.PosixPath, "unlink"), (_MEM_FORMAT_ENCODING, "__class__"),
                                        (_MEM_FORMAT_ENCODING, "_missing_"), (_MEM_FORMAT_ENCODING, 0)]):
        with pytest.raises(K.UnsafeCheckpointFile, match="getattr"):
            dcp_read.read_dcp_metadata(write(f"bad{i}", [_ByName(target, name)]))


def test_fault_specs_are_checked_and_inert_when_unset(monkeypatch):
    from llama_fp8 import faults

    assert faults.parse_faults("kill@save.pruning:step=4:rank=0;sleep@step:seconds=0.5:once") == [
        faults.Fault("kill", "save.pruning", step=4, rank=0), faults.Fault("sleep", "step", seconds=0.5, once=True)]
    for bad in ("kil@step", "kill@stpe", "kill@step:steps=3"):
        with pytest.raises(ValueError, match="LLAMA_FP8_FAULT"):
            faults.parse_faults(bad)
    monkeypatch.delenv("LLAMA_FP8_FAULT", raising=False)
    faults.at("save.pruning", 4)  # nothing happens
    monkeypatch.setenv("LLAMA_FP8_FAULT", "sleep@step:step=2:seconds=0.3")
    t0 = time.monotonic()
    faults.at("step", 1)
    assert time.monotonic() - t0 < 0.2
    faults.at("step", 2)
    assert time.monotonic() - t0 >= 0.3


def test_side_groups_use_the_process_group_timeout_and_async_saves_get_their_own(tmp_path, monkeypatch):
    """The signal check's and the checkpointer's gloo groups wait --process_group_timeout, not torch's
    30-minute default for new groups; DCP's async save runs on the checkpointer's group, never on the
    group the training's collectives use (which may also be NCCL-only, without the CPU backend it needs)."""
    import datetime

    import torch.distributed as dist

    from llama_fp8 import faults, parallel

    parallel.init_distributed(C.parse_args([*BASE, "--device", "cpu", "--process_group_timeout", "42"]))
    try:
        def timeout(group) -> datetime.timedelta:
            return group._get_backend(torch.device("cpu")).options._timeout

        watch = faults.SignalWatch(2)  # as with two ranks: a group of its own
        watch.close()
        ck = K.Checkpointer(tmp_path / "ck", 1, True, 0, 1)
        assert timeout(watch._group) == timeout(ck._pg) == datetime.timedelta(seconds=42)
        assert ck._pg is not dist.group.WORLD
    finally:
        parallel.destroy_distributed()


def test_signal_after_a_stop_cannot_kill_the_exiting_process():
    from llama_fp8 import faults

    before, before_term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    watch = faults.SignalWatch(1)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watch.requested()
        watch.close()  # a second SIGUSR1 or Slurm's SIGTERM now must not end the process before it exits 85
        assert signal.getsignal(signal.SIGUSR1) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, before)
        signal.signal(signal.SIGTERM, before_term)
    mine = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGUSR1, mine)
    try:
        quiet = faults.SignalWatch(1)
        quiet.close()  # no signal: the previous handlers come back
        assert signal.getsignal(signal.SIGUSR1) is mine and signal.getsignal(signal.SIGTERM) == before_term
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_late_time_limit_warning_cannot_kill_a_finished_run():
    """Slurm's USR1 (--signal=USR1@120) landing after the last step, while the run tears down: nothing is left to
    save, and USR1's default action (terminate) would turn a completed run into a signal death (a FAILED job;
    CI saw srun report "task 0: User defined signal 1" after training had returned). A real process checks it."""
    code = ("import os, signal\nfrom llama_fp8 import faults\nw = faults.SignalWatch(1)\nw.close()\n"
            "os.kill(os.getpid(), signal.SIGUSR1)\nprint('alive', signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert (r.returncode, r.stdout.strip()) == (0, "alive True"), (r.returncode, r.stderr[-2000:])


def test_collective_timeout_gets_one_line_naming_the_flag():
    from llama_fp8 import faults

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out "
                        "waiting 20000ms for send operation to complete")
    msg = faults.collective_timeout_message(gloo, 20.0)
    assert msg.startswith("a collective did not complete within --process_group_timeout=20 s") and "20000ms" in msg
    nccl = RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)")
    assert "--process_group_timeout=600 s" in faults.collective_timeout_message(nccl, 600.0)
    assert faults.collective_timeout_message(RuntimeError("CUDA out of memory"), 600.0) is None
