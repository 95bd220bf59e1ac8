"""The tune loop: an Optuna search over real trials, resumable, writing the best per-machine profile.

    result = tune("model-Q4_K_M.gguf", variants=["model-Q8_0.gguf"], trials=20)
    result.profile_path, result.profile.measured

Optuna's ask/tell drives the search, so llama.cpp never runs inside an Optuna callback. Each
candidate is first checked with the memory arithmetic against each device's free memory less a
margin: one predicted not to fit is not launched (recorded as pruned, with the reason). Out of
memory is a constraint, never a score of 0 t/s: once a placement runs out of memory on a device,
candidates that need as much or more there are not launched either. The study lives in SQLite
under the data folder (any SQLAlchemy URL works), named from the machine, the model and the
search space, so running the same command again resumes it: completed trials are not repeated.
Ctrl-C kills the running trial and still writes the best profile so far.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..errors import ModelError, SettingsError, StudyError
from ..model.estimate import CPU, MemoryEstimate, estimate, max_gpu_layers
from ..machine.probe import Machine, probe
from ..model.inspect import ModelInfo, inspect
from ..engine.outcome import Outcome
from ..paths import studies_dir
from ..engine.base import BenchSpec, Stats, TrialResult
from ..engine.python import TrialRunner
from ..engine.settings import Settings
from .space import Device, SearchSpace, build_space, rpc_devices_from

MiB = 1 << 20
OBJECTIVES = ("tg", "pp", "mixed")
Event = dict[str, Any]

# llama.cpp names the device whose allocation failed in these lines (src/llama-model.cpp
# "alloc_tensor_range: failed to allocate %s buffer of size %zu", ggml-cuda "allocating %.2f MiB
# on device %d: cudaMalloc failed: out of memory", llama-kv-cache "failed to allocate buffer
# for kv cache" (no device)).
_OOM_DEVICE_RES = [
    re.compile(r"failed to allocate (\S+?) buffer"),
    re.compile(r"allocating [\d.]+ MiB on device (\d+): cudaMalloc failed"),
]


@dataclass
class TuneResult:
    profile: Any  # tuner.profile.Profile
    profile_path: Path | None
    best: dict[str, Any]
    runner_up: dict[str, Any] | None
    counts: dict[str, int]
    space: SearchSpace
    study_name: str
    storage: str
    interrupted: bool = False
    rejected: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile_path": str(self.profile_path) if self.profile_path else None,
            "profile": self.profile.to_dict() if self.profile is not None else None,
            "best": self.best,
            "runner_up": self.runner_up,
            "trials": self.counts,
            "study": {"name": self.study_name, "storage": self.storage},
            "interrupted": self.interrupted,
            "rejected_variants": self.rejected,
            "excluded_dimensions": self.space.excluded,
        }


def score(objective: str, pp: Stats | None, tg: Stats | None, bench: BenchSpec) -> float:
    """The number the search maximizes, in tokens/sec."""
    if objective == "tg":
        return tg.median if tg else 0.0
    if objective == "pp":
        return pp.median if pp else 0.0
    # mixed: throughput of one request of n_prompt prompt tokens and n_gen generated ones
    seconds = (bench.n_prompt / pp.median if pp and pp.median else 0.0) + (bench.n_gen / tg.median if tg and tg.median else 0.0)
    return (bench.n_prompt + bench.n_gen) / seconds if seconds else 0.0


def expand_variants(paths: Sequence[str | Path]) -> list[Path]:
    """Files as given; folders become the GGUF files inside them (sorted)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(x for x in p.glob("*.gguf") if not re.search(r"-0000[2-9]-of-|-000[1-9]\d-of-", x.name)))
        else:
            out.append(p)
    return out


def accelerator_devices(machine: Machine) -> list[Device]:
    """The devices llama.cpp will offload to, with the memory the tuner plans with."""
    devices: list[Device] = []
    if machine.llama.gpu_offload or not machine.llama.llama_cpp_python:
        for g in machine.gpus:
            devices.append(Device(name=f"CUDA{g.index}", free=g.memory_free, total=g.memory_total))
    if machine.rpc_devices:
        devices.extend(rpc_devices_from(machine.rpc_devices))
    return devices


