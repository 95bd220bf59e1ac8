"""Before a launch: is this candidate worth a trial? The memory arithmetic against each device's free
memory less a margin, what out-of-memory failures taught, and the seeds that open a study.

Out of memory is a constraint, never a score of 0 t/s: once a placement runs out of memory on a
device, candidates that need as much or more there are not launched either.
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from ..engine.base import TrialResult
from ..engine.settings import Settings
from ..machine.probe import Machine
from ..model.estimate import CPU, MemoryEstimate, estimate, max_gpu_layers
from ..model.inspect import ModelInfo
from .space import Device, SearchSpace, rpc_devices_from

MiB = 1 << 20

# llama.cpp names the device whose allocation failed in these lines (src/llama-model.cpp
# "alloc_tensor_range: failed to allocate %s buffer of size %zu", ggml-cuda "allocating %.2f MiB
# on device %d: cudaMalloc failed: out of memory", llama-kv-cache "failed to allocate buffer
# for kv cache" (no device)).
_OOM_DEVICE_RES = [
    re.compile(r"failed to allocate (\S+?) buffer"),
    re.compile(r"allocating [\d.]+ MiB on device (\d+): cudaMalloc failed"),
]


def accelerator_devices(machine: Machine) -> list[Device]:
    """The devices llama.cpp will offload to, with the memory the tuner plans with."""
    devices: list[Device] = []
    if machine.llama.gpu_offload or not machine.llama.llama_cpp_python:
        for g in machine.gpus:
            devices.append(Device(name=f"CUDA{g.index}", free=g.memory_free, total=g.memory_total))
    if machine.rpc_devices:
        devices.extend(rpc_devices_from(machine.rpc_devices))
    return devices


def oom_device(result: TrialResult, est: MemoryEstimate, accelerators: Sequence[str]) -> str:
    """Which device ran out: from llama.cpp's error lines, else the fullest accelerator, else the host."""
    for line in result.load.errors + (result.message,):
        for pattern in _OOM_DEVICE_RES:
            m = pattern.search(line)
            if m:
                name = m.group(1)
                if name.isdigit():
                    name = f"CUDA{name}"
                if name.startswith("CPU") or name in ("CUDA_Host",):
                    return CPU
                for device in est.devices:
                    if device == name or device.startswith(name):
                        return device
    if accelerators:
        return max(accelerators, key=lambda d: est.devices[d].total if d in est.devices else 0)
    return CPU


class Candidates:
    """The pre-launch checks of one study: the memory each candidate needs per device, whether it fits
    what is free (less ``margin`` on the accelerators), and the out-of-memory limits learned so far."""

    def __init__(self, models: Mapping[str, ModelInfo], devices: Sequence[Device], ram_available: int, margin: int) -> None:
        self.models = models
        self.devices = list(devices)
        self.margin = margin
        self.free: dict[str, int] = {d.name: d.free for d in self.devices}
        self.free[CPU] = ram_available
        self.learned: dict[str, int] = {}  # device -> the smallest need that ran out of memory there

    def estimate(self, s: Settings) -> MemoryEstimate:
        return estimate(self.models[s.model_path], s, devices=[d.name for d in self.devices])

    def check(self, s: Settings, est: MemoryEstimate) -> str | None:
        """Why a candidate must not be launched, or None."""
        for device, mem in est.devices.items():
            free = self.free.get(device)
            if free is not None and device != CPU and mem.total > free - self.margin:
                return (f"predicted not to fit: {device} needs {mem.total / MiB:.0f} MiB "
                        f"({mem.weights / MiB:.0f} weights, {mem.kv / MiB:.0f} KV, {mem.compute / MiB:.0f} compute), "
                        f"{free / MiB:.0f} MiB free less a {self.margin / MiB:.0f} MiB margin")
        host = est.devices[CPU].total
        if host > self.free[CPU]:
            return f"predicted not to fit in RAM: the host needs {host / MiB:.0f} MiB, {self.free[CPU] / MiB:.0f} MiB available"
        for device, threshold in self.learned.items():
            need = est.devices.get(device)
            if need is not None and need.total >= threshold:
                return (f"learned: a placement needing {threshold / MiB:.0f} MiB on {device} ran out of memory; "
                        f"this one needs {need.total / MiB:.0f} MiB there")
        return None

    def remember_oom(self, device: str, need: int) -> None:
        """A placement needing ``need`` bytes on ``device`` ran out of memory (now or in an earlier run)."""
        if need:
            self.learned[device] = min(self.learned.get(device, 1 << 62), need)

    def learn_oom(self, result: TrialResult, est: MemoryEstimate) -> tuple[str, int]:
        """Learn from an out-of-memory trial: (the device that ran out, what the estimate put there)."""
        device = oom_device(result, est, [d.name for d in self.devices])
        need = est.devices[device].total if device in est.devices else 0
        self.remember_oom(device, need)
        return device, need

    def fit_together(self, candidates: Sequence[Settings]) -> bool:
        """Whether these candidates fit in memory all at once (a paired measurement loads them
        together): each distinct model's weights once, every context's KV and compute."""
        need: dict[str, int] = {}
        seen_models: set[tuple] = set()
        for s in candidates:
            est = self.estimate(s)
            first = s.model_key not in seen_models
            seen_models.add(s.model_key)
            for device, mem in est.devices.items():
                need[device] = need.get(device, 0) + (mem.weights if first else 0) + mem.kv + mem.compute
        for device, total in need.items():
            free = self.free.get(device)
            if free is not None and total > free - (self.margin if device != CPU else 0):
                return False
        return True

    def seeds(self, space: SearchSpace, physical_cores: int) -> list[Settings]:
        """Sensible first trials: the most layers that fit, all on the CPU, llama.cpp's defaults."""
        sp = space
        threads = max(sp.threads[0], min(sp.threads, key=lambda t: abs(t - physical_cores)))
        common = dict(n_ctx=sp.n_ctx[0], n_batch=sp.n_batch[-1], n_ubatch=512 if 512 in sp.n_ubatch else sp.n_ubatch[-1], threads=threads)
        out = []
        for variant in sp.variants:
            if sp.has_gpu:
                info = self.models[variant]
                free = {d.name: d.free for d in self.devices}
                probe = sp.settings(variant=variant, kv="f16", flash_attn="on", **common)
                best_ngl = max_gpu_layers(info, probe, free, margin=self.margin, devices=[d.name for d in self.devices])
                out.append(sp.settings(variant=variant, n_gpu_layers=best_ngl, kv="f16", flash_attn="on", **common))
                out.append(sp.settings(variant=variant, n_gpu_layers=0, kv="f16", flash_attn="on", **common))
            else:
                out.append(sp.settings(variant=variant, kv="f16", flash_attn="on", **common))
        # llama.cpp's defaults: everything offloaded, f16 cache, batch 2048/512 (flash attention
        # "auto" resolves to on where supported, the nearest choice here)
        out.append(sp.settings(variant=sp.variants[0], n_gpu_layers=sp.n_layer + 1 if sp.has_gpu else 0,
                               kv="f16", flash_attn="on", **common))
        unique: dict[str, Settings] = {}
        for s in out:
            unique.setdefault(settings_key(s), s)
        return list(unique.values())


def settings_key(s: Settings) -> str:
    """One candidate's identity in a study: its settings, as canonical JSON."""
    import json

    return json.dumps(s.to_dict(), sort_keys=True)
