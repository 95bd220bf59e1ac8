"""Which weights llama.cpp copies into an extra CPU buffer (``AMX``, ``CPU_REPACK``) on this CPU, and how big.

With weight repacking on (``llama_model_params.use_extra_bufts``, llama.cpp's default), a weight held by
the CPU goes to the first buffer type in llama.cpp's CPU list that takes it (src/llama-model.cpp
``make_cpu_buft_list``: an accelerator's pinned host buffer, then the CPU backend's extra buffer types,
then the plain CPU buffer). The extra types are, in ggml-cpu.cpp's order
(``ggml_backend_cpu_get_extra_buffer_types``):

- ``AMX`` (ggml-cpu/amx/amx.cpp), built where the compiler targets AMX_INT8 and AVX512_VNNI: a 2-D
  matrix used in ``MUL_MAT`` whose output rows are a multiple of 32 (``op->ne[0] % (TILE_N * 2)``) and
  whose rows are a multiple of 32 (Q4_0, Q4_1, Q8_0), 256 (Q4_K, Q5_K, Q6_K, IQ4_XS) or 16 (F16)
  elements. Its size is ``ggml_backend_amx_get_alloc_size`` (amx/mmq.cpp): per row of K elements,
  the blocks plus an int32 per block for the types that carry a compensation (Q8_0), 4 more bytes a
  block for Q4_K and Q5_K and 2 for IQ4_XS;
- ``CPU_REPACK`` (ggml-cpu/repack.cpp ``ggml_repack_get_optimal_repack_type``): by type and CPU
  features, a 2-D ``MUL_MAT`` matrix or a 3-D ``MUL_MAT_ID`` expert stack whose ``ne[1]`` is a multiple
  of 8 (x86, and ARM for the K-quants) or 4 (ARM): Q4_0 (AVX2; ARM NEON with i8mm or dotprod; SVE 256),
  Q4_K (AVX2; NEON i8mm/dotprod), Q2_K (AVX512), Q5_K, Q6_K and Q8_0 (NEON i8mm/dotprod), IQ4_NL and
  MXFP4 (AVX2; NEON dotprod). It keeps ``ggml_nbytes`` (no ``get_alloc_size``).

The CPU features are llama.cpp's own (``llama_print_system_info``: ``CPU : SSE3 = 1 | ... | AVX2 = 1 |
... | AMX_INT8 = 1 | ... | REPACK = 1 |``), never guessed from the model or the OS: they are what the
build was compiled for, which is what these checks read. RISC-V's vector repacks and KleidiAI are not
modelled (their buffers are counted as plain CPU weights).

An accelerator with a pinned host buffer type (CUDA and ROCm/MUSA through ggml-cuda, Vulkan, SYCL,
OpenVINO, Hexagon) is before the extra types in that list, so with such a device llama.cpp puts the CPU's
weights there (``CUDA_Host``; the mapped file with mmap) and repacks nothing: ``takes_host_weights``.

Pure: no llama_cpp import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

AMX = "AMX"
CPU_REPACK = "CPU_REPACK"
EXTRA_BUFFERS = (AMX, CPU_REPACK)

# ggml backends whose device has a host buffer type (get_host_buffer_type, ggml/src, 2026), by the
# prefix of llama.cpp's device names
_HOST_BUFFER_PREFIXES = ("CUDA", "ROCm", "HIP", "MUSA", "Vulkan", "SYCL", "OPENVINO", "HTP", "ET")

# amx.cpp supports_op: the row length (ne[0]) each type's blocks need
_AMX_ROW_MULTIPLE = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "IQ4_XS": 256, "F16": 16}
# ggml block sizes and bytes (ggml.c type_traits) of the types AMX packs
_BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176),
           "Q6_K": (256, 210), "IQ4_XS": (256, 136)}
# amx/mmq.cpp get_row_size: extra bytes per block (do_compensate: an int32 per block for Q8_0;
# the K-quants' unpacked scales; IQ4_XS's)
_AMX_EXTRA_PER_BLOCK = {"Q8_0": 4, "Q4_K": 4, "Q5_K": 4, "IQ4_XS": 2}

# "AVX2 = 1" / "SVE_CNT = 32" in llama_print_system_info's "CPU : ... |" section
_FEATURE_RE = re.compile(r"([A-Z][A-Z0-9_]*) = (\d+)")


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU backend's features as llama.cpp reports them (names with a non-zero value)."""

    flags: frozenset[str]
    sve_cnt: int = 0
    source: str = ""  # what they were read from, for messages

    @classmethod
    def parse(cls, system_info: str | None, source: str = "llama_print_system_info") -> "CpuFeatures | None":
        """From ``llama_print_system_info``'s text (or a log's ``system_info:`` line); None when it has
        no CPU section (nothing is assumed then)."""
        if not system_info:
            return None
        text = str(system_info)[:8192]
        at = text.find("CPU :")
        if at < 0:
            return None
        section = text[at + 5:]
        end = re.search(r"\|\s*[A-Za-z][\w ]* : ", section)  # the next backend's section
        if end:
            section = section[: end.start()]
        values = {name: int(value) for name, value in _FEATURE_RE.findall(section)}
        flags = frozenset(name for name, value in values.items() if value)
        return cls(flags=flags, sve_cnt=values.get("SVE_CNT", 0), source=source)

    @classmethod
    def of(cls, names: Iterable[str]) -> "CpuFeatures":
        return cls(frozenset(names))

    def has(self, *names: str) -> bool:
        return all(n in self.flags for n in names)

    @property
    def amx(self) -> bool:
        """llama.cpp's AMX buffer type exists (ggml-cpu.cpp: built for AMX_INT8 and AVX512_VNNI)."""
        return self.has("AMX_INT8", "AVX512_VNNI")

    @property
    def repack(self) -> bool:
        """llama.cpp's CPU_REPACK buffer type exists (built with GGML_USE_CPU_REPACK)."""
        return self.has("REPACK")

    def repacked_types(self) -> tuple[str, ...]:
        """The weight types some buffer here repacks (for messages and the search's question)."""
        out: list[str] = []
        if self.amx:
            out += list(_AMX_ROW_MULTIPLE)
        if self.repack:
            out += [t for t, rule in _REPACK_RULES.items() if rule(self) is not None]
        return tuple(dict.fromkeys(out))

    def describe(self) -> str:
        shown = [f for f in ("AVX2", "AVX512", "AVX512_VNNI", "AMX_INT8", "NEON", "DOTPROD", "MATMUL_INT8", "SVE", "REPACK")
                 if f in self.flags]
        return ", ".join(shown) or "none of the features repacking reads"


