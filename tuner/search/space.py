"""What to try: the search space, built from this machine (probe) and the model (inspect).

Dimensions that cannot matter on this machine are left out, each with the reason, so the output
can say why (no GPU: no n_gpu_layers and no split; a dense model: no expert placement; a short
benchmark prompt: no n_batch).
"""

from __future__ import annotations

import hashlib
import json
import re

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..model.inspect import ModelInfo
from ..engine.settings import Settings

# Tensor placement strategies (llama.cpp's -ot PATTERN=CPU): which tensors of the first k
# repeating layers stay on the host while the rest of the layer is offloaded.
PLACEMENTS = {
    "none": None,
    "ffn_cpu": r"ffn_(gate|up|down)(_exps)?\.weight",  # the FFN (dense or experts) of the first k layers
    "experts_cpu": r"ffn_(gate|up|down)_exps\.weight",  # only the MoE experts of the first k layers
    "attn_cpu": r"attn_(q|k|v|output|qkv)\.weight",  # the attention of the first k layers
}


def placement_patterns(strategy: str, k: int) -> tuple[str, ...]:
    """``-ot`` regexes for a strategy over layers 0..k-1."""
    suffix = PLACEMENTS.get(strategy)
    if not suffix or k <= 0:
        return ()
    layers = "|".join(str(i) for i in range(k))
    return (rf"^blk\.({layers})\.{suffix}$",)


def placement_of(overrides: Sequence[str]) -> tuple[str, int]:
    """The strategy and k whose ``placement_patterns`` are ``overrides`` (("none", 0) for none).

    Raises ValueError for overrides no strategy writes."""
    if not overrides:
        return "none", 0
    if len(overrides) == 1:
        m = re.match(r"^\^blk\\\.\(([\d|]+)\)\\\.", overrides[0])
        if m:
            k = len(m.group(1).split("|"))
            for strategy in PLACEMENTS:
                if placement_patterns(strategy, k) == tuple(overrides):
                    return strategy, k
    raise ValueError(f"tensor overrides {list(overrides)} are not a placement strategy of the search space")


@dataclass(frozen=True)
class Device:
    """An accelerator as llama.cpp names it, with the memory the tuner may plan with."""

    name: str  # CUDA0, Metal, RPC0[127.0.0.1:50052] ...
    free: int  # bytes
    total: int
    rpc_endpoint: str | None = None


