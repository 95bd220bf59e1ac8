"""A llama.cpp log in plain words: what happened, where the memory went, and what would fix it.

``diagnose(text, model=None, machine=None)`` reads a load log (any era and carrier ``parse_log``
reads) and returns a ``Diagnosis``:

- **what happened**: layers offloaded of the total, partial offload, out of memory and on which
  device, a silent CPU fallback (``offloaded N/N`` but every buffer on the CPU), context and KV types;
- **memory** per device: weights, KV cache, compute buffers, and free memory where the log says;
- **levers**, ranked by predicted effect, each with numbers and whether it reaches full offload:
  every layer (when the device had room and only ``-ngl`` was short), the largest standard
  quantization that fits entirely, how far the context must shrink, a q8_0 / q4_0 KV cache, the MoE
  experts or FFN of N layers on the CPU, the KV cache on the host, and on this machine the
  processes holding GPU memory now (NVML) when the log is from here.

How the levers are sized, best first (``Diagnosis.sizing`` says which was used):

1. ``model``: the model file (``--model``): its tensors, requantized tensor by tensor by
   ``model/quant.py``, through the memory arithmetic (``model/estimate.py``);
2. ``log shape``: the shape the log's metadata dump states (``print_info``), rebuilt as a
   llama-family model (``model/synthetic.py``) in the log's file type and scaled to the log's weights;
3. ``log buffers``: the log's own buffer sizes, per layer and per token (no shape: experts and FFN
   cannot be told apart, so those levers are left out, and quantization sizes are scaled by bits
   per weight of a Llama-3-8B-shaped model).

In the first two, what the arithmetic predicts for the log's own placement is compared with what
llama.cpp allocated, and the difference (per device) is carried into every lever: the levers
start from the log's real numbers.

Capacity (what each accelerator can give) comes from ``machine`` (``--device NAME=SIZE``), else the
free memory the log printed before loading, else, when the log is from this machine, what NVML
says is free now. Without any, a lever's bytes are still given and ``reaches_full_offload`` is null.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..engine.logfacts import LogFacts, log_facts
from ..engine.logparse import LoadReport, _is_host_label, _normalise_device, parse_log
from ..engine.dimensions import UNQUANTIZED_KV
from ..engine.settings import Settings
from ..errors import LogUnreadableError, SettingsError, TunerError
from ..limits import MAX_DEVICES
from ..machine.whatif import MachineSpec, device_matches
from ..model.estimate import CPU, estimate, pad
from ..model.inspect import KV_TYPE_BLOCKS, ModelInfo
from ..model.quant import FILE_TYPES, STANDARD, quantized_size, requantized
from .fit import DEFAULT_MARGIN
from .summary import gib, offload_summary

MiB = 1 << 20
# KV bytes per element of each cache type (block bytes / block elements)
_KV_BYTES = {t: size / block for t, (block, size) in KV_TYPE_BLOCKS.items()}
_MIN_CTX = 256


@dataclass(frozen=True)
class WhatHappened:
    layers_offloaded: int | None
    layers_total: int | None
    partial_offload: bool | None
    oom: bool
    oom_device: str | None
    cpu_fallback: bool | None
    n_ctx: int | None
    type_k: str | None
    type_v: str | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DeviceUse:
    weights: int | None = None
    kv: int | None = None
    compute: int | None = None
    free: int | None = None

    @property
    def used(self) -> int:
        return (self.weights or 0) + (self.kv or 0) + (self.compute or 0)

    def to_dict(self) -> dict[str, int | None]:
        return {"weights": self.weights, "kv": self.kv, "compute": self.compute, "free": self.free}


@dataclass(frozen=True)
class Lever:
    """One change, with what it frees on the accelerators and whether the whole model then fits.

    ``settings`` is the change as ``Settings`` fields (``n_ctx``, ``type_k``, ``tensor_overrides``,
    ``offload_kqv``, ``n_gpu_layers``) and ``quantization`` the file to use instead, for code that
    applies a lever; the JSON carries the issue's five keys only.
    """

    lever: str
    change: str
    frees_bytes: int | None
    reaches_full_offload: bool | None
    explanation: str
    settings: dict[str, Any] = field(default_factory=dict, compare=False)
    quantization: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {"lever": self.lever, "change": self.change, "frees_bytes": self.frees_bytes,
                "reaches_full_offload": self.reaches_full_offload, "explanation": self.explanation}


@dataclass(frozen=True)
class Diagnosis:
    what_happened: WhatHappened
    memory: dict[str, DeviceUse]
    levers: tuple[Lever, ...]
    summary: str
    sizing: str | None = None           # "model", "log shape", "log buffers", or None (no levers)
    notes: tuple[str, ...] = ()
    capacity: dict[str, int] = field(default_factory=dict)  # accelerator -> bytes it can give, where known

    def to_dict(self) -> dict[str, Any]:
        """Exactly the JSON the issue specifies (bytes; null where unknown)."""
        return {"what_happened": self.what_happened.to_dict(),
                "memory": {name: use.to_dict() for name, use in self.memory.items()},
                "levers": [lever.to_dict() for lever in self.levers]}

    def format(self) -> str:
        w = self.what_happened
        lines = [self.summary]
        if w.n_ctx or w.type_k:
            lines.append(f"context: n_ctx {w.n_ctx if w.n_ctx is not None else '?'}, KV cache K {w.type_k or '?'} / V {w.type_v or '?'}")
        if self.memory:
            lines.append(f"memory per device (MiB):  {'weights':>10} {'KV':>10} {'compute':>10} {'free before load':>17}")
            for name, use in self.memory.items():
                cells = [f"{v / MiB:>10.1f}" if v is not None else f"{'-':>10}" for v in (use.weights, use.kv, use.compute)]
                free = f"{use.free / MiB:>17.0f}" if use.free is not None else f"{'-':>17}"
                lines.append(f"  {name:<24}{' '.join(cells)} {free}")
        if self.levers:
            lines.append("levers, most effective first:")
            for i, lever in enumerate(self.levers, 1):
                frees = f"frees {gib(lever.frees_bytes)}" if lever.frees_bytes else "frees nothing"
                reach = {True: "reaches full offload", False: "does not reach full offload",
                         None: "full offload: unknown (how much memory the device has is not known)"}[lever.reaches_full_offload]
                lines.append(f"  {i}. {lever.lever}: {lever.change}  ({frees}; {reach})")
                lines.append(f"     {lever.explanation}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# -- reading the log ------------------------------------------------------------------------------


def _device_of(label: str) -> str:
    if _is_host_label(label) or label in ("compute buffer total", "CPU input"):
        return CPU
    if label.endswith(" input"):
        label = label[: -len(" input")]
    return _normalise_device(label)


def _memory(report: LoadReport, spec_names: Sequence[str] = ()) -> dict[str, DeviceUse]:
    weights: dict[str, int] = {}
    for label, size in report.model_buffers.items():
        device = CPU if _is_host_label(label) else _normalise_device(label)
        weights[device] = weights.get(device, 0) + size
    if "VRAM" in weights and weights["VRAM"] == 0 and len([w for w in weights if w not in (CPU, "VRAM")]):
        del weights["VRAM"]  # llamafile's "VRAM used: 0.00 MB" next to named Metal buffers
    kv: dict[str, int] = {}
    for label, size in report.kv_buffers.items():
        device = _device_of(label)
        kv[device] = kv.get(device, 0) + size
    compute: dict[str, int] = {}
    for label, size in report.compute_buffers.items():
        if label == "VRAM scratch":
            device = "VRAM"
        else:
            device = _device_of(label)
        compute[device] = compute.get(device, 0) + size
    names = list(dict.fromkeys([CPU] + [n for n in (*weights, *kv, *compute) if n != CPU]))
    # device_matches through two indexes (the name without case, and without its "[host:port]"), so
    # this is linear in the devices a log names: 10^5 "using device" lines once took minutes
    exact: dict[str, int] = {}
    by_base: dict[str, int] = {}
    for k, v in report.devices.items():
        exact.setdefault(k.lower(), v)
        by_base.setdefault(k.lower().split("[", 1)[0], v)

    def free_of(name: str) -> int | None:
        low = name.lower()
        for value in (exact.get(low), by_base.get(low), exact.get(low.split("[", 1)[0])):
            if value is not None:
                return value
        return None

    out: dict[str, DeviceUse] = {}
    for name in names:
        out[name] = DeviceUse(weights.get(name), kv.get(name), compute.get(name), free_of(name))
    # devices the log says were there (free memory printed) but got nothing
    named = {n.lower() for n in out}
    named_base = {n.lower().split("[", 1)[0] for n in out}
    for k, v in report.devices.items():
        low = k.lower()
        if low not in named and low.split("[", 1)[0] not in named and low not in named_base:
            out[k] = DeviceUse(None, None, None, v)
            named.add(low)
            named_base.add(low.split("[", 1)[0])
    if out.get(CPU) == DeviceUse():
        del out[CPU]
    return out


def _unreadable(report: LoadReport, facts: LogFacts) -> str | None:
    """Why this text cannot be diagnosed, or None when it can."""
    if (report.layers_offloaded is not None or report.model_buffers or report.kv_buffers or report.compute_buffers
            or report.oom or facts.oom_device or report.processor_split
            or report.prompt_tps is not None or report.eval_tps is not None):
        return None
    found = []
    if facts.meta:
        found.append("the model's metadata")
    if report.prompt_tps is not None or report.eval_tps is not None:
        found.append("timings")
    if report.n_ctx is not None:
        found.append("a context size")
    seen = f" (it has {', '.join(found)} only)" if found else ""
    return ("no llama.cpp load lines in this log" + seen + ": diagnose needs the lines llama.cpp prints while "
            "loading ('offloaded N/M layers to GPU', '... model buffer size = ...', 'KV buffer size', "
            "'compute buffer size') or an out-of-memory line; run llama.cpp with its full output (2>&1) "
            "and paste everything from the start")


# -- sizing -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Change:
    quantization: str | None = None
    n_ctx: int | None = None
    type_k: str | None = None
    type_v: str | None = None
    offload_kqv: bool = True
    cpu_ffn_layers: int = 0
    cpu_expert_layers: int = 0


def _layers_regex(n: int, part: str) -> str:
    """Tensors of the first ``n`` layers, as llama.cpp's ``--n-cpu-moe``/``-ot`` would keep them."""
    return rf"^blk\.({'|'.join(str(i) for i in range(n))})\.{part}"


