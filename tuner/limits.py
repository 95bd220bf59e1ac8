"""Bounds on every number and name the tuner takes from outside: a profile someone shared, a GGUF
header, a command line, a log. In one place, so each check says the same limit and why.

Anything read from a file someone else wrote is hostile: a count is bounded before anything is
allocated from it, a name is checked before it is printed into a shell line, a regular expression
before it is matched. The limits are far above anything real (with the reason next to each) and
far below what would exhaust memory or overflow llama.cpp's C integers.

This module imports nothing of the tuner's: every stage may use it.
"""

from __future__ import annotations

import functools
import re

# -- settings (llama.cpp's own types in brackets) ------------------------------------------------

# Context size in tokens [uint32 n_ctx]. The longest trained context is 10M tokens (Llama 4 Scout,
# 2025); 2^24 leaves room and keeps n_ctx x bytes-per-token arithmetic sane. n_ctx 2^62 passed before.
MAX_CTX = 1 << 24
# Batch sizes [uint32 n_batch, n_ubatch]: never usefully above the context.
MAX_BATCH = MAX_CTX
# GPU layers [int32 n_gpu_layers]: -1 is all; users write 999 for all too (llama.cpp clamps). No
# model has 2^16 layers; 10^400 passed before and a profile check said it fit.
MAX_GPU_LAYERS = 1 << 16
# Threads [int32]: the largest machines have a few thousand hardware threads.
MAX_THREADS = 1 << 14
# Devices: a GPU index, a tensor split's length, RPC servers [llama_max_devices() is 16 in CUDA builds].
MAX_DEVICES = 256
# A tensor split proportion: any finite share >= 0 works, memory sizes in bytes included (llama.cpp's
# own default split is proportional to free memory); an exbibyte is the cap.
MAX_PROPORTION = float(1 << 60)
# --n-cpu-moe N [int]: llama.cpp builds one tensor override per layer, each matched against every
# tensor name at load; the deepest MoE models have about a hundred layers (Qwen3-235B-A22B: 94).
MAX_CPU_MOE = 1 << 10
# Parallel sequences (-np, n_seq_max) [uint32]: llama.cpp refuses more than LLAMA_MAX_SEQ (src/llama-cparams.h: 256).
MAX_PARALLEL = 256
# The largest value of each numeric setting (tuner.engine.settings applies them by field name).
SETTING_MAX = {
    "n_gpu_layers": MAX_GPU_LAYERS,
    "main_gpu": MAX_DEVICES - 1,
    "n_ctx": MAX_CTX,
    "n_batch": MAX_BATCH,
    "n_ubatch": MAX_BATCH,
    "n_threads": MAX_THREADS,
    "n_threads_batch": MAX_THREADS,
    "n_cpu_moe": MAX_CPU_MOE,
    "n_parallel": MAX_PARALLEL,
}

# -- names and paths -----------------------------------------------------------------------------

# A name or path that ends up in a shell line, a Modelfile, an env file or a terminal: no control
# characters (a newline in a model's file name ran the rest of the name when the env export was
# sourced), and a length no file system takes.
MAX_NAME = 1024
MAX_PATH = 4096
_CONTROL = re.compile(r"[\x00-\x1f\x7f\x80-\x9f\u2028\u2029]")

# -- tensor overrides (regular expressions from profiles) ----------------------------------------

# llama.cpp matches each override against every tensor name with std::regex_search, whose
# backtracking a pattern like "(a+)+$" makes exponential: tuner.Llama hung on a shared profile.
# So a pattern is at most this long, and matched with a guarantee (see tensor_regex).
# (4096 characters: an alternation of every layer of a 200-layer model, or of the exact tensor names a
# log kept on the CPU, as tuner.report.diagnose writes them, fits.)
MAX_OVERRIDES = 64
MAX_OVERRIDE_LENGTH = 4096

# -- network -------------------------------------------------------------------------------------

MIN_PORT, MAX_PORT = 1, 65535

# -- GGUF headers ----------------------------------------------------------------------------------

# Counts in a GGUF header are checked against the file itself (a layer needs tensors, tensors need
# bytes); these absolute caps come first, so nothing is allocated from an absurd count.
MAX_GGUF_LAYERS = 1 << 16
MAX_GGUF_EMBD = 1 << 20      # embedding width: the widest models are ~2^14
MAX_GGUF_HEADS = 1 << 16
MAX_GGUF_EXPERTS = 1 << 16
MAX_GGUF_CONTEXT = 1 << 32   # a training context the header claims (uint32 in llama.cpp)

# -- integers in documents (profiles, bundles) -------------------------------------------------------

# Sizes are bytes: 2^60 is an exbibyte. Any integer a profile holds is at most this (a 400-digit one
# made the apps' arithmetic raise OverflowError).
MAX_DOCUMENT_INT = 1 << 60
MAX_DOCUMENT_FLOAT = 1e18


