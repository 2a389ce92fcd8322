"""Resuming with changed settings (1 rank, in-process): what cannot load stops before the model is built,
naming the flag; what can (precision, world size, LR) resumes and is checked by value."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from faultkit import RUN, SMALL, complete, losses, run1, run2, starts

from helpers import REPO, local_text_flags, train_records
from llama_fp8 import config as C
from llama_fp8.data import tokenize
from llama_fp8.train.build import lr_at


@pytest.fixture
def saved(tmp_path):
    """A run stopped after step 4 (checkpoints step_2, step_4)."""
    b = tmp_path / "b"
    assert run1(b, [*SMALL, "--max_steps", "4", "--checkpoint_freq", "2"]) == 0
    return b


def refused(b, capsys, extra: list[str]) -> str:
    capsys.readouterr()
    assert run1(b, [*RUN, *extra]) == 2
    err = capsys.readouterr().err
    assert "M parameters" not in err, "the model was built before the refusal"
    assert complete(b) == [2, 4] and len(train_records(b)) == 4  # nothing changed, nothing appended
    return next(ln for ln in err.splitlines() if "cannot resume from" in ln)


CHANGES = {"num_layers": ["--num_layers", "3"], "hidden_width": ["--hidden_width", "64"],
           "optimizer": ["--optimizer", "adamw8bit"], "dataset": None}


@pytest.mark.parametrize("flag", list(CHANGES))
@pytest.mark.slow
def test_resume_with_changed_model_shape_stops(saved, tmp_path, monkeypatch, capsys, row, flag):
    if flag == "optimizer":
        pytest.importorskip("torchao")
    extra = CHANGES[flag] or local_text_flags(tmp_path, monkeypatch)[:4]  # --dataset, --tokenizer
    line = refused(saved, capsys, extra)
    assert f"saved with --{flag}=" in line and f"this run has --{flag}=" in line, line
    assert line.count("saved with") == 1, line  # only the flag that changed
    row(f"exit 2 before building: \"...{line.split('it does not fit this run: ')[1].split('. Resume')[0]}\"",
        None)


def test_resume_with_another_model_implementation_stops(saved, capsys, row, registry):
    spec = importlib.util.spec_from_file_location("toy_impl", REPO / "tests" / "models" / "toy_impl.py")
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    registry.register(toy.ToyImpl())  # a third implementation, as a user would add one
    line = refused(saved, capsys, ["--model_impl", "toy"])
    assert "saved with model implementation 'hf', this run resolves --model_impl to 'toy'" in line, line
    row("exit 2 before building: \"saved with model implementation 'hf', this run resolves --model_impl to 'toy'\"",
        None)


PRECISION = {"fp8": ["--fp8", "1"], "fp8 rowwise": ["--fp8", "1", "--fp8_recipe", "rowwise"],
             "fp8 all-gather": ["--fp8", "1", "--fp8_all_gather", "1"], "fp32": ["--bf16", "0"]}


@pytest.mark.parametrize("change", list(PRECISION))
@pytest.mark.slow
def test_resume_with_changed_precision_works(saved, ref1, capsys, row, change):
    if "fp8" in change:
        pytest.importorskip("torchao")
    capsys.readouterr()
    assert run1(saved, [*RUN, *PRECISION[change]]) == 0
    err = capsys.readouterr().err
    assert starts(saved)[-1] == 4 and "resuming a bf16 checkpoint as" in err
    got = losses(saved)
    # The saved weights were loaded: the next losses are the BF16 run's within FP8/FP32 noise (a model that
    # restarted from its initialization would be back at ln(4096) = 8.3, 15 % higher).
    rel = [abs(got[s] - ref1.losses[s]) / ref1.losses[s] for s in (5, 6)]
    assert max(rel) < 0.02, (got, ref1.losses)
    row(f"resumed from step_4; losses of steps 5-6 within {100 * max(rel):.2f} % of the BF16 run", 0)


@pytest.mark.slow
def test_resume_with_changed_world_size_works(ref2, tmp_path, capsys, row):
    b = tmp_path / "b"
    shutil.copytree(ref2.run_dir, b)
    shutil.rmtree(b / "checkpoints" / "step_6")
    capsys.readouterr()
    assert run1(b, [*RUN, "--train_batch_size", "4"]) == 0  # 1 rank x 4 = 2 ranks x 2
    assert starts(b)[-1] == 4
    got = losses(b)
    # BF16 compute and another reduction order (1 shard instead of 2): relative tolerance 2e-3.
    assert [got[s] for s in (5, 6)] == pytest.approx([ref2.losses[s] for s in (5, 6)], rel=2e-3)
    saved = json.loads((b / "checkpoints" / "step_4" / "train_state.json").read_text())["world_size"]
    assert saved == 2
    rel = max(abs(got[s] - ref2.losses[s]) / ref2.losses[s] for s in (5, 6))
    row(f"2-rank step_4 resumed on 1 rank; losses of steps 5-6 within {rel:.1e} of the 2-rank run", 0)


@pytest.mark.slow  # three training runs, two of them multi-process
def test_resume_of_a_tokenized_corpus_at_another_world_size_reads_on_exactly(tmp_path, monkeypatch, row):
    text = local_text_flags(tmp_path, monkeypatch)  # --dataset TEXT --tokenizer TOK --vocab_size 320
    corpus = tmp_path / "corpus"
    assert tokenize.main(["--dataset", text[1], "--tokenizer", text[3], "--out", str(corpus)]) == 0
    flags = [*RUN, "--dataset", str(corpus), *text[4:]]
    a = tmp_path / "a"
    r = run2(a, [*flags, "--train_batch_size", "3"])  # 2 ranks x 3: a global batch of 6 samples
    assert r.rc == 0, r.err[-3000:]
    want = {rec["step"]: rec for rec in train_records(a)}
    observed = []
    for nproc, bsz in ((1, 6), (3, 2)):
        b = tmp_path / f"on{nproc}"
        shutil.copytree(a, b)
        shutil.rmtree(b / "checkpoints" / "step_6")
        (b / "metrics.jsonl").write_text("")
        if nproc == 1:
            assert run1(b, [*flags, "--train_batch_size", str(bsz)]) == 0
        else:
            r = run2(b, [*flags, "--train_batch_size", str(bsz)], nproc=nproc)
            assert r.rc == 0, r.err[-3000:]
        got = {rec["step"]: rec for rec in train_records(b)}
        assert starts(b) == [4] and sorted(got) == [5, 6]
        # exactly the samples the uninterrupted run read (every rank's tokens), and the same training
        assert [got[s]["data_crc32"] for s in (5, 6)] == [want[s]["data_crc32"] for s in (5, 6)], nproc
        assert [got[s]["data_tokens"] for s in (5, 6)] == [want[s]["data_tokens"] for s in (5, 6)]
        assert [got[s]["loss"] for s in (5, 6)] == pytest.approx([want[s]["loss"] for s in (5, 6)], rel=2e-3)
        rel = max(abs(got[s]["loss"] - want[s]["loss"]) / want[s]["loss"] for s in (5, 6))
        observed.append(f"{nproc} rank{'s' if nproc > 1 else ''} x {bsz}: losses within {rel:.1e}")
    crcs = ", ".join(want[s]["data_crc32"] for s in (5, 6))
    row(f"2 x 3 step_4 resumed on 1 x 6 and on 3 x 2: data_crc32 of steps 5-6 ({crcs}) equal to the uninterrupted "
        f"run's on both; {'; '.join(observed)}", 0)


@pytest.mark.slow
def test_resume_with_changed_lr_applies_the_new_schedule(saved, row):
    assert run1(saved, [*RUN, "--lr", "0.0015", "--min_lr", "0.0001"]) == 0
    cfg = C.parse_args([*RUN, "--lr", "0.0015", "--min_lr", "0.0001"])
    logged = {r["step"]: r["lr"] for r in train_records(saved)}
    # Step s (1-based) trains with the LR of schedule index s - 1.
    assert [logged[s] for s in (5, 6)] == pytest.approx([lr_at(s - 1, cfg) for s in (5, 6)], rel=1e-6)
    row(f"LR of step 5: {logged[5]:.6f} = the new schedule's (was {lr_at(4, C.parse_args(RUN)):.6f})", 0)
