"""The torch 2.14 tier (`make test-torch214`): every test it names exists, so a renamed or moved test fails
here, in `make test`, rather than as an empty or broken tier; and CI runs it."""

from __future__ import annotations

import re

from helpers import REPO


def tier_tests() -> list[str]:
    text = (REPO / "Makefile").read_text()
    block = re.search(r"^TORCH214_TESTS \?= \\\n((?:\t.*\\\n)*\t.*\n)", text, flags=re.M)
    assert block, "Makefile lost TORCH214_TESTS"
    return [t.strip().strip("'") for t in block.group(1).replace("\\\n", " ").split()]


def test_every_test_the_tier_names_exists():
    tests = tier_tests()
    assert len(tests) >= 10
    for node in tests:
        path, _, name = node.partition("::")
        source = (REPO / path).read_text()
        if name:
            function = name.split("[")[0]
            assert re.search(rf"^def {function}\(", source, flags=re.M), f"{node}: no such test"
            if "[" in name:  # a parametrized id must be one of the ids the test declares
                assert re.search(rf"ids=\[[^\]]*\"{name.split('[')[1].rstrip(']')}\"", source), node


def test_the_tier_covers_fsdp_dcp_tensor_parallel_torchao_and_compile():
    tests = " ".join(tier_tests())
    for needed in ("fsdp", "test_resume_reshards_between_layouts", "tensor_parallel", "test_precision.py",
                   "compile", "test_damaged_checkpoints.py", "test_hostile_files.py",
                   # the FP8 all-gather check wraps FSDP2's private foreach_all_gather: a torch upgrade may move it
                   "test_fp8_check.py::test_a_silent_bf16_all_gather"):
        assert needed in tests, needed


def test_ci_runs_the_tier():
    assert re.search(r"^tier \"make test-torch214\" make test-torch214$", (REPO / ".ci/run").read_text(), flags=re.M)
