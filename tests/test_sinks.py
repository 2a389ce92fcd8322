"""Metrics where clusters already look: the Prometheus textfile, OTLP and MLflow sinks with their real libraries, the
Grafana dashboard's queries, and a failing sink that never stops training. One 2-rank CPU run (module fixture) feeds
most assertions; its values are checked against its own metrics.jsonl."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import REPO, cli_env, read_metrics
from llama_fp8 import config as C
from llama_fp8 import train as T
from llama_fp8.telemetry import gauges, goodput, otlp, outputs, prometheus, sinks

pytest.importorskip("prometheus_client", reason="the prometheus extra (make installs it)")
pytest.importorskip("mlflow", reason="the mlflow extra (make installs it)")
pytest.importorskip("opentelemetry.sdk", reason="the otlp extra (make installs it)")

GIB = 2**30
JOB = "4242"


class _Receiver(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver on the loopback: keeps each request's body."""

    bodies: list[bytes] = []

    def do_POST(self):  # noqa: N802 - http.server's name
        self.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        return None


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    """One 2-rank CPU run with every exporting sink on (FP8 emulated, FP8 statistics and validation, so that every
    gauge has a value)."""
    base = tmp_path_factory.mktemp("sinks")
    (base / "textfiles").mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Receiver", (_Receiver,), {"bodies": []}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    args = ["--model", "tiny", "--device", "cpu", "--num_layers", "1", "--max_context_width", "32", "--max_steps", "4",
            "--run_dir", str(base / "run"), "--fp8", "1", "--fp8_stats", "2", "--validation_freq", "2",
            "--peak_tflops", "1", "--prometheus_textfile_dir", str(base / "textfiles"),
            "--mlflow_tracking_uri", f"sqlite:///{base}/mlflow.db", "--mlflow_experiment", "fp8-runs",
            "--mlflow_run_name", "arm-b", "--otlp_endpoint", f"http://127.0.0.1:{server.server_port}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "llama_fp8",
           "train", *args]
    env = cli_env(SLURM_JOB_ID=JOB)  # the documented sqlite:/// store: no MLFLOW_ALLOW_FILE_STORE
    env.pop("MLFLOW_ALLOW_FILE_STORE", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    server.shutdown()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = read_metrics(base / "run")
    yield SimpleNamespace(base=base, run_dir=base / "run", records=records, bodies=server.RequestHandlerClass.bodies,
                          mlruns=f"sqlite:///{base}/mlflow.db")


def outputs_run_id(run_dir: Path) -> str:
    return outputs.Origin(run_dir, 0, 0, True, "bf16").run_id


def last(records: list[dict], kind: str) -> dict:
    return [r for r in records if r["type"] == kind][-1]


def expected(records: list[dict], rank: int) -> dict[tuple[str, str | None], float]:
    """What the textfile of ``rank`` must hold, read from metrics.jsonl by the names of docs/metrics.md."""
    train, mine = last(records, "train"), last(records, "train")["ranks"][rank]
    out = {("llama_fp8_memory_high_water_bytes", None): mine["mem_peak_gib"] * GIB,
           **({("llama_fp8_run_info", None): 1.0} if rank == 0 else {}),
           ("llama_fp8_rank_step_seconds", None): mine["step_s"],
           ("llama_fp8_rank_data_wait_seconds", None): mine["data_wait_s"]}
    if rank:
        return out
    named = train["stragglers"]
    fp8 = last(records, "fp8_stats")
    out.update({("llama_fp8_step", None): train["step"], ("llama_fp8_train_loss", None): train["loss"],
                ("llama_fp8_validation_loss", None): last(records, "val")["val_loss"],
                ("llama_fp8_learning_rate", None): train["lr"], ("llama_fp8_grad_norm", None): train["grad_norm"],
                ("llama_fp8_tokens_per_second", None): train["tokens_per_sec"],
                ("llama_fp8_device_tokens_per_second", None): train["tokens_per_sec_per_device"],
                ("llama_fp8_device_flops_per_second", None): train["tflops_per_device"] * 1e12,
                ("llama_fp8_mfu_ratio", "bf16"): train["mfu_vs_bf16_peak"],
                ("llama_fp8_mfu_ratio", "fp8"): train["mfu_vs_fp8_peak"],
                ("llama_fp8_data_wait_ratio", None): train["data_wait_frac"],
                ("llama_fp8_goodput_ratio", None): last(records, "goodput")["goodput"],
                ("llama_fp8_straggler_rank", None): named[0]["rank"] if named else -1,
                ("llama_fp8_stragglers", None): len(named),
                ("llama_fp8_restarts_total", None): last(records, "meta")["restarts"],
                **{("llama_fp8_fp8_underflow_ratio", t): fp8[f"{t}_underflow_max"]
                   for t in ("input", "weight", "grad_output")},
                **{("llama_fp8_fp8_snr_decibels", t): fp8[f"{t}_snr_db_min"] for t in ("input", "weight", "grad_output")}})
    return {k: v for k, v in out.items() if v is not None}  # n/a (MFU of emulated FP8) is left out of the textfile


def parse_textfile(path: Path) -> tuple[dict[tuple[str, str | None], float], list[dict], dict[str, str]]:
    """(values by (sample name, peak/tensor label), every sample's labels, family types) through prometheus_client's
    own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    values, labels, types = {}, [], {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            extra = sample.labels.get("peak") or sample.labels.get("tensor")
            values[(sample.name, extra)] = sample.value
            labels.append(sample.labels)
            types[sample.name] = family.type
    return values, labels, types


@pytest.mark.slow
def test_the_textfile_of_a_2_rank_run_holds_metrics_jsonl_under_prometheus_names(run2):
    final = run2.run_dir / prometheus.FINAL_DIR
    run, run_id = f"{run2.base.name}/run", outputs_run_id(run2.run_dir)
    names = [f"llama_fp8_job{JOB}_{run2.base.name}_run_{run_id}_rank{r}.prom" for r in (0, 1)]
    assert sorted(p.name for p in final.iterdir()) == names
    assert list((run2.base / "textfiles").iterdir()) == []  # removed from the collector's folder at the end
    meta = last(run2.records, "meta")
    for rank in (0, 1):
        values, labels, types = parse_textfile(final / names[rank])
        want = expected(run2.records, rank)
        assert set(values) == set(want)
        assert values == pytest.approx(want, rel=1e-12)
        assert types["llama_fp8_restarts_total"] == "counter" if rank == 0 else "llama_fp8_restarts_total" not in types
        job_labels = {"slurm_job_id": JOB, "node": socket.gethostname(), "run": run, "run_id": run_id,
                      "precision": meta["precision"]}
        for sample_labels in labels:
            assert {k: sample_labels[k] for k in job_labels} == job_labels
        per_rank = [s for s in labels if "rank" in s]
        assert per_rank and all((s["rank"], s["local_rank"]) == (str(rank), str(rank)) for s in per_rank)
    info = [s for s in parse_textfile(final / names[0])[1] if "model" in s]
    assert info == [{**job_labels, "model": "tiny", "model_impl": meta["model_impl"], "device_name": meta["device_name"],
                     "git_commit": meta["repro"]["git_commit"] or ""}]
    # every gauge of the table was exported by this run (the docs' table lists no gauge that never appears), but MFU:
    # FP8 emulated on CPU has no peak to be measured against (n/a); the MFU gauge is proven on a BF16 record below
    assert {name for name, _ in expected(run2.records, 0)} == {g.name for g in gauges.GAUGES} - {"llama_fp8_mfu_ratio"}
    assert last(run2.records, "train")["mfu_vs_bf16_peak"] is None


def test_the_mfu_gauge_carries_each_peaks_ratio_and_leaves_out_what_is_not_measured():
    labels = {k: "x" for k in gauges.JOB_LABELS}
    board = gauges.Board(labels, 0, 0, True)
    assert board.update({"type": "train", "step": 3, "tflops_per_device": 0.5, "mfu_vs_bf16_peak": 0.25,
                         "mfu_vs_fp8_peak": None})
    (mfu,) = [samples for gauge, samples in board.samples() if gauge.name == "llama_fp8_mfu_ratio"]
    assert mfu == [({**labels, "peak": "bf16"}, 0.25)]  # the FP8 peak's ratio is n/a: no sample, not a 0


@pytest.mark.slow
def test_the_documented_sqlite_store_holds_the_runs_params_metrics_and_standard_tags(run2, monkeypatch):
    """docs/metrics.md's route (a sqlite:/// database on the shared file system), without MLFLOW_ALLOW_FILE_STORE."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_USER

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    mlflow.set_tracking_uri(run2.mlruns)
    (run,) = mlflow.search_runs(experiment_names=["fp8-runs"], filter_string="attributes.run_name = 'arm-b'",
                                output_format="list")
    meta = last(run2.records, "meta")
    assert (run.info.run_name, run.info.status) == ("arm-b", "FINISHED")
    assert (run.data.tags["precision"], run.data.tags["slurm_job_id"]) == (meta["precision"], JOB)
    assert run.data.tags[MLFLOW_USER] and run.data.tags[MLFLOW_GIT_COMMIT] == meta["repro"]["git_commit"]
    params = run.data.params
    assert (params["fp8"], params["max_steps"], params["mlflow_run_name"]) == ("true", "4", "arm-b")
    assert (params["resolved.precision.name"], params["resolved.world_size"]) == (meta["precision"], "2")
    history = MlflowClient(run2.mlruns).get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], pytest.approx(r["loss"]))
                                                    for r in run2.records if r["type"] == "train"]
    vals = MlflowClient(run2.mlruns).get_metric_history(run.info.run_id, "val/val_loss")
    assert [m.step for m in vals] == [2, 4]