def shown(value: object, width: int = 80) -> str:
    """``value`` for an error message: a number of 30 digits or more by its count of digits (a
    400-digit one is not printed whole, and ``str()`` refuses 4,300 digits), anything else as
    ``repr`` cut to ``width`` characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 30:
        bits = abs(value).bit_length()
        digits = len(str(abs(value))) if bits < 14_000 else int(bits * 0.30103) + 1
        return f"a number of {digits} digits"
    text = repr(value)
    return text if len(text) <= width else f"{text[:width - 3]}..."


def control_character(text: str) -> str | None:
    """The first control character in ``text`` as a readable escape (``'\\n'``), or None."""
    m = _CONTROL.search(text)
    return None if m is None else repr(m.group())[1:-1]


def check_name(text: object, what: str, *, limit: int = MAX_NAME) -> str | None:
    """Why ``text`` is not a safe name or path (``what`` says which), or None when it is."""
    if not isinstance(text, str) or not text:
        return f"expected a non-empty {what}, got {text!r}"[:200]
    if len(text) > limit:
        return f"a {what} of {len(text)} characters (at most {limit})"
    bad = control_character(text)
    if bad is not None:
        return f"the {what} holds a control character ({bad}); rename it"
    return None


# Matching with a guarantee. llama.cpp matches an override with std::regex_search, a backtracking
# matcher: "(a+)+$", ".?" * 30 + ".{30}!" or eight ".{0,40}" then "!" take exponential time, and
# no list of bad shapes catches them all. So every override is matched here with RE2 (google-re2),
# whose automaton matches in time linear in the name whatever the pattern; llama.cpp is then given
# only the names it matched, as patterns this tool builds (escaped literals: see
# tuner.engine.overrides), never the pattern as written. A pattern RE2 cannot express (a
# backreference, a lookaround) is refused: tensor names need neither.
_RE2_OPTIONS: object = None


@functools.lru_cache(maxsize=1024)  # (the memory arithmetic asks for the same few patterns thousands of times)
def tensor_regex(pattern: str):
    """``pattern`` compiled by RE2 (linear-time matching); raises ``ValueError`` with RE2's reason
    when RE2 cannot express it. Every matcher of tensor overrides in this tool calls this."""
    global _RE2_OPTIONS
    import re2  # google-re2: a linear-time engine (see above)

    if _RE2_OPTIONS is None:
        options = re2.Options()
        options.log_errors = False  # RE2 would print its own reason to stderr; ours is the one line
        _RE2_OPTIONS = options
    try:
        return re2.compile(pattern, _RE2_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", errors="replace")
        raise ValueError(str(reason)) from None


def check_tensor_pattern(pattern: object) -> str | None:
    """Why ``pattern`` is not an acceptable tensor override (a regular expression over tensor names,
    kept on the CPU), or None when it is: bounded length, no control character, and RE2 can express
    it (so it is matched in linear time: see ``tensor_regex``)."""
    if not isinstance(pattern, str) or not pattern:
        return f"expected a regular expression, got {pattern!r}"[:200]
    if len(pattern) > MAX_OVERRIDE_LENGTH:
        return f"a pattern of {len(pattern)} characters (at most {MAX_OVERRIDE_LENGTH})"
    bad = control_character(pattern)
    if bad is not None:
        return f"the pattern holds a control character ({bad})"
    try:
        re.compile(pattern)  # (compiling matches nothing: only the syntax error's wording is wanted)
    except (re.error, RecursionError, OverflowError) as exc:
        return f"not a valid regular expression: {exc}"
    try:
        tensor_regex(pattern)
    except ValueError as exc:
        return (f"RE2, which matches tensor overrides in linear time, cannot express it ({exc}); a backreference or a "
                r"lookaround is never needed to name tensors: write e.g. blk\.(1[0-9]|2[0-4])\.ffn_.*_exps\.")
    return None


__all__ = [
    "MAX_CTX", "MAX_BATCH", "MAX_GPU_LAYERS", "MAX_CPU_MOE", "MAX_PARALLEL", "MAX_THREADS", "MAX_DEVICES", "MAX_PROPORTION", "SETTING_MAX", "MAX_NAME", "MAX_PATH",
    "MAX_OVERRIDES", "MAX_OVERRIDE_LENGTH", "MIN_PORT", "MAX_PORT", "MAX_GGUF_LAYERS", "MAX_GGUF_EMBD", "MAX_GGUF_HEADS",
    "MAX_GGUF_EXPERTS", "MAX_GGUF_CONTEXT", "MAX_DOCUMENT_INT", "MAX_DOCUMENT_FLOAT",
    "shown", "control_character", "check_name", "check_tensor_pattern", "tensor_regex",
]
