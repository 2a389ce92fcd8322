"""The one table of image versions: NGC PyTorch tag -> PyTorch, Transformer Engine, CUDA, NCCL, minimum driver,
and the AWS EFA installer that goes with it. The README's table is generated from it (between the
``<!-- ngc:start -->`` markers; tests/cluster/test_ngc.py checks it is current) and its FP8 columns are computed
from the FP8 recipe table (precision/recipes.py), never written by hand.

Every value names its source. ``None`` as source means *not confirmed*: the value is what we expect but no
NVIDIA/AWS page we could read states it; the README prints "not confirmed" next to it. The image build checks
the real versions against this table (``check-image`` below) and prints them, so a confirmed row is one build
away: copy the printed versions here with the image build as the source.

    python -m llama_fp8.cluster.ngc table                 # the README table
    python -m llama_fp8.cluster.ngc update-readme README.md
    python -m llama_fp8.cluster.ngc check-image --tag 25.12-py3 --efa 1.49.0 --out /opt/llama-fp8/image.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from llama_fp8.precision.recipes import older

NGC_NOTES = "https://docs.nvidia.com/deeplearning/frameworks/pytorch-release-notes/rel-{}.html"
TRITON_MATRIX = ("https://docs.nvidia.com/deeplearning/triton-inference-server/user-guide/docs/introduction/"
                 "compatibility.html (Triton TRT-LLM containers built on the same PyTorch)")
EFA_CHANGELOG = "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-changelog.html"
OFI_NOTES = "aws-ofi-nccl RELEASENOTES.md at tag v{}"
NCCL_PATH_PLUGIN = "2.21.5"
"""First NCCL that takes NCCL_NET_PLUGIN as a path (NVIDIA/nccl src/net.cc, v2.21.5-1; absent in v2.20.5-1)."""
MARKERS = ("<!-- ngc:start -->", "<!-- ngc:end -->")


@dataclass(frozen=True)
class Cell:
    value: str | None
    source: str | None = None  # None: not confirmed

    def text(self) -> str:
        if self.value is None:
            return "not confirmed"
        return self.value if self.source else f"{self.value} (not confirmed)"


@dataclass(frozen=True)
class EfaInstaller:
    version: str
    ofi_nccl: Cell
    """The aws-ofi-nccl release it installs."""
    nccl_tested: str
    """NCCL versions that plugin release names (``supports`` / ``tested with``), from its release notes."""
    layout: str


@dataclass(frozen=True)
class NgcRelease:
    tag: str
    pytorch: Cell
    cuda: Cell
    nccl: Cell
    transformer_engine: Cell
    min_driver: Cell
    efa_installer: str
    note: str = ""


_LAYOUT_OLD = "/opt/amazon/ofi-nccl/lib/<arch>-linux-gnu"
_LAYOUT_NEW = "/opt/amazon/ofi-nccl/lib"
_LAYOUT_NGC = "NGC base: libnccl-ofi-ngc-v1/v2 in /opt/amazon/aws-ofi-nccl/lib, v3 in /opt/amazon/ofi-nccl/lib"
_SECONDARY = "third-party copy of the EFA changelog"
EFA_INSTALLERS = (
    EfaInstaller("1.43.2", Cell("1.16.3", EFA_CHANGELOG), "2.27.7", _LAYOUT_OLD),
    EfaInstaller("1.44.0", Cell("1.17.1", None), "2.28.3", _LAYOUT_NEW),
    EfaInstaller("1.48.0", Cell("1.19.0", None), "2.27.3, 2.28.7, 2.29.7", f"{_LAYOUT_NEW}; {_LAYOUT_NGC}"),
    EfaInstaller("1.49.0", Cell("1.20.0", None), "2.28.9, 2.29.7, 2.30.4", f"{_LAYOUT_NEW}; {_LAYOUT_NGC}"),
    EfaInstaller("1.50.0", Cell("1.21.1", EFA_CHANGELOG), "2.31.2", f"{_LAYOUT_NEW}; {_LAYOUT_NGC}"),
)
# The plugin versions of 1.44/1.48/1.49 come from a third-party copy of the changelog (the AWS page we could
# read elides them); the NCCL column is from aws-ofi-nccl's own release notes at each tag (checked in its repo).

NGC_RELEASES = (
    NgcRelease("25.06-py3", pytorch=Cell("2.8.0a0+5228986c39", TRITON_MATRIX), cuda=Cell("12.9.1", TRITON_MATRIX),
               nccl=Cell("2.27.3"), transformer_engine=Cell("2.4"), min_driver=Cell("575.57.08", TRITON_MATRIX),
               efa_installer="1.48.0", note="last CUDA 12 row: for nodes whose driver is older than R580"),
    NgcRelease("25.10-py3", pytorch=Cell("2.9.0a0+145a3a7bda", TRITON_MATRIX), cuda=Cell("13.0.2", TRITON_MATRIX),
               nccl=Cell("2.28.3"), transformer_engine=Cell("2.8"), min_driver=Cell("580.95.05", TRITON_MATRIX),
               efa_installer="1.48.0"),
    NgcRelease("25.12-py3", pytorch=Cell("2.10.0a0+b4e4ee81d3", NGC_NOTES.format("25-12")),
               cuda=Cell("13.1.0", NGC_NOTES.format("25-12")), nccl=Cell("2.28.9"), transformer_engine=Cell("2.10"),
               min_driver=Cell("590.44.01"), efa_installer="1.49.0",
               note="default: the newest tag whose release notes we could read"),
)
DEFAULT_TAG = "25.12-py3"


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
    names, gather = te_features(r.transformer_engine.value, r.cuda.value)
    suffix = "" if r.transformer_engine.source else " (if TE is as listed)"
    return (", ".join(names) or "none") + suffix, (", ".join(gather) or "none") + suffix


def table_markdown() -> str:
    """The README's NGC/EFA table (and the installer table under it)."""
    rows = ["| NGC tag | PyTorch | CUDA | NCCL | Transformer Engine | min. driver | EFA installer | "
            "TE FP8 recipes | TE FP8 all-gather (FSDP2) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in NGC_RELEASES:
        recipes_text, gather_text = _features_text(r)
        tag = f"`{r.tag}`" + (" **(default)**" if r.tag == DEFAULT_TAG else "")
        rows.append(f"| {tag} | {r.pytorch.text()} | {r.cuda.text()} | {r.nccl.text()} | "
                    f"{r.transformer_engine.text()} | {r.min_driver.text()} | {r.efa_installer} | {recipes_text} | "
                    f"{gather_text} |")
    rows += ["", "| EFA installer | aws-ofi-nccl | NCCL the plugin release names | plugin folder |",
             "|---|---|---|---|"]
    rows += [f"| {e.version} | {e.ofi_nccl.text()} | {e.nccl_tested} | {e.layout} |" for e in EFA_INSTALLERS]
    sources = sorted({c.source for r in NGC_RELEASES for c in (r.pytorch, r.cuda, r.nccl, r.transformer_engine,
                                                               r.min_driver) if c.source})
    rows += ["", "Sources: " + "; ".join(sources + [EFA_CHANGELOG + f" ({_SECONDARY} for 1.44-1.49)",
                                                    OFI_NOTES.format("X") + " (NCCL column)"]) + "."]
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
    """torch, CUDA, NCCL, Transformer Engine as installed here (None where absent)."""
    import torch

    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - CPU builds have no NCCL
        nccl = None
    te = None
    for name in ("transformer_engine", "transformer-engine"):
        try:
            te = importlib.metadata.version(name)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "transformer_engine": te}


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


