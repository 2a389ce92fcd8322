"""The training loss three ways, on CPU: the cross entropy of the whole logits (what training did before), the same
function compiled (``torch.compile``: Inductor fuses the upcast, log-softmax and their backward, as torchtitan
compiles its loss), and the chunked loss of parallel/loss.py (``output_cross_entropy``: a chunk of tokens at a time,
gradients made in forward). Each runs in a fresh process: hidden states (tokens x hidden) and an output weight
(vocabulary x hidden), forward and backward; reported are the growth of the process's peak RSS over that step (after
a warm-up step, which also compiles), the median time of a step, and the loss and gradients against the whole-logits
loss's. Prints a table, then one JSON line ``{"bench": "loss", ...}`` (its ``ratio``: the chunked loss's peak RSS
growth over the whole logits').

The Transformer Engine model's head is the same ``nn.Linear`` (its loss is this function too), so its numbers are
these; TE's own layers do not run on CPU.

Linux only (the peak RSS is reset after the warm-up through /proc/self/clear_refs).

Run: ``python benchmarks/bench_loss.py [--tokens 8192 --hidden 128 --vocab 32000 --dtype fp32 --steps 2]`` (FP32 logits of
1,000 MiB: four chunks of the chunked loss)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("whole", "compiled", "chunked")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens (rows of the hidden states)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32",
                   help="hidden states and weight (BF16 matmuls are slow on most CPUs)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in a child process
    return p.parse_args(argv)


def run_variant(args: argparse.Namespace) -> dict:
    """In this (fresh) process: warm up, then the peak RSS growth and the time of ``args.steps`` steps."""
    import torch
    from torch.nn import functional

    from llama_fp8.parallel import loss as L

    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    hidden = torch.randn(1, args.tokens, args.hidden).to(dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden) * 0.05).to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens))

    def whole(h, w, y):
        return L.cross_entropy(functional.linear(h, w), y)

    fn = {"whole": whole, "compiled": torch.compile(whole), "chunked": L.output_cross_entropy}[args.variant]

    def step():
        hidden.grad = weight.grad = None
        loss = fn(hidden, weight, labels)
        loss.backward()
        return loss

    t0 = time.perf_counter()
    step()  # warm-up (and compilation)
    warmup = time.perf_counter() - t0
    hidden.grad = weight.grad = None
    before = reset_peak_rss()  # the high-water mark back to what the process holds now (Linux: clear_refs 5)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    grown = peak_rss_kib() - before
    return {"variant": args.variant, "loss": loss.item(), "step_s": statistics.median(times), "warmup_s": warmup,
            "peak_rss_growth_mib": grown / 1024, "grad_hidden": hidden.grad.float().flatten().tolist()[:4096],
            "grad_weight_norm": weight.grad.float().norm().item()}


def peak_rss_kib() -> int:
    """The process's resident high-water mark (VmHWM), KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def reset_peak_rss() -> int:
    """Reset the high-water mark to the current resident size; returns it (KiB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return peak_rss_kib()


def child(args: argparse.Namespace, variant: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--tokens", str(args.tokens), "--hidden",
            str(args.hidden), "--vocab", str(args.vocab), "--dtype", args.dtype, "--steps", str(args.steps)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def distance(a: list[float], b: list[float]) -> float:
    num = sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) ** 0.5
    return num / max(sum(y * y for y in b) ** 0.5, 1e-30)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.variant:
        print(json.dumps(run_variant(args)))
        return 0
    rows = {v: child(args, v) for v in VARIANTS}
    ref = rows["whole"]
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"loss of {args.tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab} ({args.dtype}; FP32 logits "
          f"{logits_mib:.0f} MiB), {args.steps} steps, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'variant':9s} {'peak RSS growth MiB':>19s} {'s/step':>8s} {'warm-up s':>9s} {'loss diff':>10s} "
          f"{'d grad h':>9s} {'grad w norm ratio':>17s}")
    for v in VARIANTS:
        r = rows[v]
        r["loss_diff"] = abs(r["loss"] - ref["loss"])
        r["grad_hidden_distance"] = distance(r["grad_hidden"], ref["grad_hidden"])
        r["grad_weight_norm_ratio"] = r["grad_weight_norm"] / ref["grad_weight_norm"]
    for v in VARIANTS:
        r = rows[v]
        print(f"{v:9s} {r['peak_rss_growth_mib']:19.0f} {r['step_s']:8.3f} {r['warmup_s']:9.1f} {r['loss_diff']:10.2e} "
              f"{r['grad_hidden_distance']:9.2e} {r['grad_weight_norm_ratio']:17.6f}")
        del r["grad_hidden"]
    ratio = rows["chunked"]["peak_rss_growth_mib"] / max(rows["whole"]["peak_rss_growth_mib"], 1e-9)
    print(json.dumps({"bench": "loss", "ratio": round(ratio, 4), "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
                      "dtype": args.dtype, "steps": args.steps, "cpus": os.cpu_count(),
                      "load_avg_1min": round(os.getloadavg()[0], 2), "logits_fp32_mib": round(logits_mib),
                      "rows": {v: {k: (round(x, 6) if isinstance(x, float) else x) for k, x in r.items()}
                               for v, r in rows.items()}}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
