"""What to try: a conditional search space, built from this machine (probe), the model (inspect) and
the dimension table (``tuner.engine.dimensions``).

Each dimension of the table that has a ``Search`` is asked only when it can matter given the values
chosen before it (Optuna's define-by-run: a parameter absent from a trial is simply not asked):

- the KV cache type (``type_k``, V following K) only with flash attention on, since llama.cpp refuses a
  quantized V cache without it;
- the split (``layers_on[DEVICE]``, one count per device but the last, each bounded by what is left)
  only when two or more devices can get layers;
- a tensor placement strategy (``placement``) and its layer count (``placement_layers``) only when
  repeating layers are offloaded, counted from the first offloaded layer;
- ``offload_kqv`` only when repeating layers are offloaded;
- ``n_cpu_moe`` only for a mixture of experts with layers offloaded, counted the same way;
- ``swa_full`` only for a model with sliding-window layers;
- ``repack`` (llama.cpp's weight repacking) only where the CPU holds weights of a type it repacks.

So no proposal is invalid by construction. The study's parameters are named like the ``Settings``
fields (``n_ctx``, ``flash_attn``, ``type_k``, ``n_threads``, ``n_ubatch``, ``n_batch``, ``offload_kqv``,
``n_cpu_moe``, ``swa_full``), plus ``variant`` (the file), ``layers_on[DEVICE]``, ``placement`` and
``placement_layers``. Dimensions that cannot matter on this machine are left out, each with the reason,
so the output can say why (no GPU: no n_gpu_layers and no split; a dense model: no expert placement; a
short benchmark prompt: no n_batch).

To add a dimension to the search, give its table entry a ``Search`` and, if it is a choice, its
candidate values in ``build_space``'s ``domains``; this module reads the rest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator, Mapping, Sequence

from ..engine.dimensions import (
    DIMENSIONS,
    PLACEMENTS,
    Dimension,
    Facts,
    counts_from_split,
    placement_patterns,
    split_from_counts,
)
from ..engine.settings import Settings
from ..model.inspect import ModelInfo
from ..model.repack import CpuFeatures

# the dimensions the search walks, in the table's order (a dimension may read those before it)
SEARCHED: tuple[Dimension, ...] = tuple(d for d in DIMENSIONS if d.search is not None)
_BY_NAME = {d.name: d for d in SEARCHED}
# earlier names of the space's candidate values (Tuner(space_overrides=...))
_OLD_NAMES = {"kv_types": "type_k", "threads": "n_threads", "placements": "tensor_overrides", "variants": "model_path"}


@dataclass(frozen=True)
class Device:
    """An accelerator as llama.cpp names it, with the memory the tuner may plan with."""

    name: str  # CUDA0, ROCm0, Vulkan0, MTL0, SYCL0, RPC0[127.0.0.1:50052] ...
    free: int  # bytes
    total: int
    rpc_endpoint: str | None = None
    ggml_name: str = ""  # the name -dev takes where it differs from ``name`` (RPC0 for RPC0[host:port])


@dataclass(frozen=True)
class SearchSpace:
    """The candidates of one tune. ``domains`` holds each choice dimension's values by its name
    (``tensor_overrides``: the placement strategies); the rest comes from the dimension table."""

    variants: tuple[str, ...]  # model paths, same model in other quantizations
    devices: tuple[Device, ...]
    n_layer: int
    domains: Mapping[str, tuple] = field(default_factory=dict)
    is_moe: bool = False
    has_swa: bool = False
    supported: frozenset[str] | None = None  # the settings the engine can set; None: all
    excluded: dict[str, str] = field(default_factory=dict)  # dimension -> why it is left out
    rpc_servers: tuple[str, ...] = ()
    users: int = 1  # the workload's concurrent sequences: every candidate's n_parallel

    # -- the facts the table's predicates read ----------------------------------------------------

    @property
    def facts(self) -> Facts:
        domains = {**self.domains, "model_path": self.variants, "rpc_servers": self.rpc_servers,
                   "devices": self.device_names}
        return Facts(n_layer=self.n_layer, devices=tuple(d.name for d in self.devices), is_moe=self.is_moe,
                     has_swa=self.has_swa, users=self.users, domains=domains, supported=self.supported)

    @property
    def device_names(self) -> tuple[str, ...]:
        """The devices by the names ``-dev`` takes (``settings.devices``): ggml's, RPC servers' numbered
        across servers in their order (``RPC0``, ``RPC1``) where the device does not say its own."""
        names, rpc = [], 0
        for d in self.devices:
            if d.ggml_name:
                names.append(d.ggml_name)
            elif d.rpc_endpoint or "[" in d.name:
                names.append(f"RPC{rpc}")
            else:
                names.append(d.name)
            rpc += 1 if (d.rpc_endpoint or "[" in d.name) else 0
        return tuple(names)

    @property
    def has_gpu(self) -> bool:
        return bool(self.devices)

    # the candidate values under their names before the table
    n_ctx = property(lambda self: tuple(self.domains.get("n_ctx", ())))
    kv_types = property(lambda self: tuple(self.domains.get("type_k", ())))
    flash_attn = property(lambda self: tuple(self.domains.get("flash_attn", ())))
    threads = property(lambda self: tuple(self.domains.get("n_threads", ())))
    n_ubatch = property(lambda self: tuple(self.domains.get("n_ubatch", ())))
    n_batch = property(lambda self: tuple(self.domains.get("n_batch", ())))
    placements = property(lambda self: tuple(self.domains.get("tensor_overrides", ())))
    offload_kqv = property(lambda self: tuple(self.domains.get("offload_kqv", ())))

    def narrowed(self, **values: Sequence[Any]) -> "SearchSpace":
        """The same space with some dimensions' candidate values fixed or narrowed, by dimension name
        (``type_k=("f16",)``; the earlier names ``kv_types``, ``threads``, ``placements`` work too)."""
        from ..errors import SettingsError

        domains = dict(self.domains)
        variants = self.variants
        for name, choices in values.items():
            key = _OLD_NAMES.get(name, name)
            if key == "model_path":
                variants = tuple(choices)
            elif key in {d.name for d in SEARCHED}:
                domains[key] = tuple(choices)
            else:
                raise SettingsError("space_overrides", f"unknown dimension {name!r}; known: "
                                    + ", ".join(sorted({d.name for d in SEARCHED} | set(_OLD_NAMES))))
        return dataclasses.replace(self, domains=domains, variants=variants)

    # -- candidates --------------------------------------------------------------------------

    def suggest(self, trial: Any) -> Settings:
        """Ask an Optuna trial (or anything with suggest_int/suggest_categorical) for a candidate:
        each dimension in the table's order, only when it can matter given those before it."""
        return Settings(**self._walk(trial))

    def _walk(self, asker: Any) -> dict[str, Any]:
        facts = self.facts
        chosen: dict[str, Any] = {}
        for dim in SEARCHED:
            chosen[dim.name] = _value(dim, asker, facts, chosen)
        return chosen

    def params_for(self, s: Settings) -> dict[str, Any]:
        """The Optuna parameters that produce ``s`` (to enqueue a known candidate): the inverse of
        ``suggest``. Raises ValueError for settings this space cannot propose."""
        facts = self.facts
        chosen: dict[str, Any] = {}
        params: dict[str, Any] = {}
        for dim in SEARCHED:
            value = getattr(s, dim.name)
            search = dim.search
            assert search is not None
            if search.applies(facts, chosen):
                if search.params is not None:
                    params.update(search.params(value, facts, chosen))
                elif search.ask is None and len(facts.domain(dim.name)) > 1:
                    if value not in facts.domain(dim.name):
                        raise ValueError(f"{dim.name} {value!r} is not among this space's {list(facts.domain(dim.name))}")
                    params[dim.name] = value
            chosen[dim.name] = value
        return params

    def grid(self) -> Iterator[Settings]:
        """Every candidate of the space, each once (the conditional tree walked depth first)."""
        path: list[int] = []
        while True:
            replay = _Replay(path)
            yield self.suggest(replay)
            path = replay.next_path()
            if path is None:
                return

    def grid_size(self) -> int:
        """How many candidates ``grid`` yields, counted without listing them."""
        return self._census()[0]

    def dimensions(self) -> dict[str, Any]:
        """What the search asks, by Optuna parameter: an int range ``(low, high)`` over every branch,
        or a categorical's values. A parameter asked in some branches only is listed too."""
        return self._census()[1]

    def _census(self) -> tuple[int, dict[str, Any], dict[str, str]]:
        facts = self.facts
        # what decides the dimensions from position i on: the values their predicates read
        needs = [set().union(*(d.search.depends_on for d in SEARCHED[i:] if d.search)) for i in range(len(SEARCHED) + 1)]
        memo: dict[tuple, int] = {}
        asked: dict[str, Any] = {}
        owner: dict[str, str] = {}  # parameter -> the dimension that asks it

        def count(i: int, chosen: dict[str, Any]) -> int:
            if i == len(SEARCHED):
                return 1
            key = (i, tuple((n, _hashable(chosen.get(n))) for n in sorted(needs[i])))
            if key not in memo:
                total = 0
                for value, params in _options(SEARCHED[i], facts, chosen):
                    for name, spec in params.items():
                        _merge(asked, name, spec)
                        owner[name] = SEARCHED[i].name
                    total += count(i + 1, {**chosen, SEARCHED[i].name: value})
                memo[key] = total
            return memo[key]

        return count(0, {}), asked, owner

    def fingerprint(self) -> str:
        """Identity of the space, part of the study's name: what is searched, over which devices.
        Free memory is left out: it changes with what else runs, and a study must resume after
        another app took or gave back VRAM (the candidates decide fit with the memory of this run)."""
        data = dataclasses.asdict(self)
        data["devices"] = [{k: v for k, v in d.items() if k != "free"} for d in data["devices"]]
        data["domains"] = {k: list(v) for k, v in sorted(self.domains.items())}
        data["supported"] = sorted(self.supported) if self.supported is not None else None
        if self.users == 1:
            del data["users"]  # a one-user space keeps the name it had before users were counted
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]

    def describe(self) -> str:
        lines = ["search space:"]
        _, asked, owner = self._census()
        for name, value in asked.items():
            shown = f"{value[0]}..{value[1]}" if isinstance(value, tuple) else ", ".join(map(str, value))
            search = _BY_NAME[owner[name]].search
            when = f" (asked when {search.when})" if search is not None and search.when else ""
            lines.append(f"  {name}: {shown}{when}")
        for name, why in self.excluded.items():
            lines.append(f"  (left out) {name}: {why}")
        return "\n".join(lines)

    # -- building candidates by hand (seeds, tests, benchmarks) ----------------------------------------

    def split_from_counts(self, ngl: int, counts: Sequence[int]) -> tuple[float, ...] | None:
        """Layer counts per device -> llama.cpp's tensor split (the last device takes the rest).

        Raises ValueError when the counts exceed the offloaded layers."""
        return split_from_counts(ngl, counts)

    def settings(self, *, variant: str, n_gpu_layers: int = 0, tensor_split: tuple[float, ...] | None = None,
                 n_ctx: int, kv: str, flash_attn: str, threads: int | None, n_ubatch: int, n_batch: int,
                 placement: str = "none", placement_layers: int = 0, offload_kqv: bool = True, n_cpu_moe: int = 0,
                 swa_full: bool = False, kv_unified: bool = False) -> Settings:
        """A candidate of this space: the KV type for K and V, the threads for both thread counts, the
        placement over layers 0..placement_layers-1."""
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
            swa_full=swa_full,
            kv_unified=kv_unified and self.users > 1,
            n_parallel=self.users,
            tensor_overrides=placement_patterns(placement, placement_layers),
            n_cpu_moe=n_cpu_moe,
            rpc_servers=self.rpc_servers,
            devices=self.device_names,
        )


