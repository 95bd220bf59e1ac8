"""A GGUF model's header over HTTP, without downloading the model.

    got = read_headers("hf://OWNER/REPO/model-Q4_K_M.gguf")
    got.headers[0]["fields"]["general.architecture"], got.bytes_read

URL forms:

- ``https://...`` (and ``http://...``): any server that answers HTTP range requests;
- ``hf://OWNER/REPO/FILE.gguf``: a Hugging Face file, the short form of
  ``https://huggingface.co/OWNER/REPO/resolve/main/FILE.gguf``; ``hf://OWNER/REPO@REV/FILE.gguf``
  names a branch, tag or commit. ``HF_ENDPOINT`` changes the hub's address (a mirror), as it does
  for ``huggingface_hub``.

Only the header and the tensor table are fetched: range requests that grow (64 KiB, then
doubling) as the header parser asks for more, never the tensor data. A split model's parts
(``NAME-00001-of-00003.gguf``) are read in turn. Redirects are followed (the Hub redirects to a
CDN) with the Range header kept; an Authorization header goes only to the host it was meant for.
A server that ignores Range (answers 200 with the whole file) is refused and the body is not
read. Each request has one deadline (``OFFLOAD_TUNER_HTTP_TIMEOUT`` seconds, default 30) for all of
it: connecting, the status line and headers, and the body, however slowly the server trickles them
(every socket read waits only for what is left); a request that got no answer, or an overloaded
server's (HTTP 429, 5xx), is tried at most 3 times, and the whole command has one deadline too (4
timeouts and the pauses between tries). An answer that is not valid HTTP (a bad status line, more than 100 headers, a header
line over 64 KiB, broken chunking) is refused in one line. ``HF_TOKEN`` is sent to the Hub's own host for private or gated
repositories, over HTTPS (or to a loopback address); it is never printed or stored.

Fetched headers are cached (``tuner.model.header_cache``), so a second question about the same
URL costs no request.
"""

from __future__ import annotations

import contextlib
import contextvars
import http.client
import io
import os
import re
import socket
import time
import urllib.error
import urllib.request
from typing import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from ..errors import RemoteModelError
from . import header_cache
from .gguf import SPLIT_RE, read_header

