"""``offload-tuner doctor``: what is wrong with this set-up, and the exact fix.

    checks = run_checks(llama_bin=None)          # [Check(name, status, found, fix), ...]
    {"checks": [c.to_dict() for c in checks]}    # what ``doctor --json`` prints

Each check says ``ok``, ``warning`` or ``problem``, what it found, and the fix (a command to run, a
flag, an environment variable; empty when there is nothing to do). ``doctor`` exits 1 when any
check is a problem.

The checks, each a function of the facts it reads, so a test injects a fact at the lowest seam (a
recorded ``/sys/class/drm`` tree, NVML's GPUs, llama.cpp's device list, a disk's free bytes) and the
real check runs on it:

=================  =================================================================================
check              what it compares
=================  =================================================================================
``gpus``           the GPUs the OS has (NVML, ``/sys/class/drm`` vendor ids, ``rocm-smi``, macOS
                   ``sysctl``) against the devices llama-cpp-python's llama.cpp lists: a GPU and no
                   GPU device is a CPU-only build (the ``CMAKE_ARGS=... pip install --no-cache-dir
                   --force-reinstall`` line for that GPU), a GPU build that lists none a driver or a
                   ``CUDA_VISIBLE_DEVICES`` hiding it
``build``          GPU offload and RPC support of that build
``cuda``           the driver's CUDA version (NVML) against the CUDA runtime the build links
``repack``         the CPU features llama.cpp reports (``AMX_INT8``, ``REPACK``) and a short real decode
                   of a tiny Q4_0 model in a child process, with weight repacking on
``gpu_memory``     memory of each NVIDIA GPU held by other processes (NVML)
``data_folder``    the data folder is writable, and its disk's free space
``storage``        the study database opens (the default SQLite file, or ``--storage URL``)
``registry``       the profile registry (``OFFLOAD_TUNER_REGISTRY``) answers; passwords never shown
``llama_bin``      the user's llama.cpp binaries (``--llama-bin`` or PATH): their build and devices
``profiles``       this machine's profiles made with another llama.cpp build or engine than the one
                   installed now (``tuner.profile.apps``' own check, the one apps run at load)
=================  =================================================================================

``OFFLOAD_TUNER_DRM_DIR`` replaces ``/sys/class/drm`` (tests give a recorded tree).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

OK, WARNING, PROBLEM = "ok", "warning", "problem"
STATUSES = (OK, WARNING, PROBLEM)
MiB = 1 << 20
GiB = 1 << 30

ENV_DRM_DIR = "OFFLOAD_TUNER_DRM_DIR"
DRM_DIR = "/sys/class/drm"
# PCI vendor ids of GPUs llama.cpp has a backend for. A server's BMC display (ASPEED 0x1a03) and a
# virtual machine's display adapter (virtio 0x1af4, QEMU 0x1234, VMware 0x15ad) are not GPUs to offload to.
VENDOR_IDS = {"0x10de": "nvidia", "0x1002": "amd", "0x8086": "intel"}
VENDOR_NAMES = {"nvidia": "NVIDIA", "amd": "AMD", "intel": "Intel", "apple": "Apple"}
# The backend that serves each vendor's GPU, as CMAKE_ARGS turns it on (README, "Building
# llama-cpp-python for your hardware"), and the llama.cpp backends that can see that GPU.
CMAKE_FLAG = {"nvidia": "-DGGML_CUDA=on", "amd": "-DGGML_HIP=on", "intel": "-DGGML_VULKAN=on", "apple": "-DGGML_METAL=on"}
SERVES = {"nvidia": ("CUDA", "Vulkan"), "amd": ("ROCm", "HIP", "Vulkan"), "intel": ("SYCL", "Vulkan", "OpenCL"),
          "apple": ("Metal", "MTL")}
# Free disk below which a tune cannot finish (studies, made models, quantized variants), and below
# which a warning says so.
MIN_FREE_DISK = 2 * GiB
LOW_FREE_DISK = 10 * GiB
# Memory another process holds on a GPU before it is worth a warning.
HELD_BY_OTHERS = 256 * MiB
REPACK_PROBE_TIMEOUT_S = 60.0  # the decode takes a few seconds; a loaded machine must not read as a hang


@dataclass(frozen=True)
class Check:
    """One check's answer: ``status`` is ``ok``, ``warning`` or ``problem``; ``fix`` is empty when
    there is nothing to do."""

    name: str
    status: str
    found: str
    fix: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status, "found": self.found, "fix": self.fix}


@dataclass(frozen=True)
class OSGPU:
    """A GPU the operating system has: its vendor (``nvidia``, ``amd``, ``intel``, ``apple``), name,
    and where it was seen (``NVML``, ``/sys/class/drm/card0``, ``rocm-smi``, ``sysctl``)."""

    vendor: str
    name: str
    source: str


# -- what the OS has ------------------------------------------------------------------------------


def drm_gpus(root: str | os.PathLike[str] | None = None) -> list[OSGPU]:
    """GPUs under ``/sys/class/drm`` (``cardN/device/vendor``), by PCI vendor id."""
    root = Path(root or os.environ.get(ENV_DRM_DIR) or DRM_DIR)
    out = []
    for card in sorted(glob.glob(str(root / "card*"))):
        name = os.path.basename(card)
        if not re.fullmatch(r"card\d+", name):  # card0-HDMI-A-1 and the like are connectors
            continue
        try:
            vendor_id = Path(card, "device", "vendor").read_text().strip().lower()
        except OSError:
            continue
        vendor = VENDOR_IDS.get(vendor_id)
        if vendor is None:
            continue
        try:
            device_id = Path(card, "device", "device").read_text().strip().lower()
        except OSError:
            device_id = "?"
        out.append(OSGPU(vendor, f"{VENDOR_NAMES[vendor]} GPU (PCI {vendor_id}:{device_id})", f"{root}/{name}"))
    return out


def rocm_smi_gpus(timeout: float = 10.0) -> list[OSGPU]:
    """AMD GPUs as ``rocm-smi --showproductname --json`` names them, where rocm-smi is installed."""
    exe = shutil.which("rocm-smi")
    if exe is None:
        return []
    try:
        proc = subprocess.run([exe, "--showproductname", "--json"], capture_output=True, text=True, timeout=timeout)
        data = json.loads(proc.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    out = []
    for card, fields in sorted(data.items()) if isinstance(data, dict) else ():
        if isinstance(fields, dict) and card.startswith("card"):
            name = fields.get("Card Series") or fields.get("Card series") or fields.get("Card model") or card
            out.append(OSGPU("amd", str(name)[:200], "rocm-smi"))
    return out


def apple_gpus(timeout: float = 5.0) -> list[OSGPU]:
    """Apple silicon's GPU (macOS on arm64: ``sysctl machdep.cpu.brand_string``)."""
    import platform

    if sys.platform != "darwin" or platform.machine() != "arm64":
        return []
    try:
        brand = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                               timeout=timeout).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        brand = ""
    return [OSGPU("apple", f"{brand or 'Apple silicon'} GPU", "sysctl")]


