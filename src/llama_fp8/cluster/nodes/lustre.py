"""FSx for Lustre under a run's folders, checked before the job trains: the mount and its options, the checkpoint
folder's stripe count against one rank's checkpoint shard, and proof that LNet carries the bytes over EFA.

What is read, and from where:
- The mount table (``/proc/self/mounts``, fstab(5) fields with octal escapes): a folder is on Lustre when its
  deepest mount has file system type ``lustre``; AWS mounts FSx with ``noatime,flock`` (awsome-distributed-ai,
  1.architectures/5.sagemaker-hyperpod/LifecycleScripts/base-config/mount_fsx.sh) or ``relatime,flock`` (FSx guide).
- ``lfs getstripe -d DIR`` (lfs-getstripe(1)): the layout new files in DIR get, either one ``stripe_count: N``
  or a progressive file layout (PFL) of components ``lcme_extent.e_start`` / ``e_end`` (a number or EOF), each with
  its ``stripe_count`` (-1: every OST). A file's bulk lands in the component that holds its last byte. FSx guide,
  "Striping data in your file system": file systems created before August 2023 default to a stripe count of 1, so
  a multi-GiB checkpoint shard is written to one OST; the PFL the guide gives for large files is the fix below.
- ``lnetctl net show -v`` (YAML): each LNet net (tcp, efa) with its local NIs and their ``statistics``
  (``send_count``, ``recv_count``). Metadata traffic always rides TCP; bulk data to the OSS rides EFA when the
  client is set up for it, and falls back to TCP silently otherwise. The proof is awsome-distributed-ai's
  (#989, ``verify_efa_transport``; #1203 sums the counters of every EFA NI): write 64 MiB with O_DIRECT, read it
  back, and the EFA counters must have moved.

Standard library only and Python 3.7's grammar: the batch script runs this module with the host's python3 where
the image has no Lustre tools (``python3 -m llama_fp8.cluster.nodes.lustre --folder DIR``; job_lib.sh).
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MOUNTS = "/proc/self/mounts"  # module constant: tests point it at a stand-in table
GIB = 2**30
BIG_SHARD = GIB
"""A shard at least this big on a stripe count of 1 gets the warning (the FSx guide stripes files above 100 MiB)."""
FIX = "lfs setstripe -E 100M -c 1 -E 10G -c 8 -E -1 -c -1 {dir}"
"""The FSx guide's progressive file layout ("Striping data in your file system"); applies to files created after."""
TEST_BYTES = 64 * 2**20
ON_HOST_ENV = "LLAMA_FP8_LUSTRE_ON_HOST"
"""Set to 1 by the batch script when it runs this module with the host's tools after preflight (job_lib.sh)."""
BYTES_PER_PARAM = 12
"""One rank's checkpoint: its FP32 parameters and AdamW's two FP32 moments (checkpoint/: DCP, one file per rank)."""


@dataclass(frozen=True)
class MountEntry:
    source: str
    target: str
    fstype: str
    options: str


def parse_mount_table(text: str) -> list[MountEntry]:
    """The lines of /proc/self/mounts ("SOURCE TARGET TYPE OPTIONS 0 0"; a space in a path is \\040)."""
    def unescape(s: str) -> str:
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), s)

    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            out.append(MountEntry(unescape(parts[0]), unescape(parts[1]), parts[2], parts[3]))
    return out


def mount_of(path: str, entries: list[MountEntry]) -> MountEntry | None:
    """The deepest mount holding ``path`` (compared by path components; the last mounted wins a tie)."""
    parts = Path(os.path.abspath(path)).parts
    best = None
    for e in entries:
        target = Path(e.target).parts
        if parts[:len(target)] == target and (best is None or len(target) >= len(Path(best.target).parts)):
            best = e
    return best


def lustre_mount(path: str, table: str | None = None) -> MountEntry | None:
    """The Lustre mount ``path`` is on, else None (also when the mount table cannot be read)."""
    if table is None:
        try:
            table = Path(MOUNTS).read_text()
        except OSError:
            return None
    entry = mount_of(path, parse_mount_table(table))
    return entry if entry is not None and entry.fstype == "lustre" else None


def parse_layout(text: str) -> list[tuple[int, int | None, int]]:
    """``lfs getstripe -d`` as components (start, end or None for EOF, stripe count); a plain layout is one."""
    comps: list[tuple[int, int | None, int]] = []
    start, end = 0, None
    for line in text.splitlines():
        first = re.search(r"lcme_extent\.e_start:\s*(\d+)", line)
        last = re.search(r"lcme_extent\.e_end:\s*(\d+|EOF)", line)
        count = re.search(r"(?:lmm_)?stripe_count:\s*(-?\d+)", line)
        if first:
            start = int(first.group(1))
        elif last:
            end = None if last.group(1) == "EOF" else int(last.group(1))
        elif count:
            comps.append((start, end, int(count.group(1))))
            start, end = 0, None
    return comps