def _neon(f: CpuFeatures, what: str) -> bool:
    return f.has("NEON", what)


# repack.cpp ggml_repack_get_optimal_repack_type: per type, the row multiple ne[1] needs on this CPU
# (the first branch that applies), or None when no branch does
_REPACK_RULES: dict[str, Any] = {
    "Q4_0": lambda f: 8 if (f.has("AVX2") or (f.has("SVE", "MATMUL_INT8") and f.sve_cnt == 32))
    else 4 if (_neon(f, "MATMUL_INT8") or _neon(f, "DOTPROD") or f.has("VXE")) else None,
    "Q4_K": lambda f: 8 if (f.has("AVX2") or _neon(f, "MATMUL_INT8") or _neon(f, "DOTPROD")) else None,
    "Q2_K": lambda f: 8 if f.has("AVX512") else None,
    "Q5_K": lambda f: 8 if (_neon(f, "MATMUL_INT8") or _neon(f, "DOTPROD")) else None,
    "Q6_K": lambda f: 8 if (_neon(f, "MATMUL_INT8") or _neon(f, "DOTPROD")) else None,
    "IQ4_NL": lambda f: 8 if f.has("AVX2") else 4 if _neon(f, "DOTPROD") else None,
    "MXFP4": lambda f: 8 if f.has("AVX2") else 4 if _neon(f, "DOTPROD") else None,
    "Q8_0": lambda f: 4 if (_neon(f, "MATMUL_INT8") or _neon(f, "DOTPROD")) else None,
    "Q1_0": lambda f: 4 if (_neon(f, "MATMUL_INT8") or _neon(f, "DOTPROD")) else None,
}

_BLOCK_RE = re.compile(r"^blk\.\d+\.")
# 2-D weights of a layer that feed no matrix multiplication (llama-arch.cpp LLM_TENSOR_INFOS):
# convolutions and state-space parameters, per-layer embeddings looked up by row
_NOT_MATMUL_RE = re.compile(r"(ssm_conv1d|ssm_a|ssm_d|per_layer_token_embd|_embd\.|conv1d|time_mix_|channel_mix_lerp)")