def os_gpus(*, nvml: Sequence[Any] | None = None, drm_root: str | os.PathLike[str] | None = None,
            rocm_smi: bool = True, apple: bool = True) -> list[OSGPU]:
    """Every GPU the OS has, by vendor: NVML's NVIDIA GPUs (``nvml``: ``tuner.machine.probe.GPU``s;
    read when None), the drm tree's cards, rocm-smi's and Apple's. A vendor's count is the largest
    any source gives (NVML and drm see the same NVIDIA card)."""
    if nvml is None:
        from ..machine.probe import probe_gpus

        nvml = probe_gpus()[0]
    by_source: dict[str, list[OSGPU]] = {
        "nvml": [OSGPU("nvidia", g.name, "NVML") for g in nvml],
        "drm": drm_gpus(drm_root),
        "rocm": rocm_smi_gpus() if rocm_smi else [],
        "apple": apple_gpus() if apple else [],
    }
    out: list[OSGPU] = []
    for vendor in VENDOR_NAMES:
        best: list[OSGPU] = []
        for found in by_source.values():
            mine = [g for g in found if g.vendor == vendor]
            if len(mine) > len(best):
                best = mine
        out += best
    return out


# -- what llama.cpp has -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Build:
    """llama-cpp-python's llama.cpp as ``tuner.engine.python.read_build`` reads it (in a child process)."""

    data: Mapping[str, Any]

    @property
    def version(self) -> str | None:
        return self.data.get("llama_cpp_python")

    @property
    def devices(self) -> list[Any]:
        from ..engine.devices import DeviceInfo

        return [DeviceInfo.from_dict(d) for d in self.data.get("devices", ())]

    def local_accelerators(self) -> list[Any]:
        return [d for d in self.devices if d.is_accelerator and not d.rpc_endpoint]

    @property
    def gpu_offload(self) -> bool:
        return bool(self.data.get("gpu_offload"))

    @property
    def gpu_backends(self) -> list[str]:
        """The build's GPU backends (cuda, hip, vulkan, metal, sycl...): llama_supports_gpu_offload()
        is true for an RPC-only build too, so the backend libraries (or the devices) say it."""
        names = [b for b in self.backends if b.lower() not in ("cpu", "rpc", "blas", "base")]
        return names or sorted({d.backend for d in self.local_accelerators()})

    @property
    def rpc(self) -> bool:
        return bool(self.data.get("rpc"))

    @property
    def backends(self) -> list[str]:
        return [str(b) for b in self.data.get("backends", ())]

    def describe(self) -> str:
        from ..engine.base import EngineBuild

        d = self.data
        return EngineBuild(engine="python", build_number=d.get("build_number"), commit=d.get("commit"),
                           version=d.get("version")).describe()

    @property
    def system_info(self) -> str:
        return str(self.data.get("system_info") or "")