ENV_TOKEN = "HF_TOKEN"
ENV_ENDPOINT = "HF_ENDPOINT"
ENV_TIMEOUT = "OFFLOAD_TUNER_HTTP_TIMEOUT"
DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_TIMEOUT_S = 30.0
ATTEMPTS = 3  # tries per request, on a timeout, a refused connection, HTTP 429 or 5xx
FIRST_CHUNK = 64 << 10
MAX_CHUNK = 8 << 20
# The largest header this reads. Real ones are a few MiB (a 256k-token vocabulary and its merges
# are the bulk); a header claiming more is corrupt or hostile, and is not downloaded.
MAX_HEADER_BYTES = 128 << 20
_URL_RE = re.compile(r"^(https?|hf)://", re.IGNORECASE)
_HF_RE = re.compile(r"^hf://(?P<owner>[^/@]+)/(?P<repo>[^/@]+)(@(?P<rev>[^/]+))?/(?P<file>.+)$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL this module reads (https://, http://, hf://)."""
    return isinstance(path, str) and bool(_URL_RE.match(path))


def _endpoint() -> str:
    return (os.environ.get(ENV_ENDPOINT) or DEFAULT_ENDPOINT).rstrip("/")


def resolve(url: str) -> str:
    """The http(s) URL to fetch: ``hf://`` URLs become the Hub's ``resolve`` URL."""
    if not url.lower().startswith("hf://"):
        return url
    m = _HF_RE.match(url)
    if not m:
        raise RemoteModelError(url, "not a Hugging Face URL: expected hf://OWNER/REPO/FILE.gguf or hf://OWNER/REPO@REVISION/FILE.gguf")
    rev = quote(m["rev"] or "main", safe="")  # a branch like refs/pr/1 is one path segment
    return f"{_endpoint()}/{quote(m['owner'])}/{quote(m['repo'])}/resolve/{rev}/{quote(m['file'])}"


def is_immutable(url: str) -> bool:
    """An ``hf://`` URL pinned to a commit never changes: its cached header needs no check."""
    m = _HF_RE.match(url)
    return bool(m and m["rev"] and _COMMIT_RE.fullmatch(m["rev"]))


def part_urls(url: str) -> list[str]:
    """All parts of a split model named by ``url`` (any part), or just ``url``."""
    parts = urlsplit(url)
    folder, _, name = parts.path.rpartition("/")
    m = SPLIT_RE.match(name)
    if not m:
        return [url]
    count = int(m["count"])
    if not 1 <= count <= 9999:
        raise RemoteModelError(url, f"a split model of {count} parts? the file name is not a split GGUF's")
    return [urlunsplit(parts._replace(path=f"{folder}/{m['stem']}-{i:05d}-of-{count:05d}.gguf")) for i in range(1, count + 1)]


def _timeout() -> float:
    raw = os.environ.get(ENV_TIMEOUT)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise RemoteModelError(ENV_TIMEOUT, f"expected seconds, got {raw[:40]!r}") from None
    if not 0 < value <= 3600:
        raise RemoteModelError(ENV_TIMEOUT, f"expected seconds between 0 and 3600, got {raw[:40]!r}")
    return value


def _is_loopback(host: str | None) -> bool:
    return host in ("localhost", "::1") or bool(host and host.startswith("127."))


def _token_for(url: str) -> str | None:
    """HF_TOKEN, only for the Hub's own host and only where it is not sent in the clear."""
    token = os.environ.get(ENV_TOKEN)
    if not token:
        return None
    target, hub = urlsplit(url), urlsplit(_endpoint())
    if (target.hostname or "").lower() != (hub.hostname or "").lower() or target.port != hub.port:
        return None
    if target.scheme != "https" and not _is_loopback(target.hostname):
        return None
    return token


@dataclass
class PartFetch:
    """What reading one part's header cost."""

    url: str  # as the user named it
    resolved: str  # the http(s) URL asked
    size: int = 0  # the whole file, as the server says
    header_bytes: int = 0  # the header and tensor table
    bytes_read: int = 0  # response bodies received (the header, rounded up to a range)
    requests: int = 0  # HTTP requests sent, redirects included
    cache: str = "miss"  # miss (fetched), hit (no request), revalidated (one conditional request)
    etag: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "size": self.size, "header_bytes": self.header_bytes, "bytes_read": self.bytes_read,
                "requests": self.requests, "cache": self.cache, "etag": self.etag}


@dataclass
class RemoteHeaders:
    """The parsed headers of every part of a model at a URL, and what reading them cost."""

    url: str
    urls: list[str]
    headers: list[dict]
    parts: list[PartFetch] = field(default_factory=list)

    @property
    def bytes_read(self) -> int:
        return sum(p.bytes_read for p in self.parts)

    @property
    def requests(self) -> int:
        return sum(p.requests for p in self.parts)

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "size": self.size, "bytes_read": self.bytes_read, "requests": self.requests,
                "parts": [p.to_dict() for p in self.parts]}


