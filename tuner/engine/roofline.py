"""A roofline engine, for simulation: what a trial would measure on a machine we do not have.

It answers ``run(settings, bench)`` like the real engines do, from physics instead of llama.cpp, so
the search can be measured on GPU-sized spaces (``benchmarks/search_at_scale.py``) and tested
without GPUs. It is for benchmarks and search tests only: the tune command never uses it.

The model, per micro-batch of ``n`` tokens (``n = 1`` for a generated token):

- every device reads the weights placed on it once per micro-batch, at its memory bandwidth
  (times an efficiency), or computes ``2 n`` FLOPs per weight at its matmul throughput, whichever
  takes longer (the roofline). The layers run one after another (llama.cpp's layer split is a
  pipeline), so the devices' times add up. MoE experts: a token reads only the experts it uses
  (``expert_used / expert_count`` of their bytes); a micro-batch of ``n`` tokens reads the share
  ``1 - (1 - used/count)^n`` of them;
- attention reads the KV cache of the context so far (``depth + n_gen / 2`` tokens for
  generation) where the cache lives: on the layer's device, or on the host when ``offload_kqv``
  is off. Without flash attention the f32 scores are written and read back too. A quantized cache
  reads fewer bytes but pays for dequantizing them;
- a move between devices costs the bus's latency plus the activations (``n * n_embd`` f32) over
  its bandwidth: between consecutive layers on different devices, twice for a layer whose
  overridden tensors (``-ot ...=CPU``) or KV cache sit on the host, and the logits back to the
  host from an offloaded output layer;
- with a GPU present, a prompt micro-batch of 32 tokens or more (ggml-cuda's
  ``GGML_OP_OFFLOAD_MIN_BATCH`` default, 32) runs the host's weights on the GPU, streaming them
  over the bus (llama.cpp's op offload), which is why prompt speed grows with ``n_ubatch`` in a
  partial offload;
- host threads: memory bandwidth saturates at about half the physical cores; more threads than
  physical cores cost a little (hyper-threads contend).

Out of memory comes from the memory arithmetic (``tuner.model.estimate``) against each device's
capacity (and the host's RAM). Measurements carry multiplicative noise like a shared machine's:
a slow-down that drifts over time, shared by everything measured in the same seconds (so paired
measurements keep their ratio), plus a small per-sample jitter; every factor lies in
``[1 - noise, 1]`` and the stream is seeded.

The device table below holds vendor figures (memory, bandwidth, peak throughput, bus), each with
its source. Efficiencies and latencies are this module's assumptions, marked as such.

What a trial costs in wall-clock time (``engine.clock``, split by ``engine.spent``; each result's
``wall_s`` and ``load_s``), as the python engine spends it (``reuse_model=True``: the model stays
loaded while trials share ``Settings.model_key``; ``False``: llama-bench, which loads it for every
trial):

- the load: a process start where a fresh one is needed, then the file read from the page cache
  when an earlier load left it there, else from the machine's ``storage`` (``STORAGE``: a cited
  sequential-read figure per device class), overlapped with the upload of the accelerators' share
  over their bus. The page cache keeps a file when it fits in the RAM the trial leaves (least
  recently used files go first). A weight buffer that does not fit fails before any data is read;
  a cache or compute buffer that does not fit fails after the load, at the context;
- the context: its setup and the clearing of its KV cache;
- the warm-up and each repetition at the speeds the trial measured (noise included): the worker's
  warm-up is one prompt and 8 generated tokens; the cache is filled to ``depth`` tokens untimed
  once per context (``depth_once``, the worker's way), or before each timed region (pp, tg) as
  llama-bench does. A ``StopRule`` ends the repetitions early, as in the worker.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..limits import tensor_regex
from ..model.estimate import CPU, MemoryEstimate, estimate, layer_devices
from ..model.inspect import ModelInfo
from ..model.special import flash_attn_forms
from .base import BenchSpec, Engine, EngineBuild, Stats, StopRule, TrialResult
from .devices import DeviceInfo
from .logparse import LoadReport
from .outcome import Outcome
from .settings import Settings

GiB = 1 << 30
MiB = 1 << 20

# -- the hardware ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """A bus between a device and the host (or two devices): bandwidth per direction, and the
    latency of one small transfer with its synchronisation."""

    name: str
    bandwidth: float  # bytes/s, one direction
    latency: float  # seconds


# PCI Express Base Specification (PCI-SIG): 4.0 runs 16 GT/s per lane, 5.0 32 GT/s, with 128b/130b
# encoding, so x16 carries 16e9 * 16 * 128/130 / 8 = 31.5 GB/s per direction. The ~10 us per small
# copy (launch, DMA, synchronise) is an assumption, typical of cudaMemcpy of a few KiB.
PCIE4_X16 = Link("PCIe 4.0 x16", 31.5e9, 10e-6)
PCIE4_X8 = Link("PCIe 4.0 x8", 15.75e9, 10e-6)
PCIE5_X16 = Link("PCIe 5.0 x16", 63.0e9, 10e-6)
# NVIDIA A100 Tensor Core GPU datasheet: third-generation NVLink, 600 GB/s (both directions).
NVLINK3 = Link("NVLink 3", 300e9, 5e-6)
# Apple silicon: CPU and GPU share one memory, so a "transfer" is a synchronisation (assumption).
UNIFIED = Link("unified memory", 400e9, 5e-6)


@dataclass(frozen=True)
class DeviceSpec:
    """One device's vendor figures. ``memory`` is 0 for a CPU (the machine says how much RAM)."""

    model: str
    kind: str  # "gpu" | "cpu"; a GPU that shares the host's memory has ``unified=True``
    memory: int  # bytes
    bandwidth: float  # peak memory bandwidth, bytes/s
    flops: float  # peak FLOP/s of the units llama.cpp's matmuls use (GPU: dense FP16 tensor; CPU: FP32 FMA)
    link: Link | None = None  # to the host
    nvlink: Link | None = None  # to a twin of the same model, where there is one
    cores: int = 0  # CPU: physical cores
    threads: int = 0  # CPU: logical cores
    unified: bool = False
    source: str = ""

    @property
    def backend(self) -> str:
        """The ggml backend llama.cpp drives it with (the NVIDIA cards here with CUDA, Apple's with Metal)."""
        return "CPU" if self.kind == "cpu" else ("Metal" if self.unified else "CUDA")


