"""The devices llama.cpp will use, in its order; NVML's GPUs matched to them; the per-boot device cache.

``used_devices`` applies the selection llama.cpp makes when it is not told which devices to use
(``src/llama.cpp`` ``llama_model_load_from_file_impl``, "default device selection", as vendored by
llama-cpp-python 0.3.36):

- CPU and ACCEL devices (BLAS) are never offload targets;
- RPC servers go first ("to minimize network transfers");
- GPUs follow in registry order; a GPU whose PCI bus id (``ggml_backend_dev_props.device_id``) an
  earlier GPU already has is dropped (one card listed by two backends, CUDA and Vulkan);
- integrated GPUs only when no discrete GPU was found (RPC servers do not count), and of those the
  first and the others of the same backend.

``match_nvml`` pairs NVML's GPUs with llama.cpp's CUDA devices by PCI bus id where llama.cpp gives one;
otherwise by CUDA's own order (``CUDA_DEVICE_ORDER=PCI_BUS_ID`` with ``CUDA_VISIBLE_DEVICES``), or by
exact name where the name is unique: never by a name substring ("RTX 3060" is not "RTX 3060 Ti").

``app_devices`` is what an app loading a profile asks: llama.cpp's devices, read once per boot in a
child process and cached in the data folder (``devices/<key>.json``; the key is the boot id, the
llama.cpp build's files and the environment variables that change which devices a backend shows).
A new boot, another build or another ``CUDA_VISIBLE_DEVICES`` is another key; files of other boots are
removed when a new one is written. Free memory in the cache is as of that probe: apps that load the
model (``tuner.Llama``) ask llama.cpp again in their own process, where it costs nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

# Environment variables that change which devices a backend shows, or their order.
DEVICE_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES",
              "GPU_DEVICE_ORDINAL", "GGML_VK_VISIBLE_DEVICES", "ONEAPI_DEVICE_SELECTOR", "ZE_AFFINITY_MASK",
              "GGML_CUDA_ENABLE_UNIFIED_MEMORY", "OFFLOAD_TUNER_TEST_MACHINE")
CACHE_VERSION = 1


_DRIVER_SUFFIX = re.compile(r"\s*\((?:RADV|LLVM|NVIDIA|AMD|Intel|Mesa|MoltenVK|NVK|ANV|Microsoft|Qualcomm|Turnip)[^()]*\)\s*$",
                            re.IGNORECASE)


def device_model(description: str) -> str:
    """A device's model from llama.cpp's description: the driver's suffix in parentheses (``(RADV NAVI31)``,
    ``(LLVM 15.0.6, 256 bits)``) and extra spaces removed, so a CUDA and a Vulkan build of a card agree."""
    text = " ".join(str(description or "").split())
    while True:
        trimmed = _DRIVER_SUFFIX.sub("", text)
        if trimmed == text:
            return text
        text = trimmed


def _info(d: Any) -> Any:
    from ..engine.devices import DeviceInfo

    return d if isinstance(d, DeviceInfo) else DeviceInfo.from_dict(d)


def used_devices(devices: Iterable[Any]) -> list[Any]:
    """The devices llama.cpp offloads to when not told, in its order (``DeviceInfo``s or their dicts in,
    ``DeviceInfo``s out)."""
    rpc, gpus, igpus = [], [], []
    for d in map(_info, devices):
        if d.type in ("cpu", "accel") or not d.is_accelerator:
            continue
        if d.rpc_endpoint or d.backend == "RPC":
            rpc.append(d)
        elif d.type == "gpu":
            if d.pci_bus_id and any(g.pci_bus_id == d.pci_bus_id for g in gpus):
                continue
            gpus.append(d)
        elif d.type == "igpu":
            if not igpus or igpus[-1].backend == d.backend:
                igpus.append(d)
    return rpc + gpus + (igpus if not gpus else [])


def dropped_devices(devices: Iterable[Any]) -> list[tuple[Any, str]]:
    """The accelerators llama.cpp lists but will not use unless told, each with why, in words."""
    listed = [_info(d) for d in devices]
    used = {d.name for d in used_devices(listed)}
    has_gpu = any(d.type == "gpu" and not d.rpc_endpoint and d.backend != "RPC" for d in listed)
    out = []
    for d in listed:
        if not d.is_accelerator or d.name in used:
            continue
        if d.type == "igpu" and has_gpu:
            why = "an integrated GPU: llama.cpp uses one only when there is no other GPU"
        elif d.pci_bus_id:
            why = f"the same card ({d.pci_bus_id}) as a device listed before it, by another backend"
        else:
            why = "an integrated GPU of another backend than the first one llama.cpp listed"
        out.append((d, why))
    return out


# -- NVML -----------------------------------------------------------------------------------------


def normalize_pci(bus_id: str | None) -> str | None:
    """``'00000000:01:00.0'`` (NVML) and ``'0000:01:00.0'`` (CUDA, lower case) -> ``'0000:01:00.0'``."""
    if not bus_id:
        return None
    m = re.fullmatch(r"\s*([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])(-v\d+)?\s*", str(bus_id))
    if not m:
        return str(bus_id).strip().lower() or None
    return f"{int(m[1], 16):04x}:{int(m[2], 16):02x}:{int(m[3], 16):02x}.{m[4]}"


def match_nvml(devices: Sequence[Any], gpus: Sequence[Any], env: Mapping[str, str] | None = None) -> dict[str, int]:
    """llama.cpp device name -> NVML index, for the NVIDIA devices that can be paired for sure.

    By PCI bus id where llama.cpp gives one. Otherwise, for CUDA devices: with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` CUDA counts in NVML's (PCI) order, through ``CUDA_VISIBLE_DEVICES``
    where it lists indices; else by exact name where one NVML GPU has it, and cards of one model in
    PCI order when all are visible (CUDA breaks ties between equal cards by PCI bus)."""
    env = os.environ if env is None else env
    infos = [_info(d) for d in devices]
    out: dict[str, int] = {}
    by_pci = {normalize_pci(getattr(g, "pci_bus_id", None)): g.index for g in gpus if getattr(g, "pci_bus_id", None)}
    for d in infos:
        if d.rpc_endpoint or not d.pci_bus_id:
            continue
        index = by_pci.get(normalize_pci(d.pci_bus_id.split("-v")[0]))
        if index is not None:
            out[d.name] = index
    unpaired = [d for d in infos if d.backend in ("CUDA", "Vulkan", "OpenCL") and d.name not in out and not d.pci_bus_id]
    cuda = [d for d in unpaired if d.backend == "CUDA"]
    if not unpaired:
        return out
    taken = set(out.values())
    visible = env.get("CUDA_VISIBLE_DEVICES")
    order = [g.index for g in sorted(gpus, key=lambda g: normalize_pci(getattr(g, "pci_bus_id", None)) or f"{g.index:08d}")]
    if env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        if visible is None:
            chosen = order
        elif re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", visible):
            chosen = [order[int(i)] for i in visible.split(",") if int(i) < len(order)]
        else:
            chosen = []  # UUIDs or MIG names: left to the name match below
        for d in cuda:
            m = re.fullmatch(r"CUDA(\d+)", d.name)
            if m and int(m[1]) < len(chosen) and chosen[int(m[1])] not in taken:
                out[d.name] = chosen[int(m[1])]
                taken.add(chosen[int(m[1])])
    names: dict[str, list[int]] = {}
    for g in gpus:
        if g.index not in taken:
            names.setdefault(device_model(g.name), []).append(g.index)
    for backend in ("CUDA", "Vulkan", "OpenCL"):
        same: dict[str, list[Any]] = {}
        for d in unpaired:
            if d.backend == backend and d.name not in out:
                same.setdefault(device_model(d.description), []).append(d)
        _pair_by_name(same, names, order, out, ordered=visible is None or backend != "CUDA")
    return out


def _pair_by_name(same: Mapping[str, list[Any]], names: Mapping[str, list[int]], order: list[int], out: dict[str, int],
                  ordered: bool) -> None:
    """Devices and NVML GPUs of one model: one and one pair; several of each pair in PCI order when
    the backend lists them in it (``ordered``: CUDA without CUDA_VISIBLE_DEVICES breaks ties by PCI bus)."""
    for model, group in same.items():
        candidates = [i for i in names.get(model, []) if i not in out.values()]
        if len(candidates) == 1 and len(group) == 1:
            out[group[0].name] = candidates[0]
        elif len(candidates) == len(group) > 1 and ordered:
            for d, index in zip(group, sorted(candidates, key=order.index)):
                out[d.name] = index


# -- the per-boot cache ----------------------------------------------------------------------------


def boot_id() -> str:
    """This boot's id: Linux's ``/proc/sys/kernel/random/boot_id``, macOS's ``kern.boottime``; else the
    boot time psutil gives."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        pass
    try:
        import psutil

        return f"boot-{int(psutil.boot_time())}"
    except Exception:  # pragma: no cover - psutil is a dependency
        return "unknown-boot"


def _build_key(llama_bin: str | os.PathLike[str] | None) -> str:
    """The llama.cpp build's identity for the cache: its files' paths, sizes and times."""
    if llama_bin is not None:
        folder = Path(llama_bin)
        files = sorted(folder.glob("llama-*")) + sorted(folder.glob("lib*"))
    else:
        import importlib.util

        spec = importlib.util.find_spec("llama_cpp")
        folder = Path(spec.origin).parent / "lib" if spec and spec.origin else Path("-")
        files = sorted(folder.glob("*")) if folder.is_dir() else []
    parts = [str(folder)]
    for f in files[:64]:
        try:
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{int(st.st_mtime)}")
        except OSError:
            continue
    return "|".join(parts)


def cache_key(llama_bin: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    raw = json.dumps([CACHE_VERSION, boot_id(), _build_key(llama_bin), {k: env.get(k) for k in DEVICE_ENV}])
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


def cache_dir() -> Path:
    from ..paths import data_dir

    return data_dir() / "devices"


def app_devices(llama_bin: str | os.PathLike[str] | None = None, *, refresh: bool = False) -> dict[str, Any]:
    """llama.cpp's devices for an app: ``{"devices": [DeviceInfo dicts], "probed_at": epoch seconds,
    "source": words, "cached": bool, "error": words or absent}``; probed once per boot and build (see
    the module's docstring), in a child process (the app does not import llama_cpp for this)."""
    key = cache_key(llama_bin)
    folder = cache_dir()
    path = folder / f"{key}.json"
    if not refresh:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("devices"), list):
                return {**data, "cached": True}
        except (OSError, ValueError):
            pass
    data = _probe_devices(llama_bin)
    data["probed_at"] = time.time()
    if not data.get("error"):
        store_devices(data, key)
    return {**data, "cached": False}


def store_devices(data: Mapping[str, Any], key: str | None = None) -> None:
    """Write a device probe to this boot's cache (the tuner does, so the app that loads its profile
    need not start llama.cpp); files of other keys older than this boot are removed."""
    from ..paths import atomic_write_text

    key = key or cache_key()
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / f"{key}.json", json.dumps({k: v for k, v in data.items() if k != "cached"}))
        boot = _boot_started()
        for old in folder.glob("*.json"):
            if old.name != f"{key}.json" and boot and old.stat().st_mtime < boot:
                old.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only data folder: the next app probes again


def _boot_started() -> float | None:
    try:
        import psutil

        return float(psutil.boot_time())
    except Exception:  # pragma: no cover
        return None


def _probe_devices(llama_bin: str | os.PathLike[str] | None) -> dict[str, Any]:
    if llama_bin is not None:
        from ..engine.llamacpp import LlamaCppEngine
        from ..errors import TunerError

        try:
            engine = LlamaCppEngine(llama_bin)
            try:
                return {"devices": [d.to_dict() for d in engine.devices(())], "source": f"--list-devices of {llama_bin}"}
            finally:
                engine.close()
        except TunerError as exc:
            return {"devices": [], "source": f"--list-devices of {llama_bin}", "error": str(exc)}
    from ..engine.python import read_build

    data = read_build(sys.executable)
    if data.get("error") and not data.get("devices"):
        return {"devices": [], "source": "llama-cpp-python", "error": data["error"]}
    return {"devices": data.get("devices", []), "source": f"llama-cpp-python {data.get('llama_cpp_python') or ''}".strip(),
            "llama_cpp_python": data.get("llama_cpp_python"), "build": data.get("version")}


__all__ = ["device_model", "used_devices", "dropped_devices", "match_nvml", "normalize_pci", "app_devices", "store_devices", "cache_key",
           "boot_id", "DEVICE_ENV"]