def read_python_build() -> Build:
    from ..engine.python import read_build

    return Build(read_build())


def cpu_features(system_info: str) -> set[str]:
    """The CPU backend's features llama.cpp reports (``llama_print_system_info``: ``CPU : SSE3 = 1 |
    AVX2 = 1 | AMX_INT8 = 1 | REPACK = 1 |``, ggml-cpu.cpp ``ggml_backend_cpu_get_features``, 2025-2026)."""
    return {m[1] for m in re.finditer(r"\b([A-Z][A-Z0-9_]*) = 1\b", system_info)}


def install_line(vendor: str, build: Build | None = None) -> str:
    """The pip line that rebuilds llama-cpp-python for ``vendor``'s GPU (keeping RPC where the build
    has it); ``--no-cache-dir`` because pip otherwise reuses the cached CPU wheel."""
    flags = CMAKE_FLAG[vendor] + (" -DGGML_RPC=on" if build is not None and build.rpc else "")
    version = (build.version if build is not None else None) or "0.3.36"
    return f'CMAKE_ARGS="{flags}" pip install --no-cache-dir --force-reinstall llama-cpp-python=={version}'


def cmake_line(vendor: str) -> str:
    """The CMake lines that build llama.cpp's own binaries for ``vendor``'s GPU."""
    return f"cmake -B build {CMAKE_FLAG[vendor]} && cmake --build build --config Release -j"


def _vendors(gpus: Iterable[OSGPU]) -> dict[str, list[OSGPU]]:
    out: dict[str, list[OSGPU]] = {}
    for g in gpus:
        out.setdefault(g.vendor, []).append(g)
    return out


def _gpu_words(gpus: Sequence[OSGPU]) -> str:
    return "; ".join(f"{g.name} ({g.source})" for g in gpus)


def _serving(devices: Sequence[Any], vendor: str) -> list[Any]:
    return [d for d in devices if any(d.backend.startswith(b) or d.name.startswith(b) for b in SERVES[vendor])]


# -- the checks ----------------------------------------------------------------------------------------


def check_gpus(gpus: Sequence[OSGPU], build: Build, env: Mapping[str, str] | None = None) -> Check:
    """The GPUs the OS has against the devices llama-cpp-python's llama.cpp lists."""
    env = os.environ if env is None else env
    if build.data.get("error") and not build.data.get("devices"):
        fix = (install_line(gpus[0].vendor, build) if gpus
               else "pip install --no-cache-dir --force-reinstall llama-cpp-python==0.3.36")
        return Check("gpus", PROBLEM, f"llama-cpp-python's llama.cpp could not be read: {build.data['error']}", fix)
    devices = build.local_accelerators()
    listed = ", ".join(d.describe() for d in devices) or "none besides the CPU"
    if not gpus:
        if devices:
            return Check("gpus", OK, f"the OS lists no GPU driver llama.cpp has a backend for; llama.cpp lists: {listed}")
        return Check("gpus", OK, "no GPU (NVML, /sys/class/drm, rocm-smi): llama.cpp runs on the CPU, which is all "
                                 "this machine has (RPC servers can still lend it devices)")
    vendors = _vendors(gpus)
    seen = f"the OS has {_gpu_words(gpus)}; llama.cpp lists {listed}"
    hidden = [k for k in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "GGML_VK_VISIBLE_DEVICES")
              if k in env]
    if not devices:
        vendor = "nvidia" if "nvidia" in vendors else "amd" if "amd" in vendors else next(iter(vendors))
        only_integrated = set(vendors) == {"intel"}
        status = WARNING if only_integrated else PROBLEM
        if not build.gpu_backends:
            found = (f"{seen}: llama-cpp-python was built for the CPU only (pip reused a cached CPU wheel, or "
                     "CMAKE_ARGS was not applied), so every layer runs on the CPU")
            fix = install_line(vendor, build)
            if only_integrated:
                found += " (an Intel integrated GPU is often no faster than the CPU)"
            return Check("gpus", status, found, fix)
        backends = ", ".join(build.gpu_backends)
        found = f"{seen}: the build has {backends} but llama.cpp finds no device"
        if hidden:
            found += f" ({', '.join(f'{k}={env[k]!r}' for k in hidden)} is set)"
            return Check("gpus", PROBLEM, found, f"unset {' '.join(hidden)}")
        fix = {"nvidia": "check the NVIDIA driver (nvidia-smi must list the GPU) and that the CUDA runtime the build "
                         "links is not newer than the driver (see the cuda check)",
               "amd": "add your user to the render and video groups (sudo usermod -aG render,video $USER) and check "
                      "rocminfo lists the GPU",
               "intel": "install the GPU's Vulkan driver (Debian/Ubuntu: sudo apt-get install mesa-vulkan-drivers) "
                        "and check vulkaninfo --summary lists it"}.get(vendor, "check the GPU driver")
        return Check("gpus", PROBLEM, found, fix)
    missing = []
    for vendor, mine in vendors.items():
        if vendor == "intel" and len(vendors) > 1:
            continue  # an integrated GPU beside a discrete one: llama.cpp is right to use the discrete one
        if len(_serving(devices, vendor)) < len(mine):
            missing.append((vendor, mine))
    if missing:
        vendor, mine = missing[0]
        found = (f"{seen}: {len(mine)} {VENDOR_NAMES[vendor]} GPU(s) but llama.cpp uses "
                 f"{len(_serving(devices, vendor))} of them")
        if hidden:
            return Check("gpus", WARNING, found + f" ({', '.join(f'{k}={env[k]!r}' for k in hidden)} is set)",
                         f"unset {' '.join(hidden)} (or list every GPU in it) to let llama.cpp use them all")
        if not _serving(devices, vendor):
            return Check("gpus", WARNING, found, install_line(vendor, build))
        return Check("gpus", WARNING, found, "check the driver lists every GPU (nvidia-smi, rocminfo, vulkaninfo --summary)")
    return Check("gpus", OK, seen)


