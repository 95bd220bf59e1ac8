"""llama.cpp's special values, one helper each, for every stage that reads a setting.

- "every layer": ``n_gpu_layers`` of ``ALL_LAYERS`` (-1, any negative in ``llama_model_params``) puts
  the ``n_layer`` repeating layers and the output layer on the accelerators (src/llama-model.cpp
  ``n_gpu_layers()``); ``offloaded_layers`` resolves it, ``gpu_layers_arg`` spells it per tool;
- "the model's training context": ``n_ctx`` of ``TRAINING_CONTEXT`` (0); ``context_tokens`` resolves it;
- flash attention's forms (``auto``/``on``/``off``, the C API enum, llama-bench's 0/1, the bool
  ``llama_cpp.Llama`` takes): ``flash_attn_forms``.

The lowest stage that needs them is the memory arithmetic, so they live here; ``tuner.engine.dimensions``
re-exports them for everything above.
"""

from __future__ import annotations

from typing import Any, NamedTuple

ALL_LAYERS = -1
TRAINING_CONTEXT = 0
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type (include/llama.h)


def offloaded_layers(n_gpu_layers: int, n_layer: int) -> int:
    """The layers llama.cpp puts on the accelerators, 0..n_layer+1 (the output layer counts as one).

    ``ALL_LAYERS`` (or any negative) is ``n_layer + 1``; a count above that is capped, as llama.cpp
    caps it (``act_gpu_layers = min(n_gpu_layers, n_layer + 1)``)."""
    return n_layer + 1 if n_gpu_layers < 0 else min(n_gpu_layers, n_layer + 1)


def offloaded_repeating_layers(n_gpu_layers: int, n_layer: int) -> int:
    """Repeating layers (``blk.N``) on the accelerators: offload starts from the output layer."""
    return max(0, offloaded_layers(n_gpu_layers, n_layer) - 1)


def first_offloaded_layer(n_gpu_layers: int, n_layer: int) -> int:
    """``i_gpu_start = max(n_layer + 1 - ngl, 0)`` (src/llama-model.cpp ``load_tensors``)."""
    return n_layer + 1 - offloaded_layers(n_gpu_layers, n_layer)


def gpu_layers_arg(tool: str, n_gpu_layers: int, layers_total: int | None = None) -> str:
    """``-ngl``'s value for ``tool``. A count is itself. "Every layer" is the profile's
    ``layers_total`` when known; otherwise ``all`` for llama-server/llama-cli, whose common
    arguments read ``-1`` as "auto" (fit to free memory; common/arg.cpp, 2026), and ``-1`` for
    llama-bench, which passes the number to llama_model_params, where negative is every layer."""
    if n_gpu_layers >= 0:
        return str(n_gpu_layers)
    if layers_total:
        return str(layers_total)
    return "-1" if tool == "llama-bench" else "all"


def context_tokens(n_ctx: int, n_ctx_train: int) -> int:
    """The context llama.cpp creates before padding: ``TRAINING_CONTEXT`` (0) is the model's own."""
    return n_ctx_train if n_ctx <= TRAINING_CONTEXT else n_ctx


class FlashAttnForms(NamedTuple):
    """One flash-attention setting in each form a llama.cpp interface takes."""

    name: str  # auto | on | off: Settings, llama-server/llama-cli -fa, LLAMA_ARG_FLASH_ATTN
    c_api: int  # llama_context_params.flash_attn_type: LLAMA_FLASH_ATTN_TYPE_AUTO -1, DISABLED 0, ENABLED 1
    bench: str | None  # llama-bench -fa 0/1 (no "auto": left out, llama-bench's default applies)
    high_level: bool  # llama_cpp.Llama(flash_attn=...): on or off only; "auto" is off there
    enabled: bool  # whether llama.cpp runs flash attention where the backend has it (auto: yes)


def flash_attn_forms(value: Any) -> FlashAttnForms:
    """Every form of one flash-attention setting; takes any of them (``"auto"``, ``True``, ``-1``...)."""
    if isinstance(value, bool):
        name = "on" if value else "off"
    elif isinstance(value, int):
        name = {v: k for k, v in FLASH_ATTN.items()}.get(value, "")
    else:
        name = str(value)
    if name not in FLASH_ATTN:
        raise ValueError(f"expected one of {', '.join(FLASH_ATTN)}, got {value!r}")
    return FlashAttnForms(
        name=name,
        c_api=FLASH_ATTN[name],
        bench=None if name == "auto" else ("1" if name == "on" else "0"),
        high_level=name == "on",
        enabled=name != "off",
    )


__all__ = [
    "ALL_LAYERS", "TRAINING_CONTEXT", "FLASH_ATTN", "offloaded_layers", "offloaded_repeating_layers",
    "first_offloaded_layer", "gpu_layers_arg", "context_tokens", "FlashAttnForms", "flash_attn_forms",
]
