"""Quantization variants of a model, made with llama.cpp's own quantizer and kept in the data folder.

    paths = make_variants("model-F16.gguf", ["Q4_K_M", "Q8_0"], imatrix="imatrix.gguf")

Each variant is made once from a high-precision source (F32, F16 or BF16) by
``llama_model_quantize`` in a child process (the caller never imports llama_cpp, and a crash in the
quantizer cannot take it down), and kept under ``<data>/models/quantized/<source sha256>/`` (with
the imatrix's sha256 in the folder name when one is given): asking again for the same (source,
type, imatrix) reuses the file. Before each one the free disk space is checked against the
variant's expected size. Requantizing an already-quantized source compounds two rounds of
rounding error, so it is refused unless ``allow_requantize``.

The importance matrix (``--imatrix``) is read here, in both of llama.cpp's formats (the GGUF one
written by ``llama-imatrix`` today and the legacy ``.dat``), normalized as llama.cpp's
``tools/quantize/quantize.cpp`` does, and handed to the quantizer as its
``llama_model_imatrix_data`` array; the variant records ``quantize.imatrix.*`` in its header as
``llama-quantize`` does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import QuantizeError
from .quant import FILE_TYPES, quantized_size

# llama_ftype values by the names llama-quantize takes (tuner.model.quant keeps the table).
FTYPES: dict[str, int] = {name: ft.ftype for name, ft in FILE_TYPES.items()}
HIGH_PRECISION = ("F32", "F16", "BF16")
_HEADROOM = 64 << 20  # some room left for the rest of the machine
_SOURCE_SUFFIX_RE = re.compile(r"[-_.](F32|F16|BF16|f32|f16|bf16)$")
# llama.cpp's per-tensor progress line, src/llama-quant.cpp (2024-2026):
#   LLAMA_LOG_INFO("[%4d/%4d] %-36s - [%s], type = %6s, ", ++idx, ml.n_tensors, ...)
_PROGRESS_RE = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")

Event = dict[str, Any]


def parse_types(value: str | Sequence[str]) -> list[str]:
    """``"Q4_K_M,q8_0"`` or a list -> ``["Q4_K_M", "Q8_0"]``; an unknown type is a ``QuantizeError``."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        name = item.strip().upper()
        if not name:
            continue
        if name not in FTYPES:
            raise QuantizeError(f"unknown quantization type {item.strip()!r}; known: {', '.join(FTYPES)}")
        if name not in out:
            out.append(name)
    return out


def variant_name(source: Path, qtype: str) -> str:
    """``model-F16.gguf`` -> ``model-Q4_K_M.gguf``."""
    stem = _SOURCE_SUFFIX_RE.sub("", source.stem)
    return f"{stem}-{qtype}.gguf"


def expected_size(info: Any, qtype: str, *, imatrix: bool = False) -> int:
    """The variant's size in bytes, for the free-disk check: its tensor data as llama.cpp's rules
    give it (``tuner.model.quant``) and the source's header (the metadata is copied)."""
    return quantized_size(info, qtype, imatrix=imatrix).n_bytes + (info.file_size - sum(t.n_bytes for t in info.tensors))


