"""The tune loop: an Optuna search over real trials, resumable, writing the best per-machine profile.

    result = tune("model-Q4_K_M.gguf", variants=["model-Q8_0.gguf"], trials=20)
    result.profile_path, result.profile.measured

Optuna's ask/tell drives the search, so llama.cpp never runs inside an Optuna callback. This module is
the loop only; its collaborators do the rest:

- ``variants``: which files are the same model (the rest are rejected, with the reason);
- ``space``: what to try, built from the machine and the model;
- ``candidates``: whether a candidate is worth a launch (the memory arithmetic against free memory,
  and what out-of-memory failures taught), and the seeds that open a study (llama.cpp's own fitter's
  answer among them, where the engine has one);
- ``crashes``: a crash is a clue: the same candidate run with optional features off (weight repacking
  first) until one runs; those features are launched off from then on, like an out-of-memory limit;
- ``remeasure``: the leading candidates measured again side by side, and the winner picked;
- ``quality`` and ``budget``: each variant's quality measured first (cached), the variants over a
  quality budget left out, a speed target's winner picked by quality, and the trade printed;
- ``tuner.profile.document.Profile.from_tuning``: the profile written at the end;
- ``storage``: the study store (SQLite by default, PostgreSQL for a team), with heartbeats, and the
  trials a dead tuner left running recovered;
- ``tuner.machine.lock``: one tuner measures on a machine at a time (a second one waits, or refuses).

The study is named from the machine, the model and the search space, so running the same command
again resumes it: completed trials are not repeated, and a trial left running by a tuner that died
is failed and measured again. Ctrl-C kills the running trial and still writes the best profile so far.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..engine.base import BenchSpec, Stats, StopRule, TrialResult
from ..engine.outcome import Outcome
from ..engine.python import TrialRunner
from .. import limits
from ..engine.settings import Settings
from ..errors import SettingsError, StudyError, TunerError
from ..machine.lock import MachineLock
from ..machine.probe import Machine, probe
from ..model.estimate import MemoryEstimate
from ..model.inspect import ModelInfo
from ..paths import ensure_writable, studies_dir
from ..profile.dburl import redact_url
from ..profile.document import Profile, output_folder
from .candidates import DEFAULT_MARGIN, Candidates, accelerator_devices, settings_key
from .crashes import Crashes
from .interrupt import CtrlC
from .objective import OBJECTIVES, score, workload_figures
from .budget import QualityBudget, median, rank_for_target, trade
from .quality import DEFAULT_CHUNKS, DEFAULT_CTX, QualityMeter, QualityReport, choose_reference
from .remeasure import Contender, Remeasure, pick_winner
from .space import SearchSpace, build_space
from .thrift import group_by_model, stop_rule, within_noise
from .timing import TimeLedger
from .storage import StudyStore
from .variants import expand_variants, vet_variants

MiB = 1 << 20
Event = dict[str, Any]

__all__ = ["OBJECTIVES", "TuneResult", "Tuner", "expand_variants", "make_sampler", "score", "study_name_for", "tune"]


@dataclass
class TuneResult:
    profile: Profile | None
    profile_path: Path | None
    best: dict[str, Any]
    runner_up: dict[str, Any] | None
    counts: dict[str, int]
    space: SearchSpace
    study_name: str
    storage: str
    interrupted: bool = False
    rejected: dict[str, str] = field(default_factory=dict)
    profile_error: str | None = None  # why the profile was not written (the study keeps the result)
    quality: QualityReport | None = None
    excluded: dict[str, str] = field(default_factory=dict)  # variants over the quality budget, and why
    trade: list[dict[str, Any]] = field(default_factory=list)
    target: dict[str, Any] | None = None  # {min_tg, min_pp, met, best_tg, best_pp} in target mode
    flags_check: dict[str, Any] | None = None  # the profile's llama-server flags through the engine's own parser
    time: dict[str, float] = field(default_factory=dict)  # where the wall time went (timing.TimeLedger.to_dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile_path": str(self.profile_path) if self.profile_path else None,
            "profile_error": self.profile_error,
            "profile": self.profile.to_dict() if self.profile is not None else None,
            "best": self.best,
            "runner_up": self.runner_up,
            "trials": self.counts,
            "study": {"name": self.study_name, "storage": redact_url(self.storage)},
            "interrupted": self.interrupted,
            "rejected_variants": self.rejected,
            "excluded_dimensions": self.space.excluded,
            "quality": self.quality.to_dict() if self.quality is not None else None,
            "over_budget": self.excluded,
            "trade": self.trade,
            "target": self.target,
            "flags_check": self.flags_check,
            "time": self.time,
        }


def make_sampler(seed: int) -> Any:
    """The study's sampler: multivariate TPE with group=True, since the space is conditional (a
    parameter is asked only where it can matter) and TPE then models each group of parameters
    asked together (Optuna marks group experimental)."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=4, multivariate=True, group=True)


