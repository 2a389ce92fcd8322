"""Which recipe wins at equal quality: the arms of an A/B ranked by their iso-loss speed-up over the first arm (the
BF16 baseline), each with its 95 % interval, and the call the intervals allow.

- Rank: the arms that reach the baseline's final loss by their iso-loss speed-up, highest first; then those that do
  not ("not reached", by their loss gap at the baseline's time, smallest first). The baseline itself stands at 1
  with no interval.
- The call: the top arm (the baseline at 1 included) wins when the low end of its interval lies above the high end
  of every other arm's interval (the baseline's is 1). Otherwise the intervals cannot tell the top arm from those
  whose intervals reach its low end, and the call says so; with no candidate reaching the target, there is nothing
  to rank at equal quality.
"""

from __future__ import annotations

from typing import Any


def entry(arm: str, label: str, eq: dict[str, Any] | None) -> dict[str, Any]:
    """One arm's ranking figures from its equal_quality summary against the first arm (None: the baseline)."""
    if eq is None:
        return {"arm": arm, "label": label, "baseline": True, "reached": True, "point": 1.0, "low": 1.0,
                "high": 1.0, "text": "1 (baseline)", "gap_pct": None}
    part = (eq.get("train") or {}) if eq.get("available") else {}
    if not part.get("available"):
        why = eq.get("why") if not eq.get("available") else part.get("why", "not computed")
        return {"arm": arm, "label": label, "baseline": False, "reached": False, "point": None, "low": None,
                "high": None, "text": f"n/a ({why})", "gap_pct": None}
    sp = part["speedup"]
    gaps = [p["gap_at_end_pct"] for p in part["pairs"] if not p["reached"]]
    return {"arm": arm, "label": label, "baseline": False, "reached": sp["point"] is not None, "point": sp["point"],
            "low": sp["low"], "high": sp["high"], "text": part["text"],
            "gap_pct": sum(gaps) / len(gaps) if gaps else None}


def rank(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """{"order": entries ranked (module docstring), "winner": arm or None, "line": the call in words}."""
    reached = sorted((e for e in entries if e["reached"]), key=lambda e: -e["point"])
    missed = sorted((e for e in entries if not e["reached"]),
                    key=lambda e: e["gap_pct"] if e["gap_pct"] is not None else float("inf"))
    order = reached + missed
    if not any(not e["baseline"] for e in reached):
        return {"order": order, "winner": None,
                "line": "no candidate reaches the baseline's final loss within its steps: nothing to rank at equal "
                        "quality (each one's gap is in the table)"}
    top, others = reached[0], reached[1:]
    low = top["low"] if top["low"] is not None else 0.0  # None: the target missed in part of the draws
    close = [e for e in others if e["high"] is None or e["high"] >= low]
    what = "the baseline" if top["baseline"] else top["arm"]
    if not close:
        beaten = "every candidate's interval below 1" if top["baseline"] else "its interval above every other arm's"
        return {"order": order, "winner": top["arm"],
                "line": f"{what} wins at equal quality ({top['text']}): {beaten}"}
    names = ", ".join("the baseline" if e["baseline"] else e["arm"] for e in close)
    return {"order": order, "winner": None,
            "line": f"cannot tell {what} ({top['text']}) from {names} at equal quality: their intervals overlap"}


def markdown(ranking: dict[str, Any], baseline: str) -> list[str]:
    lines = ["## Ranked at equal quality", "",
             f"Every arm's iso-loss speed-up over {baseline} (the time {baseline} needs for its own final smoothed train "
             f"loss over the time the arm needs for it; 95 % interval over pairs), highest first; arms that do not "
             f"reach it last, by their loss gap at {baseline}'s time.", "",
             "| rank | arm | precision | iso-loss speed-up vs the baseline (95 % CI) |", "|---|---|---|---|"]
    for i, e in enumerate(ranking["order"], 1):
        lines.append(f"| {i} | {e['arm']} | {e['label']} | {e['text']} |")
    return lines + ["", f"**At equal quality: {ranking['line']}**", ""]