_EXPERTS = r"ffn_(up|down|gate|gate_up)_(ch)?exps"
_FFN = r"ffn_(up|down|gate)(_shexp)?\."


class _ModelSizer:
    """Full-offload bytes per accelerator from a ModelInfo (the file's, or a rebuilt one), through
    the memory arithmetic with the log's settings (``base``, a ``Settings``)."""

    def __init__(self, info: ModelInfo, kind: str, devices: list[str], base: Settings) -> None:
        self.info, self.kind, self.devices, self.base = info, kind, devices, base
        self.offset: dict[str, int] = {}
        self._variants: dict[str, ModelInfo] = {}

    @property
    def quantization(self) -> str | None:
        q = self.info.quantization
        return q if q in FILE_TYPES else None

    @property
    def is_moe(self) -> bool:
        return self.info.is_moe

    @property
    def n_layer(self) -> int:
        return self.info.n_layer

    def estimate(self, change: _Change, n_gpu_layers: int = -1):
        info = self.info
        if change.quantization and change.quantization != self.info.quantization:
            if change.quantization not in self._variants:
                self._variants[change.quantization] = requantized(self.info, change.quantization)
            info = self._variants[change.quantization]
        overrides = list(self.base.tensor_overrides)
        if change.cpu_expert_layers:
            overrides.append(_layers_regex(change.cpu_expert_layers, _EXPERTS))
        if change.cpu_ffn_layers:
            overrides.append(_layers_regex(change.cpu_ffn_layers, _FFN))
        changes: dict[str, Any] = {"n_gpu_layers": n_gpu_layers, "offload_kqv": change.offload_kqv,
                                   "tensor_overrides": tuple(overrides)}
        if change.n_ctx:
            changes["n_ctx"] = change.n_ctx
        if change.type_k:
            changes.update(type_k=change.type_k, type_v=change.type_v or change.type_k)
            if change.type_k not in UNQUANTIZED_KV and self.base.flash_attn == "off":
                changes["flash_attn"] = "on"  # a quantized V cache needs flash attention
        return estimate(info, self.base.replace(**changes), devices=self.devices)

    def need(self, change: _Change) -> dict[str, int]:
        est = self.estimate(change)
        return {d: est.devices[d].total + self.offset.get(d, 0) for d in self.devices}

    def calibrate(self, memory: Mapping[str, DeviceUse], layers_offloaded: int) -> None:
        """What llama.cpp allocated minus what the arithmetic predicts for the log's own placement,
        per device, over the parts the log shows (an excerpt may lack the compute lines)."""
        est = self.estimate(_Change(), n_gpu_layers=layers_offloaded)
        for d in self.devices:
            use = memory.get(d)
            if use is None:
                continue
            mem = est.devices[d]
            self.offset[d] = sum(actual - predicted for actual, predicted in
                                 ((use.weights, mem.weights), (use.kv, mem.kv), (use.compute, mem.compute))
                                 if actual is not None)


