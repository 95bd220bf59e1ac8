"""The best candidate of a search space on a simulated machine, by evaluating every candidate.

For the search-at-scale benchmark (``benchmarks/search_at_scale.py``): a search is measured against
the roofline engine's noiseless generation speed of every candidate the space can propose, and
whether it fits. A GPU-sized space holds 10^6-10^8 candidates and the memory arithmetic costs
milliseconds a call, so this module evaluates whole blocks at once: for each choice of the other
dimensions, every ``n_gpu_layers`` and every split of the offloaded layers together, as prefix sums
over the layers. The arithmetic it vectorizes is ``tuner.model.estimate.estimate``'s (placement,
weights with overrides, KV per layer, compute buffers with pipeline copies) and the speed is
``RooflineEngine.layer_times``'s; ``tests/test_search_scale.py`` checks both against the scalar
functions on sampled candidates, and ``optimum()`` checks its winner the same way, so a change to
either shows up as a failure, not as a wrong yardstick.

Generation speed (``tg``) is the objective: the context size, micro-batch and batch change only the
memory, so those candidates share a speed and each one's fit is checked.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.base import BenchSpec
from ..engine.roofline import RooflineEngine
from ..engine.settings import Settings
from ..errors import SettingsError
from ..model.estimate import CPU, compute_buffer, moved_stage_buffer, pad
from ..model.inspect import ModelInfo
from .space import SearchSpace, placement_patterns

_FLOAT_KV = ("f16", "f32", "bf16")
# the compute stage whose weights a placement strategy keeps on the host (estimate.compute_buffer's)
_STAGE = {"none": None, "ffn_cpu": "ffn", "experts_cpu": "ffn", "attn_cpu": "attention"}
_BOTH = frozenset({"attention", "ffn"})


def strategies(space: SearchSpace) -> tuple[str, ...]:
    """The space's placement strategies, and "experts_cpu" where the space searches n_cpu_moe
    instead: --n-cpu-moe k keeps the experts of layers 0..k-1 on the host, as that strategy does."""
    extra = ("experts_cpu",) if space.is_moe and "experts_cpu" not in space.placements and (
        space.supported is None or "n_cpu_moe" in space.supported) else ()
    return tuple(space.placements) + extra


@dataclass(frozen=True)
class Optimum:
    value: float  # noiseless generation t/s of the best candidate that fits
    settings: Settings
    grid_size: int  # valid candidates in the space
    feasible: int  # of those, how many fit


def _prefix(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(x)])


class _Block:
    """One variant on one machine: the layout of every (split, n_gpu_layers) as index arrays of shape
    (splits, n_layer + 2), and the per-layer prefix sums the memory arithmetic needs."""

    def __init__(self, space: SearchSpace, engine: RooflineEngine, info: ModelInfo) -> None:
        self.info, self.engine, self.space = info, engine, space
        self.devices = [d.name for d in space.devices]
        L = self.L = info.n_layer
        n_dev = len(self.devices)
        if n_dev <= 1:
            self.counts = np.zeros((1, 0), dtype=np.int64)
        else:
            self.counts = np.array(list(itertools.product(range(L + 2), repeat=n_dev - 1)), dtype=np.int64)
        g = np.arange(L + 2)[None, :]
        shape = (len(self.counts), L + 2)
        self.valid = np.broadcast_to(self.counts.sum(axis=1)[:, None] <= g, shape)  # counts within the layers offloaded
        # llama.cpp offloads from the last layer: layers start..n_layer, start = n_layer + 1 - ngl, the
        # first device taking the first of them
        self.start = np.broadcast_to((L + 1) - g, shape)
        self.spans = []
        acc = np.zeros((len(self.counts), 1), dtype=np.int64)
        for i in range(n_dev):
            lo = np.minimum(self.start + acc, L + 1)
            if i < n_dev - 1:
                acc = acc + self.counts[:, i:i + 1]
                hi = np.minimum(self.start + acc, L + 1)
            else:
                hi = np.full(shape, L + 1)
            self.spans.append((np.broadcast_to(lo, shape), np.broadcast_to(hi, shape)))
        self.shape = shape
        self.g = np.broadcast_to(g, shape)
        self.layers = [np.minimum(hi, L) - np.minimum(lo, L) for lo, hi in self.spans]
        self.output = [(lo <= L) & (L < hi) for lo, hi in self.spans]
        self.layers_cpu = np.minimum(self.start, L)
        holders = sum(((n > 0) | o).astype(np.int64) for n, o in zip(self.layers, self.output))
        self.multi = (holders > 1) & (self.g != 0) & (self.start == 0)  # several devices hold everything

        c = engine.compiled(info.path)
        self.host_only = float(c.n_bytes[c.layer < 0].sum())
        self.P_all = _prefix(c.per_layer(c.n_bytes, np.ones(len(c.names), dtype=bool)))
        self.P_match = {}
        for strategy in strategies(space):
            patterns = placement_patterns(strategy, L)
            per_layer = c.per_layer(c.n_bytes, c.mask(patterns)) if patterns else np.zeros(L + 1)
            self.P_match[strategy] = _prefix(per_layer)
        self._kv: dict[tuple[str, int, int], np.ndarray] = {}
        self._cb: dict[tuple[int, int, bool], dict[tuple[bool, bool, bool], int]] = {}

    @staticmethod
    def moved(P_match: np.ndarray, k: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """Prefix sums of the bytes an override of layers 0..k-1 moves to the host, at ``idx``, for
        each k (a leading axis: ``k`` has shape (K, 1, 1))."""
        return P_match[np.minimum(idx[None], k)]

    def P_kv(self, kv: str, n_ctx: int, n_ubatch: int) -> np.ndarray:
        key = (kv, n_ctx, n_ubatch)
        if key not in self._kv:
            info = self.info
            cells = pad(n_ctx if n_ctx > 0 else info.n_ctx_train, 256)
            swa_cells = cells if not info.sliding_window else pad(min(cells, info.sliding_window + n_ubatch), 256)
            per_cell = np.array([swa_cells if il in set(info.swa_layers) else cells for il in range(self.L)] + [0])
            self._kv[key] = _prefix(self.engine.compiled(info.path).kv_per_token(kv, kv) * per_cell)
        return self._kv[key]

    def cb(self, n_ctx: int, n_ubatch: int, fa: bool) -> dict[tuple[bool, bool, bool], int]:
        key = (n_ctx, n_ubatch, fa)
        if key not in self._cb:
            cells = pad(n_ctx if n_ctx > 0 else self.info.n_ctx_train, 256)
            self._cb[key] = {(o, l, h, st): compute_buffer(self.info, n_ctx=cells, n_ubatch=n_ubatch, flash_attn=fa, has_output=o,
                                                           has_layers=l, host=h, stages=st)
                             for o in (True, False) for l in (True, False) for h in (True, False)
                             for st in (_BOTH, frozenset({"attention"}), frozenset({"ffn"}))}
        return self._cb[key]

    def weights(self, strategy: str, ks: np.ndarray) -> dict[str, Any]:
        """Weight bytes on the host and on each accelerator for each (k, split, n_gpu_layers): what
        the memory arithmetic puts there with the strategy's override of layers 0..k-1. They do not
        depend on the context, cache or batch, so they are shared by all of those."""
        L, start = self.L, self.start
        k = ks.reshape(-1, 1, 1)
        P_match = self.P_match[strategy]
        moved_all = P_match[np.minimum(L + 1, k)]
        # the strategies' k starts at 1, so an override is present in every candidate but "none"'s
        out: dict[str, Any] = {"patterns": strategy != "none", "strategy": strategy, "k": k}
        out[CPU] = self.host_only + self.P_all[start][None] + (moved_all - self.moved(P_match, k, start))
        for name, (lo, hi) in zip(self.devices, self.spans):
            out[name] = (self.P_all[hi][None] - self.moved(P_match, k, hi)) - (self.P_all[lo][None] - self.moved(P_match, k, lo))
        return out

    def fits(self, weights: dict[str, Any], kqv: bool, kv: str, fa: bool, n_ctx: int, n_ubatch: int) -> np.ndarray:
        """Whether each (k, split, n_gpu_layers) fits every device, as ``RooflineEngine.out_of_memory``
        decides on ``estimate()``'s figures (``weights`` from ``weights()``)."""
        L, start = self.L, self.start
        P_kv = self.P_kv(kv, n_ctx, n_ubatch)
        cb = self.cb(n_ctx, n_ubatch, fa)
        cells = pad(n_ctx if n_ctx > 0 else self.info.n_ctx_train, 256)
        kv_cpu = P_kv[start] if kqv else P_kv[L + 1]
        # compute buffers (estimate(): a host that runs layers holds the logits; several devices
        # holding everything pipeline micro-batches with 4 copies of the inputs)
        pipeline = self.multi & kqv & (not weights["patterns"])
        copies = np.where(pipeline, 4, 1)
        mask = cells * n_ubatch * (2 if fa else 4)
        row = n_ubatch * self.info.n_embd * 4
        layers_cpu = self.layers_cpu
        k = weights["k"]
        moved = _STAGE[weights["strategy"]]
        # a host that runs no layer still runs the ops of the weights the strategy keeps on it, when
        # the override reaches an offloaded layer (estimate.moved_stage_buffer)
        host_ops = (moved_stage_buffer(self.info, n_ubatch=n_ubatch, stages={moved}) if moved else 0) * (k > start[None])
        c_cpu = np.where((layers_cpu > 0) | (self.g == 0),
                         np.where(layers_cpu > 0, cb[(True, True, True, _BOTH)], cb[(True, False, True, _BOTH)]),
                         copies * mask + np.where(pipeline, 5 if fa else 9, 2 if fa else 3) * row + host_ops)
        ok = np.ones(weights[CPU].shape, dtype=bool)
        gpu_total = 0.0
        extra = np.where(pipeline, (copies - 1) * mask + (4 if fa else 7) * row, 0)
        rest_stages = frozenset(_BOTH - {moved}) if moved else _BOTH
        for name, (lo, hi), n, out in zip(self.devices, self.spans, self.layers, self.output):
            kv_dev = (P_kv[hi] - P_kv[lo]) if kqv else 0.0
            runs = n > 0
            # the device keeps the moved stage where one of its layers is at or past k
            keeps = np.minimum(hi, L)[None] > k
            both = np.where(out, cb[(True, True, False, _BOTH)], cb[(False, True, False, _BOTH)])
            rest = np.where(out, cb[(True, True, False, rest_stages)], cb[(False, True, False, rest_stages)])
            c_dev = np.where(runs, np.where(keeps, both, rest), np.where(out, cb[(True, False, False, _BOTH)], 0))
            total = weights[name] + kv_dev + np.where(runs | out, c_dev + extra, 0)
            if self.engine.unified:
                gpu_total = gpu_total + total
            ok &= total <= self.engine.capacity[name]
        host = weights[CPU] + (kv_cpu + c_cpu) + gpu_total
        return ok & (host <= self.engine.capacity[CPU])

    def tg(self, times: dict[str, np.ndarray], times_over: dict[str, np.ndarray] | None, ks: np.ndarray) -> np.ndarray:
        """Noiseless generation t/s of each (k, split, n_gpu_layers), from the engine's per-layer times
        as prefix sums (``times_over``: with the placement strategy applied to every layer; layers
        below k take those)."""
        start, e = self.start, self.engine
        k = ks.reshape(-1, 1, 1)

        def P(device: str, idx: np.ndarray) -> np.ndarray:
            plain = times[device]
            if times_over is None:
                return np.broadcast_to(plain[idx], (len(ks), *idx.shape))
            over = times_over[device]
            cut = np.minimum(idx[None], k)
            return over[cut] + plain[idx][None] - plain[cut]

        total = P(CPU, start)
        acts = self.info.n_embd * 4.0
        previous = np.full(self.shape, -1)  # -1: the host (the embeddings, then its layers)
        names = [CPU, *self.devices]
        for i, (name, (lo, hi)) in enumerate(zip(self.devices, self.spans)):
            here = hi > lo
            hop = np.zeros(self.shape)
            for j, other in enumerate(names):
                if other != name:
                    hop = np.where(previous == j - 1, e.crossing(other, name, acts), hop)
            total = total + P(name, hi) - P(name, lo) + np.where(here, hop, 0.0)[None]
            previous = np.where(here, i, previous)
        return 1.0 / total


