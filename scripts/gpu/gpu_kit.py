"""The wheel kit: what is in WHEELS_DIR, and which transformer_engine_torch wheel fits this node.

A kit (``scripts/offline/make_kit.sh DIR ...``) holds, at its top level, the wheels a bare GPU node lacks
(torchao, Transformer Engine's Python part and core library, their small needs, datasets), the
``transformer_engine_torch`` source distribution, and usually a prebuilt ``transformer_engine_torch`` wheel.
Wheels that ``bootstrap.py`` compiles on a node go to ``WHEELS_DIR/built/<build key>/`` with a build record
beside them (``<wheel name>.build.json``).

A ``transformer_engine_torch`` wheel is C++ compiled against one torch: its file name says the TE version and
the Python it was built for, but not the torch. So a wheel *matches* this node only when a build record says
it was built for this TE version, this Python and exactly this torch (``torch.__version__``, local part
included), and the record's sha256 is the wheel's. A wheel without a record is only a *candidate*: bootstrap
installs it and keeps it if TE's PyTorch extension then imports, else compiles one.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

TE_TORCH = "transformer_engine_torch"
BUILT_DIR = "built"
RECORD_SUFFIX = ".build.json"
# Distributions a kit must provide (or the node must already have). TE's core wheel is
# transformer_engine_cu12 or _cu13, matched by prefix.
REQUIRED = ("torchao", "transformer_engine", "transformer_engine_cu*")

_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)(?:-(?P<build>\d[^-]*))?-(?P<py>[^-]+)-(?P<abi>[^-]+)"
                    r"-(?P<plat>[^-]+)\.whl$")
_SDIST = re.compile(r"^(?P<name>.+)-(?P<version>\d[^-]*)\.tar\.gz$")


def normalize(name: str) -> str:
    """Distribution name as pip compares them (PEP 503, with '_' for the separator)."""
    return re.sub(r"[-_.]+", "_", name).lower()


@dataclass(frozen=True)
class Wheel:
    path: Path
    name: str  # normalized
    version: str
    py: str
    abi: str
    plat: str

    @property
    def filename(self) -> str:
        return self.path.name


def parse_wheel(path: Path) -> Wheel:
    """Wheel file name -> its parts (PEP 427); ValueError naming the file if it is not one."""
    m = _WHEEL.match(path.name)
    if m is None:
        raise ValueError(f"{path}: not a wheel file name (name-version-python-abi-platform.whl)")
    return Wheel(path, normalize(m["name"]), m["version"], m["py"], m["abi"], m["plat"])


def python_tag(version_info: tuple[int, int]) -> str:
    return f"cp{version_info[0]}{version_info[1]}"


def runs_on(wheel: Wheel, cp_tag: str, machine: str) -> bool:
    """Whether pip would install ``wheel`` on CPython ``cp_tag`` (e.g. cp312) on ``machine`` (x86_64)."""
    major, minor = cp_tag[2], int(cp_tag[3:])
    pys = wheel.py.split(".")
    abis = wheel.abi.split(".")
    py_ok = any(p in (cp_tag, f"py{major}", f"py{major}{minor}") for p in pys) or (
        "abi3" in abis and any(p.startswith(f"cp{major}") and int(p[3:] or 0) <= minor for p in pys))
    abi_ok = any(a in ("none", "abi3", cp_tag) for a in abis)
    plat_ok = any(p == "any" or p.endswith(machine) for p in wheel.plat.split("."))
    return py_ok and abi_ok and plat_ok


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def record_path(wheel_path: Path) -> Path:
    return wheel_path.with_name(wheel_path.name[: -len(".whl")] + RECORD_SUFFIX)


def read_record(wheel_path: Path) -> dict | None:
    """The build record beside a wheel (written by scripts/offline/build_te_torch.sh or by bootstrap), else None."""
    path = record_path(wheel_path)
    if path.is_file():
        return json.loads(path.read_text())
    return None


def build_key(te_version: str, torch_version: str, cp_tag: str) -> str:
    """Folder name under built/ for one build (only letters, digits, '.', '_' and '-', so that it can
    come back in the node's output folder $OUT)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"te{te_version}-torch{torch_version}-{cp_tag}")


@dataclass
class Kit:
    root: Path
    wheels: list[Wheel] = field(default_factory=list)  # top level, all but transformer_engine_torch
    te_torch: list[Wheel] = field(default_factory=list)  # top level and built/*/
    sdist: Path | None = None

    def find(self, pattern: str) -> list[Wheel]:
        """Top-level wheels whose normalized name matches ``pattern`` (a trailing * is a prefix match)."""
        if pattern.endswith("*"):
            return [w for w in self.wheels if w.name.startswith(pattern[:-1])]
        return [w for w in self.wheels if w.name == pattern]

    def te_version(self) -> str | None:
        te = self.find("transformer_engine")
        return te[0].version if te else None


def inventory(root: Path) -> Kit:
    """Read a kit folder. Only names are read here; nothing is installed or imported."""
    kit = Kit(root)
    for path in sorted(root.glob("*.whl")):
        wheel = parse_wheel(path)
        (kit.te_torch if wheel.name == TE_TORCH else kit.wheels).append(wheel)
    kit.te_torch += [parse_wheel(p) for p in sorted((root / BUILT_DIR).glob("*/*.whl"))]
    for path in sorted(root.glob("*.tar.gz")):
        m = _SDIST.match(path.name)
        if m and normalize(m["name"]) == TE_TORCH:
            kit.sdist = path
    return kit


def problems(kit: Kit, installed: set[str]) -> list[str]:
    """What makes this kit unusable, one line each (empty: fine). ``installed``: normalized names of the
    distributions the node's Python already has (a required one found there need not be in the kit)."""
    out = []
    for pattern in REQUIRED:
        have_node = any(n.startswith(pattern[:-1]) if pattern.endswith("*") else n == pattern for n in installed)
        if not kit.find(pattern) and not have_node:
            out.append(f"{kit.root} has no {pattern.replace('*', 'NN')} wheel ({pattern}-VERSION-*.whl) and this "
                       f"Python does not have it either")
    if not kit.te_torch and kit.sdist is None:
        out.append(f"{kit.root} has neither a {TE_TORCH} wheel ({TE_TORCH}-VERSION-*.whl) nor its source "
                   f"({TE_TORCH}-VERSION.tar.gz) to compile one")
    by_name: dict[str, set[str]] = {}
    for w in kit.wheels:
        by_name.setdefault(w.name, set()).add(w.filename)
    for name, files in sorted(by_name.items()):
        if len(files) > 1:
            out.append(f"{kit.root} has {len(files)} wheels of {name} ({', '.join(sorted(files))}): keep one")
    te, cores = kit.find("transformer_engine"), kit.find("transformer_engine_cu*")
    if te and cores and te[0].version != cores[0].version:
        out.append(f"transformer_engine {te[0].version} and {cores[0].filename} differ in version: TE refuses "
                   f"to load such a pair")
    return out


@dataclass(frozen=True)
class Choice:
    wheel: Wheel | None
    recorded: bool  # a build record says it was built for this torch
    notes: tuple[str, ...]


def choose_te_torch(kit: Kit, te_version: str, torch_version: str, cp_tag: str, machine: str) -> Choice:
    """The transformer_engine_torch wheel to install: one recorded for exactly this TE, Python and torch
    (newest build first), else an unrecorded one of this TE version and Python (checked by import later),
    else none (compile one). Every wheel passed over is named in ``notes`` with the reason."""
    recorded, unrecorded, notes = [], [], []
    for wheel in kit.te_torch:
        where = wheel.path.relative_to(kit.root)
        if wheel.version != te_version:
            notes.append(f"{where}: TE {wheel.version}, the kit's TE is {te_version}")
            continue
        if not runs_on(wheel, cp_tag, machine):
            notes.append(f"{where}: built for {wheel.py}/{wheel.plat}, this node is {cp_tag}/{machine}")
            continue
        rec = read_record(wheel.path)
        if rec is None:
            unrecorded.append(wheel)
            continue
        mismatch = [f"{k} {rec.get(k)!r} != {v!r}" for k, v in
                    (("te_version", te_version), ("torch", torch_version), ("python", cp_tag)) if rec.get(k) != v]
        if rec.get("sha256") not in (None, sha256(wheel.path)):
            mismatch.append("sha256 differs from its record")
        if mismatch:
            notes.append(f"{where}: {'; '.join(mismatch)}")
        else:
            recorded.append((rec.get("built", ""), wheel))
    if recorded:
        return Choice(max(recorded, key=lambda t: t[0])[1], True, tuple(notes))
    if unrecorded:
        return Choice(unrecorded[0], False, tuple(notes))
    return Choice(None, False, tuple(notes))


def save_build(wheel_file: Path, wheels_dir: Path, record: dict) -> Path:
    """Move a freshly built wheel to ``wheels_dir/built/<key>/`` and write its build record beside it.
    An earlier build with the same key is replaced (same TE, torch and Python: the newer one wins)."""
    key = build_key(record["te_version"], record["torch"], record["python"])
    dest_dir = wheels_dir / BUILT_DIR / key
    dest_dir.mkdir(parents=True, exist_ok=True)
    for old in dest_dir.glob("*"):
        old.unlink()
    dest = dest_dir / wheel_file.name
    dest.write_bytes(wheel_file.read_bytes())
    record_path(dest).write_text(json.dumps({**record, "sha256": sha256(dest)}, indent=1, sort_keys=True) + "\n")
    return dest
