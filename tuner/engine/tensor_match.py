"""Tensor overrides as llama.cpp gets them: the model's tensor names a profile's patterns match
(RE2, linear time: ``tuner.limits.tensor_regex``), written as escaped literals.

llama.cpp matches each ``-ot`` pattern with std::regex_search, which backtracks: a pattern from a
shared profile such as ``".?" * 30 + ".{30}!"`` kept the load from ever returning. Given only the
names, as ``^(a|b|...)$`` alternations of literals built here, std::regex's work is linear in the
pattern, whatever the profile said. ``tuner.engine.ggml.OverrideArray`` (the one gate before
llama.cpp, in the worker and in ``tuner.Llama``) calls ``resolved_patterns``.
"""

from __future__ import annotations

import os
from typing import Sequence


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