def _value(dim: Dimension, asker: Any, facts: Facts, chosen: Mapping[str, Any]) -> Any:
    """One dimension's value: asked when it applies (its own ask, or a categorical over its domain
    when there is a choice), else its fixed value."""
    search = dim.search
    assert search is not None
    if search.applies(facts, chosen):
        if search.ask is not None:
            return search.ask(asker, facts, chosen)
        domain = facts.domain(dim.name)
        if len(domain) > 1:
            return asker.suggest_categorical(dim.name, list(domain))
        if domain:
            return domain[0]
    if search.fixed is not None:
        return search.fixed(facts, chosen)
    domain = facts.domain(dim.name)
    return domain[0] if domain else dim.default


class _Replay:
    """An asker that answers from a path of choice indices (0 past its end) and records how many
    choices each question had, and what it asked: enough to walk a conditional tree."""

    def __init__(self, path: Sequence[int]) -> None:
        self.path = list(path)
        self.sizes: list[int] = []
        self.asked: dict[str, Any] = {}

    def next_path(self) -> list[int] | None:
        """The path of the next leaf after the one this replay walked (an odometer over the choices
        it met, the last question turning fastest), or None when this was the last."""
        sizes = self.sizes
        index = (self.path + [0] * len(sizes))[: len(sizes)]
        j = len(sizes) - 1
        while j >= 0 and index[j] + 1 >= sizes[j]:
            j -= 1
        return None if j < 0 else index[:j] + [index[j] + 1]

    def _pick(self, n: int) -> int:
        i = len(self.sizes)
        self.sizes.append(n)
        return self.path[i] if i < len(self.path) else 0

    def suggest_int(self, name: str, low: int, high: int) -> int:
        _merge(self.asked, name, (low, high))
        return low + self._pick(high - low + 1)

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any:
        _merge(self.asked, name, list(choices))
        return choices[self._pick(len(choices))]


