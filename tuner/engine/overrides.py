"""Tensor overrides for llama-cpp-python's high-level ``Llama``, which has no keyword for them.

llama.cpp takes them in ``llama_model_params.tensor_buft_overrides`` (what ``-ot PATTERN=CPU``
sets). ``Llama`` builds its own params and calls ``llama_model_load_from_file`` inside its
constructor, so for the duration of the ``with`` block this wraps that call and fills the field in:

    with tensor_overrides_applied([r"blk\\.[0-3]\\.ffn_.*"]):
        llm = llama_cpp.Llama(model_path, n_gpu_layers=99)

The override array stays referenced for the life of the process: llama.cpp reads it while loading
and the wrapper cannot know when a model is freed.

llama.cpp never sees a pattern as written. It matches overrides with std::regex_search, which
backtracks: a pattern from a shared profile such as ``".?" * 30 + ".{30}!"`` would keep the load
from ever returning. So ``resolved_patterns`` matches each pattern here against the model's own
tensor names with RE2 (linear time, ``tuner.limits.tensor_regex``) and gives llama.cpp the names it
matched, as anchored alternations of escaped literals built here: matching those costs std::regex
time linear in the pattern, whatever the profile said.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator, Sequence

_KEEP: list[Any] = []
_LOCK = threading.Lock()


@contextlib.contextmanager
def tensor_overrides_applied(patterns: Sequence[str]) -> Iterator[None]:
    from llama_cpp import _internals

    from .ggml import OverrideArray

    module = _internals.llama_cpp  # the module _internals calls llama_model_load_from_file through
    original = module.llama_model_load_from_file

    def load_with_overrides(path: bytes, params: Any) -> Any:
        overrides = OverrideArray(tuple(patterns), os.fsdecode(path))
        _KEEP.append(overrides)
        params.tensor_buft_overrides = overrides.address
        return original(path, params)

    with _LOCK:
        module.llama_model_load_from_file = load_with_overrides
        try:
            yield
        finally:
            module.llama_model_load_from_file = original


# Names per built pattern: llama.cpp tries every override on every tensor, and libstdc++'s
# std::regex recurses once per alternative, so a few short alternations beat one long one.
_NAMES_PER_PATTERN = 32


def _literal(name: str) -> str:
    """``name`` as an ECMAScript (std::regex) literal: word characters as they are, "." as "[.]",
    anything else by its code (``\\xHH`` / ``\\uHHHH``)."""
    out = []
    for ch in name:
        if ch.isascii() and (ch.isalnum() or ch == "_"):
            out.append(ch)
        elif ch == ".":
            out.append("[.]")
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            raise ValueError(f"the tensor name {name[:80]!r} holds a character std::regex cannot spell")
    return "".join(out)


def tensor_names(model_path: str | os.PathLike[str]) -> list[str]:
    """Every tensor name of a GGUF model (all parts of a split model), from its header."""
    from ..model.gguf import header_info, split_parts

    return [t[0] for part in split_parts(model_path) for t in header_info(part)["tensors"]]


def resolved_patterns(patterns: Sequence[str], names: Sequence[str]) -> tuple[str, ...]:
    """The overrides as llama.cpp gets them: the tensor ``names`` any of ``patterns`` matches
    (``re.search`` semantics, as std::regex_search, matched by RE2), as ``^(a|b|...)$`` patterns of
    escaped literals, at most ``_NAMES_PER_PATTERN`` names each, in the model's order."""
    from ..limits import tensor_regex

    compiled = [tensor_regex(p) for p in patterns]
    chosen = [n for n in dict.fromkeys(names) if any(rx.search(n) for rx in compiled)]
    return tuple("^(" + "|".join(_literal(n) for n in chosen[i:i + _NAMES_PER_PATTERN]) + ")$"
                 for i in range(0, len(chosen), _NAMES_PER_PATTERN))
