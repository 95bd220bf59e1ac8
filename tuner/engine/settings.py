"""One candidate way of running a model: a frozen, validated dataclass, and its converters.

A ``Settings`` is what one trial launches and what a profile records. It converts to
``llama_cpp.Llama(**kwargs)`` and to the command-line flags of llama-server, llama-cli and
llama-bench. Each field is declared once in ``tuner.engine.dimensions`` (its kind, checks and every
spelling); this class holds the values and loops over that table. ``tests/test_dimensions.py``
checks that the fields here and the table agree, name for name, in order, with the same defaults.

This module is light on purpose: profiles import it, and apps import profiles.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from typing import Any, Mapping

from .. import limits
from ..errors import SettingsError
from .dimensions import (
    CLI_TOOLS,
    DIMENSIONS,
    FLASH_ATTN,
    KV_CACHE_TYPES,
    SPLIT_MODES,
    UNQUANTIZED_KV,
    Export,
)

# The settings that decide the loaded model (the rest only shape the context).
MODEL_KEYS = tuple(d.name for d in DIMENSIONS if d.model_level)

# fields held as tuples (JSON gives lists)
_SEQUENCES = tuple(d.name for d in DIMENSIONS if d.kind in ("proportions", "patterns", "endpoints", "devices"))
# a ggml device name as -dev takes it: CUDA0, Vulkan1, MTL0, ROCm0, SYCL0, RPC2 (fullmatch)
_DEVICE_RE = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
_RPC_RE = re.compile(r"[A-Za-z0-9.\-\[\]:]{1,255}:\d{1,5}")  # fullmatch: "$" would take a trailing newline


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
    swa_full: bool = False
    kv_unified: bool = False
    n_parallel: int = 1
    use_mmap: bool = True
    use_mlock: bool = False
    op_offload: bool = True
    tensor_overrides: tuple[str, ...] = ()
    n_cpu_moe: int = 0
    repack: bool = True
    rpc_servers: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()  # llama.cpp's devices to offload to, by ggml name; () = llama.cpp's choice

    def __post_init__(self) -> None:
        # Accept lists (from JSON) but store tuples so the dataclass stays hashable.
        for name in _SEQUENCES:
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        self.validate()

    # -- validation ---------------------------------------------------------------------------

    def validate(self, prefix: str = "settings") -> None:
        """Raise ``SettingsError`` naming the dotted path of the first bad field."""
        for dim in DIMENSIONS:
            problem = _check(dim.kind, getattr(self, dim.name), dim)
            if problem is not None:
                name, message = problem
                raise SettingsError(f"{prefix}.{name}", message)
        # across fields
        if self.n_ubatch > self.n_batch:
            raise SettingsError(f"{prefix}.n_ubatch", f"must not exceed n_batch ({self.n_batch}), got {self.n_ubatch}")
        if self.type_v not in UNQUANTIZED_KV and self.flash_attn == "off":
            raise SettingsError(f"{prefix}.type_v", f"a quantized V cache ({self.type_v}) needs flash attention; set flash_attn to on or auto")

    # -- conversions --------------------------------------------------------------------------

    def replace(self, **changes: Any) -> "Settings":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in _SEQUENCES:
            out[name] = list(out[name]) if out[name] is not None else None
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
                if f.name in _SEQUENCES and isinstance(value, list):
                    value = tuple(value)
                object.__setattr__(settings, f.name, value)
            settings.validate(prefix)
        except SettingsError:
            raise
        return settings

    @property
    def host_overrides(self) -> tuple[str, ...]:
        """Every regex of tensors kept on the CPU: ``tensor_overrides`` and what other settings
        stand for as overrides. The trial worker, ``tuner.Llama`` and the estimate apply these."""
        out: list[str] = []
        for dim in DIMENSIONS:
            if dim.host_patterns is not None:
                out += dim.host_patterns(self)
        return tuple(out)

    @property
    def model_key(self) -> tuple:
        """What decides the loaded model: trials that share it can share one loaded model."""
        return tuple(getattr(self, name) for name in MODEL_KEYS)

    def llama_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``llama_cpp.Llama`` (llama-cpp-python 0.3.36).

        Settings without a ``Llama`` keyword are left out (``dimensions.DIMENSIONS``' ``no_kwarg`` says
        who applies each: ``tensor_overrides`` through ``llama_model_params.tensor_buft_overrides``, as
        ``tuner.Llama`` and the trial worker do; ``rpc_servers`` by registering the devices before
        loading). ``flash_attn="auto"`` maps to ``False``: the high-level API offers only on and off.
        """
        kwargs: dict[str, Any] = {}
        for dim in DIMENSIONS:
            if dim.llama_kwarg and dim.to_kwarg is not None:
                value = dim.to_kwarg(self)
                if value is not None:
                    kwargs[dim.llama_kwarg] = value
        return kwargs

    def cli_args(self, tool: str = "llama-server", *, model_path: str | None = None, layers_total: int | None = None) -> list[str]:
        """Flags for ``llama-server``, ``llama-cli`` or ``llama-bench`` (as an argv list).

        ``layers_total`` (a profile's) spells "every layer" as that count; see ``dimensions.gpu_layers_arg``."""
        if tool not in CLI_TOOLS:
            raise SettingsError("tool", f"expected one of {', '.join(CLI_TOOLS)}, got {tool!r}")
        export = Export(tool=tool, layers_total=layers_total, model_path=model_path)
        args: list[str] = []
        for dim in DIMENSIONS:
            writer = dim.flags.get(tool)
            if writer is not None:
                args += writer(self, export)
        return args

    def command_line(self, tool: str = "llama-server", *, model_path: str | None = None) -> str:
        return shlex.join([tool, *self.cli_args(tool, model_path=model_path)])