@dataclass(frozen=True)
class SearchSpace:
    variants: tuple[str, ...]  # model paths, same model in other quantizations
    devices: tuple[Device, ...]
    n_layer: int
    n_ctx: tuple[int, ...]
    kv_types: tuple[str, ...]
    flash_attn: tuple[str, ...]
    threads: tuple[int, ...]
    n_ubatch: tuple[int, ...]
    n_batch: tuple[int, ...]
    placements: tuple[str, ...]
    offload_kqv: tuple[bool, ...]
    excluded: dict[str, str] = field(default_factory=dict)  # dimension -> why it is left out
    rpc_servers: tuple[str, ...] = ()

    @property
    def has_gpu(self) -> bool:
        return bool(self.devices)

    def dimensions(self) -> dict[str, Any]:
        dims: dict[str, Any] = {}
        if len(self.variants) > 1:
            dims["variant"] = [Path(v).name for v in self.variants]
        if self.has_gpu:
            dims["n_gpu_layers"] = (0, self.n_layer + 1)
            if len(self.devices) > 1:
                for d in self.devices[:-1]:
                    dims[f"layers_on[{d.name}]"] = (0, self.n_layer + 1)
        for name in ("n_ctx", "kv_types", "flash_attn", "threads", "n_ubatch", "n_batch", "placements", "offload_kqv"):
            values = getattr(self, name)
            if len(values) > 1:
                dims[name] = list(values)
        if self.has_gpu and len(self.placements) > 1:
            dims["placement_layers"] = (1, self.n_layer)
        return dims

    def grid_size(self) -> int:
        size = 1
        for value in self.dimensions().values():
            size *= (value[1] - value[0] + 1) if isinstance(value, tuple) else len(value)
        return size

    def fingerprint(self) -> str:
        data = asdict(self)
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def describe(self) -> str:
        lines = ["search space:"]
        for name, value in self.dimensions().items():
            shown = f"{value[0]}..{value[1]}" if isinstance(value, tuple) else ", ".join(map(str, value))
            lines.append(f"  {name}: {shown}")
        for name, why in self.excluded.items():
            lines.append(f"  (left out) {name}: {why}")
        return "\n".join(lines)

    # -- candidates --------------------------------------------------------------------------

    def suggest(self, trial: Any) -> Settings:
        """Ask an Optuna trial (or anything with suggest_int/suggest_categorical) for a candidate."""
        variant = self.variants[0]
        if len(self.variants) > 1:
            name = trial.suggest_categorical("variant", [Path(v).name for v in self.variants])
            variant = next(v for v in self.variants if Path(v).name == name)
        ngl = 0
        split = None
        if self.has_gpu:
            ngl = trial.suggest_int("n_gpu_layers", 0, self.n_layer + 1)
            if len(self.devices) > 1:
                counts = [trial.suggest_int(f"layers_on[{d.name}]", 0, self.n_layer + 1) for d in self.devices[:-1]]
                split = self.split_from_counts(ngl, counts)
        choose = lambda name, values: values[0] if len(values) == 1 else trial.suggest_categorical(name, list(values))  # noqa: E731
        n_ctx = choose("n_ctx", self.n_ctx)
        kv = choose("kv_types", self.kv_types)
        fa = choose("flash_attn", self.flash_attn)
        threads = choose("threads", self.threads)
        ubatch = choose("n_ubatch", self.n_ubatch)
        batch = max(choose("n_batch", self.n_batch), ubatch)
        placement = choose("placements", self.placements) if self.has_gpu else "none"
        offload_kqv = choose("offload_kqv", self.offload_kqv) if self.has_gpu else True
        k = trial.suggest_int("placement_layers", 1, self.n_layer) if placement != "none" else 0
        return self.settings(variant=variant, n_gpu_layers=ngl, tensor_split=split, n_ctx=n_ctx, kv=kv, flash_attn=fa,
                             threads=threads, n_ubatch=ubatch, n_batch=batch, placement=placement, placement_layers=k,
                             offload_kqv=offload_kqv)

    def split_from_counts(self, ngl: int, counts: Sequence[int]) -> tuple[float, ...] | None:
        """Layer counts per device -> llama.cpp's tensor split (the last device takes the rest).

        Raises ValueError when the counts exceed the offloaded layers."""
        used = sum(counts)
        if used > ngl:
            raise ValueError(f"layer counts {list(counts)} add up to more than n_gpu_layers {ngl}")
        return tuple(float(c) for c in counts) + (float(ngl - used),) if ngl else None

    def settings(self, *, variant: str, n_gpu_layers: int = 0, tensor_split: tuple[float, ...] | None = None,
                 n_ctx: int, kv: str, flash_attn: str, threads: int | None, n_ubatch: int, n_batch: int,
                 placement: str = "none", placement_layers: int = 0, offload_kqv: bool = True) -> Settings:
        return Settings(
            model_path=variant,
            n_gpu_layers=n_gpu_layers,
            tensor_split=tensor_split if tensor_split and sum(tensor_split) > 0 else None,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_ubatch,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=flash_attn,
            type_k=kv,
            type_v=kv,
            offload_kqv=offload_kqv,
            tensor_overrides=placement_patterns(placement, placement_layers),
            rpc_servers=self.rpc_servers,
        )

    def params_for(self, s: Settings) -> dict[str, Any]:
        """The Optuna parameters that produce ``s`` (for enqueueing seed trials)."""
        params: dict[str, Any] = {}
        if len(self.variants) > 1:
            params["variant"] = Path(s.model_path).name
        if self.has_gpu:
            params["n_gpu_layers"] = min(s.n_gpu_layers if s.n_gpu_layers >= 0 else self.n_layer + 1, self.n_layer + 1)
            if len(self.devices) > 1:
                counts = _counts_from_split(self.n_layer, params["n_gpu_layers"], s.tensor_split, len(self.devices))
                for d, c in zip(self.devices[:-1], counts):
                    params[f"layers_on[{d.name}]"] = c
        for name, value in (("n_ctx", s.n_ctx), ("kv_types", s.type_k), ("flash_attn", s.flash_attn),
                            ("threads", s.n_threads), ("n_ubatch", s.n_ubatch), ("n_batch", s.n_batch)):
            if len(getattr(self, name)) > 1:
                params[name] = value
        if self.has_gpu and len(self.offload_kqv) > 1:
            params["offload_kqv"] = s.offload_kqv
        if self.has_gpu and len(self.placements) > 1:
            strategy, k = placement_of(s.tensor_overrides)
            params["placements"] = strategy
            if strategy != "none":
                params["placement_layers"] = k
        return params