class _LogSizer:
    """Full-offload bytes per accelerator from the log's buffers alone (no shape)."""

    kind = "log buffers"
    is_moe = False

    def __init__(self, *, devices: list[str], shares: list[float], n_layer: int, movable_weights: int,
                 device_weights: int, kv_total: int | None, kv_type: str, n_ctx: int, compute: dict[str, int],
                 quantization: str | None) -> None:
        self.devices, self.shares, self.n_layer = devices, shares, n_layer
        self.movable, self.device_weights, self.kv_total = movable_weights, device_weights, kv_total or 0
        self.kv_type, self.n_ctx, self.compute, self.quantization = kv_type, n_ctx, compute, quantization
        self._bpw: dict[str, float] = {}

    def _bits(self, quant: str) -> float:
        if not self._bpw:
            from ..model.synthetic import llama_like

            ref = llama_like(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256)
            self._bpw = {q: quantized_size(ref, q).bits_per_weight for q in FILE_TYPES}
        return self._bpw[quant]

    def need(self, change: _Change) -> dict[str, int]:
        weights = self.device_weights + self.movable
        if change.quantization and self.quantization and change.quantization != self.quantization:
            weights = int(weights * self._bits(change.quantization) / self._bits(self.quantization))
        kv = 0
        if change.offload_kqv:
            kv = self.kv_total
            if change.n_ctx:
                kv = int(kv * pad(change.n_ctx, 256) / max(1, pad(self.n_ctx, 256)))
            new_k = change.type_k or self.kv_type
            kv = int(kv * _KV_BYTES.get(new_k, 2.0) / _KV_BYTES.get(self.kv_type, 2.0))
        total = weights + kv
        return {d: int(total * s) + self.compute.get(d, 0) for d, s in zip(self.devices, self.shares)}


# -- the diagnosis --------------------------------------------------------------------------------