def _check(kind: str, value: Any, dim: Any) -> tuple[str, str] | None:
    """(field, message) when ``value`` is not a valid ``dim``, else None. The bounds (largest
    values, names and patterns that are safe) are ``tuner.limits``', each with its reason."""
    name = dim.name
    most = limits.SETTING_MAX.get(name)
    if kind == "path":
        if not isinstance(value, str) or not value:
            return name, "expected a non-empty path to a GGUF file"
        problem = limits.check_name(value, "path", limit=limits.MAX_PATH)
        if problem:
            return name, problem
    elif kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            return name, f"expected an integer, got {_short(value)}"
        if most is not None and value > most:
            return name, f"expected at most {most}, got {_short(value)}"
    elif kind == "count":
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1
                                  or (most is not None and value > most)):
            span = f"from 1 to {most}" if most is not None else ">= 1"
            return name, f"expected null (llama.cpp's default) or a count {span}, got {_short(value)}"
    elif kind == "bool":
        if not isinstance(value, bool):
            return name, f"expected true or false, got {_short(value)}"
    elif kind == "choice":
        if value not in dim.choices:
            return name, f"expected one of {', '.join(dim.choices)}, got {_short(value)}"
    elif kind == "proportions":
        if value is not None:
            if len(value) == 0:
                return name, "expected null or at least one proportion"
            if len(value) > limits.MAX_DEVICES:
                return name, f"expected at most {limits.MAX_DEVICES} proportions, got {len(value)}"
            for i, part in enumerate(value):
                # (written so that NaN fails too)
                if not isinstance(part, (int, float)) or isinstance(part, bool) or not 0 <= part <= limits.MAX_PROPORTION:
                    return f"{name}[{i}]", f"expected a proportion >= 0, got {_short(part)}"
            if sum(value) <= 0:
                return name, "the proportions add up to 0; at least one device needs a share"
    elif kind == "patterns":
        if len(value) > limits.MAX_OVERRIDES:
            return name, f"expected at most {limits.MAX_OVERRIDES} patterns, got {len(value)}"
        for i, pattern in enumerate(value):
            problem = limits.check_tensor_pattern(pattern)
            if problem:
                return f"{name}[{i}]", problem
    elif kind == "endpoints":
        if len(value) > limits.MAX_DEVICES:
            return name, f"expected at most {limits.MAX_DEVICES} servers, got {len(value)}"
        for i, server in enumerate(value):
            if (not isinstance(server, str) or not _RPC_RE.fullmatch(server)
                    or not limits.MIN_PORT <= int(server.rsplit(":", 1)[1]) <= limits.MAX_PORT):
                return f"{name}[{i}]", f"expected host:port (port {limits.MIN_PORT}-{limits.MAX_PORT}), got {_short(server)}"
    elif kind == "devices":
        if not isinstance(value, (tuple, list)) or len(value) > limits.MAX_DEVICES:
            return name, f"expected a list of at most {limits.MAX_DEVICES} device names, got {_short(value)}"
        for i, device in enumerate(value):
            if not isinstance(device, str) or not _DEVICE_RE.fullmatch(device) or device.upper() == "CPU":
                return f"{name}[{i}]", f"expected a llama.cpp device name such as CUDA0 or Vulkan1 (not CPU), got {_short(device)}"
        if len(set(value)) != len(value):
            return name, f"a device is named twice: {_short(list(value))}"
    else:  # pragma: no cover - a table entry of an unknown kind
        raise AssertionError(f"dimension {name}: unknown kind {kind!r}")
    if dim.check is not None and value is not None:
        message = dim.check(value)
        if message:
            return name, message
    return None


def _short(value: Any) -> str:
    return limits.shown(value)


def kv_type_id(name: str) -> int:
    try:
        return KV_CACHE_TYPES[name]
    except KeyError:
        raise SettingsError("type", f"expected one of {', '.join(KV_CACHE_TYPES)}, got {name!r}") from None


__all__ = ["Settings", "KV_CACHE_TYPES", "SPLIT_MODES", "FLASH_ATTN", "CLI_TOOLS", "MODEL_KEYS", "kv_type_id"]