def stripe_count_at(layout: list[tuple[int, int | None, int]], size: int) -> int | None:
    """The stripe count of the component that holds the last byte of a ``size``-byte file (-1: every OST)."""
    last = max(size - 1, 0)
    for start, end, count in layout:
        if start <= last and (end is None or last < end):
            return count
    return layout[-1][2] if layout else None


def llama_params(cfg) -> int:
    """A Llama's parameter count from its config's shapes (attention q/k/v/o, the gated MLP, two norms per block,
    the final norm, the embedding, the output head unless tied to it)."""
    h, heads = cfg.hidden_width, cfg.num_heads
    kv = (cfg.num_key_value_heads or heads) * (h // heads)
    block = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size + 2 * h
    embedding = cfg.vocab_size * h
    return cfg.num_layers * block + embedding * (1 if cfg.tie_word_embeddings else 2) + h


def shard_bytes(cfg, ranks: int) -> int:
    """About one rank's checkpoint file: every parameter's FP32 weight and AdamW moments, split over the ranks."""
    return BYTES_PER_PARAM * llama_params(cfg) // max(ranks, 1)


def run_tool(args: list[str], timeout: float = 60.0) -> tuple[int, str]:
    """(exit code, output) of a Lustre tool; 127 when it is not on PATH."""
    exe = shutil.which(args[0])
    if exe is None:
        return 127, f"{args[0]} not found on PATH"
    try:
        proc = subprocess.run([exe, *args[1:]], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return 1, f"{type(e).__name__}: {e}"
    return proc.returncode, proc.stdout if proc.returncode == 0 else (proc.stderr or proc.stdout).strip()[:300]


def lnet_counters(text: str) -> dict[str, dict[str, int]]:
    """Per LNet net type: the sum of its NIs' send_count and recv_count, and how many NIs are not up. Read line by
    line (the YAML lnetctl prints: "- net type:", "- nid:", "status:", "send_count:", "recv_count:"), as
    awsome-distributed-ai's mount_fsx.sh reads it with awk: no YAML library on the host needed."""
    out: dict[str, dict[str, int]] = {}
    sums = None
    for line in text.splitlines():
        key, _, value = line.strip().lstrip("- ").partition(":")
        value = value.strip()
        if key == "net type":
            sums = out.setdefault(value, {"send": 0, "recv": 0, "nis": 0, "down": 0})
        elif sums is None:
            continue
        elif key == "nid":
            sums["nis"] += 1
        elif key == "status" and sums["nis"]:
            sums["down"] += value != "up"
        elif key in ("send_count", "recv_count") and value.isdigit():
            sums[key[:4]] += int(value)
    return out


def test_io(folder: Path, nbytes: int = TEST_BYTES) -> None:
    """Write ``nbytes`` to a file of this process in ``folder`` and read them back, bypassing the page cache where
    the file system allows it (O_DIRECT needs an aligned buffer: an anonymous mmap is page-aligned); the file is
    removed. Raises OSError."""
    path = folder / f".lustre-check-{os.uname().nodename}-{os.getpid()}"
    buf = mmap.mmap(-1, 2**20)
    direct = getattr(os, "O_DIRECT", 0)
    try:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o600)
        except OSError:  # a file system without O_DIRECT (not Lustre): a plain write and fsync
            fd, direct = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 0
        try:
            for _ in range(nbytes // len(buf)):
                os.write(fd, buf)
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | direct)
        try:
            while os.readv(fd, [buf]) > 0:
                pass
        finally:
            os.close(fd)
    finally:
        buf.close()
        if path.exists():
            path.unlink()


OK, WARN, FAIL = "OK", "WARN", "FAIL"


def existing(path: str) -> Path:
    """``path`` or its nearest existing parent (where a folder not made yet inherits its layout from)."""
    p = Path(path).expanduser().resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def stripe_finding(folder: Path, shard: int | None) -> tuple[str, str]:
    """The stripe count new files in ``folder`` get, against one rank's checkpoint shard."""
    code, out = run_tool(["lfs", "getstripe", "-d", str(folder)])
    if code == 127:
        return WARN, (f"stripe count not checked: {out} (no Lustre client tools here, e.g. in the image); on the "
                      f"host: lfs getstripe -d {folder}")
    if code != 0:
        return FAIL, f"lfs getstripe -d {folder} failed ({out}): the file system does not answer"
    layout = parse_layout(out)
    count = stripe_count_at(layout, shard or 1)
    if count is None:
        return WARN, f"no stripe count in the output of lfs getstripe -d {folder}"
    what = "every OST" if count == -1 else f"{count} OST(s)"
    if shard is None:
        return OK, f"new files in {folder} are striped over {what} (shard size unknown without train flags)"
    if count == 1 and shard >= BIG_SHARD:
        return WARN, (f"each rank's checkpoint shard (~{shard / GIB:.1f} GiB) would be written to 1 OST (stripe count "
                      f"1 in {folder}): slow saves and loads; before the first save run: {FIX.format(dir=folder)}")
    return OK, f"a ~{shard / GIB:.2f} GiB checkpoint shard is striped over {what}"


def lnet_finding(folder: Path) -> tuple[str, str]:
    """Whether a test write and read in ``folder`` moved LNet's EFA counters (module docstring)."""
    code, out = run_tool(["lnetctl", "net", "show", "-v"])
    if code == 127:
        return WARN, f"LNet not checked: {out} (no Lustre client tools here); on the host: lnetctl net show -v"
    if code != 0:
        return WARN, f"LNet not checked: lnetctl net show -v failed ({out})"
    before = lnet_counters(out)
    efa = before.get("efa")
    if not efa or not efa["nis"]:
        return OK, ("LNet has no EFA net: this client reaches the file system over TCP (FSx guide, \"Configuring "
                    "EFA clients\", when the file system has EFA enabled)")
    if efa["down"]:
        return FAIL, f"{efa['down']} of LNet's {efa['nis']} EFA NI(s) are down: Lustre falls back to TCP"
    try:
        test_io(folder)
    except OSError as e:
        return FAIL, f"the {TEST_BYTES // 2**20} MiB test write in {folder} failed: {e.strerror or e}"
    code, out = run_tool(["lnetctl", "net", "show", "-v"])
    after = lnet_counters(out) if code == 0 else {}
    moved = {k: {c: after.get(k, {}).get(c, 0) - v[c] for c in ("send", "recv")} for k, v in before.items()}
    tcp = moved.get("tcp", {"send": 0, "recv": 0})
    if moved["efa"]["send"] > 0 or moved["efa"]["recv"] > 0:
        return OK, (f"LNet over EFA: the {TEST_BYTES // 2**20} MiB test moved efa send_count +{moved['efa']['send']}, "
                    f"recv_count +{moved['efa']['recv']} (tcp +{tcp['send']}/+{tcp['recv']})")
    return WARN, (f"the {TEST_BYTES // 2**20} MiB test moved no EFA counter (tcp send_count +{tcp['send']}, recv_count "
                  f"+{tcp['recv']}): Lustre fell back to TCP; check that the security groups allow EFA traffic with "
                  "the file system, that it is in this AZ and has EFA enabled (awsome-distributed-ai#989)")


def worst(statuses) -> str:
    statuses = list(statuses)
    return FAIL if FAIL in statuses else WARN if WARN in statuses else OK


def from_report(path: str) -> tuple[str, int | None] | None:
    """(folder, shard bytes) that preflight's lustre check recorded in its JSON report, or None (not on Lustre, or
    no report)."""
    import json

    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    data = next((c.get("data") for c in report.get("checks") or [] if c.get("name") == "lustre"), None)
    return (str(data["folder"]), data.get("shard_bytes")) if isinstance(data, dict) and data.get("folder") else None


def main(argv: list[str] | None = None) -> int:
    """The stripe and LNet findings with this host's tools, for the folder and shard preflight reported (or given):
    one line; exit 1 on a FAIL."""
    p = argparse.ArgumentParser(prog="python3 -m llama_fp8.cluster.nodes.lustre",
                                description="FSx for Lustre with this host's lfs and lnetctl: the stripe count new "
                                            "files in a folder get against one rank's shard, and LNet over EFA.")
    p.add_argument("--from_report", help="preflight's JSON report: the folder and shard its lustre check recorded")
    p.add_argument("--folder", help="the checkpoint folder (instead of --from_report)")
    p.add_argument("--shard_bytes", type=int, default=None, help="one rank's checkpoint file, in bytes")
    a = p.parse_args(argv)
    found = from_report(a.from_report) if a.from_report else (a.folder, a.shard_bytes) if a.folder else None
    if found is None:
        return 0  # nothing on Lustre (or no report): nothing to check here
    folder = existing(found[0])
    where = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    if lustre_mount(str(folder)) is None:
        print(f"[WARN] lustre (host {where}): {folder} is not on a Lustre mount of this host", flush=True)
        return 0
    findings = [stripe_finding(folder, found[1]), lnet_finding(folder)]
    status = worst(s for s, _ in findings)
    print(f"[{status:>4}] lustre (host {where}): " + "; ".join(m for _, m in findings), flush=True)
    return 1 if status == FAIL else 0


if __name__ == "__main__":
    sys.exit(main())
