"""Search at GPU scale, on simulated machines (tuner.machine.simulated, the roofline engine).

Pure Python, no llama.cpp: the benchmark's yardstick (the exhaustive optimum) is checked against the
scalar engine and the memory arithmetic; the tuner's seeds fit; its proposals on big spaces are
valid and rarely out of memory; a study resumes.
"""

from __future__ import annotations

import dataclasses
import json
import itertools
import random

import numpy as np
import pytest

from tuner.engine.base import BenchSpec
from tuner.engine.roofline import DEVICES, RooflineEngine
from tuner.engine.settings import Settings
from tuner.errors import SettingsError
from tuner.machine.simulated import SIMULATED
from tuner.model.synthetic import llama_like
from tuner.search import exhaustive
from tuner.search.candidates import WHOLE_ON_HOST, Candidates, accelerator_devices
from tuner.search.space import build_space

GiB = 1 << 30
MiB = 1 << 20


def space_of(sim, **overrides):
    m = sim.machine()
    space = build_space(list(sim.models.values()), devices=accelerator_devices(m), physical_cores=m.physical_cores,
                        logical_cores=m.logical_cores, min_ctx=sim.min_ctx, n_prompt=512)
    return space.narrowed(**overrides) if overrides else space


def bench_of(sim):
    return BenchSpec(n_prompt=512, n_gen=128, depth=sim.depth, repetitions=3)


# -- the yardstick -------------------------------------------------------------------------------


def _block_value(block, space, engine, bench, s, params):
    """The block evaluation of one proposal of the space: (fits, tg), read at its coordinates."""
    L = space.n_layer
    g = s.n_gpu_layers
    strategy = params.get("placement", "none") if s.tensor_overrides else "none"
    k = params.get("placement_layers", 0) if strategy != "none" else 0
    k2 = params.get("n_cpu_moe", 0)
    if len(space.devices) > 1:
        counts = [params[f"layers_on[{d.name}]"] for d in space.devices[:-1]] if g >= 2 else [min(g, 1)] + [0] * (len(space.devices) - 2)
        r = next(i for i, c in enumerate(block.counts.tolist()) if c == counts)
    else:
        r = 0
    ks, k2s = block.axes(strategy)
    j, j2 = list(ks.reshape(-1)).index(k), list(k2s.reshape(-1)).index(k2)
    assert block.valid_for(strategy, s.offload_kqv)[j, j2, r, g], (s, params)
    w = block.weights(strategy)
    fit = block.fits(w, s.offload_kqv, s.type_k, s.flash_attn == "on", s.n_ctx, s.n_ubatch)[j, j2, r, g]
    context = bench.depth + bench.n_gen / 2
    states = exhaustive._states(strategy, L, block.moe)
    base = dict(model_path=s.model_path, flash_attn=s.flash_attn, type_k=s.type_k, type_v=s.type_v, offload_kqv=s.offload_kqv,
                n_threads=s.n_threads, n_threads_batch=s.n_threads)
    times = {}
    for state, extra in states.items():
        x = Settings(**base, **extra)
        times[state] = {d: exhaustive._prefix(t) for d, t in engine.layer_times(x, engine.work(x, 1, context)).items()}
    return bool(fit), float(block.tg(times, strategy)[j, j2, r, g])


