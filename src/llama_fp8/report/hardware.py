"""The A/B report's hardware and software block: where each run ran and with what, side by side.

A speed ratio only means "FP8 vs BF16" when everything else is equal. Each run's metrics.jsonl ``meta``
record carries an ``environment`` (telemetry/environment.py: node list, GPU model and driver, image, library
versions, the NCCL network preflight saw); this module compares the two and says "not the same hardware"
when the nodes, GPUs or driver differ, and "not the same software" when the image or a version differs.
A requeued run has one meta record per attempt: all of its attempts' node lists are shown. Across every run of the
A/B (repeats included), the runs that ran on other nodes than the first, or had a spare node swapped in during the
run, are named (``other_hardware``).
"""

from __future__ import annotations

from typing import Any

from llama_fp8.telemetry import peaks
from llama_fp8.telemetry.environment import HARDWARE_KEYS, SOFTWARE_KEYS, differences

NOT_RECORDED = "not recorded"


def node_set(value: Any) -> str:
    """A node list as the set of machines it names: ``llama-fp8 launch`` lists an attempt's nodes in node-rank
    order, which is the order the nodes joined the rendezvous (``n2,n1`` in one arm, ``n1,n2`` in the next on the
    same two nodes): sorted, they compare as the hardware they are. A Slurm range (``n[1-2]``) stays as written."""
    text = str(value)
    return ",".join(sorted(text.split(","))) if "," in text and "[" not in text else text


def _nodes(envs: list[dict[str, Any]]) -> str | None:
    seen = list(dict.fromkeys(node_set(e.get("nodes")) for e in envs if e.get("nodes")))
    return " then ".join(seen) if seen else None


def merged(envs: list[dict[str, Any]]) -> dict[str, Any]:
    """One description per run: the first attempt's, with every attempt's node list."""
    if not envs:
        return {}
    out = dict(envs[0])
    out["nodes"] = _nodes(envs)
    return out


def compare_environments(envs_a: list[dict[str, Any]], envs_b: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's ``environment``: both descriptions and what differs (None: not recorded by a run)."""
    a, b = merged(envs_a), merged(envs_b)
    if not a or not b:
        return {"a": a, "b": b, "same_hardware": None, "same_software": None,
                "hardware_differences": [], "software_differences": []}
    hw, sw = differences(a, b, HARDWARE_KEYS), differences(a, b, SOFTWARE_KEYS)
    return {"a": a, "b": b, "same_hardware": not hw, "same_software": not sw,
            "hardware_differences": hw, "software_differences": sw}


def other_hardware(runs: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]]) -> list[str]:
    """Which runs ran on other hardware than the first: ``(label, environments, swaps)`` per run, the first the
    reference (its first attempt's nodes); a run with another node list in any attempt, or a spare node swapped in
    during it (telemetry/swaps.py), is named with its nodes and swaps."""
    if not runs or not runs[0][1]:
        return []
    ref = node_set(runs[0][1][0].get("nodes"))
    out = []
    for label, envs, swaps in runs:
        seen = list(dict.fromkeys(node_set(e.get("nodes")) for e in envs if e.get("nodes")))
        if swaps or any(n != ref for n in seen):
            said = "; ".join(f"spare {w.get('node_in')} took the place of {w.get('node_out') or 'a node'} before step "
                             f"{w.get('step')}" for w in swaps)
            out.append(f"{label}: nodes {' then '.join(seen) or NOT_RECORDED}" + (f" ({said})" if said else ""))
    return out


def _gpu(e: dict[str, Any]) -> str:
    """"4 x NVIDIA GB200 per node (GB200: 2500 dense BF16 TFLOPS)": the SKU of the peak table MFU is measured
    against (telemetry/peaks.py), where the name is one."""
    if e.get("gpu"):
        peak, _ = peaks.lookup(str(e["gpu"]))
        sku = f" ({peak.sku}: {peak.bf16:g} dense BF16 TFLOPS)" if peak else ""
        return f"{e.get('gpu_count') or '?'} x {e['gpu']} per node{sku}"
    return f"none (CPU: {e.get('cpu') or 'unknown'})"


def _nvlink(e: dict[str, Any]) -> str | None:
    """The NVLink domains preflight saw the job's nodes in, and whether NCCL used them (None: no multi-node NVLink,
    or not recorded)."""
    n = e.get("nvlink_domains")
    if n is None:
        return None
    used = {True: "NCCL used it between nodes", False: "NCCL did NOT use it between nodes",
            None: "NCCL's use not proven"}[e.get("nvlink_used")]
    return f"{n} multi-node NVLink domain{'s' if n != 1 else ''}, {used}"


