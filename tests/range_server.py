"""A real HTTP server on 127.0.0.1 for the remote-header tests: the standard library's, with
range requests, ETags and the Hugging Face URL layout added.

    /files/PATH                          the file, with Range (single range), ETag, If-None-Match
    /OWNER/REPO/resolve/REV/PATH         302 to http://localhost:PORT/files/PATH (another host
                                         name, as the Hub redirects to its CDN); OWNER "private"
                                         needs "Authorization: Bearer <token>"

Modes: ``ranges=False`` answers 200 with the whole file (and far more: it streams padding, so the
test can see the client hung up early); ``delay`` sleeps before answering; ``raw`` answers these
bytes instead of HTTP (a malformed answer), ``trickle`` seconds apart, one byte at a time (a
server that sends too slowly). Every request is recorded (path, headers, status, bytes sent).
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    status: int = 0
    bytes_sent: int = 0
    aborted: bool = False


@dataclass
class ModelServer:
    root: Path
    token: str = "secret-token"
    ranges: bool = True
    delay: float = 0.0
    raw: bytes | None = None
    trickle: float = 0.0
    requests: list[Seen] = field(default_factory=list)

    def start(self) -> "ModelServer":
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                seen = Seen(self.path, {k: v for k, v in self.headers.items()})
                server.requests.append(seen)
                if server.delay:
                    time.sleep(server.delay)
                if server.raw is not None:
                    try:
                        server._send_raw(self, seen)
                    except (BrokenPipeError, ConnectionResetError):
                        seen.aborted = True
                    return
                try:
                    server._answer(self, seen)
                except (BrokenPipeError, ConnectionResetError):
                    seen.aborted = True

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def _send_raw(self, h: BaseHTTPRequestHandler, seen: Seen) -> None:
        h.close_connection = True
        data = self.raw or b""
        if not self.trickle:
            h.wfile.write(data)
            seen.bytes_sent = len(data)
            return
        for i in range(len(data)):
            h.wfile.write(data[i:i + 1])
            h.wfile.flush()
            seen.bytes_sent += 1
            time.sleep(self.trickle)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def url(self, rel: str) -> str:
        return f"http://127.0.0.1:{self.port}/files/{rel}"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _answer(self, h: BaseHTTPRequestHandler, seen: Seen) -> None:
        m = re.match(r"^/([^/]+)/([^/]+)/resolve/([^/]+)/(.+)$", h.path)
        if m:
            if m[1] == "private" and h.headers.get("Authorization") != f"Bearer {self.token}":
                return self._status(h, seen, 401, "Unauthorized")
            seen.status = 302
            h.send_response(302)
            h.send_header("Location", f"http://localhost:{self.port}/files/{m[4]}")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        if not h.path.startswith("/files/"):
            return self._status(h, seen, 404, "Not Found")
        path = self.root / h.path[len("/files/"):]
        if not path.is_file():
            return self._status(h, seen, 404, "Not Found")
        stat = path.stat()
        size = stat.st_size
        etag = '"' + hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16] + '"'
        if not self.ranges:
            # Ignore Range: the whole file, then padding, as a big download would go on.
            padding = 256 << 20
            data = path.read_bytes()
            seen.status = 200
            h.send_response(200)
            h.send_header("Content-Length", str(len(data) + padding))
            h.send_header("ETag", etag)
            h.end_headers()
            for start in range(0, len(data) + padding, 1 << 16):
                chunk = data[start : start + (1 << 16)] if start < len(data) else bytes(1 << 16)
                h.wfile.write(chunk)
                seen.bytes_sent += len(chunk)
            return
        if h.headers.get("If-None-Match") == etag:
            seen.status = 304
            h.send_response(304)
            h.send_header("ETag", etag)
            h.end_headers()
            return
        rng = re.match(r"^bytes=(\d+)-(\d*)$", h.headers.get("Range", ""))
        if not rng:
            return self._status(h, seen, 400, "Bad Request (this test server wants a Range)")
        start = int(rng[1])
        end = min(int(rng[2]) if rng[2] else size - 1, size - 1)
        if start >= size:
            seen.status = 416
            h.send_response(416)
            h.send_header("Content-Range", f"bytes */{size}")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        with open(path, "rb") as handle:
            handle.seek(start)
            body = handle.read(end - start + 1)
        seen.status = 206
        h.send_response(206)
        h.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        h.send_header("Content-Length", str(len(body)))
        h.send_header("ETag", etag)
        h.send_header("Accept-Ranges", "bytes")
        h.end_headers()
        h.wfile.write(body)
        seen.bytes_sent = len(body)

    @staticmethod
    def _status(h: BaseHTTPRequestHandler, seen: Seen, code: int, text: str) -> None:
        seen.status = code
        body = text.encode()
        h.send_response(code, text)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
