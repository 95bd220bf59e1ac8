"""Devices as llama.cpp sees them: names, types and memory, from whichever llama.cpp runs the trials.

Every engine reports its devices as ``DeviceInfo``: the name llama.cpp gives the memory placed on the
device (``CUDA0``, ``ROCm0``, ``Vulkan0``, ``MTL0``, ``SYCL0``, ``RPC0[10.0.0.2:50052]``: the label its
load log prints for the device's buffers, which is what the memory arithmetic and profiles key on),
its description, its ggml type (``cpu``, ``gpu``, ``igpu``, ``accel``), its free and total memory in
bytes, and whether it shares the host's RAM (an integrated GPU, Apple silicon).

Three sources, one shape:

- ``ggml_backend_dev_*`` through ctypes (the python engine; ``tuner.engine.ggml.list_devices``),
  where llama.cpp says the type itself (``GGML_BACKEND_DEVICE_TYPE_IGPU``);
- ``--list-devices`` of the user's binaries (``parse_list_devices``), which prints name, description
  and memory but not the type: integrated GPUs and unified memory are read from what the backends
  print on the same run (Vulkan's ``uma: 1``, Metal's ``has unified memory = true``, a ROCm APU's gfx
  target);
- a load log's ``using device`` lines (``devices_from_log``), for logs users paste.

NVML is not a source of devices here: it only enriches NVIDIA ones (``tuner.machine.probe``).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping

MiB = 1 << 20

DEVICE_TYPES = ("cpu", "gpu", "igpu", "accel")

# The backend of a device, from its name's prefix (ggml's device names, 2024-2026).
_BACKENDS = (
    ("CUDA", "CUDA"), ("ROCm", "ROCm"), ("HIP", "ROCm"), ("Vulkan", "Vulkan"), ("MTL", "Metal"),
    ("Metal", "Metal"), ("SYCL", "SYCL"), ("RPC", "RPC"), ("OpenCL", "OpenCL"), ("CANN", "CANN"),
    ("MUSA", "MUSA"), ("BLAS", "BLAS"), ("CPU", "CPU"), ("WebGPU", "WebGPU"), ("zDNN", "zDNN"),
)

# AMD APUs by gfx target (ROCm's "Device 0: AMD Radeon(TM) Graphics, gfx1151 (0x1151)" line):
# their "VRAM" is system RAM. From AMD's LLVM processor table: Strix Halo/Point, Phoenix/Hawk Point,
# Rembrandt, Van Gogh, Raphael/Granite Ridge iGPUs, Renoir/Cezanne/Picasso/Raven.
_APU_GFX = {"gfx1150", "gfx1151", "gfx1152", "gfx1153", "gfx1103", "gfx1035", "gfx1036", "gfx1033", "gfx1037",
            "gfx90c", "gfx902", "gfx909", "gfx1013"}


@dataclass(frozen=True)
class DeviceInfo:
    """One device of a llama.cpp build, as that build reports it."""

    name: str  # the label llama.cpp puts on the device's buffers: CUDA0, Vulkan0, MTL0, RPC0[host:port]
    description: str
    type: str  # ggml's device type: cpu, gpu, igpu (integrated), accel (BLAS and the like: no memory of its own)
    memory_free: int | None  # bytes; None where the source does not say
    memory_total: int | None
    backend: str = ""  # CUDA, ROCm, Vulkan, Metal, SYCL, RPC, BLAS, CPU ...
    unified_memory: bool = False  # shares the host's RAM: an integrated GPU, Apple silicon
    ggml_name: str = ""  # ggml's own device name where it differs (RPC0 for RPC0[host:port]): what -dev takes
    rpc_endpoint: str | None = None
    # ggml_backend_dev_props.device_id: the PCI bus id "domain:bus:device.function" (lower case) where the
    # backend gives one (CUDA, ROCm, Vulkan with VK_EXT_pci_bus_info; 2025-2026); None otherwise
    pci_bus_id: str | None = None

    @property
    def is_accelerator(self) -> bool:
        """A device llama.cpp can offload layers to (a GPU, an integrated GPU, an RPC server)."""
        return self.type in ("gpu", "igpu") and (self.memory_total is None or self.memory_total > 0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DeviceInfo":
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)

    def describe(self) -> str:
        memory = ""
        if self.memory_total is not None:
            free = f", {self.memory_free / MiB:.0f} MiB free" if self.memory_free is not None else ""
            memory = f" ({self.memory_total / MiB:.0f} MiB{free})"
        flags = [f for f, on in (("integrated", self.type == "igpu"), ("unified memory", self.unified_memory)) if on]
        return f"{self.name}: {self.description}{memory}" + (f" [{', '.join(flags)}]" if flags else "")


def backend_of(name: str) -> str:
    for prefix, backend in _BACKENDS:
        if name.startswith(prefix):
            return backend
    return re.sub(r"\d+$", "", name) or name


def rpc_label(index_in_server: int, endpoint: str) -> str:
    """The buffer label of an RPC server's device (ggml-rpc ``ggml_backend_rpc_buffer_type``: ``"RPC" +
    device + "[" + endpoint + "]"``, 2025-2026): what load logs and the memory arithmetic call it."""
    return f"RPC{index_in_server}[{endpoint}]"


# -- --list-devices ------------------------------------------------------------------------------

# common/arg.cpp common_print_available_devices (2024-11 onward; llama-bench --list-devices since
# 2025-09 calls the same function): printf("  %s: %s (%zu MiB, %zu MiB free)\n", name, description,
# total / MiB, free / MiB). Descriptions carry their own parentheses ("Intel(R) Arc(TM)", "(RADV
# NAVI33)"), so the memory group is anchored at the end of the line. A 2025-01 build named RPC
# devices "RPC[host:port]", whose ':' the name group allows inside brackets.
_LIST_LINE = re.compile(r"^\s+(?P<name>[A-Za-z][\w.-]*(?:\[[^\]]*\])?): (?P<desc>.*?) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$")
# ggml-vulkan ggml_vk_print_gpu_info, 2025-2026: "ggml_vulkan: %zu = %s (%s) | uma: %d | fp16: ...";
# 2024: "Vulkan%d: %s (%s) | uma: %d | fp16: ...". uma 1 = the GPU uses system memory (an iGPU).
_VULKAN_UMA = re.compile(r"^(?:ggml_vulkan: (?P<i>\d+) =|Vulkan(?P<j>\d+):) .*\|\s*uma:\s*(?P<uma>[01])\b")
# ggml-metal: "ggml_metal_device_init: has unified memory    = true" (2025-2026);
# "ggml_metal_init: hasUnifiedMemory              = true" (2023-2024).
_METAL_UNIFIED = re.compile(r"(?:has unified memory|hasUnifiedMemory)\s*=\s*(?P<v>true|false)")
# ggml-cuda built for HIP (2025-2026): "  Device %d: %s, %s (0x%x), VMM: %s, Wave Size: %d" with the
# gfx target as the second field.
_ROCM_DEVICE = re.compile(r"^\s+Device (?P<i>\d+): .*?, (?P<gfx>gfx[0-9a-f]+)\b")


# Intel's integrated GPUs by name (UHD, Iris Xe, and the Arc of Meteor/Lunar/Arrow Lake, which has no
# model number): what ggml-sycl reports as GGML_BACKEND_DEVICE_TYPE_IGPU, 2026.
_INTEL_IGPU = re.compile(r"Intel\(R\) (?:UHD|Iris|HD)\b|Intel\(R\) Arc\(TM\) (?:\d+V\b|Graphics\b)|Intel\(R\) Graphics\b")


def parse_list_devices(text: str) -> list[DeviceInfo]:
    """The devices in a ``--list-devices`` run's output (stdout and stderr together, in any order).

    The ``Available devices:`` block gives name, description and memory; the backends' own start-up
    lines on the same run say which devices are integrated or share the host's memory. RPC devices
    get the label their buffers carry (``RPC0[host:port]``, ``RPC0`` being ggml's device name).
    """
    uma: dict[str, bool] = {}
    metal_unified: bool | None = None
    apu: set[str] = set()
    entries: list[tuple[str, str, int, int]] = []
    in_block = False
    for raw in text.splitlines():
        line = raw.rstrip("\r")
        m = _VULKAN_UMA.search(line)
        if m:
            uma[f"Vulkan{m['i'] or m['j']}"] = m["uma"] == "1"
        m = _METAL_UNIFIED.search(line)
        if m:
            metal_unified = m["v"] == "true"
        m = _ROCM_DEVICE.match(line)
        if m and m["gfx"] in _APU_GFX:
            apu.add(f"ROCm{m['i']}")
        if line.startswith("Available devices:"):
            in_block = True
            continue
        if in_block:
            m = _LIST_LINE.match(line)
            if m:
                entries.append((m["name"], m["desc"].strip(), int(m["total"]) * MiB, int(m["free"]) * MiB))
    out: list[DeviceInfo] = []
    per_endpoint: dict[str, int] = {}
    for name, desc, total, free in entries:
        backend = backend_of(name)
        kind = "gpu"
        unified = False
        ggml_name = ""
        endpoint = None
        label = name
        if backend == "CPU":
            kind = "cpu"
        elif total == 0 or backend == "BLAS":
            kind = "accel"  # BLAS (Accelerate, OpenBLAS...) computes on the CPU: no memory to offload to
        elif backend == "RPC":
            endpoint = _rpc_endpoint(name, desc)
            if endpoint and re.fullmatch(r"RPC\d+", name):
                # ggml numbers RPC devices across servers (RPC0, RPC1, ...); buffers are named by
                # the device's index within its server.
                index = per_endpoint.get(endpoint, 0)
                per_endpoint[endpoint] = index + 1
                label, ggml_name = rpc_label(index, endpoint), name
        elif backend == "Metal":
            # Metal devices on Apple silicon share the RAM; the backend says so when it starts.
            unified = metal_unified if metal_unified is not None else True
        elif backend == "Vulkan" and uma.get(name):
            kind, unified = "igpu", True
        elif name in apu:
            kind, unified = "igpu", True
        elif backend == "SYCL" and _INTEL_IGPU.search(desc):
            # --list-devices does not print the type ggml-sycl gives an integrated GPU (Level Zero's
            # "not discrete"): Intel's integrated GPUs are known by their names
            kind, unified = "igpu", True
        out.append(DeviceInfo(label, desc, kind, free, total, backend, unified, ggml_name, endpoint))
    return out


def _rpc_endpoint(name: str, desc: str) -> str | None:
    m = re.fullmatch(r"RPC\[(?P<ep>[^\]]+)\]", name)
    if m:
        return m["ep"]
    return desc if re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", desc) else None


# -- load logs -----------------------------------------------------------------------------------

# src/llama.cpp llama_model_load_from_file_impl: "%s: using device %s (%s) - %zu MiB free\n"
# (2024-12 to 2025), and with the PCI bus id "%s: using device %s (%s) (%s) - %zu MiB free\n" (2025-2026).
_USING_DEVICE = re.compile(r"using device (?P<name>\S+) \((?P<desc>.*)\)(?: \((?P<pci>[^)]*)\))? - (?P<free>\d+) MiB free")


def devices_from_log(text: str) -> list[DeviceInfo]:
    """Accelerators a load log says it used (free memory only: the log has no totals)."""
    uma = {f"Vulkan{m['i'] or m['j']}": m["uma"] == "1" for m in map(_VULKAN_UMA.search, text.splitlines()) if m}
    out: dict[str, DeviceInfo] = {}
    for m in _USING_DEVICE.finditer(text):
        name = m["name"]
        backend = backend_of(name)
        integrated = bool(uma.get(name))
        unified = integrated or backend == "Metal"
        pci = m["pci"] if m["pci"] and m["pci"] != "unknown id" else None
        out[name] = DeviceInfo(name, m["desc"], "igpu" if integrated else "gpu", int(m["free"]) * MiB, None, backend,
                               unified, pci_bus_id=pci)
    return list(out.values())


def accelerators(devices: Iterable[DeviceInfo]) -> list[DeviceInfo]:
    return [d for d in devices if d.is_accelerator]


__all__ = ["DeviceInfo", "DEVICE_TYPES", "parse_list_devices", "devices_from_log", "backend_of", "rpc_label",
           "accelerators"]
