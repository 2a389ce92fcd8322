"""The offline kit's files (``build_kit.py`` and ``install_kit.sh`` use it):

    python kit.py prune LIB.so sm_90 [sm_100 ...]     keep only these archs' cubins in LIB's .nv_fatbin, in place
    python kit.py manifest KIT --python 3.12 --torch 2.11.0 --arch sm_90 [--te V] [--torchao V]
    python kit.py verify KIT                           every wheel listed with its sha256, nothing else

Pruning. TE's core library carries GPU code for every architecture from sm_75 to sm_120 (~280 MB). A fatbin
(section ``.nv_fatbin`` of the ELF file) is a run of containers, each a header (magic 0xBA55ED50, version u16,
header size u16, payload size u64) followed by entries (kind u16, flags u16, entry header size u32, payload size
u64, ..., the SM number as u32 at byte 28). In each container the entries of the kept architectures are moved
to its front byte for byte, its payload size is lowered and the rest is zeroed: every container keeps its
offset, so the pointers into the section stay valid, and the zeros compress to almost nothing in a wheel.
``sm_90`` keeps SM 90 entries, which include sm_90a code. A container without a kept entry is an error (the
library would have no code for that kernel on the target GPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import re
import struct
import subprocess
import sys
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
MANIFEST = "MANIFEST.json"
MAX_MANIFEST_BYTES = 1 << 20
# Plain names, or built/KEY/NAME for a compiled TE extension (with its .build.json): nothing outside the kit.
KIT_FILES = re.compile(r"^(built/[A-Za-z0-9_.+-]+/)?[A-Za-z0-9_.+-]+\.(whl|tar\.gz|build\.json)$")


class KitError(Exception):
    """A user-facing error: printed, exit code 2."""


def parse_arch(text: str) -> int:
    m = re.fullmatch(r"sm_(\d{2,3})a?", text)
    if not m:
        raise KitError(f"--arch {text}: expected sm_NN as in nvcc (e.g. sm_90 for H100/H200, sm_100 for B200)")
    return int(m.group(1))


# --- ELF + fatbin ------------------------------------------------------------------------------------------
def section(data, name: bytes) -> tuple[int, int]:
    """(file offset, size) of ELF64 little-endian section ``name``."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise KitError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    if shoff + shnum * shentsize > len(data) or shstrndx >= shnum:
        raise KitError("ELF section headers lie outside the file")

    def header(i: int) -> tuple[int, int, int]:
        name_off, = struct.unpack_from("<I", data, shoff + i * shentsize)
        offset, size = struct.unpack_from("<QQ", data, shoff + i * shentsize + 0x18)
        return name_off, offset, size

    _, str_off, str_size = header(shstrndx)
    for i in range(shnum):
        name_off, offset, size = header(i)
        start = str_off + name_off
        if data[start:data.find(b"\0", start, str_off + str_size)] == name:
            if offset + size > len(data):
                raise KitError(f"section {name.decode()} lies outside the file")
            return offset, size
    raise KitError(f"no {name.decode()} section")


def containers(f, off: int, size: int, where: Path) -> list[tuple[int, int, int, list[tuple[int, int, int]]]]:
    """Each fatbin container of the section at ``off``: (offset, body start, end, [(entry start, end, arch)])."""
    out, pos, end = [], off, off + size
    while pos + 16 <= end:
        magic, _version, hsize, fsize = struct.unpack_from("<IHHQ", f, pos)
        if magic != FATBIN_MAGIC:  # alignment padding between containers
            pos += 8
            continue
        body, cend = pos + hsize, pos + hsize + fsize
        if cend > end:
            raise KitError(f"{where}: fatbin container at {pos:#x} runs past its section")
        entries, e = [], body
        while e < cend:
            _kind, _flags, ehsize, psize = struct.unpack_from("<HHIQ", f, e)
            if ehsize < 32 or e + ehsize + psize > cend:
                raise KitError(f"{where}: malformed fatbin entry at {e:#x}")
            entries.append((e, e + ehsize + psize, struct.unpack_from("<I", f, e + 28)[0]))
            e += ehsize + psize
        out.append((pos, body, cend, entries))
        pos = cend
    return out


def prune(path: Path, archs: set[int]) -> dict:
    """Keep only ``archs``' entries in every fatbin container of ``path``, in place; the whole file is checked
    before a byte changes (a refused library is left as it was). Returns counts."""
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 0) as f:
        found = containers(f, *section(f, b".nv_fatbin"), path)
        for pos, _, _, entries in found:
            if not any(arch in archs for _, _, arch in entries):
                raise KitError(f"{path}: fatbin container at {pos:#x} has no code for "
                               f"{', '.join(f'sm_{a}' for a in sorted(archs))}")
        stats = {"containers": len(found), "kept": 0, "zeroed": 0}
        for pos, body, cend, entries in found:
            new = b"".join(bytes(f[a:b]) for a, b, arch in entries if arch in archs)
            stats["kept"] += len(new)
            stats["zeroed"] += cend - body - len(new)
            f[body:body + len(new)] = new
            f[body + len(new):cend] = bytes(cend - body - len(new))
            struct.pack_into("<Q", f, pos + 8, len(new))
        f.flush()
    return stats