def check_build(build: Build) -> Check:
    """GPU offload and RPC support of llama-cpp-python's build."""
    if build.data.get("error") and not build.version:
        return Check("build", PROBLEM, f"llama-cpp-python could not be imported: {build.data['error']}",
                     'CMAKE_ARGS="-DGGML_RPC=on" pip install --no-cache-dir --force-reinstall llama-cpp-python==0.3.36')
    backends = ", ".join(build.backends) or "cpu"
    found = (f"llama-cpp-python {build.version} (llama.cpp {build.describe()}), backends {backends}: GPU backend "
             f"{', '.join(build.gpu_backends) or 'none (CPU only)'}, RPC {'yes' if build.rpc else 'no'}")
    if not build.rpc:
        backend_flags = {"cuda": "-DGGML_CUDA=on", "hip": "-DGGML_HIP=on", "vulkan": "-DGGML_VULKAN=on",
                         "metal": "-DGGML_METAL=on", "sycl": "-DGGML_SYCL=on"}
        flags = " ".join([*(f for b, f in backend_flags.items() if b in [x.lower() for x in build.backends]), "-DGGML_RPC=on"])
        return Check("build", WARNING, found + " (RPC servers, real or simulated with `offload-tuner rpc-serve`, "
                                               "cannot be used as devices)",
                     f'CMAKE_ARGS="{flags}" pip install --no-cache-dir --force-reinstall llama-cpp-python=={build.version or "0.3.36"}')
    return Check("build", OK, found)


