"""Memory arithmetic: bytes per device for weights, KV cache and compute buffers, before loading.

    est = estimate(info, Settings(model_path=info.path, n_gpu_layers=20, n_ctx=8192), devices=["CUDA0"])
    est.devices["CUDA0"].total

Pure functions of a ``ModelInfo`` and a candidate's ``tuner.Settings`` (read by attribute: this
stage sits below the engine's and never imports it), following llama.cpp's placement rules
(src/llama-model.cpp ``load_tensors``, 2026):

- offload starts from the last layer, the output layer first:
  ``i_gpu_start = max(n_layer + 1 - ngl, 0)``; layer ``n_layer`` is the output head and norm;
- the offloaded layers are spread over the devices by the cumulative proportions of the tensor
  split: layer ``il`` goes to the first device whose cumulative share exceeds
  ``(il - i_gpu_start) / act_gpu_layers``;
- token embeddings always stay on the host;
- each layer's KV cache lives with the layer (unless ``offload_kqv`` is off), with
  ``n_ctx`` padded to a multiple of 256 cells, sliding-window layers holding
  ``min(n_ctx, n_swa + n_ubatch)`` cells;
- tensors matching one of the settings' ``host_overrides`` (``tensor_overrides`` and what other
  settings stand for as overrides) stay on the host;
- ``split_mode`` ``none`` puts every offloaded layer on ``main_gpu``; ``row`` is estimated as ``layer``.

Each setting the arithmetic reads: ``n_gpu_layers`` (every layer: ``special.offloaded_layers``),
``tensor_split``, ``n_ctx`` (0: ``special.context_tokens``), ``n_ubatch``, ``flash_attn``
(``special.flash_attn_forms``), ``type_k``, ``type_v``, ``offload_kqv``, ``swa_full`` (a
sliding-window layer holds ``min(n_ctx, n_swa + n_ubatch)`` cells unless it is set), ``host_overrides``,
``n_parallel`` and ``kv_unified`` (the sequences the cache holds, in one stream or one each: ``kv_layout``),
``split_mode``, ``main_gpu``, ``use_mmap`` and ``repack``. The others (batch, threads, mlock, op_offload)
change no buffer llama.cpp allocates.

The host's weights are llama.cpp's buffers (``MemoryEstimate.buffers``; ``tuner.model.repack`` says which
weights go where on which CPU): with ``repack`` on, the weights of a type this CPU repacks go to an extra
buffer (``AMX``, ``CPU_REPACK``, at their repacked size); the rest is ``CPU_Mapped`` with mmap, the span of
the file from the first of them to the end of the last (src/llama-model-loader.cpp ``get_mapping_range``:
a repacked weight inside that span is mapped too, and copied), or ``CPU`` without mmap, each tensor padded
to 32 bytes. So with mmap the host holds the mapped file **and** the repacked copy. The host's
``weights`` are its own tensors, the repacked copies and, with mmap, the file's pages of the repacked
tensors (the mapped span can also cover offloaded tensors' pages, read once to upload them and not
counted). The CPU's features
come from llama.cpp (``cpu=``, a ``CpuFeatures``); without them nothing is repacked.

Compute buffers are llama.cpp's graph allocator peaks; we model them from the largest live
intermediates (attention scores or flash-attention tiles, FFN activations, logits), calibrated
against the sizes llama.cpp prints (see the closing note of the foundation issue for errors).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Sequence

from ..errors import SettingsError
from ..limits import tensor_regex
from .inspect import KV_TYPE_BLOCKS, ModelInfo, tensor_role
from .repack import CpuFeatures, extra_buffer, extra_size, takes_host_weights
from .special import context_tokens, flash_attn_forms, offloaded_layers

CPU = "CPU"
MiB = 1 << 20


def pad(value: int, multiple: int) -> int:
    return ((value + multiple - 1) // multiple) * multiple


@dataclass(frozen=True)
class KVLayout:
    """How llama.cpp lays out the KV cache for ``n_seq`` sequences: ``streams`` buffers of ``cells``
    cells for a full-attention layer and ``swa_cells`` for a sliding-window layer, each."""

    streams: int
    cells: int
    swa_cells: int

    @property
    def total(self) -> tuple[int, int]:
        return self.streams * self.cells, self.streams * self.swa_cells


def kv_layout(n_ctx: int, n_ubatch: int, sliding_window: int | None, swa_full: bool, *, n_seq: int = 1,
              unified: bool = False) -> KVLayout:
    """The KV cache for ``n_seq`` sequences (llama-server's slots), as llama.cpp sizes it.

    llama.cpp pads the context to 256 cells (llama-context.cpp). A unified cache is one stream of
    all of it, shared by every sequence; otherwise each sequence has its own stream of
    ``n_ctx / n_seq`` cells, padded to 256 again (``n_ctx_seq``; llama-kv-cache.cpp: ``n_stream =
    unified ? 1 : n_seq_max``). A sliding-window layer's stream holds its window and one
    micro-batch, padded: ``GGML_PAD(min(size_base, n_swa * (unified ? n_seq_max : 1) + n_ubatch), 256)``
    (llama-kv-cache-iswa.cpp), so per sequence it costs the same window either way: 4 users, 4
    windows; or the whole stream with ``swa_full``."""
    n_seq = max(1, n_seq)
    padded = pad(n_ctx, 256)
    streams = 1 if unified or n_seq == 1 else n_seq
    cells = padded if streams == 1 else pad(padded // n_seq, 256)
    if swa_full or not sliding_window:
        return KVLayout(streams, cells, cells)
    return KVLayout(streams, cells, pad(min(cells, sliding_window * (n_seq if unified else 1) + n_ubatch), 256))


def cache_cells(n_ctx: int, n_ubatch: int, sliding_window: int | None, swa_full: bool, *, n_seq: int = 1,
                unified: bool = False) -> tuple[int, int]:
    """KV cells per layer over every sequence: (a full-context layer's, a sliding-window layer's).

    One sequence: the context padded to 256 cells; a sliding-window layer its window and one
    micro-batch, padded too, or the whole context with ``swa_full``. Several: ``kv_layout``."""
    return kv_layout(n_ctx, n_ubatch, sliding_window, swa_full, n_seq=n_seq, unified=unified).total


@dataclass(frozen=True)
class DeviceMemory:
    weights: int = 0
    kv: int = 0
    compute: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    def to_dict(self) -> dict[str, int]:
        return {"weights": self.weights, "kv": self.kv, "compute": self.compute, "total": self.total}


@dataclass(frozen=True)
class MemoryEstimate:
    devices: dict[str, DeviceMemory]
    n_gpu_layers: int
    layers: dict[str, int]  # device -> repeating layers placed there (output layer not counted)
    output_device: str
    n_ctx: int  # after llama.cpp's padding
    kv_type: tuple[str, str]
    notes: tuple[str, ...] = ()
    # device -> llama.cpp's model buffers there, by the name its load log prints (CPU_Mapped, CPU_REPACK...)
    buffers: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def layers_offloaded(self) -> int:
        """As llama.cpp prints it: ``offloaded X/Y layers`` where Y = n_layer + 1."""
        return sum(n for d, n in self.layers.items() if d != CPU) + (0 if self.output_device == CPU else 1)

    def fits(self, free: Mapping[str, int], margin: int = 0) -> list[str]:
        """Devices where the estimate exceeds ``free - margin`` (empty list: it fits)."""
        over = []
        for name, mem in self.devices.items():
            if name in free and mem.total > free[name] - margin:
                over.append(name)
        return over

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": {name: mem.to_dict() for name, mem in self.devices.items()},
            "n_gpu_layers": self.n_gpu_layers,
            "layers": dict(self.layers),
            "output_device": self.output_device,
            "layers_offloaded": self.layers_offloaded,
            "n_ctx": self.n_ctx,
            "type_k": self.kv_type[0],
            "type_v": self.kv_type[1],
            "notes": list(self.notes),
            "buffers": {d: dict(b) for d, b in self.buffers.items()},
        }


def layer_devices(n_layer: int, n_gpu_layers: int, devices: Sequence[str], tensor_split: Sequence[float] | None = None) -> list[str]:
    """The device of each layer 0..n_layer (the last index is the output layer)."""
    ngl = offloaded_layers(n_gpu_layers, n_layer)
    if not devices:
        return [CPU] * (n_layer + 1)
    split = list(tensor_split) if tensor_split else [1.0] * len(devices)
    if len(split) < len(devices):
        split += [0.0] * (len(devices) - len(split))
    split = split[: len(devices)]
    if sum(split) <= 0:
        split = [1.0] * len(devices)
    total = float(sum(split))
    cumulative, acc = [], 0.0
    for part in split:
        acc += part
        cumulative.append(acc / total)
    i_gpu_start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1)
    out = []
    for il in range(n_layer + 1):
        if il < i_gpu_start or (il - i_gpu_start) >= act:
            out.append(CPU)
            continue
        x = float(il - i_gpu_start) / act
        # std::upper_bound: first cumulative share strictly greater than x
        index = next((i for i, c in enumerate(cumulative) if c > x), len(devices) - 1)
        out.append(devices[min(index, len(devices) - 1)])
    return out


def _matches(patterns: Sequence[Any], name: str) -> bool:
    return any(p.search(name) for p in patterns)


def _stage(name: str) -> str | None:
    """The compute stage a repeating layer's weight feeds: attention or ffn (the experts' matrices
    included; a router or a norm decides no buffer)."""
    role = tensor_role(name)
    if role == "experts":
        return "ffn" if "_exps" in name or "_chexps" in name else None
    return role if role in ("attention", "ffn") else None


def compute_buffer(
    model: ModelInfo,
    *,
    n_ctx: int,
    n_ubatch: int,
    flash_attn: bool,
    has_output: bool = True,
    has_layers: bool = True,
    host: bool = True,
    masks: Sequence[int] | None = None,
    stages: Collection[str] = ("attention", "ffn"),
) -> int:
    """llama.cpp's compute buffer for one backend that runs repeating layers and/or the output.

    The worst-case graph reserved at context creation has ``n_ubatch`` tokens against all
    ``n_ctx`` cells, every token an output. The graph allocator reuses memory between layers,
    so the buffer is the KQ masks plus the largest stage:

    - the masks: one per kind of KV cache this backend's layers read (``masks``, in cells: a
      sliding-window model's window cache has its own, llm_graph_input_attn_kv_iswa); by default
      one of ``n_ctx`` cells;
    - attention: without flash attention the f32 scores (cells * ``n_ubatch`` * n_head, over the
      largest cache the backend reads), plus Q, K, V and four n_embd-wide rows per token;
    - FFN: gate, up and their product per token (per used expert in an MoE);
    - output: the f32 logits of every token, plus five n_embd-wide rows.

    ``stages`` names the layer stages whose weights this backend holds (tensor overrides can move a
    layer's FFN or attention to another backend; the op runs where its weights are).

    Fitted to the sizes llama.cpp 0.3.36's ``sched_reserve`` prints for dense and MoE models
    (benchmarks/estimate_accuracy.py measures the error).
    """
    ub = n_ubatch
    f32 = 4
    masks = list(masks) if masks else [n_ctx]
    n_q = model.n_head * model.head_size_k
    n_kv_embd = model.n_head_kv * model.head_size_k + model.n_head_kv * model.head_size_v
    mask = sum(masks) * ub * (2 if flash_attn else 4)
    peaks = [0]
    if has_layers:
        scores = 0 if flash_attn else max(masks) * ub * model.n_head * f32
        if "attention" in stages:
            peaks.append(scores + ub * (n_q + n_kv_embd + 4 * model.n_embd) * f32)
        n_ff = model.n_ff or 4 * model.n_embd
        if "ffn" in stages and model.is_moe:
            peaks.append(ub * (3 * model.expert_used_count * n_ff + 2 * model.n_embd + model.expert_count) * f32)
        elif "ffn" in stages:
            peaks.append(ub * (3 * n_ff + 2 * model.n_embd) * f32)
    if has_output:
        # the host also keeps the input embeddings and norms live next to the logits
        peaks.append(ub * (model.n_vocab + (5 if host else 1) * model.n_embd) * f32)
    return (mask if has_layers else 0) + max(peaks)


def moved_stage_buffer(model: ModelInfo, *, n_ubatch: int, stages: Collection[str]) -> int:
    """What a backend that runs no layer of its own reserves for the ops whose weights tensor
    overrides moved onto it (the host, with -ot or --n-cpu-moe): the layer's input row and the
    outputs of those matrices (gate and up of each used expert, one n_ff row for a dense FFN; Q, K
    and V), fitted to llama.cpp's sched_reserve sizes for MoE and dense models with flash attention
    (without it the host's buffer is up to a third smaller: the allocator overlaps them with the mask)."""
    f32 = 4
    n_ff = model.n_ff or 4 * model.n_embd
    peaks = [0]
    if "ffn" in stages:
        per_token = (2 * n_ff * model.expert_used_count if model.is_moe else n_ff) + model.n_embd
        peaks.append(n_ubatch * per_token * f32)
    if "attention" in stages:
        n_kv_embd = model.n_head_kv * model.head_size_k + model.n_head_kv * model.head_size_v
        peaks.append(n_ubatch * (model.n_head * model.head_size_k + n_kv_embd) * f32)
    return max(peaks)


def estimate(model: ModelInfo, settings: Any, *, devices: Sequence[str] | None = None,
             cpu: CpuFeatures | None = None) -> MemoryEstimate:
    """Bytes per device (``CPU`` plus each accelerator) for one candidate ``settings`` (a ``tuner.Settings``).

    ``devices`` are the accelerator names as llama.cpp prints them (``CUDA0``, ``RPC0[host:port]``);
    the default is one device ``GPU0``, or ``GPU0..GPUn-1`` for an n-way ``tensor_split``.
    ``cpu``: the CPU backend's features as llama.cpp reports them, which decide the repacked weights.
    """
    n_gpu_layers = settings.n_gpu_layers
    tensor_split = settings.tensor_split
    type_k, type_v = settings.type_k, settings.type_v
    n_ubatch = settings.n_ubatch
    offload_kqv = settings.offload_kqv
    flash_attn = flash_attn_forms(settings.flash_attn).enabled
    swa_full = settings.swa_full
    for name, value in (("type_k", type_k), ("type_v", type_v)):
        if value not in KV_TYPE_BLOCKS:
            raise SettingsError(name, f"expected one of {', '.join(KV_TYPE_BLOCKS)}, got {value!r}")
    n_ctx = context_tokens(settings.n_ctx, model.n_ctx_train)
    if devices is None:
        count = len(tensor_split) if tensor_split else 1
        devices = [f"GPU{i}" for i in range(count)] if n_gpu_layers != 0 else []
    devices = list(devices)
    if tensor_split is not None and devices and len(tensor_split) > len(devices):
        raise SettingsError("tensor_split", f"{len(tensor_split)} proportions for {len(devices)} devices")
    tensor_overrides = settings.host_overrides
    n_layer = model.n_layer
    layer_targets = devices
    if settings.split_mode == "none" and devices:
        # one device takes every offloaded layer: main_gpu (src/llama.cpp, llama_model_load_from_splits)
        if settings.main_gpu >= len(devices):
            raise SettingsError("main_gpu", f"expected a device index below {len(devices)} ({', '.join(devices)}), got {settings.main_gpu}")
        layer_targets, tensor_split = [devices[settings.main_gpu]], None
    placement = layer_devices(n_layer, n_gpu_layers, layer_targets, tensor_split)
    patterns = [tensor_regex(p) for p in tensor_overrides]  # RE2: linear time (tuner.limits)
    weights: dict[str, int] = {CPU: 0, **{d: 0 for d in devices}}
    kv: dict[str, int] = {CPU: 0, **{d: 0 for d in devices}}
    layers: dict[str, int] = {CPU: 0, **{d: 0 for d in devices}}

    # Weights: tensor by tensor, so overrides apply exactly. Which layer stages (attention, FFN)
    # each backend holds weights of decides the ops it runs, so its compute buffer.
    stages_on: dict[str, set[str]] = {d: set() for d in [CPU, *devices]}
    moved_to_host: set[str] = set()
    # the host's weights: repacked into an extra buffer (repack on, a type this CPU repacks, no
    # accelerator's pinned host buffer taking them first), or in the mapped file / CPU buffer
    repack_on = bool(getattr(settings, "repack", True)) and cpu is not None and not takes_host_weights(devices)
    extra: dict[str, int] = {}
    on_host: list[Any] = []
    repacked_in_file = 0
    block = re.compile(r"^blk\.(\d+)\.")
    for tensor in model.tensors:
        m = block.match(tensor.name)
        if m and int(m.group(1)) < n_layer:
            device = placement[int(m.group(1))]
        elif tensor.name.startswith(("output.", "output_norm.")):
            device = placement[n_layer]
        else:
            device = CPU  # token embeddings and anything else outside the blocks stay on the host
        stage = _stage(tensor.name) if m else None
        if device != CPU and _matches(patterns, tensor.name):
            device = CPU
            if stage:
                moved_to_host.add(stage)
        if stage:
            stages_on[device].add(stage)
        if device == CPU:
            buffer = extra_buffer(tensor.name, tensor.type, tensor.shape, cpu) if repack_on else None
            if buffer:
                extra[buffer] = extra.get(buffer, 0) + pad(extra_size(buffer, tensor.type, tensor.shape, tensor.n_bytes), 32)
                repacked_in_file += tensor.n_bytes
            else:
                on_host.append(tensor)
        else:
            weights[device] += tensor.n_bytes
        if tensor.name.startswith("token_embd.") and model.tied_output:
            # the output head is a copy of the token embedding, loaded with the output layer
            # when that layer is offloaded (on the host the one copy serves both)
            output_device = placement[n_layer]
            if output_device != CPU and not _matches(patterns, tensor.name):
                weights[output_device] += tensor.n_bytes
    for il in range(n_layer):
        layers[placement[il]] += 1
    host_buffer = _host_weights(on_host, getattr(settings, "use_mmap", True))
    # what the host holds: its own tensors and every repacked copy; with mmap also the file's pages of
    # the repacked tensors (mapped, and read to repack them). The mapped span's other pages belong to
    # offloaded tensors, read once to upload them, and are not counted.
    weights[CPU] = sum(t.n_bytes for t in on_host) + sum(extra.values())
    if getattr(settings, "use_mmap", True):
        weights[CPU] += repacked_in_file
    buffers: dict[str, dict[str, int]] = {CPU: {("CPU_Mapped" if getattr(settings, "use_mmap", True) else "CPU"): host_buffer,
                                               **extra}}
    buffers.update({d: {d: weights[d]} for d in devices if weights[d]})

    # KV cache, per layer, padded cells. A sliding-window layer's cache holds the window and a
    # micro-batch (llama_kv_cache_iswa: min(n_ctx, n_swa + n_ubatch), padded), or all of n_ctx
    # with swa_full.
    # With several sequences (n_parallel, llama-server's slots): kv_layout's streams.
    swa = set(model.swa_layers) if model.sliding_window else set()
    layout = kv_layout(n_ctx, n_ubatch, model.sliding_window if swa else None, swa_full,
                       n_seq=getattr(settings, "n_parallel", 1), unified=getattr(settings, "kv_unified", False))
    cells, swa_cells = layout.total
    for il in range(n_layer):
        per_token = model.kv_bytes_per_token_layer(il, type_k, type_v)
        device = placement[il] if offload_kqv else CPU
        kv[device] += per_token * (swa_cells if il in swa else cells)

    # The KQ masks each backend holds: one per kind of cache its layers read (full-context and
    # sliding-window caches each have their own); the host, which builds the graph's inputs,
    # holds every kind the model has. With one stream per sequence, the worst-case micro-batch is
    # split among the streams (n_ubatch / n_stream tokens against each stream's cells): the masks
    # and attention scores are those of one stream's cells for all n_ubatch tokens.
    cells_of = {False: layout.cells, True: layout.swa_cells}
    kinds: dict[str, set[bool]] = {d: set() for d in [CPU, *devices]}
    for il in range(n_layer):
        if il in model.kv_layers or not model.kv_layers:
            kinds[placement[il]].add(il in swa)
    every_kind = sorted(set().union(*kinds.values()) or {False})

    def masks_of(device: str) -> list[int]:
        return [cells_of[k] for k in sorted(kinds[device])] or [layout.cells]

    # Compute buffers. Each backend that runs layers reserves its own graph peak. A host that
    # runs layers also holds the logits (they land on the host), so it gets the output stage.
    # A host that runs no layer keeps the graph inputs: the KQ masks and a few embedding rows.
    # With several devices and everything offloaded, llama.cpp pipelines micro-batches
    # (pipeline_parallel, GGML_SCHED_MAX_COPIES = 4 copies of the inputs).
    pipeline = (len([d for d in devices if layers[d] or placement[n_layer] == d]) > 1 and n_gpu_layers != 0
                and placement.count(CPU) == 0 and offload_kqv and not patterns)
    copies = 4 if pipeline else 1
    mask_bytes = lambda m: sum(m) * n_ubatch * (2 if flash_attn else 4)  # noqa: E731
    row = n_ubatch * model.n_embd * 4
    host_runs_layers = layers[CPU] > 0 or placement[n_layer] == CPU
    compute: dict[str, int] = {}
    for device in [CPU, *devices]:
        runs_layers = layers[device] > 0
        runs_output = placement[n_layer] == device
        if device == CPU:
            if host_runs_layers:
                compute[device] = compute_buffer(model, n_ctx=layout.cells, n_ubatch=n_ubatch, flash_attn=flash_attn,
                                                 has_output=True, has_layers=runs_layers,
                                                 masks=[cells_of[k] for k in every_kind])
            else:
                compute[device] = (copies * mask_bytes([cells_of[k] for k in every_kind])
                                   + ((5 if flash_attn else 9) if pipeline else (2 if flash_attn else 3)) * row
                                   + moved_stage_buffer(model, n_ubatch=n_ubatch, stages=moved_to_host))
        elif runs_layers or runs_output:
            compute[device] = compute_buffer(model, n_ctx=layout.cells, n_ubatch=n_ubatch, flash_attn=flash_attn,
                                             has_output=runs_output, has_layers=runs_layers, host=False,
                                             masks=masks_of(device), stages=stages_on[device])
            if pipeline:
                compute[device] += (copies - 1) * mask_bytes(masks_of(device)) + (4 if flash_attn else 7) * row
        else:
            compute[device] = 0

    notes = []
    for buffer, size in extra.items():
        notes.append(f"{buffer}: {size / MiB:.2f} MiB of weights repacked for this CPU ({cpu.describe() if cpu else ''}), "
                     + ("on top of the mapped file" if getattr(settings, "use_mmap", True) else "beside the CPU buffer"))
    if patterns:
        notes.append(f"{len(patterns)} tensor override pattern(s) keep matching tensors on the host")
    if not offload_kqv:
        notes.append("offload_kqv is off: the whole KV cache stays on the host")
    out = {
        d: DeviceMemory(weights=weights[d], kv=kv[d], compute=compute.get(d, 0))
        for d in [CPU, *devices]
    }
    return MemoryEstimate(
        devices=out,
        n_gpu_layers=offloaded_layers(n_gpu_layers, n_layer),
        layers=layers,
        output_device=placement[n_layer],
        n_ctx=cells,
        kv_type=(type_k, type_v),
        notes=tuple(notes),
        buffers=buffers,
    )


def _host_weights(tensors: Sequence[Any], use_mmap: bool) -> int:
    """The host's plain weight buffer: with mmap, per file, the span from the first of these tensors to
    the end of the last (llama_model_loader::get_mapping_range); without, each tensor padded to 32 bytes
    (ggml_backend_alloc_ctx_tensors_from_buft). Tensors of unknown offset count their own bytes."""
    if not use_mmap:
        return sum(pad(t.n_bytes, 32) for t in tensors)
    spans: dict[int, list[int]] = {}
    loose = 0
    for t in tensors:
        offset = getattr(t, "offset", -1)
        if offset < 0:
            loose += t.n_bytes
            continue
        span = spans.setdefault(getattr(t, "part", 0), [offset, offset + t.n_bytes])
        span[0], span[1] = min(span[0], offset), max(span[1], offset + t.n_bytes)
    return loose + sum(last - first for first, last in spans.values())


def max_gpu_layers(
    model: ModelInfo,
    settings: Any,
    free: Mapping[str, int],
    *,
    margin: int = 512 * MiB,
    devices: Sequence[str] | None = None,
) -> int:
    """The most layers (0..n_layer+1) whose estimate with ``settings`` (its ``n_gpu_layers`` aside)
    fits every device in ``free`` less ``margin``.

    ``free`` maps accelerator names (as passed in ``devices``, which default to its keys) to free
    bytes; a ``CPU`` entry, if present, is not a limit here. Returns 0 when even one layer does not fit.
    """
    devices = list(devices) if devices else [d for d in free if d != CPU]
    best = 0
    # Memory grows with n_gpu_layers on the accelerators, so the largest that fits is found by
    # scanning up (n_layer is at most a few hundred; each step is cheap arithmetic).
    for ngl in range(0, model.n_layer + 2):
        est = estimate(model, dataclasses.replace(settings, n_gpu_layers=ngl), devices=devices)
        over = [d for d in est.fits(free, margin) if d != CPU]
        if over:
            break
        best = ngl
    return best


def format_estimate(est: MemoryEstimate) -> str:
    lines = [
        f"n_gpu_layers {est.n_gpu_layers}: offloaded {est.layers_offloaded}/{sum(est.layers.values()) + 1} layers, "
        f"n_ctx {est.n_ctx}, KV {est.kv_type[0]}/{est.kv_type[1]}",
        f"  {'device':<24} {'weights':>10} {'kv':>10} {'compute':>10} {'total':>10}  (MiB)",
    ]
    for name, mem in est.devices.items():
        lines.append(
            f"  {name:<24} {mem.weights / MiB:>10.2f} {mem.kv / MiB:>10.2f} {mem.compute / MiB:>10.2f} {mem.total / MiB:>10.2f}"
        )
    for name, held in est.buffers.items():
        if len(held) > 1 or any(b != name for b in held):
            parts = " + ".join(f"{b} {size / MiB:.2f}" for b, size in held.items() if size or b.startswith("CPU"))
            lines.append(f"  {name} model buffers (MiB, as llama.cpp's load log names them): {parts}")
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)
