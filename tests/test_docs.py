"""The docs state what the code does and a reader can find them: their tables (flags, FP8 recipes, GPU peaks, the
estimate's terms) are generated from the code and current; the README is a landing page that links every docs
page; every relative link resolves; each command's --help names the page that explains it."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from helpers import REPO
from llama_fp8 import reference
from llama_fp8.__main__ import COMMANDS, MODULES

README_MAX_LINES = 200
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# The page each command's --help names, and a phrase that page must hold about that command.
HELP_PAGES = {
    "train": ("docs/flags.md", "llama-fp8 train --help"),
    "tokenize": ("docs/data.md", "python -m llama_fp8 tokenize --dataset /fsx/raw"),
    "estimate": ("docs/estimate.md", "llama_fp8 estimate --model"),
    "compare": ("docs/report.md", "python -m llama_fp8 compare RUN_A RUN_B"),
    "launch": ("docs/reliability.md", "runs one `llama-fp8 launch` per node"),
    "submit": ("docs/cluster.md", "python -m llama_fp8 submit --nodes"),
    "convert": ("docs/checkpoints.md", "python -m llama_fp8 convert CKPT_DIR OUT_DIR"),
    "preflight": ("docs/cluster.md", "python -m llama_fp8 preflight -- --model"),
    "fp8-bisect": ("docs/fp8.md", "python -m llama_fp8 fp8-bisect --config"),
    "publish": ("docs/metrics.md", "llama-fp8 publish REPORT_DIR"),
}


def pages(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (a link or heading there is not one)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``_`` and ``-`` kept), spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), re.M):
        base = slug(heading)
        name, n = base, 0
        while name in found:  # a repeated heading gets -1, -2, ...
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def broken_links(repo: Path) -> list[str]:
    """``page: link`` for every relative link of README.md and docs/*.md whose file or anchor does not exist."""
    bad = []
    for page in pages(repo):
        for target in LINK.findall(prose(page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or not file.resolve().is_relative_to(repo.resolve()):
                bad.append(f"{page.relative_to(repo)}: {target} (no such file in the repository)")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text())):
                bad.append(f"{page.relative_to(repo)}: {target} (no such heading)")
    return bad


def test_generated_tables_are_current():
    assert reference.stale(REPO) == [], "run: python scripts/update_docs.py"


def test_every_table_has_a_page_that_must_hold_it():
    assert sorted(t for names in reference.PAGES.values() for t in names) == sorted(reference.tables())
    assert all((REPO / rel).is_file() for rel in reference.PAGES)


def test_a_stale_table_and_a_lost_table_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    for rel, names in reference.PAGES.items():
        blocks = "".join(f"<!-- {n}:start -->\n<!-- {n}:end -->\n" for n in names)
        (tmp_path / rel).write_text(reference.render("# page\n" + blocks))
    assert reference.stale(tmp_path) == []
    fp8 = tmp_path / "docs" / "fp8.md"
    fp8.write_text(fp8.read_text().replace("| `tensorwise`", "| `old`"))
    (tmp_path / "docs" / "flags.md").write_text("# flags\nthe table was deleted\n")
    assert reference.stale(tmp_path) == ["docs/flags.md: flags (no markers)", "docs/flags.md: presets (no markers)",
                                         "docs/fp8.md: recipes"]


def test_readme_shows_the_two_commands_first():
    text = (REPO / "README.md").read_text()
    first_block = text.split("```")[1]
    assert "make demo" in first_block and "make test" in first_block


def test_readme_is_a_landing_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move a section to docs/"
    headings = [ln for ln in lines if ln.startswith("## ")]
    assert "## Read next" in headings and "## On a Slurm cluster, in five steps" in headings


def test_the_cluster_quickstart_has_its_five_steps():
    text = (REPO / "README.md").read_text()
    block = text.split("## On a Slurm cluster, in five steps", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    steps = re.findall(r"^# (\d)\. ", block, re.M)
    assert steps == ["1", "2", "3", "4", "5"]
    for needed in ("scripts/build_image.sh", "enroot import", "preflight", "sbatch 1.train_llama.sbatch",
                   "2.ab_fp8_vs_bf16.sh"):
        assert needed in block, needed


def test_every_docs_page_is_linked_from_the_readme():
    targets = set(LINK.findall(prose((REPO / "README.md").read_text())))
    unlinked = [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"docs/{p.name}" not in targets]
    assert not unlinked, f"add to README.md's Read next table: {unlinked}"


def test_every_relative_link_resolves():
    assert broken_links(REPO) == []


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("[ok](docs/a.md#the-title) [gone](docs/b.md) [web](https://x.y/z)\n"
                                        "`[code](docs/c.md)`\n```\n[block](docs/d.md)\n```\n")
    (tmp_path / "docs" / "a.md").write_text("# The title\n[up](../README.md) [bad](#nothing-here)\n"
                                            "[out](../../elsewhere.md)\n## The title\n[twice](#the-title-1)\n")
    assert broken_links(tmp_path) == ["README.md: docs/b.md (no such file in the repository)",
                                      "docs/a.md: #nothing-here (no such heading)",
                                      "docs/a.md: ../../elsewhere.md (no such file in the repository)"]


def test_slugs_are_githubs():
    assert slug("Will it fit? `llama_fp8 estimate`") == "will-it-fit-llama_fp8-estimate"
    assert slug("Image versions (NGC, EFA)") == "image-versions-ngc-efa"
    assert slug("Crashes, hangs and lost nodes inside the allocation") == \
        "crashes-hangs-and-lost-nodes-inside-the-allocation"


def help_text(command: str, capsys, monkeypatch) -> str:
    """``llama-fp8 COMMAND --help`` as printed, in-process."""
    # launch sets this default for torchrun before parsing: keep it out of the other tests' environment
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        code = importlib.import_module(MODULES[command]).main(["--help"])
    except SystemExit as stopped:  # argparse's exit after printing the help
        code = stopped.code
    assert code in (0, None), f"{command} --help exited with {code}"
    return capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_commands_help_names_the_page_that_explains_it(command, capsys, monkeypatch):
    page, phrase = HELP_PAGES[command]
    named = re.findall(r"docs/[\w-]+\.md", help_text(command, capsys, monkeypatch))
    assert named == [page], f"{command} --help names {named}, expected {page}"
    text = " ".join((REPO / page).read_text().split())
    assert phrase in text, f"{page} does not explain {command}: {phrase!r} not in it"


def test_the_architecture_page_draws_the_layer_order_the_test_enforces():
    from test_architecture import LAYERS

    text = (REPO / "docs" / "architecture.md").read_text()
    drawing = text.split("## Layers", 1)[1].split("```", 2)[1]
    floors = [re.split(r"\s{6,}", line.strip(), maxsplit=1)[0].split() for line in drawing.splitlines()
              if line.strip()]
    drawn = [{room.rstrip("/").removesuffix(".py") for room in floor} for floor in reversed(floors)]
    assert drawn == [set(layer) for layer in LAYERS], "docs/architecture.md's drawing is not LAYERS"
    rows = re.findall(r"^\| `([\w./]+)` \|", text.split("## Rooms and their jobs", 1)[1], re.M)
    missing = [room for layer in LAYERS for room in layer
               if not any(r.split("/")[0].removesuffix(".py") == room for r in rows)]
    assert not missing, f"docs/architecture.md's rooms table lacks {missing}"


# --- facts the docs state once, as the code and the tests have them ------------------------------------------------
def test_te_delayed_scalings_state_is_said_to_resume_as_fp8_md_and_the_code_have_it():
    """reliability.md said TE's delayed-scaling history is not in checkpoints; fp8.md's "What resumes exactly" and the
    code (models/te/fp8/state.py) restore it in place."""
    for page in ("docs/reliability.md", "tests/reliability/decisions.md"):
        text = (REPO / page).read_text()
        assert "not in checkpoints" not in text and "fp8.md#what-resumes-exactly" in text, page
    assert "| `delayed` | per module: scale and amax history" in (REPO / "docs/fp8.md").read_text()


def test_the_fp8_all_gather_test_is_said_to_run_where_it_runs():
    tests = (REPO / "tests/precision/test_fp8_check.py").read_text()
    assert "def test_all_gather_bytes_of_fp8_weights_halve_with_fp8_all_gather_on_2_gloo_ranks(" in tests
    scale = (REPO / "docs/scale.md").read_text()
    assert "torchao on one process" not in scale and "torchao on 2 gloo ranks" in scale


def test_each_troubleshooting_error_is_one_the_scripts_print_with_its_cause():
    text = (REPO / "docs/cluster.md").read_text().split("## Troubleshooting")[1].split("\n## ")[0]
    scripts = "".join(p.read_text() for p in [REPO / "1.train_llama.sbatch", REPO / "scripts/slurm/job_lib.sh"])
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `error: ([^`]*)`[^|]*\| (.*) \|$", text, re.M)}
    assert 'lf_die "no $VENV/bin/python: set VENV=' in scripts and "is not a checkout of llama-fp8" in scripts
    venv = next(cause for message, cause in rows.items() if message.startswith("no .../.venv/bin/python"))
    assert "make install" in venv and "outside the repository" not in venv  # that is the REPO_DIR error's cause
    assert any("is not a checkout of llama-fp8" in m and "outside the repository" in c for m, c in rows.items())


def test_a_readme_section_the_docs_name_is_a_readme_heading():
    headings = set(re.findall(r"^#+ (.+)$", (REPO / "README.md").read_text(), re.M))
    for page in pages():
        for name in re.findall(r"README's ([A-Z][\w-]*(?: [A-Z][\w-]*)*)", prose(page.read_text())):
            assert any(name.lower() in h.lower() for h in headings), f"{page.name}: the README's {name}"


def test_the_estimate_equality_is_said_for_what_was_tested():
    """The 8B/70B tables are estimates: the equality with a real run is tested on a 2-layer, 128-token model."""
    for page in ("docs/estimate.md", "benchmarks/README.md"):
        text = " ".join((REPO / page).read_text().split())
        assert "a real CPU run's to the byte" not in text, page
        assert "2-layer, 128-token" in text, page


def test_the_hand_written_crash_table_quotes_no_measurement_of_its_own():
    """The restart and hang figures live in the generated fault matrix; the hand-written table above it said 11-18 s
    and 'the collective timeout' after the launcher's hang watch had made them 6-7 s and 15 s."""
    text = (REPO / "tests/reliability/decisions.md").read_text()
    assert not re.search(r"\d+-\d+ s from (a|the) kill", text) and "Bound: the timeout + one restart" not in text
    assert "max(5 x its recent step time, 15 s)" in text
    assert (REPO / "docs/reliability.md").read_text().endswith(text)


def test_the_readme_says_the_image_was_built_on_a_stand_in():
    text = " ".join((REPO / "README.md").read_text().split())
    assert "under real Pyxis + Enroot, built on a stand-in for the NGC base" in text


def test_the_published_band_is_said_to_be_in_sample():
    """The margin was set from the four rows the band test checks: the page and the test say so."""
    page = " ".join((REPO / "docs/estimate.md").read_text().split())
    assert "**In-sample:** the 20 % margin was chosen from these same four rows" in page
    # the range of margins that pass, as test_published.py derives it (IN_SAMPLE_MARGINS), and the held-out rows
    assert "any margin from 17.3 % to 29.2 % of the tracked peak puts all four in the band" in page
    test = (REPO / "tests/estimate/test_published.py").read_text()
    assert "In-sample:" in test and "IN_SAMPLE_MARGINS = (0.173, 0.292)" in test
    assert "| torchtitan's run, held out (its table) |" in page and "def test_held_out_published_rows" in test


def test_the_equality_test_is_said_to_keep_the_lower_peak_and_to_compare_every_rank():
    page = " ".join((REPO / "docs/estimate.md").read_text().split())
    assert "Each real configuration is tracked twice and the lower of the two peaks compared" in page
    assert "it is compared with every rank's record of the real run" in page
    assert "only rank 0's record is compared" not in page