def matmul_op(name: str, shape: Sequence[int]) -> str | None:
    """The op llama.cpp checks a weight's buffer type with: ``mul_mat`` (a layer's or the output's
    2-D matrix), ``mul_mat_id`` (a 3-D expert stack), or None (embeddings, norms, the rest)."""
    dims = len(shape)
    while dims > 1 and shape[dims - 1] == 1:  # ggml_n_dims: trailing dimensions of 1 do not count
        dims -= 1
    if not name.endswith(".weight"):
        return None
    if name == "output.weight":
        return "mul_mat" if dims == 2 else None
    if not _BLOCK_RE.match(name) or _NOT_MATMUL_RE.search(name):
        return None
    if dims == 2:
        return "mul_mat"
    if dims == 3 and ("_exps." in name or "_chexps." in name):
        return "mul_mat_id"
    return None


def extra_buffer(name: str, ggml_type: str, shape: Sequence[int], features: CpuFeatures | None) -> str | None:
    """The extra buffer llama.cpp puts this weight in when the CPU holds it and repacking is on."""
    if features is None:
        return None
    op = matmul_op(name, shape)
    if op is None:
        return None
    ne = list(shape) + [1] * (4 - len(shape))
    if features.amx and op == "mul_mat" and ggml_type in _AMX_ROW_MULTIPLE:
        if ne[1] % 32 == 0 and ne[0] % _AMX_ROW_MULTIPLE[ggml_type] == 0:
            return AMX
    if features.repack:
        rule = _REPACK_RULES.get(ggml_type)
        multiple = rule(features) if rule is not None else None
        if multiple and ne[1] % multiple == 0:
            return CPU_REPACK
    return None


def extra_size(buffer: str, ggml_type: str, shape: Sequence[int], n_bytes: int) -> int:
    """Bytes the weight takes in that buffer (before the buffer's 32-byte alignment)."""
    if buffer == AMX and ggml_type in _BLOCKS:
        block, size = _BLOCKS[ggml_type]
        k, n = shape[0], shape[1]
        per_row = (k // block) * (size + _AMX_EXTRA_PER_BLOCK.get(ggml_type, 0))
        return n * per_row
    return n_bytes


def repack_risk(features: CpuFeatures | None) -> str:
    """What weight repacking means on this CPU, in a sentence (``probe`` prints it)."""
    if features is None:
        return "unknown: llama.cpp did not report the CPU's features"
    parts = []
    if features.amx:
        types = ", ".join(_AMX_ROW_MULTIPLE)
        parts.append(f"weights held by the CPU of types {types} are repacked into an AMX buffer: a second copy in RAM, "
                     "and a known llama.cpp crash at the first decode on some AMX machines (ggml-org/llama.cpp#20824); "
                     "`tune` detects it and turns repacking off (--no-repack)")
    others = [t for t, rule in _REPACK_RULES.items() if features.repack and rule(features) is not None]
    if others:
        parts.append(f"{', '.join(others)} weights held by the CPU are repacked into a CPU_REPACK buffer: a second copy "
                     "in RAM, which `estimate` counts")
    return "; ".join(parts) if parts else "none: this llama.cpp build repacks no weights on this CPU"


def takes_host_weights(devices: Iterable[str]) -> bool:
    """Whether one of these accelerators has a pinned host buffer that takes the CPU's weights first."""
    return any(str(d).startswith(_HOST_BUFFER_PREFIXES) for d in devices)


def repackable(tensors: Iterable[Any], features: CpuFeatures | None) -> dict[str, int]:
    """Per extra buffer, the bytes this model's weights would take there if the CPU held all of them."""
    out: dict[str, int] = {}
    for t in tensors:
        buffer = extra_buffer(t.name, t.type, t.shape, features)
        if buffer:
            out[buffer] = out.get(buffer, 0) + extra_size(buffer, t.type, t.shape, t.n_bytes)
    return out


__all__ = ["AMX", "CPU_REPACK", "EXTRA_BUFFERS", "CpuFeatures", "extra_buffer", "extra_size", "matmul_op",
           "repack_risk", "repackable", "takes_host_weights"]
