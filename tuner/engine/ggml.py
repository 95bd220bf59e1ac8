"""ctypes access to the ggml libraries that llama.cpp itself uses (trial worker and apps only).

llama-cpp-python's wheel ships ``libggml.so``, ``libggml.so.0`` and ``libggml.so.0.25.3`` as
separate copies, not links. ``libllama.so`` links the ``.so.0`` names, so those are the ones to
load: a call into another copy reaches a device registry and buffer types llama.cpp never sees.
"""

from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache

GGML_BACKEND_DEVICE_TYPE_CPU = 0


def lib_dir() -> str:
    import llama_cpp

    return os.path.join(os.path.dirname(llama_cpp.__file__), "lib")


def _candidates(stem: str) -> list[str]:
    if sys.platform == "darwin":
        return [f"lib{stem}.0.dylib", f"lib{stem}.dylib"]
    if sys.platform == "win32":
        return [f"{stem}.dll"]
    return [f"lib{stem}.so.0", f"lib{stem}.so"]


@lru_cache(maxsize=None)
def load(stem: str) -> ctypes.CDLL:
    """Load ``libggml``, ``libggml-base`` or ``libggml-rpc`` by the name libllama links."""
    import llama_cpp  # noqa: F401  (loads libllama first, so its ggml copies are the ones mapped)

    errors = []
    for name in _candidates(stem):
        path = os.path.join(lib_dir(), name)
        if os.path.exists(path):
            try:
                return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                errors.append(f"{name}: {exc}")
    raise OSError(f"cannot load {stem} from {lib_dir()}: " + ("; ".join(errors) or "not found"))


@lru_cache(maxsize=None)
def cpu_buffer_type() -> int:
    """``ggml_backend_dev_buffer_type(ggml_backend_dev_by_type(CPU))`` as an address."""
    ggml = load("ggml")
    base = load("ggml-base")
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    dev = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise OSError("llama.cpp has no CPU device registered")
    buft = base.ggml_backend_dev_buffer_type(dev)
    if not buft:
        raise OSError("the CPU device has no buffer type")
    return buft


class TensorBuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; };
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class OverrideArray:
    """A NULL-terminated array of overrides, kept alive as long as this object lives."""

    def __init__(self, patterns: tuple[str, ...] | list[str], model_path: str | os.PathLike[str]) -> None:
        from ..errors import SettingsError
        from ..limits import check_tensor_pattern
        from .tensor_match import resolved_patterns, tensor_names

        # the last gate before llama.cpp: it gets the names the patterns match in this model (RE2,
        # linear time), never the patterns themselves (std::regex backtracks: see engine/overrides.py)
        for i, pattern in enumerate(patterns):
            problem = check_tensor_pattern(pattern)
            if problem:
                raise SettingsError(f"tensor_overrides[{i}]", problem)
        try:
            patterns = resolved_patterns(patterns, tensor_names(model_path))
        except ValueError as exc:
            raise SettingsError("tensor_overrides", str(exc)) from None
        self.resolved = tuple(patterns)
        buft = cpu_buffer_type()
        self._patterns = [p.encode() for p in patterns]
        self.array = (TensorBuftOverride * (len(self._patterns) + 1))()
        for i, pattern in enumerate(self._patterns):
            self.array[i].pattern = pattern
            self.array[i].buft = buft
        self.array[len(self._patterns)].pattern = None
        self.array[len(self._patterns)].buft = None

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


class DeviceArray:
    """The NULL-terminated ``ggml_backend_dev_t`` array ``llama_model_params.devices`` points at, from
    llama.cpp's device names (what ``-dev`` takes), kept alive as long as this object lives."""

    def __init__(self, names: tuple[str, ...] | list[str]) -> None:
        from ..errors import SettingsError

        ggml = load("ggml")
        ggml.ggml_backend_dev_by_name.restype = ctypes.c_void_p
        ggml.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
        self.array = (ctypes.c_void_p * (len(names) + 1))()
        for i, name in enumerate(names):
            dev = ggml.ggml_backend_dev_by_name(name.encode())
            if not dev:
                listed = ", ".join(d["name"] for d in list_devices() if d["type"] != "cpu") or "none"
                raise SettingsError(f"devices[{i}]", f"llama.cpp has no device {name!r} here (it lists: {listed})")
            self.array[i] = dev
        self.array[len(names)] = None

    @property
    def address(self) -> int:
        return ctypes.addressof(self.array)