def study_name_for(model: ModelInfo, machine: Machine, space: SearchSpace, objective: str, bench: BenchSpec, min_ctx: int) -> str:
    import hashlib

    key = json.dumps([model.header_hash, machine.fingerprint(), space.fingerprint(), objective, bench.to_dict(), min_ctx])
    return f"{Path(model.path).stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _settings_key(s: Settings) -> str:
    return json.dumps(s.to_dict(), sort_keys=True)


def _oom_device(result: TrialResult, est: MemoryEstimate, accelerators: Sequence[str]) -> str:
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


class Tuner:
    """One tuning run. ``tune()`` below is the function most callers want."""

    def __init__(
        self,
        model: str | Path,
        *,
        variants: Sequence[str | Path] = (),
        trials: int | None = None,
        time_budget: float | None = None,
        objective: str = "tg",
        min_ctx: int = 4096,
        depth: int = 0,
        n_prompt: int = 512,
        n_gen: int = 128,
        repetitions: int = 3,
        final_repetitions: int = 8,
        final_candidates: int = 3,
        final_rounds: int = 3,
        vram_margin: int = 512 * MiB,
        storage: str | None = None,
        study_name: str | None = None,
        out: str | Path | None = None,
        rpc_servers: Sequence[str] = (),
        machine: Machine | None = None,
        engine: Any = None,
        trial_timeout: float = 300.0,
        seed: int = 0,
        on_event: Callable[[Event], None] | None = None,
        space_overrides: dict[str, tuple] | None = None,
    ) -> None:
        if objective not in OBJECTIVES:
            raise SettingsError("objective", f"expected one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if trials is None and time_budget is None:
            trials = 20
        if trials is not None and trials < 1:
            raise SettingsError("trials", f"expected at least 1, got {trials}")
        self.objective = objective
        self.trials = trials
        self.time_budget = time_budget
        self.min_ctx = min_ctx
        self.bench = BenchSpec(n_prompt=n_prompt, n_gen=n_gen, depth=depth, repetitions=repetitions)
        if depth + max(n_prompt, n_gen) > min_ctx:
            raise SettingsError("min_ctx", f"--min-ctx {min_ctx} is smaller than --depth {depth} + {max(n_prompt, n_gen)} benchmark tokens")
        self.final_repetitions = max(final_repetitions, repetitions)
        self.final_candidates = max(1, final_candidates)
        self.final_rounds = max(1, final_rounds)
        self.margin = vram_margin
        self.out = Path(out) if out else None
        self.rpc_servers = tuple(rpc_servers)
        self.seed = seed
        self.emit = on_event or (lambda event: None)
        self.trial_timeout = trial_timeout

        main = inspect(model)
        self.models: dict[str, ModelInfo] = {main.path: main}
        self.rejected: dict[str, str] = {}
        for path in expand_variants(variants):
            if str(path) == main.path or path.resolve() == Path(main.path).resolve():
                continue
            try:
                info = inspect(path)
            except ModelError as exc:
                self.rejected[str(path)] = exc.problem
                continue
            why = main.same_model_as(info)
            if why:
                self.rejected[str(path)] = f"not the same model: {why}"
            else:
                self.models[info.path] = info
        for path, why in self.rejected.items():
            self.emit({"kind": "rejected", "path": path, "reason": why})

        self.machine = machine or probe(rpc_servers=self.rpc_servers)
        self.devices = accelerator_devices(self.machine)
        self.space = build_space(
            list(self.models.values()), devices=self.devices, physical_cores=self.machine.physical_cores,
            logical_cores=self.machine.logical_cores, min_ctx=min_ctx, n_prompt=n_prompt, rpc_servers=self.rpc_servers,
            unified_memory=self.machine.unified_memory,
        )
        if space_overrides:
            # fix or narrow dimensions (e.g. {"kv_types": ("f16",)}): a study of fewer questions
            import dataclasses

            unknown = set(space_overrides) - {f.name for f in dataclasses.fields(SearchSpace)}
            if unknown:
                raise SettingsError("space_overrides", f"unknown dimension(s): {', '.join(sorted(unknown))}")
            self.space = dataclasses.replace(self.space, **{k: tuple(v) for k, v in space_overrides.items()})
        self.free = {d.name: d.free for d in self.devices}
        self.free[CPU] = self.machine.ram_available
        self.storage = storage or f"sqlite:///{studies_dir() / 'studies.db'}"
        self.study_name = study_name or study_name_for(main, self.machine, self.space, objective, self.bench, min_ctx)
        self.engine = engine
        self.main = main

    # -- the pieces ------------------------------------------------------------------------

    def estimate_for(self, s: Settings) -> MemoryEstimate:
        return estimate(
            self.models[s.model_path], n_gpu_layers=s.n_gpu_layers, n_ctx=s.n_ctx, type_k=s.type_k, type_v=s.type_v,
            tensor_split=s.tensor_split, devices=[d.name for d in self.devices], n_ubatch=s.n_ubatch,
            flash_attn=s.flash_attn != "off", offload_kqv=s.offload_kqv, tensor_overrides=s.tensor_overrides,
        )

    def seeds(self) -> list[Settings]:
        """Sensible first trials: the most layers that fit, all on the CPU, llama.cpp's defaults."""
        sp = self.space
        threads = max(sp.threads[0], min(sp.threads, key=lambda t: abs(t - self.machine.physical_cores)))
        common = dict(n_ctx=sp.n_ctx[0], n_batch=sp.n_batch[-1], n_ubatch=512 if 512 in sp.n_ubatch else sp.n_ubatch[-1], threads=threads)
        out = []
        for variant in sp.variants:
            if sp.has_gpu:
                info = self.models[variant]
                free = {d.name: d.free for d in self.devices}
                best_ngl = max_gpu_layers(info, free, margin=self.margin, devices=[d.name for d in self.devices],
                                          n_ctx=common["n_ctx"], n_ubatch=common["n_ubatch"], flash_attn=True)
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
            unique.setdefault(_settings_key(s), s)
        return list(unique.values())

    def check(self, s: Settings, est: MemoryEstimate, learned: dict[str, int]) -> str | None:
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
        for device, threshold in learned.items():
            need = est.devices.get(device)
            if need is not None and need.total >= threshold:
                return (f"learned: a placement needing {threshold / MiB:.0f} MiB on {device} ran out of memory; "
                        f"this one needs {need.total / MiB:.0f} MiB there")
        return None

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> TuneResult:
        import optuna
        from optuna.trial import TrialState

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = optuna.samplers.TPESampler(seed=self.seed, n_startup_trials=4, multivariate=True)
        study = optuna.create_study(storage=self.storage, study_name=self.study_name, direction="maximize",
                                    load_if_exists=True, sampler=sampler)
        # What earlier runs of this study already know: done candidates and OOM thresholds.
        done: dict[str, Any] = {}
        learned: dict[str, int] = {}
        launched_before = 0
        for t in study.get_trials(deepcopy=False):
            key = t.user_attrs.get("settings_key")
            if key and t.state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED) and not t.user_attrs.get("interrupted"):
                done.setdefault(key, t)
            if t.user_attrs.get("oom_device"):
                device = t.user_attrs["oom_device"]
                learned[device] = min(learned.get(device, 1 << 62), int(t.user_attrs["oom_need"]))
            if t.user_attrs.get("launched") and not t.user_attrs.get("interrupted"):
                launched_before += 1
        resumed = bool(done)
        if not resumed:
            for s in self.seeds():
                study.enqueue_trial(self.space.params_for(s), user_attrs={"seed": True}, skip_if_exists=True)
        self.emit({"kind": "start", "study": self.study_name, "storage": _redact(self.storage), "resumed": resumed,
                   "done": len(done), "space": self.space.describe(), "grid": self.space.grid_size(),
                   "variants": list(self.models), "rejected": self.rejected, "trials": self.trials,
                   "time_budget": self.time_budget})

        engine = self.engine or TrialRunner(timeout_s=self.trial_timeout)
        with _CtrlC() as ctrl_c:
            return self._loop(study, engine, ctrl_c, done, learned, launched_before)

    def _loop(self, study: Any, engine: Any, ctrl_c: "_CtrlC", done: dict[str, Any], learned: dict[str, int],
              launched_before: int) -> TuneResult:
        from optuna.trial import TrialState

        started = time.monotonic()
        launched = 0
        asks = 0
        duplicates_in_a_row = 0
        interrupted = False
        max_asks = (self.trials or 1000) * 20 + 50
        try:
            while True:
                if ctrl_c.requested:
                    interrupted = True
                    self.emit({"kind": "interrupted", "number": None})
                    break
                # --trials counts launches over the whole study: a resumed study runs the rest.
                if self.trials is not None and launched_before + launched >= self.trials:
                    break
                if self.time_budget is not None and time.monotonic() - started >= self.time_budget:
                    break
                if asks >= max_asks or duplicates_in_a_row >= 40:
                    self.emit({"kind": "exhausted", "asks": asks})
                    break
                asks += 1
                trial = study.ask()
                try:
                    s = self.space.suggest(trial)
                except (ValueError, SettingsError) as exc:
                    trial.set_user_attr("reason", f"invalid candidate: {exc}")
                    study.tell(trial, state=TrialState.PRUNED)
                    self.emit({"kind": "invalid", "number": trial.number, "reason": str(exc)})
                    continue
                key = _settings_key(s)
                if key in done:
                    # Already measured (in this run or an earlier one): answer from the record.
                    duplicates_in_a_row += 1
                    prev = done[key]
                    trial.set_user_attr("duplicate_of", prev.number)
                    if prev.state == TrialState.COMPLETE:
                        study.tell(trial, prev.value)
                    else:
                        study.tell(trial, state=TrialState.PRUNED)
                    continue
                duplicates_in_a_row = 0
                trial.set_user_attr("settings_key", key)
                trial.set_user_attr("settings", s.to_dict())
                est = self.estimate_for(s)
                trial.set_user_attr("predicted", {d: m.to_dict() for d, m in est.devices.items()})
                reason = self.check(s, est, learned)
                if reason:
                    trial.set_user_attr("reason", reason)
                    study.tell(trial, state=TrialState.PRUNED)
                    done[key] = _Record(trial.number, TrialState.PRUNED, None)
                    self.emit({"kind": "pruned", "number": trial.number, "settings": s.to_dict(), "reason": reason})
                    continue
                self.emit({"kind": "launch", "number": trial.number, "n": launched_before + launched + 1,
                           "total": self.trials,
                           "settings": s.to_dict(), "elapsed": time.monotonic() - started})
                trial.set_user_attr("launched", True)
                try:
                    with ctrl_c.immediate():
                        result = engine.run(s, self.bench, trial_id=trial.number)
                except KeyboardInterrupt:
                    trial.set_user_attr("interrupted", True)
                    study.tell(trial, state=TrialState.FAIL)
                    interrupted = True
                    self.emit({"kind": "interrupted", "number": trial.number})
                    break
                launched += 1
                self._record(trial, result, est)
                if result.ok:
                    value = score(self.objective, result.pp, result.tg, self.bench)
                    study.tell(trial, value)
                    done[key] = _Record(trial.number, TrialState.COMPLETE, value)
                else:
                    if result.outcome is Outcome.OOM:
                        device = _oom_device(result, est, [d.name for d in self.devices])
                        need = est.devices[device].total if device in est.devices else 0
                        trial.set_user_attr("oom_device", device)
                        trial.set_user_attr("oom_need", need)
                        if need:
                            learned[device] = min(learned.get(device, 1 << 62), need)
                    study.tell(trial, state=TrialState.FAIL)
                    done[key] = _Record(trial.number, TrialState.FAIL, None)
                best_value = _best_value(study)
                self.emit({"kind": "result", "number": trial.number, "outcome": result.outcome.value,
                           "message": result.message, "value": score(self.objective, result.pp, result.tg, self.bench) if result.ok else None,
                           "best": best_value, "elapsed": time.monotonic() - started,
                           "time_left": self._time_left(started, launched, launched_before),
                           "layers": (result.load.layers_offloaded, result.load.layers_total)})
        except KeyboardInterrupt:
            interrupted = True
            self.emit({"kind": "interrupted", "number": None})
        try:
            return self._finish(study, engine, interrupted or ctrl_c.requested, ctrl_c)
        finally:
            if self.engine is None:
                engine.close()

    def _fit_together(self, candidates: Sequence[Settings]) -> bool:
        """Whether these candidates fit in memory all at once (a paired measurement loads them
        together): each distinct model's weights once, every context's KV and compute."""
        need: dict[str, int] = {}
        seen_models: set[tuple] = set()
        for s in candidates:
            est = self.estimate_for(s)
            first = s.model_key not in seen_models
            seen_models.add(s.model_key)
            for device, mem in est.devices.items():
                need[device] = need.get(device, 0) + (mem.weights if first else 0) + mem.kv + mem.compute
        for device, total in need.items():
            free = self.free.get(device)
            if free is not None and total > free - (self.margin if device != CPU else 0):
                return False
        return True

    def _time_left(self, started: float, launched: int, launched_before: int) -> float | None:
        """Seconds left: of the time budget, or estimated from the trials so far."""
        elapsed = time.monotonic() - started
        if self.time_budget is not None:
            return max(0.0, self.time_budget - elapsed)
        if self.trials is not None and launched:
            return elapsed / launched * max(0, self.trials - launched_before - launched)
        return None

    def _record(self, trial: Any, result: TrialResult, est: MemoryEstimate) -> None:
        trial.set_user_attr("outcome", result.outcome.value)
        trial.set_user_attr("message", result.message[:2000])
        if result.pp:
            trial.set_user_attr("pp", result.pp.to_dict())
        if result.tg:
            trial.set_user_attr("tg", result.tg.to_dict())
        trial.set_user_attr("layers", [result.load.layers_offloaded, result.load.layers_total])
        trial.set_user_attr("actual", _actual_memory(result))
        trial.set_user_attr("peak_rss", result.peak_rss)

    # -- the winner ---------------------------------------------------------------------------

    def _finish(self, study: Any, engine: Any, interrupted: bool, ctrl_c: "_CtrlC") -> TuneResult:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
        counts = {
            "run": sum(1 for t in trials if t.user_attrs.get("launched") and not t.user_attrs.get("interrupted")),
            "pruned": sum(1 for t in trials if t.state == TrialState.PRUNED and "duplicate_of" not in t.user_attrs),
            "oom": sum(1 for t in trials if t.user_attrs.get("outcome") == "oom"),
            "failed": sum(1 for t in trials if t.user_attrs.get("launched") and not t.user_attrs.get("interrupted")
                          and t.user_attrs.get("outcome") not in ("ok", "oom")),
        }
        if not complete:
            failures = [f"#{t.number}: {t.user_attrs.get('outcome', 'pruned')} - {t.user_attrs.get('message') or t.user_attrs.get('reason', '')}"
                        for t in trials if "duplicate_of" not in t.user_attrs][:8]
            raise StudyError("no candidate ran successfully, so there is no profile to write.\n  " + "\n  ".join(failures)
                             + "\nRead the reasons above: try a smaller --min-ctx, a smaller quantization (--variant), or free memory.")
        ranked = sorted(complete, key=lambda t: t.value, reverse=True)
        stats_key = "pp" if self.objective == "pp" else "tg"

        def entry(t: Any, result: TrialResult | None = None) -> dict[str, Any]:
            e = {"number": t.number, "settings": Settings.from_dict(t.user_attrs["settings"]),
                 "pp": t.user_attrs.get("pp"), "tg": t.user_attrs.get("tg"), "value": t.value, "remeasured": False,
                 "actual": t.user_attrs.get("actual", {}), "predicted": t.user_attrs.get("predicted", {}),
                 "layers": t.user_attrs.get("layers", [None, None])}
            if result is not None and result.ok:
                e.update(pp=result.pp.to_dict() if result.pp else None, tg=result.tg.to_dict() if result.tg else None,
                         value=score(self.objective, result.pp, result.tg, final), remeasured=True)
            return e

        rounds = max(1, min(self.final_rounds, self.final_repetitions))
        per_round = max(1, math.ceil(self.final_repetitions / rounds))
        final = BenchSpec(n_prompt=self.bench.n_prompt, n_gen=self.bench.n_gen, depth=self.bench.depth,
                          repetitions=per_round)
        # A first measurement of a few repetitions is noisy, and the top of a noisy ranking is
        # biased upwards. The leading candidates are measured again with more repetitions, in
        # alternating rounds (on a shared machine speed drifts over seconds: interleaving gives
        # each candidate the same conditions), and the winner is chosen on those figures.
        contenders = [entry(t) for t in ranked[: self.final_candidates]]
        samples: dict[int, dict[str, list[float]]] = {c["number"]: {"pp": [], "tg": []} for c in contenders}
        last: dict[int, TrialResult] = {}
        paired = hasattr(engine, "run_paired") and len(contenders) > 1 and self._fit_together([c["settings"] for c in contenders])
        if not interrupted:
            self.emit({"kind": "remeasure", "candidates": [c["number"] for c in contenders], "rounds": rounds,
                       "repetitions": rounds * per_round, "paired": paired})
            try:
                if paired:
                    # all loaded in one worker, measured within the same seconds, round after round
                    with ctrl_c.immediate():
                        results = engine.run_paired([c["settings"] for c in contenders], final, rounds=rounds)
                    if not all(r.ok for r in results):
                        self.emit({"kind": "paired_failed", "message": results[0].message})
                        paired = False
                    else:
                        for c, r in zip(contenders, results):
                            last[c["number"]] = r
                            samples[c["number"]] = {"pp": list(r.pp.samples) if r.pp else [], "tg": list(r.tg.samples) if r.tg else []}
                if not paired:
                    for _ in range(rounds):
                        for c in contenders:
                            with ctrl_c.immediate():
                                again = engine.run(c["settings"], final, trial_id=f"final-{c['number']}")
                            if again.ok:
                                last[c["number"]] = again
                                samples[c["number"]]["pp"] += list(again.pp.samples) if again.pp else []
                                samples[c["number"]]["tg"] += list(again.tg.samples) if again.tg else []
            except KeyboardInterrupt:
                interrupted = True
        for i, c in enumerate(contenders):
            got = samples[c["number"]]
            if c["number"] in last and (got["tg"] or got["pp"]):
                merged = dataclasses.replace(last[c["number"]], pp=Stats.of(got["pp"]), tg=Stats.of(got["tg"]))
                contenders[i] = entry(ranked[i], merged)
        measured = [c for c in contenders if c["remeasured"]] or contenders
        measured.sort(key=lambda c: c["value"], reverse=True)
        best = measured[0]
        runner_up = None
        if len(measured) > 1:
            second = measured[1]
            win, sec = best.get(stats_key) or {}, second.get(stats_key) or {}
            # within noise: the runner-up's interval reaches the winner's
            if win and sec and sec.get("ci_high", 0) >= win.get("ci_low", math.inf):
                runner_up = {"settings": second["settings"].to_dict(), "pp": second["pp"], "tg": second["tg"]}
        profile = self._profile(best, runner_up, counts)
        path = profile.write(self.out) if profile is not None else None
        best_out = {k: (v.to_dict() if isinstance(v, Settings) else v) for k, v in best.items()}
        self.emit({"kind": "done", "profile_path": str(path) if path else None, "best": best_out, "counts": counts,
                   "interrupted": interrupted})
        return TuneResult(profile=profile, profile_path=path, best=best_out, runner_up=runner_up, counts=counts,
                          space=self.space, study_name=self.study_name, storage=self.storage, interrupted=interrupted,
                          rejected=self.rejected)

    def _profile(self, best: dict[str, Any], runner_up: dict[str, Any] | None, counts: dict[str, int]) -> Any:
        from ..profile.document import tool_version, utc_now

        s: Settings = best["settings"]
        info = self.models[s.model_path]
        kv_layer = info.kv_bytes_per_token_layer(info.kv_layers[0] if info.kv_layers else 0, s.type_k, s.type_v)
        data = {
            "schema_version": "1.0",
            "tool_version": tool_version(),
            "created_at": utc_now(),
            "model": info.fingerprint(),
            "settings": s.to_dict(),
            "min_ctx": self.min_ctx,
            "objective": self.objective,
            "measured": {"pp": best["pp"], "tg": best["tg"], "n_prompt": self.bench.n_prompt, "n_gen": self.bench.n_gen,
                         "depth": self.bench.depth},
            "memory": {"predicted": best["predicted"], "actual": best["actual"]},
            "sizing": {"n_layer": info.n_layer, "layer_weight_bytes": info.bytes_per_layer,
                       "output_weight_bytes": info.nonrepeating_bytes.get("output", 0) + info.nonrepeating_bytes.get("output_norm", 0),
                       "kv_bytes_per_token_per_layer": kv_layer},
            "layers_offloaded": best["layers"][0],
            "layers_total": best["layers"][1] if best["layers"][1] is not None else info.n_layer + 1,
            "runner_up": runner_up,
            "trials": counts,
            "study": {"name": self.study_name, "storage": _redact(self.storage)},
        }
        return _build_profile(data, self.machine)


