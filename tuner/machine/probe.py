"""What this machine has: CPU, RAM, GPUs (NVML), unified memory, and the llama.cpp build.

``probe()`` reads the real machine. Everything above this layer takes a ``Machine`` as an
argument, so tests inject one and never depend on the hardware they run on.

No NVML or no GPU is not an error: ``Machine.gpu_status`` says so and why.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

GiB = 1 << 30


@dataclass(frozen=True)
class GPUProcess:
    pid: int
    name: str
    used_memory: int | None  # bytes; None where the driver does not say


@dataclass(frozen=True)
class GPU:
    index: int
    name: str
    uuid: str
    memory_total: int  # bytes
    memory_free: int  # bytes, at probe time
    driver: str
    processes: tuple[GPUProcess, ...] = ()


@dataclass(frozen=True)
class LlamaBuild:
    llama_cpp_python: str | None = None
    llama_cpp_build: str | None = None  # build number / commit where the library exposes it
    gpu_offload: bool = False
    rpc: bool = False
    backends: tuple[str, ...] = ()
    system_info: str | None = None
    error: str | None = None  # why the build could not be read


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    physical_cores: int
    logical_cores: int
    ram_total: int
    ram_available: int
    gpus: tuple[GPU, ...] = ()
    gpu_status: str = "no GPU probe ran"
    unified_memory: bool = False
    system: str = ""
    arch: str = ""
    llama: LlamaBuild = field(default_factory=LlamaBuild)
    rpc_devices: tuple[dict, ...] = ()  # {"endpoint", "name", "memory_total", "memory_free"}

    # -- identity ------------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """Stable identity of this machine: changes when its hardware changes, not its load."""
        parts = {
            "cpu_model": self.cpu_model,
            "physical_cores": self.physical_cores,
            "logical_cores": self.logical_cores,
            "ram_gib": round(self.ram_total / GiB),
            "gpus": [[g.name, g.uuid, g.memory_total] for g in self.gpus],
            "unified_memory": self.unified_memory,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]

    def hardware_class(self) -> str:
        """Identity of the kind of machine: same GPU models and memory, wherever they are."""
        parts = {
            "gpus": sorted([g.name, g.memory_total] for g in self.gpus),
            "unified_memory": self.unified_memory,
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["fingerprint"] = self.fingerprint()
        out["hardware_class"] = self.hardware_class()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Machine":
        gpus = tuple(
            GPU(
                index=g["index"],
                name=g["name"],
                uuid=g.get("uuid", ""),
                memory_total=g["memory_total"],
                memory_free=g.get("memory_free", g["memory_total"]),
                driver=g.get("driver", ""),
                processes=tuple(GPUProcess(**p) for p in g.get("processes", ())),
            )
            for g in data.get("gpus", ())
        )
        llama = LlamaBuild(**{**data.get("llama", {}), "backends": tuple(data.get("llama", {}).get("backends", ()))})
        return cls(
            cpu_model=data.get("cpu_model", ""),
            physical_cores=data.get("physical_cores", 1),
            logical_cores=data.get("logical_cores", 1),
            ram_total=data.get("ram_total", 0),
            ram_available=data.get("ram_available", data.get("ram_total", 0)),
            gpus=gpus,
            gpu_status=data.get("gpu_status", ""),
            unified_memory=data.get("unified_memory", False),
            system=data.get("system", ""),
            arch=data.get("arch", ""),
            llama=llama,
            rpc_devices=tuple(data.get("rpc_devices", ())),
        )


# -- probing -----------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            return subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown CPU"


def probe_gpus() -> tuple[tuple[GPU, ...], str]:
    """GPUs through NVML. Returns (gpus, status) where status says what happened, in words."""
    try:
        import pynvml
    except ImportError:
        return (), "nvidia-ml-py is not installed: no NVIDIA GPU information"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return (), f"NVML unavailable ({exc}): no NVIDIA driver on this machine, so no NVIDIA GPU is visible"
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(
                GPU(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    memory_total=int(memory.total),
                    memory_free=int(memory.free),
                    driver=driver,
                    processes=_gpu_processes(pynvml, handle),
                )
            )
        status = f"NVML {driver}: {len(gpus)} GPU(s)" if gpus else f"NVML {driver}: the driver reports no GPU"
        return tuple(gpus), status
    except pynvml.NVMLError as exc:
        return (), f"NVML failed while listing GPUs ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _gpu_processes(pynvml: Any, handle: Any) -> tuple[GPUProcess, ...]:
    """Processes holding memory on this GPU: 'it worked yesterday' is usually one of these."""
    found: dict[int, GPUProcess] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            procs = getattr(pynvml, getter)(handle)
        except (pynvml.NVMLError, AttributeError):
            continue
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)
            found[proc.pid] = GPUProcess(pid=int(proc.pid), name=_process_name(proc.pid), used_memory=int(used) if used else None)
    return tuple(found.values())


def _process_name(pid: int) -> str:
    try:
        import psutil

        return " ".join(psutil.Process(pid).cmdline()) or psutil.Process(pid).name()
    except Exception:  # another user's process, or gone already
        return f"pid {pid}"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def detect_unified_memory(gpus: tuple[GPU, ...] = ()) -> bool:
    """Apple Silicon, or an AMD APU (its 'VRAM' is a small carve-out of system RAM)."""
    if sys.platform == "darwin" and platform.machine() == "arm64":
        return True
    for device in glob.glob("/sys/class/drm/card*/device"):
        try:
            with open(os.path.join(device, "vendor")) as handle:
                if handle.read().strip() != "0x1002":  # AMD
                    continue
            with open(os.path.join(device, "mem_info_vram_total")) as handle:
                vram = int(handle.read())
            with open(os.path.join(device, "mem_info_gtt_total")) as handle:
                gtt = int(handle.read())
        except (OSError, ValueError):
            continue
        # An APU reports a carve-out of a few GiB at most and a GTT window much larger.
        if vram <= 4 * GiB and gtt > 4 * vram:
            return True
    return False


_BUILD_SCRIPT = r"""
import json, sys
out = {}
try:
    import llama_cpp
    out["llama_cpp_python"] = getattr(llama_cpp, "__version__", None)
    out["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    out["rpc"] = bool(llama_cpp.llama_supports_rpc())
    info = llama_cpp.llama_print_system_info()
    out["system_info"] = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    backends = []
    import ctypes, os, glob, sysconfig
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for path in sorted(glob.glob(os.path.join(libdir, "libggml-*.so*")) + glob.glob(os.path.join(libdir, "ggml-*.dll")) + glob.glob(os.path.join(libdir, "libggml-*.dylib"))):
        name = os.path.basename(path).split(".")[0].replace("libggml-", "").replace("ggml-", "")
        if name not in ("base",) and name not in backends:
            backends.append(name)
    out["backends"] = backends
    # llama.cpp's own version (llama_version(), 2026) and, where llama.cpp's common library was
    # installed beside it, the commit and build number it was compiled from.
    version = origin = None
    try:
        lib = ctypes.CDLL(os.path.join(libdir, "libllama.so"))
        lib.llama_version.restype = ctypes.c_char_p
        version = lib.llama_version().decode()
    except (OSError, AttributeError):
        pass
    for common in (os.path.join(libdir, "libllama-common.so"), os.path.join(sysconfig.get_paths()["purelib"], "lib", "libllama-common.so")):
        if os.path.exists(common):
            try:
                c = ctypes.CDLL(common)
                commit = ctypes.c_char_p.in_dll(c, "LLAMA_COMMIT").value.decode()
                origin = f"commit {commit}, build {ctypes.c_int.in_dll(c, 'LLAMA_BUILD_NUMBER').value}"
            except (OSError, ValueError, AttributeError):
                pass
            break
    out["llama_cpp_build"] = " ".join(x for x in (version, f"({origin})" if origin else None) if x) or None
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def probe_llama_build(python: str | None = None, timeout: float = 60.0) -> LlamaBuild:
    """Read the llama.cpp build in a child process (only trial workers import llama_cpp here)."""
    try:
        proc = subprocess.run(
            [python or sys.executable, "-c", _BUILD_SCRIPT], capture_output=True, text=True, timeout=timeout
        )
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return LlamaBuild(error=f"could not read the llama.cpp build: {exc}")
    data["backends"] = tuple(data.get("backends", ()))
    return LlamaBuild(**{k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(LlamaBuild)}})


def probe(*, llama: bool = True, rpc_servers: tuple[str, ...] = ()) -> Machine:
    """Read this machine. ``llama=False`` skips the llama.cpp build check (a child process)."""
    import psutil

    gpus, status = probe_gpus()
    memory = psutil.virtual_memory()
    rpc_devices: tuple[dict, ...] = ()
    if rpc_servers:
        from ..engine.rpc import query_devices

        rpc_devices = tuple(query_devices(rpc_servers))
    return Machine(
        cpu_model=cpu_model(),
        physical_cores=psutil.cpu_count(logical=False) or psutil.cpu_count() or 1,
        logical_cores=psutil.cpu_count() or 1,
        ram_total=int(memory.total),
        ram_available=int(memory.available),
        gpus=gpus,
        gpu_status=status,
        unified_memory=detect_unified_memory(gpus),
        system=platform.system(),
        arch=platform.machine(),
        llama=probe_llama_build() if llama else LlamaBuild(),
        rpc_devices=rpc_devices,
    )
