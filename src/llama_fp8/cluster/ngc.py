"""The one table of image versions: NGC PyTorch tag -> PyTorch, CUDA, cuDNN, NCCL, Transformer Engine, Python,
minimum driver, and the AWS EFA installer that goes with it. docs/cluster.md's table is generated from it (between the
``<!-- ngc:start -->`` markers; tests/cluster/test_ngc.py checks it is current) and its FP8 columns are computed
from the FP8 recipe table (precision/recipes.py), never written by hand.

Every value names its source (a ``Source``: the page, and whether it is NVIDIA's/AWS's own or a third party's
public file that records what it found in the image); the page numbers them. ``None`` as source means *not
confirmed*: the value is what we expect but no page we could read states it; ``None`` as value means we found
none. The image build checks the real versions against this table (``check-image`` below) and prints them, so
a confirmed row is one build away: copy the printed versions here with the image build as the source.

    python -m llama_fp8.cluster.ngc table                 # the table of docs/cluster.md
    python -m llama_fp8.cluster.ngc update-readme docs/cluster.md   # (scripts/update_docs.py does this too)
    python -m llama_fp8.cluster.ngc check-image --tag 26.09-py3 --efa 1.50.0 --out /opt/llama-fp8/image.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from llama_fp8.precision.recipes import older, version_tuple

STANDIN_MARKER = Path("/etc/llama-fp8/standin-base")
"""Present only in the tests' stand-in for the NGC base (scripts/container/standin/): its versions are not NGC's."""
NCCL_PATH_PLUGIN = "2.21.5"
"""First NCCL that takes NCCL_NET_PLUGIN as a path (NVIDIA/nccl src/net.cc, v2.21.5-1; absent in v2.20.5-1)."""
MARKERS = ("<!-- ngc:start -->", "<!-- ngc:end -->")


@dataclass(frozen=True)
class Source:
    url: str
    what: str
    third_party: bool = False
    """Not NVIDIA's or AWS's own page: a public file that records the versions it found in the image."""


@dataclass(frozen=True)
class Cell:
    value: str | None
    source: Source | None = None  # None: not confirmed

    def text(self, ref: str = "") -> str:
        if self.value is None:
            return "not confirmed"
        return f"{self.value}{ref}" if self.source else f"{self.value} (not confirmed)"


@dataclass(frozen=True)
class EfaInstaller:
    version: str
    ofi_nccl: Cell
    """The aws-ofi-nccl release it installs."""
    nccl_tested: tuple[str, ...]
    """NCCL versions that plugin release names (``tested with``), from its RELEASENOTES.md; () = not confirmed."""
    layout: str


@dataclass(frozen=True)
class NgcRelease:
    tag: str
    pytorch: Cell
    cuda: Cell
    cudnn: Cell
    nccl: Cell
    transformer_engine: Cell
    python: Cell
    min_driver: Cell
    efa_installer: str
    note: str = ""
    """Driver and forward-compatibility remarks (printed under the table)."""
    arm64: Cell = Cell(None)
    """Published for linux/arm64 too (GB200/GB300: Grace, aarch64): "yes" with its page, else not confirmed."""

    def cells(self) -> dict[str, Cell]:
        return {"torch": self.pytorch, "cuda": self.cuda, "cudnn": self.cudnn, "nccl": self.nccl,
                "transformer_engine": self.transformer_engine, "python": self.python,
                "min_driver": self.min_driver}


def _ngc_notes(release: str) -> Source:
    return Source(f"https://docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/rel-{release}.html",
                  f"NVIDIA PyTorch Release {release.replace('-', '.')} notes")


def _triton_notes(release: str) -> Source:
    return Source(f"https://docs.nvidia.com/deeplearning/triton-inference-server/release-notes/rel-{release}.html",
                  f"NVIDIA Triton Inference Server Release {release.replace('-', '.')} notes (CUDA of the same release)")


def _superbench(commit: str, path: str, base: str) -> Source:
    return Source(f"https://github.com/microsoft/superbenchmark/blob/{commit}/{path}",
                  f"microsoft/superbenchmark {path}: the versions it lists for its nvcr.io/nvidia/pytorch:{base} "
                  "base", third_party=True)


TRITON_MATRIX = Source("https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/introduction/"
                       "compatibility.html", "NVIDIA Triton compatibility matrix (TRT-LLM containers built on the "
                       "same PyTorch)")
EFA_CHANGELOG = Source("https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-changelog.html",
                       "AWS EFA installer changelog")
EFA_CHANGELOG_2026 = Source("https://docs.amazonaws.cn/en_us/AWSEC2/latest/UserGuide/efa-changelog.md",
                            "AWS EFA installer changelog (China-region copy; lists 1.50.0 and 1.51.0)")
CUDA_13_4_DRIVER = Source("https://github.com/NVIDIA/cutlass/discussions/3555",
                          "NVIDIA CUTLASS 4.8.0dev release notes: the R615 driver is released with CUDA Toolkit 13.4 "
                          "GA")
FORWARD_COMPAT = "https://docs.nvidia.com/deploy/cuda-compatibility/forward-compatibility.html"
OFI_NOTES = "aws-ofi-nccl RELEASENOTES.md at the installer's plugin tag (https://github.com/aws/aws-ofi-nccl)"
SB_26_06 = _superbench("c514d457713a1f94fa80cb00e63571857938f481", "dockerfile/cuda13.4.dockerfile", "26.06-py3")
SB_26_07 = _superbench("990c4dcbd79c9cfca47d7257bfd8322c9aa45a48", "dockerfile/cuda13.3.dockerfile", "26.07-py3")
SB_26_09 = _superbench("5c29c5cdebb972114d7fcf6eecf222770eccd69a", "dockerfile/cuda13.4.dockerfile", "26.09-py3")
ARM64_26_06 = Source("https://github.com/cl-gao777/Neu-PAN_MK-mini/blob/main/docker/README.md", "cl-gao777/Neu-PAN_MK-mini "
                     "docker/README.md: its 26.06-py3 base \"confirmed to contain the linux/arm64 manifest\"", True)

_LAYOUT_OLD = "/opt/amazon/ofi-nccl/lib/<arch>-linux-gnu"
_LAYOUT_NEW = "/opt/amazon/ofi-nccl/lib"
_LAYOUT_NGC = "NGC base: libnccl-ofi-ngc-v1/v2 in /opt/amazon/aws-ofi-nccl/lib, v3 in /opt/amazon/ofi-nccl/lib"
EFA_INSTALLERS = (
    EfaInstaller("1.43.2", Cell("1.16.3", EFA_CHANGELOG), ("2.27.7",), _LAYOUT_OLD),
    EfaInstaller("1.44.0", Cell("1.17.1"), ("2.28.3",), _LAYOUT_NEW),
    EfaInstaller("1.48.0", Cell("1.19.0"), ("2.27.3", "2.28.7", "2.29.7"), f"{_LAYOUT_NEW}; {_LAYOUT_NGC}"),
    EfaInstaller("1.49.0", Cell("1.20.0"), ("2.28.9", "2.29.7", "2.30.4"), f"{_LAYOUT_NEW}; {_LAYOUT_NGC}"),
    EfaInstaller("1.50.0", Cell("1.21.1", EFA_CHANGELOG_2026), ("2.31.2",), f"{_LAYOUT_NEW}; {_LAYOUT_NGC}"),
    # aws-ofi-nccl 1.22.0's release notes were not readable: which NCCL it was tested with is not confirmed.
    EfaInstaller("1.51.0", Cell("1.22.0", EFA_CHANGELOG_2026), (), f"{_LAYOUT_NEW}; {_LAYOUT_NGC}"),
)
# The plugin versions of 1.44/1.48/1.49 come from a third-party copy of the changelog (the AWS pages we could
# read elide them: "not confirmed"); the NCCL column is from aws-ofi-nccl's own release notes at each tag.

_NONE = Cell(None)
_FORWARD = f"data-center GPUs may run it on an older driver through CUDA forward compatibility ({FORWARD_COMPAT})"
NGC_RELEASES = (
    NgcRelease("25.06-py3", pytorch=Cell("2.8.0a0+5228986c39", TRITON_MATRIX), cuda=Cell("12.9.1", TRITON_MATRIX),
               cudnn=_NONE, nccl=Cell("2.27.3"), transformer_engine=Cell("2.4"), python=Cell("3.12.3", TRITON_MATRIX),
               min_driver=Cell("575.57.08", TRITON_MATRIX), efa_installer="1.48.0",
               note="the last CUDA 12 row: for nodes whose driver is older than R580"),
    NgcRelease("25.10-py3", pytorch=Cell("2.9.0a0+145a3a7bda", TRITON_MATRIX), cuda=Cell("13.0.2", TRITON_MATRIX),
               cudnn=_NONE, nccl=Cell("2.28.3"), transformer_engine=Cell("2.8"), python=Cell("3.12.3", TRITON_MATRIX),
               min_driver=Cell("580.95.05", TRITON_MATRIX), efa_installer="1.48.0"),
    NgcRelease("25.12-py3", pytorch=Cell("2.10.0a0+b4e4ee81d3", _ngc_notes("25-12")),
               cuda=Cell("13.1.0", _ngc_notes("25-12")), cudnn=_NONE, nccl=Cell("2.28.9"),
               transformer_engine=Cell("2.10"), python=Cell("3.12", _ngc_notes("25-12")), min_driver=Cell("590.44.01"),
               efa_installer="1.49.0", note=f"CUDA 13.1; {_FORWARD}"),
    NgcRelease("26.06-py3", pytorch=Cell("2.13.0a0+8145d630e8", SB_26_06), cuda=Cell("13.3.0", _triton_notes("26-06")),
               cudnn=Cell("9.23.0", SB_26_06), nccl=Cell("2.30.5", SB_26_06),
               transformer_engine=Cell("2.16.0", SB_26_06), python=_NONE, min_driver=_NONE, efa_installer="1.49.0",
               note=f"CUDA 13.3: the driver it needs is not confirmed; {_FORWARD}", arm64=Cell("yes", ARM64_26_06)),
    NgcRelease("26.07-py3", pytorch=Cell("2.13.0a0+9186a08", SB_26_07), cuda=Cell("13.3.1", SB_26_07),
               cudnn=Cell("9.24.0.43", SB_26_07), nccl=Cell("2.30.7", SB_26_07),
               transformer_engine=Cell("2.17", SB_26_07), python=_NONE, min_driver=_NONE, efa_installer="1.49.0",
               note=f"CUDA 13.3 Update 1: the driver it needs is not confirmed; {_FORWARD}"),
    NgcRelease("26.09-py3", pytorch=Cell("2.14.0a0+b2c75dd062", SB_26_09), cuda=Cell("13.4.1", _triton_notes("26-09")),
               cudnn=Cell("9.26.0", SB_26_09), nccl=Cell("2.31.2", SB_26_09),
               transformer_engine=Cell("2.19.0", SB_26_09), python=_NONE, min_driver=Cell("R615", CUDA_13_4_DRIVER),
               efa_installer="1.50.0",
               note=f"CUDA 13.4: hosts need an R615 driver (its exact minimum version is not confirmed); {_FORWARD}"),
)
DEFAULT_TAG = "26.09-py3"
# 26.01-26.05, 26.08: no page we could read lists their TE and NCCL, so no row (a build from one prints its versions:
# `check-image` says which row to add). 26.10 exists (Triton 26.10: CUDA 13.4.3), its PyTorch versions unread.


def release(tag: str) -> NgcRelease | None:
    return next((r for r in NGC_RELEASES if r.tag == tag), None)


def installer(version: str) -> EfaInstaller | None:
    return next((e for e in EFA_INSTALLERS if e.version == version), None)


def _te_recipes():
    from llama_fp8.precision import recipes

    return [r for r in recipes.all_recipes() if recipes.library_of(r.backend) == "transformer_engine"]


def _cuda_ok(recipe, cuda: str | None) -> bool:
    """Only the CUDA minimum that holds on every GPU (``(99, 0)`` rows: e.g. block scaling needs 12.9)."""
    return all(cuda is not None and not older(cuda, v) for below, v in recipe.min_cuda if below >= (99, 0))


def te_features(te: str | None, cuda: str | None) -> tuple[list[str], list[str]]:
    """(TE FP8 recipes this TE/CUDA pair has, recipes whose FP8 all-gather under FSDP2 it has)."""
    if te is None:
        return [], []
    rows = [r for r in _te_recipes() if not older(te, r.min_library) and _cuda_ok(r, cuda)]
    gather = [r.name for r in rows if r.fp8_all_gather_since and not older(te, r.fp8_all_gather_since)]
    return [r.name for r in rows], gather


def _features_text(r: NgcRelease) -> tuple[str, str]:
    if r.transformer_engine.value is None:
        return "unknown (TE not confirmed)", "unknown (TE not confirmed)"
    names, gather = te_features(r.transformer_engine.value, r.cuda.value)
    suffix = "" if r.transformer_engine.source else " (if TE is as listed)"
    return (", ".join(names) or "none") + suffix, (", ".join(gather) or "none") + suffix


def _numbered(sources: list[Source]) -> dict[Source, int]:
    """Each source once, numbered in order of first use."""
    numbers: dict[Source, int] = {}
    for source in sources:
        numbers.setdefault(source, len(numbers) + 1)
    return numbers


def table_markdown() -> str:
    """docs/cluster.md's NGC/EFA table, its notes, the installer table under it and the numbered sources."""
    cells = [c for r in NGC_RELEASES for c in (*r.cells().values(), r.arm64)] + [e.ofi_nccl for e in EFA_INSTALLERS]
    numbers = _numbered([c.source for c in cells if c.source])

    def show(cell: Cell) -> str:
        return cell.text(f" [{numbers[cell.source]}]" if cell.source else "")

    rows = ["| NGC tag | PyTorch | CUDA | cuDNN | NCCL | Transformer Engine | Python | min. driver | EFA installer | "
            "TE FP8 recipes | TE FP8 all-gather (FSDP2) | linux/arm64 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in NGC_RELEASES:
        recipes_text, gather_text = _features_text(r)
        tag = f"`{r.tag}`" + (" **(default)**" if r.tag == DEFAULT_TAG else "")
        rows.append(f"| {tag} | " + " | ".join(show(c) for c in r.cells().values()) +
                    f" | {r.efa_installer} | {recipes_text} | {gather_text} | {show(r.arm64)} |")
    rows += [""] + [f"- `{r.tag}`: {r.note}" for r in NGC_RELEASES if r.note]
    rows += ["", "| EFA installer | aws-ofi-nccl | NCCL the plugin release names | plugin folder |",
             "|---|---|---|---|"]
    rows += [f"| {e.version} | {show(e.ofi_nccl)} | {', '.join(e.nccl_tested) or 'not confirmed'} | {e.layout} |"
             for e in EFA_INSTALLERS]
    rows += ["", "Sources (third-party: a public file that records the versions it found in that image; the image "
             "build prints the real ones):"]
    rows += [f"{n}. {s.what}{' (third-party)' if s.third_party else ''}: {s.url}" for s, n in numbers.items()]
    rows += [f"{len(numbers) + 1}. NCCL the plugin release names: {OFI_NOTES}"]
    return "\n".join(rows)


def update_readme(path: Path) -> bool:
    """Rewrite the table between the markers; True when the file changed."""
    text = path.read_text()
    start, end = (re.escape(m) for m in MARKERS)
    if not re.search(start + ".*?" + end, text, flags=re.S):
        raise ValueError(f"{path} has no {MARKERS[0]} ... {MARKERS[1]} block")
    new = re.sub(f"({start}\n).*?({end})", lambda m: m.group(1) + table_markdown() + "\n" + m.group(2), text,
                 flags=re.S)
    path.write_text(new)
    return new != text


def installed_versions() -> dict[str, str | None]:
    """torch, CUDA, cuDNN, NCCL, Transformer Engine and Python as installed here (None where absent)."""
    import platform

    import torch

    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    te = None
    for name in ("transformer_engine", "transformer-engine"):
        try:
            te = importlib.metadata.version(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": _cudnn_text(cudnn), "nccl": nccl,
            "transformer_engine": te, "python": platform.python_version()}


def _cudnn_text(number: int | None) -> str | None:
    """cuDNN 9's version number (``major * 10000 + minor * 100 + patch``: 92600) as ``9.26.0``."""
    if number is None:
        return None
    return f"{number // 10000}.{number // 100 % 100}.{number % 100}" if number >= 90000 else str(number)


def same_version(found: str, listed: str) -> bool:
    """Whether an installed version is the listed one, to the precision both give: ``13.4`` (torch.version.cuda)
    is ``13.4.1``, ``9.24.0`` is ``9.24.0.43``, ``2.14.0a0+b2c75dd062.nv26.09`` is ``2.14.0a0+b2c75dd062``; ``2.10``
    is not ``2.1``."""
    numbers = [re.match(r"\d+(?:\.\d+)*", v) for v in (found, listed)]
    if not all(numbers):
        return found == listed
    a, b = ([int(x) for x in m.group(0).split(".")] for m in numbers)
    n = min(len(a), len(b))
    return n >= 2 and a[:n] == b[:n] and ("+" not in listed or found.startswith(listed))


def efa_problem(nccl: str | None, efa: str) -> str:
    """Why an EFA installer does not go with this NCCL ('' when its plugin release names NCCL's major.minor)."""
    e = installer(efa)
    if e is None:
        return f"EFA installer {efa} is not in src/llama_fp8/cluster/ngc.py: check which NCCL its aws-ofi-nccl names"
    if nccl is None or not e.nccl_tested:
        return "" if nccl is None else f"which NCCL EFA installer {efa}'s aws-ofi-nccl was tested with is not confirmed"
    if not any(_minor(t) == _minor(nccl) for t in e.nccl_tested):
        return (f"EFA installer {efa} installs aws-ofi-nccl {e.ofi_nccl.value}, tested with NCCL "
                f"{', '.join(e.nccl_tested)}; the image has NCCL {nccl}")
    return ""


def _minor(version: str) -> tuple[int, int]:
    return version_tuple(version)[:2]


def requirement_problems(found: dict[str, str | None]) -> list[str]:
    """What the image lacks for our defaults: TE for the default TE recipe, torch for the package."""
    from llama_fp8.precision import recipes

    out = []
    te_backend = next(r.backend for r in _te_recipes())
    default = recipes.default_for(te_backend)
    if found["transformer_engine"] is None or older(found["transformer_engine"], default.min_library):
        out.append(f"Transformer Engine {found['transformer_engine'] or 'missing'}: the default FP8 recipe "
                   f"({default.name}) needs >= {default.min_library}")
    if found["torch"] is None or older(found["torch"], "2.6"):
        out.append(f"torch {found['torch']}: llama-fp8 needs >= 2.6 (pyproject.toml)")
    return out


PLATFORMS = {"amd64": "x86_64", "arm64": "aarch64"}  # TARGETARCH (docker's names) -> uname -m


def platform_problem(target: str | None, machine: str) -> str:
    """Why the image being built is not of the platform asked for ('' when it is, or nothing was asked)."""
    if target and target not in PLATFORMS:
        return f"TARGETARCH {target}: not a platform of this image (valid: {', '.join(PLATFORMS)})"
    if target and PLATFORMS[target] != machine:
        return f"the build asked for linux/{target} but runs on {machine}: the base image is not the {target} one"
    return ""


def check_image(tag: str, efa: str, plugin_env: Path | None, out: Path | None, target: str | None = None) -> int:
    """Run in the image build: print the real versions next to the table's, fail when a default cannot run or the
    image is not of the platform asked for. The tests' stand-in base: printed and recorded, not compared."""
    import platform

    found, machine = installed_versions(), platform.machine()
    standin = STANDIN_MARKER.read_text().strip()[:300] if STANDIN_MARKER.is_file() else ""
    row = None if standin else release(tag)
    print(f"{'stand-in for ' if standin else ''}NGC {tag}: " + ", ".join(f"{k} {v}" for k, v in found.items())
          + f", machine {machine}")
    if target == "arm64" and row is not None and row.arm64.value is None:  # the build just pulled one
        print(f"note: ngc.py does not confirm an arm64 image of {tag}; this build pulled one: add it to the row")
    if standin:
        print(f"note: the tests' stand-in base ({standin}): its versions are not NGC's and are not compared "
              "with src/llama_fp8/cluster/ngc.py")
    elif row is None:
        print(f"note: {tag} is not in src/llama_fp8/cluster/ngc.py; add a row with the versions above")
    else:
        for key, cell in row.cells().items():
            if found.get(key) and cell.value and not same_version(found[key], cell.value):
                print(f"note: ngc.py lists {key} {cell.value} for {tag}, the image has {found[key]}: update the row")
    problem = efa_problem(found["nccl"], efa)
    if problem:
        print(f"note: {problem} (docs/cluster.md: Image versions)")
    if found["nccl"] and older(found["nccl"], NCCL_PATH_PLUGIN):
        print(f"warning: NCCL {found['nccl']} < {NCCL_PATH_PLUGIN} ignores a path in NCCL_NET_PLUGIN; run with "
              "NCCL_NET_PLUGIN=ofi (the plugin folder is on LD_LIBRARY_PATH)")
    plugin = dict(line.split("=", 1) for line in plugin_env.read_text().split() if "=" in line) if plugin_env else {}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        base = {"base": "stand-in"} if standin else {}
        out.write_text(json.dumps({"ngc_tag": tag, **base, "machine": machine, "efa_installer": efa, **found, **plugin},
                                  indent=1) + "\n")
    bad = requirement_problems(found) + [x for x in [platform_problem(target, machine)] if x]
    for message in bad:
        print(f"error: {message}; choose another NGC_TAG (docs/cluster.md: Image versions)", file=sys.stderr)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_fp8.cluster.ngc", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("table", help="print the table of docs/cluster.md")
    upd = sub.add_parser("update-readme", help="rewrite the table in a page (docs/cluster.md) between its markers")
    upd.add_argument("readme", type=Path)
    chk = sub.add_parser("check-image", help="(image build) versions vs the table; fail if a default cannot run")
    chk.add_argument("--tag", required=True, help="the NGC_TAG the image was built from")
    chk.add_argument("--efa", required=True, help="EFA_INSTALLER_VERSION")
    chk.add_argument("--plugin-env", type=Path, help="KEY=VALUE file written by scripts/image/setup_nccl_plugin.sh")
    chk.add_argument("--out", type=Path, help="write the image description here (JSON)")
    chk.add_argument("--platform", choices=tuple(PLATFORMS), help="TARGETARCH the image was built for (amd64, arm64)")
    args = p.parse_args(argv)
    if args.cmd == "table":
        print(table_markdown())
        return 0
    if args.cmd == "update-readme":
        print(f"{args.readme}: NGC table {'updated' if update_readme(args.readme) else 'already current'}")
        return 0
    return check_image(args.tag, args.efa, args.plugin_env, args.out, args.platform)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
