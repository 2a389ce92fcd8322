"""After a device command: take what came back from $OUT into the repository.

    python scripts/gpu/take_back.py FILES_AT [--results docs/gpu-results/results.jsonl] [--wheels .whl]

- the results file: the records the device added (lines of FILES_AT/<results name> that the local file lacks)
  are appended to the local one, so a local file that moved on meanwhile loses nothing;
- a compiled transformer_engine_torch (FILES_AT/built/<key>/: the wheel and its build record) goes to
  WHEELS/built/<key>/, where the next bootstrap finds it instead of compiling;
- docs/gpu-results.md (--page) is regenerated from the results file's folder, and the new records'
  outcomes are printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import results_md

REPO = Path(__file__).resolve().parents[2]


def merge(returned: Path, local: Path) -> list[dict]:
    """Append to ``local`` the lines of ``returned`` it does not have; returns their records."""
    have = set(local.read_text().splitlines()) if local.exists() else set()
    new = [line for line in returned.read_text().splitlines() if line.strip() and line not in have]
    valid = []
    for line in new:
        try:
            valid.append((line, json.loads(line)))
        except json.JSONDecodeError:
            print(f"take_back: skipped a line that is not JSON (cut off?): {line[:80]}", file=sys.stderr)
    if valid:
        local.parent.mkdir(parents=True, exist_ok=True)
        with open(local, "a") as f:
            if local.stat().st_size and not local.read_text().endswith("\n"):
                f.write("\n")
            f.writelines(line + "\n" for line, _ in valid)
    return [rec for _, rec in valid]


def take_wheels(files_at: Path, wheels: Path) -> list[Path]:
    out = []
    for src in sorted((files_at / "built").glob("*/*")):
        dest = wheels / "built" / src.parent.name / src.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
        out.append(dest)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files_at", help="the node's output folder ($OUT), as it came back")
    p.add_argument("--results", default=str(REPO / "docs" / "gpu-results" / "results.jsonl"),
                   help="the local results file to append to")
    p.add_argument("--wheels", default=str(REPO / ".whl"), help="the wheel kit (compiled wheels go to its built/)")
    p.add_argument("--page", default=str(REPO / "docs" / "gpu-results.md"),
                   help="the page to regenerate from the results file's folder")
    args = p.parse_args(argv)
    files_at, local = Path(args.files_at), Path(args.results)
    returned = files_at / local.name
    if not files_at.is_dir():
        print(f"take_back: {files_at}: not a folder", file=sys.stderr)
        return 2
    new = merge(returned, local) if returned.is_file() else []
    print(f"take_back: {len(new)} new records into {local}" + ("" if returned.is_file() else
                                                              f" ({returned.name} did not come back)"))
    for rec in new:
        print(f"  {rec.get('status', '?'):<12} {rec.get('unit')}")
    for path in take_wheels(files_at, Path(args.wheels)):
        print(f"take_back: kept {path}")
    return results_md.main(["--results-dir", str(local.parent), "--out", args.page])


if __name__ == "__main__":
    sys.exit(main())