def _image(e: dict[str, Any]) -> str:
    if not e.get("image"):
        return "none (virtualenv)"
    parts = [f"`{e['image']}`"]
    if e.get("image_digest"):
        parts.append(f"sha256 {str(e['image_digest'])[:16]}...")
    if e.get("image_size"):
        parts.append(f"{e['image_size'] / 2**30:.2f} GiB")
    if e.get("image_mtime"):
        parts.append(f"modified {e['image_mtime']}")
    build = e.get("image_build") or {}
    if build.get("ngc_tag"):
        base = f"stand-in for NGC {build['ngc_tag']} (tests)" if build.get("base") == "stand-in" else \
            f"NGC {build['ngc_tag']}"
        parts.append(f"{base}, EFA installer {build.get('efa_installer') or '?'}")
    return ", ".join(parts)


def _network(e: dict[str, Any]) -> str:
    seen = e.get("nccl_network")
    text = seen + (f" / {e['nccl_provider']}" if e.get("nccl_provider") else "") if seen else "not measured"
    if e.get("preflight_busbw_gbps") is not None:
        text += f", preflight busbw {e['preflight_busbw_gbps']:.1f} GB/s"
    if e.get("nccl_net_requested"):
        text += f" (NCCL_NET={e['nccl_net_requested']})"
    return text


ROWS = (("nodes", lambda e: str(e.get("nodes"))), ("GPU", _gpu), ("NVLink domain", _nvlink),
        ("CPU", lambda e: str(e.get("cpu"))), ("driver", lambda e: str(e.get("driver"))),
        ("image", _image), ("torch", lambda e: str(e.get("torch"))), ("CUDA", lambda e: str(e.get("cuda"))),
        ("NCCL", lambda e: str(e.get("nccl"))), ("Transformer Engine", lambda e: str(e.get("transformer_engine"))),
        ("torchao", lambda e: str(e.get("torchao"))), ("NCCL network", _network))


def verdict_lines(env: dict[str, Any]) -> list[str]:
    """"same hardware" / "not the same hardware: ..." (and the software counterpart)."""
    if env.get("same_hardware") is None:
        return [f"Hardware: {NOT_RECORDED} for both runs (plain logs or an older version): the ratio assumes "
                "the same nodes."]
    hw = ("same hardware (nodes, GPU model and count, driver, CPU, NVLink domains)" if env["same_hardware"] else
          "**not the same hardware**: " + "; ".join(env["hardware_differences"]) +
          " (node quality and placement can move the ratio: use the same-allocation A/B mode)")
    sw = ("same software (image and library versions)" if env["same_software"] else
          "**not the same software**: " + "; ".join(env["software_differences"]))
    return [f"Hardware: {hw}.", "", f"Software: {sw}."]


def markdown(env: dict[str, Any] | None, label_a: str, label_b: str) -> list[str]:
    """The report section (a table and the verdict lines)."""
    if not env:
        return []
    lines = ["## Hardware and software", "", f"| | A: {label_a} | B: {label_b} |", "|---|---|---|"]
    a, b = env.get("a") or {}, env.get("b") or {}
    for name, fmt in ROWS:
        cells = [fmt(e) if e else NOT_RECORDED for e in (a, b)]
        if cells == [None, None]:  # a row only some nodes have (the NVLink domain): left out where neither has it
            continue
        lines.append(f"| {name} | {cells[0] or 'none'} | {cells[1] or 'none'} |")
    other = env.get("other_hardware") or []
    moved = ["", f"Runs on other hardware than {env.get('reference_run') or 'the first'} (a node list that differs, "
             "or a spare node swapped in during the run: its speed is not that of the same nodes): "
             + "; ".join(other) + "."] if other else []
    return lines + [""] + verdict_lines(env) + moved + [""]


def one_line(env: dict[str, Any]) -> str:
    """For the CLI output."""
    if env.get("same_hardware") is None:
        return NOT_RECORDED
    if env["same_hardware"]:
        nvlink = _nvlink(env["a"])
        return f"same ({env['a'].get('nodes')}, {_gpu(env['a'])}{', ' + nvlink if nvlink else ''})"
    return "NOT THE SAME: " + "; ".join(env["hardware_differences"])
