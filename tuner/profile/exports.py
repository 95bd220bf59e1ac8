"""A profile's settings in other tools' words: command lines, an ollama Modelfile, environment variables.

``export_args(profile, fmt)`` is what ``offload-tuner profile args PROFILE --for FMT`` prints:

- ``llama-server``, ``llama-cli``, ``llama-bench``: one shell-quoted command line from
  ``Settings.cli_args(tool)``; ``llama-bench`` also gets the benchmark's shape (``-p``, ``-n``, ``-d``).
- ``ollama``: a Modelfile with ``FROM`` and the ``PARAMETER`` lines that ollama's runner options take
  (``num_gpu``, ``num_ctx``, ``num_batch``, ``num_thread``, ``main_gpu``, ``use_mmap``: the ``Runner``
  struct of ollama's ``api/types.go``, 2026), and a comment naming the settings a Modelfile cannot say.
- ``env``: ``export LLAMA_ARG_...=...`` lines llama-server reads at start (names from the ``set_env``
  calls in llama.cpp's ``common/arg.cpp``, as vendored by llama-cpp-python 0.3.36), and a comment
  naming the flags that have no variable.

``n_gpu_layers = -1`` (all layers) is written as the profile's ``layers_total``: since 2026
llama.cpp's common arguments read ``-ngl -1`` as "auto" (fit to free memory), not "all".
"""

from __future__ import annotations

import os
import shlex

from ..errors import ProfileError
from .document import Profile
from ..engine.settings import CLI_TOOLS

FORMATS = (*CLI_TOOLS, "ollama", "env")

# llama-server flag (as Settings.cli_args writes it) -> the environment variable it reads instead.
ENV_BY_FLAG = {
    "-m": "LLAMA_ARG_MODEL",
    "-ngl": "LLAMA_ARG_N_GPU_LAYERS",
    "-sm": "LLAMA_ARG_SPLIT_MODE",
    "-mg": "LLAMA_ARG_MAIN_GPU",
    "-ts": "LLAMA_ARG_TENSOR_SPLIT",
    "-c": "LLAMA_ARG_CTX_SIZE",
    "-b": "LLAMA_ARG_BATCH",
    "-ub": "LLAMA_ARG_UBATCH",
    "-t": "LLAMA_ARG_THREADS",
    "-fa": "LLAMA_ARG_FLASH_ATTN",
    "-ctk": "LLAMA_ARG_CACHE_TYPE_K",
    "-ctv": "LLAMA_ARG_CACHE_TYPE_V",
    "-lm": "LLAMA_ARG_LOAD_MODE",
    "-ot": "LLAMA_ARG_OVERRIDE_TENSOR",
    "--rpc": "LLAMA_ARG_RPC",
}
# Switches without a value. --no-kv-offload is the negative of "-kvo, --kv-offload", whose variable is
# LLAMA_ARG_KV_OFFLOAD (a boolean: 0 turns it off; arg.cpp also reads LLAMA_ARG_NO_KV_OFFLOAD).
ENV_BY_SWITCH = {"-nkvo": ("LLAMA_ARG_KV_OFFLOAD", "0")}
# In arg.cpp these have no set_env(): they can only be passed as flags.
NO_ENV_WITH_VALUE = {"-tb"}
NO_ENV_SWITCHES = {"--no-op-offload"}

# ollama's OLLAMA_KV_CACHE_TYPE takes these (fs/ggml/ggml.go, 2026); f16 is its default.
OLLAMA_KV_TYPES = ("f16", "q8_0", "q4_0")


def export_args(profile: Profile, fmt: str, *, model_path: str | os.PathLike[str] | None = None) -> str:
    """The profile as ``fmt`` (one of ``FORMATS``) writes it; ``model_path`` replaces the recorded path."""
    path = os.fspath(model_path) if model_path is not None else None
    if fmt in CLI_TOOLS:
        return shlex.join([fmt, *tool_args(profile, fmt, model_path=path)]) + "\n"
    if fmt == "ollama":
        return ollama_modelfile(profile, model_path=path)
    if fmt == "env":
        return llama_server_env(profile, model_path=path)
    raise ProfileError(f"unknown export format {fmt!r}; expected one of {', '.join(FORMATS)}")


def tool_args(profile: Profile, tool: str, *, model_path: str | None = None) -> list[str]:
    """argv for ``llama-server``, ``llama-cli`` or ``llama-bench`` (without the program name)."""
    args = profile.cli_args(tool, model_path=model_path)
    if profile.settings.n_gpu_layers < 0 and profile.layers_total > 0:
        index = args.index("-ngl")
        args[index + 1] = str(profile.layers_total)
    if tool == "llama-bench":
        measured = profile.measured
        args += ["-p", str(measured.n_prompt), "-n", str(measured.n_gen)]
        if measured.depth:
            args += ["-d", str(measured.depth)]
    return args