def cuda_driver_version() -> tuple[int, int] | None:
    """The highest CUDA version the NVIDIA driver supports (NVML), or None without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        version = int(pynvml.nvmlSystemGetCudaDriverVersion())
        return version // 1000, (version % 1000) // 10
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def cuda_runtime_version(lib_dir: str | os.PathLike[str] | None = None) -> tuple[int, int] | None:
    """The CUDA runtime llama.cpp's CUDA backend links: ``libcudart.so.MAJOR.MINOR...`` in
    llama-cpp-python's ``lib`` folder or, through ``ldd``, where the loader finds it."""
    if lib_dir is None:
        try:
            import importlib.util

            spec = importlib.util.find_spec("llama_cpp")
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin:
            return None
        lib_dir = Path(spec.origin).parent / "lib"
    names = [os.path.basename(p) for p in glob.glob(os.path.join(lib_dir, "libcudart.so*"))]
    cuda_lib = next(iter(glob.glob(os.path.join(lib_dir, "libggml-cuda.so*"))), None)
    if not names and cuda_lib and shutil.which("ldd"):
        try:
            text = subprocess.run(["ldd", cuda_lib], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
        m = re.search(r"libcudart\.so[^\s]*\s+=>\s+(\S+)", text)
        if m:
            names = [os.path.basename(os.path.realpath(m[1]))]
    for name in sorted(names, key=len, reverse=True):
        m = re.search(r"libcudart\.so\.(\d+)\.(\d+)", name)
        if m:
            return int(m[1]), int(m[2])
    return None


def check_cuda(build: Build, driver: tuple[int, int] | None, runtime: tuple[int, int] | None) -> Check:
    """The driver's CUDA version against the CUDA runtime the build links, where CUDA is used."""
    uses_cuda = "cuda" in [b.lower() for b in build.backends] or any(d.backend == "CUDA" for d in build.devices)
    if not uses_cuda:
        found = "the build has no CUDA backend" + (f" (the driver supports CUDA {driver[0]}.{driver[1]})" if driver else "")
        return Check("cuda", OK, found)
    d = f"{driver[0]}.{driver[1]}" if driver else None
    r = f"{runtime[0]}.{runtime[1]}" if runtime else None
    if driver is None:
        return Check("cuda", PROBLEM, f"the build uses CUDA{f' {r}' if r else ''} but NVML finds no NVIDIA driver",
                     "install the NVIDIA driver (nvidia-smi must run), or rebuild for the CPU: "
                     "pip install --no-cache-dir --force-reinstall llama-cpp-python")
    if runtime is None:
        return Check("cuda", WARNING, f"the driver supports CUDA {d}; the CUDA runtime the build links was not found "
                                      "(libcudart)", "add the CUDA toolkit's lib64 folder to LD_LIBRARY_PATH")
    if runtime > driver:
        return Check("cuda", PROBLEM, f"the build links CUDA runtime {r}, newer than the driver supports ({d}): "
                                      "CUDA fails to start and llama.cpp lists no CUDA device",
                     f"update the NVIDIA driver to one for CUDA {r} or newer, or rebuild with a CUDA toolkit <= {d}: "
                     f"CUDACXX=/usr/local/cuda-{d}/bin/nvcc {install_line('nvidia', build)}")
    return Check("cuda", OK, f"CUDA runtime {r}, driver supports CUDA {d}")


@dataclass(frozen=True)
class ProbeResult:
    """The repack probe's decode: its outcome (``tuner.engine.outcome.Outcome`` value), the message,
    and the weight buffers llama.cpp made (``AMX``, ``CPU_REPACK``, ``CPU_Mapped``...)."""

    outcome: str
    message: str
    buffers: tuple[str, ...] = ()
    wall_s: float = 0.0


def probe_model() -> Path:
    """A tiny Q4_0 model (weights llama.cpp repacks on AVX2 and AMX CPUs), made once in the data folder."""
    from ..model.make import ModelShape, make_model, quantize
    from ..paths import models_dir

    folder = models_dir() / "doctor"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "repack-probe-Q4_0.gguf"
    if not target.exists():
        f16 = make_model(folder / "repack-probe-F16.gguf",
                         ModelShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx_train=1024))
        quantize(f16, folder / "repack-probe-Q4_0.gguf.tmp", "Q4_0")
        os.replace(folder / "repack-probe-Q4_0.gguf.tmp", target)
        f16.unlink()
    return target


def repack_probe(*, timeout_s: float = REPACK_PROBE_TIMEOUT_S, python: str | None = None) -> ProbeResult:
    """A short real decode (16 prompt tokens, 8 generated) of ``probe_model()`` with weight repacking
    on (llama.cpp's default), in a child process: a crash there is a result, not the doctor's end.
    ``python`` is the interpreter the worker runs in (tests give one that crashes)."""
    from ..engine.base import BenchSpec
    from ..engine.python import TrialRunner
    from ..engine.settings import Settings

    model = probe_model()
    settings = Settings(model_path=str(model), n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, n_threads_batch=2)
    with TrialRunner(timeout_s=timeout_s, python=python) as runner:
        result = runner.run(settings, BenchSpec(n_prompt=16, n_gen=8, repetitions=1, warmup=False))
    return ProbeResult(result.outcome.value, result.message, tuple(result.load.model_buffers), result.wall_s)


