"""One candidate way of running a model: a frozen, validated dataclass, and its converters.

A ``Settings`` is what one trial launches and what a profile records. It converts to
``llama_cpp.Llama(**kwargs)`` and to the command-line flags of llama-server, llama-cli and
llama-bench (flag names checked against llama.cpp's ``common/arg.cpp`` and
``tools/llama-bench/llama-bench.cpp`` as vendored by llama-cpp-python 0.3.36).

This module is light on purpose: profiles import it, and apps import profiles.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import SettingsError

# llama.cpp's KV cache types (common/arg.cpp ``kv_cache_types``), by the name -ctk/-ctv take,
# with the ggml_type enum value llama_context_params.type_k/type_v take.
KV_CACHE_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
CLI_TOOLS = ("llama-server", "llama-cli", "llama-bench")

# The settings that decide the loaded model (the rest only shape the context).
MODEL_KEYS = ("model_path", "n_gpu_layers", "split_mode", "main_gpu", "tensor_split", "use_mmap", "use_mlock",
              "tensor_overrides", "rpc_servers")

_RPC_RE = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:\d{1,5}$")


@dataclass(frozen=True)
class Settings:
    """A candidate configuration for one llama.cpp instance.

    ``None`` for a thread count means llama.cpp's default. ``tensor_overrides`` are regular
    expressions over tensor names whose matching tensors stay in host (CPU) memory, as
    llama.cpp's ``-ot PATTERN=CPU``: e.g. ``blk\\.(0|1)\\.ffn_.*`` keeps the FFN of layers 0
    and 1 on the CPU while their attention is offloaded.
    """

    model_path: str
    n_gpu_layers: int = 0
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] | None = None
    n_ctx: int = 4096
    n_batch: int = 2048
    n_ubatch: int = 512
    n_threads: int | None = None
    n_threads_batch: int | None = None
    flash_attn: str = "auto"
    type_k: str = "f16"
    type_v: str = "f16"
    offload_kqv: bool = True
    use_mmap: bool = True
    use_mlock: bool = False
    op_offload: bool = True
    tensor_overrides: tuple[str, ...] = ()
    rpc_servers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # Accept lists (from JSON) but store tuples so the dataclass stays hashable.
        if self.tensor_split is not None and not isinstance(self.tensor_split, tuple):
            object.__setattr__(self, "tensor_split", tuple(self.tensor_split))
        if not isinstance(self.tensor_overrides, tuple):
            object.__setattr__(self, "tensor_overrides", tuple(self.tensor_overrides))
        if not isinstance(self.rpc_servers, tuple):
            object.__setattr__(self, "rpc_servers", tuple(self.rpc_servers))
        self.validate()

    # -- validation ---------------------------------------------------------------------------

    def validate(self, prefix: str = "settings") -> None:
        """Raise ``SettingsError`` naming the dotted path of the first bad field."""

        def bad(name: str, message: str) -> SettingsError:
            return SettingsError(f"{prefix}.{name}", message)

        if not isinstance(self.model_path, str) or not self.model_path:
            raise bad("model_path", "expected a non-empty path to a GGUF file")
        for name in ("n_gpu_layers", "main_gpu", "n_ctx", "n_batch", "n_ubatch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise bad(name, f"expected an integer, got {value!r}")
        if self.n_gpu_layers < -1:
            raise bad("n_gpu_layers", f"expected -1 (all) or a count >= 0, got {self.n_gpu_layers}")
        if self.main_gpu < 0:
            raise bad("main_gpu", f"expected a device index >= 0, got {self.main_gpu}")
        if self.n_ctx < 0:
            raise bad("n_ctx", f"expected 0 (the model's training context) or more, got {self.n_ctx}")
        if self.n_batch < 1:
            raise bad("n_batch", f"expected at least 1, got {self.n_batch}")
        if self.n_ubatch < 1:
            raise bad("n_ubatch", f"expected at least 1, got {self.n_ubatch}")
        if self.n_ubatch > self.n_batch:
            raise bad("n_ubatch", f"must not exceed n_batch ({self.n_batch}), got {self.n_ubatch}")
        for name in ("n_threads", "n_threads_batch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise bad(name, f"expected null (llama.cpp's default) or a count >= 1, got {value!r}")
        if self.split_mode not in SPLIT_MODES:
            raise bad("split_mode", f"expected one of {', '.join(SPLIT_MODES)}, got {self.split_mode!r}")
        if self.flash_attn not in FLASH_ATTN:
            raise bad("flash_attn", f"expected one of {', '.join(FLASH_ATTN)}, got {self.flash_attn!r}")
        for name in ("type_k", "type_v"):
            if getattr(self, name) not in KV_CACHE_TYPES:
                raise bad(name, f"expected one of {', '.join(KV_CACHE_TYPES)}, got {getattr(self, name)!r}")
        if self.type_v != "f16" and self.type_v not in ("f32", "bf16") and self.flash_attn == "off":
            raise bad("type_v", f"a quantized V cache ({self.type_v}) needs flash attention; set flash_attn to on or auto")
        for name in ("offload_kqv", "use_mmap", "use_mlock", "op_offload"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"expected true or false, got {getattr(self, name)!r}")
        if self.tensor_split is not None:
            if len(self.tensor_split) == 0:
                raise bad("tensor_split", "expected null or at least one proportion")
            for i, part in enumerate(self.tensor_split):
                if not isinstance(part, (int, float)) or isinstance(part, bool) or part < 0:
                    raise bad(f"tensor_split[{i}]", f"expected a proportion >= 0, got {part!r}")
            if sum(self.tensor_split) <= 0:
                raise bad("tensor_split", "the proportions add up to 0; at least one device needs a share")
        for i, pattern in enumerate(self.tensor_overrides):
            if not isinstance(pattern, str) or not pattern:
                raise bad(f"tensor_overrides[{i}]", f"expected a regular expression, got {pattern!r}")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise bad(f"tensor_overrides[{i}]", f"not a valid regular expression: {exc}") from None
        for i, server in enumerate(self.rpc_servers):
            if not isinstance(server, str) or not _RPC_RE.match(server):
                raise bad(f"rpc_servers[{i}]", f"expected host:port, got {server!r}")

    # -- conversions --------------------------------------------------------------------------

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tensor_split"] = list(self.tensor_split) if self.tensor_split is not None else None
        out["tensor_overrides"] = list(self.tensor_overrides)
        out["rpc_servers"] = list(self.rpc_servers)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], prefix: str = "settings") -> "Settings":
        if not isinstance(data, Mapping):
            raise SettingsError(prefix, f"expected an object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SettingsError(f"{prefix}.{unknown[0]}", f"unknown setting; known: {', '.join(sorted(known))}")
        if "model_path" not in data:
            raise SettingsError(f"{prefix}.model_path", "missing")
        try:
            settings = cls.__new__(cls)
            for f in dataclasses.fields(cls):
                if f.name in data:
                    value = data[f.name]
                elif f.default is not dataclasses.MISSING:
                    value = f.default
                else:
                    value = f.default_factory()  # type: ignore[misc]
                if f.name in ("tensor_split", "tensor_overrides", "rpc_servers") and isinstance(value, list):
                    value = tuple(value)
                object.__setattr__(settings, f.name, value)
            settings.validate(prefix)
        except SettingsError:
            raise
        return settings

    @property
    def model_key(self) -> tuple:
        """What decides the loaded model: trials that share it can share one loaded model."""
        return tuple(getattr(self, name) for name in MODEL_KEYS)

    def llama_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``llama_cpp.Llama`` (llama-cpp-python 0.3.36).

        Two settings have no ``Llama`` keyword and are left out: ``tensor_overrides`` (set
        ``llama_model_params.tensor_buft_overrides`` through ctypes, as the trial worker does)
        and ``rpc_servers`` (register the devices before loading; ``tuner.engine.rpc`` does it).
        ``flash_attn="auto"`` maps to ``False``: the high-level API offers only on and off.
        """
        kwargs: dict[str, Any] = {
            "model_path": self.model_path,
            "n_gpu_layers": self.n_gpu_layers,
            "split_mode": SPLIT_MODES[self.split_mode],
            "main_gpu": self.main_gpu,
            "n_ctx": self.n_ctx,
            "n_batch": self.n_batch,
            "n_ubatch": self.n_ubatch,
            "flash_attn": self.flash_attn == "on",
            "type_k": KV_CACHE_TYPES[self.type_k],
            "type_v": KV_CACHE_TYPES[self.type_v],
            "offload_kqv": self.offload_kqv,
            "use_mmap": self.use_mmap,
            "use_mlock": self.use_mlock,
            "op_offload": self.op_offload,
        }
        if self.tensor_split is not None:
            kwargs["tensor_split"] = list(self.tensor_split)
        if self.n_threads is not None:
            kwargs["n_threads"] = self.n_threads
        if self.n_threads_batch is not None:
            kwargs["n_threads_batch"] = self.n_threads_batch
        return kwargs

    def cli_args(self, tool: str = "llama-server", *, model_path: str | None = None) -> list[str]:
        """Flags for ``llama-server``, ``llama-cli`` or ``llama-bench`` (as an argv list)."""
        if tool not in CLI_TOOLS:
            raise SettingsError("tool", f"expected one of {', '.join(CLI_TOOLS)}, got {tool!r}")
        bench = tool == "llama-bench"
        # -1 means every layer here (llama_model_params). llama-server/llama-cli read -1 as
        # "auto" (fit to free memory) and take "all" for every layer (common/arg.cpp, 2026);
        # llama-bench passes the number through to llama_model_params, where -1 is all.
        ngl = "all" if self.n_gpu_layers < 0 and not bench else str(self.n_gpu_layers)
        args = ["-m", model_path or self.model_path, "-ngl", ngl]
        if self.split_mode != "layer":
            args += ["-sm", self.split_mode]
        if self.main_gpu:
            args += ["-mg", str(self.main_gpu)]
        if self.tensor_split is not None:
            # llama-bench splits its list arguments on ',' (one value per run), so its tensor
            # split uses '/' between devices; the others take a comma list.
            sep = "/" if bench else ","
            args += ["-ts", sep.join(_num(p) for p in self.tensor_split)]
        if not bench:
            # llama-bench sizes its context from -p/-n/-d; it has no -c.
            args += ["-c", str(self.n_ctx)]
        args += ["-b", str(self.n_batch), "-ub", str(self.n_ubatch)]
        if self.n_threads is not None:
            args += ["-t", str(self.n_threads)]
        if self.n_threads_batch is not None and not bench:
            args += ["-tb", str(self.n_threads_batch)]
        if bench:
            if self.flash_attn != "auto":
                args += ["-fa", "1" if self.flash_attn == "on" else "0"]
        else:
            args += ["-fa", self.flash_attn]
        args += ["-ctk", self.type_k, "-ctv", self.type_v]
        if not self.offload_kqv:
            args += ["-nkvo", "1"] if bench else ["-nkvo"]
        load_mode = _load_mode(self.use_mmap, self.use_mlock)
        if load_mode != "mmap":
            args += ["-lm", load_mode]
        if not self.op_offload:
            args += ["-nopo", "1"] if bench else ["--no-op-offload"]
        if self.tensor_overrides:
            # llama-server/cli separate overrides with ','; llama-bench uses ',' between runs and
            # ';' between the overrides of one run.
            args += ["-ot", (";" if bench else ",").join(f"{p}=CPU" for p in self.tensor_overrides)]
        if self.rpc_servers:
            args += ["--rpc", ",".join(self.rpc_servers)]
        return args

    def command_line(self, tool: str = "llama-server", *, model_path: str | None = None) -> str:
        return shlex.join([tool, *self.cli_args(tool, model_path=model_path)])


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _load_mode(use_mmap: bool, use_mlock: bool) -> str:
    # llama.cpp's --load-mode names (common/arg.cpp, 2026), mirroring llama-cpp-python's mapping.
    if use_mmap and use_mlock:
        return "mmap+mlock"
    if use_mlock:
        return "mlock"
    return "mmap" if use_mmap else "none"


def kv_type_id(name: str) -> int:
    try:
        return KV_CACHE_TYPES[name]
    except KeyError:
        raise SettingsError("type", f"expected one of {', '.join(KV_CACHE_TYPES)}, got {name!r}") from None


__all__ = ["Settings", "KV_CACHE_TYPES", "SPLIT_MODES", "FLASH_ATTN", "CLI_TOOLS", "kv_type_id"]