def optimum(space: SearchSpace, engine: RooflineEngine, bench: BenchSpec) -> Optimum:
    """The fastest candidate (generation t/s, no noise) of ``space`` that fits ``engine``'s machine."""
    if not space.has_gpu:
        return _host_only(space, engine, bench)
    if [d.name for d in space.devices] != engine.names:
        raise ValueError(f"the space's devices {[d.name for d in space.devices]} are not the engine's {engine.names}")
    best_value = -1.0
    best: dict[str, Any] | None = None
    size = feasible = 0
    threads = space.threads
    per_speed = len(space.n_batch)  # n_batch changes neither memory nor generation speed
    context = bench.depth + bench.n_gen / 2
    kv_fa = [(kv, fa) for kv in space.kv_types for fa in space.flash_attn if not (kv not in _FLOAT_KV and fa == "off")]
    ctx_ub = list(itertools.product(space.n_ctx, space.n_ubatch))
    for variant in space.variants:
        info = engine.models[variant]
        block = _Block(space, engine, info)
        L = info.n_layer
        weights = {strategy: block.weights(strategy, _ks(strategy, L)) for strategy in strategies(space)}
        for strategy, kqv, (kv, fa) in itertools.product(strategies(space), space.offload_kqv, kv_fa):
            base = dict(model_path=variant, n_ctx=space.n_ctx[0], flash_attn=fa, type_k=kv, type_v=kv, offload_kqv=kqv,
                        rpc_servers=space.rpc_servers)
            try:
                plain = {t: Settings(**base, n_threads=t, n_threads_batch=t) for t in threads}
            except SettingsError:
                continue
            times = {t: {d: _prefix(x) for d, x in engine.layer_times(s, engine.work(s, 1, context)).items()} for t, s in plain.items()}
            times_over: dict[int, Any] = {t: None for t in threads}
            if strategy != "none":
                for t, s in plain.items():
                    o = Settings(**{**base, **_placed(space, strategy, L)}, n_threads=t, n_threads_batch=t)
                    times_over[t] = {d: _prefix(x) for d, x in engine.layer_times(o, engine.work(o, 1, context)).items()}
            ks = _ks(strategy, L)
            first = np.full((len(ks), *block.shape), -1)
            fit_count = 0
            for i, (n_ctx, ub) in enumerate(ctx_ub):
                f = block.fits(weights[strategy], kqv, kv, fa == "on", n_ctx, ub) & block.valid[None]
                first = np.where((first < 0) & f, i, first)
                fit_count += int(f.sum())
            size += int(block.valid.sum()) * len(ks) * len(ctx_ub) * len(threads) * per_speed
            feasible += fit_count * len(threads) * per_speed
            if not (first >= 0).any():
                continue
            for t in threads:
                tg = np.where(first >= 0, block.tg(times[t], times_over[t], ks), -1.0)
                j, r, c = np.unravel_index(int(np.argmax(tg)), tg.shape)
                if tg[j, r, c] > best_value:
                    best_value = float(tg[j, r, c])
                    n_ctx, ub = ctx_ub[int(first[j, r, c])]
                    best = dict(variant=variant, ngl=int(c), counts=[int(x) for x in block.counts[r]], n_ctx=n_ctx, ub=ub,
                                kv=kv, fa=fa, threads=t, strategy=strategy, k=int(ks[j]), kqv=kqv)
    if best is None:
        raise ValueError("no candidate of the space fits this machine")
    s = _settings(space, best)
    # the yardstick checks itself against the scalar engine and estimate()
    scalar = engine.speed(s, bench)[1]
    if abs(scalar - best_value) > 1e-9 * best_value or engine.out_of_memory(engine.memory(s)) is not None:
        raise AssertionError(f"the vectorized optimum disagrees with the engine: {best_value} vs {scalar} for {s}")
    return Optimum(value=best_value, settings=s, grid_size=size, feasible=feasible)