def describe_fetched(fetched: dict[str, Any]) -> str:
    """One line from ``RemoteHeaders.to_dict()``: how much was read, of how much, in how many requests."""
    parts = fetched["parts"]
    where = f"{len(parts)} parts" if len(parts) > 1 else "the file"
    if fetched["requests"] == 0:
        return (f"header from the cache, no request: {_size(sum(p['header_bytes'] for p in parts))} "
                f"(the header and tensor table of {where}, {_size(fetched['size'])})")
    checked = sum(1 for p in parts if p["cache"] == "revalidated")
    note = f"; {checked} cached header(s) confirmed unchanged" if checked else ""
    return (f"read {_size(fetched['bytes_read'])} of {_size(fetched['size'])} ({fetched['bytes_read'] / max(1, fetched['size']):.2%}: "
            f"the header and tensor table of {where}) in {fetched['requests']} HTTP request(s){note}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def read_headers(url: str) -> RemoteHeaders:
    """Parse the GGUF header (``read_header(..., values=True)``) of every part of the model at
    ``url``, from the cache where it can. Raises ``RemoteModelError`` or another ``ModelError``."""
    urls = part_urls(url)
    out = RemoteHeaders(url=url, urls=urls, headers=[])
    with command_deadline():
        for part in urls:
            fetch = PartFetch(url=part, resolved=resolve(part))
            header = _part_header(fetch)
            fetch.header_bytes = header["header_len"]
            out.headers.append(header)
            out.parts.append(fetch)
    return out


# -- deadlines ---------------------------------------------------------------------------------------

# The command's deadline (time.monotonic()), set by ``command_deadline``; None outside one.
_COMMAND_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("command_deadline", default=None)


@contextlib.contextmanager
def command_deadline(seconds: float | None = None) -> Iterator[float]:
    """Every request made inside ends by one deadline: ``seconds`` from now (default: a timeout per
    try and one more, and the pauses between tries). Nested, the earlier deadline holds."""
    limit = time.monotonic() + ((ATTEMPTS + 1) * _timeout() + 2.0 if seconds is None else seconds)
    outer = _COMMAND_DEADLINE.get()
    token = _COMMAND_DEADLINE.set(limit if outer is None else min(outer, limit))
    try:
        yield _COMMAND_DEADLINE.get()  # type: ignore[misc]
    finally:
        _COMMAND_DEADLINE.reset(token)


class _DeadlinePassed(TimeoutError):
    """The request's (or the command's) deadline passed while the server was still answering."""


class _DeadlineSocket:
    """A connected socket whose every send and receive waits only for what is left of one deadline:
    a server trickling a byte a second cannot stretch a request past it."""

    def __init__(self, sock: Any, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline
        self._readers = 0          # open makefile() readers: as a socket's, they keep it open
        self._close_pending = False
        self._received = 0         # bytes the server sent: none yet is "no answer" (worth a retry)

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            if not self._received:
                raise socket.timeout("no answer")
            raise _DeadlinePassed
        self._sock.settimeout(left)

    def sendall(self, data: bytes, *args: Any) -> None:
        self._arm()
        self._sock.sendall(data, *args)

    def recv_into(self, buffer: Any, n: int = 0) -> int:
        self._arm()
        try:
            got = self._sock.recv_into(buffer, n)
        except (socket.timeout, TimeoutError):
            if not self._received:
                raise  # no answer at all: a timeout like any other (tried again)
            raise _DeadlinePassed from None
        self._received += got
        return got

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def close(self) -> None:
        # urllib closes the connection once it has the response, whose reader still reads from the
        # socket: as socket.makefile does, the socket really closes when its last reader does
        if self._readers:
            self._close_pending = True
        else:
            self._sock.close()

    def _reader_closed(self) -> None:
        self._readers -= 1
        if not self._readers and self._close_pending:
            self._sock.close()

    def __getattr__(self, name: str) -> Any:  # close, settimeout, setsockopt, ... as the socket does
        return getattr(self._sock, name)


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: _DeadlineSocket) -> None:
        self._dsock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._dsock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._dsock._reader_closed()
        super().close()


def _deadline_connection(base: type, deadline: float) -> type:
    class Connection(base):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _DeadlinePassed
            self.timeout = min(self.timeout, left) if isinstance(self.timeout, (int, float)) else left
            super().connect()
            self.sock = _DeadlineSocket(self.sock, deadline)

    return Connection


class _DeadlineHTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req: Any) -> Any:
        return self.do_open(_deadline_connection(http.client.HTTPConnection, self.deadline), req)


class _DeadlineHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req: Any) -> Any:
        return self.do_open(_deadline_connection(http.client.HTTPSConnection, self.deadline), req,
                            context=self._context)