def check_repack(features: set[str], probe: ProbeResult | None) -> Check:
    """The AMX / weight-repacking crash risk: the CPU features llama.cpp reports and the probe's
    decode. Kept apart from the probe so a finding of the crash search can stand in for it."""
    amx = "AMX_INT8" in features
    cpu = ("AMX_INT8 (llama.cpp repacks weights into an AMX buffer)" if amx else
           "no AMX" + (", weight repacking built in (REPACK)" if "REPACK" in features else ""))
    fix = ("run llama.cpp without weight repacking: llama-server/llama-cli --no-repack (or LLAMA_ARG_REPACK=0), "
           "llama-bench --repack 0; llama-cpp-python: llama_model_params.use_extra_bufts = False")
    if probe is None:
        return Check("repack", WARNING if amx else OK, f"CPU: {cpu}; the decode probe did not run",
                     fix if amx else "")
    buffers = f"; weight buffers {', '.join(probe.buffers)}" if probe.buffers else ""
    if probe.outcome == "ok":
        return Check("repack", OK, f"CPU: {cpu}; a decode of a Q4_0 model with repacking on ran ({probe.wall_s:.1f} s{buffers})")
    if probe.outcome == "timeout":
        return Check("repack", WARNING, f"CPU: {cpu}; the decode probe did not finish: {probe.message}",
                     "run `offload-tuner doctor` again on an idle machine" + ("; if it hangs again: " + fix if amx else ""))
    if probe.outcome == "crash":
        return Check("repack", PROBLEM, f"CPU: {cpu}; a decode with repacking on crashed: {probe.message}{buffers}", fix)
    return Check("repack", WARNING, f"CPU: {cpu}; the decode probe ended {probe.outcome}: {probe.message}{buffers}",
                 "run `offload-tuner bench` on a model with --debug to see llama.cpp's log")