def _counts_from_split(n_layer: int, ngl: int, split: Sequence[float] | None, n_devices: int) -> list[int]:
    """Offloaded layers (output included) per device under llama.cpp's cumulative split rule,
    for all devices but the last (which takes the rest)."""
    from ..model.estimate import layer_devices

    names = [f"dev{i}" for i in range(n_devices)]
    placement = layer_devices(n_layer, ngl, names, split)
    return [placement.count(n) for n in names][:-1]


def _ctx_choices(min_ctx: int, n_ctx_train: int, max_choices: int = 3) -> tuple[int, ...]:
    out = [min_ctx]
    while len(out) < max_choices and out[-1] * 2 <= n_ctx_train:
        out.append(out[-1] * 2)
    return tuple(out)


def thread_choices(physical: int, logical: int) -> tuple[int, ...]:
    """Thread counts worth trying: half and all physical cores, and all logical ones."""
    return tuple(sorted({max(1, physical // 2), physical, logical}))


def build_space(
    models: Sequence[ModelInfo],
    *,
    devices: Sequence[Device] = (),
    physical_cores: int = 1,
    logical_cores: int = 1,
    min_ctx: int = 4096,
    n_prompt: int = 512,
    rpc_servers: Sequence[str] = (),
    unified_memory: bool = False,
) -> SearchSpace:
    """The search space for these variants of one model on this machine."""
    first = models[0]
    excluded: dict[str, str] = {}
    if min_ctx > first.n_ctx_train:
        excluded["n_ctx"] = f"--min-ctx {min_ctx} exceeds the training context {first.n_ctx_train}; using {min_ctx} anyway"
        ctx = (min_ctx,)
    else:
        ctx = _ctx_choices(min_ctx, first.n_ctx_train)
        if len(ctx) == 1:
            excluded["n_ctx"] = f"the training context ({first.n_ctx_train}) leaves no room above --min-ctx {min_ctx}"
    kv_types = tuple(t for t in ("f16", "q8_0", "q4_0") if all(t in m.kv_bytes_per_token for m in models))
    placements: tuple[str, ...] = ("none",)
    offload_kqv: tuple[bool, ...] = (True,)
    if devices:
        placements = ("none", "ffn_cpu", "attn_cpu") + (("experts_cpu",) if first.is_moe else ())
        offload_kqv = (True, False)
        if not first.is_moe:
            excluded["placement: experts_cpu"] = "a dense model has no expert tensors"
        if unified_memory:
            excluded["note"] = "unified memory: host and GPU share RAM, so offloading frees no memory, only moves compute"
    else:
        excluded["n_gpu_layers"] = "no GPU or RPC device: every layer runs on the CPU"
        excluded["tensor_split"] = "no GPU or RPC device"
        excluded["tensor placement"] = "no GPU or RPC device: no tensor can be kept off one"
        excluded["offload_kqv"] = "no GPU or RPC device"
    if len(devices) < 2 and devices:
        excluded["tensor_split"] = "one device: nothing to split"
    if n_prompt <= 512:
        n_batch: tuple[int, ...] = (max(512, n_prompt),)
        excluded["n_batch"] = f"the benchmark prompt ({n_prompt} tokens) fits in one batch of 512: n_batch cannot matter"
    else:
        n_batch = (512, 2048)
    return SearchSpace(
        variants=tuple(m.path for m in models),
        devices=tuple(devices),
        n_layer=first.n_layer,
        n_ctx=ctx,
        kv_types=kv_types,
        flash_attn=("on", "off"),
        threads=thread_choices(physical_cores, logical_cores),
        n_ubatch=(128, 256, 512),
        n_batch=n_batch,
        placements=placements,
        offload_kqv=offload_kqv,
        excluded=excluded,
        rpc_servers=tuple(rpc_servers),
    )


def rpc_devices_from(report: Sequence[Mapping[str, Any]]) -> list[Device]:
    """Devices from ``tuner.engine.rpc.query_devices``; a server that did not answer is an error."""
    from ..errors import RPCError

    out = []
    for entry in report:
        if "error" in entry:
            raise RPCError(f"RPC server {entry['endpoint']}: {entry['error']}; start it with `offload-tuner rpc-serve`")
        out.append(Device(name=f"RPC0[{entry['endpoint']}]", free=int(entry["memory_free"]), total=int(entry["memory_total"]),
                          rpc_endpoint=entry["endpoint"]))
    return out


