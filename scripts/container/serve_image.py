#!/usr/bin/env python3
"""Serve an image archive folder to `enroot import docker://` on 127.0.0.1, read-only, then stop.

    python3 scripts/container/serve_image.py FOLDER NAME:TAG     # prints the port, serves until killed

Enroot imports from a registry, a Docker daemon or podman's storage, but not from an image archive; buildah on a
head node without a registry has only archives. scripts/build_image.sh therefore pushes the image to a folder
(`buildah push --format v2s2 IMAGE dir:FOLDER`: manifest.json and one file per blob, named by its sha256) and
serves that folder here with the pull half of the registry API, for `ENROOT_ALLOW_HTTP=yes enroot import
docker://127.0.0.1:PORT#NAME:TAG`:
    GET|HEAD /v2/                          200
    GET|HEAD /v2/NAME/manifests/TAG|DIGEST the manifest, with its media type and digest
    GET|HEAD /v2/NAME/blobs/sha256:HEX     a blob the manifest lists
Anything else is 404: only the manifest and the blobs it names are ever read, by their exact file names.
Standard library only (python3 >= 3.7, as on a head node).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

MAX_MANIFEST = 4 << 20  # a v2s2 manifest is a few KB


def load(folder: Path, reference: str) -> tuple[bytes, str, dict[str, Path], str, str]:
    """The manifest (bytes, media type), the blob files it names (by 'sha256:HEX'), the image name and tag."""
    name, _, tag = reference.partition(":")
    if not re.fullmatch(r"[a-z0-9]+(?:[._/-][a-z0-9]+)*", name) or not re.fullmatch(r"[\w][\w.-]{0,127}", tag or ""):
        raise ValueError(f"NAME:TAG {reference!r}: lower-case name and a tag, e.g. llama-fp8:latest")
    path = folder / "manifest.json"
    if not path.is_file() or path.stat().st_size > MAX_MANIFEST:
        raise ValueError(f"{path}: no manifest (push with `buildah push --format v2s2 IMAGE dir:{folder}`)")
    raw = path.read_bytes()
    manifest = json.loads(raw)
    media = manifest.get("mediaType", "")
    if "manifest.v2+json" not in media:
        raise ValueError(f"{path}: media type {media!r}; Enroot needs Docker v2 schema 2 (push with --format v2s2)")
    blobs = {}
    for entry in [manifest["config"], *manifest["layers"]]:
        digest = entry["digest"]
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise ValueError(f"{path}: unexpected digest {digest!r}")
        blob = folder / digest.removeprefix("sha256:")
        if not blob.is_file():
            raise ValueError(f"{path} names {digest} but {blob} is missing")
        blobs[digest] = blob
    return raw, media, blobs, name, tag


def handler(manifest: bytes, media: str, blobs: dict[str, Path], name: str, tag: str):
    digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
    manifests = {f"/v2/{name}/manifests/{tag}", f"/v2/{name}/manifests/{digest}"}

    class Handler(BaseHTTPRequestHandler):
        def answer(self, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/v2/", "/v2"):
                self.send(200, "application/json", b"{}", body)
            elif path in manifests:
                self.send(200, media, manifest, body, {"Docker-Content-Digest": digest})
            elif path.startswith(f"/v2/{name}/blobs/") and path.rsplit("/", 1)[1] in blobs:
                blob = blobs[path.rsplit("/", 1)[1]]
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(blob.stat().st_size))
                self.end_headers()
                if body:
                    with blob.open("rb") as f:
                        while chunk := f.read(1 << 20):
                            self.wfile.write(chunk)
            else:
                self.send(404, "application/json", b'{"errors":[{"code":"NAME_UNKNOWN"}]}', body)

        def send(self, code: int, kind: str, data: bytes, body: bool, extra: dict | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

        def do_GET(self):  # noqa: N802 - http.server's name
            self.answer(True)

        def do_HEAD(self):  # noqa: N802
            self.answer(False)

        def log_message(self, *_):  # quiet: build_image.sh prints Enroot's own progress
            pass

    return Handler


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        manifest, media, blobs, name, tag = load(Path(argv[0]), argv[1])
    except (ValueError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(manifest, media, blobs, name, tag))
    print(server.server_address[1], flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
