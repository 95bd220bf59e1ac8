"""This model's size in every standard llama.cpp quantization, computed from its tensor shapes.

A quantization such as Q4_K_M is not one type applied to every tensor: llama.cpp's quantizer picks
a type per tensor (``src/llama-quant.cpp``, ``llama_tensor_get_type``): the output head gets Q6_K,
some layers' ``attn_v`` and ``ffn_down`` get more bits (``use_more_bits``), 1-d tensors, norms and
expert routers are never quantized, and a tensor whose rows do not divide into the type's blocks
falls back to a compatible type. This module follows those rules, tensor by tensor, from the shapes
in a GGUF header, so the answer to "how big is the Q4_K_M of this model?" is the size llama.cpp
would write, without making the file:

    info = inspect("model-F16.gguf")
    quantized_size(info, "Q4_K_M").n_bytes       # bytes of tensor data in the Q4_K_M file
    estimate(requantized(info, "Q4_K_M"), ...)    # memory arithmetic for that file
    size_table(info)                              # every standard quantization, smallest first

Block sizes are ggml's type traits (``ggml/src/ggml.c``, ``type_traits``). The rules are those of
the llama.cpp that llama-cpp-python 0.3.36 vendors.

Where the rules depend on something a header cannot say, this module approximates and says so in
``QuantizedSize.approximations``:

- an importance matrix changes a few choices (IQ3_XXS ``attn_v``, IQ4_NL / IQ4_XS / IQ3_XXS
  ``ffn_down``, Q4_0 / Q5_0 ``ffn_down``): the default is "no imatrix", as ``llama-quantize`` without
  ``--imatrix`` (the IQ1/IQ2/IQ3_XXS types and Q2_K_S cannot be made without one; their size is the
  same either way apart from those tensors);
- llama.cpp's model type ``LLM_TYPE_70B`` (which gives ``attn_v`` more bits) is inferred as
  llama.cpp's own quantization tests infer it: a ``llama`` model with 80 layers and grouped-query
  attention;
- per-tensor ``--tensor-type`` overrides, ``--pure``, ``--output-tensor-type`` and
  ``--token-embedding-type`` are not modelled (the defaults are);
- architecture-specific exclusions are followed for the names llama.cpp lists in
  ``tensor_allows_quantization`` (positional embeddings, SSM conv, RWKV ``time_mix_*``, multimodal
  projector parts...); GLM5-Next's extra rules are not.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import TunerError
from .inspect import _BLOCK_RE, _NONREPEATING, LayerBytes, ModelInfo, TensorInfo, _role

# ggml type -> (elements per block, bytes per block): ggml/src/ggml.c type_traits.
TYPE_BLOCKS: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "F64": (1, 8),
    "I8": (1, 1), "I16": (1, 2), "I32": (1, 4), "I64": (1, 8),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q8_1": (32, 40),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "Q8_K": (256, 292),
    "IQ1_S": (256, 50), "IQ1_M": (256, 56), "IQ2_XXS": (256, 66), "IQ2_XS": (256, 74), "IQ2_S": (256, 82),
    "IQ3_XXS": (256, 98), "IQ3_S": (256, 110), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
    "TQ1_0": (256, 54), "TQ2_0": (256, 66), "MXFP4": (32, 17),
}
_FLOAT = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True)
class FileType:
    """A llama.cpp file type (``LLAMA_FTYPE_MOSTLY_*``, include/llama.h)."""

    name: str           # as llama-quantize spells it: Q4_K_M
    ftype: int          # the llama_ftype value
    default_type: str   # llama_ftype_get_default_type: the ggml type most tensors get
    needs_imatrix: bool = False  # llama.cpp refuses to make it without an importance matrix


# llama_ftype_get_default_type (src/llama-quant.cpp) and tensor_requires_imatrix.
FILE_TYPES: dict[str, FileType] = {f.name: f for f in (
    FileType("F32", 0, "F32"), FileType("F16", 1, "F16"), FileType("BF16", 32, "BF16"),
    FileType("Q8_0", 7, "Q8_0"),
    FileType("Q6_K", 18, "Q6_K"),
    FileType("Q5_K_M", 17, "Q5_K"), FileType("Q5_K_S", 16, "Q5_K"),
    FileType("Q5_1", 9, "Q5_1"), FileType("Q5_0", 8, "Q5_0"),
    FileType("Q4_K_M", 15, "Q4_K"), FileType("Q4_K_S", 14, "Q4_K"),
    FileType("Q4_1", 3, "Q4_1"), FileType("Q4_0", 2, "Q4_0"),
    FileType("IQ4_NL", 25, "IQ4_NL"), FileType("IQ4_XS", 30, "IQ4_XS"),
    FileType("Q3_K_L", 13, "Q3_K"), FileType("Q3_K_M", 12, "Q3_K"), FileType("Q3_K_S", 11, "Q3_K"),
    FileType("IQ3_M", 27, "IQ3_S"), FileType("IQ3_S", 26, "IQ3_S"), FileType("IQ3_XS", 22, "IQ3_S"),
    FileType("IQ3_XXS", 23, "IQ3_XXS", needs_imatrix=True),
    FileType("Q2_K", 10, "Q2_K"), FileType("Q2_K_S", 21, "Q2_K", needs_imatrix=True),
    FileType("IQ2_M", 29, "IQ2_S", needs_imatrix=True), FileType("IQ2_S", 28, "IQ2_XS", needs_imatrix=True),
    FileType("IQ2_XS", 20, "IQ2_XS", needs_imatrix=True), FileType("IQ2_XXS", 19, "IQ2_XXS", needs_imatrix=True),
    FileType("IQ1_M", 31, "IQ1_M", needs_imatrix=True), FileType("IQ1_S", 24, "IQ1_S", needs_imatrix=True),
)}

# The rows of ``estimate --table`` and the candidates of diagnose's "smaller quantization" lever:
# what people download. Q4_0/Q4_1/Q5_0/Q5_1 and the IQ2_S/IQ3_XS/IQ3_S in-betweens stay available
# by name.
STANDARD: tuple[str, ...] = (
    "F32", "BF16", "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "IQ4_NL", "IQ4_XS",
    "Q3_K_L", "Q3_K_M", "IQ3_M", "Q3_K_S", "IQ3_XXS", "Q2_K", "IQ2_M", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S",
)

# The ggml types each file type family uses as "Q4_K" in rules (names as gguf writes them).
_IQ_LOW = {"IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"}


@dataclass(frozen=True)
class QuantizedSize:
    """What llama.cpp would write for this model in one file type."""

    quantization: str
    n_bytes: int                     # tensor data, every tensor
    n_elements: int
    tensor_types: dict[str, str]     # tensor name -> ggml type
    tensor_bytes: dict[str, int]     # tensor name -> bytes
    approximations: tuple[str, ...] = ()

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.n_bytes / max(1, self.n_elements)

    def to_dict(self) -> dict:
        counts: dict[str, int] = {}
        for t in self.tensor_types.values():
            counts[t] = counts.get(t, 0) + 1
        return {"quantization": self.quantization, "n_bytes": self.n_bytes, "bits_per_weight": round(self.bits_per_weight, 4),
                "tensor_types": counts, "approximations": list(self.approximations)}


def row_bytes(ggml_type: str, n_per_row: int) -> int:
    """``ggml_row_size``: bytes of one row of ``n_per_row`` elements."""
    block, size = TYPE_BLOCKS[ggml_type]
    return size * n_per_row // block


def tensor_bytes(ggml_type: str, shape: Sequence[int]) -> int:
    """``ggml_nbytes`` of a contiguous tensor: rows times the row size."""
    rows = 1
    for d in shape[1:]:
        rows *= d
    return rows * row_bytes(ggml_type, shape[0] if shape else 1)


def file_type(name: str) -> FileType:
    """A file type by name (``q4_k_m``, ``Q4_K_M``); ``TunerError`` naming the known ones otherwise."""
    key = name.strip().upper()
    if key not in FILE_TYPES:
        raise TunerError(f"unknown quantization {name!r}; known: {', '.join(FILE_TYPES)}")
    return FILE_TYPES[key]


# -- llama.cpp's rules -----------------------------------------------------------------------------


def _n_dims(shape: Sequence[int]) -> int:
    """``ggml_n_dims``: trailing dimensions of 1 do not count."""
    n = len(shape)
    while n > 1 and shape[n - 1] == 1:
        n -= 1
    return max(n, 1)


# tensor_allows_quantization: name fragments never quantized (src/llama-quant.cpp, 0.3.36).
_NEVER = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel", "per_layer_model_proj",
    "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight", "indexer.q_proj.weight",
    "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight",
    "time_mix_v1.weight", "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight",
    "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_",
    ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)
# LLM_TN(arch)(LLM_TENSOR_POS_EMBD / LLM_TENSOR_TOKEN_TYPES, "weight")
_NEVER_EXACT = {"position_embd.weight", "token_types.weight"}


def allows_quantization(name: str, shape: Sequence[int]) -> bool:
    """``tensor_allows_quantization`` with the default parameters."""
    if _n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    return name not in _NEVER_EXACT and not any(part in name for part in _NEVER)


def _category(name: str) -> str:
    """``tensor_get_category``: the order of the checks matters (attn_qkv before attn_v...)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for fragment, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
                          ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                          ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if fragment in name:
            return cat
    return "other"