def study_name_for(model: ModelInfo, machine: Machine, space: SearchSpace, objective: str, bench: BenchSpec, min_ctx: int) -> str:
    key = json.dumps([model.header_hash, machine.fingerprint(), space.fingerprint(), objective, bench.to_dict(), min_ctx])
    # (a file name that is not UTF-8 holds surrogate escapes, which no database takes: U+FFFD instead)
    stem = os.fsencode(Path(model.path).stem).decode("utf-8", errors="replace")
    return f"{stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _release_on_failure(init: Callable[..., None]) -> Callable[..., None]:
    """A Tuner whose construction fails lets go of the machine at once (not when collected)."""

    @functools.wraps(init)
    def wrapper(self: "Tuner", *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            lock = getattr(self, "lock", None)
            if lock is not None:
                lock.release()
            raise

    return wrapper


@dataclass(frozen=True)
class _Record:
    number: int
    state: Any
    value: float | None


class Tuner:
    """One tuning run. ``tune()`` below is the function most callers want."""

    @_release_on_failure
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
        users: int = 1,
        min_user_tg: float | None = None,
        final_repetitions: int = 8,
        final_candidates: int = 3,
        final_rounds: int = 3,
        vram_margin: int | None = None,
        storage: Any = None,
        study_name: str | None = None,
        out: str | Path | None = None,
        rpc_servers: Sequence[str] = (),
        machine: Machine | None = None,
        engine: Any = None,
        trial_timeout: float = 300.0,
        seed: int = 0,
        on_event: Callable[[Event], None] | None = None,
        space_overrides: dict[str, tuple] | None = None,
        infos: Mapping[str, ModelInfo] | None = None,
        max_kl: float | None = None,
        max_ppl_increase: float | None = None,
        min_tg: float | None = None,
        min_pp: float | None = None,
        reference: str | Path | None = None,
        corpus: str | Path | None = None,
        chunks: int = DEFAULT_CHUNKS,
        quality_ctx: int = DEFAULT_CTX,
        quantize: Sequence[str] | str = (),
        imatrix: str | Path | None = None,
        allow_requantize: bool = False,
        measure_quality: bool = True,
        wait: bool = True,
    ) -> None:
        if objective not in OBJECTIVES:
            raise SettingsError("objective", f"expected one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if trials is None and time_budget is None:
            trials = 20
        if trials is not None and trials < 1:
            raise SettingsError("trials", f"expected at least 1, got {trials}")
        _check_numbers(time_budget=time_budget, vram_margin=vram_margin, trial_timeout=trial_timeout, min_ctx=min_ctx,
                       depth=depth, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions, users=users,
                       min_user_tg=min_user_tg)
        if min_user_tg is not None and objective != "aggregate":
            raise SettingsError("min_user_tg", f"a per-user floor applies to the aggregate objective, not {objective!r}")
        self.objective = objective
        self.trials = trials
        self.time_budget = time_budget
        self.min_ctx = min_ctx
        self.bench = BenchSpec(n_prompt=n_prompt, n_gen=n_gen, depth=depth, repetitions=repetitions, users=users,
                               min_user_tg=min_user_tg)
        # one user: pp and tg are measured apart (llama-bench); several: each sequence keeps its
        # prompt and its generated tokens (llama-batched-bench), all within its share of the context
        tokens = max(n_prompt, n_gen) if users == 1 else n_prompt + n_gen
        if depth + tokens > min_ctx:
            raise SettingsError("min_ctx", f"--min-ctx {min_ctx} is smaller than --depth {depth} + {tokens} benchmark tokens"
                                + (" per user" if users > 1 else ""))
        self.final_repetitions = max(final_repetitions, repetitions)
        self.final_candidates = max(1, final_candidates)
        self.final_rounds = max(1, final_rounds)
        self.out = Path(out) if out else None
        self.rpc_servers = tuple(rpc_servers)
        self.seed = seed
        self.emit = on_event or (lambda event: None)
        self.time = TimeLedger()  # where the wall time goes, from here
        self.trial_timeout = trial_timeout

        # Where the results go must take them, before any trial runs: a read-only profile or data
        # folder is found now, not after an hour of trials.
        ensure_writable(output_folder(self.out))
        if storage is None:
            ensure_writable(studies_dir())
        # a SQLAlchemy URL (or an Optuna storage object): one that cannot work is said now
        self.store = StudyStore(storage)
        self.store.check()
        self.storage = self.store.url
        # One tuner measures on a machine at a time, from here: quantizing, measuring quality and
        # the probe's free memory would all be disturbed by another tuner's trials.
        self.lock = MachineLock.for_machine(machine, what=f"tune {Path(model).name}")
        self.lock.acquire(wait=wait, on_wait=lambda message: self.emit({"kind": "waiting", "message": message}))

        self.budget = QualityBudget(max_kl=max_kl, max_ppl_increase=max_ppl_increase, min_tg=min_tg, min_pp=min_pp)
        if quantize:
            from ..model.quantize import make_variants

            made = make_variants(model, quantize, imatrix=imatrix, allow_requantize=allow_requantize, on_event=self.emit)
            variants = tuple(variants) + tuple(str(p) for p in made)
        vetted = vet_variants(model, variants, known=infos)
        self.main, self.models, self.rejected = vetted.main, vetted.models, vetted.rejected
        for path, why in self.rejected.items():
            self.emit({"kind": "rejected", "path": path, "reason": why})

        binaries = getattr(engine, "binaries", None)
        if users > 1 and binaries is not None and binaries.get("llama-batched-bench") is None:
            # said before anything runs, not as the same refusal on every trial
            raise StudyError(f"--users {users}: the llama-cpp engine measures several users with llama-batched-bench, and "
                             f"{binaries.folder} has none: build it (cmake --build build --target llama-batched-bench) "
                             "or use --engine python")
        self.machine = machine or probe(rpc_servers=self.rpc_servers, engine=engine)
        self.engine = engine
        self._watch_loads(engine)
        self.quality: QualityReport | None = None
        self.excluded: dict[str, str] = {}
        wanted = self.budget.has_limit or (measure_quality and (len(self.models) > 1 or reference is not None))
        if wanted:
            with self.time.part("quality"):
                self.quality = self._measure_quality(reference, corpus, chunks, quality_ctx)
        if self.quality is not None and self.budget.has_limit:
            for path in list(self.models):
                v = self.quality.by_path(path)
                why = self.budget.over(v) if v is not None else None
                if why:
                    self.excluded[path] = why
                    del self.models[path]
                    self.emit({"kind": "quality_excluded", "path": path, "reason": why})
            if not self.models:
                raise StudyError("every variant is over the quality budget, so there is nothing to tune:\n  "
                                 + "\n  ".join(f"{Path(p).name}: {why}" for p, why in self.excluded.items())
                                 + "\nRaise --max-kl / --max-ppl-increase, or add a higher-precision --variant.")
        self.devices = accelerator_devices(self.machine)
        self.space = build_space(
            list(self.models.values()), devices=self.devices, physical_cores=self.machine.physical_cores,
            logical_cores=self.machine.logical_cores, min_ctx=min_ctx, n_prompt=n_prompt, rpc_servers=self.rpc_servers,
            unified_memory=self.machine.unified_memory,
            supported=engine.supported_settings() if hasattr(engine, "supported_settings") else None,
            cpu=self.machine.cpu_features(),
            users=users,
        )
        if space_overrides:
            # fix or narrow dimensions (e.g. {"type_k": ("f16",)}): a study of fewer questions
            self.space = self.space.narrowed(**space_overrides)
        # No --vram-margin: start at DEFAULT_MARGIN and follow what the trials measure (Candidates)
        self.calibrated = vram_margin is None
        self.margin = DEFAULT_MARGIN if vram_margin is None else vram_margin
        peak_names = {f"CUDA{d['nvml_index']}": d["name"] for d in self.machine.devices
                      if isinstance(d, dict) and d.get("nvml_index") is not None and d.get("name")}
        self.candidates = Candidates(self.models, self.devices, self.machine.ram_available, self.margin,
                                     calibrate=self.calibrated, peak_names=peak_names, cpu=self.machine.cpu_features(),
                                     shared_ram=[d["name"] for d in self.machine.used_accelerators() if d.get("unified_memory")])
        self.crashes = Crashes(cpu=self.machine.cpu_features())
        self.study_name = study_name or study_name_for(self.main, self.machine, self.space, objective, self.bench, min_ctx)

    def _measure_quality(self, reference: str | Path | None, corpus: str | Path | None, chunks: int,
                         n_ctx: int) -> QualityReport | None:
        """Each variant's quality against the reference (cached in the data folder), before any
        speed trial. None when the engine cannot score text and no budget needs it."""
        from ..errors import ModelError, QualityError
        from ..model.inspect import inspect

        scorer = self.engine
        if self.engine is not None and not hasattr(self.engine, "score_corpus") and getattr(self.engine, "name", None) == "llama-cpp":
            # llama-bench prints speeds, never logits: the text is scored by llama-cpp-python's llama.cpp
            # (the python engine's worker), the same method on the same files. What a quantization costs
            # is in the file, not in which build reads it.
            scorer = None
            self.emit({"kind": "quality_engine", "message": "quality is measured with llama-cpp-python's llama.cpp "
                                                            "(llama-bench gives no logits); speed with the llama-cpp engine"})
        elif self.engine is not None and not hasattr(self.engine, "score_corpus"):
            if self.budget.has_limit:
                raise QualityError(f"a quality budget needs an engine that scores text; {type(self.engine).__name__} does not")
            self.emit({"kind": "quality_skipped", "reason": f"the engine ({type(self.engine).__name__}) cannot score text"})
            return None
        infos = list(self.models.values())
        ref = inspect(reference) if reference is not None else choose_reference(infos)
        why = self.main.same_model_as(ref)
        if why:
            raise ModelError(ref.path, f"not the same model as {Path(self.main.path).name}: {why}")
        # On the accelerators when there are real ones (a model that does not fit is scored on the
        # CPU); simulated RPC devices would only be slower than the CPU behind them.
        local = [d for d in self.machine.used_accelerators() if not d.get("rpc_endpoint")]
        gpus = bool(local or (self.machine.gpus and not self.machine.devices)) and self.machine.llama.gpu_offload
        with QualityMeter(ref, corpus=corpus, n_ctx=n_ctx, chunks=chunks, engine=scorer, on_event=self.emit,
                          settings={"n_gpu_layers": -1 if gpus else 0}, timeout_s=self.trial_timeout) as meter:
            return meter.measure(infos)

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> TuneResult:
        try:
            # a write to the study's database failing mid-tune (a full disk, a server gone) is one
            # error: what was committed before is there, and the same command resumes from it
            with self.store.guard(self.study_name):
                return self._run()
        finally:
            self.close()

    def close(self) -> None:
        """Let another tuner measure on this machine (``run()`` does this when it ends)."""
        self.store.close()
        self.lock.release()

    def _run(self) -> TuneResult:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        sampler = make_sampler(self.seed)
        study = self.store.study(self.study_name, sampler)
        if self.quality is not None:
            study.set_user_attr("quality", self.quality.to_dict())
        if self.budget.has_limit or self.budget.has_target:
            study.set_user_attr("quality_budget", self.budget.to_dict())
        done, launched_before = self._resume(study)
        resumed = bool(study.get_trials(deepcopy=False))
        engine = self.engine or TrialRunner(timeout_s=self.trial_timeout)
        self._watch_loads(engine)
        if not resumed:
            seeds = self._seeds()
            for s in seeds:
                study.enqueue_trial(self.space.params_for(s), user_attrs={"seed": True, "seed_margins": self._margins()},
                                    skip_if_exists=True)
            self._enqueue_fit_seed(study, engine, seeds[0])
        self.emit({"kind": "start", "study": self.study_name, "storage": redact_url(self.storage), "resumed": resumed,
                   "done": len(done), "recovered": list(self.store.recovered), "space": self.space.describe(),
                   "grid": self.space.grid_size(), "variants": list(self.models), "rejected": self.rejected,
                   "trials": self.trials, "time_budget": self.time_budget})

        try:
            with CtrlC() as ctrl_c:
                interrupted = self._loop(study, engine, ctrl_c, done, launched_before)
                return self._finish(study, engine, interrupted or ctrl_c.requested, ctrl_c)
        finally:
            if self.engine is None:
                engine.close()

    def _enqueue_fit_seed(self, study: Any, engine: Any, base: Settings) -> None:
        """llama.cpp's own fitter as one more seed, where the engine has it: its choice of layers, split
        and tensor placement for the first seed's other settings, measured like any other candidate."""
        fit = getattr(engine, "fit", None)  # an engine object without the Engine interface has none
        if fit is None or not self.space.has_gpu:
            return  # nothing to fit with, or nothing to fit: every layer runs on the CPU
        try:
            answer = fit(base, margin=self.margin, min_ctx=self.min_ctx)
        except TunerError as exc:
            self.emit({"kind": "fit_seed", "settings": None, "message": f"llama.cpp's fitter failed: {exc}"})
            return
        if answer is None:
            return
        s = answer.settings
        every = self.space.n_layer + 1
        if s.n_gpu_layers < 0 or s.n_gpu_layers > every:
            s = s.replace(n_gpu_layers=every)
        # Fit's tensor placement may be one the space cannot express: the trial carries the exact
        # settings, and the parameters are the nearest the space has (for the sampler's model).
        # Not skip_if_exists: a seed with the same parameters may differ in that placement.
        study.enqueue_trial(self.space.params_for(s), user_attrs={"seed": "fit", "fixed_settings": s.to_dict(),
                                                                  "fit_args": answer.args})
        self.emit({"kind": "fit_seed", "settings": s.to_dict(), "message": f"{Path(answer.tool).name}: {answer.args}"})

    def _resume(self, study: Any) -> tuple[dict[str, Any], int]:
        """What earlier runs of this study already know: the candidates done (by settings) and the
        out-of-memory limits they found; and how many trials they launched."""
        from optuna.trial import TrialState

        done: dict[str, Any] = {}
        launched_before = 0
        for t in study.get_trials(deepcopy=False):
            key = t.user_attrs.get("settings_key")
            if key and t.state in (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED) and _settled(t) \
                    and not _memory_verdict(t):
                done.setdefault(key, t)
            if t.user_attrs.get("oom_device"):
                self.candidates.remember_oom(t.user_attrs["oom_device"], int(t.user_attrs["oom_need"]))
            self.crashes.remember(t.user_attrs.get("crash_avoided"))
            for device, extra in (t.user_attrs.get("beyond_estimate") or {}).items():
                self.candidates.remember_usage(device, int(extra))
            if _measured(t):
                launched_before += 1
        return done, launched_before

    def _loop(self, study: Any, engine: Any, ctrl_c: CtrlC, done: dict[str, Any], launched_before: int) -> bool:
        """Ask, check, launch, tell, until the budget is spent. Returns whether it was interrupted."""
        from optuna.trial import TrialState

        started = time.monotonic()
        launched = 0
        asks = 0
        duplicates_in_a_row = 0
        max_asks = (self.trials or 1000) * 20 + 50
        try:
            while True:
                if ctrl_c.requested:
                    self.emit({"kind": "interrupted", "number": None})
                    return True
                # --trials counts launches over the whole study: a resumed study runs the rest.
                if self.trials is not None and launched_before + launched >= self.trials:
                    return False
                if self.time_budget is not None and time.monotonic() - started >= self.time_budget:
                    return False
                if asks >= max_asks or duplicates_in_a_row >= 40:
                    self.emit({"kind": "exhausted", "asks": asks})
                    return False
                asks += 1
                self.store.sweep(study)
                trial = study.ask()
                self.store.claim(trial)
                if trial.user_attrs.get("seed_margins") not in (None, self._margins()):
                    # a seed sized with a margin that has since been calibrated: its replacement is queued
                    trial.set_user_attr("reason", "a seed sized before the margin was calibrated")
                    trial.set_user_attr("superseded", True)  # not a candidate: counted and shown nowhere
                    study.tell(trial, state=TrialState.PRUNED)
                    continue
                try:
                    s = self.space.suggest(trial)
                    if trial.user_attrs.get("fixed_settings"):
                        # a seed the space cannot express exactly (llama.cpp's fitter's answer)
                        s = Settings.from_dict(trial.user_attrs["fixed_settings"])
                except (ValueError, SettingsError) as exc:
                    trial.set_user_attr("reason", f"invalid candidate: {exc}")
                    study.tell(trial, state=TrialState.PRUNED)
                    self.emit({"kind": "invalid", "number": trial.number, "reason": str(exc)})
                    continue
                # A proposal with more layers than the devices hold is lowered to the most they hold, its
                # other choices kept: to the sampler n_gpu_layers means "this many, or as many as fit", so
                # a proposal past the memory boundary lands on it instead of being skipped
                # (benchmarks/search_at_scale.py measured this against skipping and against searching
                # "layers below the most that fit").
                repaired = self.candidates.repair(s, self.space, trial.params)
                if repaired != s:
                    trial.set_user_attr("proposed", s.to_dict())
                    self.emit({"kind": "repaired", "number": trial.number, "proposed": s.to_dict(), "settings": repaired.to_dict()})
                    s = repaired
                if self.crashes.off and self.crashes.avoid(s) != s:
                    # a feature that crashed here is launched off (learned, like an out-of-memory limit)
                    trial.set_user_attr("proposed", s.to_dict())
                    s = self.crashes.avoid(s)
                    self.emit({"kind": "crash_avoided", "number": trial.number, "off": list(self.crashes.off),
                               "settings": s.to_dict()})
                key = settings_key(s)
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
                variant_quality = self.quality.by_path(s.model_path) if self.quality is not None else None
                if variant_quality is not None:
                    trial.set_user_attr("quality", variant_quality.summary())
                est = self.candidates.estimate(s)
                trial.set_user_attr("predicted", {d: m.to_dict() for d, m in est.devices.items()})
                reason = self.candidates.check(s, est)
                if reason:
                    trial.set_user_attr("reason", reason)
                    study.tell(trial, state=TrialState.PRUNED)
                    done[key] = _Record(trial.number, TrialState.PRUNED, None)
                    self.emit({"kind": "pruned", "number": trial.number, "settings": s.to_dict(), "reason": reason})
                    continue
                self.emit({"kind": "launch", "number": trial.number, "n": launched_before + launched + 1,
                           "total": self.trials, "settings": s.to_dict(), "elapsed": time.monotonic() - started})
                trial.set_user_attr("launched", True)
                early = self._stop_rule(engine, study)
                try:
                    with ctrl_c.immediate():
                        result = engine.run(s, self.bench, trial_id=trial.number, **({"stop": early} if early else {}))
                except KeyboardInterrupt:
                    trial.set_user_attr("interrupted", True)
                    study.tell(trial, state=TrialState.FAIL)
                    self.emit({"kind": "interrupted", "number": trial.number})
                    return True
                launched += 1
                self.time.trial(result)
                self._record(trial, result, est)
                if self._calibrate(trial, result, est):
                    self._reseed(study, done)
                value = None
                if result.ok:
                    value = score(self.objective, result.pp, result.tg, self.bench)
                    study.tell(trial, value)
                    done[key] = _Record(trial.number, TrialState.COMPLETE, value)
                else:
                    if result.outcome is Outcome.OOM:
                        device, need = self.candidates.learn_oom(result, est)
                        trial.set_user_attr("oom_device", device)
                        trial.set_user_attr("oom_need", need)
                    elif result.outcome is Outcome.CRASH and self.crashes.worth_investigating(s):
                        self._learn_crash(study, trial, s, engine)
                    study.tell(trial, state=TrialState.FAIL)
                    done[key] = _Record(trial.number, TrialState.FAIL, None)
                self.emit({"kind": "result", "number": trial.number, "outcome": result.outcome.value,
                           "message": result.message, "value": value, "best": _best_value(study),
                           "elapsed": time.monotonic() - started,
                           "time_left": self._time_left(started, launched, launched_before),
                           "layers": (result.load.layers_offloaded, result.load.layers_total)})
        except KeyboardInterrupt:
            self.emit({"kind": "interrupted", "number": None})
            return True

    def _learn_crash(self, study: Any, trial: Any, s: Settings, engine: Any) -> None:
        """A crash is a clue: find the feature that crashes (``crashes.investigate``), record it on the
        trial (a resumed study reads it back), and queue the same candidate again, to be launched
        with that feature off and measured."""
        self.emit({"kind": "crash_search", "number": trial.number, "settings": s.to_dict(),
                   "message": "llama.cpp crashed: running the same candidate with optional features off"})

        def said(off: tuple[str, ...], result: TrialResult) -> None:
            self.emit({"kind": "crash_check", "number": trial.number, "off": list(off), "outcome": result.outcome.value})

        finding = self.crashes.learn(s, engine, self.bench, on_run=said)
        trial.set_user_attr("crash_avoided", finding.to_dict())
        self.emit({"kind": "crash_learned", "number": trial.number, **finding.to_dict()})
        if finding.found:
            try:
                fixed = {"fixed_settings": trial.user_attrs["fixed_settings"]} if trial.user_attrs.get("fixed_settings") else {}
                study.enqueue_trial(dict(trial.params), user_attrs={"seed": "crash", **fixed})
            except (ValueError, TypeError):  # pragma: no cover - the same parameters enqueue as they were asked
                pass

    def _watch_loads(self, engine: Any) -> None:
        """A long model load says how far it is (bytes read of the file's size), where the engine can."""
        if engine is not None and hasattr(engine, "on_load") and engine.on_load is None:
            engine.on_load = lambda p: self.emit({"kind": "load_progress", **p})

    def _stop_rule(self, engine: Any, study: Any) -> StopRule | None:
        """When the next trial may stop repeating (``thrift.stop_rule``), for an engine that can; none
        in target mode, where a slower candidate of better quality may still be the answer."""
        if not getattr(engine, "stops_early", False) or self.budget.has_target:
            return None
        if self.objective not in ("tg", "pp", "mixed") or self.bench.users > 1:
            return None  # the rule scores one sequence's tg/pp; several users' figures are the workload's
        return stop_rule(self.objective, self.bench, _best_value(study))

    def _time_left(self, started: float, launched: int, launched_before: int) -> float | None:
        """Seconds left: of the time budget, or estimated from the trials so far."""
        elapsed = time.monotonic() - started
        if self.time_budget is not None:
            return max(0.0, self.time_budget - elapsed)
        if self.trials is not None and launched:
            return elapsed / launched * max(0, self.trials - launched_before - launched)
        return None

    def _seeds(self) -> list[Settings]:
        return group_by_model(self._plain_seeds())

    def _plain_seeds(self) -> list[Settings]:
        return self.candidates.seeds(self.space, self.machine.physical_cores, objective=self.objective,
                                     depth=self.bench.depth + self.bench.n_gen // 2, unified_memory=self.machine.unified_memory)

    def _margins(self) -> dict[str, int]:
        return {d.name: self.candidates.margin_for(d.name) for d in self.devices}

    def _calibrate(self, trial: Any, result: TrialResult, est: MemoryEstimate) -> bool:
        """What the trial used beyond the arithmetic, per accelerator (recorded, and the margin learns
        it). Returns whether a device's margin changed."""
        before = self._margins()
        beyond = self.candidates.learn_usage(result, est)
        if not beyond:
            return False
        trial.set_user_attr("beyond_estimate", beyond)
        changed = False
        for device, old in before.items():
            new = self.candidates.margin_for(device)
            if new != old:
                changed = True
                self.emit({"kind": "margin", "number": trial.number, "device": device, "margin": new, "was": old,
                           "message": f"{device}: margin {new / MiB:.0f} MiB (was {old / MiB:.0f}): trials used up to "
                                      f"{max(self.candidates.beyond[device]) / MiB:.0f} MiB beyond the arithmetic there"})
        return changed

    def _reseed(self, study: Any, done: dict[str, Any]) -> None:
        """The margin moved: the seeds are sized again with it (seeds still queued from before are
        dropped as they come up; those already measured are not measured again)."""
        margins = self._margins()
        for s in self._seeds():
            if settings_key(s) not in done:
                study.enqueue_trial(self.space.params_for(s), user_attrs={"seed": True, "seed_margins": margins})

    def _record(self, trial: Any, result: TrialResult, est: MemoryEstimate) -> None:
        trial.set_user_attr("outcome", result.outcome.value)
        trial.set_user_attr("message", result.message[:2000])
        if result.pp:
            trial.set_user_attr("pp", result.pp.to_dict())
        if result.tg:
            trial.set_user_attr("tg", result.tg.to_dict())
        trial.set_user_attr("layers", [result.load.layers_offloaded, result.load.layers_total])
        trial.set_user_attr("actual", result.actual_memory())
        trial.set_user_attr("peak_rss", result.peak_rss)

    # -- the winner ---------------------------------------------------------------------------

    def _finish(self, study: Any, engine: Any, interrupted: bool, ctrl_c: CtrlC) -> TuneResult:
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        complete = [t for t in trials if t.state == TrialState.COMPLETE and "duplicate_of" not in t.user_attrs]
        counts = _counts(trials)
        if not complete:
            failures = [f"#{t.number}: {t.user_attrs.get('outcome', 'pruned')} - {t.user_attrs.get('message') or t.user_attrs.get('reason', '')}"
                        for t in trials if "duplicate_of" not in t.user_attrs][:8]
            raise StudyError("no candidate ran successfully, so there is no profile to write.\n  " + "\n  ".join(failures)
                             + "\nRead the reasons above: try a smaller --min-ctx, a smaller quantization (--variant), or free memory.")
        ranked = sorted(complete, key=lambda t: t.value, reverse=True)
        target: dict[str, Any] | None = None
        reaching: list[Contender] = []
        if self.budget.has_target:
            # Target mode: among what reaches the target, the highest quality wins, then the least
            # accelerator memory; the re-measure confirms it still reaches the target.
            everything = [Contender.from_trial(t) for t in complete]
            reaching = rank_for_target([c for c in everything if self.budget.reaches(median(c.pp), median(c.tg))], self.quality)
            target = {**{k: v for k, v in self.budget.to_dict().items() if k in ("min_tg", "min_pp")}, "met": bool(reaching),
                      "best_tg": max((median(c.tg) or 0.0 for c in everything), default=None),
                      "best_pp": max((median(c.pp) or 0.0 for c in everything), default=None)}
            if not reaching:
                self.emit({"kind": "target_missed", **target})
        contenders = reaching[: self.final_candidates] if reaching else [Contender.from_trial(t) for t in ranked[: self.final_candidates]]
        clear = False
        if not reaching and len(contenders) > 1:
            # only the candidates within noise of the leader are measured again; none when it is clear
            near = within_noise(contenders, self.objective)
            clear = len(near) == 1
            if clear:
                self.emit({"kind": "remeasure_skipped", "candidates": [c.number for c in contenders],
                           "message": f"#{near[0].number} leads the others by more than the noise: not measured again"})
            contenders = near
        if not interrupted and not clear:
            remeasure = Remeasure(engine, objective=self.objective, bench=self.bench, repetitions=self.final_repetitions,
                                  rounds=self.final_rounds, fit_together=self.candidates.fit_together, emit=self.emit)
            with self.time.part("remeasure"):
                contenders, interrupted = remeasure.run(contenders, ctrl_c)
        if reaching:
            confirmed = [c for c in contenders if self.budget.reaches(median(c.pp), median(c.tg))]
            if confirmed:
                best, second = confirmed[0], None  # already in the target's order: quality, memory, speed
            else:
                best, second = pick_winner(contenders, self.objective)
                assert target is not None
                target["met"] = False
                self.emit({"kind": "target_missed", **target, "after_remeasure": True})
        else:
            best, second = pick_winner(contenders, self.objective)
        runner_up = {"settings": second.settings.to_dict(), "pp": second.pp, "tg": second.tg} if second else None
        self.curve = []
        if self.bench.users > 1 and not interrupted:
            # the knee: the winner and the next contender at fewer users (issue 21's report)
            others = [c for c in contenders if c is not best]
            self.curve = self._curve(engine, best, second or (others[0] if others else None), ctrl_c)
        # The study holds every trial whatever happens next; a profile that cannot be made or written
        # (a full disk, a folder gone read-only) is reported with the winner, never in its place.
        profile: Profile | None = None
        path: Path | None = None
        problem = None
        try:
            profile = self._profile(best, runner_up, counts, target, engine)
            path = profile.write(self.out)
        except TunerError as exc:
            problem = (f"the profile was not written: {exc}. Nothing is lost: study {self.study_name} keeps every trial; "
                       "fix this and run the same command again, it writes the profile without repeating the trials")
        flags = self._check_exported_flags(profile, engine) if profile is not None else None
        best_out = best.to_dict()
        traded = self._trade(complete, contenders)
        spent = self.time.to_dict()
        study.set_user_attr("time", spent)  # the report shows it
        self.emit({"kind": "done", "profile_path": str(path) if path else None, "best": best_out, "counts": counts, "time": spent,
                   "interrupted": interrupted, "profile_error": problem, "trade": traded, "target": target})
        return TuneResult(profile=profile, profile_path=path, best=best_out, runner_up=runner_up, counts=counts,
                          space=self.space, study_name=self.study_name, storage=self.storage, interrupted=interrupted,
                          rejected=self.rejected, profile_error=problem, quality=self.quality, excluded=self.excluded,
                          trade=traded, target=target, flags_check=flags, time=spent)

    def _curve(self, engine: Any, best: Contender, second: Contender | None, ctrl_c: CtrlC) -> list[dict[str, Any]]:
        """The winner (and the next contender) measured at 1, 2, 4... users up to the workload's, each
        with the context its users need (n_parallel k, n_ctx / N * k): where aggregate speed stops
        growing (the knee), and what each user gets and waits. The workload's own point is the
        profile's; an out-of-memory or failed point is left out."""
        users = self.bench.users
        counts = sorted({1 << i for i in range(users.bit_length()) if 1 << i < users})
        points: list[dict[str, Any]] = []
        for name, c in (("winner", best), ("second", second)):
            if c is None:
                continue
            for k in counts:
                per_user_ctx = max(1, c.settings.n_ctx // users) if c.settings.n_ctx else 0
                s = c.settings.replace(n_parallel=k, n_ctx=per_user_ctx * k, kv_unified=c.settings.kv_unified and k > 1)
                # one method along the curve: its one-user point too is measured as batched-bench does
                bench = dataclasses.replace(self.bench, users=k, batched=True)
                try:
                    with ctrl_c.immediate():
                        result = engine.run(s, bench, trial_id=f"curve-{name}-{k}")
                except KeyboardInterrupt:
                    return points
                if result.ok:
                    points.append({"users": k, "candidate": name, **workload_figures(result.pp, result.tg, bench)})
            figures = workload_figures(Stats.of(c.pp["samples"]) if c.pp and c.pp.get("samples") else None,
                                       Stats.of(c.tg["samples"]) if c.tg and c.tg.get("samples") else None, self.bench)
            points.append({"users": users, "candidate": name, **figures})
        self.emit({"kind": "curve", "points": points})
        return points

    def _trade(self, complete: Sequence[Any], contenders: Sequence[Contender]) -> list[dict[str, Any]]:
        """Per variant, its best speed found (re-measured figures where it was re-measured) and
        its quality; the variants over the budget with why. Empty when quality was not measured."""
        if self.quality is None:
            return []
        again = {c.number: c for c in contenders if c.remeasured}
        best: dict[str, dict[str, Any]] = {}
        for t in complete:
            c = again.get(t.number) or Contender.from_trial(t)
            path = c.settings.model_path
            held = best.get(path)
            # a re-measured figure beats a single first measurement of the same variant (which would
            # often be luckier, and name another candidate than the winner); among equals, the faster
            if held is None or (c.remeasured, c.value) > (held["remeasured"], held["value"]):
                best[path] = {"number": c.number, "value": c.value, "pp": median(c.pp), "tg": median(c.tg),
                              "remeasured": c.remeasured}
        return trade(self.quality, best, self.excluded, list(self.models))

    def _check_exported_flags(self, profile: Profile, engine: Any) -> dict[str, Any] | None:
        """The profile's llama-server flags through the engine's own binaries' parser, where it has one."""
        if not hasattr(engine, "check_flags"):
            return None
        from ..profile.exports import tool_args

        try:
            answer = engine.check_flags("llama-server", tool_args(profile, "llama-server"))
        except TunerError as exc:
            answer = ("", f"could not run the check: {exc}")
        if answer is None:
            return None
        binary, error = answer
        result = {"tool": "llama-server", "parser": binary, "accepted": error is None, "error": error}
        self.emit({"kind": "flags_checked", **result})
        return result

    def _profile(self, best: Contender, runner_up: dict[str, Any] | None, counts: dict[str, int],
                 target: dict[str, Any] | None = None, engine: Any = None) -> Profile:
        s = best.settings
        info = self.models[s.model_path]
        quality = None
        v = self.quality.by_path(s.model_path) if self.quality is not None else None
        if v is not None and self.quality is not None:
            quality = {"kl": {"mean": max(0.0, v.kl_mean), "median": max(0.0, v.kl_median), "p99": max(0.0, v.kl_p99)},
                       "top1_agreement": v.top1_agreement, "ppl": v.ppl, "ppl_ratio": v.ppl_ratio,
                       "reference": {"file_name": Path(self.quality.reference).name, "sha256": self.quality.reference_sha256},
                       "corpus_sha256": self.quality.corpus_sha256, "n_ctx": self.quality.n_ctx, "chunks": self.quality.chunks}
        asked = None
        if self.budget.has_limit or self.budget.has_target:
            asked = {**self.budget.to_dict(), "target_met": target["met"] if target is not None else None}
        kv_layer = info.kv_bytes_per_token_layer(info.kv_layers[0] if info.kv_layers else 0, s.type_k, s.type_v)
        machine = self.machine
        recorded_engine = None
        if getattr(engine, "name", "") in ("python", "llama-cpp"):
            build = engine.build()
            recorded_engine = {"name": engine.name, "build": build.describe(), "path": build.path}
            if engine.name == "llama-cpp":
                # the binaries' build, now that a benchmark ran (an older llama-bench says it only there)
                import dataclasses

                from ..machine.probe import build_of_engine

                machine = dataclasses.replace(machine, llama=build_of_engine(build, engine.devices(self.rpc_servers)))
        return Profile.from_tuning(
            machine=machine,
            engine=recorded_engine,
            model=info.fingerprint(),
            settings=s,
            min_ctx=self.min_ctx,
            objective=self.objective,
            measured={"pp": best.pp, "tg": best.tg, "n_prompt": self.bench.n_prompt, "n_gen": self.bench.n_gen,
                      "depth": self.bench.depth},
            workload={**workload_of(self.bench, self.objective, best.pp, best.tg),
                      **({"curve": self.curve} if getattr(self, "curve", None) else {})},
            memory={"predicted": best.predicted, "actual": best.actual},
            sizing={"n_layer": info.n_layer, "layer_weight_bytes": info.bytes_per_layer,
                    "output_weight_bytes": info.output_layer_bytes, "kv_bytes_per_token_per_layer": kv_layer,
                    "sliding_window": info.sliding_window or 0, "swa_layers": len(info.swa_layers) if info.sliding_window else 0,
                    "n_ctx_train": info.n_ctx_train},
            layers_offloaded=best.layers[0],
            layers_total=best.layers[1] if best.layers[1] is not None else info.n_layer + 1,
            runner_up=runner_up,
            trials=counts,
            study={"name": self.study_name, "storage": redact_url(self.storage)},
            quality=quality,
            quality_budget=asked,
        )


def workload_of(bench: BenchSpec, objective: str, pp: dict[str, Any] | None, tg: dict[str, Any] | None) -> dict[str, Any]:
    """The profile's ``workload``: what it was tuned for, and its figures at that load."""
    out: dict[str, Any] = {"users": bench.users, "n_prompt": bench.n_prompt, "n_gen": bench.n_gen, "depth": bench.depth,
                           "objective": objective}
    if bench.min_user_tg is not None:
        out["min_user_tg"] = bench.min_user_tg
    figures = workload_figures(Stats.of(pp["samples"]) if pp and pp.get("samples") else None,
                               Stats.of(tg["samples"]) if tg and tg.get("samples") else None, bench)
    out.update(figures)
    return out


def _counts(trials: Sequence[Any]) -> dict[str, int]:
    """Trials run, not launched (pruned), out of memory, failed otherwise; duplicates not counted."""
    from optuna.trial import TrialState

    ran = [t for t in trials if _measured(t)]
    return {
        "run": len(ran),
        "pruned": sum(1 for t in trials if t.state == TrialState.PRUNED and "duplicate_of" not in t.user_attrs
                      and "superseded" not in t.user_attrs),
        "oom": sum(1 for t in trials if t.user_attrs.get("outcome") == "oom"),
        "failed": sum(1 for t in ran if t.user_attrs.get("outcome") not in ("ok", "oom")),
    }


def _check_numbers(**values: Any) -> None:
    """The tune's numeric options: refused with the option named, before anything runs."""
    rules = {
        "time_budget": (lambda v: v is None or (math.isfinite(v) and v > 0), "a number of seconds above 0"),
        "vram_margin": (lambda v: v is None or 0 <= v <= limits.MAX_DOCUMENT_INT, "a size >= 0"),
        "trial_timeout": (lambda v: math.isfinite(v) and v > 0, "a number of seconds above 0"),
        "min_ctx": (lambda v: 1 <= v <= limits.MAX_CTX, f"a context from 1 to {limits.MAX_CTX} tokens"),
        "depth": (lambda v: 0 <= v <= limits.MAX_CTX, f"a token count from 0 to {limits.MAX_CTX}"),
        "n_prompt": (lambda v: 0 <= v <= limits.MAX_CTX, f"a token count from 0 to {limits.MAX_CTX}"),
        "n_gen": (lambda v: 0 <= v <= limits.MAX_CTX, f"a token count from 0 to {limits.MAX_CTX}"),
        "repetitions": (lambda v: 1 <= v <= 10_000, "a count from 1 to 10000"),
        "users": (lambda v: isinstance(v, int) and 1 <= v <= limits.MAX_PARALLEL, f"a count of users from 1 to {limits.MAX_PARALLEL}"),
        "min_user_tg": (lambda v: v is None or (math.isfinite(v) and v > 0), "tokens/sec above 0"),
    }
    for name, value in values.items():
        ok, expected = rules[name]
        if not isinstance(value, (int, float, type(None))) or isinstance(value, bool) or not ok(value):
            raise SettingsError(name, f"expected {expected}, got {value!r}")


def _best_value(study: Any) -> float | None:
    try:
        return study.best_value
    except ValueError:
        return None


def _measured(trial: Any) -> bool:
    """Whether a trial's measurement ended with an outcome the study was told: not interrupted, not
    killed with its tuner. (A tuner killed between recording "ok" and telling the study leaves a
    trial that recovery fails: FAIL with outcome "ok", measured again.)"""
    outcome = trial.user_attrs.get("outcome")
    if not trial.user_attrs.get("launched") or outcome is None:
        return False
    return outcome != "ok" or trial.state.name == "COMPLETE"


def _memory_verdict(trial: Any) -> bool:
    """A candidate skipped because it was predicted not to fit the memory free then: free memory
    changes between runs, so a resumed study checks it again instead of answering from the record."""
    return str(trial.user_attrs.get("reason", "")).startswith("predicted not to fit")


def _settled(trial: Any) -> bool:
    """Whether a finished trial answers for its candidate: decided without launching (pruned), or
    measured to an outcome. A trial interrupted or killed mid-measurement does not: it runs again."""
    return not trial.user_attrs.get("launched") or _measured(trial)


def tune(model: str | Path, **kwargs: Any) -> TuneResult:
    """Tune ``model`` on this machine and write the best profile. See ``Tuner`` for the options."""
    return Tuner(model, **kwargs).run()