def llama_server_env(profile: Profile, *, model_path: str | None = None) -> str:
    """``export LLAMA_ARG_...`` lines for llama-server; flags without a variable in a comment."""
    args = tool_args(profile, "llama-server", model_path=model_path)
    lines = [f"# llama-server settings of offload-tuner profile {profile.name} ({profile.model.file_name})"]
    flags_only: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i]
        if flag in ENV_BY_SWITCH:
            name, value = ENV_BY_SWITCH[flag]
            lines.append(f"export {name}={shlex.quote(value)}")
            i += 1
        elif flag in ENV_BY_FLAG:
            lines.append(f"export {ENV_BY_FLAG[flag]}={shlex.quote(args[i + 1])}")
            i += 2
        elif flag in NO_ENV_SWITCHES:
            flags_only.append(flag)
            i += 1
        else:
            # -tb, or a flag Settings learned after this table was written: keep it with its value.
            takes_value = flag in NO_ENV_WITH_VALUE or (i + 1 < len(args) and not args[i + 1].startswith("-"))
            flags_only.append(shlex.join(args[i : i + 2] if takes_value else [flag]))
            i += 2 if takes_value else 1
    if flags_only:
        lines.append(f"# llama-server reads no environment variable for these; pass them as flags: {' '.join(flags_only)}")
    return "\n".join(lines) + "\n"


def ollama_modelfile(profile: Profile, *, model_path: str | None = None) -> str:
    """A Modelfile: ``FROM``, the ``PARAMETER`` lines that map, and what does not map, in a comment."""
    s = profile.settings
    measured = profile.measured
    lines = [
        f"# Modelfile from offload-tuner profile {profile.name}",
        f"# {profile.model.file_name} on {profile.machine.describe()}; tuned {profile.created_at}: "
        f"tg {measured.tg.median:g} t/s, pp {measured.pp.median:g} t/s with llama.cpp",
        f"FROM {model_path or s.model_path}",
    ]
    not_expressible: list[str] = []

    num_gpu = profile.layers_total if s.n_gpu_layers < 0 else s.n_gpu_layers
    lines.append(f"PARAMETER num_gpu {num_gpu}")
    if s.n_ctx:
        lines.append(f"PARAMETER num_ctx {s.n_ctx}")
    else:
        not_expressible.append("n_ctx 0 (the model's training context): set num_ctx to that number")
    # ollama passes num_batch as both -b and -ub (llm/llama_server.go): use the physical batch, which
    # sizes the compute buffers the profile measured.
    lines.append(f"PARAMETER num_batch {s.n_ubatch}")
    if s.n_batch != s.n_ubatch:
        not_expressible.append(
            f"n_batch {s.n_batch}: ollama's num_batch sets llama.cpp's batch and ubatch together; "
            f"num_batch above is the profile's n_ubatch ({s.n_ubatch})"
        )
    if s.n_threads is not None:
        lines.append(f"PARAMETER num_thread {s.n_threads}")
    if s.main_gpu:
        lines.append(f"PARAMETER main_gpu {s.main_gpu}")
    lines.append(f"PARAMETER use_mmap {'true' if s.use_mmap else 'false'}")
    # ollama starts llama-server with -c num_ctx x OLLAMA_NUM_PARALLEL (llm/llama_server.go).
    lines.append("# num_ctx is per parallel request: the memory this profile measured holds with OLLAMA_NUM_PARALLEL=1")

    if s.n_threads_batch is not None:
        not_expressible.append(f"n_threads_batch {s.n_threads_batch}: ollama uses num_thread for prompt processing too")
    if s.split_mode != "layer":
        not_expressible.append(f"split_mode {s.split_mode}: ollama always splits by layer")
    if s.tensor_split is not None:
        split = ",".join(f"{p:g}" for p in s.tensor_split)
        not_expressible.append(
            f"tensor_split {split}: ollama places layers on GPUs itself (OLLAMA_SCHED_SPREAD=1 spreads one model over all GPUs)"
        )
    if s.type_k != "f16" or s.type_v != "f16":
        if s.type_k != s.type_v:
            kv = (
                f"type_k {s.type_k}, type_v {s.type_v}: ollama has one KV cache type for K and V, set server-wide "
                f"with OLLAMA_KV_CACHE_TYPE where `ollama serve` runs"
            )
        else:
            kv = f"type_k and type_v {s.type_k}: the KV cache type is server-wide in ollama: OLLAMA_KV_CACHE_TYPE={s.type_k} where `ollama serve` runs"
        if any(t not in OLLAMA_KV_TYPES for t in (s.type_k, s.type_v)):
            kv += f" (it takes {', '.join(OLLAMA_KV_TYPES)})"
        not_expressible.append(kv)
    if s.flash_attn != "auto":
        value = "1" if s.flash_attn == "on" else "0"
        not_expressible.append(f"flash_attn {s.flash_attn}: server-wide in ollama: OLLAMA_FLASH_ATTENTION={value} where `ollama serve` runs")
    if not s.offload_kqv:
        not_expressible.append("offload_kqv false (KV cache in host memory): ollama keeps the KV cache with its layers")
    if s.use_mlock:
        not_expressible.append("use_mlock true: ollama's use_mlock parameter is deprecated and ignored")
    if not s.op_offload:
        not_expressible.append("op_offload false: no ollama equivalent")
    if s.tensor_overrides:
        not_expressible.append(
            f"tensor_overrides {', '.join(s.tensor_overrides)} (kept on the CPU): ollama has no tensor placement option"
        )
    if s.rpc_servers:
        not_expressible.append(f"rpc_servers {', '.join(s.rpc_servers)}: ollama does not use llama.cpp RPC servers")
    if not_expressible:
        lines.append("# not expressible in a Modelfile:")
        lines += [f"#   {item}" for item in not_expressible]
    return "\n".join(lines) + "\n"


__all__ = ["FORMATS", "export_args", "tool_args", "llama_server_env", "ollama_modelfile"]
