"""The best candidate of a search space on a simulated machine, by evaluating every candidate.

For the search-at-scale benchmark (``benchmarks/search_at_scale.py``): a search is measured against
the roofline engine's noiseless generation speed of every candidate the space can propose, and
whether it fits. A GPU-sized space holds 10^6-10^8 candidates and the memory arithmetic costs
milliseconds a call, so this module evaluates whole blocks at once: for each choice of the other
dimensions, every ``n_gpu_layers``, every split of the offloaded layers, every placement layer
count and every ``n_cpu_moe`` together, as prefix sums over the layers.

The candidates are exactly the conditional space's (``SearchSpace.grid()``, counted by
``grid_size()``): a placement strategy's layers and ``n_cpu_moe`` count from the first offloaded
layer and are asked only when repeating layers are offloaded, as ``offload_kqv`` is; the split only
when two or more layers are offloaded; a quantized KV cache only with flash attention. The
arithmetic it vectorizes is ``tuner.model.estimate.estimate``'s (placement, weights with overrides,
KV per layer, compute buffers per the stages each backend holds, pipeline copies) and the speed is
``RooflineEngine.layer_times``'s. ``tests/test_search_scale.py`` checks both against the scalar
functions on the space's own proposals and the count against ``grid_size()``; ``optimum()`` checks
its winner the same way, so a change to either shows up as a failure, not as a wrong yardstick.

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
from ..engine.dimensions import n_cpu_moe_patterns
from ..engine.roofline import RooflineEngine
from ..engine.settings import Settings
from ..errors import SettingsError
from ..model.estimate import CPU, cache_cells, compute_buffer, moved_stage_buffer
from ..model.inspect import ModelInfo, tensor_role
from .space import SearchSpace, placement_patterns

_FLOAT_KV = ("f16", "f32", "bf16")
_STAGE_SETS = tuple(frozenset(s) for s in ((), ("attention",), ("ffn",), ("attention", "ffn")))


@dataclass(frozen=True)
class Optimum:
    value: float  # noiseless generation t/s of the best candidate that fits
    settings: Settings
    grid_size: int  # candidates in the space
    feasible: int  # of those, how many fit


def _states(strategy: str, n_layer: int, moe: bool) -> dict[str, dict[str, Any]]:
    """The settings each layer state adds, for per-layer times: as placed ("none"), the strategy's
    tensors on the host ("placed"), the experts there ("experts"), both ("both")."""
    states: dict[str, dict[str, Any]] = {"none": {}}
    if strategy != "none":
        states["placed"] = {"tensor_overrides": placement_patterns(strategy, n_layer)}
    if moe:
        states["experts"] = {"n_cpu_moe": n_layer}
        if strategy != "none":
            states["both"] = {**states["placed"], **states["experts"]}
    return states


def _prefix(x: np.ndarray) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(x)])


def _stage(name: str) -> str | None:
    """The compute stage a repeating layer's weight feeds, as ``tuner.model.estimate`` decides it:
    attention or ffn (an MoE's expert matrices included; a router, a shared expert or a norm none)."""
    role = tensor_role(name)
    if role == "experts":
        return "ffn" if "_exps" in name or "_chexps" in name else None
    return role if role in ("attention", "ffn") else None


def searches_n_cpu_moe(space: SearchSpace) -> bool:
    return space.is_moe and space.has_gpu and (space.supported is None or "n_cpu_moe" in space.supported)


class _Block:
    """One variant on one machine. Arrays have the axes (k, k2, split, n_gpu_layers): the placement's
    layer count (0 for none), n_cpu_moe's (counted from the first offloaded layer), the layer counts
    of every device but the last, and n_gpu_layers 0..n_layer+1."""

    def __init__(self, space: SearchSpace, engine: RooflineEngine, info: ModelInfo) -> None:
        if info.tied_output or info.sliding_window:
            raise ValueError(f"{info.path}: the exhaustive yardstick does not model tied output heads or sliding windows")
        self.info, self.engine, self.space = info, engine, space
        self.devices = [d.name for d in space.devices]
        L = self.L = info.n_layer
        n_dev = len(self.devices)
        self.counts = (np.array(list(itertools.product(range(L + 2), repeat=n_dev - 1)), dtype=np.int64)
                       if n_dev > 1 else np.zeros((1, 0), dtype=np.int64))
        shape = (1, 1, len(self.counts), L + 2)
        g = np.arange(L + 2).reshape(1, 1, 1, -1)
        cum = np.cumsum(self.counts, axis=1) if n_dev > 1 else np.zeros((len(self.counts), 0), dtype=np.int64)
        used = cum[:, -1].reshape(1, 1, -1, 1) if n_dev > 1 else np.zeros((1, 1, 1, 1), dtype=np.int64)
        if n_dev > 1:
            # the split is asked from two offloaded layers on (each count bounded by what is left);
            # below, llama.cpp's even default puts a lone output layer on the first device
            first_only = (cum[:, -1] == self.counts[:, 0]).reshape(1, 1, -1, 1)
            self.valid = np.where(g >= 2, used <= g, first_only & (self.counts[:, 0].reshape(1, 1, -1, 1) == np.minimum(g, 1)))
        else:
            self.valid = np.ones(shape, dtype=bool)
        self.valid = np.broadcast_to(self.valid, shape)
        self.g = np.broadcast_to(g, shape)
        self.start = np.broadcast_to((L + 1) - g, shape)  # the first offloaded layer: offload starts from the last
        self.R = np.maximum(self.g - 1, 0)  # repeating layers offloaded
        self.spans = []
        acc = np.zeros((1, 1, len(self.counts), 1), dtype=np.int64)
        for i in range(n_dev):
            lo = np.minimum(self.start + acc, L + 1)
            if i < n_dev - 1:
                acc = acc + self.counts[:, i].reshape(1, 1, -1, 1)
                hi = np.minimum(self.start + acc, L + 1)
            else:
                hi = np.full(shape, L + 1)
            self.spans.append((np.broadcast_to(lo, shape), np.broadcast_to(hi, shape)))
        self.layers = [np.minimum(hi, L) - np.minimum(lo, L) for lo, hi in self.spans]
        self.output = [(lo <= L) & (L < hi) for lo, hi in self.spans]
        self.layers_cpu = np.minimum(self.start, L)
        holders = sum(((n > 0) | o).astype(np.int64) for n, o in zip(self.layers, self.output))
        self.multi = (holders > 1) & (self.g != 0) & (self.start == 0)  # several devices hold everything

        # per layer (0..n_layer, the output head last): bytes, and what each override moves
        c = engine.compiled(info.path)
        self.host_only = float(c.n_bytes[c.layer < 0].sum())
        self.P_all = _prefix(c.per_layer(c.n_bytes, np.ones(len(c.names), dtype=bool)))
        stages = np.array([_stage(n) if layer >= 0 and layer < L else None for n, layer in zip(c.names, c.layer)], dtype=object)
        ffn, attn = stages == "ffn", stages == "attention"
        self.moe = searches_n_cpu_moe(space)
        none = np.zeros(len(c.names), dtype=bool)
        mX = c.mask(n_cpu_moe_patterns(L)) if self.moe else none
        by_layer = lambda mask: c.per_layer(np.ones(len(c.names)), mask) > 0  # noqa: E731  (any tensor of the layer)
        all_of = lambda stage, mask: by_layer(stage) & ~by_layer(stage & ~mask)  # noqa: E731  (the stage's tensors all moved)
        count = lambda b: _prefix(b.astype(np.float64))  # noqa: E731
        self.N_ffn, self.N_attn = count(by_layer(ffn)), count(by_layer(attn))
        self.P_X = _prefix(c.per_layer(c.n_bytes, mX))
        self.N_Xall, self.N_Xany = count(all_of(ffn, mX)), count(by_layer(ffn & mX))
        self.per_strategy: dict[str, dict[str, np.ndarray]] = {}
        for strategy in space.placements:
            patterns = placement_patterns(strategy, L)
            m = c.mask(patterns) if patterns else none
            self.per_strategy[strategy] = dict(
                P=_prefix(c.per_layer(c.n_bytes, m)), P_both=_prefix(c.per_layer(c.n_bytes, m & mX)),
                ffn_all=count(all_of(ffn, m)), ffn_all_either=count(all_of(ffn, m | mX)), ffn_any=count(by_layer(ffn & m)),
                attn_all=count(all_of(attn, m)), attn_any=count(by_layer(attn & m)))
        self._kv: dict[tuple[str, int, int], tuple[np.ndarray, int]] = {}
        self._cb: dict[tuple[int, int, bool], dict[Any, int]] = {}

    # -- windows: a placement or n_cpu_moe covers offloaded layers start..start+w-1 -------------------

    def win(self, P: np.ndarray, w: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Sum over the layers of [lo, hi) inside the window [start, start + w) (prefix sums ``P``)."""
        top = self.start + w
        return P[np.clip(hi, self.start, top)] - P[np.clip(lo, self.start, top)]

    def axes(self, strategy: str) -> tuple[np.ndarray, np.ndarray]:
        """The placement's layer counts (k) and n_cpu_moe's (k2) the space asks, as broadcastable axes."""
        ks = np.array([0]) if strategy == "none" else np.arange(1, self.L + 1)
        k2s = np.arange(0, self.L + 1) if self.moe else np.array([0])
        return ks.reshape(-1, 1, 1, 1), k2s.reshape(1, -1, 1, 1)

    def valid_for(self, strategy: str, kqv: bool) -> np.ndarray:
        k, k2 = self.axes(strategy)
        ok = self.valid & (k <= self.R) & (k2 <= self.R)
        if not kqv:
            ok = ok & (self.R >= 1)  # offload_kqv is asked only with repeating layers offloaded
        return ok

    # -- memory: estimate()'s arithmetic over a whole block -------------------------------------------

    def weights(self, strategy: str) -> dict[str, Any]:
        """Weight bytes on the host and each accelerator, which layer stages each accelerator still
        holds weights of, and which stages the host runs for moved weights; the same for every
        context, cache and batch."""
        L, start = self.L, self.start
        k, k2 = self.axes(strategy)
        m = np.minimum(k, k2)
        st = self.per_strategy[strategy]

        def moved(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:  # bytes the overrides move off [lo, hi)
            return self.win(st["P"], k, lo, hi) + self.win(self.P_X, k2, lo, hi) - self.win(st["P_both"], m, lo, hi)

        def ffn_moved(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:  # layers of [lo, hi) whose FFN weights all moved
            return (self.win(st["ffn_all_either"], m, lo, hi)
                    + np.where(k > k2, self.win(st["ffn_all"], k, lo, hi) - self.win(st["ffn_all"], m, lo, hi), 0)
                    + np.where(k2 > k, self.win(self.N_Xall, k2, lo, hi) - self.win(self.N_Xall, m, lo, hi), 0))

        end = np.full(start.shape, L + 1)
        out: dict[str, Any] = {"overrides": (k > 0) | (k2 > 0)}
        out[CPU] = self.host_only + self.P_all[start] + moved(start, end)
        out["host_ffn"] = (self.win(st["ffn_any"], k, start, end) + self.win(self.N_Xany, k2, start, end)) > 0
        out["host_attn"] = self.win(st["attn_any"], k, start, end) > 0
        for name, (lo, hi) in zip(self.devices, self.spans):
            out[name] = self.P_all[hi] - self.P_all[lo] - moved(lo, hi)
            out[name, "ffn"] = (self.N_ffn[hi] - self.N_ffn[lo]) - ffn_moved(lo, hi) > 0
            out[name, "attn"] = (self.N_attn[hi] - self.N_attn[lo]) - self.win(st["attn_all"], k, lo, hi) > 0
        return out

    def P_kv(self, kv: str, n_ctx: int, n_ubatch: int) -> tuple[np.ndarray, int]:
        key = (kv, n_ctx, n_ubatch)
        if key not in self._kv:
            cells, _ = cache_cells(n_ctx if n_ctx > 0 else self.info.n_ctx_train, n_ubatch, None, False)
            self._kv[key] = (_prefix(self.engine.compiled(self.info.path).kv_per_token(kv, kv) * cells), cells)
        return self._kv[key]

    def cb(self, cells: int, n_ubatch: int, fa: bool) -> dict[Any, int]:
        key = (cells, n_ubatch, fa)
        if key not in self._cb:
            info = self.info
            table: dict[Any, int] = {}
            for o, l, st in itertools.product((True, False), (True, False), _STAGE_SETS):
                table[o, l, st] = compute_buffer(info, n_ctx=cells, n_ubatch=n_ubatch, flash_attn=fa, has_output=o, has_layers=l,
                                                 host=False, masks=[cells], stages=st)
            for l in (True, False):
                table["host", l] = compute_buffer(info, n_ctx=cells, n_ubatch=n_ubatch, flash_attn=fa, has_output=True,
                                                  has_layers=l, masks=[cells])
            for st in _STAGE_SETS:
                table["moved", st] = moved_stage_buffer(info, n_ubatch=n_ubatch, stages=st)
            self._cb[key] = table
        return self._cb[key]

    def fits(self, w: dict[str, Any], kqv: bool, kv: str, fa: bool, n_ctx: int, n_ubatch: int) -> np.ndarray:
        """Whether each candidate of the block fits every device, as ``RooflineEngine.out_of_memory``
        decides on ``estimate()``'s figures (``w`` from ``weights()``)."""
        L, start = self.L, self.start
        P_kv, cells = self.P_kv(kv, n_ctx, n_ubatch)
        cb = self.cb(cells, n_ubatch, fa)
        kv_cpu = P_kv[start] if kqv else P_kv[L + 1]
        # compute buffers (estimate(): a host that runs layers holds the logits; one that runs none
        # keeps the graph's inputs and the ops of the weights overrides moved onto it; several devices
        # holding everything pipeline micro-batches with 4 copies of the inputs)
        pipeline = self.multi & kqv & ~w["overrides"]
        copies = np.where(pipeline, 4, 1)
        mask = cells * n_ubatch * (2 if fa else 4)
        row = n_ubatch * self.info.n_embd * 4
        moved_ops = np.select([w["host_ffn"] & w["host_attn"], w["host_ffn"], w["host_attn"]],
                              [cb["moved", _STAGE_SETS[3]], cb["moved", _STAGE_SETS[2]], cb["moved", _STAGE_SETS[1]]],
                              cb["moved", _STAGE_SETS[0]])
        c_cpu = np.where((self.layers_cpu > 0) | (self.g == 0),
                         np.where(self.layers_cpu > 0, cb["host", True], cb["host", False]),
                         copies * mask + np.where(pipeline, 5 if fa else 9, 2 if fa else 3) * row + moved_ops)
        ok = np.ones(w[CPU].shape, dtype=bool)
        gpu_total = 0.0
        extra = np.where(pipeline, (copies - 1) * mask + (4 if fa else 7) * row, 0)
        for name, (lo, hi), n, out in zip(self.devices, self.spans, self.layers, self.output):
            kv_dev = (P_kv[hi] - P_kv[lo]) if kqv else 0.0
            runs = n > 0
            holds = w[name, "attn"].astype(np.int64) + 2 * w[name, "ffn"].astype(np.int64)  # index into _STAGE_SETS
            c_dev = np.zeros(holds.shape)
            for i, st in enumerate(_STAGE_SETS):
                here = holds == i
                c_dev = np.where(here & runs & out, cb[True, True, st], c_dev)
                c_dev = np.where(here & runs & ~out, cb[False, True, st], c_dev)
            c_dev = np.where(~runs & out, cb[True, False, _STAGE_SETS[0]], c_dev)
            total = w[name] + kv_dev + np.where(runs | out, c_dev + extra, 0)
            if self.engine.unified:
                gpu_total = gpu_total + total
            ok &= total <= self.engine.capacity[name]
        host = w[CPU] + kv_cpu + c_cpu + gpu_total
        return ok & (host <= self.engine.capacity[CPU])

    # -- speed: the engine's layer times over a whole block -------------------------------------------

    def tg(self, times: dict[str, dict[str, np.ndarray]], strategy: str) -> np.ndarray:
        """Noiseless generation t/s of each candidate of the block, from the engine's per-layer times as
        prefix sums in four states: ``none``, ``placed`` (the strategy on every layer), ``experts``
        (n_cpu_moe on every layer) and ``both``."""
        e = self.engine
        k, k2 = self.axes(strategy)
        m = np.minimum(k, k2)

        def span(device: str, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
            base = times["none"][device]
            total = base[hi] - base[lo]
            for state, w, under in (("both", m, None), ("placed", k, m), ("experts", k2, m)):
                if state not in times:
                    continue
                d = times[state][device] - base
                part = self.win(d, w, lo, hi) - (self.win(d, under, lo, hi) if under is not None else 0)
                total = total + (part if under is None else np.where(w > under, part, 0))
            return total

        total = times["none"][CPU][self.start]
        acts = self.info.n_embd * 4.0
        previous = np.full(self.start.shape, -1)  # -1: the host (the embeddings, then its layers)
        names = [CPU, *self.devices]
        for i, (name, (lo, hi)) in enumerate(zip(self.devices, self.spans)):
            here = hi > lo
            hop = np.zeros(self.start.shape)
            for j, other in enumerate(names):
                if other != name:
                    hop = np.where(previous == j - 1, e.crossing(other, name, acts), hop)
            total = total + span(name, lo, hi) + np.where(here, hop, 0.0)
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
    kv_fa = [(kv, "on") for kv in space.kv_types] + ([("f16", "off")] if "off" in space.flash_attn else [])
    kv_fa = [(kv, fa) for kv, fa in kv_fa if fa in space.flash_attn]
    ctx_ub = list(itertools.product(space.n_ctx, space.n_ubatch))
    for variant in space.variants:
        info = engine.models[variant]
        block = _Block(space, engine, info)
        L = info.n_layer
        weights = {strategy: block.weights(strategy) for strategy in space.placements}
        for strategy, kqv, (kv, fa) in itertools.product(space.placements, space.offload_kqv, kv_fa):
            base = dict(model_path=variant, flash_attn=fa, type_k=kv, type_v=kv, offload_kqv=kqv, rpc_servers=space.rpc_servers,
                        devices=space.device_names)
            states = _states(strategy, L, block.moe)
            times = {}
            for t in threads:
                times[t] = {}
                for state, extra in states.items():
                    s = Settings(**base, **extra, n_threads=t, n_threads_batch=t)
                    times[t][state] = {d: _prefix(x) for d, x in engine.layer_times(s, engine.work(s, 1, context)).items()}
            valid = block.valid_for(strategy, kqv)
            first = np.full(valid.shape, -1)
            fit_count = 0
            for i, (n_ctx, ub) in enumerate(ctx_ub):
                f = block.fits(weights[strategy], kqv, kv, fa == "on", n_ctx, ub) & valid
                first = np.where((first < 0) & f, i, first)
                fit_count += int(f.sum())
            size += int(valid.sum()) * len(ctx_ub) * len(threads) * per_speed
            feasible += fit_count * len(threads) * per_speed
            if not (first >= 0).any():
                continue
            ks, k2s = block.axes(strategy)
            for t in threads:
                tg = np.where(first >= 0, block.tg(times[t], strategy), -1.0)
                j, j2, r, c = np.unravel_index(int(np.argmax(tg)), tg.shape)
                if tg[j, j2, r, c] > best_value:
                    best_value = float(tg[j, j2, r, c])
                    n_ctx, ub = ctx_ub[int(first[j, j2, r, c])]
                    best = dict(variant=variant, ngl=int(c), counts=[int(x) for x in block.counts[r]], n_ctx=n_ctx, ub=ub,
                                kv=kv, fa=fa, threads=t, strategy=strategy, k=int(ks.reshape(-1)[j]),
                                k2=int(k2s.reshape(-1)[j2]), kqv=kqv)
    if best is None:
        raise ValueError("no candidate of the space fits this machine")
    s = _settings(space, best)
    # the yardstick checks itself: a candidate the space proposes, the scalar engine's speed, estimate()'s fit
    from optuna.trial import FixedTrial

    scalar = engine.speed(s, bench)[1]
    if (space.suggest(FixedTrial(space.params_for(s))) != s or abs(scalar - best_value) > 1e-9 * best_value
            or engine.out_of_memory(engine.memory(s)) is not None):
        raise AssertionError(f"the vectorized optimum disagrees with the space or the engine: {best_value} vs {scalar} for {s}")
    return Optimum(value=best_value, settings=s, grid_size=size, feasible=feasible)


def _host_only(space: SearchSpace, engine: RooflineEngine, bench: BenchSpec) -> Optimum:
    """Without an accelerator the space is small: every candidate through the scalar engine."""
    best: tuple[float, Settings] | None = None
    size = feasible = 0
    for s in space.grid():
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


def settings_of(space: SearchSpace, c: dict[str, Any]) -> Settings:
    """The candidate of ``space`` at a block's coordinates: the placement's k and n_cpu_moe's k2
    count from the first offloaded layer; the split is stated from two offloaded layers on."""
    L = space.n_layer
    start = L + 1 - c["ngl"]
    split = space.split_from_counts(c["ngl"], c["counts"]) if len(space.devices) > 1 and c["ngl"] >= 2 else None
    s = space.settings(variant=c["variant"], n_gpu_layers=c["ngl"], tensor_split=split, n_ctx=c["n_ctx"], kv=c["kv"],
                       flash_attn=c["fa"], threads=c["threads"], n_ubatch=c["ub"], n_batch=max(space.n_batch[0], c["ub"]),
                       offload_kqv=c["kqv"], n_cpu_moe=start + c["k2"] if c["k2"] else 0)
    if c["strategy"] != "none":
        import dataclasses

        s = dataclasses.replace(s, tensor_overrides=placement_patterns(c["strategy"], c["k"], start))
    return s


_settings = settings_of


def describe(s: Settings, value: float | None = None) -> str:
    """One line for a candidate, as the benchmark prints it."""
    overrides = f" -ot {s.tensor_overrides[0][:40]}..." if s.tensor_overrides else ""
    overrides += f" --n-cpu-moe {s.n_cpu_moe}" if s.n_cpu_moe else ""
    split = f" split {'/'.join(f'{x:g}' for x in s.tensor_split)}" if s.tensor_split else ""
    speed = f": {value:.2f} t/s" if value is not None else ""
    return (f"{Path(s.model_path).name} ngl {s.n_gpu_layers}{split} ctx {s.n_ctx} kv {s.type_k} fa {s.flash_attn} "
            f"threads {s.n_threads} ubatch {s.n_ubatch} kqv {'on' if s.offload_kqv else 'off'}{overrides}{speed}")