def make_variants(
    source: str | os.PathLike[str],
    types: Sequence[str] | str,
    *,
    imatrix: str | os.PathLike[str] | None = None,
    allow_requantize: bool = False,
    folder: str | os.PathLike[str] | None = None,
    nthread: int = 0,
    on_event: Callable[[Event], None] | None = None,
) -> list[Path]:
    """Make (or reuse) the variants of ``source`` in each of ``types``; returns their paths in order.

    Events: ``{"kind": "quantize", "type", "path", "index", "count"}`` before each made variant,
    ``{"kind": "quantize_progress", "type", "tensor", "tensors"}`` as llama.cpp goes,
    ``{"kind": "quantize_done", ...}`` and ``{"kind": "quantize_reused", "type", "path"}``.
    """
    from .filehash import file_sha256
    from .inspect import inspect

    emit = on_event or (lambda event: None)
    wanted = parse_types(types)
    info = inspect(source)
    src = Path(info.path)
    if info.quantization.upper() not in HIGH_PRECISION and not allow_requantize:
        raise QuantizeError(
            f"{src}: already quantized ({info.quantization}); quantizing it again compounds the rounding error. "
            "Give an F32, F16 or BF16 source, or pass --allow-requantize"
        )
    for qtype in wanted:
        if FILE_TYPES[qtype].needs_imatrix and not imatrix:
            raise QuantizeError(f"{qtype} needs an importance matrix (llama.cpp refuses to make it without one): give --imatrix FILE")
    matrix = _read_imatrix(Path(imatrix)) if imatrix else None
    key = file_sha256(src)[:16]
    if imatrix:
        key += "-imatrix-" + file_sha256(imatrix)[:12]
    if folder is None:
        from ..paths import models_dir

        base = models_dir() / "quantized" / key
    else:
        base = Path(folder) / key
    base.mkdir(parents=True, exist_ok=True)
    out: list[Path] = []
    for index, qtype in enumerate(wanted, 1):
        target = base / variant_name(src, qtype)
        if target.exists():
            emit({"kind": "quantize_reused", "type": qtype, "path": str(target)})
            out.append(target)
            continue
        need = expected_size(info, qtype, imatrix=matrix is not None) + _HEADROOM
        free = shutil.disk_usage(base).free
        if free < need:
            raise QuantizeError(
                f"not enough free disk to make {target.name}: about {need / (1 << 20):.0f} MiB needed, "
                f"{free / (1 << 20):.0f} MiB free in {base}"
            )
        emit({"kind": "quantize", "type": qtype, "path": str(target), "index": index, "count": len(wanted)})
        quantize_file(src, target, qtype, imatrix=matrix, imatrix_path=str(imatrix) if imatrix else None,
                      allow_requantize=allow_requantize, nthread=nthread,
                      on_progress=lambda i, n, q=qtype: emit({"kind": "quantize_progress", "type": q, "tensor": i, "tensors": n}))
        emit({"kind": "quantize_done", "type": qtype, "path": str(target), "size": target.stat().st_size})
        out.append(target)
    return out


_QUANTIZE_SCRIPT = r"""
import ctypes, json, os, sys
import llama_cpp

job = json.loads(sys.argv[1])


@llama_cpp.llama_log_callback
def on_log(level, text, user_data):
    if text:
        os.write(2, text)


llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = job["ftype"]
params.nthread = job["nthread"]
params.allow_requantize = job["allow_requantize"]
keep = []
if job.get("imatrix_npz"):
    import numpy as np

    data = np.load(job["imatrix_npz"], allow_pickle=False)
    names = list(data.files)
    entries = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()
    for i, name in enumerate(names):
        values = np.ascontiguousarray(data[name], dtype=np.float32)
        keep.append(values)
        encoded = name.encode()
        keep.append(encoded)
        entries[i].name = encoded
        entries[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        entries[i].size = values.size
    entries[len(names)].name = None  # the array ends with a null name (llama.h)
    keep.append(entries)
    params.imatrix = entries
    # What llama-quantize records in the variant's header (tools/quantize/quantize.cpp).
    overrides = (llama_cpp.llama_model_kv_override * 5)()
    items = [("quantize.imatrix.file", job["imatrix_file"]), ("quantize.imatrix.entries_count", len(names))]
    if job.get("imatrix_dataset"):
        items.append(("quantize.imatrix.dataset", job["imatrix_dataset"]))
    if job.get("imatrix_chunks"):
        items.append(("quantize.imatrix.chunks_count", job["imatrix_chunks"]))
    for i, (k, v) in enumerate(items):
        overrides[i].key = k.encode()
        if isinstance(v, int):
            overrides[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT
            overrides[i].value.val_i64 = v
        else:
            overrides[i].tag = llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR
            overrides[i].value.val_str = v.encode()[:127]
    overrides[len(items)].key = b""
    keep.append(overrides)
    params.kv_overrides = overrides
rc = llama_cpp.llama_model_quantize(job["src"].encode(), job["dst"].encode(), params)
sys.exit(0 if rc == 0 else 3)
"""


