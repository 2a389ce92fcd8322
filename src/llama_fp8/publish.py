"""``llama-fp8 publish REPORT_DIR``: an A/B report (the folder ``llama-fp8 compare`` wrote) as an MLflow run that a
team can find again. The A/B is a parent run: the report's markdown, plots and summary.json are its artifacts, its
verdict is a tag (``verdict``), its speed-up and loss gaps are metrics. Each arm's run is a child: the MLflow run that
training opened (``--mlflow_tracking_uri``; its id is in the run folder's mlflow_run.json), else one made here from the
run folder (config.yaml's params, metrics.jsonl's scalars) or log. Children are tagged with their role
(``ab_role``: baseline or candidate), their pair and the A/B's verdict, so that "which FP8 runs passed last month" is
one query (docs/metrics.md). The report folder remembers its parent run: publishing again updates it. A report of
more than two arms (``compare --arms N``) publishes the same way: one parent, one child per run of every arm, each
child also tagged with its arm (``ab_arm``) and that arm's own loss verdict (``ab_arm_verdict``); the parent gets
each candidate's speed-up (``speedup_<arm>``).

The tracking URI: ``--mlflow_tracking_uri``, else ``MLFLOW_TRACKING_URI``, else the one the arms trained with.
``report/`` stays a reader of run folders; this command only reads what it wrote and the arms' folders.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from llama_fp8.report.runs import CompareError, load_run
from llama_fp8.telemetry import mlflow_tracking as tracking

MAX_SUMMARY_BYTES = 16 << 20
MAX_CONFIG_BYTES = 1 << 20
MAX_ARTIFACT_BYTES = 64 << 20
MAX_ARTIFACTS = 100
ARTIFACT_SUFFIXES = (".md", ".json", ".png")
ROLES = ("baseline", "candidate")


class PublishError(ValueError):
    """Bad input: main() prints it and exits 2."""


class Unreachable(RuntimeError):
    """The tracking store does not answer: main() prints it and exits 1."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama-fp8 publish", allow_abbrev=False, epilog="docs: docs/metrics.md",
                                description="An A/B report as an MLflow run, each arm's run a child of it.")
    p.add_argument("report", metavar="REPORT_DIR", help="the folder `llama-fp8 compare` wrote (summary.json, "
                                                        "report.md, plots)")
    p.add_argument("--mlflow_tracking_uri", help="default: $MLFLOW_TRACKING_URI, else the arms' own")
    p.add_argument("--mlflow_experiment", help=f"default: the arms' own, else {tracking.DEFAULT_EXPERIMENT}")
    p.add_argument("--mlflow_run_name", help="the A/B's run name (default: the A/B folder's name)")
    return p


def _read(path: Path, limit: int, what: str) -> str:
    try:
        if path.stat().st_size > limit:
            raise PublishError(f"{path}: larger than {limit >> 20} MiB; not a {what}")
        return path.read_text(errors="replace")
    except OSError as e:
        raise PublishError(f"{path}: {e.strerror or e} (is it a {what}?)") from None


def read_summary(report_dir: Path) -> dict[str, Any]:
    text = _read(report_dir / "summary.json", MAX_SUMMARY_BYTES, "compare report's summary")
    try:
        summary = json.loads(text)
    except json.JSONDecodeError as e:
        raise PublishError(f"{report_dir / 'summary.json'}: not JSON ({e})") from None
    runs = summary.get("repro", {}).get("runs") if isinstance(summary, dict) else None
    n = per_repeat(summary) if isinstance(summary, dict) else 0
    if summary.get("verdict") not in ("PASS", "FAIL") or not isinstance(runs, list) or not n or len(runs) % n \
            or not runs:
        raise PublishError(f"{report_dir / 'summary.json'}: no verdict or no runs: not written by llama-fp8 compare")
    return summary


def per_repeat(summary: dict[str, Any]) -> int:
    """Runs per repeat: 2 for an A/B pair, ``arms_per_repeat`` for a report of more arms (0: not a valid count)."""
    n = summary.get("arms_per_repeat", 2)
    return n if isinstance(n, int) and not isinstance(n, bool) and 2 <= n <= 8 else 0


