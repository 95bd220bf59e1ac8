"""A model file's identity, read from its GGUF header alone, with the standard library only.

Profiles record it and apps check it at load, so this must stay light (no ``gguf``, no numpy):
a hash of the header and tensor table catches a different file saved under the same name
without reading gigabytes of weights.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path
from typing import BinaryIO

from ..errors import ModelNotFoundError, NotGGUFError, TruncatedGGUFError

GGUF_MAGIC = b"GGUF"
# gguf value types (ggml/include/gguf.h, enum gguf_type) -> struct format of a scalar
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


class _Reader:
    def __init__(self, handle: BinaryIO, path: Path, size: int) -> None:
        self.handle, self.path, self.size = handle, path, size
        self.hash = hashlib.sha256()

    def read(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) != n:
            raise TruncatedGGUFError(
                self.path, f"truncated GGUF: the header ends at byte {self.handle.tell()} of {self.size}; re-download or re-convert the file"
            )
        self.hash.update(data)
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        length = self.unpack("<Q")
        if length > self.size:
            raise TruncatedGGUFError(self.path, f"corrupt GGUF header: a string of {length} bytes in a file of {self.size}")
        return self.read(length)

    def skip_value(self, vtype: int) -> None:
        if vtype in _SCALAR:
            self.read(struct.calcsize(_SCALAR[vtype]))
        elif vtype == _STRING:
            self.string()
        elif vtype == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR:
                self.read(struct.calcsize(_SCALAR[item_type]) * count)
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            raise NotGGUFError(self.path, f"corrupt GGUF header: unknown value type {vtype}")


def check_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.exists():
        raise ModelNotFoundError(p, "no such file; check the path")
    if p.is_dir():
        raise ModelNotFoundError(p, "is a directory, not a GGUF file; name a .gguf file inside it")
    return p


def header_info(path: str | os.PathLike[str]) -> dict:
    """Read the GGUF header: returns version, tensor/kv counts, header length and its sha256."""
    p = check_path(path)
    size = p.stat().st_size
    with open(p, "rb") as handle:
        reader = _Reader(handle, p, size)
        magic = handle.read(4)
        if magic != GGUF_MAGIC:
            if len(magic) < 4:
                raise NotGGUFError(p, f"not a GGUF file: only {len(magic)} bytes long")
            raise NotGGUFError(p, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        reader.hash.update(magic)
        version = reader.unpack("<I")
        if version not in (2, 3):
            raise NotGGUFError(p, f"unsupported GGUF version {version} (this tool reads versions 2 and 3)")
        n_tensors, n_kv = reader.unpack("<Q"), reader.unpack("<Q")
        alignment = 32  # GGUF_DEFAULT_ALIGNMENT, unless general.alignment says otherwise
        for _ in range(n_kv):
            key = reader.string()
            vtype = reader.unpack("<I")
            if key == b"general.alignment" and vtype == 4:
                alignment = reader.unpack("<I") or 32
            else:
                reader.skip_value(vtype)
        tensors = []
        for _ in range(n_tensors):
            name = reader.string().decode("utf-8", errors="replace")
            n_dims = reader.unpack("<I")
            dims = struct.unpack(f"<{n_dims}Q", reader.read(8 * n_dims)) if n_dims else ()
            ggml_type, offset = reader.unpack("<I"), reader.unpack("<Q")
            tensors.append((name, dims, ggml_type, offset))
        header_len = handle.tell()
    return {
        "version": version,
        "n_tensors": n_tensors,
        "n_kv": n_kv,
        "header_len": header_len,
        "data_offset": -(-header_len // alignment) * alignment,
        "tensors": tensors,  # (name, dims, ggml type, offset from data_offset)
        "header_hash": reader.hash.hexdigest(),
        "size": size,
    }


def split_parts(path: str | os.PathLike[str]) -> list[Path]:
    """All files of a split GGUF (``name-00001-of-00003.gguf``), or just ``path``."""
    p = Path(path)
    match = SPLIT_RE.match(p.name)
    if not match:
        return [p]
    count = int(match["count"])
    return [p.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def combined_hash(headers: list[dict]) -> str:
    """One hash for a model from the ``header_info`` of each of its parts, in order."""
    digest = hashlib.sha256()
    for info in headers:
        digest.update(info["header_hash"].encode())
    return digest.hexdigest()


def model_fingerprint(path: str | os.PathLike[str]) -> dict:
    """``{"file_name", "size", "header_hash"}`` of a model (all parts of a split model)."""
    headers = [header_info(part) for part in split_parts(path)]
    return {"file_name": Path(path).name, "size": sum(h["size"] for h in headers), "header_hash": combined_hash(headers)}
