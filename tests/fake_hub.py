"""A Hugging Face Hub stand-in on 127.0.0.1 for download tests: the two endpoints huggingface_hub
uses to fetch a model's files, over real HTTP, from files held in memory.

    GET  /api/models/{org}/{name}[/revision/{rev}]   the repo's commit and files (sizes, LFS SHA-256)
    HEAD /{org}/{name}/resolve/{rev}/{path}          a file's commit, ETag (its SHA-256) and size
    GET  /{org}/{name}/resolve/{rev}/{path}          its bytes; a Range request gets the rest (206)

Point a process at it with HF_ENDPOINT=hub.url. What each request asked is kept (`hub.log`), a
listed SHA-256 can be set wrong (`wrong_sha`), and a file's first GET can be cut after some bytes
(`cut_after`), as a dropped connection would.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str = COMMIT
    wrong_sha: set[str] = field(default_factory=set)  # paths whose listed SHA-256 is not their bytes'

    def sha(self, path: str) -> str:
        digest = hashlib.sha256(self.files[path]).hexdigest()
        return ("0" * 64) if path in self.wrong_sha else digest


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.cut_after: dict[str, int] = {}  # path -> bytes sent before the first GET is cut
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _send(self, code: int, headers: dict[str, str], data: bytes = b"") -> None:
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                if data:
                    self.wfile.write(data)

            def _json(self, code: int, doc: object) -> None:
                data = json.dumps(doc).encode()
                self._send(code, {"Content-Type": "application/json", "Content-Length": str(len(data))},
                           data if self.command == "GET" else b"")

            def _serve(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.log.append((self.command, path, self.headers.get("Range")))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    repo = hub.repos.get("/".join(parts[2:4]))
                    if repo is None:
                        self._json(404, {"error": "Repository not found"})
                        return
                    self._json(200, {"id": "/".join(parts[2:4]), "sha": repo.commit, "siblings": [
                        {"rfilename": p, "size": len(b), "blobId": hashlib.sha1(b).hexdigest(),
                         "lfs": {"size": len(b), "sha256": repo.sha(p), "pointerSize": 134}}
                        for p, b in sorted(repo.files.items())]})
                    return
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = hub.repos.get("/".join(parts[:2]))
                    name = "/".join(parts[4:])
                    if repo is None or name not in repo.files or parts[3] not in (repo.commit, "main"):
                        self._send(404, {"Content-Length": "0", "X-Error-Code": "EntryNotFound"})
                        return
                    data = repo.files[name]
                    headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.sha(name)}"',
                               "X-Linked-Etag": f'"{repo.sha(name)}"', "X-Linked-Size": str(len(data)),
                               "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
                    start, code = 0, 200
                    rng = self.headers.get("Range")
                    if rng and rng.startswith("bytes="):
                        start = int(rng[6:].split("-")[0] or 0)
                        code = 206
                        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                    rest = data[start:]
                    headers["Content-Length"] = str(len(rest))
                    if not body:
                        self._send(code, headers)
                        return
                    cut = hub.cut_after.pop(name, None)
                    if cut is not None:  # send the headers and part of the bytes, then drop the connection
                        self._send(code, headers, rest[:cut])
                        self.close_connection = True
                        self.wfile.flush()
                        self.connection.shutdown(2)
                        return
                    self._send(code, headers, rest)
                    return
                self._send(404, {"Content-Length": "0"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str) -> list[str | None]:
        """The Range header of every GET of a repo file named `name` (None: the whole file)."""
        return [rng for method, path, rng in self.log
                if method == "GET" and "/resolve/" in path and path.split("/resolve/", 1)[1].split("/", 1)[1] == name]