def arms(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Each run of the report, per repeat the baseline then the candidates, in order: its source, run folder, config,
    role and arm."""
    n = per_repeat(summary)
    verdicts = {r.get("arm"): r.get("verdict") for r in summary.get("arms") or [] if isinstance(r, dict)}
    out = []
    for i, info in enumerate(summary["repro"]["runs"]):
        source = Path(str(info.get("source")))
        folder = source if source.is_dir() else source.parent if source.name == "metrics.jsonl" else None
        config: dict[str, Any] = {}
        if folder is not None and (folder / "config.yaml").is_file():
            loaded = yaml.safe_load(_read(folder / "config.yaml", MAX_CONFIG_BYTES, "run's config.yaml"))
            config = loaded if isinstance(loaded, dict) else {}
        arm = folder.name if folder is not None else source.stem
        out.append({"name": str(info.get("run") or source.name), "source": source, "folder": folder,
                    "config": config, "role": ROLES[min(i % n, 1)], "pair": i // n + 1, "arm": arm,
                    "arm_verdict": verdicts.get(arm) if n > 2 else None})
    return out


def _tracked_with(runs: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """(tracking URI, experiment) of the first arm that trained with --mlflow_tracking_uri, else (None, None)."""
    for arm in runs:
        asked = arm["config"].get("asked")
        if isinstance(asked, dict) and isinstance(asked.get("mlflow_tracking_uri"), str) and asked["mlflow_tracking_uri"]:
            experiment = asked.get("mlflow_experiment")
            return asked["mlflow_tracking_uri"], experiment if isinstance(experiment, str) and experiment else None
    return None, None


def _get(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...``, None where a level is missing or not a mapping (summary.json may be half-written)."""
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d


def _parent_numbers(summary: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """The A/B's metrics (speed-up, iso-loss speed-up, loss gaps) and params (tolerance, pairs, seeds) from
    summary.json."""
    loss, ab = summary.get("loss") or {}, summary.get("ab") or {}
    metrics = {"speedup": summary.get("speedup"), "train_loss_gap_pct": loss.get("train_gap_pct"),
               "val_loss_gap_pct": loss.get("val_gap_pct"), "pairs": ab.get("pairs")}
    params = {"loss_tolerance_pct": summary.get("loss_tolerance_pct"), "pairs": ab.get("pairs"),
              "seeds": ab.get("seeds"), "baseline": summary.get("run_a", {}).get("label"),
              "candidate": summary.get("run_b", {}).get("label")}
    metrics["iso_loss_speedup"] = _get(summary, "equal_quality", "train", "speedup", "point")
    rows = [r for r in summary.get("arms") or [] if isinstance(r, dict) and isinstance(r.get("arm"), str)]
    if rows:  # more than two arms: each candidate's speed-up, the arms and the repeats
        metrics.update({f"speedup_{r['arm']}": r.get("speedup") for r in rows[1:]}, pairs=summary.get("repeats"))
        ranked = _get(summary, "ranking", "order") or []
        metrics.update({f"iso_loss_speedup_{e['arm']}": e.get("point") for e in ranked
                        if isinstance(e, dict) and isinstance(e.get("arm"), str) and not e.get("baseline")})
        params.update(baseline=rows[0].get("label"), candidate=None, pairs=summary.get("repeats"),
                      arms=",".join(r["arm"] for r in rows))
    return ({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
            {k: v if isinstance(v, str) else json.dumps(v) for k, v in params.items() if v is not None})


def _records(run) -> list[dict[str, Any]]:
    return [*({**r, "type": "train"} for r in run.train), *({**r, "type": "val"} for r in run.val),
            *({**r, "type": "goodput"} for r in run.goodput)]


def _ended(run) -> str:
    """How the run's last attempt ended, as an MLflow status: an attempt without its goodput record (written when it
    closes) was killed before it could close (the process, or its node, gone)."""
    if len(run.goodput) < max(len(run.environments), 1) or not run.goodput:
        return "KILLED"
    return tracking.STATUS.get(str(run.goodput[-1].get("ended")), "FAILED")


def complete(client, run_id: str, arm: dict[str, Any]) -> str | None:
    """A run training opened and never closed (still RUNNING: training was killed, or the server went away during
    the run) gets what metrics.jsonl holds and it lacks (train, validation and goodput records, by step), then the
    status its last attempt ended with (KILLED when it never closed) and an ``incomplete`` tag saying what was filled
    in. Returns that note (None: the run was closed)."""
    if client.get_run(run_id).info.status != "RUNNING":
        return None
    try:
        run = load_run(str(arm["source"]), arm["role"])
    except CompareError as e:
        raise PublishError(str(e)) from None
    logged = {kind: {m.step for m in client.get_metric_history(run_id, key)}
              for kind, key in (("train", "train/loss"), ("val", "val/val_loss"), ("goodput", "goodput/goodput"))}
    missing = [r for r in _records(run) if r.get("step") not in logged[r["type"]]]
    tracking.log_records(client, run_id, missing)
    status = _ended(run)
    steps = sorted({r["step"] for r in missing if r["type"] == "train"})
    note = (f"left RUNNING in MLflow (training or the server stopped before the run was closed): "
            f"{len(steps)} of {len(run.train)} logged training steps filled in from metrics.jsonl"
            f"{f' (steps {steps[0]}-{steps[-1]})' if steps else ''}, closed as {status}")
    client.set_tag(run_id, "incomplete", note)
    client.set_terminated(run_id, status=status)
    return note


def _child(client, uri: str, experiment: str, parent: str, parent_name: str, arm: dict[str, Any]) -> str:
    """The arm's MLflow run: the one training opened on this tracking server (completed from metrics.jsonl when
    training left it open), else the one an earlier publish of this A/B made, else a new one from its folder or log."""
    recorded = tracking.read_run_file(arm["folder"]) if arm["folder"] is not None else None
    if recorded is not None and recorded["tracking_uri"] == uri:
        arm["note"] = complete(client, recorded["run_id"], arm)
        return recorded["run_id"]
    source = str(arm["source"])
    if "'" not in source:
        made = client.search_runs([experiment], max_results=1, filter_string=(
            f"tags.mlflow.parentRunId = '{parent}' and tags.run_dir = '{source}'"))
        if made:
            return made[0].info.run_id
    try:
        run = load_run(str(arm["source"]), arm["role"])
    except CompareError as e:
        raise PublishError(str(e)) from None
    run_id = client.create_run(experiment, run_name=f"{parent_name}/{arm['name']}",
                               tags={"precision": run.label, "run_dir": str(arm["source"])}).info.run_id
    if arm["config"]:
        tracking.log_params(client, run_id, tracking.flat_params(arm["config"]))
    tracking.log_records(client, run_id, _records(run))
    client.set_terminated(run_id, status="FINISHED")
    return run_id


def publish(args: argparse.Namespace) -> dict[str, Any]:
    report_dir = Path(args.report)
    summary = read_summary(report_dir)
    runs = arms(summary)
    arms_uri, arms_experiment = _tracked_with(runs)
    uri = args.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or arms_uri
    if not uri:
        raise PublishError("no MLflow tracking URI: pass --mlflow_tracking_uri (or set MLFLOW_TRACKING_URI; arms "
                           "trained with --mlflow_tracking_uri name theirs)")
    why = tracking.unreachable(uri)  # one request, a few seconds at most: a dead server is said at once
    if why is not None:
        raise Unreachable(f"MLflow at {uri} cannot be used ({why}); nothing was published")
    client = tracking.client(uri)
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    experiment = tracking.experiment_id(client, args.mlflow_experiment or arms_experiment
                                        or tracking.DEFAULT_EXPERIMENT)
    name = args.mlflow_run_name or (report_dir.resolve().parent.name if report_dir.name == "report"
                                    else report_dir.resolve().name)
    verdict = summary["verdict"]
    recorded = tracking.read_run_file(report_dir)
    if recorded is not None and recorded["tracking_uri"] == uri:
        parent = recorded["run_id"]
        client.update_run(parent, status="RUNNING", name=name)
    else:
        parent = client.create_run(experiment, run_name=name).info.run_id
        tracking.write_run_file(report_dir, uri, experiment, parent)
    for key, value in {"kind": "ab", "verdict": verdict, "verdict_line": str(summary.get("verdict_line", ""))}.items():
        client.set_tag(parent, key, value)
    metrics, params = _parent_numbers(summary)
    tracking.log_params(client, parent, params)
    for key, value in metrics.items():
        client.log_metric(parent, key, value)
    artifacts = [p for p in sorted(report_dir.iterdir()) if p.suffix in ARTIFACT_SUFFIXES and p.is_file()
                 and not p.is_symlink() and p.name != tracking.RUN_FILE and p.stat().st_size <= MAX_ARTIFACT_BYTES]
    for path in artifacts[:MAX_ARTIFACTS]:  # what compare writes: report.md, summary.json, a few plots
        client.log_artifact(parent, str(path))
    children = []
    for arm in runs:
        child = _child(client, uri, experiment, parent, name, arm)
        tags = {MLFLOW_PARENT_RUN_ID: parent, "ab_role": arm["role"], "ab_pair": str(arm["pair"]), "ab_verdict": verdict}
        if arm["arm_verdict"] is not None or per_repeat(summary) > 2:
            tags.update(ab_arm=arm["arm"], ab_arm_verdict=str(arm["arm_verdict"] or "baseline"))
        for key, value in tags.items():
            client.set_tag(child, key, value)
        children.append({"run": arm["name"], "role": arm["role"], "run_id": child, "note": arm.get("note")})
    client.set_terminated(parent, status="FINISHED")
    return {"uri": uri, "experiment_id": experiment, "run_id": parent, "verdict": verdict, "children": children}


def main(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed the message naming the flag
        return int(e.code or 0)
    if not Path(args.report).is_dir():
        print(f"publish: error: REPORT_DIR {args.report} is not a folder (give the folder compare wrote)",
              file=sys.stderr)
        return 2
    try:
        done = publish(args)
    except (PublishError, ImportError) as e:
        print(f"publish: error: {e}", file=sys.stderr)
        return 2
    except Unreachable as e:
        print(f"publish: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # the tracking server refused, or went away on the way
        if not type(e).__module__.startswith(("mlflow", "requests", "urllib3")):
            raise
        where = args.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "the arms' tracking URI"
        print(f"publish: error: MLflow at {where}: {tracking.cause(e)}", file=sys.stderr)
        return 1
    print(f"mlflow: A/B run {done['run_id']} ({done['verdict']}) in experiment {done['experiment_id']} at "
          f"{done['uri']}")
    for child in done["children"]:
        print(f"  {child['role']} {child['run']}: run {child['run_id']}")
        if child.get("note"):
            print(f"  warning: {child['run']}'s run was incomplete: {child['note']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
