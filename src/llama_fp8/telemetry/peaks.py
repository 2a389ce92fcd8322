"""Dense peak tensor-core TFLOPS per GPU SKU: what MFU is measured against.

The convention, stated once: MFU is always reported against the GPU's **dense BF16** peak (log label
``MFU(bf16 peak)``, record key ``mfu_vs_bf16_peak``); FP8 runs are also reported against the **dense FP8**
peak (``MFU(fp8 peak)``, ``mfu_vs_fp8_peak``; MXFP8 runs at the FP8 rate), and NVFP4 runs against the **dense FP4**
peak too (``MFU(fp4 peak)``, ``mfu_vs_fp4_peak``). "Dense" means without 2:4 structured sparsity: NVIDIA's
datasheets print the sparsity figure (twice the dense one) with a footnote, so every figure below is the
datasheet's sparsity figure halved, or its dense figure where it prints one.

A CUDA device name is matched against exact SKU patterns (the whole name, after the "NVIDIA " prefix).
A name that matches no SKU, a name shared by SKUs with different peaks, and a MIG slice (a fraction of
the GPU) give no peak: MFU is ``n/a`` with a hint to pass ``--peak_tflops``, never another GPU's figure.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peak:
    sku: str
    pattern: str  # regex, matched against the whole device name without the "NVIDIA " prefix
    bf16: float  # dense BF16 tensor-core TFLOPS
    fp8: float | None  # dense FP8 tensor-core TFLOPS (MXFP8 runs at the same rate); None: no FP8 tensor cores
    source: str  # the NVIDIA document the figures come from
    fp4: float | None = None  # dense FP4 (NVFP4) tensor-core TFLOPS; None: no FP4 tensor cores, or no figure


_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
PEAKS: tuple[Peak, ...] = (
    Peak("H100 SXM", r"H100 (SXM\S* )?\d+GB HBM3|H100 SXM\S*( \d+GB)?", 989.4, 1978.9,
         f"{_H100}, H100 SXM column (1,979 / 3,958 with sparsity)"),
    Peak("H100 PCIe", r"H100 PCIe( \d+GB)?", 756.0, 1513.0, f"{_H100}, H100 PCIe column (1,513 / 3,026 with sparsity)"),
    Peak("H100 NVL", r"H100 NVL( \d+GB)?", 835.5, 1670.5, f"{_H100}, H100 NVL column (1,671 / 3,341 with sparsity)"),
    Peak("H200 SXM", r"H200( \d+GB HBM3e| SXM\S*)?", 989.4, 1978.9,
         f"{_H200}, H200 SXM column (1,979 / 3,958 with sparsity)"),
    Peak("H200 NVL", r"H200 NVL( \d+GB)?", 835.5, 1670.5, f"{_H200}, H200 NVL column (1,671 / 3,341 with sparsity)"),
    Peak("H20", r"H20( \d+GB)?( HBM3e?)?", 148.0, 296.0,
         "NVIDIA HGX H20 product brief (dense figures; no public datasheet)"),
    Peak("GH200", r"GH200( \d+GB?)?( HBM3e?)?", 989.4, 1978.9,
         "NVIDIA GH200 Grace Hopper Superchip datasheet (1,979 / 3,958 with sparsity)"),
    Peak("B200", r"B200( \S+)*", 2250.0, 4500.0,
         "NVIDIA HGX B200 / DGX B200 datasheet, per GPU (BF16 / FP8 / FP4: 4.5 / 9 / 18 PFLOPS with sparsity)",
         fp4=9000.0),
    Peak("GB200", r"GB200( \S+)*", 2500.0, 5000.0,
         "NVIDIA GB200 NVL72 datasheet, per Blackwell GPU (BF16 / FP8 / FP4: 5 / 10 / 20 PFLOPS with sparsity)",
         fp4=10000.0),
    # Blackwell Ultra's dense FP4 figures differ between the documents found (13.5, 14 and 15 PFLOPS per GPU): no
    # FP4 peak until one datasheet settles it (MFU vs the FP4 peak is then n/a; --peak_tflops gives one).
    Peak("B300", r"B300( \S+)*", 2250.0, 4500.0,
         "NVIDIA HGX B300 datasheet, per GPU (4.5 / 9 PFLOPS with sparsity)"),
    Peak("GB300", r"GB300( \S+)*", 2500.0, 5000.0,
         "NVIDIA GB300 NVL72 datasheet, per Blackwell Ultra GPU (5 / 10 PFLOPS with sparsity)"),
    Peak("L40S", r"L40S", 362.05, 733.0, "NVIDIA L40S datasheet (733 / 1,466 with sparsity)"),
    Peak("L4", r"L4", 121.0, 242.5, "NVIDIA L4 datasheet (242 / 485 with sparsity)"),
    Peak("A100", r"A100([- ](SXM4?|PCIE|PCIe|\d+GB))*", 312.0, None,
         "NVIDIA A100 Tensor Core GPU datasheet, SXM and PCIe (624 with sparsity; no FP8)"),
)

FLOPS_CONVENTION = "6*N + 12*layers*heads*head_dim*seq per token: causal attention counted in full (not halved)"
HINT = "pass --peak_tflops DENSE_BF16_TFLOPS to measure MFU against your GPU's datasheet peak"


def lookup(device_name: str) -> tuple[Peak | None, str]:
    """(the SKU's peaks, "") for a CUDA device name, or (None, why there is none)."""
    name = re.sub(r"^NVIDIA\s+", "", device_name.strip())
    if re.search(r"\bMIG\b", name):
        return None, f"{device_name!r} is a MIG slice (a fraction of the GPU's peak)"
    hits = [p for p in PEAKS if re.fullmatch(p.pattern, name)]
    if len({(p.bf16, p.fp8) for p in hits}) > 1:  # a pattern overlap that would pick between two peaks
        return None, f"{device_name!r} is ambiguous between {', '.join(p.sku for p in hits)}"
    if not hits:
        return None, f"{device_name!r} is not a GPU SKU in the peak table (or its name is ambiguous)"
    return hits[0], ""


def resolve(device_name: str | None, override: float | None) -> tuple[float | None, float | None, str]:
    """(dense BF16 peak, dense FP8 peak, where they come from) for a device (None: CPU).
    ``override`` (--peak_tflops) is the dense BF16 peak; FP8's is taken as twice that, as on every GPU
    generation with FP8 tensor cores so far."""
    if override:
        return override, 2.0 * override, "--peak_tflops"
    if device_name is None:
        return None, None, "cpu: no peak"
    peak, why = lookup(device_name)
    if peak is None:
        log.warning("MFU n/a: %s; %s", why, HINT)
        return None, None, f"n/a: {why}"
    return peak.bf16, peak.fp8, f"{peak.sku}: {peak.source}"


def fp4_peak(device_name: str | None, override: float | None) -> float | None:
    """The dense FP4 peak NVFP4 runs are measured against: the SKU's, or with ``override`` (--peak_tflops, the dense
    BF16 peak) four times that, as on B200 and GB200; None on CPU, an unknown GPU or one without an FP4 figure."""
    if override:
        return 4.0 * override
    if device_name is None:
        return None
    peak, _ = lookup(device_name)
    return peak.fp4 if peak is not None else None


def table_markdown() -> str:
    """docs/report.md's table of the peaks MFU is measured against."""
    rows = ["| GPU SKU | dense BF16 TFLOPS | dense FP8 TFLOPS | dense FP4 TFLOPS | source |", "|---|---|---|---|---|"]
    for p in PEAKS:
        rows.append(f"| {p.sku} | {p.bf16:g} | {'-' if p.fp8 is None else f'{p.fp8:g}'} | "
                    f"{'-' if p.fp4 is None else f'{p.fp4:g}'} | {p.source} |")
    return "\n".join(rows)