def _options(dim: Dimension, facts: Facts, chosen: Mapping[str, Any]) -> list[tuple[Any, dict[str, Any]]]:
    """Every value one dimension can take after ``chosen``, with the parameters asked for it."""
    out = []
    path: list[int] = []
    while True:
        replay = _Replay(path)
        out.append((_value(dim, replay, facts, chosen), replay.asked))
        path = replay.next_path()
        if path is None:
            return out


def _merge(asked: dict[str, Any], name: str, spec: Any) -> None:
    """Record a parameter's range (widest over every branch) or categorical values."""
    if isinstance(spec, tuple):
        low, high = asked.get(name, spec)
        asked[name] = (min(low, spec[0]), max(high, spec[1]))
    else:
        asked.setdefault(name, list(spec))


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


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
    supported: Collection[str] | None = None,
    cpu: CpuFeatures | None = None,
    users: int = 1,
) -> SearchSpace:
    """The search space for these variants of one model on this machine.

    ``supported`` names the settings the engine can set (None: all, as the python engine); a
    dimension it cannot set is left out (without ``n_cpu_moe``, the ``experts_cpu`` placement, the
    same overrides spelled as regexes, stands in for it). ``cpu``: llama.cpp's CPU features, which
    decide whether weight repacking (``repack``) can matter: only for weights of a type this CPU
    repacks, and only without an accelerator whose pinned host buffer takes the CPU's weights first.

    ``users``: the workload's concurrent
    sequences; ``min_ctx`` is each one's context, so the context candidates are ``users`` times
    it (llama-server's -c is shared by its slots: n_ctx / n_parallel each), and the KV layout
    (``kv_unified``) is searched."""
    first = models[0]
    supported_set = frozenset(supported) if supported is not None else None
    can = lambda name: supported_set is None or name in supported_set  # noqa: E731
    excluded: dict[str, str] = {}
    if min_ctx > first.n_ctx_train:
        excluded["n_ctx"] = f"--min-ctx {min_ctx} exceeds the training context {first.n_ctx_train}; using {min_ctx} anyway"
        ctx = (min_ctx,)
    else:
        ctx = _ctx_choices(min_ctx, first.n_ctx_train)
        if len(ctx) == 1:
            excluded["n_ctx"] = f"the training context ({first.n_ctx_train}) leaves no room above --min-ctx {min_ctx}"
    if users > 1:
        ctx = tuple(c * users for c in ctx)  # each user's context, times the users
    kv_types = tuple(t for t in ("f16", "q8_0", "q4_0") if all(t in m.kv_bytes_per_token for m in models))
    domains: dict[str, tuple] = {
        "n_ctx": ctx,
        "flash_attn": ("on", "off"),
        "type_k": kv_types,
        "n_threads": thread_choices(physical_cores, logical_cores),
        "n_ubatch": (128, 256, 512),
    }
    if n_prompt <= 512:
        domains["n_batch"] = (max(512, n_prompt),)
        excluded["n_batch"] = f"the benchmark prompt ({n_prompt} tokens) fits in one batch of 512: n_batch cannot matter"
    else:
        domains["n_batch"] = (512, 2048)
    # every n_ubatch must fit in every n_batch (Settings refuses n_ubatch > n_batch)
    assert max(domains["n_ubatch"]) <= min(domains["n_batch"])
    has_swa = any(m.sliding_window and m.swa_layers for m in models)
    if devices:
        moe_placement = first.is_moe and not can("n_cpu_moe")
        domains["tensor_overrides"] = ("none", "ffn_cpu", "attn_cpu") + (("experts_cpu",) if moe_placement else ())
        domains["offload_kqv"] = (True, False)
        if not first.is_moe:
            excluded["placement: experts_cpu"] = "a dense model has no expert tensors"
            excluded["n_cpu_moe"] = "a dense model has no expert tensors"
        elif not moe_placement:
            excluded["placement: experts_cpu"] = "n_cpu_moe keeps the experts of the first N layers on the CPU instead"
        else:
            excluded["n_cpu_moe"] = "the engine cannot set it: the experts_cpu placement stands in"
        if unified_memory:
            excluded["note"] = "unified memory: host and GPU share RAM, so offloading frees no memory, only moves compute"
    else:
        excluded["n_gpu_layers"] = "no GPU or RPC device: every layer runs on the CPU"
        excluded["tensor_split"] = "no GPU or RPC device"
        excluded["tensor placement"] = "no GPU or RPC device: no tensor can be kept off one"
        excluded["offload_kqv"] = "no GPU or RPC device"
        if first.is_moe:
            excluded["n_cpu_moe"] = "no GPU or RPC device: every expert is on the CPU already"
    if len(devices) < 2 and devices:
        excluded["tensor_split"] = "one device: nothing to split"
    repack_why = _repack_why_not(models, devices, cpu)
    if repack_why is None and can("repack"):
        domains["repack"] = (True, False)
        # the variants with weights this CPU repacks (another quantization may have none)
        from ..model.repack import repackable

        domains["repack_variants"] = tuple(m.path for m in models if repackable(m.tensors, cpu))
    else:
        excluded["repack"] = repack_why or "the engine cannot set it"
    if has_swa and can("swa_full"):
        domains["swa_full"] = (False, True)
    elif has_swa:
        excluded["swa_full"] = "the engine cannot set it"
    if users > 1 and can("kv_unified"):
        domains["kv_unified"] = (False, True)
    elif users > 1:
        excluded["kv_unified"] = "the engine cannot set it"
    return SearchSpace(
        variants=tuple(m.path for m in models),
        devices=tuple(devices),
        n_layer=first.n_layer,
        domains=domains,
        is_moe=first.is_moe,
        has_swa=has_swa,
        supported=supported_set,
        excluded=excluded,
        rpc_servers=tuple(rpc_servers),
        users=users,
    )


