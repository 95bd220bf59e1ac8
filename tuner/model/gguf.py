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
from typing import Any, BinaryIO

from ..errors import ModelNotFoundError, NotGGUFError, TruncatedGGUFError

GGUF_MAGIC = b"GGUF"
# gguf value types (ggml/include/gguf.h, enum gguf_type) -> struct format of a scalar
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


class _Reader:
    """Reads a GGUF header from a binary handle (a file, or the range-request reader of
    ``tuner.model.remote``), hashing every byte it reads."""

    def __init__(self, handle: BinaryIO, source: object, size: int) -> None:
        self.handle, self.source, self.size = handle, source, size
        self.hash = hashlib.sha256()

    def read(self, n: int) -> bytes:
        # A count in a header is hostile until bounded: never ask the handle for more bytes than
        # the file has (a remote handle would fetch them).
        if n > self.size - self.handle.tell():
            raise TruncatedGGUFError(
                self.source,
                f"truncated GGUF: the header runs past the end of the file ({self.size} bytes); re-download or re-convert the file",
            )
        data = self.handle.read(n)
        if len(data) != n:
            raise TruncatedGGUFError(
                self.source, f"truncated GGUF: the header ends at byte {self.handle.tell()} of {self.size}; re-download or re-convert the file"
            )
        self.hash.update(data)
        return data

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> bytes:
        length = self.unpack("<Q")
        if length > self.size:
            raise TruncatedGGUFError(self.source, f"corrupt GGUF header: a string of {length} bytes in a file of {self.size}")
        return self.read(length)

    def value(self, vtype: int, keep: bool) -> Any:
        """Read one value; return it decoded when ``keep`` (strings as str, arrays as lists)."""
        if vtype in _SCALAR:
            data = self.read(struct.calcsize(_SCALAR[vtype]))
            return struct.unpack(_SCALAR[vtype], data)[0] if keep else None
        if vtype == _STRING:
            data = self.string()
            return data.decode("utf-8", errors="replace") if keep else None
        if vtype == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR:
                fmt = _SCALAR[item_type]
                data = self.read(struct.calcsize(fmt) * count)
                return list(struct.unpack(f"<{count}{fmt[1:]}", data)) if keep else None
            if count > self.size:  # every item takes at least one byte
                raise TruncatedGGUFError(self.source, f"corrupt GGUF header: an array of {count} items in a file of {self.size} bytes")
            items = [self.value(item_type, keep) for _ in range(count)]
            return items if keep else None
        raise NotGGUFError(self.source, f"corrupt GGUF header: unknown value type {vtype}")


def check_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.exists():
        if re.match(r"^(https?|hf)://", str(path)):
            raise ModelNotFoundError(
                path, "a URL: inspect and estimate read a model's header over the network, but this needs the file on disk; download it first"
            )
        raise ModelNotFoundError(p, "no such file; check the path")
    if p.is_dir():
        raise ModelNotFoundError(p, "is a directory, not a GGUF file; name a .gguf file inside it")
    return p


def read_header(handle: BinaryIO, source: object, size: int, *, values: bool = False) -> dict:
    """Parse a GGUF header and tensor table from ``handle`` (positioned at byte 0 of a file of
    ``size`` bytes), reading nothing past the tensor table.

    Returns version, tensor/kv counts, header length, data offset, the tensors as
    ``(name, dims, ggml type, offset from data_offset)``, the header's sha256 and ``size``; with
    ``values``, also ``fields``: every metadata key and its value (strings decoded, arrays as
    lists). ``source`` (a path or URL) names the file in errors.
    """
    reader = _Reader(handle, source, size)
    magic = handle.read(4)
    if magic != GGUF_MAGIC:
        if len(magic) < 4:
            raise NotGGUFError(source, f"not a GGUF file: only {len(magic)} bytes long")
        raise NotGGUFError(source, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    reader.hash.update(magic)
    version = reader.unpack("<I")
    if version not in (2, 3):
        raise NotGGUFError(source, f"unsupported GGUF version {version} (this tool reads versions 2 and 3)")
    n_tensors, n_kv = reader.unpack("<Q"), reader.unpack("<Q")
    if n_kv > size or n_tensors > size:
        raise TruncatedGGUFError(source, f"corrupt GGUF header: {n_kv} keys and {n_tensors} tensors in a file of {size} bytes")
    alignment = 32  # GGUF_DEFAULT_ALIGNMENT, unless general.alignment says otherwise
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = reader.string().decode("utf-8", errors="replace")
        vtype = reader.unpack("<I")
        if key == "general.alignment" and vtype == 4:
            alignment = reader.unpack("<I") or 32
            if alignment & (alignment - 1):
                raise NotGGUFError(source, f"corrupt GGUF header: general.alignment {alignment} is not a power of two")
            value: Any = alignment
        else:
            value = reader.value(vtype, values)
        if values:
            if key in fields:
                raise NotGGUFError(source, f"corrupt GGUF header: the key {key[:80]!r} appears twice")
            fields[key] = value
    tensors = []
    for _ in range(n_tensors):
        name = reader.string().decode("utf-8", errors="replace")
        n_dims = reader.unpack("<I")
        if n_dims > 8:  # GGML_MAX_DIMS is 4
            raise NotGGUFError(source, f"corrupt GGUF header: tensor {name[:80]!r} has {n_dims} dimensions")
        dims = struct.unpack(f"<{n_dims}Q", reader.read(8 * n_dims)) if n_dims else ()
        ggml_type, offset = reader.unpack("<I"), reader.unpack("<Q")
        tensors.append((name, dims, ggml_type, offset))
    header_len = handle.tell()
    out = {
        "version": version,
        "n_tensors": n_tensors,
        "n_kv": n_kv,
        "header_len": header_len,
        "alignment": alignment,
        "data_offset": -(-header_len // alignment) * alignment,
        "tensors": tensors,  # (name, dims, ggml type, offset from data_offset)
        "header_hash": reader.hash.hexdigest(),
        "size": size,
    }
    if values:
        out["fields"] = fields
    return out


def header_info(path: str | os.PathLike[str], *, values: bool = False) -> dict:
    """Read a GGUF file's header: see ``read_header``."""
    p = check_path(path)
    with open(p, "rb") as handle:
        return read_header(handle, p, p.stat().st_size, values=values)


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