DEVICES: dict[str, DeviceSpec] = {
    "rtx3090": DeviceSpec(
        "NVIDIA GeForce RTX 3090", "gpu", 24 * GiB, 936e9, 142e12, PCIE4_X16,
        source="NVIDIA GeForce RTX 3090 product specifications (24 GB GDDR6X, 384-bit, 19.5 Gbps: 936 GB/s; "
               "PCIe 4.0 x16); NVIDIA Ampere GA102 GPU Architecture whitepaper (peak FP16 Tensor TFLOPS with "
               "FP16 accumulate, dense: 142)"),
    "rtx4090": DeviceSpec(
        "NVIDIA GeForce RTX 4090", "gpu", 24 * GiB, 1008e9, 330.3e12, PCIE4_X16,
        source="NVIDIA GeForce RTX 4090 product specifications (24 GB GDDR6X, 384-bit, 21 Gbps: 1008 GB/s; "
               "PCIe 4.0 x16); NVIDIA Ada Lovelace GPU Architecture whitepaper (peak FP16 Tensor TFLOPS with "
               "FP16 accumulate, dense: 330.3)"),
    "rtx4060ti16": DeviceSpec(
        "NVIDIA GeForce RTX 4060 Ti 16GB", "gpu", 16 * GiB, 288e9, 88.3e12, PCIE4_X8,
        source="NVIDIA GeForce RTX 4060 Ti product specifications (16 GB GDDR6, 128-bit, 18 Gbps: 288 GB/s; "
               "PCIe 4.0 x8; 353 AI TOPS, which is FP8 with sparsity: dense FP16 is a quarter, 88.3 TFLOPS)"),
    "a100-80g": DeviceSpec(
        "NVIDIA A100 80GB SXM", "gpu", 80 * GiB, 2039e9, 312e12, PCIE4_X16, nvlink=NVLINK3,
        source="NVIDIA A100 Tensor Core GPU datasheet (80 GB HBM2e, 2,039 GB/s; FP16 Tensor Core 312 TFLOPS dense; "
               "NVLink 600 GB/s; PCIe Gen4 64 GB/s)"),
    "ryzen9-7950x": DeviceSpec(
        "AMD Ryzen 9 7950X, dual-channel DDR5-5200", "cpu", 0, 83.2e9, 2.6e12, cores=16, threads=32,
        source="AMD Ryzen 9 7950X product specifications (16 cores, 32 threads; DDR5 up to 5200 MT/s, 2 channels: "
               "2 x 8 bytes x 5.2e9 = 83.2 GB/s); FP32 peak derived: 16 cores x 32 FLOP/cycle (two 256-bit FMA "
               "pipes) x ~5.1 GHz"),
    "m2max-gpu": DeviceSpec(
        "Apple M2 Max, 38-core GPU", "gpu", 96 * GiB, 400e9, 13.6e12, UNIFIED, unified=True,
        source="Apple Newsroom, 'Apple unveils M2 Pro and M2 Max' (January 2023): up to 96GB unified memory, "
               "400GB/s of unified memory bandwidth; 38-core GPU 13.6 TFLOPS"),
    "m2max-cpu": DeviceSpec(
        "Apple M2 Max, 12-core CPU", "cpu", 0, 240e9, 1.0e12, cores=12, threads=12,
        source="Apple Newsroom (January 2023): 12-core CPU (8 performance, 4 efficiency), 400GB/s for the chip; the "
               "CPU cores alone reach less: 240 GB/s and ~1 TFLOPS FP32 are assumptions"),
}