def otlp_points(bodies: list[bytes]) -> dict[tuple[str, str, str | None], float]:
    """(metric name, rank label or "", peak/tensor label) -> value, from OTLP/HTTP protobuf requests."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    out = {}
    for body in bodies:
        request = ExportMetricsServiceRequest.FromString(body)
        for resource in request.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    points = metric.gauge.data_points or metric.sum.data_points
                    for point in points:
                        attrs = {kv.key: kv.value.string_value for kv in point.attributes}
                        out[(metric.name, attrs.get("rank", ""), attrs.get("peak") or attrs.get("tensor"))] = \
                            point.as_double
    return out


@pytest.mark.slow
def test_otlp_over_http_carries_the_textfiles_gauges_from_every_rank(run2):
    got = otlp_points(run2.bodies)
    want = {}
    for rank in (0, 1):
        for (name, extra), value in expected(run2.records, rank).items():
            want[(name, str(rank) if gauges.BY_NAME[name].per_rank else "", extra)] = value
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.slow
def test_otlp_through_the_sdks_in_memory_reader_holds_the_same_values(run2):
    """The SDK's InMemoryMetricReader in place of the OTLP exporter, fed rank 0's records of the run."""
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    board = gauges.Board({"slurm_job_id": JOB, "node": "n1", "run": "run", "run_id": "ab12cd34", "precision": "fp8"},
                         0, 0, True)
    sink = otlp.OtlpSink(None, board, reader=reader)
    for rec in run2.records:
        sink.write(rec)
    got = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    assert point.attributes["slurm_job_id"] == JOB and point.attributes["node"] == "n1"
                    got[(metric.name, point.attributes.get("peak") or point.attributes.get("tensor"))] = point.value
    sink.close("finished")
    assert got == pytest.approx(expected(run2.records, 0), rel=1e-12)


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "label_values"}


def dashboard_queries() -> list[str]:
    dash = json.loads((REPO / "dashboards" / "llama-fp8.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def names_and_labels(expr: str) -> tuple[set[str], set[str]]:
    """The metric names a PromQL expression reads and the label names it matches or groups by."""
    labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", " ".join(re.findall(r"\{([^}]*)\}", expr))))
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels.update(x.strip() for x in group.split(",") if x.strip())
    labels.update(re.findall(r"label_values\([^,]+,\s*(\w+)\)", expr))
    bare = re.sub(r'"[^"]*"|\{[^}]*\}|\[[^\]]*\]|\b(?:by|without|on|ignoring)\s*\([^)]*\)', " ", expr)
    bare = re.sub(r",\s*\w+\)", ")", bare)  # label_values(metric, label): the label is not a metric
    return {w for w in re.findall(r"\b[a-zA-Z_:][\w:]*\b(?!\s*\()", bare) if w not in PROMQL_WORDS}, labels


@pytest.mark.slow
def test_the_dashboards_queries_name_only_metrics_and_labels_the_textfile_writes(run2):
    written, labels = set(), set()
    for path in (run2.run_dir / prometheus.FINAL_DIR).iterdir():
        values, sample_labels, _ = parse_textfile(path)
        written |= {name for name, _ in values}
        labels |= {k for s in sample_labels for k in s}
    written.add("llama_fp8_mfu_ratio")  # n/a in this run (FP8 emulated); its samples: test_the_mfu_gauge_carries_...
    used = [names_and_labels(e) for e in dashboard_queries()]
    assert len(used) > 20
    assert set().union(*(n for n, _ in used)) <= written
    assert set().union(*(lab for _, lab in used)) <= labels
    assert {"llama_fp8_train_loss", "llama_fp8_mfu_ratio", "llama_fp8_memory_high_water_bytes"} <= \
        set().union(*(n for n, _ in used))


def test_the_query_reader_finds_a_name_the_textfile_lacks():
    names, labels = names_and_labels('sum by (node) (rate(DCGM_FI_DEV_GPU_UTIL{hpc_job=~"$job"}[5m]))')
    assert (names, labels) == ({"DCGM_FI_DEV_GPU_UTIL"}, {"node", "hpc_job"})


def test_gauge_names_follow_prometheus_conventions():
    for g in gauges.GAUGES:
        assert re.fullmatch(r"llama_fp8_[a-z0-9_]+", g.name), g.name
        assert g.name.endswith("_total") == g.counter, g.name
        assert not re.search(r"(gib|_ms|milliseconds|tflops|percent)", g.name), f"{g.name}: not a base unit"
        if "second" in g.name:
            assert g.name.endswith(("_seconds", "_per_second")), g.name
        if "bytes" in g.name or "ratio" in g.name:
            assert g.name.endswith(("_bytes", "_ratio")), g.name


def test_the_textfile_is_written_by_rename_and_leaves_the_collector_folder_at_the_end(tmp_path, monkeypatch):
    renames = []
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append((a, b)), real(a, b))[1])
    (tmp_path / "collector").mkdir()
    board = gauges.Board({"slurm_job_id": "7", "node": "n", "run": "r", "run_id": "0", "precision": "bf16"}, 0, 0, True)
    name = prometheus.file_name("7", "runs/a b", 0)
    assert name == "llama_fp8_job7_runs_a_b_rank0.prom"
    sink = prometheus.TextfileSink(str(tmp_path / "collector"), board, tmp_path / "run", name)
    sink.write({"type": "train", "step": 5, "loss": 2.5, "ranks": [{"step_s": 0.1, "data_wait_s": 0.0,
                                                                    "mem_peak_gib": 1.0}]})
    (tmp, final), = renames
    assert Path(final) == tmp_path / "collector" / name and not Path(tmp).name.endswith(".prom")
    assert Path(tmp).parent == Path(final).parent  # a rename within one file system: atomic
    assert parse_textfile(Path(final))[0][("llama_fp8_train_loss", None)] == 2.5
    sink.write({"type": "train", "step": 5, "loss": 2.5})  # nothing changed: no write
    assert len(renames) == 1
    sink.close("finished")
    assert list((tmp_path / "collector").iterdir()) == []
    assert parse_textfile(tmp_path / "run" / "prometheus" / name)[0][("llama_fp8_step", None)] == 5


def tiny(tmp_path, *extra: str) -> C.TrainConfig:
    return C.parse_args(["--model", "tiny", "--device", "cpu", "--num_layers", "1", "--max_context_width", "32",
                         "--max_steps", "4", "--run_dir", str(tmp_path / "run"), *extra])


def test_a_sink_failing_mid_run_leaves_training_and_the_other_records_intact(tmp_path, monkeypatch, capsys):
    """A full disk under the textfile from its third write on, and an MLflow server that is not there: each is
    reported once, training finishes, metrics.jsonl and TensorBoard get every record, the stale textfile is gone."""
    import prometheus_client
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    real, calls = prometheus_client.write_to_textfile, []

    def disk_full(path, registry, *a, **kw):
        calls.append(path)
        if len(calls) >= 3:
            raise OSError(28, "No space left on device")
        return real(path, registry, *a, **kw)

    monkeypatch.setattr(prometheus_client, "write_to_textfile", disk_full)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    (tmp_path / "collector").mkdir()
    code = T.run(tiny(tmp_path, "--prometheus_textfile_dir", str(tmp_path / "collector"), "--tensorboard_dir",
                      str(tmp_path / "tb"), "--mlflow_tracking_uri", f"http://127.0.0.1:{port}"))
    assert code == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run") if r["type"] == "train"] == [1, 2, 3, 4]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    # (training's logging setup replaces the root handlers, so the warnings are read where it prints them)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "llama_fp8.metrics" in line]
    assert len([w for w in warnings if "prometheus textfile failed" in w and "No space left" in w]) == 1, warnings
    # the server is checked once at start: one warning naming it and the cause, then no MLflow sink at all
    assert len([w for w in warnings if "mlflow" in w]) == 1, warnings
    assert len([w for w in warnings if f"MLflow at http://127.0.0.1:{port} cannot be used" in w and "refused" in w]) == 1
    assert len(calls) == 3 and list((tmp_path / "collector").iterdir()) == []


@pytest.mark.parametrize("flag, value, module, extra", [
    ("--prometheus_textfile_dir", ".", "prometheus_client", "prometheus"),
    ("--mlflow_tracking_uri", "http://127.0.0.1:5000", "mlflow", "mlflow"),
    ("--otlp_endpoint", "http://127.0.0.1:4318", "opentelemetry.sdk.metrics", "otlp"),
])
def test_a_missing_package_is_a_config_error_before_training(tmp_path, monkeypatch, capsys, flag, value, module,
                                                             extra):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    assert T.run(tiny(tmp_path, flag, value)) == 2
    err = capsys.readouterr().err
    assert f"{flag} needs" in err and f"pip install 'llama-fp8[{extra}]'" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_textfile_folder_or_otlp_endpoint_that_cannot_work_is_a_config_error(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert T.run(tiny(tmp_path, "--prometheus_textfile_dir", str(tmp_path / "file"))) == 2
    assert f"--prometheus_textfile_dir {tmp_path / 'file'} is not a folder" in capsys.readouterr().err
    assert T.run(tiny(tmp_path, "--otlp_endpoint", "localhost:4318")) == 2
    assert "--otlp_endpoint 'localhost:4318': give the http(s) URL" in capsys.readouterr().err
    assert otlp.endpoint_url("http://c:4318") == "http://c:4318/v1/metrics"
    assert otlp.endpoint_url("https://c/otlp/v1/metrics") == "https://c/otlp/v1/metrics"


def test_restarts_count_the_earlier_attempts_of_a_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert goodput.earlier_attempts(path) == 0
    lines = [{"type": "meta"}, {"type": "train", "step": 1}, {"type": "meta"}, {"type": "train", "step": 1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert goodput.earlier_attempts(path) == 2  # older runs' meta records without a count
    path.write_text(path.read_text() + json.dumps({"type": "meta", "restarts": 6}) + "\n")
    assert goodput.earlier_attempts(path) == 7  # the last attempt's own count + 1 (a tail may miss older ones)


def test_the_sinks_flags_are_recorded_in_config_yaml(tmp_path):
    cfg = tiny(tmp_path, "--mlflow_experiment", "e1", "--mlflow_run_name", "r1")
    asked = C.asked(cfg)
    assert (asked["mlflow_experiment"], asked["mlflow_run_name"], asked["prometheus_textfile_dir"]) == ("e1", "r1",
                                                                                                          None)
    assert {f.name for f in dataclasses.fields(cfg)} >= {"prometheus_textfile_dir", "otlp_endpoint",
                                                         "mlflow_tracking_uri", "mlflow_experiment", "mlflow_run_name"}


@pytest.mark.slow
def test_publish_makes_the_ab_a_parent_run_with_its_report_and_each_arm_a_child(run2, tmp_path, monkeypatch, capsys):
    """The 2-rank FP8 run (tracked in MLflow while it trained) against a BF16 run that was not: the A/B's report as the
    parent's artifacts, its verdict a tag, the tracked arm made a child, the other one's run made from its folder."""
    import mlflow
    from mlflow import MlflowClient

    from llama_fp8 import publish
    from llama_fp8.report import compare

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert T.run(tiny(tmp_path)) == 0
    report = tmp_path / "report"
    assert compare.main([str(tmp_path / "run"), str(run2.run_dir), "--out", str(report)]) == 0
    summary = json.loads((report / "summary.json").read_text())
    # no tracking URI given: the one the FP8 arm trained with, and its experiment
    assert publish.main([str(report), "--mlflow_run_name", "ab-1"]) == 0
    assert publish.main([str(report), "--mlflow_run_name", "ab-1"]) == 0  # again: the same parent, updated
    client = MlflowClient(run2.mlruns)
    mlflow.set_tracking_uri(run2.mlruns)
    (parent,) = mlflow.search_runs(experiment_names=["fp8-runs"], filter_string="tags.kind = 'ab'", output_format="list")
    assert (parent.info.run_name, parent.info.status) == ("ab-1", "FINISHED")
    assert parent.data.tags["verdict"] == summary["verdict"]
    assert parent.data.metrics["speedup"] == pytest.approx(summary["speedup"])
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"report.md", "summary.json"} <= artifacts and any(a.endswith(".png") for a in artifacts)
    children = mlflow.search_runs(experiment_names=["fp8-runs"], output_format="list",
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_role = {c.data.tags["ab_role"]: c for c in children}
    assert set(by_role) == {"baseline", "candidate"} and len(children) == 2
    trained = json.loads((run2.run_dir / "mlflow_run.json").read_text())["run_id"]
    assert by_role["candidate"].info.run_id == trained  # the run training opened, not a copy
    base = by_role["baseline"]
    assert (base.data.params["fp8"], base.data.tags["precision"]) == ("false", "bf16")
    history = client.get_metric_history(base.info.run_id, "train/loss")
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in read_metrics(tmp_path / "run")
                                                        if r["type"] == "train"])
    # "which FP8 runs passed": one query
    found = mlflow.search_runs(experiment_names=["fp8-runs"], output_format="list", filter_string=(
        f"tags.ab_role = 'candidate' and tags.ab_verdict = '{summary['verdict']}' and tags.precision LIKE 'fp8%'"))
    assert [r.info.run_id for r in found] == [trained]
    assert f"({summary['verdict']})" in capsys.readouterr().out


def test_publish_without_a_tracking_uri_or_report_says_what_to_pass(tmp_path, monkeypatch, capsys):
    from llama_fp8 import publish

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert publish.main([str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text(json.dumps({"verdict": "PASS", "repro": {"runs": [
        {"source": str(tmp_path / "a")}, {"source": str(tmp_path / "b")}]}}))
    assert publish.main([str(tmp_path)]) == 2
    assert "no MLflow tracking URI: pass --mlflow_tracking_uri" in capsys.readouterr().err
    (tmp_path / "summary.json").write_text("{}")
    assert publish.main([str(tmp_path), "--mlflow_tracking_uri", "file:///x"]) == 2
    assert "not written by llama-fp8 compare" in capsys.readouterr().err


def test_two_runs_whose_folders_share_a_name_write_two_files_and_two_series(tmp_path):
    """Outside Slurm, /a/x/run and /b/x/run (or an A/B's pair1/bf16 and pair2/bf16 in one job) were one textfile and
    one series (run="run" / run="bf16"): the step flipped between them. Now the run label is the folder's parent and
    name, and run_id a hash of its path; the file is named by both."""
    origins = [outputs.Origin.here(tmp_path / side / "x" / "run", 0, 0, True, "bf16", env={}) for side in ("a", "b")]
    pairs = [outputs.Origin.here(tmp_path / "ab" / f"pair{i}" / "bf16", 0, 0, True, "bf16", env={"SLURM_JOB_ID": "9"})
             for i in (1, 2)]
    assert [o.labels()["run"] for o in pairs] == ["pair1/bf16", "pair2/bf16"]
    for one, two in (origins, pairs):
        assert one.labels() != two.labels() and one.labels()["run_id"] != two.labels()["run_id"]
    (tmp_path / "collector").mkdir()
    for o in origins + pairs:
        cfg = tiny(tmp_path, "--prometheus_textfile_dir", str(tmp_path / "collector"))
        writer = outputs.open_writer(cfg, dataclasses.replace(o, is_main=False), {})
        writer.write({"type": "train", "step": 3, "ranks": [{"step_s": 0.1, "data_wait_s": 0.0, "mem_peak_gib": 1.0}]})
    files = sorted(p.name for p in (tmp_path / "collector").iterdir())
    assert len(files) == 4 and any(f.startswith("llama_fp8_job9_pair2_bf16_") for f in files), files


def test_otlp_honours_the_standard_environment_for_its_service_name(monkeypatch):
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    board = gauges.Board({"slurm_job_id": JOB, "node": "n1", "run": "r", "run_id": "1", "precision": "bf16"}, 0, 0, True)
    names = {}
    for env in ({}, {"OTEL_SERVICE_NAME": "team-train"}, {"OTEL_RESOURCE_ATTRIBUTES": "service.name=x,team=y"}):
        for key in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        sink = otlp.OtlpSink(None, board, reader=InMemoryMetricReader())
        names[tuple(env)] = dict(sink.provider._sdk_config.resource.attributes)
        sink.close("finished")
    assert names[()]["service.name"] == "llama-fp8"  # before: llama-fp8 over the user's own name
    assert names[("OTEL_SERVICE_NAME",)]["service.name"] == "team-train"
    assert (names[("OTEL_RESOURCE_ATTRIBUTES",)]["service.name"], names[("OTEL_RESOURCE_ATTRIBUTES",)]["team"]) == ("x", "y")


@pytest.mark.slow
def test_an_otlp_endpoint_that_is_down_is_one_warning_per_job_without_the_librarys_lines(capfd, monkeypatch):
    """Rank 0 says it once, with the exporter's own reason; another rank says nothing; none of the exporter's lines.
    The exporter's standard timeout (its retries included) cut to 1 s: the test waits on no retry schedule."""
    import logging

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", "1")

    logging.getLogger().handlers.clear()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    for rank in (0, 1):
        board = gauges.Board({"slurm_job_id": JOB, "node": "n1", "run": "r", "run_id": "1", "precision": "bf16"}, rank,
                             rank, rank == 0)
        sink = otlp.OtlpSink(url, board)
        sink.write({"type": "train", "step": 1, "loss": 2.0, "ranks": [{"step_s": 0.1}, {"step_s": 0.1}]})
        sink.provider.force_flush(5_000)
        sink.provider.force_flush(5_000)
        sink.provider.shutdown(timeout_millis=2_000)
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len([ln for ln in lines if "metrics sink otlp" in ln]) == 1, lines
    (ours,) = [ln for ln in lines if "metrics sink otlp" in ln]
    assert f"export to {url}/v1/metrics failed (" in ours and "no reason given" not in ours, ours
    assert not [ln for ln in lines if "opentelemetry" in ln or "Retrying" in ln], lines


@pytest.mark.slow
def test_an_mlflow_file_store_without_the_opt_out_is_one_warning_at_start_saying_what_to_use(tmp_path, monkeypatch,
                                                                                            capsys):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    assert T.run(tiny(tmp_path, "--mlflow_tracking_uri", uri)) == 0
    warnings = [ln for ln in capsys.readouterr().err.splitlines() if "mlflow" in ln.lower()]
    assert len(warnings) == 1 and f"MLflow at {uri} cannot be used" in warnings[0], warnings
    assert "sqlite:///<folder>/mlflow.db" in warnings[0] and "MLFLOW_ALLOW_FILE_STORE=true" in warnings[0]


def test_the_dashboards_per_rank_panels_name_the_run_and_one_panel_compares_fp8_with_bf16():
    dash = json.loads((REPO / "dashboards" / "llama-fp8.json").read_text())
    per_rank = [t for p in dash["panels"] for t in p.get("targets", []) if "{{rank}}" in t.get("legendFormat", "")]
    assert len(per_rank) == 3 and all("{{run}}" in t["legendFormat"] for t in per_rank)
    (ratio,) = [p for p in dash["panels"] if p["title"].startswith("FP8 over BF16")]
    expr = ratio["targets"][0]["expr"]
    assert 'precision!="bf16"' in expr and 'precision="bf16"' in expr and " / " in expr


class _Slow(sinks.Sink):
    """A sink that takes ``start_s`` to be made (a new sqlite store creating its tables) and records what it got."""

    def __init__(self, got: list, start_s: float):
        time.sleep(start_s)
        self.got = got

    def write(self, rec: dict, line: str | None = None) -> None:
        self.got.append(rec["step"])

    def close(self, ended: str) -> None:
        self.got.append(ended)


def test_a_sink_still_starting_at_the_end_of_a_short_run_gets_its_start_bound_then_its_close_bound():
    """A 4-step run on a busy node ended before its MLflow sink had created its sqlite store's tables; the close
    waited its 5 s for a sink that had not started, and the run stayed RUNNING in MLflow (CI-sized run). The start
    has a bound of its own: the records and the close reach a sink that starts within it, not one that does not."""
    got: list = []
    slow = sinks.Background("slow", lambda: _Slow(got, 1.0), close_timeout_s=0.2, start_timeout_s=10.0)
    slow.write({"step": 1})
    slow.close("completed")
    assert got == [1, "completed"]
    stuck = sinks.Background("stuck", lambda: _Slow([], 5.0), close_timeout_s=0.2, start_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="not done after 0 s"):
        stuck.close("completed")
    assert time.monotonic() - t0 < 2