@pytest.mark.parametrize("name", list(SIMULATED))
def test_the_yardstick_counts_and_reads_the_space_as_the_space_and_the_engine_do(name):
    """The space's own proposals (random draws of its conditional tree): the block evaluation's fit
    and speed at their coordinates equal estimate()'s and the engine's; and the block counts exactly
    the space's candidates."""
    import optuna

    sim = SIMULATED[name]
    space, bench = space_of(sim), bench_of(sim)
    engine = sim.engine(noise=0.0)
    blocks = {v: exhaustive._Block(space, engine, engine.models[v]) for v in space.variants}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    fits_seen = 0
    for _ in range(60):
        trial = study.ask()
        s = space.suggest(trial)
        fit, tg = _block_value(blocks[s.model_path], space, engine, bench, s, trial.params)
        assert fit == (engine.out_of_memory(engine.memory(s)) is None), s
        assert tg == pytest.approx(engine.speed(s, bench)[1], rel=1e-9), s
        fits_seen += fit
        study.tell(trial, 0.0)
    assert 0 < fits_seen < 60  # both sides of the memory boundary were checked
    count = 0
    for v, block in blocks.items():
        kv_fa = len(space.kv_types) + ("off" in space.flash_attn)
        for strategy in space.placements:
            for kqv in space.offload_kqv:
                count += int(block.valid_for(strategy, kqv).sum()) * kv_fa
    per_cell = len(space.n_ctx) * len(space.n_ubatch) * len(space.threads) * len(space.n_batch)
    assert count * per_cell == space.grid_size()


def _tiny(moe: bool):
    shape = dict(n_layer=3, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536, n_vocab=2048, n_ctx_train=16384, name="tiny")
    if moe:
        shape.update(n_expert=4, n_expert_used=2, n_ff_exp=512)
    return dataclasses.replace(llama_like(**shape), path="tiny-moe.gguf" if moe else "tiny.gguf")


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_optimum_equals_brute_force_on_a_small_space(moe):
    """Every candidate of a small two-GPU space (space.grid()) through the scalar engine: the same
    count, the same number that fit and the same best."""
    from tuner.search.space import Device

    info = _tiny(moe)
    engine = RooflineEngine({info.path: info}, host=DEVICES["ryzen9-7950x"], ram=64 * GiB,
                            accelerators=[("CUDA0", DEVICES["rtx3090"]), ("CUDA1", DEVICES["rtx4060ti16"])],
                            free={"CUDA0": 350 * MiB + 14 * MiB, "CUDA1": 350 * MiB + 9 * MiB}, noise=0.0)
    space = build_space([info], devices=[Device("CUDA0", 1, 1), Device("CUDA1", 1, 1)], physical_cores=16, logical_cores=32,
                        min_ctx=4096, n_prompt=512)
    space = space.narrowed(n_threads=(8, 32), n_ubatch=(128, 512), n_ctx=space.n_ctx[:2])
    bench = BenchSpec(n_prompt=64, n_gen=16, depth=1024)
    best = exhaustive.optimum(space, engine, bench)
    brute, count, fit = -1.0, 0, 0
    for s in space.grid():
        count += 1
        if engine.out_of_memory(engine.memory(s)) is None:
            fit += 1
            brute = max(brute, engine.speed(s, bench)[1])
    assert best.grid_size == count == space.grid_size() and best.feasible == fit and 0 < fit < count
    assert best.value == pytest.approx(brute, rel=1e-9)
    assert engine.speed(best.settings, bench)[1] == pytest.approx(brute, rel=1e-9)
    if moe:
        assert any(s.n_cpu_moe and s.tensor_overrides for s in space.grid())  # placement and n_cpu_moe together


# -- the tuner on GPU-sized spaces ---------------------------------------------------------------


def candidates_of(sim):
    m = sim.machine()
    return Candidates(sim.models, accelerator_devices(m), m.ram_available, 512 * MiB)


