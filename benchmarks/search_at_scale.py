"""How many trials does the tuner need on GPU-sized search spaces? Measured by simulation.

On a real GPU a trial of a 30-70B model costs 10-60 s, so trials are the tuner's cost. This runs the
search on simulated machines (``tuner.machine.simulated``: the roofline engine with vendor device
figures, models of real shapes built without a file) where every candidate can be evaluated:

- the optimum: the best generation speed of any candidate of the tuner's own search space that
  fits, by exhaustive evaluation of the noiseless engine (``tuner.search.exhaustive``);
- three strategies, each over several seeds (the seed drives the sampler and the engine's noise,
  a drifting 0-20% slow-down like this shared machine's):

  * ``tuner``: the real ``Tuner`` (study loop, search space, pre-launch memory checks, seeds, OOM
    learning, the re-measure of the leading candidates), with the roofline engine injected;
  * ``random``: uniform random candidates from the same space (Optuna's RandomSampler), each one
    launched: no memory arithmetic, out of memory is a failed trial;
  * ``bisect_tpe``: llama-optimus's way: bisect n_gpu_layers (with the other settings at their
    defaults) to the largest that loads, each probe a launch, then multivariate TPE over the other
    dimensions with n_gpu_layers fixed there; a failed trial scores 0 t/s as llama-optimus scores it.

A trial is a launch (a model load on a real machine). After each launch a strategy's pick is the
candidate with the best *measured* figure so far; what counts is that pick's *true* (noiseless)
speed over the optimum. Printed per machine and strategy:

- trials to 0.98: the first launch after which the pick is within 0.98 of the optimum, median and
  worst over the seeds (searched up to ``--horizon`` launches; "-" / null: not within the horizon);
- ratio at 20: the true speed of what the strategy ends with after 20 trials, over the optimum
  (median over seeds). For the tuner that is the profile's winner of a ``--trials 20`` run, chosen
  after its re-measure; the re-measure's loads (one paired load of the three leading candidates
  when they fit together, else three rounds of three) come on top of the 20 and are printed apart;
- OOM launches: launches that ran out of memory within the first 20, summed over the seeds.

    python benchmarks/search_at_scale.py [--quick] [--json] [--seeds N] [--machines 24gb-70b,...]
                                         [--vram-margin MiB] [--ablation]

``--quick``: 3 seeds. ``--json`` prints only
``{MACHINE: {"optimum", "grid_size", STRATEGY: {"trials_to_098_median", "trials_to_098_worst",
"ratio_at_20_median", "oom_launches"}}}``. Target: the tuner reaches 0.98 x the optimum within 20
trials (median) on every machine, with no OOM launch, and beats random search at 20 trials.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STRATEGIES = ("tuner", "random", "bisect_tpe")
BUDGET = 20
TARGET = 0.98


@dataclass
class Trace:
    """One strategy's launches on one machine and seed: measured score (None: failed) and true
    speed of each, and what it ended with."""

    measured: list[float | None] = field(default_factory=list)
    true: list[float] = field(default_factory=list)
    oom: list[bool] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)  # the simulated wall clock after each launch, seconds
    final_true: float | None = None  # the tuner's profile winner (after its re-measure)
    final_wall: float | None = None  # the simulated wall clock when the profile is written
    loads: int = 0  # model loads (trials, re-measure and probes)
    spent: dict[str, float] = field(default_factory=dict)  # the simulated clock by kind (roofline.COSTS)
    remeasure_loads: int = 0
    proposals: dict[str, int] = field(default_factory=dict)  # the tuner's asks: launched, pruned, invalid, repaired

    loads_at: list[int] = field(default_factory=list)  # model loads after each launch

    def add(self, measured: float | None, true: float, oom: bool, engine: Any) -> None:
        self.measured.append(measured)
        self.true.append(true)
        self.oom.append(oom)
        self.wall.append(engine.clock)
        self.loads_at.append(engine.loads)

    def close(self, engine: Any) -> "Trace":
        self.loads, self.spent = engine.loads, dict(engine.spent)
        return self

    def picks(self) -> list[float]:
        """After each launch, the true speed of the best measured candidate so far (0: none yet)."""
        out, best, best_true = [], None, 0.0
        for m, t in zip(self.measured, self.true):
            if m is not None and (best is None or m > best):
                best, best_true = m, t
            out.append(best_true)
        return out


def true_tg(engine: Any, settings: Any, bench: Any) -> float:
    """The noiseless generation speed of a candidate that fits, else 0."""
    if engine.out_of_memory(engine.memory(settings)) is not None:
        return 0.0
    return engine.speed(settings, bench)[1]


def plain_seeds(self: Any, space: Any, physical_cores: int, **_: Any) -> list[Any]:
    """The seeds before issue 14 (for --ablation): per variant the most whole layers that fit at f16
    and n_ubatch 512, the variant on the CPU alone; llama.cpp's defaults."""
    from optuna.trial import FixedTrial

    threads = max(space.threads[0], min(space.threads, key=lambda t: abs(t - physical_cores)))
    common = dict(n_ctx=space.n_ctx[0], n_batch=space.n_batch[-1], n_ubatch=512, threads=threads)
    out = []
    for variant in space.variants:
        out.append(self.most_layers(space.settings(variant=variant, kv="f16", flash_attn="on", **common)))
        out.append(space.settings(variant=variant, kv="f16", flash_attn="on", **common))
    out.append(space.settings(variant=space.variants[0], n_gpu_layers=space.n_layer + 1, kv="f16", flash_attn="on", **common))
    return [space.suggest(FixedTrial(space.params_for(s))) for s in out]


