"""What this machine has: CPU, RAM, the devices llama.cpp sees, GPUs (NVML), and the llama.cpp build.

``probe()`` reads the real machine. Everything above this layer takes a ``Machine`` as an
argument, so tests inject one and never depend on the hardware they run on.

Devices come from the engine that runs the trials (``tuner.engine``), with llama.cpp's own names,
types and memory (``Machine.devices``: CUDA0, ROCm0, Vulkan0, MTL0, SYCL0, RPC0[host:port]); a Metal,
ROCm, SYCL or Vulkan build is seen as it is. NVML only enriches NVIDIA devices: the processes holding
their memory (``Machine.gpus``) and the index the trial runner samples peak memory by.

No NVML or no GPU is not an error: ``Machine.gpu_status`` says so and why.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import TunerError

if TYPE_CHECKING:
    from ..model.repack import CpuFeatures

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
    pci_bus_id: str | None = None  # "0000:01:00.0": how llama.cpp's CUDA devices are matched to NVML's


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
    # llama.cpp's devices as the engine sees them (tuner.engine.devices.DeviceInfo.to_dict()), the
    # CPU included; empty when no engine was asked (probe(llama=False)) or in an injected Machine.
    devices: tuple[dict, ...] = ()
    engine: dict | None = None  # the engine's EngineBuild.to_dict(), where one was asked

    def cpu_features(self) -> "CpuFeatures | None":
        """The CPU backend's features as llama.cpp reports them (``llama_print_system_info``: AVX2,
        AMX_INT8, REPACK...); None when no llama.cpp was asked. They decide which weights llama.cpp
        repacks (``tuner.model.repack``)."""
        from ..model.repack import CpuFeatures

        return CpuFeatures.parse(self.llama.system_info)

    def accelerators(self) -> list[dict]:
        """The devices llama.cpp can offload to (GPUs, integrated GPUs, RPC servers), as it names them."""
        from ..engine.devices import DeviceInfo

        return [d for d in self.devices if DeviceInfo.from_dict(d).is_accelerator]

    # -- identity (tuner.machine.identity computes it; these are shorthands) ----------------------

    def fingerprint(self) -> str:
        """Stable identity of this machine: changes when its hardware changes, not its load."""
        from .identity import fingerprint

        return fingerprint(self)

    def hardware_class(self) -> str:
        """Identity of the kind of machine: same GPU models and memory, wherever they are."""
        from .identity import hardware_class

        return hardware_class(self)

    def used_accelerators(self) -> list[dict]:
        """The accelerators llama.cpp will offload to when not told, in its order (``tuner.machine.devices``)."""
        from .devices import used_devices

        by_name = {e.get("name"): e for e in self.devices}
        return [dict(by_name[d.name]) for d in used_devices(self.devices)]

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
                pci_bus_id=g.get("pci_bus_id"),
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
            devices=tuple(data.get("devices", ())),
            engine=data.get("engine"),
        )


# -- probing -----------------------------------------------------------------------------------


def cpu_model() -> str:
    from ..engine.recorded import recorded_machine

    recorded = recorded_machine()
    if recorded is not None and recorded.cpu().get("model"):  # a test seam
        return str(recorded.cpu()["model"])
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
    from ..engine.recorded import recorded_machine

    recorded = recorded_machine()
    if recorded is not None:  # a test seam: NVML as recorded (nvml.json), or no NVIDIA driver
        return _recorded_gpus(recorded)
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
                    pci_bus_id=_pci_bus_id(pynvml, handle),
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


def _pci_bus_id(pynvml: Any, handle: Any) -> str | None:
    from .devices import normalize_pci

    try:
        return normalize_pci(_text(pynvml.nvmlDeviceGetPciInfo(handle).busId))
    except (pynvml.NVMLError, AttributeError):
        return None


def _recorded_gpus(recorded: Any) -> tuple[tuple[GPU, ...], str]:
    from .devices import normalize_pci

    listed = recorded.nvml()
    if listed is None:
        return (), f"NVML unavailable (recorded machine {recorded.kind}): no NVIDIA driver on this machine, so no NVIDIA GPU is visible"
    gpus = tuple(GPU(index=i, name=str(g.get("name", "")), uuid=str(g.get("uuid", "")), memory_total=int(g.get("memory_total", 0)),
                     memory_free=int(g.get("memory_free", g.get("memory_total", 0))), driver="recorded",
                     pci_bus_id=normalize_pci(g.get("pci_bus_id"))) for i, g in enumerate(listed))
    return gpus, f"NVML (recorded machine {recorded.kind}): {len(gpus)} GPU(s)"


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


def probe_llama_build(python: str | None = None, timeout: float = 60.0) -> LlamaBuild:
    """Read llama-cpp-python's llama.cpp build in a child process (only trial workers import llama_cpp here)."""
    from ..engine.python import read_build

    return _llama_build(read_build(python, timeout))