def diagnose(
    text: str | bytes,
    *,
    model: ModelInfo | None = None,
    machine: MachineSpec | None = None,
    local_gpus: Sequence[Any] | None | bool = None,
    margin: int = DEFAULT_MARGIN,
) -> Diagnosis:
    """Diagnose a llama.cpp log. ``model``: the model it loaded (exact tensor sizes); ``machine``:
    what each accelerator can give (overrides the log's free memory); ``local_gpus``: this machine's
    GPUs as ``machine.probe.probe_gpus()`` returns them (None: probe NVML; False: do not look).

    Raises ``LogUnreadableError`` when the text has no load lines, naming what was missing.
    """
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    if not text or not text.strip():
        raise LogUnreadableError("the log is empty: paste or pipe llama.cpp's output (2>&1), from its first line")
    report = parse_log(text)
    facts = log_facts(text)
    why = _unreadable(report, facts)
    if why:
        raise LogUnreadableError(why)
    memory = _memory(report)
    notes: list[str] = []

    accelerators = [d for d in memory if d != CPU]
    if len(accelerators) > MAX_DEVICES:
        raise LogUnreadableError(f"this log names {len(accelerators)} devices, and llama.cpp uses at most {MAX_DEVICES}: "
                                 "it is not the log of one llama.cpp run; paste the log of the run to diagnose")
    oom_device = None
    if facts.oom_device:
        oom_device = next((d for d in accelerators if device_matches(d, facts.oom_device)), None)
        if oom_device is None:
            oom_device = _normalise_device(facts.oom_device) if not _is_host_label(facts.oom_device) else CPU
            if oom_device != CPU:
                accelerators.append(oom_device)
    elif report.oom and len(accelerators) == 1 and facts.oom_what:
        oom_device = accelerators[0]
    cpu_fallback: bool | None = None
    if report.layers_offloaded is not None:
        cpu_fallback = report.offload_fell_back
    what = WhatHappened(
        layers_offloaded=report.layers_offloaded, layers_total=report.layers_total,
        partial_offload=None if cpu_fallback is None and report.layers_offloaded is None else
        (False if cpu_fallback else report.partial_offload),
        oom=bool(report.oom), oom_device=oom_device, cpu_fallback=cpu_fallback,
        n_ctx=report.n_ctx, type_k=report.type_k, type_v=report.type_v,
    )
    free_after = {d: (use.free - use.used) for d, use in memory.items()
                  if d != CPU and use.free is not None and not report.oom}
    summary = offload_summary(report.layers_offloaded, report.layers_total, free_after, oom=bool(report.oom),
                              oom_device=oom_device, oom_what=facts.oom_what, cpu_fallback=bool(cpu_fallback),
                              cpu_only=report.cpu_only)
    notes.extend(report.notes)
    if report.processor_split and report.layers_offloaded is None:
        # `ollama ps` pasted: its PROCESSOR column is the only placement fact
        cpu, gpu = report.processor_split.get("CPU", 0), report.processor_split.get("GPU", 0)
        what = dataclasses.replace(what, partial_offload=report.partial_offload)
        summary = (f"partial offload: Ollama runs {gpu}% of the model on the GPU and {cpu}% on the CPU (ollama ps)"
                   if report.partial_offload else f"{'full offload' if gpu == 100 else 'no offload (CPU only)'}: "
                   f"Ollama runs {max(cpu, gpu)}% of the model on the {'GPU' if gpu == 100 else 'CPU'} (ollama ps)")
        if report.partial_offload:
            notes.append("ollama ps shows the split only; for the levers, paste Ollama's server log of this load "
                         "(journalctl -u ollama, or the container's log) or give --model MODEL --device NAME=SIZE")
        return Diagnosis(what, memory, (), summary, None, tuple(notes), {})
    if report.layers_offloaded is None and not (report.model_buffers or report.kv_buffers or report.compute_buffers
                                                or report.oom or facts.oom_device):
        # a log of timings only (llama-server's JSON log of requests): its speeds are what it says
        speeds = ", ".join(f"{name} {value:.2f} tokens/s" for name, value in
                           (("prompt", report.prompt_tps), ("generation", report.eval_tps)) if value is not None)
        summary = f"speed: {speeds}; where the layers went is not in this log (it has no load lines)"
        notes.append("for a diagnosis of the load, paste the log from the server's start (llama.cpp prints the "
                     "load lines then), with its full output (2>&1)")
        return Diagnosis(what, memory, (), summary, None, tuple(notes), {})

    if model is not None:
        n_log = (report.layers_total - 1) if report.layers_total else facts.meta.get("n_layer")
        if n_log and n_log != model.n_layer and not (report.layers_total and report.layers_total - 1 > model.n_layer
                                                      and facts.meta.get("n_layer") == model.n_layer):
            raise TunerError(f"--model {model.path} has {model.n_layer} layers but the log loaded a model with {n_log}: "
                             "give the model file the log loaded")

    # the devices to size for: the log's accelerators, and any the user described
    if machine is not None:
        for name in machine.devices:
            if not any(device_matches(name, d) for d in accelerators):
                accelerators.append(name)
    capacity: dict[str, int] = {}
    for d in accelerators:
        given = next((v for k, v in (machine.devices if machine else {}).items() if device_matches(k, d)), None)
        if given is not None:
            capacity[d] = given
        elif d in memory and memory[d].free is not None:
            capacity[d] = memory[d].free
    if report.oom and facts.oom_request:
        asked = {"weights": "weights", "kv": "the KV cache", "compute": "compute buffers"}.get(facts.oom_what or "", "memory")
        notes.append(f"the allocation that failed asked {oom_device or 'the device'} for {gib(facts.oom_request)} of {asked}")
    if oom_device in capacity and facts.oom_request and facts.oom_request <= capacity[oom_device] and not (
            machine and any(device_matches(k, oom_device) for k in machine.devices)):
        notes.append(f"the log says {oom_device} had {gib(capacity[oom_device])} free, yet an allocation of "
                     f"{gib(facts.oom_request)} failed there: that free figure is not what the device could give "
                     "(RPC servers report their host's memory; or something else took it); give "
                     f"--device {oom_device.split('[')[0]}=SIZE")
        del capacity[oom_device]
    gpus = _local_gpus(local_gpus)
    here = _log_is_from_here(facts, gpus)
    if here:
        for d, gpu in here.items():
            if d in accelerators and d not in capacity:
                capacity[d] = gpu.memory_free
                notes.append(f"{d} is this machine's {gpu.name} (NVML): {gib(gpu.memory_free)} free now")

    repack_crash = _repack_crash(text, report)
    if repack_crash is not None:
        return Diagnosis(what, memory, (repack_crash,), summary + "; then llama.cpp crashed after repacking weights",
                         None, tuple(notes), capacity)
    if cpu_fallback:
        levers = [Lever(
            "a working GPU backend", "rebuild llama.cpp / llama-cpp-python for the GPU (CMAKE_ARGS, see the README), "
            "then check `offload-tuner probe` says GPU offload: yes", None, None,
            f"llama.cpp reported {report.layers_offloaded}/{report.layers_total} layers offloaded but put every "
            "buffer on the CPU: the build has no usable GPU backend (a CPU-only build, a driver it could not use, "
            "or a backend that failed to start). Memory is not the problem; no memory lever applies.")]
        return Diagnosis(what, memory, tuple(levers), summary, None, tuple(notes), capacity)
    full = report.layers_total is not None and report.layers_offloaded is not None and \
        report.layers_offloaded >= report.layers_total and not report.oom
    if full:
        notes.append("every layer is on the GPU: there is nothing to fix in this load")
        return Diagnosis(what, memory, (), summary, None, tuple(notes), capacity)
    if not accelerators:
        # (one fact, LoadReport.cpu_only, says whether the run used an accelerator: a log that
        # offloaded layers is never called CPU-only because its accelerators' memory lines are missing)
        if report.cpu_only:
            notes.append("no accelerator appears in this log (a CPU-only run); give --device NAME=SIZE to ask "
                         "what would fit on a GPU")
        else:
            notes.append("the log does not say how much memory each accelerator used, so no lever can be sized; "
                         "paste the whole log, or give --model MODEL --device NAME=SIZE")
        return Diagnosis(what, memory, (), summary, None, tuple(notes), capacity)

    sizer = _sizer(report, facts, memory, accelerators, capacity, model, notes)
    if sizer is None:
        return Diagnosis(what, memory, (), summary, None, tuple(notes), capacity)
    levers = _levers(sizer, report, facts, accelerators, capacity, margin, gpus, here, notes)
    return Diagnosis(what, memory, tuple(levers), summary, sizer.kind, tuple(notes), capacity)