def quantize_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    qtype: str,
    *,
    imatrix: "Imatrix | None" = None,
    imatrix_path: str | None = None,
    allow_requantize: bool = False,
    nthread: int = 0,
    on_progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Quantize ``src`` into ``dst`` with ``llama_model_quantize`` in a child process.

    The file appears at ``dst`` only when whole (written as ``dst.part``, then renamed)."""
    qtype = qtype.upper()
    if qtype not in FTYPES:
        raise QuantizeError(f"unknown quantization type {qtype!r}; known: {', '.join(FTYPES)}")
    out = Path(dst)
    tmp = out.with_name(out.name + ".part")
    with tempfile.TemporaryDirectory(prefix="offload-tuner-quantize-") as scratch:
        job: dict[str, Any] = {"src": str(src), "dst": str(tmp), "ftype": FTYPES[qtype], "nthread": nthread,
                               "allow_requantize": allow_requantize}
        if imatrix is not None:
            import numpy as np

            matrix_file = Path(scratch) / "imatrix.npz"
            with open(matrix_file, "wb") as handle:
                np.savez(handle, **imatrix.entries)
            job.update(imatrix_npz=str(matrix_file), imatrix_file=Path(imatrix_path or "imatrix").name[:127],
                       imatrix_dataset=imatrix.datasets[0][:127] if imatrix.datasets else None,
                       imatrix_chunks=imatrix.chunk_count)
        proc = subprocess.Popen([sys.executable, "-c", _QUANTIZE_SCRIPT, json.dumps(job)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        tail: list[str] = []
        assert proc.stderr is not None
        try:
            for raw in proc.stderr:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                match = _PROGRESS_RE.match(line)
                if match and on_progress is not None:
                    on_progress(int(match[1]), int(match[2]))
                elif line.strip():
                    tail = (tail + [line])[-8:]
            proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            tmp.unlink(missing_ok=True)
            raise
    if proc.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        how = f"exit {proc.returncode}" if proc.returncode >= 0 else f"killed by signal {-proc.returncode}"
        raise QuantizeError(f"llama.cpp could not quantize {src} to {qtype} ({how}): " + " | ".join(tail[-4:]))
    os.replace(tmp, out)
    return out


# -- the importance matrix ------------------------------------------------------------------------


class Imatrix:
    """Per-tensor importance values, normalized as llama.cpp's quantize tool does."""

    def __init__(self, entries: dict[str, Any], datasets: list[str], chunk_count: int) -> None:
        self.entries, self.datasets, self.chunk_count = entries, datasets, chunk_count


# A real imatrix holds one float per input column of each weight matrix: tens of MiB at most for
# today's models. Bound what a damaged or hostile file can make us allocate.
_MAX_IMATRIX_VALUES = 1 << 31


def _read_imatrix(path: Path) -> Imatrix:
    if not path.is_file():
        raise QuantizeError(f"{path}: no such imatrix file")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    try:
        return _read_gguf_imatrix(path) if magic == b"GGUF" else _read_legacy_imatrix(path)
    except QuantizeError:
        raise
    except (ValueError, struct.error, OSError, IndexError) as exc:
        raise QuantizeError(f"{path}: not a readable importance matrix ({exc})") from None