# Assumptions, not vendor figures: the share of peak bandwidth a decode kernel streams at, the share
# of peak matmul throughput llama.cpp's quantized kernels reach, and the fixed cost per layer
# (kernel launches on a GPU, thread barriers on a CPU). With them a 70B Q4_K_M fully on two RTX
# 3090s generates ~17 t/s and fully on a DDR5 desktop ~1.4 t/s, in line with published llama-bench
# figures for such machines.
BANDWIDTH_EFFICIENCY = {"gpu": 0.8, "cpu": 0.7}
MATMUL_EFFICIENCY = {"gpu": 0.5, "cpu": 0.4}
LAYER_OVERHEAD_S = {"gpu": 15e-6, "cpu": 25e-6}
# ggml-cuda: ops on host weights run on the GPU from this batch size on (GGML_OP_OFFLOAD_MIN_BATCH).
OP_OFFLOAD_MIN_BATCH = 32
# A quantized KV cache reads fewer bytes but spends time dequantizing them (assumption).
QUANTIZED_KV_COST = 1.25
# A GPU's memory is not all llama.cpp's (assumptions): the driver and a desktop hold some before the
# tuner probes (what NVML then reports free), and llama.cpp's own process spends some on its CUDA
# context and library handles, which the memory arithmetic does not count (a llama-server process
# shows ~330 MB in nvidia-smi before its first buffer: ggml-org/llama.cpp issue 23446). The tuner's
# default --vram-margin (512 MiB) covers the second, with some to spare.
DRIVER_RESERVED = 300 * MiB
CONTEXT_OVERHEAD = 350 * MiB
# Metal lets one process wire about this share of unified memory (recommendedMaxWorkingSetSize).
UNIFIED_GPU_SHARE = 0.75

_FLOAT_KV = ("f16", "f32", "bf16")
_ROUTED_EXPERT = re.compile(r"\.ffn_(gate|up|down|gate_up)_exps\.")
_BLOCK = re.compile(r"^blk\.(\d+)\.")


# -- what a trial costs in time --------------------------------------------------------------------


@dataclass(frozen=True)
class Storage:
    """Where the model files live: a device class and its sequential read speed."""

    name: str
    bandwidth: float  # sequential read, bytes/s
    source: str = ""


STORAGE: dict[str, Storage] = {
    "nvme": Storage("NVMe SSD (PCIe 4.0 x4)", 7.45e9,
                    "Samsung 990 PRO product specifications: sequential read up to 7,450 MB/s"),
    "sata-ssd": Storage("SATA SSD", 560e6,
                        "Samsung 870 EVO data sheet: sequential read up to 560 MB/s (the SATA 6 Gb/s interface's ceiling)"),
    "hdd": Storage("hard disk, 7200 rpm", 190e6,
                   "Seagate BarraCuda 3.5-inch data sheet (ST8000DM004): max. sustained transfer rate 190 MB/s, "
                   "on the outer tracks (less towards the inner ones)"),
    "network": Storage("network share over 1 Gb/s Ethernet", 117.7e6,
                       "IEEE 802.3ab (1000BASE-T): 125 MB/s on the wire; a standard 1500-byte MTU carries 1448 bytes of "
                       "TCP payload per 1538 bytes on the wire (preamble, headers, FCS, gap): 117.7 MB/s, before the "
                       "file protocol's own overhead"),
}
# Assumptions, not vendor figures: a file already in the page cache is copied out of it (faulting
# the pages in, uploading through pinned buffers) at about this rate; a fresh worker process
# (Python, llama-cpp-python's import, the backends' initialisation) and a model's metadata and
# buffer setup cost about these; each context sets up its graphs in about CONTEXT_SETUP_S.
PAGE_CACHE_BANDWIDTH = 8e9
PROCESS_START_S = 1.0
MODEL_SETUP_S = 0.3
CONTEXT_SETUP_S = 0.3
# the worker's warm-up generates this many tokens (tuner.engine.worker._Bench.warm_up)
WARMUP_GEN_TOKENS = 8
COSTS = ("load", "context", "warmup", "measure")


# -- the noise ------------------------------------------------------------------------------------


class Drift:
    """A shared machine's slow-down: a level that wanders over time (a bounded random walk, one step
    per sample), times a small independent jitter. Every factor lies in ``[1 - band, 1]``."""

    def __init__(self, band: float, seed: int) -> None:
        if not 0 <= band < 1:
            raise ValueError(f"noise band must be in [0, 1), got {band}")
        self.band = band
        self.jitter = min(0.03, band / 4)
        self.rng = random.Random(seed)
        self.span = band - self.jitter  # (1 - span) * (1 - jitter) >= 1 - band
        self.level = self.rng.uniform(0, self.span)

    def step(self) -> None:
        if self.span <= 0:
            return
        x = self.level + self.rng.gauss(0, self.span / 4)
        # reflect into [0, span]
        period = 2 * self.span
        x = math.fmod(x, period)
        x = x + period if x < 0 else x
        self.level = period - x if x > self.span else x

    def factor(self) -> float:
        return (1 - self.level) * (1 - self.rng.uniform(0, self.jitter))


# -- the model, compiled --------------------------------------------------------------------------