# How a crash ends a log: the shell's report of the signal, ggml's abort, a backtrace
# (ggml/src/ggml.c ggml_abort: "%s:%d: %s" after "GGML_ASSERT(...) failed"; ggml_print_backtrace),
# Python's faulthandler ("Fatal Python error: Segmentation fault")
_CRASH_RE = re.compile(r"Segmentation fault|SIGSEGV|signal 11\b|Aborted|core dumped|GGML_ASSERT\(.*\) failed|"
                       r"ggml_abort|Illegal instruction|SIGILL|Fatal Python error|exit status 0xc0000005|"
                       r"exit code -1073741819|signal: segmentation fault")
# What a log prints once the model is loaded and before (or at) the first decode: the context's own
# lines, the warm-up (common.cpp "warming up the model with an empty run"), llama-bench's first row
_AFTER_LOAD_RE = re.compile(r"llama_context:|llama_init_from_model|warming up the model|common_init_from_params|"
                            r"sched_reserve|llama_kv_cache|load_model|main: ")
_REPACK_LABELS = ("AMX", "CPU_REPACK", "CPU_AARCH64")
# "load_tensors: %12s model buffer size = %8.2f MiB" (src/llama-model.cpp)
_REPACK_BUFFER_RE = re.compile(r"\b(AMX|CPU_REPACK|CPU_AARCH64) model buffer size\s*=")


def _repack_crash(text: str, report: LoadReport) -> Lever | None:
    """The lever for a log where llama.cpp repacked weights (an ``AMX`` or ``CPU_REPACK`` model buffer)
    and then crashed at the first decode or the warm-up, before any timing: ``--no-repack``."""
    labels = [label for label in report.model_buffers if label in _REPACK_LABELS]
    buffer = _REPACK_BUFFER_RE.search(text)
    if not labels and buffer is None:
        return None
    after = text[buffer.end():] if buffer is not None else text
    crash = _CRASH_RE.search(after)
    if crash is None or report.eval_tps is not None:
        return None  # it ran (timings printed), or the log does not show it ending in a crash
    label = labels[0] if labels else buffer.group(1) if buffer is not None else "CPU_REPACK"
    amx = label == "AMX" or "AMX_INT8 = 1" in text
    where = "at the first decode" if _AFTER_LOAD_RE.search(after[: crash.start()]) else "right after loading"
    fault = (" This is a known llama.cpp fault on CPUs with AMX (Sapphire, Emerald and Granite Rapids Xeons): "
             "ggml-org/llama.cpp#20824.") if amx else ""
    return Lever(
        "weight repacking off",
        "--no-repack (LLAMA_ARG_REPACK=0 for llama-server; llama-bench --repack 0; "
        "llama_model_params.use_extra_bufts = false; repack: false in a profile)",
        None, None,
        f"llama.cpp repacked weights into its {label} buffer ({gib(report.model_buffers.get(label, 0))}) and then "
        f"crashed {where} ({crash.group(0)}).{fault} Loading with repacking off keeps the weights in the plain "
        "CPU buffer (or the mapped file), which runs; memory is not the problem. `offload-tuner tune` finds this "
        "by itself and records repack: false in the profile.")


def _local_gpus(local_gpus: Sequence[Any] | None | bool) -> Sequence[Any]:
    if local_gpus is False:
        return ()
    if local_gpus is None or local_gpus is True:
        from ..machine.probe import probe_gpus

        return probe_gpus()[0]
    return local_gpus


def _log_is_from_here(facts: LogFacts, gpus: Sequence[Any]) -> dict[str, Any]:
    """The log's CUDA devices that are this machine's GPUs: same index, same model name."""
    out = {}
    for gpu in gpus:
        name = facts.device_names.get(f"CUDA{gpu.index}")
        if name and name.strip().lower() == gpu.name.strip().lower():
            out[f"CUDA{gpu.index}"] = gpu
    return out


