"""Tensor overrides and weight repacking for llama-cpp-python's high-level ``Llama``, which has no
keyword for them.

llama.cpp takes them in ``llama_model_params.tensor_buft_overrides`` (what ``-ot PATTERN=CPU``
sets). ``Llama`` builds its own params and calls ``llama_model_load_from_file`` inside its
constructor, so for the duration of the ``with`` block this wraps that call and fills the field in:

    with tensor_overrides_applied([r"blk\\.[0-3]\\.ffn_.*"]):
        llm = llama_cpp.Llama(model_path, n_gpu_layers=99)

``repack=False`` likewise clears ``llama_model_params.use_extra_bufts`` (llama.cpp's weight
repacking into the AMX / CPU_REPACK buffers; what ``--no-repack`` sets):

    with tensor_overrides_applied((), repack=False):
        llm = llama_cpp.Llama(model_path)

The override array stays referenced for the life of the process: llama.cpp reads it while loading
and the wrapper cannot know when a model is freed.

llama.cpp never sees a pattern as written. It matches overrides with std::regex_search, which
backtracks: a pattern from a shared profile such as ``".?" * 30 + ".{30}!"`` would keep the load
from ever returning. So ``tensor_match.resolved_patterns`` (called by ``OverrideArray``) matches each pattern here against the model's own
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
def tensor_overrides_applied(patterns: Sequence[str], *, repack: bool = True) -> Iterator[None]:
    from llama_cpp import _internals

    from .ggml import OverrideArray

    module = _internals.llama_cpp  # the module _internals calls llama_model_load_from_file through
    original = module.llama_model_load_from_file

    def load_with_overrides(path: bytes, params: Any) -> Any:
        if patterns:
            overrides = OverrideArray(tuple(patterns), os.fsdecode(path))
            _KEEP.append(overrides)
            params.tensor_buft_overrides = overrides.address
        if not repack:
            params.use_extra_bufts = False
        return original(path, params)

    with _LOCK:
        module.llama_model_load_from_file = load_with_overrides
        try:
            yield
        finally:
            module.llama_model_load_from_file = original
