"""The corpus flags through the real `train` command (one rank, in-process): --data_blend's tokens per source in
metrics.jsonl, --skip_samples logged and kept in the checkpoint, --doc_masking through the built model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import train_records
from llama_fp8 import config as C
from llama_fp8 import train as T
from llama_fp8.checkpoint.files import read_rank_state
from llama_fp8.data.indexed import IndexedWriter


def corpus(folder, low: int, n_docs: int) -> str:
    """A Megatron-format corpus of ``n_docs`` documents of random tokens in [low, low + 50)."""
    folder.mkdir()
    rng = np.random.default_rng(low)
    lengths = rng.integers(5, 40, n_docs)
    writer = IndexedWriter(folder / "part", np.dtype(np.uint16))
    writer.add(rng.integers(low, low + 50, int(lengths.sum())), lengths)
    writer.finish()
    return str(folder)


@pytest.mark.slow
def test_a_run_reads_a_blend_skips_samples_and_masks_documents(tmp_path, capsys):
    web, code = corpus(tmp_path / "web", 0, 400), corpus(tmp_path / "code", 60, 400)
    run = tmp_path / "run"
    args = ["--model", "tiny", "--device", "cpu", "--num_layers", "2", "--max_context_width", "32",
            "--vocab_size", "128", "--train_batch_size", "5", "--max_steps", "4", "--checkpoint_freq", "4",
            "--data_blend", f"0.6:{web},0.4:{code}", "--skip_samples", "5:10", "--doc_masking", "1",
            "--num_workers", "1", "--run_dir", str(run)]
    capsys.readouterr()
    assert T.run(C.parse_args(args)) == 0
    err = capsys.readouterr().err
    assert "--skip_samples: global samples 5..9 are left out" in err  # at start-up
    assert "--skip_samples: left out global samples 5..9 (5 samples)" in err  # when the run passes them
    recs = train_records(run)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and all(np.isfinite(r["loss"]) for r in recs)
    # 4 steps x 5 samples read from positions 0-4 and 10-24; the blend's pattern 0.6/0.4 gives 3:2 in every 5
    assert recs[-1]["data_tokens"] == {web: 12 * 32, code: 8 * 32}
    assert recs[0]["data_tokens"] == {web: 3 * 32, code: 2 * 32}
    state = read_rank_state(run / "checkpoints" / "step_4" / "rank0.safetensors")["loader"]
    assert state["kind"] == "corpus" and state["position"] == 25 and state["skip_samples"] == [[5, 10]]
    assert state["settings"]["data_blend"][0][0] == 0.6
    config = json.loads(json.dumps(C.parse_args(args).to_dict()))
    assert config["doc_masking"] is True