def _part_header(fetch: PartFetch) -> dict:
    """One part's parsed header, from the cache or fetched (then cached)."""
    cached = header_cache.load(fetch.resolved)
    if cached is not None:
        fresh = is_immutable(fetch.url) or time.time() - cached.fetched_at < header_cache.FRESH_SECONDS
        if fresh or _unchanged(fetch, cached):
            fetch.cache = "hit" if fresh else "revalidated"
            fetch.size, fetch.etag = cached.size, cached.etag
            if not fresh:
                header_cache.touch(fetch.resolved)
            return read_header(_BytesAt(cached.data), fetch.url, cached.size, values=True)
    reader = _RangeReader(fetch)
    # The parser pulls what it needs through the reader; the bytes it consumed are the header.
    header = read_header(reader, fetch.url, reader.size, values=True)
    fetch.cache, fetch.size = "miss", reader.size
    header_cache.store(header_cache.CachedHeader(url=fetch.resolved, etag=reader.etag, last_modified=reader.last_modified,
                                                 size=reader.size, fetched_at=time.time(),
                                                 data=bytes(reader.buffer[: header["header_len"]])))
    return header


def _unchanged(fetch: PartFetch, cached: header_cache.CachedHeader) -> bool:
    """One conditional request for one byte: does the server still have the file we cached?"""
    if not cached.etag and not cached.last_modified:
        return False
    headers = {"Range": "bytes=0-0"}
    if cached.etag:
        headers["If-None-Match"] = cached.etag
    elif cached.last_modified:
        headers["If-Modified-Since"] = cached.last_modified
    status, info, _ = _get(fetch, headers, want=1, not_modified_ok=True)
    if status == 304:
        return True
    total = _content_range(fetch, info, 0)[2]
    return total == cached.size and bool(cached.etag) and info.get("ETag") == cached.etag


class _BytesAt:
    """A read-only handle over bytes already fetched (the cached header)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def read(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    def tell(self) -> int:
        return self.pos


class _RangeReader:
    """A handle whose ``read`` fetches the next byte range when the parser needs more: 64 KiB
    first, each further range twice the last (up to 8 MiB), so a header of H bytes costs at
    most about 2H bytes and log2(H / 64 KiB) + 1 requests."""

    def __init__(self, fetch: PartFetch) -> None:
        self.fetch = fetch
        self.buffer = bytearray()
        self.pos = 0
        self.chunk = FIRST_CHUNK
        self.size = 0
        self.etag: str | None = None
        self.last_modified: str | None = None
        self._get_range(0, FIRST_CHUNK - 1, first=True)

    def _get_range(self, start: int, end: int, first: bool = False) -> None:
        status, info, body = _get(self.fetch, {"Range": f"bytes={start}-{end}"}, want=end - start + 1)
        got_start, got_end, total = _content_range(self.fetch, info, start)
        etag = info.get("ETag")
        if first:
            self.size, self.etag, self.last_modified = total, etag, info.get("Last-Modified")
            self.fetch.etag = etag
        elif total != self.size or (self.etag and etag and etag != self.etag):
            raise RemoteModelError(self.fetch.url, "the file changed on the server while its header was being read; try again")
        if len(body) != got_end - got_start + 1:
            raise RemoteModelError(self.fetch.url, f"the server sent {len(body)} bytes for a range of {got_end - got_start + 1}")
        self.buffer += body

    def read(self, n: int) -> bytes:
        end = min(self.pos + n, self.size)
        while len(self.buffer) < end:
            start = len(self.buffer)
            self.chunk = min(self.chunk * 2, MAX_CHUNK)
            stop = min(self.size, max(end, start + self.chunk))
            if stop > MAX_HEADER_BYTES:
                raise RemoteModelError(self.fetch.url, f"the GGUF header runs past {MAX_HEADER_BYTES >> 20} MiB; a real one is a few MiB, "
                                       "so this file is corrupt (or not a model): not downloading more")
            self._get_range(start, stop - 1)
        out = bytes(self.buffer[self.pos : end])
        self.pos += len(out)
        return out

    def tell(self) -> int:
        return self.pos


def _content_range(fetch: PartFetch, info: Any, start: int) -> tuple[int, int, int]:
    m = _CONTENT_RANGE_RE.match(info.get("Content-Range", "").strip())
    if not m:
        raise RemoteModelError(fetch.url, f"the server answered a range request without a usable Content-Range "
                               f"({info.get('Content-Range', 'none')[:60]!r})")
    got_start, got_end, total = int(m[1]), int(m[2]), m[3]
    if total == "*":
        raise RemoteModelError(fetch.url, "the server does not say how large the file is (Content-Range */*)")
    if got_start != start or got_end < got_start:
        raise RemoteModelError(fetch.url, f"asked for bytes from {start}, the server sent {got_start}-{got_end}")
    return got_start, got_end, int(total)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects (at most 10), counting each hop. urllib copies ordinary headers (Range
    stays) but not "unredirected" ones: the Authorization header is added back only while the
    host stays the same."""

    max_redirections = 10

    def __init__(self, fetch: PartFetch) -> None:
        self.fetch = fetch

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is None:
            return None
        self.fetch.requests += 1
        auth = req.unredirected_hdrs.get("Authorization")
        old, target = urlsplit(req.full_url), urlsplit(new.full_url)
        if auth and old.hostname == target.hostname and old.port == target.port and target.scheme == old.scheme:
            new.add_unredirected_header("Authorization", auth)
        return new

    http_error_308 = urllib.request.HTTPRedirectHandler.http_error_302  # not in every Python's urllib