ABLATIONS = {  # --ablation: the tuner with parts of issue 14's search turned back
    "tuner": {},
    "plain_seeds": {"seeds": plain_seeds},
    "skip_oom_proposals": {"repair": lambda self, s, space, params: s},
    "plain_seeds+skip": {"seeds": plain_seeds, "repair": lambda self, s, space, params: s},
}


def run_tuner(sim: Any, seed: int, trials: int, *, final: bool, ablation: str = "tuner", margin: int | None = None) -> Trace:
    """The real Tuner with the roofline engine; ``final``: keep its profile winner as the pick."""
    import optuna

    from tuner.engine.settings import Settings
    from tuner.search.candidates import Candidates
    from tuner.search.study import Tuner

    if ablation != "tuner":
        saved = {name: getattr(Candidates, name) for name in ABLATIONS[ablation]}
        try:
            for name, replacement in ABLATIONS[ablation].items():
                setattr(Candidates, name, replacement)
            return run_tuner(sim, seed, trials, final=final, margin=margin)
        finally:
            for name, original in saved.items():
                setattr(Candidates, name, original)

    engine = sim.engine(seed=seed)
    trace = Trace()
    pending: dict[int, Any] = {}

    def on_event(e: dict[str, Any]) -> None:
        if e["kind"] in ("launch", "pruned", "invalid", "repaired", "exhausted"):
            trace.proposals[e["kind"]] = trace.proposals.get(e["kind"], 0) + 1
        if e["kind"] == "launch":
            pending[e["number"]] = Settings.from_dict(e["settings"])
        elif e["kind"] == "result" and e["number"] in pending:
            s = pending.pop(e["number"])
            trace.add(e["value"], true_tg(engine, s, tuner.bench), e["outcome"] == "oom", engine)
        elif e["kind"] == "remeasure":
            trace.remeasure_loads = 1 if e["paired"] else e["rounds"] * len(e["candidates"])

    tuner = Tuner(sim.main, variants=sim.variants, infos=sim.models, machine=sim.machine(), engine=engine, trials=trials,
                  min_ctx=sim.min_ctx, depth=sim.depth, seed=seed, on_event=on_event, storage=optuna.storages.InMemoryStorage(),
                  study_name=f"{sim.name}-{seed}", out=Path(tempfile.mkdtemp()) / "profile.json",
                  **({"vram_margin": margin} if margin is not None else {}))
    result = tuner.run()
    if final:
        trace.final_true = true_tg(engine, Settings.from_dict(result.best["settings"]), tuner.bench)
        trace.final_wall = engine.clock
    return trace.close(engine)