def _llama_build(data: dict[str, Any]) -> LlamaBuild:
    if data.get("error") and not data.get("llama_cpp_python"):
        return LlamaBuild(error=data["error"])
    number, commit, version = data.get("build_number"), data.get("commit"), data.get("version")
    origin = f"commit {commit}, build {number}" if commit and number is not None else None
    build = " ".join(x for x in (version, f"({origin})" if origin else None) if x) or None
    return LlamaBuild(llama_cpp_python=data.get("llama_cpp_python"), llama_cpp_build=build,
                      gpu_offload=bool(data.get("gpu_offload")), rpc=bool(data.get("rpc")),
                      backends=tuple(data.get("backends", ())), system_info=data.get("system_info"),
                      error=data.get("error"))


def build_of_engine(build: Any, devices: list[Any]) -> LlamaBuild:
    """The ``LlamaBuild`` of the user's llama.cpp binaries (``llama-cpp`` engine): what profiles record
    in ``llama_build`` for a build that is not llama-cpp-python's."""
    names = [b.lower() for b in build.backends] + [d.backend.lower() for d in devices if d.backend]
    backends = tuple(dict.fromkeys(["cpu", *names]))
    return LlamaBuild(llama_cpp_python=None, llama_cpp_build=build.describe(),
                      gpu_offload=any(b not in ("cpu", "rpc", "blas") for b in backends),
                      rpc="rpc" in backends, backends=backends, system_info=build.detail, error=build.error)


def _enrich_with_nvml(devices: list[Any], gpus: tuple[GPU, ...]) -> list[dict]:
    """Each device llama.cpp lists, with the NVML index of the same GPU where they pair for sure (by PCI bus
    id, or CUDA's order: ``tuner.machine.devices.match_nvml``): NVML then says who holds its memory, its
    free memory now, and samples its peak use."""
    from .devices import match_nvml

    paired = match_nvml(devices, gpus)
    out = []
    for device in devices:
        entry = device.to_dict()
        if device.name in paired:
            entry["nvml_index"] = paired[device.name]
        out.append(entry)
    return out