# --- manifest ----------------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def in_kit(name: str) -> bool:
    return bool(KIT_FILES.match(name)) and ".." not in name.split("/")


def kit_files(kit: Path) -> list[str]:
    """The kit's wheels, sdists and build records, as names relative to the kit."""
    found = [p for p in [*kit.iterdir(), *kit.glob("built/*/*")] if p.is_file() and not p.is_symlink()]
    return sorted(n for n in (p.relative_to(kit).as_posix() for p in found) if in_kit(n))


def write_manifest(kit: Path, target: dict) -> dict:
    files = {n: {"sha256": sha256(kit / n), "bytes": (kit / n).stat().st_size} for n in kit_files(kit)}
    if not files:
        raise KitError(f"{kit}: no wheel or sdist to list")
    manifest = {"target": target, "files": files}
    tmp = kit / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    tmp.replace(kit / MANIFEST)
    return manifest


def read_manifest(kit: Path) -> dict:
    """MANIFEST.json as written (capped in size; refused when it is not a kit manifest)."""
    path = kit / MANIFEST
    if not path.is_file():
        raise KitError(f"{kit}: no {MANIFEST} (make the kit with scripts/offline/make_kit.sh)")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise KitError(f"{path}: larger than {MAX_MANIFEST_BYTES} bytes, not a kit manifest")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        assert isinstance(files, dict) and all(isinstance(v, dict) and "sha256" in v for v in files.values())
    except (ValueError, KeyError, TypeError, AssertionError):
        raise KitError(f"{path}: not a kit manifest (expected JSON with files: {{name: {{sha256}}}})") from None
    return manifest


def verify(kit: Path) -> dict:
    """The manifest, after checking that every file it lists is there with its sha256 and that no wheel or sdist
    beside them is unlisted (a kit is installed whole: a stray wheel would be installed too)."""
    path = kit / MANIFEST
    manifest = read_manifest(kit)
    files = manifest["files"]
    bad = [n for n in files if not in_kit(n)]
    if bad:
        raise KitError(f"{path}: file names outside the kit's folder: {', '.join(map(repr, bad[:3]))}")
    missing = [n for n in files if not (kit / n).is_file()]
    changed = [n for n in files if n not in missing and sha256(kit / n) != files[n]["sha256"]]
    extra = [n for n in kit_files(kit) if n not in files]
    problems = [f"{what}: {', '.join(names)}" for what, names in
                (("missing", missing), ("sha256 differs", changed), ("not in the manifest", extra)) if names]
    if problems:
        raise KitError(f"{kit}: " + "; ".join(problems))
    return manifest


def repo_bytes(repo: Path) -> int:
    """The bytes of the working tree a command to the node carries: tracked files and untracked ones git does
    not ignore."""
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout.decode()
    return sum((repo / n).stat().st_size for n in out.split("\0") if n and (repo / n).is_file())


def size_table(manifest: dict, missing: dict[str, str]) -> str:
    rows = [f"  {f['bytes'] / 2**20:8.2f} MiB  {n}" for n, f in sorted(manifest["files"].items())]
    total = sum(f["bytes"] for f in manifest["files"].values())
    rows.append(f"  {total / 2**20:8.2f} MiB  in all ({len(rows)} files)")
    rows += [f"  not in the kit: {k}: {v.splitlines()[0]}" for k, v in missing.items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kit.py", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prune")
    a.add_argument("lib", type=Path)
    a.add_argument("archs", nargs="+")
    a = sub.add_parser("manifest")
    a.add_argument("kit", type=Path)
    for flag in ("--python", "--torch", "--arch"):
        a.add_argument(flag, required=True)
    a.add_argument("--te")
    a.add_argument("--torchao")
    a = sub.add_parser("verify")
    a.add_argument("kit", type=Path)
    args = p.parse_args(argv)
    try:
        if args.cmd == "prune":
            stats = prune(args.lib, {parse_arch(x) for x in args.archs})
            print(f"{args.lib.name}: {stats['containers']} fatbin containers, kept {stats['kept'] / 1e6:.1f} MB of "
                  f"GPU code, zeroed {stats['zeroed'] / 1e6:.1f} MB")
        elif args.cmd == "manifest":
            for arch in args.arch.split(","):
                parse_arch(arch)
            target = {k: getattr(args, k) for k in ("python", "torch", "arch", "te", "torchao")}
            print(f"{args.kit / MANIFEST}: {len(write_manifest(args.kit, target)['files'])} files")
        else:
            print(f"{args.kit}: {len(verify(args.kit)['files'])} files match {MANIFEST}")
    except (KitError, OSError) as e:
        print(f"kit.py {args.cmd}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