def check_gpu_memory(gpus: Sequence[Any], status: str, me: int | None = None) -> Check:
    """Memory of each NVIDIA GPU held by other processes (NVML's ``tuner.machine.probe.GPU``s)."""
    me = os.getpid() if me is None else me
    if not gpus:
        return Check("gpu_memory", OK, f"{status} (no NVIDIA GPU whose memory NVML could show)")
    held, lines = [], []
    for g in gpus:
        used = g.memory_total - g.memory_free
        others = [p for p in g.processes if p.pid != me]
        lines.append(f"GPU {g.index} {g.name}: {g.memory_free / MiB:.0f} of {g.memory_total / MiB:.0f} MiB free")
        for p in others:
            if (p.used_memory or 0) >= HELD_BY_OTHERS:
                held.append((g, p))
        if not others and used >= max(HELD_BY_OTHERS, g.memory_total // 10):
            held.append((g, None))
    if not held:
        return Check("gpu_memory", OK, "; ".join(lines))
    words, pids = [], []
    for g, p in held:
        if p is None:
            words.append(f"GPU {g.index}: {(g.memory_total - g.memory_free) / MiB:.0f} MiB used by processes NVML "
                         "cannot name (another container or user)")
        else:
            words.append(f"GPU {g.index}: pid {p.pid} ({p.name[:80]}) holds {(p.used_memory or 0) / MiB:.0f} MiB")
            pids.append(str(p.pid))
    fix = (f"stop what you do not need (kill {' '.join(pids)}), or tune with it running: the tuner sizes "
           "for the memory free now" if pids else "free that memory (nvidia-smi shows who holds it on the host)")
    return Check("gpu_memory", WARNING, "; ".join(lines) + "; " + "; ".join(words), fix)


def check_data_folder(folder: str | os.PathLike[str] | None = None,
                      disk_usage: Callable[[str], Any] = shutil.disk_usage) -> Check:
    """The data folder is writable, and the free space of its disk (``disk_usage`` is the OS's answer)."""
    from ..errors import FileWriteError
    from ..paths import ENV_HOME, data_dir, ensure_writable

    path = Path(folder) if folder is not None else data_dir()
    move = f"export {ENV_HOME}=/a/folder/with/room (where profiles, studies and made models go)"
    try:
        ensure_writable(path)
    except FileWriteError as exc:
        return Check("data_folder", PROBLEM, str(exc), move)
    try:
        free = int(disk_usage(str(path)).free)
    except OSError as exc:
        return Check("data_folder", WARNING, f"{path} is writable; its free space is unknown ({exc})", "")
    found = f"{path} is writable; {free / GiB:.1f} GiB free"
    if free < MIN_FREE_DISK:
        return Check("data_folder", PROBLEM, found + f": a tune needs at least {MIN_FREE_DISK / GiB:.0f} GiB "
                                                     "(studies, made and quantized models)", f"free space on that disk, or {move}")
    if free < LOW_FREE_DISK:
        return Check("data_folder", WARNING, found + " (quantized variants of a large model take GiBs each)",
                     f"free space on that disk, or {move}")
    return Check("data_folder", OK, found)


def check_storage(url: str | None = None, *, connect_timeout: int = 5) -> Check:
    """The study database opens and its tables can be listed (``url``: the default SQLite file when None)."""
    from ..profile.dburl import explain, redact_url, remember, scrub
    from ..search.storage import default_url

    url = url or default_url()
    remember(url)
    try:
        tables = _list_tables(url, connect_timeout)
    except Exception as exc:
        err = explain(exc, url, what="study database")
        return Check("storage", PROBLEM, scrub(str(err)), "fix the URL or start the server; or omit --storage for the "
                                                          "default SQLite file in the data folder")
    studies = "with studies" if "studies" in tables else "empty"
    return Check("storage", OK, f"study database {redact_url(url)}: opens ({studies})")


def _list_tables(url: str, connect_timeout: int) -> list[str]:
    import sqlalchemy

    from ..profile.dburl import engine_kwargs, normalize_url

    normalized = normalize_url(url)
    engine = sqlalchemy.create_engine(normalized, **engine_kwargs(normalized, connect_timeout=connect_timeout))
    try:
        with engine.connect() as connection:
            return sqlalchemy.inspect(connection).get_table_names()
    finally:
        engine.dispose()


def check_registry(url: str | None = None, *, connect_timeout: int = 5) -> Check:
    """The profile registry apps read (``OFFLOAD_TUNER_REGISTRY``) answers; its password never shown."""
    from ..paths import ENV_REGISTRY
    from ..profile.dburl import redact_url, remember, scrub

    url = url if url is not None else os.environ.get(ENV_REGISTRY)
    if not url:
        return Check("registry", OK, f"no profile registry configured ({ENV_REGISTRY} is not set): apps read local profiles")
    remember(url)
    from ..profile.registry import TABLE

    try:
        # read-only: publishing creates the table; the doctor only looks
        tables = _list_tables(url, connect_timeout)
        count = _count_rows(url, TABLE, connect_timeout) if TABLE in tables else None
    except Exception as exc:
        from ..profile.dburl import explain

        return Check("registry", PROBLEM, scrub(str(explain(exc, url, what="profile registry")), [url]),
                     f"start the database or fix {ENV_REGISTRY}; until then apps use their cached copies of its "
                     "profiles (offload-tuner profile pull refreshes them)")
    held = f"{count} profile(s) in {TABLE}" if count is not None else "no profile published yet"
    return Check("registry", OK, f"profile registry {redact_url(url)}: answers ({held})")


def _count_rows(url: str, table: str, connect_timeout: int) -> int:
    import sqlalchemy

    from ..profile.dburl import engine_kwargs, normalize_url

    normalized = normalize_url(url)
    engine = sqlalchemy.create_engine(normalized, **engine_kwargs(normalized, connect_timeout=connect_timeout))
    try:
        with engine.connect() as connection:
            return int(connection.execute(sqlalchemy.select(sqlalchemy.func.count()).select_from(
                sqlalchemy.table(table))).scalar_one())
    finally:
        engine.dispose()


def check_llama_bin(llama_bin: str | os.PathLike[str] | None, gpus: Sequence[OSGPU]) -> tuple[Check, Any]:
    """The user's llama.cpp binaries (``--llama-bin`` or llama-bench on PATH): found, their build and
    devices. Returns the check and their ``EngineBuild`` (None when not found)."""
    from ..engine.llamacpp import LlamaCppEngine, find_binaries
    from ..errors import EngineError, TunerError

    if llama_bin is None and shutil.which("llama-bench") is None:
        return Check("llama_bin", OK, "no llama.cpp binaries on PATH (llama-bench): the python engine "
                                      "(llama-cpp-python) runs the trials; pass --llama-bin DIR to check your own build"), None
    try:
        find_binaries(llama_bin)
        with LlamaCppEngine(llama_bin) as engine:
            devices = engine.devices()
            build = engine.build()
            folder = engine.binaries.folder
            tools = ", ".join(sorted(engine.binaries.tools))
    except TunerError as exc:
        hint = ("point --llama-bin at the folder that holds llama-bench (llama.cpp/build/bin)" if isinstance(exc, EngineError)
                else "")
        return Check("llama_bin", PROBLEM, str(exc), hint), None
    accel = [d for d in devices if d.is_accelerator and not d.rpc_endpoint]
    listed = ", ".join(d.describe() for d in accel) or "no device besides the CPU"
    found = f"{folder}: llama.cpp {build.describe()} ({tools}); devices: {listed}"
    vendors = _vendors(gpus)
    if vendors and not accel and set(vendors) != {"intel"}:
        vendor = "nvidia" if "nvidia" in vendors else next(iter(vendors))
        return Check("llama_bin", PROBLEM, found + f": a CPU-only build on a machine with {_gpu_words(gpus)}",
                     f"rebuild llama.cpp for the GPU: {cmake_line(vendor)}"), build
    return Check("llama_bin", OK, found), build


def this_machine(build: Build) -> Any:
    """This machine as profiles record it (``tuner.machine.probe``), with llama-cpp-python's devices."""
    import dataclasses as dc

    from ..machine.probe import _llama_build, probe, with_devices

    machine = dc.replace(probe(llama=False), llama=_llama_build(dict(build.data)))
    return with_devices(machine, build.devices)


def check_profiles(machine: Any, binaries: Any = None, search_path: Any = None) -> Check:
    """This machine's profiles made with another llama.cpp build or engine than the one installed now:
    the check apps run at load (``tuner.profile.apps``), on every profile found. ``binaries`` is the
    user's binaries' ``EngineBuild`` (None: not found)."""
    from ..profile.apps import _check_build
    from ..profile.document import LlamaBuildWarning
    from ..profile.store import list_profiles

    entries = list_profiles(search_path)
    mine, other, unreadable, stale = 0, 0, [], []
    for entry in entries:
        profile = entry.profile
        if profile is None:
            unreadable.append(f"{entry.path}: {entry.error}")
            continue
        if profile.machine.fingerprint != machine.fingerprint():
            other += 1
            continue
        mine += 1
        by_binaries = profile.engine is not None and profile.engine.name == "llama-cpp"
        if by_binaries and binaries is None:
            stale.append((profile, f"{profile.name}: measured with llama.cpp binaries (build {profile.engine.build}, "
                                   f"{profile.engine.path}), which are not found now"))
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _check_build(profile, machine, binaries if by_binaries else None)
        for w in caught:
            if issubclass(w.category, LlamaBuildWarning):
                stale.append((profile, str(w.message)))
    found = f"{mine} profile(s) of this machine" + (f", {other} of other machines (not checked)" if other else "")
    if unreadable:
        return Check("profiles", WARNING, found + f"; unreadable: {'; '.join(unreadable[:3])}",
                     "move the unreadable file(s) out of the profile folders (offload-tuner profile list --all shows them)")
    if stale:
        fixes = []
        for profile, _ in stale[:3]:
            engine = " --engine llama-cpp" + (f" --llama-bin {profile.engine.path}" if profile.engine and profile.engine.path else "") \
                if profile.engine is not None and profile.engine.name == "llama-cpp" else ""
            fixes.append(f"offload-tuner tune {profile.model.file_name}{engine}")
        return Check("profiles", WARNING, found + "; " + "; ".join(w for _, w in stale[:3])
                     + (f" (and {len(stale) - 3} more)" if len(stale) > 3 else ""),
                     "tune again with the llama.cpp you run now: " + " ; ".join(fixes))
    return Check("profiles", OK, found + ("; all made with the llama.cpp installed now" if mine else ""))


# -- all of them ------------------------------------------------------------------------------------


def run_checks(*, llama_bin: str | os.PathLike[str] | None = None, storage: str | None = None,
               probe: bool = True) -> list[Check]:
    """Every check on this machine, in the order ``doctor`` prints them. ``probe=False`` skips the
    repack decode (the check then says it did not run)."""
    from ..machine.probe import probe_gpus

    nvml, status = probe_gpus()
    gpus = os_gpus(nvml=nvml)
    build = read_python_build()
    checks = [check_gpus(gpus, build), check_build(build)]
    checks.append(check_cuda(build, cuda_driver_version(), cuda_runtime_version()))
    result = None
    if probe and not (build.data.get("error") and not build.version):
        result = repack_probe()
    checks.append(check_repack(cpu_features(build.system_info), result))
    checks.append(check_gpu_memory(nvml, status))
    checks.append(check_data_folder())
    checks.append(check_storage(storage))
    checks.append(check_registry())
    binaries_check, binaries = check_llama_bin(llama_bin, gpus)
    checks.append(binaries_check)
    try:
        machine = this_machine(build)
        checks.append(check_profiles(machine, binaries))
    except Exception as exc:  # a profile check must never hide the others
        checks.append(Check("profiles", WARNING, f"profiles not checked: {type(exc).__name__}: {exc}", ""))
    return checks


def failed(checks: Iterable[Check]) -> bool:
    """Whether any check is a problem (``doctor`` exits 1)."""
    return any(c.status == PROBLEM for c in checks)


def format_checks(checks: Sequence[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"[{c.status}] {c.name}: {c.found}")
        if c.fix and c.status != OK:
            lines.append(f"    fix: {c.fix}")
    problems = sum(c.status == PROBLEM for c in checks)
    warns = sum(c.status == WARNING for c in checks)
    lines.append(f"{len(checks)} checks: {problems} problem(s), {warns} warning(s)")
    return "\n".join(lines)


__all__ = ["Check", "OSGPU", "Build", "ProbeResult", "OK", "WARNING", "PROBLEM", "STATUSES", "run_checks", "failed",
           "format_checks", "os_gpus", "drm_gpus", "cpu_features", "install_line", "check_gpus", "check_build",
           "check_cuda", "check_repack", "repack_probe", "check_gpu_memory", "check_data_folder", "check_storage",
           "check_registry", "check_llama_bin", "check_profiles", "cuda_runtime_version", "cuda_driver_version"]