@dataclass
class _Compiled:
    """One model's tensors as arrays: which layer each belongs to (``n_layer`` for the output head,
    -1 for tensors the host always keeps), bytes, elements, and whether it is a routed expert."""

    info: ModelInfo
    names: tuple[str, ...]
    layer: np.ndarray
    n_bytes: np.ndarray
    elements: np.ndarray
    routed: np.ndarray
    masks: dict[tuple[str, ...], np.ndarray] = field(default_factory=dict)
    kv: dict[tuple[str, str], np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, info: ModelInfo) -> "_Compiled":
        layer, names = [], []
        for t in info.tensors:
            m = _BLOCK.match(t.name)
            if m and int(m.group(1)) < info.n_layer:
                layer.append(int(m.group(1)))
            elif t.name.startswith(("output.", "output_norm.")):
                layer.append(info.n_layer)
            else:
                layer.append(-1)
            names.append(t.name)
        return cls(
            info=info, names=tuple(names), layer=np.array(layer, dtype=np.int64),
            n_bytes=np.array([t.n_bytes for t in info.tensors], dtype=np.float64),
            elements=np.array([t.n_elements for t in info.tensors], dtype=np.float64),
            routed=np.array([bool(_ROUTED_EXPERT.search(n)) for n in names], dtype=bool),
        )

    def mask(self, patterns: tuple[str, ...]) -> np.ndarray:
        """Tensors a set of ``-ot PATTERN=CPU`` regexes keeps on the host (as ``estimate`` applies them)."""
        if patterns not in self.masks:
            compiled = [tensor_regex(p) for p in patterns]
            self.masks[patterns] = np.array([any(p.search(n) for p in compiled) for n in self.names], dtype=bool)
        return self.masks[patterns]

    def kv_per_token(self, type_k: str, type_v: str) -> np.ndarray:
        """KV bytes one token costs in each layer 0..n_layer (the output head holds none)."""
        if (type_k, type_v) not in self.kv:
            info = self.info
            self.kv[(type_k, type_v)] = np.array(
                [info.kv_bytes_per_token_layer(il, type_k, type_v) for il in range(info.n_layer)] + [0], dtype=np.float64)
        return self.kv[(type_k, type_v)]

    def per_layer(self, values: np.ndarray, select: np.ndarray) -> np.ndarray:
        """Sum of ``values`` over the selected tensors, per layer 0..n_layer (the output head last)."""
        keep = select & (self.layer >= 0)
        return np.bincount(self.layer[keep], weights=values[keep], minlength=self.info.n_layer + 1)


@dataclass(frozen=True)
class Work:
    """What one micro-batch costs, per layer: arrays of ``n_layer + 1`` entries (the output head
    last). ``kept``: the tensors that go where the layer goes; ``moved``: the ones an override
    keeps on the host; ``kv``: attention's reads of the cache (and scores)."""

    kept_bytes: np.ndarray
    kept_flops: np.ndarray
    moved_bytes: np.ndarray
    moved_flops: np.ndarray
    kv_bytes: np.ndarray
    kv_flops: np.ndarray
    tokens: int


# -- the engine -----------------------------------------------------------------------------------