def _space_and_bench(sim: Any) -> tuple[Any, Any]:
    from tuner.engine.base import BenchSpec
    from tuner.search.candidates import accelerator_devices
    from tuner.search.space import build_space

    m = sim.machine()
    space = build_space(list(sim.models.values()), devices=accelerator_devices(m), physical_cores=m.physical_cores,
                        logical_cores=m.logical_cores, min_ctx=sim.min_ctx, n_prompt=512)
    # the Tuner's defaults: 512 prompt tokens, 128 generated after the depth, 3 repetitions
    return space, BenchSpec(n_prompt=512, n_gen=128, depth=sim.depth, repetitions=3)


def _launch(engine: Any, s: Any, bench: Any, trace: Trace) -> float | None:
    from tuner.search.objective import score

    result = engine.run(s, bench)
    value = score("tg", result.pp, result.tg, bench) if result.ok else None
    trace.add(value, true_tg(engine, s, bench), result.outcome.value == "oom", engine)
    return value


def run_random(sim: Any, seed: int, trials: int) -> Trace:
    """Uniform random candidates of the tuner's space, every one launched."""
    import optuna

    from tuner.errors import SettingsError

    space, bench = _space_and_bench(sim)
    engine = sim.engine(seed=seed)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed))
    trace = Trace()
    while len(trace.true) < trials:
        trial = study.ask()
        try:
            s = space.suggest(trial)
        except (ValueError, SettingsError):
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)  # not a candidate: nothing launched
            continue
        value = _launch(engine, s, bench, trace)
        study.tell(trial, value if value is not None else 0.0)
    return trace.close(engine)


class _FixedLayers:
    """An Optuna trial whose n_gpu_layers is fixed (the rest asked as usual)."""

    def __init__(self, trial: Any, ngl: int) -> None:
        self.trial, self.ngl = trial, ngl

    def suggest_int(self, name: str, low: int, high: int, **kw: Any) -> int:
        return self.ngl if name == "n_gpu_layers" else self.trial.suggest_int(name, low, high, **kw)

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        return self.trial.suggest_categorical(name, choices)


def run_bisect_tpe(sim: Any, seed: int, trials: int) -> Trace:
    """llama-optimus: bisect n_gpu_layers to the largest that loads, then TPE over the rest."""
    import optuna

    from tuner.errors import SettingsError

    space, bench = _space_and_bench(sim)
    engine = sim.engine(seed=seed)
    trace = Trace()
    m = sim.machine()
    defaults = dict(variant=space.variants[0], n_ctx=space.n_ctx[0], kv="f16", flash_attn="on", threads=m.physical_cores,
                    n_ubatch=512, n_batch=max(space.n_batch[0], 512))
    # probes: llama-bench with a minimal workload; only whether it loads counts
    low, high = 0, space.n_layer + 1
    while low < high and len(trace.true) < trials:
        mid = (low + high + 1) // 2
        probe = engine.run(space.settings(n_gpu_layers=mid, **defaults), bench)
        trace.add(None, 0.0, probe.outcome.value == "oom", engine)
        if probe.ok:
            low = mid
        else:
            high = mid - 1
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed, multivariate=True))
    while len(trace.true) < trials:
        trial = study.ask()
        try:
            s = space.suggest(_FixedLayers(trial, low))
        except (ValueError, SettingsError):
            study.tell(trial, 0.0)  # llama-optimus: whatever fails scores 0 (here: rejected before launch)
            continue
        value = _launch(engine, s, bench, trace)
        study.tell(trial, value if value is not None else 0.0)
    return trace.close(engine)


def trials_to(picks: list[float], goal: float) -> int | None:
    return next((i + 1 for i, v in enumerate(picks) if v >= goal), None)