def _ks(strategy: str, n_layer: int) -> np.ndarray:
    """The placement strategy's layer counts the space asks (none: 0)."""
    return np.array([0]) if strategy == "none" else np.arange(1, n_layer + 1)


def _host_only(space: SearchSpace, engine: RooflineEngine, bench: BenchSpec) -> Optimum:
    """Without an accelerator the space is small: every candidate through the scalar engine."""
    best: tuple[float, Settings] | None = None
    size = feasible = 0
    for variant, n_ctx, kv, fa, t, ub, batch in itertools.product(space.variants, space.n_ctx, space.kv_types, space.flash_attn,
                                                                  space.threads, space.n_ubatch, space.n_batch):
        try:
            s = space.settings(variant=variant, n_ctx=n_ctx, kv=kv, flash_attn=fa, threads=t, n_ubatch=ub, n_batch=max(batch, ub))
        except SettingsError:
            continue
        size += 1
        if engine.out_of_memory(engine.memory(s)) is not None:
            continue
        feasible += 1
        tg = engine.speed(s, bench)[1]
        if best is None or tg > best[0]:
            best = (tg, s)
    if best is None:
        raise ValueError("no candidate of the space fits this machine")
    return Optimum(value=best[0], settings=best[1], grid_size=size, feasible=feasible)