@pytest.mark.parametrize("name", list(SIMULATED))
def test_seeds_fit_and_are_what_the_study_enqueues(name):
    import optuna

    sim = SIMULATED[name]
    space, bench = space_of(sim), bench_of(sim)
    candidates = candidates_of(sim)
    seeds = candidates.seeds(space, sim.machine().physical_cores, depth=bench.depth)
    *planned, defaults = seeds
    # every seed but llama.cpp's defaults is predicted to fit (the defaults are not launched unless they do)
    assert all(candidates.fits(s) for s in planned)
    assert defaults.n_gpu_layers == space.n_layer + 1 and defaults.type_k == "f16"
    # one or more per variant, offloading everything or as many layers as fit, and the CPU alone
    assert {s.model_path for s in planned} == set(space.variants)
    assert any(s.n_gpu_layers == 0 for s in planned)
    for s in planned:
        if s.n_gpu_layers:
            more = dataclasses.replace(s, n_gpu_layers=s.n_gpu_layers + 1,
                                       tensor_split=None if s.tensor_split is None else (*s.tensor_split[:-1], s.tensor_split[-1] + 1))
            whole = space.n_layer + 1 - s.n_gpu_layers  # layers wholly on the host
            placed = bool(s.tensor_overrides or s.n_cpu_moe)  # a placement seed may keep 1-2 first layers there
            assert whole == 0 or (placed and whole in WHOLE_ON_HOST) or not candidates.fits(more), s
    # the parameters the study enqueues give back the same candidate
    for s in seeds:
        assert space.suggest(optuna.trial.FixedTrial(space.params_for(s))) == s
    # and on the (simulated) machine they load
    engine = sim.engine(noise=0.0)
    assert all(engine.run(s, bench).ok for s in planned)


def test_tune_on_a_simulated_gpu_machine(tuner_home):
    """The real tune loop on a 24 GB GPU with a 70B model: nothing predicted not to fit is launched,
    nothing launched runs out of memory, and the winner is the best measured, re-measured."""
    import optuna

    from tuner.search.study import Tuner

    sim = SIMULATED["24gb-70b"]
    engine = sim.engine(seed=3)
    events = []
    tuner = Tuner(sim.main, variants=sim.variants, infos=sim.models, machine=sim.machine(), engine=engine, trials=10,
                  min_ctx=sim.min_ctx, depth=sim.depth, seed=3, on_event=events.append,
                  storage=optuna.storages.InMemoryStorage())
    result = tuner.run()
    launched = [Settings.from_dict(e["settings"]) for e in events if e["kind"] == "launch"]
    assert len(launched) == 10 and result.counts == {"run": 10, "pruned": result.counts["pruned"], "oom": 0, "failed": 0}
    for s in launched:
        assert tuner.candidates.fits(s) and engine.out_of_memory(engine.memory(s)) is None
    # the seeds go first: the most offloaded candidates of each variant (sized again once the first
    # trial calibrated the margin), one file's together (thrift.group_by_model)
    assert {s.model_path for s in launched[:8]} == set(sim.models)
    firsts = [s.model_path for i, s in enumerate(launched[:8]) if i == 0 or launched[i - 1].model_path != s.model_path]
    assert len(firsts) == len(set(firsts))
    # re-measured, unless no other candidate was within noise of the leader (then said so)
    skipped = any(e["kind"] == "remeasure_skipped" for e in events)
    assert (result.best["remeasured"] or skipped) and result.profile.settings.n_gpu_layers > 0
    assert Settings.from_dict(result.best["settings"]) in launched


