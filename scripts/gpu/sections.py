"""The results page's sections, from the last record of each unit: the headline A/B (TE BF16 vs TE FP8 in
interleaved pairs: each pair's speed-up, their geometric mean, MFU, the FP8 check, the loss over the first steps),
the memory (the node's terms from memprobe.py; each estimate against its cell's measured memory), the tests, the
training matrix, what failed. Only what a record holds is printed; nothing is estimated here."""

from __future__ import annotations

import math
from collections import Counter

from units import HEADLINE, HEADLINE_MODEL, VARIANT, VARIANTS
from versions import FIELDS

GIB, MIB = 2**30, 2**20


def fmt(x, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None else format(x, spec) + suffix


def pct(x) -> str:
    return fmt(None if x is None else 100 * x, ".1f", " %")


def speedup(rec: dict | None, base: dict | None) -> float | None:
    """The A/B report's speed-up of ``rec`` over ``base``: the ratio of their samples/s rates (one GPU)."""
    a, b = base and base.get("samples_per_sec"), rec and rec.get("samples_per_sec")
    return b / a if a and b else None


def ratio(x: float | None) -> str:
    return f"{x:.2f}x" if x else "n/a"


def first_line(text: str | None, n: int = 160) -> str:
    line = next((x for x in (text or "").splitlines() if x.strip()), "")
    return line.strip().replace("|", "/")[:n]


def _gib(b) -> str:
    return "n/a" if b is None else (f"{b / GIB:.2f} GiB" if abs(b) >= GIB else f"{b / MIB:.0f} MiB")


def headline_pairs(units: dict[str, dict]) -> list[tuple[int, dict | None, dict | None]]:
    """(pair, BF16 record, FP8 record) of the headline, passed runs only, in pair order."""
    def get(variant: str, pair: int) -> dict | None:
        r = units.get(f"train/{HEADLINE_MODEL}/synthetic/{variant}" + (f"/pair{pair}" if pair > 1 else ""))
        return r if r and r["status"] == "passed" else None

    pairs = sorted({p for _, p in HEADLINE})
    arms = list(dict.fromkeys(v for v, _ in HEADLINE))
    bf16 = next(v for v in arms if not VARIANT[v].fp8)
    fp8 = next(v for v in arms if VARIANT[v].fp8)
    return [(p, get(bf16, p), get(fp8, p)) for p in pairs]


def headline_speedup(units: dict[str, dict]) -> tuple[float | None, int]:
    """The geometric mean of the pairs' FP8/BF16 samples/s ratios (the A/B report's across-pair point), and how
    many pairs it rests on."""
    ratios = [r for _, a, b in headline_pairs(units) if (r := speedup(b, a))]
    return (math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None), len(ratios)


def fp8_check_text(rec: dict | None) -> str:
    check = rec and rec.get("fp8_check")
    if not check:
        return "n/a"
    kernels = (f"; {check['fp8_gemm_kernels']} of {check['gemm_kernel_names']} GEMM kernels named FP8"
               if "gemm_kernel_names" in check else "")
    problems = "; ".join(check.get("problems") or []) or "no problem"
    return (f"{check.get('fp8_linears')}/{check.get('linears')} linears in FP8, "
            f"{100 * (check.get('fp8_flop_share') or 0):.1f} % of linear FLOPs{kernels}; {problems}").replace("|", "/")


def headline_section(units: dict[str, dict]) -> list[str]:
    pairs = headline_pairs(units)
    if not any(a or b for _, a, b in pairs):
        return ["Not measured."]
    point, n = headline_speedup(units)
    out = [f"{HEADLINE_MODEL}, seq 4096, synthetic data, Transformer Engine both arms; pairs run interleaved (bf16 "
           f"fp8, then fp8 bf16; pair i seed 1234 + i - 1). **TE FP8 / TE BF16 samples/s: {fmt(point, '.3f', 'x')}** "
           f"(geometric mean over {n} pair{'s' if n != 1 else ''}{headline_interval(pairs)}).", "",
           "| pair | arm | samples/s | tokens/s/GPU | MFU (BF16 peak) | peak mem GiB | loss at last step | FP8 check |",
           "|---|---|---|---|---|---|---|---|"]
    for pair, bf16, fp8 in pairs:
        for arm, rec in (("te-bf16", bf16), ("te-fp8-current", fp8)):
            if rec is None:
                out.append(f"| {pair} | {arm} | not measured | | | | | |")
                continue
            mfu = rec.get("mfu_vs_bf16_peak")
            out.append(f"| {pair} | {arm} | {fmt(rec.get('samples_per_sec'), '.3f')} | "
                       f"{fmt(rec.get('tokens_per_sec_per_device'), ',.0f')} | "
                       f"{fmt(None if mfu is None else 100 * mfu, '.1f', ' %')} | {fmt(rec.get('mem_peak_gib'), '.1f')} | "
                       f"{fmt(rec.get('last_loss'), '.4f')} (step {rec.get('last_step')}) | "
                       f"{fp8_check_text(rec) if rec.get('fp8') else ''} |")
    return out + ["", *loss_table(pairs)]


def headline_interval(pairs) -> str:
    """The A/B report's interval (report.stats.ratio_ci) when every run of every pair has its windows."""
    from llama_fp8.report.stats import ratio_ci

    arms = [[[x for _, x in rec.get("windows") or []] for rec in (a, b)] for _, a, b in pairs if a and b]
    ci = ratio_ci(arms) if arms and all(all(w) for w in arms) else None
    return "" if ci is None else (f"; 95 % CI {ci.low:.3f}-{ci.high:.3f}, a bootstrap over the pairs and their "
                                  f"{sum(ci.windows)} logged windows after the warm-up, as the A/B report's")


def loss_table(pairs) -> list[str]:
    """The loss over the first steps, each pair's arms side by side (the logged window means)."""
    cols = [(pair, arm, {s: v for s, v in rec.get("losses", [])}) for pair, a, b in pairs
            for arm, rec in (("bf16", a), ("fp8", b)) if rec]
    steps = sorted({s for _, _, losses in cols for s in losses})
    if not steps:
        return []
    return ["Loss over the first steps (the mean of each logging window):", "",
            "| step | " + " | ".join(f"pair {p} {arm}" for p, arm, _ in cols) + " |", "|---" * (len(cols) + 1) + "|",
            *[f"| {s} | " + " | ".join(fmt(losses.get(s), ".4f") for _, _, losses in cols) + " |" for s in steps]]


def memory_section(units: dict[str, dict]) -> list[str]:
    probe = units.get("memory/terms")
    estimates = [r for r in units.values() if r.get("kind") == "estimate"]
    if probe is None and not estimates:
        return ["Not measured."]
    out = []
    if probe is not None and probe["status"] == "passed":
        out += ["Measured by `scripts/gpu/memprobe.py` (one GPU: NCCL on one rank opens no buffers per peer; "
                "those need 2 or more GPUs):", "", "| term | measured |", "|---|---|",
                *[f"| {n.replace('_', ' ')} | {_gib(v)} |" for n, v in probe["probe"].get("terms", {}).items()], ""]
    elif probe is not None:
        out += [f"memory/terms: {probe['status']}: {(probe.get('message') or '').splitlines()[0][:160]}", ""]
    if estimates:
        out += ["`llama_fp8 estimate` of each headline configuration against its runs here (the largest reading over "
                "the pairs):", "",
                "| configuration | estimate: tracked peak | + terms + margin | verdict | max allocated | allocated - "
                "tracked | max reserved | reserved - allocated | nvidia-smi peak | outside the allocator |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(estimates, key=lambda r: r["unit"]):
            if r["status"] != "passed":
                out.append(f"| {r.get('variant')} | {r['status']} | | | | | | | | |")
                continue
            e, m, a = r["estimate"], r.get("measured") or {}, r.get("against") or {}
            pct = a.get("allocated_vs_tracked_pct")
            out.append(f"| {r.get('variant')} | {_gib(e['tracked_peak'])} | {_gib(e['needed'] + e['margin'])} | "
                       f"{e['verdict']} | {_gib(m.get('max_allocated'))} | {_gib(a.get('allocated_minus_tracked'))}"
                       f"{'' if pct is None else f' ({pct:+.1f} %)'} | {_gib(m.get('max_reserved'))} | "
                       f"{_gib(a.get('reserved_minus_allocated'))} | {_gib(m.get('smi_used_peak'))} | "
                       f"{_gib(a.get('outside_allocator'))} |")
    return out


def versions_table(rec: dict | None) -> list[str]:
    if rec is None:
        return ["(no versions record)"]
    v = rec["versions"]
    rows = ["| | |", "|---|---|"] + [f"| {label} | {v.get(name, 'n/a')} |" for name, label in FIELDS]
    return rows + [f"| code | src {rec.get('src_sha')}, git {rec.get('git') or 'n/a'} |"]


def tests_section(units: dict[str, dict]) -> list[str]:
    tests = [r for r in units.values() if r.get("kind") == "test"]
    if not tests:
        return ["No test outcome recorded."]
    counts = Counter(r["status"] for r in tests)
    out = [", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + f" ({len(tests)} tests)", ""]
    other = sorted((r for r in tests if r["status"] != "passed"), key=lambda r: r["nodeid"])
    if other:
        out += ["| test | outcome | message |", "|---|---|---|"]
        out += [f"| `{r['nodeid']}` | {r['status']} | {first_line(r.get('message'))} |" for r in other]
    return out


def train_table(cells: dict[str, dict]) -> list[str]:
    """Each cell; an FP8 cell's speed-up and loss gap against the same implementation in BF16 (same compile)."""
    out = ["| configuration | samples/s | tokens/s/GPU | MFU (BF16 peak) | peak mem GiB | loss at last step | speed-up "
           "vs same-impl BF16 | loss gap |", "|---|---|---|---|---|---|---|---|"]
    for v in (v for v in VARIANTS if v.name in cells):
        rec = cells[v.name]
        if rec["status"] != "passed":
            out.append(f"| {v.name} | {rec['status']}: {first_line(rec.get('message'), 120)} | | | | | | |")
            continue
        base = next((c for c in cells.values() if v.fp8 and c.get("impl") == v.impl and not c.get("fp8")
                     and c.get("compile") == v.compile and c["status"] == "passed"), None)
        gap = (f"{100 * (rec['last_loss'] - base['last_loss']) / base['last_loss']:+.2f} %" if base and
               base.get("last_step") == rec.get("last_step") else "")
        tokens = fmt(rec.get("tokens_per_sec_per_device"), ",.0f")
        out.append(f"| {v.name} | {fmt(rec.get('samples_per_sec'), '.2f')} | {tokens} | "
                   f"{pct(rec.get('mfu_vs_bf16_peak'))} | {fmt(rec.get('mem_peak_gib'), '.1f')} | "
                   f"{fmt(rec.get('last_loss'), '.4f')} (step {rec.get('last_step')}) | "
                   f"{ratio(speedup(rec, base)) if base else ''} | {gap} |")
    return out


def train_section(units: dict[str, dict]) -> list[str]:
    groups: dict[str, dict[str, dict]] = {}
    for r in units.values():
        if r.get("kind") == "train" and r.get("pair", 1) == 1:  # later pairs: the headline's section
            groups.setdefault(r["model"], {})[r["variant"]] = r
    out = [x for model, cells in groups.items() for x in (f"#### {model}", "", *train_table(cells), "")]
    return out + ["Commands: the `command` field of each record in the results file."] if out else ["Not measured."]


def failures_section(units: dict[str, dict]) -> list[str]:
    bad = [r for r in units.values() if r.get("status") in ("failed", "error", "timeout", "interrupted", "unavailable")]
    if not bad:
        return ["Nothing."]
    return [f"- `{r['unit']}`: {r['status']}: {first_line(r.get('reason') or r.get('message'), 200)}" for r in bad]