def _sizer(report: LoadReport, facts: LogFacts, memory: Mapping[str, DeviceUse], accelerators: list[str],
           capacity: Mapping[str, int], model: ModelInfo | None, notes: list[str]):
    n_ctx = report.n_ctx or 4096
    type_k = report.type_k or "f16"
    overrides: tuple[str, ...] = ()
    if facts.overridden_to_cpu:
        overrides = ("^(" + "|".join(re.escape(n) for n in facts.overridden_to_cpu) + ")$",)
    split = (tuple(float(capacity[d]) for d in accelerators) if len(accelerators) > 1 and all(d in capacity for d in accelerators)
             else None)
    base = _log_settings(model.path if model else "log", report, facts, overrides, split)
    info, kind = model, "model"
    if info is None:
        shape = facts.shape()
        if shape is not None:
            info, kind = _rebuilt(shape, facts, report, notes), "log shape"
    if info is not None:
        sizer = _ModelSizer(info, kind, accelerators, base.replace(model_path=info.path))
        if (report.layers_offloaded is not None and not report.oom and report.model_buffers
                and (len(accelerators) == 1 or split is not None)):
            sizer.calibrate(memory, report.layers_offloaded)
        return sizer
    # no shape: the log's buffers
    n_layer = (report.layers_total - 1) if report.layers_total else facts.meta.get("n_layer")
    if not n_layer:
        notes.append("the log says neither how many layers the model has nor its shape, so no lever can be sized; "
                     "give --model MODEL")
        return None
    host = memory.get(CPU, DeviceUse())
    device_weights = sum(memory[d].weights or 0 for d in accelerators if d in memory)
    offloaded = report.layers_offloaded or 0
    remaining = max(0, n_layer + 1 - offloaded)
    if report.model_buffers:
        # the host keeps the token embeddings (about one layer's worth) and the layers not offloaded
        movable = int((host.weights or 0) * remaining / (remaining + 1)) if remaining else 0
    elif facts.file_size:
        movable = int(facts.file_size * (n_layer + 1) / (n_layer + 2))  # the load failed before any buffer
    else:
        notes.append("the log shows no weight buffers and no model size, so no lever can be sized; give --model MODEL")
        return None
    kv_total = report.kv_size
    shares = ([capacity[d] / sum(capacity[x] for x in accelerators) for d in accelerators]
              if all(d in capacity for d in accelerators) else [1 / len(accelerators)] * len(accelerators))
    compute = {d: memory[d].compute or 0 for d in accelerators if d in memory}
    notes.append("sized from the log's buffers (the log does not state the model's shape): per-layer bytes are "
                 "averages and the token embeddings are taken as one layer's worth; --model MODEL makes it exact")
    return _LogSizer(devices=accelerators, shares=shares, n_layer=n_layer, movable_weights=movable,
                     device_weights=device_weights, kv_total=kv_total, kv_type=type_k, n_ctx=n_ctx, compute=compute,
                     quantization=facts.quantization)


def _log_settings(path: str, report: LoadReport, facts: LogFacts, overrides: tuple[str, ...],
                  split: tuple[float, ...] | None) -> Settings:
    """The settings the log ran with, as far as it says (llama.cpp's defaults for the rest)."""
    type_k = report.type_k if report.type_k in KV_TYPE_BLOCKS else "f16"
    type_v = report.type_v if report.type_v in KV_TYPE_BLOCKS else type_k
    flash = {True: "on", False: "off", None: "auto"}[facts.flash_attn]
    if type_v not in UNQUANTIZED_KV and flash == "off":
        flash = "auto"
    n_ubatch = facts.n_ubatch if facts.n_ubatch and 0 < facts.n_ubatch <= 1 << 16 else 512
    n_ctx = report.n_ctx if report.n_ctx and 0 < report.n_ctx <= 1 << 24 else 4096
    try:
        return Settings(model_path=path, n_gpu_layers=-1, n_ctx=n_ctx, n_batch=max(2048, n_ubatch), n_ubatch=n_ubatch,
                        flash_attn=flash, type_k=type_k, type_v=type_v, tensor_overrides=overrides, tensor_split=split)
    except SettingsError:
        return Settings(model_path=path, n_gpu_layers=-1, n_ctx=n_ctx, tensor_overrides=overrides, tensor_split=split)


def _rebuilt(shape: dict[str, int], facts: LogFacts, report: LoadReport, notes: list[str]) -> ModelInfo | None:
    """The log's model rebuilt from its shape, in its file type, scaled to its weights; None when
    the rebuild is too far from the log's weights to be this model (an architecture whose tensors
    a llama-family shape does not describe)."""
    from ..model.quant import with_tensors
    from ..model.synthetic import llama_like

    info = llama_like(n_layer=shape["n_layer"], n_embd=shape["n_embd"], n_head=shape["n_head"],
                      n_head_kv=shape["n_head_kv"], n_ff=shape["n_ff"], n_vocab=shape["n_vocab"],
                      n_expert=shape.get("n_expert", 0), n_expert_used=shape.get("n_expert_used", 0),
                      n_ff_exp=shape.get("n_ff_exp"), n_expert_shared=shape.get("n_expert_shared", 0),
                      head_dim=shape.get("n_embd_head_k"), n_ctx_train=shape.get("n_ctx_train", 4096),
                      architecture=str(facts.meta.get("arch", "llama")))
    if facts.quantization in FILE_TYPES:
        info = requantized(info, facts.quantization)
    real = sum(report.model_buffers.values()) or facts.file_size
    rebuilt = sum(t.n_bytes for t in info.tensors)
    if real and rebuilt:
        scale = real / rebuilt
        if not 0.67 <= scale <= 1.5:
            notes.append(f"the shape the log states rebuilds a model of {gib(rebuilt)}, but its weights are {gib(real)}: "
                         f"this architecture ({facts.meta.get('arch', '?')}) is not a llama-family layout, so the "
                         "levers are sized from the log's buffers")
            return None
        if abs(scale - 1) > 0.02:
            tensors = [dataclasses.replace(t, n_bytes=int(t.n_bytes * scale)) for t in info.tensors]
            info = with_tensors(info, tensors, info.quantization)
            notes.append(f"the model was rebuilt from the shape the log states; its tensors were scaled by {scale:.2f} "
                         "to the log's weights (architecture details a shape does not show)")
    return info