def test_the_margin_follows_what_trials_used_beyond_the_arithmetic(tuner_home, tmp_path):
    """No --vram-margin: 512 MiB until the first trial that ran says what llama.cpp's process used beyond
    the arithmetic (the simulation's CUDA context, 350 MiB); then that and 32 MiB. The seeds are sized
    again, what is launched uses the memory the default margin kept back, and nothing runs out of memory.
    A given margin is kept as given. A resumed study starts from what its trials measured."""
    from tuner.engine.roofline import CONTEXT_OVERHEAD
    from tuner.search.candidates import CALIBRATION_SLACK
    from tuner.search.study import Tuner

    sim = SIMULATED["24gb-70b"]
    free = {d.name: d.free for d in accelerator_devices(sim.machine())}
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    common = dict(variants=sim.variants, infos=sim.models, machine=sim.machine(), min_ctx=sim.min_ctx, depth=sim.depth, seed=1)

    events = []
    engine = sim.engine(seed=1)
    tuner = Tuner(sim.main, engine=engine, trials=8, on_event=events.append, storage=storage, **common)
    result = tuner.run()
    margins = [e for e in events if e["kind"] == "margin"]
    assert [(e["device"], e["was"], e["margin"]) for e in margins] == [("CUDA0", 512 * MiB, CONTEXT_OVERHEAD + CALIBRATION_SLACK)]
    calibrated_at = margins[0]["number"]
    launched = [(e["number"], Settings.from_dict(e["settings"])) for e in events if e["kind"] == "launch"]
    assert calibrated_at == launched[0][0]  # the first trial that ran
    after = [s for number, s in launched if number > calibrated_at]
    need = [tuner.candidates.estimate(s).devices["CUDA0"].total for s in after]
    assert all(n <= free["CUDA0"] - (CONTEXT_OVERHEAD + CALIBRATION_SLACK) for n in need)
    assert any(n > free["CUDA0"] - 512 * MiB for n in need)  # what the default margin had kept back
    assert result.counts["oom"] == 0 and all(engine.out_of_memory(engine.memory(s)) is None for _, s in launched)
    # the seeds sized with 512 MiB and still queued were dropped: not candidates, so no event, no launch,
    # and not counted among the candidates not launched
    import optuna

    trials = optuna.load_study(study_name=result.study_name, storage=storage).get_trials(deepcopy=False)
    assert any(t.user_attrs.get("superseded") for t in trials)
    assert not [e for e in events if e["kind"] == "pruned" and "seed sized before" in e.get("reason", "")]
    assert result.counts["pruned"] == len([e for e in events if e["kind"] in ("pruned", "invalid")])
    assert result.counts["run"] == 8

    # resumed: the margin is the calibrated one from the start
    again = []
    resumed = Tuner(sim.main, engine=sim.engine(seed=2), trials=10, on_event=again.append, storage=storage, **common)
    resumed.run()
    assert not [e for e in again if e["kind"] == "margin"]
    assert resumed.candidates.margin_for("CUDA0") == CONTEXT_OVERHEAD + CALIBRATION_SLACK

    # a margin given is kept as given
    fixed_events = []
    fixed = Tuner(sim.main, engine=sim.engine(seed=1), trials=6, on_event=fixed_events.append, vram_margin=512 * MiB,
                  storage=f"sqlite:///{tmp_path / 'fixed.db'}", **common)
    fixed.run()
    assert not [e for e in fixed_events if e["kind"] == "margin"]
    for e in fixed_events:
        if e["kind"] == "launch":
            assert fixed.candidates.estimate(Settings.from_dict(e["settings"])).devices["CUDA0"].total <= free["CUDA0"] - 512 * MiB


class _StopAfter:
    """An engine that is interrupted (Ctrl-C) when it starts its n+1-th trial."""

    def __init__(self, engine, n):
        self.engine, self.n, self.runs = engine, n, 0

    def run(self, settings, bench, *, trial_id=None):
        if self.runs >= self.n:
            raise KeyboardInterrupt
        self.runs += 1
        return self.engine.run(settings, bench, trial_id=trial_id)

    def close(self):
        pass


def test_an_interrupted_study_resumes_without_repeating_trials(tuner_home, tmp_path):
    from tuner.search.study import Tuner

    sim = SIMULATED["2gpu-32b"]
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    common = dict(variants=sim.variants, infos=sim.models, machine=sim.machine(), trials=9, min_ctx=sim.min_ctx,
                  depth=sim.depth, storage=storage, seed=5)
    first_events, second_events = [], []
    first = Tuner(sim.main, engine=_StopAfter(sim.engine(seed=1), 4), on_event=first_events.append, **common).run()
    assert first.interrupted and first.counts["run"] == 4 and first.profile_path.exists()
    second_engine = sim.engine(seed=2)
    second = Tuner(sim.main, engine=second_engine, on_event=second_events.append, **common).run()
    assert not second.interrupted and second.study_name == first.study_name
    start = next(e for e in second_events if e["kind"] == "start")
    assert start["resumed"] and start["done"] >= 4
    finished = {e["number"] for e in first_events if e["kind"] == "result"}  # the fifth launch was interrupted
    before = {json.dumps(e["settings"], sort_keys=True) for e in first_events if e["kind"] == "launch" and e["number"] in finished}
    assert len(before) == 4
    after = [json.dumps(e["settings"], sort_keys=True) for e in second_events if e["kind"] == "launch"]
    assert len(after) == 9 - 4 and not set(after) & before  # completed trials are not run again
    assert second.counts["run"] == 9 and second.counts["oom"] == 0


