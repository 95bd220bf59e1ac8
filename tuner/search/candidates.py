"""Before a launch: is this candidate worth a trial? The memory arithmetic against each device's free
memory less a margin, what out-of-memory failures taught, and the seeds that open a study.

Out of memory is a constraint, never a score of 0 t/s: once a placement runs out of memory on a
device, candidates that need as much or more there are not launched either.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

from ..engine.base import TrialResult
from ..engine.settings import Settings
from ..limits import tensor_regex
from ..machine.probe import Machine
from ..model.estimate import CPU, MemoryEstimate, estimate, layer_devices
from ..model.inspect import KV_TYPE_BLOCKS, ModelInfo
from ..model.repack import CpuFeatures
from .space import PLACEMENTS, Device, SearchSpace, devices_from, placement_patterns, rpc_devices_from

MiB = 1 << 20

# Seeds are ranked by the bytes a generated token reads, those in host memory weighted by this:
# host memory is about ten times slower than a discrete GPU's (dual-channel DDR5 ~80 GB/s, a GDDR6X
# card ~900 GB/s). With unified memory both are the same memory. Only the order of the first trials
# depends on it: every seed is measured.
HOST_SLOWDOWN = 10.0
# Seeds with a placement strategy also come with the first 1 or 2 layers wholly on the host (and the
# strategy on the fewest layers after them): one whole layer can cost fewer host bytes per token than
# one more layer's FFN (a 70B's attention is a fifth of its FFN), measured in benchmarks/search_at_scale.py.
WHOLE_ON_HOST = (0, 1, 2)
# With a calibrated margin: kept free beyond the most a trial used past the arithmetic and the spread
# of those excesses (benchmarks/search_at_scale.py measures what the margin costs).
CALIBRATION_SLACK = 32 * MiB
# Where a device starts, without --vram-margin (and the whole margin with no measurement of it): it
# covers a CUDA context (300-500 MiB) and the arithmetic's error.
DEFAULT_MARGIN = 512 * MiB
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_ROUTED_RE = re.compile(r"\.ffn_(gate|up|down|gate_up)_exps\.")

# llama.cpp names the device whose allocation failed in these lines (src/llama-model.cpp
# "alloc_tensor_range: failed to allocate %s buffer of size %zu", ggml-cuda "allocating %.2f MiB
# on device %d: cudaMalloc failed: out of memory", llama-kv-cache "failed to allocate buffer
# for kv cache" (no device)).
_OOM_DEVICE_RES = [
    re.compile(r"failed to allocate (\S+?) buffer"),
    re.compile(r"allocating [\d.]+ MiB on device (\d+): cudaMalloc failed"),
]


def accelerator_devices(machine: Machine) -> list[Device]:
    """The devices llama.cpp will offload to, with the memory the tuner plans with.

    Where the engine listed its devices (``Machine.devices``), those, with llama.cpp's names; an RPC
    server that did not answer is an error. A ``Machine`` without them (injected by a test, or probed
    without an engine) falls back to NVML's GPUs under CUDA names and the RPC servers' own reports."""
    if machine.devices:
        for entry in machine.rpc_devices:
            if "error" in entry:
                rpc_devices_from([entry])  # raises, naming the server
        return devices_from(machine.devices)
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
    what is free (less a margin on the accelerators), and the out-of-memory limits learned so far.

    The margin is what the arithmetic does not see: the backend's own context (CUDA's is 300-500 MiB),
    its workspaces, the allocator's slack, the arithmetic's own error. A fixed ``margin`` is used as
    given. With ``calibrate``, ``margin`` is only where a device starts: once a trial that ran reports
    the process's peak use on a device (NVML's per-process figure; the simulation's), the margin there
    becomes the most any trial used beyond the arithmetic, plus the spread of those excesses, plus
    ``CALIBRATION_SLACK``. It follows this machine: larger where the arithmetic falls short, smaller
    where the backend needs less than the default."""

    def __init__(self, models: Mapping[str, ModelInfo], devices: Sequence[Device], ram_available: int, margin: int,
                 *, calibrate: bool = False, peak_names: Mapping[str, str] | None = None, cpu: CpuFeatures | None = None,
                 shared_ram: Sequence[str] = ()) -> None:
        self.models = models
        self.cpu = cpu  # llama.cpp's CPU features: which weights it repacks (an extra host buffer)
        # devices whose memory is the host's RAM (Apple silicon, an APU alone): one pool with the host,
        # as at load (tuner.profile.apps): what they hold counts against the RAM too
        self.shared_ram = tuple(shared_ram)
        self.devices = list(devices)
        self.margin = margin
        self.calibrate = calibrate
        self.peak_names = dict(peak_names or {})  # the memory sampler's name of a device -> llama.cpp's
        self.free: dict[str, int] = {d.name: d.free for d in self.devices}
        self.free[CPU] = ram_available
        self.learned: dict[str, int] = {}  # device -> the smallest need that ran out of memory there
        self.beyond: dict[str, list[int]] = {}  # device -> what trials used there beyond the arithmetic
        self._estimates: dict[str, MemoryEstimate] = {}

    def margin_for(self, device: str) -> int:
        """The memory kept free on ``device`` beyond what the arithmetic predicts."""
        seen = self.beyond.get(device)
        if not self.calibrate or not seen:
            return self.margin
        return max(CALIBRATION_SLACK, max(seen) + (max(seen) - min(seen)) + CALIBRATION_SLACK)

    def learn_usage(self, result: TrialResult, est: MemoryEstimate) -> dict[str, int]:
        """From a trial that ran: per accelerator, what the process used there beyond the arithmetic's
        prediction (its peak less the predicted total). Remembered for the margin; returned to record."""
        if not result.ok:
            return {}
        out: dict[str, int] = {}
        for label, peak in result.peak_vram.items():
            device = self.peak_names.get(label, label)
            mem = est.devices.get(device)
            if device == CPU or mem is None or mem.total <= 0 or peak <= 0:
                continue
            out[device] = int(peak) - mem.total
        for device, extra in out.items():
            self.remember_usage(device, extra)
        return out

    def remember_usage(self, device: str, beyond: int) -> None:
        """A trial used ``beyond`` bytes on ``device`` past the arithmetic (now or in an earlier run)."""
        self.beyond.setdefault(device, []).append(int(beyond))

    def estimate(self, s: Settings) -> MemoryEstimate:
        # memoized: the checks, the seeds and repairs ask about the same candidates more than once
        key = settings_key(s)
        if key not in self._estimates:
            self._estimates[key] = estimate(self.models[s.model_path], s, devices=[d.name for d in self.devices], cpu=self.cpu)
        return self._estimates[key]

    def check(self, s: Settings, est: MemoryEstimate) -> str | None:
        """Why a candidate must not be launched, or None."""
        for device, mem in est.devices.items():
            free = self.free.get(device)
            if free is not None and device != CPU and mem.total > free - self.margin_for(device):
                return (f"predicted not to fit: {device} needs {mem.total / MiB:.0f} MiB "
                        f"({mem.weights / MiB:.0f} weights, {mem.kv / MiB:.0f} KV, {mem.compute / MiB:.0f} compute), "
                        f"{free / MiB:.0f} MiB free less a {self.margin_for(device) / MiB:.0f} MiB margin")
        host = est.devices[CPU].total
        shared = sum(est.devices[d].total for d in self.shared_ram if d in est.devices)
        if host + shared > self.free[CPU]:
            also = f" (with {shared / MiB:.0f} MiB of {', '.join(self.shared_ram)}, which shares it)" if shared else ""
            return (f"predicted not to fit in RAM: the host needs {host / MiB:.0f} MiB{also}, "
                    f"{self.free[CPU] / MiB:.0f} MiB available")
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
            if free is not None and total > free - (self.margin_for(device) if device != CPU else 0):
                return False
        return need.get(CPU, 0) + sum(need.get(d, 0) for d in self.shared_ram) <= self.free[CPU]

    def room(self, device: str) -> int:
        """The most a candidate may need on an accelerator: its free memory less the margin, and
        below what ran out of memory there."""
        room = self.free.get(device, 0) - self.margin_for(device)
        if device in self.learned:
            room = min(room, self.learned[device] - 1)
        return room

    def repair(self, s: Settings, space: SearchSpace, params: Mapping[str, Any]) -> Settings:
        """``s`` if it fits. Else, when an accelerator cannot hold its share, the candidate the same
        parameters (``params``, what the space asked for ``s``) give with that device's layers lowered
        to the most it holds, the other devices' kept: what counts in offloaded layers (a placement's
        layers, n_cpu_moe) is kept too, bounded by what remains offloaded. ``s`` itself when lowering
        does not make it fit (the host's memory, say)."""
        if not s.n_gpu_layers or self.fits(s):
            return s
        info = self.models[s.model_path]
        names = [d.name for d in self.devices]
        placement = layer_devices(info.n_layer, s.n_gpu_layers, names, s.tensor_split)
        counts = [placement.count(n) for n in names]

        def with_counts(c: list[int]) -> Settings:
            asked = {**params, "n_gpu_layers": sum(c), **{f"layers_on[{n}]": c[i] for i, n in enumerate(names[:-1])}}
            return space.suggest(_Clamped(asked))

        for i, name in enumerate(names):
            if self.estimate(with_counts(counts)).devices[name].total <= self.room(name):
                continue
            low, high = 0, counts[i]
            while low < high:  # what a device needs grows with the layers it holds
                mid = (low + high + 1) // 2
                if self.estimate(with_counts(counts[:i] + [mid] + counts[i + 1:])).devices[name].total <= self.room(name):
                    low = mid
                else:
                    high = mid - 1
            counts[i] = low
        out = with_counts(counts)
        return out if out.n_gpu_layers and self.fits(out) else s

    def fits(self, s: Settings) -> bool:
        return self.check(s, self.estimate(s)) is None

    def most_layers(self, s: Settings, cap: int | None = None) -> Settings:
        """``s`` with as many layers offloaded as fit, at most ``cap`` (default: every layer): the devices
        filled one at a time, the one with the most free memory first (``s``'s own n_gpu_layers and split
        are ignored)."""
        info = self.models[s.model_path]
        names = [d.name for d in self.devices]
        if not names:
            return dataclasses.replace(s, n_gpu_layers=0, tensor_split=None)
        cap = info.n_layer + 1 if cap is None else cap
        counts = [0] * len(names)

        def with_counts(c: list[int]) -> Settings:
            total = sum(c)
            split = tuple(float(x) for x in c) if len(names) > 1 and total else None
            return dataclasses.replace(s, n_gpu_layers=total, tensor_split=split)

        for i in sorted(range(len(names)), key=lambda i: -self.devices[i].free):
            low, high = 0, cap - sum(counts)
            while low < high:  # memory grows with the layers a device holds
                mid = (low + high + 1) // 2
                if self.fits(with_counts(counts[:i] + [mid] + counts[i + 1:])):
                    low = mid
                else:
                    high = mid - 1
            counts[i] = low
        return with_counts(counts)

    def fewest_on_host(self, s: Settings, strategy: str, whole: int = 0) -> Settings | None:
        """``s`` with every layer but the first ``whole`` offloaded (those run wholly on the host) and the
        tensors of a placement strategy (or, for ``"n_cpu_moe"``, the experts) kept on the host for the
        fewest next layers that make it fit; None when even all of them do not. A layer wholly on the
        host costs its attention's bytes too but no placement pattern: which reads fewer host bytes
        per token depends on the model, so the seeds rank both."""
        info = self.models[s.model_path]
        wanted = info.n_layer + 1 - whole

        def offloaded(k: int) -> Settings:
            if strategy == "n_cpu_moe":  # llama.cpp counts it from layer 0, the layers wholly on the host too
                return self.most_layers(dataclasses.replace(s, n_cpu_moe=whole + k), cap=wanted)
            return self.most_layers(dataclasses.replace(s, tensor_overrides=placement_patterns(strategy, k, whole)), cap=wanted)

        if wanted < 2 or offloaded(info.n_layer - whole).n_gpu_layers < wanted:
            return None
        low, high = 1, info.n_layer - whole
        while low < high:  # the more layers' tensors on the host, the less each device needs
            mid = (low + high) // 2
            if offloaded(mid).n_gpu_layers >= wanted:
                high = mid
            else:
                low = mid + 1
        return offloaded(low)

    def traffic(self, s: Settings, depth: int = 0) -> tuple[float, float]:
        """Bytes a generated token reads: (from host memory, from the accelerators). Every weight
        where the memory arithmetic places it (a token uses only its experts' share of an MoE's
        expert tensors; the embeddings table gives one row), and the KV cache at ``depth``."""
        info = self.models[s.model_path]
        placement = layer_devices(info.n_layer, s.n_gpu_layers, [d.name for d in self.devices], s.tensor_split)
        patterns = [tensor_regex(p) for p in s.host_overrides]
        used = info.expert_used_count / info.expert_count if info.is_moe else 1.0
        host = accel = 0.0
        for t in info.tensors:
            m = _BLOCK_RE.match(t.name)
            if m and int(m.group(1)) < info.n_layer:
                device = placement[int(m.group(1))]
            elif t.name.startswith(("output.", "output_norm.")):
                device = placement[info.n_layer]
            else:
                continue  # token embeddings: one row per token
            if device != CPU and any(p.search(t.name) for p in patterns):
                device = CPU
            read = t.n_bytes * (used if _ROUTED_RE.search(t.name) else 1.0)
            if device == CPU:
                host += read
            else:
                accel += read
        for il in range(info.n_layer):
            kv = depth * info.kv_bytes_per_token_layer(il, s.type_k, s.type_v)
            if placement[il] == CPU or not s.offload_kqv:
                host += kv
            else:
                accel += kv
        return host, accel

    def seeds(self, space: SearchSpace, physical_cores: int, *, objective: str = "tg", depth: int = 0,
              unified_memory: bool = False, limit: int = 6) -> list[Settings]:
        """The first trials: for each variant, the most that can be offloaded with the least memory
        per layer (the smallest context, micro-batch and KV cache): as many whole layers as fit, the
        KV cache on the host, and each placement strategy (n_cpu_moe for an MoE) on the fewest layers
        that let everything else on the accelerators. Ranked by the traffic a generated token causes (host memory is the
        slow one), the best of each variant first, up to ``limit``; then the model on the CPU alone
        and llama.cpp's defaults (not launched unless they fit).

        Without an accelerator: each variant with the threads nearest the physical cores."""
        sp = space
        threads = max(sp.threads[0], min(sp.threads, key=lambda t: abs(t - physical_cores)))
        # a prompt is faster in bigger micro-batches; generation does not care and the smallest saves memory
        # (the users' generation objectives are generation too: a step of N tokens fits the smallest)
        ubatch = sp.n_ubatch[0] if objective in ("tg", "aggregate", "per-user") else (512 if 512 in sp.n_ubatch else sp.n_ubatch[-1])
        common = dict(n_ctx=sp.n_ctx[0], n_batch=max(sp.n_batch[-1], ubatch), n_ubatch=ubatch, threads=threads)
        fa = "on" if "on" in sp.flash_attn else sp.flash_attn[0]
        kv = min((t for t in sp.kv_types if fa == "on" or t in ("f16", "f32", "bf16")),
                 key=lambda t: KV_TYPE_BLOCKS[t][1] / KV_TYPE_BLOCKS[t][0])
        out: list[Settings] = []
        if sp.has_gpu:
            slowdown = 1.0 if unified_memory else HOST_SLOWDOWN
            strategies = [p for p in sp.placements if p != "none" and PLACEMENTS.get(p)]
            if sp.is_moe and "n_cpu_moe" not in sp.excluded:
                strategies.append("n_cpu_moe")
            ranked: list[tuple[float, int, Settings]] = []
            for rank_in_file, variant in enumerate(sp.variants):
                options: list[Settings] = []
                for kqv in sp.offload_kqv:
                    base = sp.settings(variant=variant, kv=kv, flash_attn=fa, offload_kqv=kqv, **common)
                    options.append(self.most_layers(base))
                    for strategy in strategies:
                        for whole in WHOLE_ON_HOST:
                            option = self.fewest_on_host(base, strategy, whole)
                            if option is not None:
                                options.append(option)
                for s in options:
                    if s.n_gpu_layers and self.fits(s):
                        host, accel = self.traffic(s, depth)
                        ranked.append((host * slowdown + accel, rank_in_file, s))
            ranked.sort(key=lambda r: (r[0], r[1]))
            best_per_variant: dict[str, Settings] = {}
            for _, _, s in ranked:
                best_per_variant.setdefault(s.model_path, s)
            chosen = list(best_per_variant.values())
            for _, _, s in ranked:
                if len(chosen) >= limit:
                    break
                if s not in chosen:
                    chosen.append(s)
            out.extend(chosen[:max(limit, len(best_per_variant))])
            # the model on the CPU alone (an accelerator can be slower than the host: an RPC server)
            out.append(sp.settings(variant=sp.variants[0], kv="f16", flash_attn=fa, **common))
        else:
            for variant in sp.variants:
                out.append(sp.settings(variant=variant, kv="f16", flash_attn=fa, **common))
        # llama.cpp's defaults: everything offloaded, f16 cache, batch 2048/512 (flash attention
        # "auto" resolves to on where supported, the nearest choice here)
        out.append(sp.settings(variant=sp.variants[0], n_gpu_layers=sp.n_layer + 1 if sp.has_gpu else 0, kv="f16",
                               flash_attn=fa, **{**common, "n_ubatch": 512 if 512 in sp.n_ubatch else common["n_ubatch"]}))
        # as the study will ask them (a multi-device space states the split: llama.cpp's default
        # becomes the arithmetic's even split)
        from optuna.trial import FixedTrial

        unique: dict[str, Settings] = {}
        for s in out:
            s = sp.suggest(FixedTrial(sp.params_for(s)))
            unique.setdefault(settings_key(s), s)
        return list(unique.values())


class _Clamped:
    """Answers a search space's questions from known parameters, an integer clamped into the range
    asked (a count of offloaded layers shrinks with them); a question not answered takes the lowest
    value or the first choice."""

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = params

    def suggest_int(self, name: str, low: int, high: int, **_: Any) -> int:
        return min(max(int(self.params.get(name, low)), low), high)

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        value = self.params.get(name)
        return value if value in choices else choices[0]


def settings_key(s: Settings) -> str:
    """One candidate's identity in a study: its settings, as canonical JSON."""
    import json

    return json.dumps(s.to_dict(), sort_keys=True)
