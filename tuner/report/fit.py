"""Will it fit on that machine? The memory arithmetic turned into answers.

For a model (``ModelInfo``) and a machine (``MachineSpec``: accelerators with the bytes each can give,
and RAM), these answer the questions asked before a download or a purchase, and the ones
``diagnose`` asks of a failed load:

Every answer is for a ``Settings`` (context, KV types, flash attention, batch, overrides...), as the
memory arithmetic takes it; its ``n_gpu_layers`` is what the answers vary.

- ``most_layers``: the most layers (``n_gpu_layers``, 0 .. n_layer + 1) whose estimate fits every
  accelerator less a margin, with the layers spread over several devices in proportion to their
  memory, as llama.cpp spreads them by default (``tensor_split`` from each device's free memory);
- ``fit_grid``: that answer for each context and KV cache type;
- ``quantization_table``: one row per standard quantization of this model (sizes from
  ``model/quant.py``), full offload or the most layers at each context;
- ``largest_quantization_that_fits``: the biggest standard file that runs fully offloaded.

Pure arithmetic on top of ``model/estimate.py``; nothing is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..engine.dimensions import UNQUANTIZED_KV
from ..engine.settings import Settings
from ..machine.whatif import MachineSpec, gib
from ..model.estimate import CPU, MemoryEstimate, estimate
from ..model.inspect import ModelInfo
from ..model.quant import STANDARD, requantized
from ..model.special import context_tokens

MiB = 1 << 20
DEFAULT_MARGIN = 512 * MiB
KV_TYPES = ("f16", "q8_0", "q4_0")


def split_for(spec: MachineSpec) -> list[float] | None:
    """llama.cpp's default tensor split: each device's share of the total free memory."""
    if len(spec.devices) < 2:
        return None
    return [float(size) for size in spec.devices.values()]


def estimate_on(info: ModelInfo, spec: MachineSpec, n_gpu_layers: int, settings: Settings) -> MemoryEstimate:
    """``estimate`` of ``settings`` with ``n_gpu_layers`` on the machine's accelerators, the layers
    split by the settings' ``tensor_split`` or else by each device's memory."""
    devices = list(spec.devices)
    split = settings.tensor_split or split_for(spec)
    return estimate(info, settings.replace(n_gpu_layers=n_gpu_layers if devices else 0,
                                           tensor_split=tuple(split) if split else None), devices=devices)


def over(est: MemoryEstimate, spec: MachineSpec, margin: int = DEFAULT_MARGIN) -> dict[str, int]:
    """Accelerators where the estimate exceeds what they can give less the margin: device -> bytes short."""
    return {name: mem.total - (spec.devices[name] - margin)
            for name, mem in est.devices.items()
            if name in spec.devices and mem.total > spec.devices[name] - margin}


def most_layers(info: ModelInfo, spec: MachineSpec, settings: Settings, margin: int = DEFAULT_MARGIN) -> int:
    """The most layers that fit (0 when not even one does, or there is no accelerator).

    Memory on the accelerators grows with the layer count, so a bisection finds the boundary; the
    two counts above it are checked too, because spreading layers over several devices by
    proportion can make one device's share step back by a layer as the count grows.
    """
    if not spec.devices:
        return 0
    top = info.n_layer + 1

    def ok(ngl: int) -> bool:
        return not over(estimate_on(info, spec, ngl, settings), spec, margin)

    if ok(top):
        return top
    lo, hi = 0, top  # ok(lo) assumed (0 layers need no accelerator memory but a compute buffer), not ok(hi)
    if not ok(1):
        return 0
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    for extra in (lo + 2, lo + 1):
        if extra < top and ok(extra):
            return extra
    return lo


@dataclass(frozen=True)
class Fit:
    """One answer: at these settings, this many layers fit; full offload or not; host memory."""

    n_ctx: int
    type_k: str
    type_v: str
    layers: int          # n_gpu_layers that fit (0 .. n_layer + 1)
    layers_total: int    # n_layer + 1, as llama.cpp counts "offloaded X/Y layers"
    host_bytes: int      # what the host needs at that layer count (weights, KV, compute)
    ram_ok: bool | None  # None when the machine's RAM is not known

    @property
    def full(self) -> bool:
        return self.layers >= self.layers_total

    def cell(self) -> str:
        return "yes" if self.full else str(self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"n_ctx": self.n_ctx, "type_k": self.type_k, "type_v": self.type_v, "layers": self.layers,
                "layers_total": self.layers_total, "full_offload": self.full, "host_bytes": self.host_bytes,
                "ram_ok": self.ram_ok}


def fit(info: ModelInfo, spec: MachineSpec, settings: Settings, margin: int = DEFAULT_MARGIN) -> Fit:
    layers = most_layers(info, spec, settings, margin)
    est = estimate_on(info, spec, layers, settings)
    host = est.devices[CPU].total
    return Fit(n_ctx=est.n_ctx, type_k=settings.type_k, type_v=settings.type_v, layers=layers, layers_total=info.n_layer + 1,
               host_bytes=host, ram_ok=None if spec.ram is None else host <= spec.ram)


def contexts_for(info: ModelInfo, wanted: Iterable[int] = (4096, 16384, 32768)) -> list[int]:
    """4k / 16k / 32k (those the model allows) and the training context, in order."""
    out = sorted({c for c in wanted if 0 < c <= info.n_ctx_train} | {info.n_ctx_train})
    return out


def fit_grid(info: ModelInfo, spec: MachineSpec, contexts: Sequence[int], kv_types: Sequence[str] = KV_TYPES,
             base: Settings | None = None, margin: int = DEFAULT_MARGIN) -> list[Fit]:
    """``fit`` for every context and KV type (K and V the same; a quantized V cache needs flash
    attention, so it is switched on for those when ``base`` has it off)."""
    base = base or Settings(model_path=info.path)
    out = []
    for ctx in contexts:
        for kv in kv_types:
            if kv not in info.kv_bytes_per_token:
                continue  # the head size does not divide into this type's blocks
            flash = "on" if kv not in UNQUANTIZED_KV and base.flash_attn == "off" else base.flash_attn
            out.append(fit(info, spec, base.replace(n_ctx=ctx, type_k=kv, type_v=kv, flash_attn=flash), margin))
    return out


@dataclass(frozen=True)
class QuantRow:
    """One standard quantization of this model on the machine."""

    quantization: str
    size: int                 # bytes of tensor data
    bits_per_weight: float
    fits: tuple[Fit, ...]     # one per context
    approximations: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"quantization": self.quantization, "size": self.size, "bits_per_weight": round(self.bits_per_weight, 3),
                "contexts": {str(f.n_ctx): ("yes" if f.full else f.layers) for f in self.fits},
                "fits": [f.to_dict() for f in self.fits], "approximations": list(self.approximations)}


def quantization_table(info: ModelInfo, spec: MachineSpec, contexts: Sequence[int], settings: Settings | None = None,
                       quantizations: Sequence[str] = STANDARD, margin: int = DEFAULT_MARGIN) -> list[QuantRow]:
    """Rows largest first: for each quantization, full offload (``yes``) or the most layers at each context."""
    from ..model.quant import quantized_size

    settings = settings or Settings(model_path=info.path)
    rows = []
    for quant in quantizations:
        size = quantized_size(info, quant)
        variant = requantized(info, quant)
        fits = tuple(fit(variant, spec, settings.replace(n_ctx=ctx), margin) for ctx in contexts)
        rows.append(QuantRow(quant, size.n_bytes, size.bits_per_weight, fits, size.approximations))
    rows.sort(key=lambda r: -r.size)
    return rows


def largest_quantization_that_fits(info: ModelInfo, spec: MachineSpec, settings: Settings,
                                   quantizations: Sequence[str] = STANDARD, margin: int = DEFAULT_MARGIN,
                                   below: int | None = None) -> tuple[str, ModelInfo, MemoryEstimate] | None:
    """The largest standard quantization (by size, at most ``below`` bytes) that runs fully offloaded."""
    from ..model.quant import quantized_size

    sized = sorted(((quantized_size(info, q).n_bytes, q) for q in quantizations), reverse=True)
    for size, quant in sized:
        if below is not None and size >= below:
            continue
        variant = requantized(info, quant)
        est = estimate_on(variant, spec, info.n_layer + 1, settings)
        if not over(est, spec, margin):
            return quant, variant, est
    return None


def format_grid(grid: Sequence[Fit], kv_types: Sequence[str] = KV_TYPES) -> list[str]:
    kinds = [k for k in kv_types if any(f.type_k == k for f in grid)]
    lines = [f"    {'n_ctx':>8}  " + "  ".join(f"{k:>9}" for k in kinds)]
    for ctx in dict.fromkeys(f.n_ctx for f in grid):
        cells = {f.type_k: f for f in grid if f.n_ctx == ctx}
        row = []
        for k in kinds:
            f = cells.get(k)
            row.append(f"{'-':>9}" if f is None else f"{('full' if f.full else f'{f.layers}/{f.layers_total}'):>9}")
        lines.append(f"    {ctx:>8}  " + "  ".join(row))
    return lines


def answer_lines(info: ModelInfo, spec: MachineSpec, grid: Sequence[Fit], largest: tuple[str, Any, Any] | None,
                 settings: Settings) -> list[str]:
    """The what-if answer in words: per context and KV type, then full offload and with what file."""
    lines = [f"machine: {spec.describe()} ({spec.source})",
             f"most layers that fit (of {info.n_layer + 1}; 'full' = every layer), by context and KV cache type:"]
    lines += format_grid(grid)
    full = [f for f in grid if f.full]
    if full:
        best = max(full, key=lambda f: (f.n_ctx, f.type_k == "f16"))
        lines.append(f"full offload: yes, {info.quantization} up to n_ctx {best.n_ctx} with {best.type_k} KV")
    else:
        lines.append(f"full offload: no, not with {info.quantization} at any of these contexts")
    if largest is not None:
        quant, variant, est = largest
        lines.append(f"largest standard quantization fully offloaded at n_ctx {est.n_ctx} ({settings.type_k} KV): "
                     f"{quant} ({gib(variant.file_size)} file)")
    else:
        lines.append(f"no standard quantization of this model runs fully offloaded at n_ctx "
                     f"{context_tokens(settings.n_ctx, info.n_ctx_train)} on this machine")
    short = [f for f in grid if f.ram_ok is False]
    if short:
        lines.append(f"RAM: the host part needs more than {spec.ram / (1 << 30):.1f} GiB at "
                     + ", ".join(f"n_ctx {f.n_ctx} {f.type_k}" for f in short[:4]))
    return lines


def format_table(rows: Sequence[QuantRow], contexts: Sequence[int], n_ctx_train: int) -> list[str]:
    heads = [("train " if c == n_ctx_train else "") + (f"{c // 1024}k" if c % 1024 == 0 else str(c)) for c in contexts]
    lines = [f"  {'quantization':<13} {'size':>10} {'bpw':>6}  " + "  ".join(f"{h:>10}" for h in heads)]
    for r in rows:
        lines.append(f"  {r.quantization:<13} {gib(r.size):>10} {r.bits_per_weight:>6.2f}  "
                     + "  ".join(f"{('yes' if f.full else str(f.layers)):>10}" for f in r.fits))
    notes: dict[str, list[str]] = {}
    for r in rows:
        for note in r.approximations:
            notes.setdefault(note, []).append(r.quantization)
    lines += [f"note ({', '.join(quants)}): {note}" for note, quants in notes.items()]
    return lines
