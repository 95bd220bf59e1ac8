"""Time to a trustworthy profile (issue 24): what a trial costs, and the rules that spend less of it.

The cost model and the search rules run on the roofline engine (simulation); the worker's side of
them (stopping repetitions early, the depth filled once, the load's progress lines) on the real
python engine with a small real model.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import optuna
import pytest

from tuner.engine.base import BenchSpec, StopRule
from tuner.engine.roofline import DEVICES, PAGE_CACHE_BANDWIDTH, STORAGE, RooflineEngine
from tuner.engine.settings import Settings
from tuner.machine.simulated import SIMULATED, model
from tuner.search.remeasure import Contender
from tuner.search.thrift import BEHIND, NEAR, stop_rule, within_noise
from tuner.search.timing import TimeLedger, describe

GiB = 1 << 30
BENCH = BenchSpec(n_prompt=512, n_gen=128, depth=4096, repetitions=3)


def test_a_stop_rule_cuts_what_is_clearly_behind_and_keeps_the_leader_measuring():
    rule = stop_rule("tg", BENCH, leader=10.0)
    assert rule is not None and rule.below == pytest.approx(10.0 * (1 - BEHIND))
    assert rule.enough([], [5.0])  # far behind after one repetition
    assert not rule.enough([], [9.0])  # near the leader: keeps going
    assert not rule.enough([], [9.0, 9.5])  # near, and its repetitions disagree
    assert rule.enough([], [9.0, 9.05])  # its repetitions agree, below the leader: its rank is settled
    assert not rule.enough([], [11.0, 11.01])  # a new leader runs every repetition
    # mixed: a repetition's score is one request's throughput
    mixed = StopRule("mixed", below=100.0, leader=200.0, n_prompt=512, n_gen=128)
    assert mixed.score(1000.0, 10.0) == pytest.approx(640 / (0.512 + 12.8))
    assert mixed.enough([1000.0], [10.0]) and not mixed.enough([1000.0], [100.0])
    assert StopRule.from_dict(rule.to_dict()) == rule
    # nothing to compare with, a single repetition, an objective it does not know: no rule
    assert stop_rule("tg", BENCH, None) is None
    assert stop_rule("tg", BenchSpec(repetitions=1), 10.0) is None
    assert stop_rule("users", BENCH, 10.0) is None


def _contender(number: int, value: float, low: float, high: float) -> Contender:
    tg = {"median": value, "ci_low": low, "ci_high": high, "samples": [low, value, high]}
    return Contender(number=number, settings=Settings(model_path="m.gguf"), pp=None, tg=tg, value=value)


def test_only_candidates_within_noise_of_the_leader_are_measured_again():
    leader = _contender(1, 10.0, 9.8, 10.2)
    near = _contender(2, 10.0 * (1 - NEAR / 2), 9.4, 9.6)
    overlapping = _contender(3, 8.5, 8.0, 9.9)
    behind = _contender(4, 7.0, 6.9, 7.1)
    assert [c.number for c in within_noise([leader, near, overlapping, behind], "tg")] == [1, 2, 3]
    assert [c.number for c in within_noise([leader, behind], "tg")] == [1]  # clear: nothing to re-measure
    assert within_noise([], "tg") == []


def test_the_time_ledger_splits_the_wall_clock():
    now = [100.0]
    ledger = TimeLedger(clock=lambda: now[0])

    class Result:
        wall_s, load_s = 10.0, 4.0

    ledger.trial(Result())
    with ledger.part("remeasure"):
        now[0] += 5.0
    with ledger.part("quality"):
        now[0] += 2.0
    now[0] += 20.0  # ten seconds of trials (said by the results) and ten of the tuner's own
    split = ledger.to_dict()
    assert split == {"load_s": 4.0, "measure_s": 6.0, "quality_s": 2.0, "remeasure_s": 5.0, "tuner_s": 10.0, "total_s": 27.0}
    assert describe(split).startswith("time: 27.0 s: loading 4.0 s (15%), measuring 6.0 s")


def _engine(storage: str = "nvme", reuse_model: bool = True, ram: int = 60 * GiB) -> tuple[RooflineEngine, str]:
    info = model("Llama-3.1-70B", "Q4_K_M")
    return RooflineEngine({info.path: info}, host=DEVICES["ryzen9-7950x"], ram=ram, accelerators=[("CUDA0", DEVICES["rtx3090"])],
                          noise=0.0, storage=storage, reuse_model=reuse_model), info.path


def test_a_trial_costs_its_load_from_disk_then_from_the_page_cache_and_nothing_while_the_model_stays():
    engine, path = _engine()
    size = engine.models[path].file_size
    a = Settings(model_path=path, n_gpu_layers=30, n_ctx=8192, flash_attn="on", n_threads=16)
    first = engine.run(a, BENCH)
    assert first.ok and first.load_s > size / STORAGE["nvme"].bandwidth  # read from the disk
    again = engine.run(a, BENCH)  # the same model-level settings: the model stays loaded
    assert again.reused_model and again.load_s == 0 and again.wall_s == pytest.approx(first.wall_s - first.load_s)
    assert engine.run(a.replace(n_threads=8, flash_attn="off"), BENCH).reused_model  # context-level changes ride on it
    other = engine.run(a.replace(n_gpu_layers=20), BENCH)  # a new model-level setting: loaded again, from the page cache
    assert not other.reused_model and size / PAGE_CACHE_BANDWIDTH < other.load_s < first.load_s
    assert engine.loads == 2
    assert set(engine.spent) == {"load", "context", "warmup", "measure"} and engine.spent["measure"] > engine.spent["load"]
    # a file larger than the RAM left is read from the disk every time; a hard disk is slower than an NVMe drive
    small, _ = _engine("hdd", ram=30 * GiB)
    loads = [small.run(a.replace(n_gpu_layers=n), BENCH).load_s for n in (30, 20)]
    assert loads[0] == pytest.approx(loads[1], rel=0.01) and loads[0] > size / STORAGE["hdd"].bandwidth
    # llama-bench loads for every trial
    bench_like, _ = _engine(reuse_model=False)
    bench_like.run(a, BENCH)
    assert bench_like.run(a.replace(n_threads=8), BENCH).load_s > 0 and bench_like.loads == 2
    # a weight buffer that does not fit fails before any data is read
    oom = engine.run(a.replace(n_gpu_layers=81), BENCH)
    assert oom.outcome.value == "oom" and 0 < oom.load_s < size / PAGE_CACHE_BANDWIDTH


def test_a_trial_behind_the_leader_stops_after_one_repetition():
    engine, path = _engine()
    s = Settings(model_path=path, n_gpu_layers=30, n_ctx=8192, flash_attn="on", n_threads=16)
    full = engine.run(s, BENCH)
    cut = engine.run(s, BENCH, stop=stop_rule("tg", BENCH, leader=full.tg.median * 2))
    assert len(full.tg.samples) == 3 and len(cut.tg.samples) == 1 and cut.wall_s < full.wall_s


def test_a_tune_says_where_its_time_went_and_spends_less_on_what_cannot_win():
    sim = SIMULATED["24gb-70b"]
    engine = sim.engine(seed=1)
    events: list[dict] = []
    from tuner.search.study import Tuner

    tuner = Tuner(sim.main, variants=sim.variants, infos=sim.models, machine=sim.machine(), engine=engine, trials=8,
                  min_ctx=sim.min_ctx, depth=sim.depth, seed=1, on_event=events.append, storage=optuna.storages.InMemoryStorage(),
                  study_name="thrift", out=Path(tempfile.mkdtemp()) / "profile.json")
    result = tuner.run()
    split = result.to_dict()["time"]
    assert set(split) == {"load_s", "measure_s", "quality_s", "remeasure_s", "tuner_s", "total_s"}
    # the roofline engine reports simulated seconds per trial: the trials' load and measure add up to its clock
    trials = [e for e in events if e["kind"] == "result"]
    assert len(trials) == 8
    assert split["load_s"] + split["measure_s"] <= engine.clock + 1e-6 and split["load_s"] > 0
    done = next(e for e in events if e["kind"] == "done")
    assert done["time"] == split
    # some trials were clearly behind the leader and stopped repeating
    measured = [t for t in tuner.store.study(tuner.study_name, None).get_trials() if "tg" in t.user_attrs]
    assert any(len(t.user_attrs["tg"]["samples"]) < 3 for t in measured)
    assert any(e["kind"] in ("remeasure", "remeasure_skipped") for e in events)


def test_the_worker_stops_early_reuses_the_depth_and_says_how_a_load_goes(models, monkeypatch):
    """The python engine, for real: a StopRule ends the repetitions, the depth is filled once per
    context (the speeds stay those of a full cache), and a load sends progress lines of bytes read."""
    from tuner.engine.python import TrialRunner

    monkeypatch.setenv("OFFLOAD_TUNER_LOAD_PROGRESS_AFTER_S", "0")
    path = models["q8_0"]
    s = Settings(model_path=str(path), n_ctx=512, n_threads=2)
    bench = BenchSpec(n_prompt=32, n_gen=8, depth=128, repetitions=3)
    lines: list[dict] = []
    with TrialRunner(timeout_s=120) as engine:
        engine.on_load = lines.append
        full = engine.run(s, bench)
        cut = engine.run(s, bench, stop=StopRule("tg", below=float("inf"), leader=float("inf")))
    assert full.ok and cut.ok and cut.reused_model
    assert len(full.tg.samples) == 3 and len(full.pp.samples) == 3
    assert len(cut.tg.samples) == 1 and len(cut.pp.samples) == 1
    assert lines, "a load sends progress lines when told to from its first second"
    last = lines[-1]
    assert last["total"] == path.stat().st_size and 0 < last["bytes"] <= last["total"] and 0 < last["load"] <= 1


def test_seeds_of_one_file_and_one_load_run_together_the_first_staying_first():
    a = Settings(model_path="a.gguf", n_gpu_layers=10)
    b = Settings(model_path="b.gguf", n_gpu_layers=10)
    seeds = [a, b, a.replace(n_gpu_layers=5), a.replace(n_threads=4), b.replace(n_ctx=8192)]
    from tuner.search.thrift import group_by_model

    assert group_by_model(seeds) == [a, a.replace(n_threads=4), a.replace(n_gpu_layers=5), b, b.replace(n_ctx=8192)]


def test_tune_json_has_the_time_split(models, tmp_path):
    """A real tune (python engine, a small model): ``--json`` carries ``time``, its parts add up to
    no more than its total, and the trials' time is in load and measure."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "tuner", "tune", str(models["q8_0"]), "--trials", "2", "--min-ctx", "512",
                           "--n-prompt", "32", "--n-gen", "8", "--out", str(tmp_path / "p.json"), "--json"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    split = json.loads(proc.stdout)["time"]
    assert set(split) == {"load_s", "measure_s", "quality_s", "remeasure_s", "tuner_s", "total_s"}
    parts = split["load_s"] + split["measure_s"] + split["quality_s"] + split["remeasure_s"] + split["tuner_s"]
    assert parts == pytest.approx(split["total_s"], abs=0.01)
    assert split["load_s"] > 0 and split["measure_s"] > 0 and split["quality_s"] == 0
