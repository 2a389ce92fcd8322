"""--profile_steps / --profile_ranks / --memory_snapshot: the trace a CPU run writes (it exists, covers the
asked steps and names our phases and modules), which ranks write one, and the CUDA memory snapshot's calls."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

from helpers import run_cli
from llama_fp8 import config as C
from llama_fp8 import train as T
from llama_fp8.telemetry import profiling


def names(trace: Path) -> list[str]:
    return [e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]]


def test_profile_steps_writes_a_trace_of_those_steps_naming_our_modules(tiny_args):
    cfg = C.parse_args([*tiny_args, "--max_steps", "4", "--profile_steps", "2:3"])
    assert T.run(cfg) == 0
    traces = list((Path(cfg.run_dir) / "profile").glob("*.json"))
    assert [t.name for t in traces] == ["trace_rank0_steps2-3.json"]
    events = names(traces[0])
    assert events.count("llama_fp8/optimizer") == 2  # steps 2 and 3, not 1 or 4
    assert events.count("llama_fp8/forward") == 2 and events.count("llama_fp8/backward") == 2
    assert "nn.Module: FSDPLlamaDecoderLayer_1" in events and "nn.Module: LlamaAttention_0" in events  # by name
    assert any(n.startswith("aten::mm") or n.startswith("aten::addmm") for n in events)  # and the kernels


@pytest.mark.slow
def test_profile_ranks_picks_the_ranks_that_write(tmp_path):
    r = run_cli(["train", "--model", "tiny", "--device", "cpu", "--num_layers", "1", "--max_context_width", "16",
                 "--max_steps", "2", "--profile_steps", "1:1", "--profile_ranks", "1", "--run_dir",
                 str(tmp_path / "r")], nproc=2, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "r" / "profile").iterdir()) == ["trace_rank1_steps1-1.json"]


@pytest.mark.parametrize("flags, message", [
    (["--profile_steps", "5:3"], r"--profile_steps 5:3: need 1 <= A <= B <= --max_steps 20"),
    (["--profile_steps", "3:30"], r"need 1 <= A <= B <= --max_steps 20"),
    (["--profile_steps", "three"], r"--profile_steps 'three' is not valid; valid: A:B"),
    (["--profile_steps", "1:2", "--profile_ranks", "first"], r"--profile_ranks 'first' is not valid"),
])
def test_bad_profile_flags_name_the_flag(flags, message):
    with pytest.raises(C.ConfigError, match=message):
        C.parse_args(["--model", "tiny", *flags])
    assert profiling.parse_ranks("all") is None and profiling.parse_ranks("0,4") == {0, 4}


def test_memory_snapshot_needs_cuda(tiny_args, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the snapshot runs for real")
    assert T.run(C.parse_args([*tiny_args, "--memory_snapshot", "1"])) == 2
    assert "--memory_snapshot 1 records CUDA memory history and needs CUDA" in capsys.readouterr().err


def test_memory_snapshot_records_history_and_dumps_at_the_end_and_on_oom(tmp_path, monkeypatch):
    """The calls PyTorch's memory visualizer needs, with the CUDA functions replaced by recorders."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", Path(path).name)))
    cfg = types.SimpleNamespace(profile_steps=None, profile_ranks="0", memory_snapshot=True, max_steps=3)
    prof = profiling.Profiler(cfg, tmp_path, rank=3, device=torch.device("cpu"))
    prof.dump_snapshot("oom")
    prof.close()
    assert calls == [("record", {"max_entries": profiling.SNAPSHOT_ENTRIES}), ("dump", "memory_rank3_oom.pickle"),
                     ("dump", "memory_rank3_end.pickle"), ("record", {"enabled": None})]
