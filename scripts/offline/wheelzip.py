"""Change one file inside a wheel without the ``wheel`` package: read the wheel with ``zipfile``, let a function
rewrite one member, and write a new wheel of the same name whose RECORD holds that member's new sha256 and size
(PEP 376/427: ``path,sha256=<urlsafe base64, unpadded>,size``). The offline kit prunes TE's core library this way.

    python wheelzip.py prune WHEEL OUT_DIR sm_90 [sm_100 ...]
"""

from __future__ import annotations

import base64
import copy
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import kit

TE_LIBRARY = "libtransformer_engine.so"


def record_hash(path: Path) -> str:
    """A file's hash as a wheel's RECORD writes it."""
    return "sha256=" + base64.urlsafe_b64encode(bytes.fromhex(kit.sha256(path))).rstrip(b"=").decode()


def rewrite_member(wheel: Path, out_dir: Path, matches: Callable[[str], bool], change: Callable[[Path], dict]) -> dict:
    """Copy ``wheel`` to ``out_dir`` with the one member ``matches`` accepts passed through ``change`` (which edits a
    file in place and returns counts); every other member byte for byte, RECORD updated. Returns ``change``'s
    counts. Refused (nothing written) when no member or several match, or the wheel has no RECORD."""
    with zipfile.ZipFile(wheel) as src:
        names = src.namelist()
        hits = [n for n in names if matches(n)]
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        if len(hits) != 1 or len(records) != 1:
            raise kit.KitError(f"{wheel.name}: expected one member to change and one RECORD, found {hits or 'none'} "
                               f"and {len(records)} RECORD files")
        with tempfile.TemporaryDirectory() as tmp:  # the library streamed through a file: it is ~300 MB
            lib = Path(tmp) / Path(hits[0]).name
            with src.open(hits[0]) as f, open(lib, "wb") as g:
                shutil.copyfileobj(f, g, 1 << 20)
            stats = change(lib)
            lines = [f"{hits[0]},{record_hash(lib)},{lib.stat().st_size}" if line.split(",")[0] == hits[0] else line
                     for line in src.read(records[0]).decode().splitlines()]
            out = out_dir / wheel.name
            tmp_out = out.with_name(out.name + ".tmp")
            with zipfile.ZipFile(tmp_out, "w", zipfile.ZIP_DEFLATED) as dst:
                for info in src.infolist():  # same order, names, dates and modes
                    out_info = copy.copy(info)
                    out_info.compress_type = zipfile.ZIP_DEFLATED
                    if info.filename == hits[0]:
                        with open(lib, "rb") as f, dst.open(out_info, "w") as g:
                            shutil.copyfileobj(f, g, 1 << 20)
                    else:
                        body = ("\n".join(lines) + "\n").encode() if info.filename == records[0] else src.read(info)
                        dst.writestr(out_info, body)
            tmp_out.replace(out)
    return stats


def prune_wheel(wheel: Path, out_dir: Path, archs: set[int]) -> dict:
    """TE's core wheel with its library's GPU code pruned to ``archs`` (kit.prune), into ``out_dir``."""
    return rewrite_member(wheel, out_dir, lambda n: Path(n).name.startswith(TE_LIBRARY),
                          lambda lib: kit.prune(lib, archs))


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "prune":
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        stats = prune_wheel(Path(argv[1]), Path(argv[2]), {kit.parse_arch(a) for a in argv[3:]})
    except (kit.KitError, OSError, zipfile.BadZipFile) as e:
        print(f"wheelzip.py: {e}", file=sys.stderr)
        return 2
    print(f"{argv[1]}: kept {stats['kept'] / 1e6:.1f} MB of GPU code, zeroed {stats['zeroed'] / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
