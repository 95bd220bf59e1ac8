"""What a GGUF file is, from its header alone: shapes, quantization, and what every part costs.

``inspect(path)`` reads the GGUF metadata and tensor table (``tuner.model.gguf``'s reader, from a
file, or from bytes fetched over HTTP by ``tuner.model.remote`` for a URL) and returns a
``ModelInfo``: the architecture's hyperparameters, bytes per repeating layer split by role
(attention, FFN, MoE experts, norms), the non-repeating tensors (token embedding, output head
and norm), and KV cache bytes per token for each KV cache type. The memory arithmetic
(``tuner.model.estimate``) stands on it.

Split models (``name-00001-of-00003.gguf``) are read part by part. The ``gguf`` package gives
the ggml type names and block sizes only.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .. import limits
from ..errors import EmptyModelError, ModelNotFoundError, NotGGUFError, TruncatedGGUFError, UnsupportedArchitectureError
from .gguf import check_path, combined_hash, header_info, split_parts

# ggml type -> (block size, bytes per block): ggml/src/ggml.c type_traits. Used for the KV cache.
KV_TYPE_BLOCKS: dict[str, tuple[int, int]] = {
    "f32": (1, 4),
    "f16": (1, 2),
    "bf16": (1, 2),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "iq4_nl": (32, 18),
}

# The role of a tensor inside a repeating block, by its name (llama.cpp's LLM_TENSOR_* names,
# src/llama-arch.cpp). Order matters: expert tensors before the plain FFN pattern.
_ROLE_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("experts", re.compile(r"\.ffn_(gate|up|down|gate_up)_(exps|shexp|chexps)\b|\.ffn_gate_inp(_shexp)?\b|\.exp_probs_b\b")),
    ("norms", re.compile(r"_norm(_\w+)?\.(weight|bias)$|\.layer_output_norm|\.ln_\d|\.norm\.")),
    ("attention", re.compile(r"\.attn_|\.(q|k|v|o|qkv)_proj|\.wq|\.wk|\.wv|\.wo|\.ssm_|\.time_mix|\.attn\.|\.pos_|\.rel_")),
    ("ffn", re.compile(r"\.ffn_|\.channel_mix|\.mlp|\.w[123]\b")),
]
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_NONREPEATING = {
    "token_embd": "token_embd",
    "output": "output",
    "output_norm": "output_norm",
}


@dataclass(frozen=True)
class LayerBytes:
    attention: int = 0
    ffn: int = 0
    experts: int = 0
    norms: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return self.attention + self.ffn + self.experts + self.norms + self.other


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # ggml type name, e.g. Q4_K
    shape: tuple[int, ...]  # ggml order (ne0 first)
    n_bytes: int
    n_elements: int
    offset: int = -1  # where its data starts in its file (bytes from the file's start); -1: not known
    part: int = 0  # which file of a split model holds it


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architecture: str
    name: str | None
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_head_kv_per_layer: tuple[int, ...]
    head_size_k: int
    head_size_v: int
    n_ctx_train: int
    n_vocab: int
    n_ff: int | None
    expert_count: int
    expert_used_count: int
    file_type: int | None
    quantization: str
    n_params: int
    file_size: int
    n_tensors: int
    split_count: int
    layer_bytes: tuple[LayerBytes, ...]  # per repeating layer
    nonrepeating_bytes: dict[str, int]  # token_embd, output, output_norm, other
    kv_bytes_per_token: dict[str, int]  # KV cache type -> bytes per token, all layers, K and V
    kv_layers: tuple[int, ...]  # layers that hold a KV cache (not all do in some architectures)
    sliding_window: int | None
    swa_layers: tuple[int, ...]
    header_hash: str
    tensor_types: dict[str, int] = field(default_factory=dict)  # ggml type -> count
    tensors: tuple[TensorInfo, ...] = field(default=(), repr=False)
    # For a URL: what was read and from where (``tuner.model.remote.RemoteHeaders.to_dict``).
    fetched: dict[str, Any] | None = field(default=None, compare=False)

    @property
    def file_name(self) -> str:
        """The model file's name (the last part of a URL's path for a URL)."""
        return _file_name(self.path)

    @property
    def bytes_per_layer(self) -> int:
        """Average bytes of one repeating layer."""
        return sum(l.total for l in self.layer_bytes) // max(1, len(self.layer_bytes))

    @property
    def is_moe(self) -> bool:
        return self.expert_count > 0

    @property
    def tied_output(self) -> bool:
        """No ``output.weight``: llama.cpp reuses the token embedding as the output head, loading a
        copy of it with the output layer (``TENSOR_DUPLICATED`` in src/models/*.cpp) when that
        layer is offloaded."""
        return not self.nonrepeating_bytes.get("output") and bool(self.nonrepeating_bytes.get("token_embd"))

    @property
    def output_layer_bytes(self) -> int:
        """What the output layer puts on the device it is offloaded to: its norm and its head (the
        token embedding's copy when the output is tied to it)."""
        head = self.nonrepeating_bytes.get("token_embd", 0) if self.tied_output else self.nonrepeating_bytes.get("output", 0)
        return head + self.nonrepeating_bytes.get("output_norm", 0)

    def kv_bytes_per_token_layer(self, layer: int, type_k: str = "f16", type_v: str = "f16") -> int:
        """KV bytes one token costs in one layer for the given cache types (0 for a KV-less layer)."""
        if layer not in self.kv_layers:
            return 0
        n_kv = self.n_head_kv_per_layer[layer] if self.n_head_kv_per_layer else self.n_head_kv
        return _row_size(type_k, self.head_size_k * n_kv) + _row_size(type_v, self.head_size_v * n_kv)

    def fingerprint(self) -> dict[str, Any]:
        return {
            "file_name": self.file_name,
            "size": self.file_size,
            "header_hash": self.header_hash,
            "architecture": self.architecture,
            "quantization": self.quantization,
            "n_layer": self.n_layer,
        }

    def same_model_as(self, other: "ModelInfo") -> str | None:
        """None if ``other`` is the same model in another quantization; else why not."""
        for key in ("architecture", "n_layer", "n_embd", "n_head", "n_head_kv", "n_vocab", "n_ff", "expert_count"):
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine != theirs:
                return f"{key} differs ({theirs} in {other.file_name}, {mine} in {self.file_name})"
        return None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("tensors")
        if out["fetched"] is None:
            out.pop("fetched")
        out["layer_bytes"] = [asdict(l) | {"total": l.total} for l in self.layer_bytes]
        out["bytes_per_repeating_layer"] = {
            role: sum(getattr(l, role) for l in self.layer_bytes) // max(1, self.n_layer)
            for role in ("attention", "ffn", "experts", "norms", "other")
        }
        out["bytes_per_repeating_layer"]["total"] = self.bytes_per_layer
        out["head_sizes"] = {"k": self.head_size_k, "v": self.head_size_v}
        return out


def _file_name(path: str) -> str:
    from .remote import is_url

    if is_url(path):
        from urllib.parse import unquote, urlsplit

        return unquote(urlsplit(path).path.rstrip("/").rsplit("/", 1)[-1])
    return Path(path).name


def _row_size(type_name: str, n: int) -> int:
    block, size = KV_TYPE_BLOCKS[type_name]
    return (n // block) * size


def tensor_role(name: str) -> str:
    """What a repeating layer's tensor is for: attention, ffn, experts, norms or other."""
    return _role(name)


def _role(name: str) -> str:
    for role, pattern in _ROLE_PATTERNS:
        if pattern.search(name):
            return role
    return "other"


def inspect(path: str | Any) -> ModelInfo:
    """Read a GGUF model's facts and sizes. Raises a ``ModelError`` subclass on bad input.

    ``path`` is a file, or a URL (``https://...``, ``http://...``, ``hf://OWNER/REPO/FILE.gguf``):
    then only the header and tensor table of each part are fetched, with range requests, and the
    answer is the same as for the downloaded file but for ``path`` (the URL) and ``fetched``
    (what was read, and from where).
    """
    from . import remote

    if remote.is_url(path):
        got = remote.read_headers(str(path))
        return _model_info(str(path), list(zip(got.urls, got.headers)), fetched=got.to_dict())
    first = check_path(path)
    parts = split_parts(first)
    for part in parts:
        if not part.exists():
            raise ModelNotFoundError(part, f"part of the split model {first.name} is missing; all {len(parts)} parts must sit side by side")
    # One pass over each part's header: our own reader gives clear errors for a bad magic or a
    # truncated file, the header hash and every metadata value.
    return _model_info(str(first), [(part, header_info(part, values=True)) for part in parts])


def check_model_file(path: str | Any) -> None:
    """Raise the ``ModelError`` that says why ``path`` is not a usable GGUF file: missing, not
    GGUF, a part of a split model missing, or truncated in its header or in its tensor data.
    Lighter than ``inspect`` (no hyperparameter sizing): for the commands that hand the file to
    llama.cpp, which would fail on it with a long report."""
    first = check_path(path)
    for part in split_parts(first):
        if not part.exists():
            raise ModelNotFoundError(part, f"part of the split model {first.name} is missing")
        _tensors(part, header_info(part))


def _model_info(path: str, parts: list[tuple[Any, dict]], fetched: dict | None = None) -> ModelInfo:
    """A ``ModelInfo`` from the parsed headers (``read_header(..., values=True)``) of each part,
    in order, each with the path or URL that names it in errors."""
    first = parts[0][0]
    fields = parts[0][1]["fields"]
    arch = fields.get("general.architecture")
    if not arch:
        raise UnsupportedArchitectureError(first, "no general.architecture key; this GGUF does not describe a model")
    arch = str(arch)

    tensors: list[TensorInfo] = []
    for index, (source, header) in enumerate(parts):
        tensors.extend(_tensors(source, header, index))
    file_size = sum(header["size"] for _, header in parts)
    if not tensors:
        raise EmptyModelError(first, "the GGUF holds no tensors (a vocabulary-only or metadata-only file?); it cannot be run")

    def key(name: str, required: bool = True, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{name}")
        if value is None:
            if required:
                raise UnsupportedArchitectureError(
                    first, f"cannot size architecture {arch!r}: the GGUF lacks {arch}.{name}"
                )
            return default
        return value

    # Every count read from the header is bounded before anything is sized or allocated from it,
    # against tuner.limits and against the file's own tensors (block_count = 10^9 once made inspect,
    # estimate and tune eat memory until the machine ran out); the message names the key.
    hyper = _Hyper(first, arch, tensors)
    n_layer = hyper.count("block_count", key("block_count"), 1, limits.MAX_GGUF_LAYERS)
    hyper.layers_have_tensors(n_layer)
    n_embd = hyper.count("embedding_length", key("embedding_length"), 1, limits.MAX_GGUF_EMBD)
    hyper.embedding_matches(n_embd)
    n_head_raw = key("attention.head_count")
    n_head_list = hyper.per_layer("attention.head_count", n_head_raw, n_layer, 0, limits.MAX_GGUF_HEADS)
    n_head = max(n_head_list)
    if n_head == 0:
        raise UnsupportedArchitectureError(first, f"cannot size architecture {arch!r}: {arch}.attention.head_count is 0")
    kv_raw = key("attention.head_count_kv", required=False, default=n_head_raw)
    kv_per_layer = tuple(hyper.per_layer("attention.head_count_kv", kv_raw, n_layer, 0, limits.MAX_GGUF_HEADS))
    if not isinstance(kv_raw, list) and kv_per_layer and kv_per_layer[0] == 0:
        hyper.bad("attention.head_count_kv", 0, "at least 1 (a model whose layers attend has key/value heads)")
    n_head_kv = max(kv_per_layer) if kv_per_layer else n_head
    head_k = hyper.count("attention.key_length", key("attention.key_length", required=False, default=n_embd // n_head), 1, 1 << 16)
    head_v = hyper.count("attention.value_length", key("attention.value_length", required=False, default=n_embd // n_head), 1, 1 << 16)
    n_ctx_train = hyper.count("context_length", key("context_length"), 1, limits.MAX_GGUF_CONTEXT)
    n_ff_raw = key("feed_forward_length", required=False)
    n_ff = max(hyper.per_layer("feed_forward_length", n_ff_raw, n_layer, 0, 1 << 24)) if n_ff_raw is not None else None
    expert_count = hyper.count("expert_count", key("expert_count", required=False, default=0) or 0, 0, limits.MAX_GGUF_EXPERTS)
    expert_used = hyper.count("expert_used_count", key("expert_used_count", required=False, default=0) or 0, 0, expert_count)
    sliding_window = key("attention.sliding_window", required=False)
    sliding_window = hyper.count("attention.sliding_window", sliding_window, 0, limits.MAX_GGUF_CONTEXT) or None if sliding_window else None
    swa_layers = _swa_layers(fields, arch, n_layer, sliding_window)

    layer_roles: list[dict[str, int]] = [dict(attention=0, ffn=0, experts=0, norms=0, other=0) for _ in range(n_layer)]
    nonrep = {"token_embd": 0, "output": 0, "output_norm": 0, "other": 0}
    type_counts: dict[str, int] = {}
    has_output = False
    for t in tensors:
        type_counts[t.type] = type_counts.get(t.type, 0) + 1
        m = _BLOCK_RE.match(t.name)
        if m and int(m.group(1)) < n_layer:
            layer_roles[int(m.group(1))][_role(t.name)] += t.n_bytes
            continue
        base = t.name.rsplit(".", 1)[0]
        if base in _NONREPEATING:
            nonrep[_NONREPEATING[base]] += t.n_bytes
            has_output = has_output or base == "output"
        else:
            nonrep["other"] += t.n_bytes

    # Layers with a KV cache: those with K/V projections (or fused QKV); in recurrent and
    # hybrid models some layers carry none.
    kv_layers = tuple(
        i
        for i in range(n_layer)
        if any(t.name.startswith(f"blk.{i}.attn_k") or t.name.startswith(f"blk.{i}.attn_qkv") for t in tensors)
        and kv_per_layer[i] > 0
    )
    if not kv_layers and arch in ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3", "phi3"):
        raise UnsupportedArchitectureError(first, f"cannot size the KV cache: no attn_k tensors found in {arch!r}")

    file_type = fields.get("general.file_type")
    quant_name = _quantization_name(file_type, type_counts)
    n_params = sum(t.n_elements for t in tensors)
    name = fields.get("general.name")
    vocab = fields.get("tokenizer.ggml.tokens")
    n_vocab = hyper.count("vocab_size", key("vocab_size", required=False, default=0) or 0, 0, 1 << 24) or (len(vocab) if isinstance(vocab, list) else 0)

    result = ModelInfo(
        path=path,
        architecture=arch,
        name=str(name) if name is not None else None,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        n_head_kv_per_layer=kv_per_layer,
        head_size_k=head_k,
        head_size_v=head_v,
        n_ctx_train=n_ctx_train,
        n_vocab=n_vocab,
        n_ff=n_ff,
        expert_count=expert_count,
        expert_used_count=expert_used,
        file_type=int(file_type) if file_type is not None else None,
        quantization=quant_name,
        n_params=n_params,
        file_size=file_size,
        n_tensors=len(tensors),
        split_count=len(parts),
        layer_bytes=tuple(LayerBytes(**r) for r in layer_roles),
        nonrepeating_bytes=nonrep,
        kv_bytes_per_token={},
        kv_layers=kv_layers,
        sliding_window=sliding_window,
        swa_layers=swa_layers,
        header_hash=combined_hash([header for _, header in parts]),
        tensor_types=type_counts,
        tensors=tuple(tensors),
        fetched=fetched,
    )
    kv = {
        t: sum(result.kv_bytes_per_token_layer(i, t, t) for i in range(n_layer))
        for t in KV_TYPE_BLOCKS
        if all((head_k * n) % KV_TYPE_BLOCKS[t][0] == 0 and (head_v * n) % KV_TYPE_BLOCKS[t][0] == 0 for n in kv_per_layer if n)
    }
    object.__setattr__(result, "kv_bytes_per_token", kv)
    return result


class _Hyper:
    """Bounds for the hyperparameters a GGUF header states, each error naming its key."""

    def __init__(self, source: Any, arch: str, tensors: list["TensorInfo"]) -> None:
        self.source, self.arch, self.tensors = source, arch, tensors

    def bad(self, name: str, value: Any, expected: str) -> None:
        raise NotGGUFError(self.source, f"corrupt GGUF header: {self.arch}.{name} is {limits.shown(value)}; expected {expected}")

    def count(self, name: str, value: Any, low: int, high: int) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            self.bad(name, value, f"a whole number from {low} to {high}")
        return value

    def per_layer(self, name: str, value: Any, n_layer: int, low: int, high: int) -> list[int]:
        """A scalar (every layer) or a list of one value per layer."""
        if isinstance(value, list):
            if len(value) != n_layer:
                self.bad(name, f"a list of {len(value)}", f"one value per layer ({n_layer}, {self.arch}.block_count)")
            return [self.count(name, v, low, high) for v in value]
        return [self.count(name, value, low, high)] * n_layer

    def layers_have_tensors(self, n_layer: int) -> None:
        # A layer llama.cpp loads has tensors named blk.<i>.*; more layers than the file holds
        # tensors for is a corrupt (or hostile) count, not a model.
        highest = max((int(m.group(1)) for t in self.tensors if (m := _BLOCK_RE.match(t.name)) and len(m.group(1)) < 8), default=-1)
        if n_layer > highest + 1:
            holds = f"tensors for {highest + 1} layers (blk.0 to blk.{highest})" if highest >= 0 else "no layer tensors (blk.*)"
            self.bad("block_count", n_layer, f"at most the layers the file holds: {holds}")

    def embedding_matches(self, n_embd: int) -> None:
        embd = next((t for t in self.tensors if t.name == "token_embd.weight"), None)
        if embd is not None and embd.shape and embd.shape[0] != n_embd:
            self.bad("embedding_length", n_embd, f"the width of token_embd.weight ({embd.shape[0]})")


def _tensors(source: Any, header: dict, part: int = 0) -> list[TensorInfo]:
    """The tensors of one part; every tensor's bytes must lie inside the file (a cut download
    fails here, by name). For a URL the file's size is the server's, not what was fetched."""
    import gguf

    size = header["size"]
    out = []
    for name, dims, ggml_type, offset in header["tensors"]:
        try:
            qtype = gguf.GGMLQuantizationType(ggml_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise NotGGUFError(source, f"tensor {name} has an unknown ggml type {ggml_type}; this gguf package is older than the file") from None
        n = 1
        for d in dims:
            n *= d
        n_bytes = n // block * type_size
        end = header["data_offset"] + offset + n_bytes
        if end > size:
            raise TruncatedGGUFError(
                source, f"truncated GGUF: tensor {name} ends at byte {end} but the file has {size} bytes; re-download or re-convert it"
            )
        out.append(TensorInfo(name=name, type=qtype.name, shape=tuple(int(d) for d in dims), n_bytes=n_bytes, n_elements=n,
                              offset=header["data_offset"] + offset, part=part))
    return out


def _swa_layers(fields: dict[str, Any], arch: str, n_layer: int, window: int | None) -> tuple[int, ...]:
    if not window:
        return ()
    pattern = fields.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per-layer booleans (newer converters)
        return tuple(i for i, is_swa in enumerate(pattern) if is_swa)
    # llama.cpp's defaults by architecture (src/llama-model.cpp, set_swa_pattern): every Nth
    # layer is dense, the rest slide.
    period = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4, "llama4": 4}.get(arch)
    if isinstance(pattern, int):
        period = pattern  # 0: every layer slides (llama_hparams::set_swa_pattern)
    if not period:
        return tuple(range(n_layer))
    return tuple(i for i in range(n_layer) if (i % period) < (period - 1))


def _quantization_name(file_type: Any, type_counts: dict[str, int]) -> str:
    import gguf

    if file_type is not None:
        try:
            name = gguf.LlamaFileType(int(file_type)).name
            return name.replace("MOSTLY_", "").replace("ALL_", "")
        except ValueError:
            pass
    # No file type: name the most common type among 2-d weights.
    return max(type_counts, key=type_counts.get) if type_counts else "unknown"


def describe(info: ModelInfo) -> str:
    """A few lines a person reads."""
    mib = 1 << 20
    lines = [
        f"{info.file_name}: {info.architecture} {info.quantization}, {info.n_params / 1e6:.1f} M params, {info.file_size / mib:.1f} MiB"
        + (f" in {info.split_count} parts" if info.split_count > 1 else ""),
        f"  layers {info.n_layer}, n_embd {info.n_embd}, heads {info.n_head} (KV {info.n_head_kv}), head size {info.head_size_k}/{info.head_size_v}, "
        f"n_ff {info.n_ff}, vocab {info.n_vocab}, n_ctx_train {info.n_ctx_train}",
    ]
    if info.is_moe:
        lines.append(f"  experts {info.expert_count}, {info.expert_used_count} used per token")
    roles = {r: sum(getattr(l, r) for l in info.layer_bytes) / max(1, info.n_layer) / mib for r in ("attention", "ffn", "experts", "norms", "other")}
    lines.append(
        f"  per repeating layer: {info.bytes_per_layer / mib:.2f} MiB ("
        + ", ".join(f"{r} {v:.2f}" for r, v in roles.items() if v)
        + ")"
    )
    lines.append("  non-repeating: " + ", ".join(f"{k} {v / mib:.2f} MiB" for k, v in info.nonrepeating_bytes.items() if v))
    lines.append("  KV per token: " + ", ".join(f"{t} {b / 1024:.1f} KiB" for t, b in info.kv_bytes_per_token.items()))
    if info.sliding_window:
        lines.append(f"  sliding window {info.sliding_window} on {len(info.swa_layers)} of {info.n_layer} layers")
    return "\n".join(lines)