def _fits(need: Mapping[str, int], capacity: Mapping[str, int], margin: int) -> bool | None:
    if not all(d in capacity for d in need):
        return None
    return all(need[d] <= capacity[d] - margin for d in need)


def _short(need: Mapping[str, int], capacity: Mapping[str, int], margin: int) -> str:
    parts = []
    for d, n in need.items():
        if d in capacity:
            parts.append(f"{gib(n)} on {d} of {gib(capacity[d])}" + (f" less a {margin // MiB} MiB margin" if margin else ""))
        else:
            parts.append(f"{gib(n)} on {d}")
    return "; ".join(parts)


def _levers(sizer: Any, report: LoadReport, facts: LogFacts, accelerators: list[str], capacity: Mapping[str, int],
            margin: int, gpus: Sequence[Any], here: Mapping[str, Any], notes: list[str]) -> list[Lever]:
    base = _Change()
    need0 = sizer.need(base)
    total0 = sum(need0.values())
    fits0 = _fits(need0, capacity, margin)
    n_ctx = report.n_ctx or 4096
    type_k = report.type_k or "f16"
    levers: list[Lever] = []

    def frees(need: Mapping[str, int]) -> int:
        return max(0, total0 - sum(need.values()))

    unknown = [d for d in accelerators if d not in capacity]
    if unknown:
        notes.append(f"how much memory {', '.join(unknown)} can give is not in the log: levers show bytes only; "
                     f"give --device {unknown[0]}=SIZE to know which reach full offload")
    notes.append(f"full offload at these settings needs {_short(need0, capacity, margin)}")

    if fits0:
        # nothing needs to change but the layer count: the other levers would only cost quality or speed
        return [Lever(
            "every layer", f"n_gpu_layers {report.layers_offloaded if report.layers_offloaded is not None else '?'} -> all (-ngl 99)",
            0, True, f"the accelerators have room for the whole model at these settings ({_short(need0, capacity, margin)}): "
            "the offload was partial because fewer layers were asked for", settings={"n_gpu_layers": -1})]

    # a smaller quantization: the largest standard one that fits entirely
    current = sizer.quantization
    if current:
        sizes = _quant_sizes(sizer, current)
        current_size = dict(sizes)[current]
        smaller = [q for q, size in sizes if size < current_size]  # largest first
        chosen = None
        if smaller and not unknown:
            for q in smaller:
                need = sizer.need(_Change(quantization=q))
                if _fits(need, capacity, margin):
                    chosen = q
                    break
            if chosen is None:  # none fits: say what the smallest common one would still need
                chosen = "Q2_K" if "Q2_K" in smaller else smaller[-1]
        elif smaller:
            chosen = smaller[0]  # capacity unknown: the next size down
        if chosen is not None:
            need = sizer.need(_Change(quantization=chosen))
            ok = _fits(need, capacity, margin)
            if ok:
                why = f"{chosen} is the largest standard quantization that runs fully offloaded: {_short(need, capacity, margin)}"
            elif ok is False:
                why = f"no standard quantization smaller than {current} fits entirely; {chosen} would still need {_short(need, capacity, margin)}"
            else:
                why = f"{chosen}, the next standard size down, needs {_short(need, capacity, margin)}"
            levers.append(Lever("smaller quantization", f"{current} -> {chosen}", frees(need), ok, why,
                                settings={"n_gpu_layers": -1}, quantization=chosen))
    else:
        notes.append("the log does not say the file's quantization, so the smaller-quantization lever is left out; "
                     "give --model MODEL")

    # a smaller context
    if n_ctx > _MIN_CTX:
        low = sizer.need(_Change(n_ctx=_MIN_CTX))
        low_ok = _fits(low, capacity, margin)
        if low_ok:
            ctx, need = _largest_ctx(sizer, capacity, margin, n_ctx, low)
            levers.append(Lever("smaller context", f"n_ctx {n_ctx} -> {ctx}", frees(need), True,
                                f"the KV cache and compute buffers shrink with the context; {ctx} is the largest that "
                                f"fits fully offloaded: {_short(need, capacity, margin)}",
                                settings={"n_ctx": ctx, "n_gpu_layers": -1}))
        else:
            target = _MIN_CTX if low_ok is False else max(_MIN_CTX, pad(n_ctx // 2, 256))
            need = low if low_ok is False else sizer.need(_Change(n_ctx=target))
            why = (f"even n_ctx {target} needs {_short(need, capacity, margin)}: the context alone cannot make it fit"
                   if low_ok is False else f"half the context needs {_short(need, capacity, margin)}")
            levers.append(Lever("smaller context", f"n_ctx {n_ctx} -> {target}", frees(need), low_ok if low_ok is False else None,
                                why, settings={"n_ctx": target, "n_gpu_layers": -1}))

    # a quantized KV cache
    for kv in ("q8_0", "q4_0"):
        if _KV_BYTES.get(kv, 9) >= _KV_BYTES.get(type_k, 2.0):
            continue
        need = sizer.need(_Change(type_k=kv, type_v=kv))
        ok = _fits(need, capacity, margin)
        fa = "" if facts.flash_attn is not False else " (a quantized V cache needs flash attention: add -fa on)"
        levers.append(Lever(f"{kv} KV cache", f"KV cache {type_k} -> {kv} (-ctk {kv} -ctv {kv}){fa}", frees(need), ok,
                            f"a {kv} cache takes {_KV_BYTES[kv] / _KV_BYTES.get(type_k, 2.0):.0%} of the {type_k} one; "
                            f"full offload then needs {_short(need, capacity, margin)}",
                            settings={"type_k": kv, "type_v": kv, "flash_attn": "on", "n_gpu_layers": -1}))

    # experts (MoE) or FFN of the first N layers on the CPU
    if isinstance(sizer, _ModelSizer):
        part = "cpu_expert_layers" if sizer.is_moe else "cpu_ffn_layers"
        label = "MoE experts on the CPU" if sizer.is_moe else "FFN on the CPU"
        found = _fewest_layers(sizer, part, capacity, margin)
        n, need = found
        ok = _fits(need, capacity, margin)
        regex = _layers_regex(n, _EXPERTS if sizer.is_moe else _FFN)
        flag = f"--n-cpu-moe {n}" if sizer.is_moe else f"-ot '{regex}=CPU'"
        what = "experts" if sizer.is_moe else "feed-forward weights"
        levers.append(Lever(label, f"the {what} of the first {n} layers on the CPU ({flag})", frees(need), ok,
                            (f"{n} is the fewest layers whose {what} must stay on the CPU for the rest to fit: "
                             if ok else f"even with the {what} of all {n} layers on the CPU, ")
                            + f"full offload needs {_short(need, capacity, margin)}; those tensors then run on the CPU",
                            settings={"tensor_overrides": (regex,), "n_gpu_layers": -1}))
    else:
        notes.append("experts and FFN cannot be told apart without the model's shape: those levers are left out; "
                     "give --model MODEL")

    # the KV cache on the host
    need = sizer.need(_Change(offload_kqv=False))
    ok = _fits(need, capacity, margin)
    levers.append(Lever("KV cache on the host", "--no-kv-offload (-nkvo)", frees(need), ok,
                        f"the whole KV cache moves to system RAM (attention then runs on the CPU, usually slower than "
                        f"a smaller context); full offload needs {_short(need, capacity, margin)}",
                        settings={"offload_kqv": False, "n_gpu_layers": -1}))

    # memory held by other processes, when the log is from this machine
    for d, gpu in here.items():
        if d not in need0:
            continue
        held = [p for p in gpu.processes if p.used_memory]
        if not held:
            continue
        amount = sum(p.used_memory for p in held)
        cap = capacity.get(d)
        ok = None if cap is None else need0[d] <= cap + amount - margin
        who = ", ".join(f"pid {p.pid} ({p.name[:60]}) {gib(p.used_memory)}" for p in sorted(held, key=lambda p: -p.used_memory)[:5])
        levers.append(Lever("free GPU memory", f"stop what holds memory on {d} ({gpu.name})", amount, ok,
                            f"on this machine now (NVML): {who}"))

    order = {True: 0, None: 1, False: 2}
    levers.sort(key=lambda lv: (order[lv.reaches_full_offload], -(lv.frees_bytes or 0)))
    return levers


def _quant_sizes(sizer: Any, current: str) -> list[tuple[str, int]]:
    """Standard quantizations with their sizes, largest first (the current one included)."""
    if isinstance(sizer, _ModelSizer):
        names = list(dict.fromkeys([*STANDARD, current]))
        return sorted(((q, quantized_size(sizer.info, q).n_bytes) for q in names), key=lambda x: -x[1])
    names = list(dict.fromkeys([*STANDARD, current]))
    return sorted(((q, int(sizer._bits(q) * 1e6)) for q in names), key=lambda x: -x[1])


def _largest_ctx(sizer: Any, capacity: Mapping[str, int], margin: int, n_ctx: int,
                 low_need: dict[str, int]) -> tuple[int, dict[str, int]]:
    """The largest context (a multiple of 256 below ``n_ctx``) that fits fully offloaded, given that
    the smallest one does."""
    lo, hi = _MIN_CTX // 256 + 1, max(1, (n_ctx - 1) // 256)
    best = (_MIN_CTX, low_need)
    while lo <= hi:
        mid = (lo + hi) // 2
        need = sizer.need(_Change(n_ctx=mid * 256))
        if _fits(need, capacity, margin):
            best = (mid * 256, need)
            lo = mid + 1
        else:
            hi = mid - 1
    return best


def _fewest_layers(sizer: _ModelSizer, part: str, capacity: Mapping[str, int], margin: int) -> tuple[int, dict[str, int]]:
    """The fewest first layers to keep on the CPU (their experts or FFN) for full offload; all when
    none is enough or capacity is unknown."""
    n_layer = sizer.n_layer
    every = sizer.need(_Change(**{part: n_layer}))
    if not _fits(every, capacity, margin):
        return n_layer, every
    lo, hi = 0, n_layer
    best = (n_layer, every)
    while lo <= hi:
        mid = (lo + hi) // 2
        need = sizer.need(_Change(**{part: mid}))
        if _fits(need, capacity, margin):
            best = (mid, need)
            hi = mid - 1
        else:
            lo = mid + 1
    return best