def _read_gguf_imatrix(path: Path) -> Imatrix:
    """llama-imatrix's GGUF format (common/imatrix-loader.cpp): ``NAME.in_sum2`` and ``NAME.counts``
    F32 tensors, and the ``imatrix.datasets``, ``imatrix.chunk_count``, ``imatrix.chunk_size`` keys."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path), "r")

    def field(name: str) -> Any:
        f = reader.get_field(name)
        return None if f is None else f.contents()

    datasets, chunk_count, chunk_size = field("imatrix.datasets"), field("imatrix.chunk_count"), field("imatrix.chunk_size")
    if datasets is None or chunk_count is None or chunk_size is None:
        raise QuantizeError(f"{path}: missing imatrix metadata (imatrix.datasets, chunk_count, chunk_size)")
    sums: dict[str, Any] = {}
    counts: dict[str, Any] = {}
    for tensor in reader.tensors:
        for suffix, into in ((".in_sum2", sums), (".counts", counts)):
            if tensor.name.endswith(suffix):
                if int(tensor.tensor_type) != int(gguf.GGMLQuantizationType.F32):
                    raise QuantizeError(f"{path}: sums and counts for {tensor.name[: -len(suffix)]} must be F32")
                into[tensor.name[: -len(suffix)]] = np.asarray(tensor.data, dtype=np.float32).reshape(-1)
    if not sums:
        raise QuantizeError(f"{path}: no importance data in this GGUF (no *.in_sum2 tensors)")
    entries: dict[str, Any] = {}
    for name in sorted(set(sums) | set(counts)):
        if name not in sums or name not in counts:
            raise QuantizeError(f"{path}: mismatched sums and counts for {name}")
        s, c = sums[name], np.rint(counts[name]).astype(np.int64)
        if c.size == 0 or s.size % c.size:
            raise QuantizeError(f"{path}: {name} has {s.size} sums for {c.size} counts")
        per = s.reshape(c.size, -1)
        # sums / count per expert; a slice nothing was counted for is all ones
        safe = np.where(c > 0, c, 1).astype(np.float32)[:, None]
        entries[name] = np.where(c[:, None] > 0, per / safe, 1.0).astype(np.float32).reshape(-1)
    return Imatrix(entries, [str(d) for d in (datasets if isinstance(datasets, list) else [datasets])], int(chunk_count))


def _read_legacy_imatrix(path: Path) -> Imatrix:
    """The legacy binary format (common/imatrix-loader.cpp, common_imatrix_load_legacy): int32
    entries; per entry int32 name length, name, int32 ncall, int32 nval, nval floats; then an
    optional int32 chunk count and int32-length dataset name."""
    import numpy as np

    data = path.read_bytes()
    pos = 0

    def take(fmt: str) -> Any:
        nonlocal pos
        value = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return value

    n_entries = take("<i")
    if n_entries < 1 or n_entries > len(data) // 12:
        raise QuantizeError(f"{path}: not an importance matrix (neither GGUF nor llama.cpp's legacy format)")
    entries: dict[str, Any] = {}
    total = 0
    for i in range(n_entries):
        length = take("<i")
        if length < 0 or pos + length > len(data):
            raise QuantizeError(f"{path}: entry {i + 1} has a bad name length {length}")
        name = data[pos : pos + length].decode("utf-8", errors="replace")
        pos += length
        ncall, nval = take("<i"), take("<i")
        total += nval
        if nval < 1 or pos + 4 * nval > len(data) or total > _MAX_IMATRIX_VALUES:
            raise QuantizeError(f"{path}: entry {name!r} has a bad value count {nval}")
        values = np.frombuffer(data, dtype="<f4", count=nval, offset=pos).astype(np.float32)
        pos += 4 * nval
        entries[name] = values / ncall if ncall > 0 else values
    chunks, datasets = 0, []
    if pos + 4 <= len(data):
        chunks = take("<i")
        if pos + 4 <= len(data):
            length = take("<i")
            if 0 < length <= len(data) - pos:
                datasets.append(data[pos : pos + length].decode("utf-8", errors="replace"))
    return Imatrix(entries, datasets, chunks)


__all__ = ["FTYPES", "HIGH_PRECISION", "Imatrix", "expected_size", "make_variants", "parse_types", "quantize_file", "variant_name"]