def check_image(tag: str, efa: str, plugin_env: Path | None, out: Path | None) -> int:
    """Run in the image build: print the real versions next to the table's, fail when a default cannot run."""
    found = installed_versions()
    row = release(tag)
    print(f"NGC {tag}: " + ", ".join(f"{k} {v}" for k, v in found.items()))
    if row is None:
        print(f"note: {tag} is not in llama_fp8/cluster/ngc.py; add a row with the versions above")
    else:
        for key, cell in (("torch", row.pytorch), ("cuda", row.cuda), ("nccl", row.nccl),
                          ("transformer_engine", row.transformer_engine)):
            if found[key] and cell.value and not found[key].startswith(cell.value):
                print(f"note: ngc.py lists {key} {cell.value} for {tag}, the image has {found[key]}: update the row")
    if found["nccl"] and older(found["nccl"], NCCL_PATH_PLUGIN):
        print(f"warning: NCCL {found['nccl']} < {NCCL_PATH_PLUGIN} ignores a path in NCCL_NET_PLUGIN; run with "
              "NCCL_NET_PLUGIN=ofi (the plugin folder is on LD_LIBRARY_PATH)")
    plugin = dict(line.split("=", 1) for line in plugin_env.read_text().split() if "=" in line) if plugin_env else {}
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"ngc_tag": tag, "efa_installer": efa, **found, **plugin}, indent=1) + "\n")
    bad = requirement_problems(found)
    for message in bad:
        print(f"error: {message}; choose another NGC_TAG (README: Image versions)", file=sys.stderr)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m llama_fp8.cluster.ngc", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("table", help="print the README table")
    upd = sub.add_parser("update-readme", help="rewrite the table in README.md between its markers")
    upd.add_argument("readme", type=Path)
    chk = sub.add_parser("check-image", help="(image build) versions vs the table; fail if a default cannot run")
    chk.add_argument("--tag", required=True, help="the NGC_TAG the image was built from")
    chk.add_argument("--efa", required=True, help="EFA_INSTALLER_VERSION")
    chk.add_argument("--plugin-env", type=Path, help="KEY=VALUE file written by scripts/image/setup_nccl_plugin.sh")
    chk.add_argument("--out", type=Path, help="write the image description here (JSON)")
    args = p.parse_args(argv)
    if args.cmd == "table":
        print(table_markdown())
        return 0
    if args.cmd == "update-readme":
        print(f"{args.readme}: NGC table {'updated' if update_readme(args.readme) else 'already current'}")
        return 0
    return check_image(args.tag, args.efa, args.plugin_env, args.out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