def list_devices() -> list[dict]:
    """Every device llama.cpp's registry holds now: name, description, type, memory, backend.

    ggml's own type is kept (``igpu`` for an integrated GPU: ``GGML_BACKEND_DEVICE_TYPE_IGPU``); an
    RPC device's ``name`` is the label its buffers carry (``RPC0[host:port]``), its ggml name in
    ``ggml_name``. ``tuner.engine.devices.DeviceInfo.from_dict`` reads each entry.
    """
    from .recorded import recorded_machine
    from .devices import backend_of, rpc_label

    recorded = recorded_machine()
    if recorded is not None:  # a test seam: a recorded machine's devices (RPC servers register with --rpc only)
        return [d.to_dict() for d in recorded.devices() if d.backend != "RPC"]
    ggml = load("ggml")
    base = load("ggml-base")
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(base, fn).restype = ctypes.c_char_p
        getattr(base, fn).argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_type.restype = ctypes.c_int
    base.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_memory.restype = None
    base.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    base.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    base.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_name.restype = ctypes.c_char_p
    base.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    get_props = getattr(base, "ggml_backend_dev_get_props", None)
    if get_props is not None:
        get_props.restype = None
        get_props.argtypes = [ctypes.c_void_p, ctypes.POINTER(DevProps)]
    out = []
    per_endpoint: dict[str, int] = {}
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        name = (base.ggml_backend_dev_name(dev) or b"").decode(errors="replace")
        description = (base.ggml_backend_dev_description(dev) or b"").decode(errors="replace")
        kind = base.ggml_backend_dev_type(dev)
        reg = base.ggml_backend_dev_backend_reg(dev)
        reg_name = (base.ggml_backend_reg_name(reg) or b"").decode(errors="replace") if reg else ""
        entry = {
            "name": name,
            "description": description,
            # enum ggml_backend_dev_type (ggml-backend.h, 2025-2026): CPU, GPU, IGPU, ACCEL, META
            "type": ["cpu", "gpu", "igpu", "accel", "accel"][kind] if 0 <= kind < 5 else str(kind),
            "memory_free": int(free.value),
            "memory_total": int(total.value),
            "backend": backend_of(name) if not reg_name.startswith("RPC") else "RPC",
            "unified_memory": kind == 2 or backend_of(name) == "Metal",
            "ggml_name": "",
            "rpc_endpoint": None,
            "pci_bus_id": None,
        }
        if get_props is not None:
            props = DevProps()
            get_props(dev, ctypes.byref(props))
            if props.device_id:
                entry["pci_bus_id"] = props.device_id.decode(errors="replace")[:64]
        if entry["backend"] == "RPC":
            # ggml-rpc: device name "RPC<n>" numbered across servers, description the endpoint;
            # buffers are labelled by the device's index within its server.
            endpoint = description
            index = per_endpoint.get(endpoint, 0)
            per_endpoint[endpoint] = index + 1
            entry.update(name=rpc_label(index, endpoint), ggml_name=name, rpc_endpoint=endpoint, unified_memory=False)
        out.append(entry)
    return out


class DevProps(ctypes.Structure):
    # struct ggml_backend_dev_props (ggml/include/ggml-backend.h, as vendored by llama-cpp-python 0.3.36):
    # name, description, memory_free, memory_total, type, device_id (the PCI bus id or NULL), caps
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("description", ctypes.c_char_p),
        ("memory_free", ctypes.c_size_t),
        ("memory_total", ctypes.c_size_t),
        ("type", ctypes.c_int),
        ("device_id", ctypes.c_char_p),
        ("caps_async", ctypes.c_bool),
        ("caps_host_buffer", ctypes.c_bool),
        ("caps_buffer_from_host_ptr", ctypes.c_bool),
        ("caps_events", ctypes.c_bool),
        ("caps_mmap_support", ctypes.c_bool),
        ("_room", ctypes.c_char * 64),  # a newer ggml may add fields: the callee writes into our memory
    ]


class ThreadpoolParams(ctypes.Structure):
    # struct ggml_threadpool_params (ggml/include/ggml.h; GGML_MAX_N_THREADS is 512), as vendored by
    # llama-cpp-python 0.3.36
    _fields_ = [
        ("cpumask", ctypes.c_bool * 512),
        ("n_threads", ctypes.c_int),
        ("prio", ctypes.c_int),
        ("poll", ctypes.c_uint32),
        ("strict_cpu", ctypes.c_bool),
        ("paused", ctypes.c_bool),
    ]


class Threadpools:
    """The CPU threadpools llama-bench attaches to its context, made the way it makes them
    (tools/llama-bench/llama-bench.cpp: ``ggml_threadpool_params_default(n_threads)``, ``poll`` 50,
    ``ggml_threadpool_new``, ``llama_attach_threadpool``): one for generation, one for batches when
    their thread counts differ.

    Without one, ggml's CPU backend makes and frees a threadpool for every graph it computes, once
    per generated token: 14% more CPU per token than llama-bench at one thread on a small model, a
    gap the trial worker's figures showed at high speeds. Free it after the context (``free``).
    If this llama.cpp build lacks a symbol, nothing is attached (``attached`` says so)."""

    def __init__(self, ctx: int, n_threads: int, n_threads_batch: int, poll: int = 50) -> None:
        self.pools: list[int] = []
        self.attached = False
        try:
            base, cpu, llama = load("ggml-base"), load("ggml-cpu"), load("llama")
            base.ggml_threadpool_params_default.restype = ThreadpoolParams
            base.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
            cpu.ggml_threadpool_new.restype = ctypes.c_void_p
            cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(ThreadpoolParams)]
            cpu.ggml_threadpool_free.restype = None
            cpu.ggml_threadpool_free.argtypes = [ctypes.c_void_p]
            llama.llama_attach_threadpool.restype = None
            llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        except (OSError, AttributeError):
            return
        self._free = cpu.ggml_threadpool_free
        for n in dict.fromkeys((n_threads, n_threads_batch)):  # (one pool when the counts agree)
            params = base.ggml_threadpool_params_default(max(1, int(n)))
            params.poll = poll
            pool = cpu.ggml_threadpool_new(ctypes.byref(params))
            if not pool:
                self.free()
                return
            self.pools.append(pool)
        batch = self.pools[-1] if len(self.pools) > 1 else None
        llama.llama_attach_threadpool(ctx, self.pools[0], batch)
        self.attached = True

    def free(self) -> None:
        """Free the pools; the context they were attached to must be freed already."""
        pools, self.pools = self.pools, []
        for pool in pools:
            self._free(pool)
