"""GGUF headers fetched over the network, kept in the data folder by URL and ETag.

    headers/<sha256 of the URL>.bin    the header and tensor table, as the server sent them
    headers/<sha256 of the URL>.json   {url, etag, last_modified, size, fetched_at, sha256}

A second question about a URL is answered from here without a request while the entry is
younger than ``FRESH_SECONDS`` (or forever for an ``hf://`` URL pinned to a commit); after that,
one conditional request for one byte (If-None-Match with the ETag) confirms the file has not
changed, and the header is fetched again only if it has. No token or request header is stored.
The ``.json`` is written last, so an entry is whole or absent; one whose bytes do not match its
recorded hash is ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import FileWriteError
from ..paths import atomic_write_bytes, atomic_write_text, headers_dir

FRESH_SECONDS = 24 * 3600


@dataclass(frozen=True)
class CachedHeader:
    url: str
    etag: str | None
    last_modified: str | None
    size: int  # the whole file on the server
    fetched_at: float  # seconds since the epoch, when fetched or last confirmed unchanged
    data: bytes


def _paths(url: str) -> tuple[Path, Path]:
    key = hashlib.sha256(url.encode("utf-8")).hexdigest()
    folder = headers_dir()
    return folder / f"{key}.json", folder / f"{key}.bin"


def load(url: str) -> CachedHeader | None:
    """The cached header of ``url``, or None (never cached, or the entry is damaged)."""
    meta_path, data_path = _paths(url)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        data = data_path.read_bytes()
        if meta.get("url") != url or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            return None
        return CachedHeader(url=url, etag=meta.get("etag"), last_modified=meta.get("last_modified"), size=int(meta["size"]),
                            fetched_at=float(meta["fetched_at"]), data=data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store(entry: CachedHeader) -> None:
    meta_path, data_path = _paths(entry.url)
    try:
        atomic_write_bytes(data_path, entry.data)
        _write_meta(meta_path, entry, hashlib.sha256(entry.data).hexdigest())
    except FileWriteError:
        pass  # a cache: a read-only or full data folder only costs the next run a download


def touch(url: str) -> None:
    """Record that ``url``'s file was just confirmed unchanged."""
    import dataclasses
    import time

    entry = load(url)
    if entry is not None:
        try:
            _write_meta(_paths(url)[0], dataclasses.replace(entry, fetched_at=time.time()), hashlib.sha256(entry.data).hexdigest())
        except FileWriteError:
            pass  # (see store)


def _write_meta(path: Path, entry: CachedHeader, digest: str) -> None:
    meta = {"url": entry.url, "etag": entry.etag, "last_modified": entry.last_modified, "size": entry.size,
            "fetched_at": entry.fetched_at, "sha256": digest}
    atomic_write_text(path, json.dumps(meta, indent=1))