def probe(*, llama: bool = True, rpc_servers: tuple[str, ...] = (), engine: Any = None) -> Machine:
    """Read this machine. ``llama=False`` skips asking llama.cpp (a child process) for its build and
    devices; ``engine`` (a ``tuner.engine.base.Engine``) asks that engine instead of llama-cpp-python."""
    import psutil

    gpus, status = probe_gpus()
    memory = psutil.virtual_memory()
    rpc_devices: tuple[dict, ...] = ()
    devices: list[Any] = []
    engine_build: dict | None = None
    build = LlamaBuild()
    if engine is not None or llama:
        if engine is None:
            from ..engine.python import TrialRunner

            engine = TrialRunner()
            owned = True
        else:
            owned = False
        try:
            devices = list(engine.devices(()))
            rpc_list = []
            for endpoint in rpc_servers:
                # one server at a time, so one that does not answer is named and the others still listed
                try:
                    found = [d for d in engine.devices((endpoint,)) if d.rpc_endpoint == endpoint]
                except TunerError as exc:
                    rpc_list.append({"endpoint": endpoint, "error": getattr(exc, "reason", None) or str(exc)})
                    continue
                # ggml numbers RPC devices across servers in the order --rpc registers them (RPC0, RPC1...)
                n_rpc = sum(1 for d in devices if d.rpc_endpoint)
                found = [dataclasses.replace(d, ggml_name=f"RPC{n_rpc + k}") for k, d in enumerate(found)]
                devices += found
                rpc_list += [{"endpoint": d.rpc_endpoint, "name": d.name, "description": d.description,
                              "memory_free": d.memory_free, "memory_total": d.memory_total} for d in found]
                if not found:
                    rpc_list.append({"endpoint": endpoint, "error": "no device reported"})
            rpc_devices = tuple(rpc_list)
            eb = engine.build()
            _remember_devices(engine, [d for d in devices if not d.rpc_endpoint])
            if engine.name == "python":
                build = _llama_build(engine._probe())
            else:
                build = build_of_engine(eb, devices)
            engine_build = eb.to_dict()
        finally:
            if owned:
                engine.close()
    elif rpc_servers:
        from ..engine.rpc import query_devices

        rpc_devices = tuple(query_devices(rpc_servers))
    from ..engine.recorded import recorded_machine

    recorded = recorded_machine()
    cpu = recorded.cpu() if recorded is not None else {}  # a test seam: the recorded machine's CPU and RAM
    ram_total = int(cpu.get("ram_total") or memory.total)
    machine = Machine(
        cpu_model=cpu_model(),
        physical_cores=cpu.get("physical_cores") or psutil.cpu_count(logical=False) or psutil.cpu_count() or 1,
        logical_cores=cpu.get("logical_cores") or psutil.cpu_count() or 1,
        ram_total=ram_total,
        ram_available=min(int(memory.available), ram_total),
        gpus=gpus,
        gpu_status=status,
        system=(recorded.platform() if recorded is not None else None) or platform.system(),
        arch=(platform.machine() if recorded is None or recorded.platform() != "Darwin"
              else "arm64" if "Apple" in cpu_model() else "x86_64"),
        llama=build,
        rpc_devices=rpc_devices,
        engine=engine_build,
        unified_memory=detect_unified_memory(gpus),
    )
    return with_devices(machine, devices)


def app_machine(llama_bin: Any = None) -> Machine:
    """This machine as the llama.cpp an app runs sees it (``llama_bin``: the binaries' folder; by default
    llama-cpp-python), without paying llama.cpp's start-up more than once per boot: its devices come from
    ``tuner.machine.devices.app_devices`` (cached in the data folder per boot, build and device
    environment); NVML, the CPU and RAM are read now. The identity (``tuner.machine.identity``) is the
    one the tuner computed. ``tuner.profile.apps.this_machine`` is this."""
    from importlib.metadata import PackageNotFoundError, version

    from ..engine.devices import DeviceInfo
    from .devices import app_devices

    machine = probe(llama=False)
    found = app_devices(llama_bin)
    machine = with_devices(machine, [DeviceInfo.from_dict(d) for d in found.get("devices", [])])
    if found.get("error"):
        machine = dataclasses.replace(machine, gpu_status=f"{machine.gpu_status}; llama.cpp's devices could not be read "
                                                          f"({found['source']}: {found['error']})")
    if llama_bin is not None:
        return machine
    try:
        return dataclasses.replace(machine, llama=LlamaBuild(llama_cpp_python=version("llama_cpp_python")))
    except PackageNotFoundError:
        return machine


def _remember_devices(engine: Any, devices: list[Any]) -> None:
    """The devices a tune's probe found, in this boot's device cache (``tuner.machine.devices``), so the
    app that loads its profile need not start llama.cpp to see them."""
    from .devices import cache_key, store_devices

    if engine.name == "python" and getattr(engine, "env", os.environ) == dict(os.environ):
        key = cache_key(None)
    elif engine.name == "llama-cpp" and getattr(engine, "binaries", None) is not None:
        key = cache_key(engine.binaries.folder)
    else:
        return  # a simulated or scripted engine: not this machine's llama.cpp
    store_devices({"devices": [d.to_dict() for d in devices], "source": f"the {engine.name} engine's probe"}, key)


def with_devices(machine: Machine, devices: list[Any]) -> Machine:
    """``machine`` with llama.cpp's devices (``DeviceInfo``s, NVML-enriched). The machine is a
    unified-memory one when every local device llama.cpp will use shares the host's RAM
    (``tuner.machine.identity.unified``): an iGPU beside a discrete GPU does not make it one."""
    from .identity import unified

    if not devices:
        return machine
    out = dataclasses.replace(machine, devices=tuple(_enrich_with_nvml(devices, machine.gpus)))
    return dataclasses.replace(out, unified_memory=unified(out))