def _repack_why_not(models: Sequence[ModelInfo], devices: Sequence[Device], cpu: CpuFeatures | None) -> str | None:
    """Why weight repacking cannot matter here, or None when it can."""
    from ..model.repack import repackable, takes_host_weights

    if cpu is None:
        return "llama.cpp did not report this CPU's features, so which weights it repacks is not known"
    if takes_host_weights(d.name for d in devices):
        return "the GPU's pinned host buffer takes the CPU's weights before any repack buffer"
    if not any(repackable(m.tensors, cpu) for m in models):
        types = ", ".join(cpu.repacked_types()) or "none"
        return f"no weight of this model is of a type this CPU repacks ({types})"
    return None


def devices_from(machine_devices: Sequence[Mapping[str, Any]]) -> list[Device]:
    """The accelerators among llama.cpp's devices (``Machine.devices``) that llama.cpp will use, in its
    order (``tuner.machine.devices.used_devices``: RPC servers first, an integrated GPU only when there
    is no other GPU, a card two backends list once), as the search space plans with them; not the CPU,
    and not the compute-only devices without memory of their own (BLAS)."""
    from ..machine.devices import used_devices

    out = []
    for d in used_devices(machine_devices):
        if d.is_accelerator:
            total = d.memory_total if d.memory_total is not None else (d.memory_free or 0)
            out.append(Device(name=d.name, free=d.memory_free if d.memory_free is not None else total, total=total,
                              rpc_endpoint=d.rpc_endpoint, ggml_name=d.ggml_name))
    return out


def rpc_devices_from(report: Sequence[Mapping[str, Any]]) -> list[Device]:
    """Devices from ``tuner.engine.rpc.query_devices``; a server that did not answer is an error."""
    from ..errors import RPCError

    out = []
    for entry in report:
        if "error" in entry:
            error = str(entry["error"])
            raise RPCError(error if error.startswith("RPC server") else
                           f"RPC server {entry['endpoint']}: {error}; start it with `offload-tuner rpc-serve`")
        out.append(Device(name=f"RPC0[{entry['endpoint']}]", free=int(entry["memory_free"]), total=int(entry["memory_total"]),
                          rpc_endpoint=entry["endpoint"], ggml_name=f"RPC{len(out)}"))
    return out


__all__ = ["Device", "SearchSpace", "build_space", "rpc_devices_from", "thread_choices", "SEARCHED", "PLACEMENTS",
           "counts_from_split"]