def _get(fetch: PartFetch, headers: dict[str, str], want: int, not_modified_ok: bool = False) -> tuple[int, Any, bytes]:
    """GET ``fetch.resolved`` with ``headers`` (a Range among them): status, headers, body.

    Refuses a 200 (the server ignored Range) without reading its body, reads at most ``want``
    bytes of a 206, and retries timeouts, refused connections, 429 and 5xx (``ATTEMPTS`` tries)."""
    timeout = _timeout()
    last_problem = ""
    with command_deadline():  # (a request outside read_headers still gets a command's deadline)
        command_end = _COMMAND_DEADLINE.get() or 0.0
        for attempt in range(ATTEMPTS):
            if attempt:
                pause = 0.5 * 2 ** (attempt - 1)
                if time.monotonic() + pause >= command_end:
                    break
                time.sleep(pause)
            deadline = min(time.monotonic() + timeout, command_end)
            try:
                outcome = _get_once(fetch, headers, want, not_modified_ok, timeout, deadline)
            except _DeadlinePassed:
                raise RemoteModelError(fetch.url, f"the server did not finish answering within {timeout:g} s "
                                       f"(it sends too slowly, or stalled); {ENV_TIMEOUT} sets the limit per request") from None
            except http.client.HTTPException as exc:
                raise RemoteModelError(fetch.url, f"the server's answer is not valid HTTP ({_http_exception(exc)})") from None
            if isinstance(outcome, str):
                last_problem = outcome
                continue
            return outcome
    raise RemoteModelError(fetch.url, f"{last_problem or 'no answer'} ({attempt + 1} tries); the server is slow or unreachable "
                           f"({ENV_TIMEOUT} sets the limit per request)")


def _http_exception(exc: http.client.HTTPException) -> str:
    """What http.client says was wrong with an answer, in one short line."""
    if isinstance(exc, http.client.LineTooLong):
        return "a header line longer than 64 KiB"
    if isinstance(exc, http.client.BadStatusLine):
        return f"a bad status line: {_one_line(str(exc), 60)}"
    if isinstance(exc, http.client.IncompleteRead):
        return "the body ended early or its chunked encoding is broken"
    text = str(exc)
    if "more than" in text and "headers" in text:
        return "more than 100 header lines"
    return f"{type(exc).__name__}: {_one_line(text, 80)}" if text else type(exc).__name__