class _CtrlC:
    """Ctrl-C during a tune: immediate while llama.cpp runs (the runner kills the worker at once),
    deferred everywhere else, so it never lands in the middle of a write to the study's database.
    Only the main thread can own SIGINT; elsewhere this does nothing."""

    def __init__(self) -> None:
        self.requested = False
        self._immediate = False
        self._previous: Any = None

    def __enter__(self) -> "_CtrlC":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        if self._immediate:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def immediate(self) -> Iterator[None]:
        if self.requested:
            raise KeyboardInterrupt
        self._immediate = True
        try:
            yield
        finally:
            self._immediate = False


@dataclass(frozen=True)
class _Record:
    number: int
    state: Any
    value: float | None


def _best_value(study: Any) -> float | None:
    try:
        return study.best_value
    except ValueError:
        return None


def _actual_memory(result: TrialResult) -> dict[str, dict[str, int]]:
    """Per device, what llama.cpp allocated (weights by device, host labels folded into CPU)."""
    out: dict[str, dict[str, int]] = {}
    for label, size in result.load.model_buffers.items():
        device = CPU if label.startswith("CPU") or label in ("AMX", "CUDA_Host") else label
        out.setdefault(device, {"weights": 0, "kv": 0, "compute": 0})["weights"] += size
    for kind, buffers in (("kv", result.load.kv_buffers), ("compute", result.load.compute_buffers)):
        for label, size in buffers.items():
            device = CPU if label.startswith("CPU") or label == "CUDA_Host" else label
            out.setdefault(device, {"weights": 0, "kv": 0, "compute": 0})[kind] += size
    return out


def _redact(url: str) -> str:
    """A storage URL without its password."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def _build_profile(data: dict[str, Any], machine: Machine) -> Any:
    from ..profile.document import LlamaBuildInfo, MachineInfo, Profile

    m = MachineInfo.from_machine(machine)
    b = LlamaBuildInfo.from_build(machine.llama)
    data["machine"] = _asdict(m)
    data["llama_build"] = _asdict(b)
    return Profile.from_dict(data)


def _asdict(obj: Any) -> Any:
    import dataclasses

    if dataclasses.is_dataclass(obj):
        return {f.name: _asdict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_asdict(x) for x in obj]
    return obj


def tune(model: str | Path, **kwargs: Any) -> TuneResult:
    """Tune ``model`` on this machine and write the best profile. See ``Tuner`` for the options."""
    return Tuner(model, **kwargs).run()