class RooflineEngine(Engine):
    """Simulated trials on a machine described by device specs.

    ``accelerators`` are (llama.cpp device name, spec) pairs in llama.cpp's order (``CUDA0``,
    ``CUDA1``...); ``host`` is the CPU's spec and ``ram`` what the host can allocate. ``free`` is
    each accelerator's free memory as a probe reports it (default: its memory less the driver's
    share); llama.cpp can allocate that less its own context's overhead.
    """

    def __init__(
        self,
        models: Mapping[str, ModelInfo],
        *,
        host: DeviceSpec,
        ram: int,
        accelerators: Sequence[tuple[str, DeviceSpec]] = (),
        free: Mapping[str, int] | None = None,
        noise: float = 0.2,
        seed: int = 0,
        storage: str = "nvme",
        reuse_model: bool = True,
    ) -> None:
        if storage not in STORAGE:
            raise ValueError(f"storage must be one of {', '.join(STORAGE)}, got {storage!r}")
        self.models = dict(models)
        self.host = host
        self.ram = ram
        self.accelerators = list(accelerators)
        self.names = [name for name, _ in self.accelerators]
        self.specs = {name: spec for name, spec in self.accelerators}
        self.unified = any(spec.unified for spec in self.specs.values())
        self.free = {name: spec.memory - DRIVER_RESERVED for name, spec in self.accelerators}
        self.free.update(free or {})
        # what llama.cpp can allocate on each device (the host: all of ``ram``)
        self.capacity: dict[str, int] = {
            name: int(min(spec.memory, ram) * UNIFIED_GPU_SHARE) if spec.unified else self.free[name] - CONTEXT_OVERHEAD
            for name, spec in self.accelerators
        }
        self.capacity[CPU] = ram
        self.noise = noise
        self.drift = Drift(noise, seed)
        self.launched: list[Settings] = []
        self._compiled: dict[str, _Compiled] = {}
        # the wall clock a real machine would have spent, by kind (COSTS)
        self.storage = STORAGE[storage]
        self.reuse_model = reuse_model
        self.spent: dict[str, float] = {k: 0.0 for k in COSTS}
        self.loads = 0
        self._loaded: tuple | None = None  # the model_key the worker holds
        self._page_cache: OrderedDict[str, int] = OrderedDict()  # file -> bytes, least recently used first
        self._prefill: dict[tuple, float] = {}

    @property
    def clock(self) -> float:
        """Seconds a real machine would have spent on every trial so far."""
        return sum(self.spent.values())

    # -- the engine interface ----------------------------------------------------------------------

    name = "roofline"
    stops_early = True  # run() takes a StopRule, as the python engine's does
    # the python engine's worker fills the depth once per context and drops only what each timed
    # region added (worker._Bench.at_depth); llama-bench (and the worker before) fills it for each
    depth_once = True

    def build(self) -> EngineBuild:
        return EngineBuild(engine=self.name, backends=tuple(dict.fromkeys(["CPU", *(s.backend for s in self.specs.values())])),
                           detail="simulation (tuner.engine.roofline): no llama.cpp runs")

    def devices(self, rpc_servers: Sequence[str] = ()) -> list[DeviceInfo]:
        """The simulated machine's devices as llama.cpp would list them: the host (its RAM as free
        memory) and each accelerator with the free memory a probe reports (``free``)."""
        out = [DeviceInfo(CPU, self.host.model, "cpu", self.ram, self.ram, "CPU")]
        for name, spec in self.accelerators:
            out.append(DeviceInfo(name, spec.model, "gpu", self.free[name], spec.memory, spec.backend,
                                  unified_memory=spec.unified))
        return out

    def close(self) -> None:
        pass

    def run(self, settings: Settings, bench: BenchSpec = BenchSpec(), *, trial_id: object = None,
            stop: StopRule | None = None) -> TrialResult:
        """One simulated trial: refused, out of memory, or ``bench.repetitions`` noisy samples (fewer
        where ``stop`` says the rank is settled, as the python engine's worker does)."""
        self.launched.append(settings)
        refused = self._refuse(settings, bench)
        if refused is not None:
            return refused
        before = self.clock
        est = self.memory(settings)
        over = self.out_of_memory(est)
        reused = self.reuse_model and self._loaded == settings.model_key
        load_s = 0.0 if reused else self._load(settings, est, over)
        if over is not None:
            self._loaded = None  # a failed trial retires its worker
            if not self._weights_fail(est, over):
                self._charge("context", CONTEXT_SETUP_S)
            return dataclasses.replace(self._oom(settings, bench, est, over), wall_s=self.clock - before, load_s=load_s)
        self._loaded = settings.model_key if self.reuse_model else None
        self._context(settings, est)
        pp, tg = self.speed(settings, bench)
        self._warm_up(settings, bench, pp, tg)
        pps: list[float] = []
        tgs: list[float] = []
        for _ in range(bench.repetitions):
            self.drift.step()
            pps.append(pp * self.drift.factor())
            tgs.append(tg * self.drift.factor())
            self._repetition(settings, bench, pp, tg, pps[-1], tgs[-1])
            if stop is not None and stop.enough(pps if bench.n_prompt else [], tgs if bench.n_gen else []):
                break
        result = self._ok(settings, bench, est, pps, tgs)
        return dataclasses.replace(result, wall_s=self.clock - before, load_s=load_s, reused_model=reused)

    def run_paired(self, candidates: list[Settings], bench: BenchSpec = BenchSpec(), *, rounds: int = 5) -> list[TrialResult]:
        """Candidates measured side by side: in each round every candidate is measured within the
        same seconds, so they share the round's drift and differ only by jitter. (The python
        engine's way: each model loaded once, a context per candidate, in one worker.)"""
        self.launched.extend(candidates)
        for s in candidates:
            refused = self._refuse(s, bench)
            if refused is not None:
                return [dataclasses.replace(refused, settings=x) for x in candidates]
        ests = [self.memory(s) for s in candidates]
        over = self._together(candidates, ests)
        self._loaded = None  # the paired worker frees what it loaded
        loaded: set[tuple] = set()
        for s, e in zip(candidates, ests):
            if s.model_key not in loaded:
                loaded.add(s.model_key)
                self._load(s, e, None)
        if over is not None:
            return [self._oom(s, bench, e, over) for s, e in zip(candidates, ests)]
        speeds = [self.speed(s, bench) for s in candidates]
        for s, e, (pp, tg) in zip(candidates, ests, speeds):
            self._context(s, e)
            self._warm_up(s, bench, pp, tg)
        pps: list[list[float]] = [[] for _ in candidates]
        tgs: list[list[float]] = [[] for _ in candidates]
        for r in range(rounds):
            for _ in range(bench.repetitions):
                self.drift.step()
                for k in range(len(candidates)):
                    i = (k + r) % len(candidates)  # rotating order
                    pps[i].append(speeds[i][0] * self.drift.factor())
                    tgs[i].append(speeds[i][1] * self.drift.factor())
                    self._repetition(candidates[i], bench, *speeds[i], pps[i][-1], tgs[i][-1])
        return [self._ok(s, bench, e, pps[i], tgs[i]) for i, (s, e) in enumerate(zip(candidates, ests))]

    # -- time -----------------------------------------------------------------------------------------

    def _charge(self, kind: str, seconds: float) -> None:
        self.spent[kind] += seconds

    def _weights_fail(self, est: MemoryEstimate, device: str) -> bool:
        """Whether the weights alone do not fit ``device`` (llama.cpp then fails before reading any)."""
        if device == CPU:
            return False  # the host maps the file: its weights fail only with the rest, at the context
        return est.devices[device].weights > self.capacity.get(device, 0)

    def load_seconds(self, s: Settings, est: MemoryEstimate, *, cached: bool, fresh: bool = True) -> float:
        """Seconds to load ``s``'s model: the file read (from the page cache or the storage),
        overlapped with the accelerators' share going over their bus."""
        info = self.models[s.model_path]
        read = info.file_size / (PAGE_CACHE_BANDWIDTH if cached else self.storage.bandwidth)
        upload = 0.0
        for device, mem in est.devices.items():
            if device != CPU and mem.weights and not self.specs[device].unified:
                upload += mem.weights / (self.specs[device].link or PCIE4_X16).bandwidth
        return (PROCESS_START_S if fresh else 0.0) + MODEL_SETUP_S + max(read, upload)

    def _load(self, s: Settings, est: MemoryEstimate, over: str | None) -> float:
        """Charge one load of ``s``'s model (to where it fails, when ``over`` names a device that
        cannot hold its weights) and keep the page cache's state. Returns its seconds."""
        self.loads += 1
        fresh = True  # both engines start a process for a new model (the python engine retires its worker)
        if over is not None and self._weights_fail(est, over):
            seconds = PROCESS_START_S + MODEL_SETUP_S
            self._charge("load", seconds)
            return seconds
        path = s.model_path
        size = self.models[path].file_size
        cached = path in self._page_cache
        seconds = self.load_seconds(s, est, cached=cached, fresh=fresh)
        self._charge("load", seconds)
        # what the page cache keeps: the RAM the trial's own buffers leave
        room = self.capacity[CPU] - est.devices[CPU].kv - est.devices[CPU].compute
        if self.unified:
            room -= sum(m.kv + m.compute for d, m in est.devices.items() if d != CPU)
        self._page_cache.pop(path, None)
        if size > room:
            self._page_cache.clear()  # streaming a file larger than the cache leaves nothing else in it
        else:
            while self._page_cache and sum(self._page_cache.values()) + size > room:
                self._page_cache.popitem(last=False)
            self._page_cache[path] = size
        return seconds

    def _context(self, s: Settings, est: MemoryEstimate) -> None:
        clear = 0.0
        for device, mem in est.devices.items():
            bandwidth = self.host.bandwidth if device == CPU else self.specs[device].bandwidth
            clear += mem.kv / bandwidth
        self._charge("context", CONTEXT_SETUP_S + clear)

    def prefill_seconds(self, s: Settings, tokens: int) -> float:
        """Noiseless seconds to fill the cache with ``tokens`` tokens (the untimed depth)."""
        if tokens <= 0:
            return 0.0
        key = (s, tokens)
        if key not in self._prefill:
            pp, _ = self.speed(s, BenchSpec(n_prompt=tokens, n_gen=0, depth=0))
            self._prefill[key] = tokens / pp
        return self._prefill[key]

    def _warm_up(self, s: Settings, bench: BenchSpec, pp: float, tg: float) -> None:
        if not bench.warmup:
            return
        depth = self.prefill_seconds(s, bench.depth)
        regions = (1 if bench.n_prompt else 0) + (1 if bench.n_gen else 0)
        seconds = ((depth if self.depth_once else regions * depth) + (bench.n_prompt / pp if bench.n_prompt else 0.0)
                   + (min(bench.n_gen, WARMUP_GEN_TOKENS) / tg if bench.n_gen else 0.0))
        self._charge("warmup", seconds)

    def _repetition(self, s: Settings, bench: BenchSpec, pp: float, tg: float, pp_seen: float, tg_seen: float) -> None:
        """One repetition at the speeds measured (the untimed depth slowed as the timed part was)."""
        depth = 0.0 if self.depth_once else self.prefill_seconds(s, bench.depth)
        seconds = 0.0
        if bench.n_prompt:
            seconds += (depth + bench.n_prompt / pp) * pp / pp_seen
        if bench.n_gen:
            seconds += (depth + bench.n_gen / tg) * tg / tg_seen
        self._charge("measure", seconds)

    # -- memory -------------------------------------------------------------------------------------

    def memory(self, s: Settings) -> MemoryEstimate:
        """The memory arithmetic for ``s`` on this machine's devices."""
        return estimate(self.models[s.model_path], s, devices=self.names)

    def out_of_memory(self, est: MemoryEstimate) -> str | None:
        """The device that cannot hold its share (``CPU`` for the host), or None when all fit."""
        for device, mem in est.devices.items():
            if device != CPU and mem.total > self.capacity.get(device, 0):
                return device
        host = est.devices[CPU].total
        if self.unified:
            host += sum(m.total for d, m in est.devices.items() if d != CPU)
        return CPU if host > self.capacity[CPU] else None

    def _together(self, candidates: Sequence[Settings], ests: Sequence[MemoryEstimate]) -> str | None:
        """Where candidates loaded at once would run out: each loaded model's weights once, every
        context's cache and compute buffers."""
        need: dict[str, int] = {}
        loaded: set[tuple] = set()
        for s, est in zip(candidates, ests):
            first = s.model_key not in loaded
            loaded.add(s.model_key)
            for device, mem in est.devices.items():
                need[device] = need.get(device, 0) + (mem.weights if first else 0) + mem.kv + mem.compute
        for device, total in need.items():
            if total > self.capacity.get(device, 0):
                return device
        return None

    # -- speed --------------------------------------------------------------------------------------

    def speed(self, s: Settings, bench: BenchSpec = BenchSpec()) -> tuple[float, float]:
        """Noiseless (prompt t/s, generation t/s) for ``s``, whether or not it fits.

        With ``bench.users`` N > 1 (or ``bench.batched``), as llama-batched-bench measures (S_PP, S_TG): the N prompts fill
        the batch one sequence after another, so a micro-batch holds tokens of one or more sequences,
        each reading its own cache; a generation step is one micro-batch of N tokens, one per
        sequence: the weights are read once for all N, every sequence's cache is read for its token."""
        placement = self.placement(s)
        users = max(1, bench.users)
        served = bench.as_served  # one user measured as batched-bench does: generation after the prompt
        if not served:
            tg_time = self.time(s, self.work(s, 1, bench.depth + bench.n_gen / 2), placement)
        else:
            context = bench.depth + bench.n_prompt + bench.n_gen / 2
            tg_time = self.time(s, self.work(s, users, context, sequences=users), placement) / users
        pp_time = 0.0
        done = 0
        total = bench.n_prompt * users
        while done < total:  # prompts in batches of n_batch, each in micro-batches of n_ubatch
            batch = min(s.n_batch, total - done)
            start = done
            while start < done + batch:
                n = min(s.n_ubatch, done + batch - start)
                if not served:
                    context = bench.depth + start + n / 2
                    sequences = 1
                else:  # the sequences this micro-batch's tokens belong to, each at about half its prompt
                    first, last = start // bench.n_prompt, (start + n - 1) // bench.n_prompt
                    sequences = last - first + 1
                    context = bench.depth + min(bench.n_prompt, n / sequences) / 2
                pp_time += self.time(s, self.work(s, n, context, sequences=sequences), placement)
                start += n
            done += batch
        pp = total / pp_time if bench.n_prompt else 0.0
        return pp, 1.0 / tg_time

    def placement(self, s: Settings) -> list[str]:
        """The device of each layer 0..n_layer (the output head last), by llama.cpp's rule."""
        info = self.models[s.model_path]
        return layer_devices(info.n_layer, s.n_gpu_layers, self.names, s.tensor_split)

    def compiled(self, path: str) -> _Compiled:
        if path not in self._compiled:
            self._compiled[path] = _Compiled.of(self.models[path])
        return self._compiled[path]

    def work(self, s: Settings, n: int, context: float, *, sequences: int = 1) -> Work:
        """The bytes and FLOPs of one micro-batch of ``n`` tokens at ``context`` tokens of cache,
        the tokens spread over ``sequences`` sequences, each reading its own cache."""
        c = self.compiled(s.model_path)
        info = c.info
        used = min(1.0, info.expert_used_count / info.expert_count) if info.is_moe else 1.0
        # a micro-batch of n tokens touches this share of the routed experts' bytes
        touched = 1.0 - (1.0 - used) ** n
        bytes_read = c.n_bytes * np.where(c.routed, touched, 1.0)
        flops = 2.0 * n * c.elements * np.where(c.routed, used, 1.0)
        moved = c.mask(s.host_overrides)
        kv_per_token = c.kv_per_token(s.type_k, s.type_v)
        quantized = s.type_k not in _FLOAT_KV or s.type_v not in _FLOAT_KV
        kv_bytes = sequences * context * kv_per_token * (QUANTIZED_KV_COST if quantized else 1.0)
        has_kv = kv_per_token > 0
        if not flash_attn_forms(s.flash_attn).enabled:
            kv_bytes = kv_bytes + has_kv * 3.0 * n * context * info.n_head * 4  # f32 scores: written, softmaxed, read
        kv_flops = has_kv * 4.0 * n * context * info.n_head * info.head_size_k
        return Work(c.per_layer(bytes_read, ~moved), c.per_layer(flops, ~moved), c.per_layer(bytes_read, moved),
                    c.per_layer(flops, moved), kv_bytes, kv_flops, n)

    def threads(self, s: Settings, n: int) -> int:
        t = s.n_threads if n == 1 else (s.n_threads_batch or s.n_threads)
        return t or self.host.cores or 1

    def host_time(self, nbytes: np.ndarray, flops: np.ndarray, threads: int) -> np.ndarray:
        """Seconds on the host's cores: bandwidth saturates at half the physical cores; compute
        scales with the cores used; hyper-threads beyond the physical cores cost 10%."""
        cores = self.host.cores or 1
        bw = self.host.bandwidth * BANDWIDTH_EFFICIENCY["cpu"] * min(1.0, threads / max(1, cores // 2))
        compute = self.host.flops * MATMUL_EFFICIENCY["cpu"] * min(threads, cores) / cores
        return np.maximum(nbytes / bw, flops / compute) * (1.1 if threads > cores else 1.0)

    def host_weights_time(self, nbytes: np.ndarray, flops: np.ndarray, threads: int, n: int) -> np.ndarray:
        """Seconds for matmuls over weights the host keeps: on the host, or (op offload, a
        micro-batch of 32 tokens or more with a GPU present) streamed to the first GPU."""
        if self.names and n >= OP_OFFLOAD_MIN_BATCH:
            gpu = self.specs[self.names[0]]
            link = gpu.link or PCIE4_X16
            return np.maximum(nbytes / link.bandwidth, flops / (gpu.flops * MATMUL_EFFICIENCY["gpu"]))
        return self.host_time(nbytes, flops, threads)

    def gpu_time(self, device: str, nbytes: np.ndarray, flops: np.ndarray) -> np.ndarray:
        spec = self.specs[device]
        return np.maximum(nbytes / (spec.bandwidth * BANDWIDTH_EFFICIENCY["gpu"]), flops / (spec.flops * MATMUL_EFFICIENCY["gpu"]))

    def link(self, a: str, b: str) -> Link:
        """The bus between two devices (CPU included)."""
        if a == CPU or b == CPU:
            return self.specs[b if a == CPU else a].link or PCIE4_X16
        sa, sb = self.specs[a], self.specs[b]
        if sa.nvlink and sb.nvlink and sa.model == sb.model:
            return sa.nvlink
        la, lb = sa.link or PCIE4_X16, sb.link or PCIE4_X16
        # no peer-to-peer between consumer GPUs: through the host, both hops
        return Link(f"{la.name} via host", min(la.bandwidth, lb.bandwidth), la.latency + lb.latency)

    def crossing(self, a: str, b: str, nbytes: float) -> float:
        """Seconds to move ``nbytes`` of activations from device ``a`` to ``b``."""
        if a == b:
            return 0.0
        link = self.link(a, b)
        return link.latency + nbytes / link.bandwidth

    def layer_times(self, s: Settings, work: Work) -> dict[str, np.ndarray]:
        """Seconds each layer (0..n_layer, the output head last) costs if placed on each device,
        the moves out and back for its host-kept parts included."""
        info = self.models[s.model_path]
        threads = self.threads(s, work.tokens)
        n = work.tokens
        acts = n * info.n_embd * 4.0
        overhead = np.full(info.n_layer + 1, 1.0)
        overhead[-1] = 0.0
        host_kv = self.host_time(work.kv_bytes, work.kv_flops, threads)
        out = {CPU: self.host_weights_time(work.kept_bytes + work.moved_bytes, work.kept_flops + work.moved_flops, threads, n)
               + host_kv + overhead * LAYER_OVERHEAD_S["cpu"]}
        for device in self.names:
            there_and_back = 2 * self.crossing(device, CPU, acts)
            t = self.gpu_time(device, work.kept_bytes, work.kept_flops)
            t = t + np.where(work.moved_bytes > 0,
                             self.host_weights_time(work.moved_bytes, work.moved_flops, threads, n) + there_and_back, 0.0)
            if s.offload_kqv:
                t = t + self.gpu_time(device, work.kv_bytes, work.kv_flops)
            else:
                t = t + np.where(work.kv_bytes > 0, host_kv + there_and_back, 0.0)
            t = t + overhead * LAYER_OVERHEAD_S["gpu"]
            t[-1] += self.crossing(device, CPU, n * info.n_vocab * 4.0)  # the logits come back to the host
            out[device] = t
        return out

    def time(self, s: Settings, work: Work, placement: Sequence[str]) -> float:
        """Seconds for one micro-batch: each layer where it is placed, plus the moves between
        consecutive layers on different devices (the token embeddings start on the host)."""
        info = self.models[s.model_path]
        times = self.layer_times(s, work)
        acts = work.tokens * info.n_embd * 4.0
        total = 0.0
        previous = CPU
        for il, device in enumerate(placement):
            total += float(times[device][il]) + self.crossing(previous, device, acts)
            previous = device
        return total

    # -- results ------------------------------------------------------------------------------------

    def _refuse(self, s: Settings, bench: BenchSpec) -> TrialResult | None:
        # (a quantized V cache without flash attention, which llama.cpp refuses, is refused by Settings)
        if s.model_path not in self.models:
            # llama.cpp src/llama.cpp "%s: error loading model: %s" around src/llama-mmap.cpp "failed to open %s: %s" (2026)
            line = f"llama_model_load: error loading model: failed to open {s.model_path}: No such file or directory"
            return TrialResult(Outcome.LOAD_ERROR, f"llama.cpp refused the model: {line}", s, bench, load=LoadReport(errors=(line,)))
        return None

    def _report(self, s: Settings, est: MemoryEstimate, **extra: object) -> LoadReport:
        info = self.models[s.model_path]
        return LoadReport(
            layers_offloaded=est.layers_offloaded, layers_total=info.n_layer + 1,
            model_buffers={d: m.weights for d, m in est.devices.items() if m.weights},
            kv_buffers={d: m.kv for d, m in est.devices.items() if m.kv},
            compute_buffers={d: m.compute for d, m in est.devices.items() if m.compute},
            n_ctx=est.n_ctx, type_k=s.type_k, type_v=s.type_v, **extra,  # type: ignore[arg-type]
        )

    def _oom(self, s: Settings, bench: BenchSpec, est: MemoryEstimate, device: str) -> TrialResult:
        need = est.devices[device].total if device in est.devices else 0
        # src/llama-model.cpp "alloc_tensor_range: failed to allocate %s buffer of size %zu" (2026)
        line = f"alloc_tensor_range: failed to allocate {device} buffer of size {need}"
        load = LoadReport(layers_offloaded=est.layers_offloaded, layers_total=self.models[s.model_path].n_layer + 1, oom=True,
                          errors=(line, "llama_model_load: error loading model: unable to allocate buffer"))
        return TrialResult(Outcome.OOM, f"out of memory: {line}", s, bench, load=load)

    def _ok(self, s: Settings, bench: BenchSpec, est: MemoryEstimate, pps: list[float], tgs: list[float]) -> TrialResult:
        return TrialResult(
            Outcome.OK, "ok", s, bench,
            pp=Stats.of(pps) if bench.n_prompt else None,
            tg=Stats.of(tgs) if bench.n_gen else None,
            load=self._report(s, est),
            peak_rss=est.devices[CPU].total,
            # what NVML would show the process using on each discrete GPU: its buffers and llama.cpp's own context
            peak_vram={d: m.total + CONTEXT_OVERHEAD for d, m in est.devices.items()
                       if d in self.specs and m.total and not self.specs[d].unified},
        )


__all__ = ["COSTS", "DEVICES", "STORAGE", "DeviceSpec", "Drift", "Link", "RooflineEngine", "Storage"]