def _placed(space: SearchSpace, strategy: str, k: int) -> dict[str, Any]:
    """The settings of a strategy over layers 0..k-1: n_cpu_moe for the experts where the space
    searches it, else the strategy's overrides."""
    if strategy == "experts_cpu" and "experts_cpu" not in space.placements:
        return {"n_cpu_moe": k}
    return {"tensor_overrides": placement_patterns(strategy, k)}


def _settings(space: SearchSpace, c: dict[str, Any]) -> Settings:
    split = space.split_from_counts(c["ngl"], c["counts"]) if len(space.devices) > 1 else None
    placed = _placed(space, c["strategy"], c["k"]) if c["strategy"] != "none" else {}
    strategy = "none" if "n_cpu_moe" in placed else c["strategy"]
    return space.settings(variant=c["variant"], n_gpu_layers=c["ngl"], tensor_split=split, n_ctx=c["n_ctx"], kv=c["kv"],
                          flash_attn=c["fa"], threads=c["threads"], n_ubatch=c["ub"], n_batch=max(space.n_batch[0], c["ub"]),
                          placement=strategy, placement_layers=c["k"] if strategy != "none" else 0, offload_kqv=c["kqv"],
                          n_cpu_moe=placed.get("n_cpu_moe", 0))


def describe(s: Settings, value: float | None = None) -> str:
    """One line for a candidate, as the benchmark prints it."""
    overrides = f" -ot {s.tensor_overrides[0][:40]}..." if s.tensor_overrides else ""
    overrides += f" --n-cpu-moe {s.n_cpu_moe}" if s.n_cpu_moe else ""
    split = f" split {'/'.join(f'{x:g}' for x in s.tensor_split)}" if s.tensor_split else ""
    speed = f": {value:.2f} t/s" if value is not None else ""
    return (f"{Path(s.model_path).name} ngl {s.n_gpu_layers}{split} ctx {s.n_ctx} kv {s.type_k} fa {s.flash_attn} "
            f"threads {s.n_threads} ubatch {s.n_ubatch} kqv {'on' if s.offload_kqv else 'off'}{overrides}{speed}")