def _one_line(text: str, width: int) -> str:
    """``text`` with its whitespace runs (newlines included) made one space, cut to ``width``, as
    ``repr`` shows what is left of control characters."""
    flat = " ".join(str(text).split())
    flat = repr(flat)[1:-1] if not flat.isprintable() else flat
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def _get_once(fetch: PartFetch, headers: dict[str, str], want: int, not_modified_ok: bool, timeout: float,
              deadline: float) -> tuple[int, Any, bytes] | str:
    """One try: the answer, or (a str) why it is worth trying again."""
    if True:  # (one indent level kept from the loop this came from)
        request = urllib.request.Request(fetch.resolved, headers={**headers, "Accept-Encoding": "identity",
                                                                   "User-Agent": "offload-tuner"})
        token = _token_for(fetch.resolved)
        if token:
            request.add_unredirected_header("Authorization", f"Bearer {token}")
        opener = urllib.request.build_opener(_Redirects(fetch), _DeadlineHTTP(deadline), _DeadlineHTTPS(deadline))
        fetch.requests += 1
        try:
            response = opener.open(request, timeout=timeout)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 304 and not_modified_ok:
                return 304, exc.headers, b""
            if exc.code == 429 or exc.code >= 500:
                return f"HTTP {exc.code} {_one_line(str(exc.reason), 80)}"
            raise RemoteModelError(fetch.url, _http_problem(fetch, exc.code, str(exc.reason), bool(token))) from None
        except _DeadlinePassed:
            raise
        except (socket.timeout, TimeoutError):
            return f"no answer within {timeout:g} s"
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, _DeadlinePassed):
                raise reason from None
            if isinstance(reason, (socket.timeout, TimeoutError)):
                return f"no answer within {timeout:g} s"
            if isinstance(reason, ConnectionError):
                return f"cannot connect to {urlsplit(fetch.resolved).netloc} ({_one_line(reason.strerror or str(reason), 80)})"
            raise RemoteModelError(fetch.url, f"cannot reach {urlsplit(fetch.resolved).netloc}: {_one_line(str(reason), 120)}") from None
        except http.client.HTTPException:
            raise
        except (ConnectionError, OSError) as exc:  # e.g. a connection reset mid-answer
            return f"the connection failed ({_one_line(str(exc), 80)})"
        with response:
            status = response.status
            if status == 200:
                # The whole file is on its way: close without reading it.
                raise RemoteModelError(
                    fetch.url, "the server ignored the range request and started sending the whole file "
                    f"({_declared(response)}); refusing to download it all: use a server that answers range requests, "
                    "or download the file and give its path")
            if status != 206:
                raise RemoteModelError(fetch.url, f"unexpected answer to a range request: HTTP {status} {response.reason}")
            try:
                body = _read_body(response, want)
            except _DeadlinePassed:
                raise
            except http.client.HTTPException:
                raise
            except (socket.timeout, TimeoutError):
                return f"the answer stalled for more than {timeout:g} s"
            except (ConnectionError, OSError) as exc:
                return f"the connection failed mid-answer ({_one_line(str(exc), 80)})"
            fetch.bytes_read += len(body)
            return status, response.headers, body


def _read_body(response: Any, want: int) -> bytes:
    """At most ``want`` bytes (the socket's reads end at the request's deadline: _DeadlineSocket)."""
    body = bytearray()
    while len(body) < want:
        piece = response.read(min(1 << 16, want - len(body)))
        if not piece:
            break
        body += piece
    return bytes(body)


def _declared(response: Any) -> str:
    length = response.headers.get("Content-Length")
    return f"{_size(int(length))}" if length and length.isdigit() else "size not given"


def _http_problem(fetch: PartFetch, code: int, reason: str, sent_token: bool) -> str:
    hub = urlsplit(fetch.resolved).hostname == urlsplit(_endpoint()).hostname
    if code == 404:
        return "HTTP 404 Not Found: check the URL" + (" (owner, repository, revision and file name)" if hub else "")
    if code in (401, 403) and hub:
        if sent_token:
            return f"HTTP {code} {reason}: the Hub refused {ENV_TOKEN}; check that it can read this repository"
        return f"HTTP {code} {reason}: a private or gated repository? set {ENV_TOKEN} to a token that can read it"
    if code == 416:
        return "HTTP 416: the file is empty"
    if 300 <= code < 400:  # urllib raises a redirect it will not follow: a loop, or too many (its reason is 3 lines)
        return f"too many redirects (a redirect loop, or more than {_Redirects.max_redirections} in a row)"
    return f"HTTP {code} {_one_line(reason, 120)}"