def _loader_order(names: Iterable[str]) -> list[str]:
    """``llama_model_loader::weight_name_comparer``: by layer (non-layer tensors first), then name.
    The per-layer counters of the rules (``i_attention_wv``, ``i_ffn_down``) count in this order."""
    def key(name: str) -> tuple[int, str]:
        m = re.match(r"blk\.(\d+)\.", name)
        return (int(m.group(1)) if m else -1, name)
    return sorted(names, key=key)


@dataclass
class _State:
    """``quantize_state_impl``: counters the rules read and advance."""

    arch: str
    n_layer: int
    n_expert: int
    n_gqa: int
    is_70b: bool
    has_imatrix: bool
    n_attention_wv: int = 0
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0
    has_tied_embeddings: bool = True


def _use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def _layer_of(name: str, counter: int, st: _State) -> int:
    # MoE models number expert tensors by name (they are not consecutive); dense ones count
    if st.n_expert > 1:
        m = re.match(r"blk\.(\d+)\.", name)
        if m:
            return int(m.group(1))
    return counter


def _type_impl(st: _State, new: str, name: str, shape: Sequence[int], ftype: str, cat: str) -> str:
    """``llama_tensor_get_type_impl`` (src/llama-quant.cpp, 0.3.36), rule for rule."""
    falcon = st.arch == "falcon"
    n_expert = st.n_expert
    if cat == "output" or (st.has_tied_embeddings and cat == "token_embd"):
        qk = TYPE_BLOCKS[new][0]
        if falcon or shape[0] % qk != 0:
            new = "Q8_0"
        elif ftype in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
            new = "Q5_K"
        elif new != "Q8_0":
            new = "Q6_K"
    elif cat == "token_embd":
        if ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            new = "Q2_K"
        elif ftype in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            new = "IQ3_S"
    elif ftype in _IQ_LOW:
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            if st.n_gqa >= 4 or n_expert >= 4:
                new = "Q4_K"
            else:
                new = "IQ3_S" if ftype in ("IQ2_S", "IQ2_M") else "Q2_K"
            st.i_attention_wv += 1
        elif n_expert == 8 and cat == "attn_k":
            new = "Q4_K"
        elif cat == "ffn_down":
            if st.i_ffn_down < st.n_layer // 8:
                new = "IQ3_S" if ftype in ("IQ2_S", "IQ2_M") else "Q2_K"
            st.i_ffn_down += 1
        elif cat == "attn_output":
            if n_expert == 8:
                new = "Q5_K"
            elif ftype in ("IQ1_S", "IQ1_M"):
                new = "IQ2_XXS"
            elif ftype in ("IQ2_S", "IQ2_M"):
                new = "IQ3_S"
    elif cat in ("attn_v", "attn_qkv", "attn_kv_b"):
        i, n = st.i_attention_wv, st.n_attention_wv
        if ftype == "Q2_K":
            new = "Q4_K" if st.n_gqa >= 4 else "Q3_K"
        elif ftype == "Q2_K_S" and st.n_gqa >= 4:
            new = "Q4_K"
        elif ftype == "IQ3_XXS":
            new = "Q4_K" if st.n_gqa >= 4 else ("IQ3_S" if not st.has_imatrix else "IQ3_XXS")
        elif ftype in ("IQ3_XS", "IQ3_S") and st.n_gqa >= 4:
            new = "Q4_K"
        elif ftype == "IQ3_M":
            new = "Q4_K"
        elif ftype == "Q3_K_M":
            new = "Q5_K" if i < 2 else "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q5_K"
        elif ftype in ("IQ4_NL", "IQ4_XS") and st.n_gqa >= 4:
            new = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(i, n):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and i < 4:
            new = "Q5_K"
        if st.is_70b and new in ("Q3_K", "Q4_K"):
            # 8 heads share each attn_v in the 70B: more bits cost almost nothing there
            new = "Q5_K"
        if n_expert == 8:
            new = "Q8_0"
        st.i_attention_wv += 1
    elif cat == "attn_k":
        if n_expert == 8:
            new = "Q8_0"
        elif ftype == "IQ3_XS":
            new = "IQ3_XXS"
        elif ftype == "IQ3_XXS":
            new = "IQ2_S"
    elif cat == "attn_q":
        if ftype == "IQ3_XS":
            new = "IQ3_XXS"
        elif ftype == "IQ3_XXS":
            new = "IQ2_S"
    elif cat == "ffn_down":
        i_layer, n_layer = _layer_of(name, st.i_ffn_down, st), st.n_layer
        if ftype == "Q2_K":
            new = "Q3_K"
        elif ftype == "Q2_K_S":
            if i_layer < n_layer // 8:
                new = "Q4_K"
        elif ftype == "IQ3_XXS" and not st.has_imatrix:
            new = "Q4_K" if i_layer < n_layer // 8 else "Q3_K"
        elif ftype == "Q3_K_M":
            new = ("Q5_K" if i_layer < n_layer // 16
                   else "Q4_K" if not falcon or _use_more_bits(i_layer, n_layer) else "Q3_K")
        elif ftype == "IQ3_M" and (i_layer < n_layer // 8 or (n_expert == 8 and _use_more_bits(i_layer, n_layer))):
            new = "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q4_K" if falcon else "Q5_K"
        elif ftype == "Q4_K_M":
            if falcon:
                new = "Q6_K" if i_layer < n_layer // 16 else "Q5_K" if _use_more_bits(i_layer, n_layer) else "Q4_K"
            elif _use_more_bits(i_layer, n_layer):
                new = "Q6_K"
        elif i_layer < n_layer // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not st.has_imatrix:
            new = "Q5_K"
        elif ftype == "Q5_K_M" and _use_more_bits(i_layer, n_layer):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and not falcon and i_layer < n_layer // 8:
            new = "Q5_K"
        elif ftype in ("Q4_0", "Q5_0") and st.has_imatrix and i_layer < n_layer // 8:
            new = "Q4_1" if ftype == "Q4_0" else "Q5_1"
        st.i_ffn_down += 1
    elif cat == "attn_output":
        if not falcon:
            if n_expert == 8:
                if ftype in ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M", "IQ3_S",
                             "IQ3_M", "IQ4_XS"):
                    new = "Q5_K"
            else:
                new = {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K"}.get(ftype, new)
        elif ftype == "Q3_K_L":
            new = "Q4_K"
    elif cat == "attn_qkv":  # unreachable: attn_qkv is handled with attn_v above, as in llama.cpp
        pass
    elif cat == "ffn_gate":
        i_layer = _layer_of(name, st.i_ffn_gate, st)
        if ftype == "IQ3_XS" and st.n_layer // 8 <= i_layer < 7 * st.n_layer // 8:
            new = "IQ3_XXS"
        st.i_ffn_gate += 1
    elif cat == "ffn_up":
        i_layer = _layer_of(name, st.i_ffn_up, st)
        if ftype == "IQ3_XS" and st.n_layer // 8 <= i_layer < 7 * st.n_layer // 8:
            new = "IQ3_XXS"
        st.i_ffn_up += 1
    return new


# tensor_type_fallback: a type whose block does not divide the row falls back to one that does.
_FALLBACK = {
    "IQ1_S": "IQ4_NL", "IQ1_M": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ2_XS": "IQ4_NL", "IQ2_S": "IQ4_NL",
    "IQ3_XXS": "IQ4_NL", "IQ3_S": "IQ4_NL", "IQ4_XS": "IQ4_NL",
    "Q2_K": "Q4_0", "Q3_K": "Q4_0", "TQ1_0": "Q4_0", "TQ2_0": "Q4_0",
    "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
}


def _fallback(shape: Sequence[int], target: str) -> str:
    ncols = shape[0]
    if ncols % TYPE_BLOCKS[target][0] == 0:
        return target
    out = _FALLBACK.get(target, target)
    if ncols % TYPE_BLOCKS[out][0] != 0:
        out = "F16"  # "must use F16 due to unusual shape"
    return out


def tensor_types(info: ModelInfo, quantization: str, *, imatrix: bool = False) -> dict[str, str]:
    """The ggml type llama.cpp's quantizer gives each tensor of ``info`` for ``quantization``.

    Tensors llama.cpp never quantizes (1-d, norms, expert routers...) keep the type they have in
    ``info``'s file.
    """
    ft = file_type(quantization)
    n_head_kv0 = info.n_head_kv_per_layer[0] if info.n_head_kv_per_layer else info.n_head_kv
    st = _State(
        arch=info.architecture, n_layer=info.n_layer, n_expert=info.expert_count,
        n_gqa=info.n_head // n_head_kv0 if n_head_kv0 else 0,
        # llama_quant_model_from_metadata: "only LLM_TYPE_70B matters for quantization logic"
        is_70b=info.architecture == "llama" and info.n_layer == 80 and info.n_head != n_head_kv0,
        has_imatrix=imatrix,
    )
    by_name = {t.name: t for t in info.tensors}
    order = _loader_order(by_name)
    for name in order:
        cat = _category(name)
        if cat in ("attn_v", "attn_qkv", "attn_kv_b"):
            st.n_attention_wv += 1
        if cat == "output":
            st.has_tied_embeddings = False
    out: dict[str, str] = {}
    quantized_default = ft.default_type not in _FLOAT
    for name in order:
        t = by_name[name]
        if not allows_quantization(name, t.shape):
            out[name] = t.type
            continue
        new = ft.default_type
        if quantized_default:
            new = _type_impl(st, new, name, t.shape, ft.name, _category(name))
            new = _fallback(t.shape, new)
        out[name] = new
    return out


def _approximations(info: ModelInfo, ft: FileType, imatrix: bool) -> tuple[str, ...]:
    notes = []
    if ft.needs_imatrix and not imatrix:
        notes.append("llama.cpp makes this quantization only with an importance matrix; the sizes assume none "
                     "(with one, a few tensors may get another type)")
    elif ft.name in ("IQ3_XXS", "IQ4_NL", "IQ4_XS", "Q4_0", "Q5_0"):
        notes.append("with an importance matrix some ffn_down/attn_v tensors get another type; "
                     + ("the sizes assume one" if imatrix else "the sizes assume none"))
    known = {"llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "mistral", "gemma", "gemma2", "gemma3", "phi3", "falcon",
             "mixtral", "command-r", "cohere2", "granite", "olmo", "olmo2", "starcoder2", "stablelm", "internlm2"}
    if info.architecture not in known:
        notes.append(f"architecture {info.architecture!r}: llama.cpp's general rules applied; "
                     "tensors it treats specially for this architecture may differ")
    return tuple(notes)


def quantized_size(info: ModelInfo, quantization: str, *, imatrix: bool = False) -> QuantizedSize:
    """Bytes of tensor data llama.cpp would write for ``info`` quantized to ``quantization``."""
    ft = file_type(quantization)
    types = tensor_types(info, ft.name, imatrix=imatrix)
    sizes = {t.name: (tensor_bytes(types[t.name], t.shape) if types[t.name] != t.type else t.n_bytes) for t in info.tensors}
    return QuantizedSize(
        quantization=ft.name, n_bytes=sum(sizes.values()), n_elements=sum(t.n_elements for t in info.tensors),
        tensor_types=types, tensor_bytes=sizes, approximations=_approximations(info, ft, imatrix),
    )


def size_table(info: ModelInfo, quantizations: Sequence[str] = STANDARD, *, imatrix: bool = False) -> list[QuantizedSize]:
    """``quantized_size`` for each of ``quantizations``, largest first."""
    sizes = [quantized_size(info, q, imatrix=imatrix) for q in quantizations]
    return sorted(sizes, key=lambda s: (-s.n_bytes, s.quantization))


def with_tensors(info: ModelInfo, tensors: Sequence[TensorInfo], quantization: str, file_size: int | None = None) -> ModelInfo:
    """``info`` with other tensor sizes: per-layer and non-repeating bytes recomputed the way
    ``inspect`` computes them, so ``estimate()`` sees a file with these tensors."""
    layers = [dict(attention=0, ffn=0, experts=0, norms=0, other=0) for _ in range(info.n_layer)]
    nonrep = {"token_embd": 0, "output": 0, "output_norm": 0, "other": 0}
    counts: dict[str, int] = {}
    for t in tensors:
        counts[t.type] = counts.get(t.type, 0) + 1
        m = _BLOCK_RE.match(t.name)
        if m and int(m.group(1)) < info.n_layer:
            layers[int(m.group(1))][_role(t.name)] += t.n_bytes
            continue
        base = t.name.rsplit(".", 1)[0]
        nonrep[_NONREPEATING.get(base, "other")] += t.n_bytes
    data_bytes = sum(t.n_bytes for t in tensors)
    old_data = sum(t.n_bytes for t in info.tensors)
    return dataclasses.replace(
        info,
        quantization=quantization,
        file_size=file_size if file_size is not None else info.file_size - old_data + data_bytes,
        layer_bytes=tuple(LayerBytes(**r) for r in layers),
        nonrepeating_bytes=nonrep,
        tensor_types=counts,
        tensors=tuple(tensors),
    )


def requantized(info: ModelInfo, quantization: str, *, imatrix: bool = False) -> ModelInfo:
    """``info`` as the same model quantized to ``quantization`` would read: every tensor with the
    type and size llama.cpp's quantizer would give it. The file size keeps the header's bytes and
    pads each tensor to the 32-byte alignment GGUF uses."""
    size = quantized_size(info, quantization, imatrix=imatrix)
    tensors = [dataclasses.replace(t, type=size.tensor_types[t.name], n_bytes=size.tensor_bytes[t.name]) for t in info.tensors]
    header = max(0, info.file_size - sum(-(-t.n_bytes // 32) * 32 for t in info.tensors))
    file_size = header + sum(-(-b // 32) * 32 for b in size.tensor_bytes.values())
    return with_tensors(info, tensors, size.quantization, file_size=file_size)
