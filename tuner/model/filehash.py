"""The sha256 of a whole file (every part of a split model), remembered while the file is unchanged.

Quality caches are keyed by the hash of the model's bytes, not of its header: two files with the
same header can hold different weights (a re-conversion, an imatrix quantization of the same type).
Hashing gigabytes takes a while, so the result is kept in the data folder (``hashes.json``), keyed by
the file's real path, size, modification time and inode; a file that changed is hashed again.

    file_sha256("model-F16.gguf")          # 64 hex digits
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

from ..paths import atomic_write_text, data_dir
from .gguf import split_parts

_CHUNK = 8 << 20
# A memo of a few hundred entries is kilobytes; anything larger is not ours (or damaged): start over.
_MAX_MEMO_BYTES = 4 << 20

Progress = Callable[[int, int], None]  # (bytes hashed so far, bytes in all)


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _memo_path() -> Path:
    return data_dir() / "hashes.json"


def _read_memo() -> dict[str, dict[str, str]]:
    path = _memo_path()
    try:
        if path.stat().st_size > _MAX_MEMO_BYTES:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict) and isinstance(v.get("sha256"), str)} if isinstance(data, dict) else {}


def file_sha256(path: str | os.PathLike[str], *, on_progress: Progress | None = None) -> str:
    """sha256 of the file's bytes; for a split model, of all its parts in order."""
    parts = [p.resolve() for p in split_parts(Path(path))]
    key = "|".join(str(p) for p in parts)
    stamp = "|".join(_stamp(p) for p in parts)
    memo = _read_memo()
    known = memo.get(key)
    if known and known.get("stamp") == stamp:
        return known["sha256"]
    total = sum(p.stat().st_size for p in parts)
    digest = hashlib.sha256()
    done = 0
    for part in parts:
        with open(part, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
                done += len(chunk)
                if on_progress is not None:
                    on_progress(done, total)
    value = digest.hexdigest()
    memo = _read_memo()  # another process may have added entries meanwhile
    memo[key] = {"stamp": stamp, "sha256": value}
    atomic_write_text(_memo_path(), json.dumps(memo, indent=1, sort_keys=True))
    return value


def bytes_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