def summarize(traces: list[Trace], final: list[Trace] | None, optimum: float) -> dict[str, Any]:
    """One strategy on one machine, over seeds."""
    reached = [trials_to(t.picks(), TARGET * optimum) for t in traces]
    as_num = [r if r is not None else float("inf") for r in reached]
    median = statistics.median(as_num)
    worst = max(as_num)
    if final is not None:
        at_20 = [(t.final_true or 0.0) / optimum for t in final]
        total = [t.final_wall or 0.0 for t in final]
    else:
        at_20 = [t.picks()[min(BUDGET, len(t.true)) - 1] / optimum for t in traces]
        total = [t.wall[min(BUDGET, len(t.wall)) - 1] for t in traces]
    # the simulated wall clock when the pick first reaches 0.98 (the launch that got there included)
    wall_to = [t.wall[r - 1] if r is not None else float("inf") for t, r in zip(traces, reached)]
    wall_median = statistics.median(wall_to)
    spent = final or traces
    return {
        "trials_to_098_median": None if median == float("inf") else median,
        "trials_to_098_worst": None if worst == float("inf") else worst,
        "wall_s_to_098_median": None if wall_median == float("inf") else round(wall_median, 1),
        "wall_s_total_median": round(statistics.median(total), 1),
        "loads_total_median": statistics.median(t.loads if final else t.loads_at[min(BUDGET, len(t.loads_at)) - 1]
                                                for t in spent),
        "_spent": ({k: round(statistics.median(t.spent.get(k, 0.0) for t in final), 1) for k in final[0].spent}
                   if final else None),
        "ratio_at_20_median": round(statistics.median(at_20), 4),
        "oom_launches": sum(sum(t.oom[:BUDGET]) for t in (final or traces)),
        "_ratios_at_20": [round(r, 3) for r in at_20],
        "_remeasure_loads": [t.remeasure_loads for t in final] if final else None,
        "_proposals": {k: sum(t.proposals.get(k, 0) for t in traces) for k in ("launch", "pruned", "invalid", "repaired", "exhausted")},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 seeds")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per strategy (default 10, 3 with --quick)")
    parser.add_argument("--horizon", type=int, default=60, help="launches searched for the 0.98 mark")
    parser.add_argument("--machines", default=None, help="comma-separated simulated machines (default: all)")
    parser.add_argument("--json", action="store_true", help="print only the JSON summary")
    parser.add_argument("--json-out", default=None, metavar="FILE", help="also write the JSON summary to FILE")
    parser.add_argument("--storage", default="nvme", help="where the model files live: nvme, sata-ssd, hdd, network "
                        "(tuner.engine.roofline.STORAGE)")
    parser.add_argument("--vram-margin", type=int, default=None, metavar="MiB",
                        help="the tuner's --vram-margin (default: none given, the tune command's calibrated margin)")
    parser.add_argument("--ablation", action="store_true",
                        help="instead: the tuner with its memory-aware seeds and/or its lowering of proposals past the "
                             "memory boundary turned back (plain seeds; such proposals skipped)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = tmp
        # a simulated machine is no machine to lock: runs of this benchmark (and tunes here) need not wait for each other
        os.environ["OFFLOAD_TUNER_LOCK_DIR"] = os.path.join(tmp, "locks")
        import optuna

        from tuner.machine.simulated import SIMULATED
        from tuner.engine.roofline import CONTEXT_OVERHEAD
        from tuner.search.candidates import CALIBRATION_SLACK, DEFAULT_MARGIN
        from tuner.search.exhaustive import describe, optimum

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        seeds = args.seeds or (3 if args.quick else 10)
        from tuner.engine.roofline import STORAGE

        if args.storage not in STORAGE:
            print(f"search_at_scale: unknown --storage {args.storage}; known: {', '.join(STORAGE)}", file=sys.stderr)
            return 2
        margin_arg = args.vram_margin << 20 if args.vram_margin is not None else None
        names = args.machines.split(",") if args.machines else list(SIMULATED)
        unknown = [n for n in names if n not in SIMULATED]
        if unknown:
            print(f"search_at_scale: unknown machine(s) {', '.join(unknown)}; known: {', '.join(SIMULATED)}", file=sys.stderr)
            return 2
        say: Callable[..., None] = (lambda *a, **k: None) if args.json else (lambda *a, **k: print(*a, **k, flush=True))
        started = time.monotonic()
        out: dict[str, Any] = {}
        for name in names:
            sim = dataclasses.replace(SIMULATED[name], storage=args.storage)
            space, bench = _space_and_bench(sim)
            t0 = time.monotonic()
            best = optimum(space, sim.engine(noise=0.0), bench)
            say(f"\n== {name}: {sim.description}")
            say(f"   space: {best.grid_size:.3g} candidates, {best.feasible / best.grid_size:.0%} fit; exhaustive evaluation "
                f"{time.monotonic() - t0:.1f} s")
            say(f"   optimum: {describe(best.settings, best.value)}")
            # what the tuner's margin leaves reachable. Without --vram-margin the tuner calibrates it from
            # the trials' measured use: here llama.cpp's own context (roofline.CONTEXT_OVERHEAD), which the
            # arithmetic never sees, plus the calibration's slack.
            if margin_arg is not None:
                margin, how = margin_arg, f"{margin_arg >> 20} MiB --vram-margin"
            else:
                margin = CONTEXT_OVERHEAD + CALIBRATION_SLACK
                how = f"calibrated margin ({margin >> 20} MiB once a trial measured; {DEFAULT_MARGIN >> 20} MiB before)"
            within = sim.engine(noise=0.0)
            for device in within.names:
                within.capacity[device] = within.free[device] - margin
            reachable = optimum(space, within, bench).value
            say(f"   best outside the tuner's {how}: {reachable:.2f} t/s, {reachable / best.value:.3f} of the optimum")
            row: dict[str, Any] = {"optimum": round(best.value, 4), "grid_size": best.grid_size}
            runs: dict[str, Callable[[int], Trace]] = {
                "tuner": lambda seed: run_tuner(sim, seed, args.horizon, final=False, margin=margin_arg),
                "random": lambda seed: run_random(sim, seed, args.horizon),
                "bisect_tpe": lambda seed: run_bisect_tpe(sim, seed, args.horizon),
            }
            strategies: tuple[str, ...] = STRATEGIES
            if args.ablation:
                strategies = tuple(ABLATIONS)
                runs = {a: (lambda seed, a=a: run_tuner(sim, seed, args.horizon, final=False, ablation=a, margin=margin_arg))
                        for a in ABLATIONS}
            for strategy in strategies:
                t0 = time.monotonic()
                traces = [runs[strategy](seed) for seed in range(seeds)]
                final = ([run_tuner(sim, seed, BUDGET, final=True, ablation=strategy, margin=margin_arg) for seed in range(seeds)]
                         if strategy in ABLATIONS else None)
                summary = summarize(traces, final, best.value)
                row[strategy] = {k: v for k, v in summary.items() if not k.startswith("_")}
                reach = lambda v: "-" if v is None else f"{v:g}"  # noqa: E731
                p = summary["_proposals"]
                extra = (f", re-measure loads {summary['_remeasure_loads']}; proposals over {args.horizon} launches: "
                         f"{p['pruned']} predicted not to fit, {p['repaired']} lowered to the layers that fit, "
                         f"{p['invalid']} invalid" + (f", stopped early {p['exhausted']}x" if p["exhausted"] else "")
                         if final else "")
                say(f"   {strategy:<18} trials to 0.98: median {reach(summary['trials_to_098_median']):>3}, worst "
                    f"{reach(summary['trials_to_098_worst']):>3} | ratio at 20: {summary['ratio_at_20_median']:.3f} "
                    f"{summary['_ratios_at_20']} | OOM launches {summary['oom_launches']}{extra} "
                    f"({time.monotonic() - t0:.0f} s)")
                minutes = lambda v: "-" if v is None else f"{v / 60:.1f} min"  # noqa: E731
                split = summary["_spent"]
                say(f"   {'':<18} simulated wall clock to 0.98: median {minutes(summary['wall_s_to_098_median'])}; to the "
                    f"{'profile' if final else 'pick at 20'}: median {minutes(summary['wall_s_total_median'])}, "
                    f"{summary['loads_total_median']:g} loads"
                    + (" (" + ", ".join(f"{k} {v / 60:.1f} min" for k, v in split.items()) + ")" if split else ""))
            out[name] = row
        say(f"\n{seeds} seeds, horizon {args.horizon} launches, {time.monotonic() - started:.0f} s")
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=2) + "\n")
        if args.json:
            print(json.dumps(out, indent=2))
        elif not args.ablation:
            met = all(r["tuner"]["ratio_at_20_median"] >= TARGET and r["tuner"]["trials_to_098_median"] is not None
                      and r["tuner"]["trials_to_098_median"] <= BUDGET and r["tuner"]["oom_launches"] == 0
                      and r["tuner"]["ratio_at_20_median"] > r["random"]["ratio_at_20_median"] for r in out.values())
            print(f"target (tuner >= {TARGET} x optimum within {BUDGET} trials, no OOM launch, beats random): "
                  f"{'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