@pytest.mark.parametrize("name", list(SIMULATED))
def test_a_thousand_draws_of_a_gpu_sized_space_are_valid_and_lowered_into_memory(name):
    """1000 draws of each simulated machine's conditional space (10^6-10^8 candidates): every one a
    valid candidate within what the space promises (tests/test_space.py's conditions); the first
    hundred through the tune loop's repair: what does not fit is lowered to a candidate that does,
    with the same choices."""
    import optuna

    from .test_space import _conditions_hold

    sim = SIMULATED[name]
    space = space_of(sim)
    candidates = candidates_of(sim)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=7))
    lowered = kept = 0
    for i in range(1000):
        trial = study.ask()
        s = space.suggest(trial)
        _conditions_hold(space, s, trial.params)
        if i < 100:
            fixed = candidates.repair(s, space, trial.params)
            if fixed is s:
                kept += 1
                assert candidates.fits(s) or not s.n_gpu_layers or not candidates.fits(
                    dataclasses.replace(s, n_gpu_layers=0, tensor_split=None, tensor_overrides=(), n_cpu_moe=0))
            else:
                lowered += 1
                assert candidates.fits(fixed) and 0 < fixed.n_gpu_layers < s.n_gpu_layers
                assert (fixed.model_path, fixed.n_ctx, fixed.type_k, fixed.flash_attn, fixed.n_ubatch) == \
                       (s.model_path, s.n_ctx, s.type_k, s.flash_attn, s.n_ubatch)
                _conditions_hold(space, fixed, {})
        study.tell(trial, float(i % 11))
    assert lowered >= 5 and kept >= 5  # both kinds were met on each machine


def test_the_benchmark_prints_exactly_its_json(tmp_path):
    """benchmarks/search_at_scale.py --json on one machine, one seed: the keys the issue names, and
    numbers that mean what they say (the tuner's winner fits, so it never beats the optimum)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "search_at_scale.py"
    out = subprocess.run([sys.executable, str(script), "--json", "--seeds", "1", "--horizon", "4", "--machines", "16gb-moe"],
                         capture_output=True, text=True, timeout=600, check=True)
    data = json.loads(out.stdout)
    assert list(data) == ["16gb-moe"]
    row = data["16gb-moe"]
    assert set(row) == {"optimum", "grid_size", "tuner", "random", "bisect_tpe"}
    assert row["grid_size"] == space_of(SIMULATED["16gb-moe"]).grid_size() and row["optimum"] > 0
    for strategy in ("tuner", "random", "bisect_tpe"):
        assert set(row[strategy]) == {"trials_to_098_median", "trials_to_098_worst", "ratio_at_20_median", "oom_launches",
                                      "wall_s_to_098_median", "wall_s_total_median", "loads_total_median"}
        assert 0 <= row[strategy]["ratio_at_20_median"] <= 1
        # the simulated wall clock: loads and repetitions of a 106B model take minutes, never nothing
        assert row[strategy]["wall_s_total_median"] > 60 and row[strategy]["loads_total_median"] >= 1
        reached = row[strategy]["wall_s_to_098_median"]
        assert reached is None or 0 < reached <= row[strategy]["wall_s_total_median"] or strategy == "tuner"
    assert row["tuner"]["oom_launches"] == 0
    bad = subprocess.run([sys.executable, str(script), "--machines", "nope"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unknown machine" in bad.stderr
