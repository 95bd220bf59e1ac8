"""What a llama.cpp log says about the model and the context, beyond the buffers: ``log_facts(text)``.

``parse_log`` (``engine/logparse.py``) reads what happened at load: layers, buffers per device, KV,
out-of-memory lines. Diagnosing a load needs a few more facts the same log states, read here:

- the model's shape and file type from the metadata dump (``print_info`` 2025-2026,
  ``llm_load_print_meta`` 2023-2024): ``n_layer``, ``n_embd``, ``n_head``, ``n_head_kv``, ``n_ff``,
  ``n_expert``, ``n_vocab``, ``file type``/``model ftype``, ``file size``/``model size``, ``model params``;
- the context's parameters (``llama_context``/``llama_new_context_with_model``): ``flash_attn``,
  ``n_ubatch``, ``n_batch``;
- the accelerators and their model names (``using device CUDA0 (NVIDIA GeForce RTX 4090)``,
  ``Device 0: NVIDIA GeForce RTX 3090, compute capability 8.6``, ``ggml_vulkan: 0 = ...``);
- which device ran out of memory, for what (weights, KV cache, compute buffers) and how much it
  asked for;
- the tensors a ``--override-tensor`` kept on the CPU (``Tensor X buffer type overriden to CPU``).

The lines are read through ``logparse``'s own reader, so every carrier prefix it strips is stripped
here too. Garbage gives empty facts; nothing here raises.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .logparse import MiB, _logical_lines

# llama_ftype_name (src/llama-model-loader.cpp) -> llama-quantize's name. 2024 builds printed
# "IQ2_XSS" for IQ2_XXS; "(guessed) " prefixes a type inferred from the tensors.
LOG_FTYPE_NAMES = {
    "all F32": "F32", "F16": "F16", "BF16": "BF16", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "Q8_0": "Q8_0", "Q2_K - Medium": "Q2_K", "Q2_K - Small": "Q2_K_S", "Q3_K - Small": "Q3_K_S",
    "Q3_K - Medium": "Q3_K_M", "Q3_K - Large": "Q3_K_L", "Q4_K - Small": "Q4_K_S", "Q4_K - Medium": "Q4_K_M",
    "Q5_K - Small": "Q5_K_S", "Q5_K - Medium": "Q5_K_M", "Q6_K": "Q6_K", "IQ2_XXS - 2.0625 bpw": "IQ2_XXS",
    "IQ2_XSS - 2.0625 bpw": "IQ2_XXS", "IQ2_XS - 2.3125 bpw": "IQ2_XS", "IQ2_S - 2.5 bpw": "IQ2_S",
    "IQ2_M - 2.7 bpw": "IQ2_M", "IQ3_XS - 3.3 bpw": "IQ3_XS", "IQ3_XXS - 3.0625 bpw": "IQ3_XXS",
    "IQ1_S - 1.5625 bpw": "IQ1_S", "IQ1_M - 1.75 bpw": "IQ1_M", "IQ4_NL - 4.5 bpw": "IQ4_NL",
    "IQ4_XS - 4.25 bpw": "IQ4_XS", "IQ3_S - 3.4375 bpw": "IQ3_S", "IQ3_S mix - 3.66 bpw": "IQ3_M",
}

# "%s: %-20s = %s"-style metadata lines: "print_info: n_layer = 32" (2025-2026),
# "llm_load_print_meta: n_layer = 32" (2023-2024). Keys are what llama.cpp prints.
_RX_META = re.compile(r"^(?:print_info|llm_load_print_meta):\s*([A-Za-z_][\w .]*?)\s*=\s*(.*?)\s*$")
_INT_KEYS = {"n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_expert", "n_expert_used", "n_vocab", "n_ctx_train",
             "n_embd_head_k", "n_embd_head_v", "n_swa", "n_layer_all", "n_ff_exp", "n_expert_shared"}
# "%s: file size   = %.2f GiB (%.2f BPW) " (2025-2026) / "%s: model size = %.2f GiB (%.2f BPW) " (2023-2024)
_RX_SIZE = re.compile(r"^(\d+(?:[.,]\d+)?)\s*([KMGT]i?B)\b(?:\s*\(\s*(\d+(?:[.,]\d+)?)\s*BPW\s*\))?", re.IGNORECASE)
# "%s: model params = %.2f B" (also T, M, K)
_RX_PARAMS = re.compile(r"^(\d+(?:[.,]\d+)?)\s*([TBMK])\b")
_SCALE = {"T": 1e12, "B": 1e9, "M": 1e6, "K": 1e3}
_UNIT = {"KB": 1024, "KIB": 1024, "MB": MiB, "MIB": MiB, "GB": 1024 * MiB, "GIB": 1024 * MiB, "TB": MiB * MiB, "TIB": MiB * MiB}

# "%s: flash_attn = %d" (2023-2025), "%s: flash_attn = %s" ("enabled"/"disabled"/"auto", 2025-2026);
# "%s: n_ubatch = %u", "%s: n_batch = %u"  llama_context / llama_new_context_with_model
_RX_CTX_PARAM = re.compile(r"^(?:llama_context|llama_new_context_with_model|llama_init_from_model):\s*"
                           r"(flash_attn|n_ubatch|n_batch)\s*=\s*(\S+)")
# "%s: Flash Attention was auto, set to %s" (sched_reserve / llama_context, 2025-2026)
_RX_FA_AUTO = re.compile(r"Flash Attention was auto, set to (enabled|disabled)")

# "%s: using device %s (%s) - %zu MiB free"  (late 2024-2025); "(%s) (%s) - ..." (2026, + device id)
_RX_USING = re.compile(r"\busing device\s+(\S+)\s+\((.*?)\)(?:\s+\(.*?\))?\s*-\s*\d+\s*MiB free")
# ggml_cuda_init (2024-2026) / ggml_init_cublas (2023): "  Device %d: %s, compute capability %d.%d, VMM: %s"
_RX_CUDA_DEV = re.compile(r"^Device\s+(\d+):\s*(.+?),\s*compute capability\b")
# "ggml_vulkan: %d = %s (%s) | uma: %d | ..." (2024-2026)
_RX_VULKAN_DEV = re.compile(r"^ggml_vulkan:\s*(\d+)\s*=\s*(.+?)\s*(?:\(|\|)")
# "ggml_metal_init: found device: %s" / "ggml_metal_device_init: GPU name: %s" (2024-2026)
_RX_METAL_DEV = re.compile(r"^ggml_metal_\w*:\s*(?:found device|GPU name):\s*(.+?)\s*$")
# "ggml_cuda_init: found %d ROCm devices:" / "found %d CUDA devices:" (which backend numbers "Device N")
_RX_FOUND = re.compile(r"^ggml_(?:cuda_init|init_cublas):\s*found\s+\d+\s+(CUDA|ROCm|MUSA)\s+devices")

# Out of memory, by device:
# "%s: failed to allocate %s buffer of size %zu"  alloc_tensor_range (weights) / ggml_gallocr_reserve_n
#   (compute), 2024-2026: the buffer type is named after the device ("CUDA0", "RPC0[host:port]")
_RX_FAILED_BUF = re.compile(r"^(\w+):\s*failed to allocate\s+(\S+?)\s+buffer of size\s+(\d+)")
# "llama_model_load: error loading model: unable to allocate %s buffer" (2024-2026, weights)
_RX_UNABLE = re.compile(r"unable to allocate\s+(\S+?)\s+buffer")
# "%s: allocating %.2f MiB on device %d: cudaMalloc failed: %s"  ggml-cuda (2024-2026)
_RX_CUDA_MALLOC = re.compile(r"allocating\s+(\d+(?:[.,]\d+)?)\s*MiB on device\s+(\d+):\s*(?:cuda|hip|musa)Malloc failed")
# "%s: failed to allocate buffer for kv cache" / "failed to initialize the context: failed to allocate
# buffer for kv cache" (2024-2026); "failed to allocate compute buffers" / "failed to allocate compute
# pp buffers" (2024-2026)
_RX_KV_FAIL = re.compile(r"failed to allocate buffer for kv cache|kv cache.*failed to allocate", re.IGNORECASE)
_RX_COMPUTE_FAIL = re.compile(r"failed to allocate compute(?: pp| tg)? buffers|ggml_gallocr_reserve_n|sched_reserve.*failed",
                              re.IGNORECASE)
# "Tensor %s buffer type overriden to %s" / "tensor %s (%zu MiB %s) buffer type overridden to %s"
_RX_OVERRIDE = re.compile(r"^[Tt]ensor\s+(\S+)\s+(?:\((\d+)\s*MiB[^)]*\)\s+)?buffer type overrid+en to\s+(\S+)")

_MAX_OVERRIDES = 100_000
# Beyond any model llama.cpp loads (LLAMA_MAX_LAYERS is 512; the widest models are ~20k wide).
_SHAPE_BOUNDS = {"n_layer": 512, "n_embd": 1 << 17, "n_head": 1 << 12, "n_head_kv": 1 << 12, "n_ff": 1 << 19,
                 "n_vocab": 1 << 22, "n_expert": 1 << 12, "n_ff_exp": 1 << 19, "n_expert_shared": 64,
                 "n_embd_head_k": 1 << 12}


@dataclass
class LogFacts:
    """Facts a log states besides its buffers. ``None`` / empty where the log does not say."""

    meta: dict[str, Any] = field(default_factory=dict)   # print_info key -> int or text
    quantization: str | None = None      # llama-quantize's name (Q4_K_M), from the file type line
    file_size: int | None = None         # bytes, from "file size" / "model size"
    bits_per_weight: float | None = None
    n_params: int | None = None
    flash_attn: bool | None = None
    n_ubatch: int | None = None
    n_batch: int | None = None
    device_names: dict[str, str] = field(default_factory=dict)   # CUDA0 -> NVIDIA GeForce RTX 4090
    oom_device: str | None = None        # as the log names it: CUDA0, RPC0[127.0.0.1:50052]
    oom_what: str | None = None          # "weights", "kv", "compute"
    oom_request: int | None = None       # bytes the failed allocation asked for
    overridden_to_cpu: tuple[str, ...] = ()

    def shape(self) -> dict[str, int] | None:
        """The shape a llama-family rebuild needs, when the log states all of it within the bounds
        of real models (a log is someone else's text: a shape of 10^12 layers is not rebuilt)."""
        keys = ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab")
        values = {k: self.meta.get(k) for k in keys}
        if not all(isinstance(v, int) and 0 < v <= _SHAPE_BOUNDS[k] for k, v in values.items()):
            return None
        if any(isinstance(self.meta.get(k), int) and self.meta[k] > _SHAPE_BOUNDS[k]
               for k in ("n_expert", "n_ff_exp", "n_expert_shared", "n_embd_head_k")):
            return None
        out: dict[str, int] = dict(values)  # type: ignore[arg-type]
        for k in ("n_expert", "n_expert_used", "n_embd_head_k", "n_ctx_train", "n_ff_exp", "n_expert_shared"):
            if isinstance(self.meta.get(k), int):
                out[k] = self.meta[k]
        return out


def _first_int(text: str) -> int | None:
    # per-layer arrays print as "[32, 32, 8, ...]" or "32, 8"; the largest is what sizes the model
    numbers = [int(x) for x in re.findall(r"\d{1,12}", text)]
    if not numbers or not re.match(r"^[\[\d]", text.strip()):
        return None
    return max(numbers)


def _num(text: str) -> float:
    return float(text.replace(",", "."))


def log_facts(text: str | bytes | None) -> LogFacts:
    """Read the facts of a llama.cpp log (the last value of each wins, as the last load pass does)."""
    facts = LogFacts()
    if text is None:
        return facts
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    cuda_family = "CUDA"
    overrides: list[str] = []
    numbered: dict[int, str] = {}
    try:
        for ln in _logical_lines(text):
            if ln.structured:
                continue
            t = ln.text
            try:
                m = _RX_META.match(t)
                if m:
                    key, value = m.group(1).strip(), m.group(2)
                    _meta(facts, key, value)
                    continue
                m = _RX_CTX_PARAM.match(t)
                if m:
                    key, value = m.group(1), m.group(2)
                    if key == "flash_attn":
                        facts.flash_attn = {"1": True, "0": False, "enabled": True, "disabled": False,
                                            "true": True, "false": False}.get(value.lower(), facts.flash_attn)
                    elif value.isdigit():
                        setattr(facts, key, int(value))
                    continue
                m = _RX_FA_AUTO.search(t)
                if m:
                    facts.flash_attn = m.group(1) == "enabled"
                    continue
                m = _RX_FOUND.match(t)
                if m:
                    cuda_family = m.group(1)
                    continue
                m = _RX_USING.search(t)
                if m:
                    facts.device_names[m.group(1)] = m.group(2).strip()[:100]
                    continue
                m = _RX_CUDA_DEV.match(t)
                if m:
                    numbered[int(m.group(1))] = m.group(2).strip()[:100]
                    continue
                m = _RX_VULKAN_DEV.match(t)
                if m:
                    facts.device_names.setdefault(f"Vulkan{m.group(1)}", m.group(2).strip()[:100])
                    continue
                m = _RX_METAL_DEV.match(t)
                if m:
                    facts.device_names.setdefault("Metal", m.group(1)[:100])
                    continue
                m = _RX_OVERRIDE.match(t)
                if m:
                    if m.group(3).upper().startswith("CPU") and len(overrides) < _MAX_OVERRIDES:
                        overrides.append(m.group(1))
                    continue
                _oom(facts, t, cuda_family)
            except (ValueError, OverflowError, IndexError):
                continue  # one odd line must not cost the rest of the log
    except Exception:  # noqa: BLE001 - like parse_log, reading a log never raises
        return facts
    for index, name in numbered.items():
        facts.device_names.setdefault(f"{cuda_family}{index}", name)
    facts.overridden_to_cpu = tuple(dict.fromkeys(overrides))
    return facts


def _meta(facts: LogFacts, key: str, value: str) -> None:
    if len(facts.meta) > 200 and key not in facts.meta:
        return  # a metadata dump has a few dozen keys; more is not llama.cpp's
    if key in _INT_KEYS:
        number = _first_int(value)
        if number is not None:
            facts.meta[key] = number
        return
    if key in ("file type", "model ftype"):
        name = re.sub(r"^\(guessed\)\s*", "", value).strip()
        facts.meta[key] = name[:60]
        facts.quantization = LOG_FTYPE_NAMES.get(name, facts.quantization)
        return
    if key in ("file size", "model size"):
        m = _RX_SIZE.match(value)
        if m:
            facts.file_size = int(_num(m.group(1)) * _UNIT[m.group(2).upper()])
            if m.group(3):
                facts.bits_per_weight = _num(m.group(3))
        return
    if key == "model params":
        m = _RX_PARAMS.match(value)
        if m:
            facts.n_params = int(_num(m.group(1)) * _SCALE[m.group(2)])
        return
    if key in ("arch", "model type", "general.name"):
        facts.meta[key] = value[:100]


def _oom(facts: LogFacts, t: str, cuda_family: str) -> None:
    m = _RX_FAILED_BUF.match(t)
    if m:
        func, device, size = m.group(1), m.group(2), int(m.group(3))
        facts.oom_device = device
        facts.oom_request = size
        facts.oom_what = "compute" if "gallocr" in func or "sched" in func else "weights" if func == "alloc_tensor_range" else facts.oom_what
        return
    m = _RX_CUDA_MALLOC.search(t)
    if m:
        facts.oom_device = f"{cuda_family}{m.group(2)}"
        facts.oom_request = int(_num(m.group(1)) * MiB)
        return
    m = _RX_UNABLE.search(t)
    if m:
        facts.oom_device = m.group(1)
        facts.oom_what = "weights"
        return
    if _RX_KV_FAIL.search(t):
        facts.oom_what = "kv"
        return
    if _RX_COMPUTE_FAIL.search(t) and ("fail" in t.lower()):
        facts.oom_what = "compute"
