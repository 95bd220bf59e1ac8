"""A real headless Chromium (Debian's ``chromium`` package; ``.ci/run`` installs it) for the report
tests: the page's DOM after its scripts ran, every console message, and screenshots.

Console messages come from Chromium's own log (``--enable-logging=stderr``): each one, errors and
uncaught exceptions included, is a line ``...:INFO:CONSOLE:<line>] "<message>", source: <url>``.
Chromium's proxy is a recorder on 127.0.0.1 that answers every request with 502 and keeps its
request line, so ``Page.network`` lists whatever the page tried to fetch from anywhere (less
Chromium's own service traffic: its component updater, network time and account hosts).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

# Chromium's own requests, made whatever the page (seen: update.googleapis.com, clients2.google.com
# time queries, accounts.google.com)
_BROWSER_OWN_RE = re.compile(r"^\S+ (https?://)?(update\.googleapis\.com|clients\d*\.google\.com|accounts\.google\.com|"
                             r"\w+-pa\.googleapis\.com|safebrowsing\.googleapis\.com)[:/]")
_CONSOLE_RE = re.compile(r":CONSOLE(?::|\()\d+\)?\] (.*)$")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("Chromium is needed for the report tests: install Debian's chromium package (.ci/run does)")


@dataclass
class Page:
    dom: str
    console: list[str]
    network: list[str] = field(default_factory=list)  # request lines the page sent (through the proxy)


class _Recorder:
    """An HTTP proxy on 127.0.0.1 that records each request line and answers 502."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        lines = self.lines

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _refuse(self) -> None:
                lines.append(self.requestline)
                self.send_error(502, "no network in tests")

            do_GET = do_POST = do_HEAD = do_CONNECT = _refuse  # noqa: N815 (http.server's names)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _run(url: str, profile: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    recorder = _Recorder()
    try:
        cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
               f"--proxy-server=http://127.0.0.1:{recorder.server.server_address[1]}",
               "--virtual-time-budget=20000", *extra, url]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240), list(recorder.lines)
    finally:
        recorder.close()


def open_page(path: Path, workdir: Path) -> Page:
    """Load ``path`` and return its DOM once its scripts have run, its console messages and
    the requests it sent."""
    proc, network = _run(path.resolve().as_uri(), workdir / "chromium-profile", "--dump-dom")
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [m.group(1) for line in proc.stderr.splitlines() if (m := _CONSOLE_RE.search(line))]
    return Page(dom=proc.stdout, console=console, network=[line for line in network if not _BROWSER_OWN_RE.match(line)])


def screenshot(path: Path, out: Path, workdir: Path, size: tuple[int, int] = (1280, 4200)) -> Path:
    proc, _ = _run(path.resolve().as_uri(), workdir / "chromium-profile", "--hide-scrollbars",
                   f"--window-size={size[0]},{size[1]}", f"--screenshot={out}")
    assert proc.returncode == 0 and out.exists(), proc.stderr[-2000:]
    return out
