"""The tune loop's search logic, with the scripted engine (tuner.engine.fake) standing in for llama.cpp.

The real engine is exercised by test_tune_real.py and the runner's own tests.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from tuner.model.estimate import estimate
from tuner.engine.fake import ScriptedRunner
from tuner.machine.probe import LlamaBuild, Machine
from tuner.model.inspect import inspect
from tuner.engine.outcome import Outcome
from tuner.engine.settings import Settings
from tuner.profile.document import SCHEMA_VERSION, Profile
from tuner.profile.store import read_profile
from tuner.search.space import Device, build_space
from tuner.search.study import Tuner, tune

MiB = 1 << 20
RPC = "RPC0[127.0.0.1:50052]"


def machine(rpc_free: int | None = None, cores: int = 4) -> Machine:
    rpc = ({"endpoint": "127.0.0.1:50052", "name": "RPC0", "description": "", "memory_free": rpc_free, "memory_total": rpc_free},) if rpc_free else ()
    return Machine(cpu_model="Test CPU", physical_cores=cores, logical_cores=cores, ram_total=16 << 30, ram_available=12 << 30,
                   gpu_status="no GPU", llama=LlamaBuild(llama_cpp_python="0.3.36", gpu_offload=True, rpc=True, backends=("cpu", "rpc")),
                   rpc_devices=rpc)


def kwargs(**extra):
    base = dict(min_ctx=512, n_prompt=64, n_gen=16, repetitions=2, final_repetitions=3, vram_margin=0)
    base.update(extra)
    return base


def test_space_without_a_gpu_leaves_offload_out_and_says_why(models):
    info = inspect(models["q8_0"])
    space = build_space([info], devices=(), physical_cores=4, logical_cores=8, min_ctx=512)
    dims = space.dimensions()
    assert "n_gpu_layers" not in dims and "placement" not in dims
    assert "no GPU" in space.excluded["n_gpu_layers"]
    assert space.threads == (2, 4, 8)
    assert dims["type_k"] == ["f16", "q8_0", "q4_0"] and dims["flash_attn"] == ["on", "off"]
    assert all(c >= 512 for c in space.n_ctx)
    assert "n_batch" in space.excluded  # a 512-token prompt fits in one batch
    assert "(left out) n_gpu_layers" in space.describe()


def test_space_with_devices(models):
    info = inspect(models["q8_0"])
    devices = (Device("A", 1 << 30, 1 << 30), Device("B", 1 << 30, 1 << 30))
    space = build_space([info], devices=devices, physical_cores=2, logical_cores=2, min_ctx=512)
    dims = space.dimensions()
    assert dims["n_gpu_layers"] == (0, info.n_layer + 1)
    assert "layers_on[A]" in dims and "layers_on[B]" not in dims  # the last device takes the rest
    assert "experts_cpu" not in dims["placement"] and "dense model" in space.excluded["placement: experts_cpu"]
    moe = build_space([inspect(models["moe"])], devices=devices[:1], min_ctx=512)
    # n_cpu_moe keeps the experts on the CPU where the engine can set it; the regex placement stands in elsewhere
    assert "experts_cpu" not in moe.dimensions()["placement"] and moe.dimensions()["n_cpu_moe"] == (0, 3)
    assert "one device" in moe.excluded["tensor_split"]
    fallback = build_space([inspect(models["moe"])], devices=devices[:1], min_ctx=512, supported={"n_gpu_layers"})
    assert "experts_cpu" in fallback.dimensions()["placement"] and "n_cpu_moe" not in fallback.dimensions()


def test_split_counts_and_placements(models):
    info = inspect(models["q8_0"])
    space = build_space([info], devices=(Device("A", 1, 1), Device("B", 1, 1)), min_ctx=512)
    assert space.split_from_counts(5, [2]) == (2.0, 3.0)
    with pytest.raises(ValueError, match="add up to more"):
        space.split_from_counts(3, [4])
    s = space.settings(variant=info.path, n_gpu_layers=5, n_ctx=512, kv="f16", flash_attn="on", threads=1,
                       n_ubatch=512, n_batch=512, placement="ffn_cpu", placement_layers=2)
    assert s.tensor_overrides == (r"^blk\.(0|1)\.ffn_(gate|up|down)(_exps)?\.weight$",)


def test_no_gpu_tune_writes_a_valid_profile(models, tuner_home):
    infos = {str(p): inspect(p) for p in (models["q8_0"], models["q4_k_m"])}
    engine = ScriptedRunner(infos)
    result = tune(str(models["q8_0"]), variants=[str(models["q4_k_m"])], trials=6, machine=machine(), engine=engine, **kwargs())
    # six trials, then the three leading candidates measured again in three alternating rounds
    assert len(engine.launched) == 6 + 3 * 3
    finals = [json.dumps(s.to_dict(), sort_keys=True) for s in engine.launched[6:]]
    assert finals[:3] == finals[3:6] == finals[6:] and len(set(finals[:3])) == 3
    assert len({json.dumps(s.to_dict(), sort_keys=True) for s in engine.launched[:6]}) == 6
    assert result.best["settings"] in [s.to_dict() for s in engine.launched[6:]]
    assert result.best["remeasured"] is True
    assert result.profile_path.parent == tuner_home / "profiles"
    data = json.loads(result.profile_path.read_text())
    profile = Profile.from_dict(data)  # validates against the schema
    assert read_profile(result.profile_path) == profile
    assert data["schema_version"] == SCHEMA_VERSION and data["objective"] == "tg" and data["min_ctx"] == 512
    assert data["quality"] is None and data["quality_budget"] is None  # the scripted engine scores no text
    assert data["engine"] is None  # the scripted engine measures nothing a profile could name
    assert data["trials"]["run"] == 6 and data["trials"]["oom"] == 0
    assert data["measured"]["tg"]["median"] > 0 and len(data["measured"]["tg"]["samples"]) == 3
    assert data["model"]["header_hash"] == infos[data["settings"]["model_path"]].header_hash
    assert data["machine"]["cpu_model"] == "Test CPU"
    assert data["settings"]["n_gpu_layers"] == 0
    # the fake's fastest: most threads, not q4_0
    assert data["settings"]["n_threads"] == 4 and data["settings"]["type_k"] != "q4_0"


def test_rejects_a_variant_of_another_model(models, tmp_path):
    engine = ScriptedRunner({str(models["q8_0"]): inspect(models["q8_0"])})
    tuner = Tuner(str(models["q8_0"]), variants=[str(models["moe"]), str(tmp_path / "missing.gguf")], trials=1,
                  machine=machine(), engine=engine, **kwargs())
    assert "not the same model: n_layer differs" in tuner.rejected[str(models["moe"])]
    assert "no such file" in tuner.rejected[str(tmp_path / "missing.gguf")]


def test_candidates_predicted_not_to_fit_are_not_launched(models):
    info = inspect(models["q8_0"])
    # a device with room for about two layers' worth of the model at the smallest settings
    need = {ngl: estimate(info, Settings(model_path=info.path, n_gpu_layers=ngl, n_ctx=512, n_ubatch=128, type_k="q4_0",
                                         type_v="q4_0", flash_attn="on"), devices=[RPC]).devices[RPC].total for ngl in range(6)}
    free = need[2] + 1
    engine = ScriptedRunner({str(models["q8_0"]): info}, devices=(RPC,))
    events = []
    tuner = Tuner(str(models["q8_0"]), trials=12, machine=machine(rpc_free=free), engine=engine,
                  rpc_servers=("127.0.0.1:50052",), on_event=events.append, **kwargs())
    tuner.run()
    for s in engine.launched:
        est = tuner.candidates.estimate(s)
        assert est.devices[RPC].total <= free
    # proposals with more layers than fit were lowered to the most that fit, their other choices kept
    repaired = [e for e in events if e["kind"] == "repaired"]
    assert repaired
    for e in repaired:
        proposed, lowered = Settings.from_dict(e["proposed"]), Settings.from_dict(e["settings"])
        assert tuner.candidates.check(proposed, tuner.candidates.estimate(proposed)).startswith("predicted not to fit")
        assert lowered.n_gpu_layers < proposed.n_gpu_layers and tuner.candidates.fits(lowered)
        # every other choice kept (what counts in offloaded layers, like a placement's, may shrink with them)
        layerwise = dict(n_gpu_layers=0, tensor_split=None, tensor_overrides=(), n_cpu_moe=0)
        if lowered.n_gpu_layers <= 1:  # no repeating layer offloaded: the KV cache's place is not asked
            layerwise["offload_kqv"] = True
        assert dataclasses.replace(lowered, **layerwise) == dataclasses.replace(proposed, **layerwise)
        if not lowered.tensor_overrides:
            assert not tuner.candidates.fits(dataclasses.replace(lowered, n_gpu_layers=lowered.n_gpu_layers + 1))
    # what could not be lowered into memory was skipped, with the reason
    pruned = [e for e in events if e["kind"] == "pruned"]
    assert all("predicted not to fit" in e["reason"] or "learned" in e["reason"] for e in pruned)


def test_out_of_memory_is_learned_and_not_repeated(models):
    info = inspect(models["q8_0"])
    # The device reports plenty of memory (like an RPC server over host RAM) but holds only ~3 layers.
    cap = estimate(info, Settings(model_path=info.path, n_gpu_layers=3, n_ctx=512, n_ubatch=512, flash_attn="on"),
                   devices=[RPC]).devices[RPC].total
    engine = ScriptedRunner({str(models["q8_0"]): info}, devices=(RPC,), capacity={RPC: cap})
    events = []
    tuner = Tuner(str(models["q8_0"]), trials=15, machine=machine(rpc_free=8 << 30), engine=engine,
                  rpc_servers=("127.0.0.1:50052",), on_event=events.append, **kwargs())
    result = tuner.run()
    ooms = [s for s in engine.launched if tuner.candidates.estimate(s).devices[RPC].total > cap]
    # after the first OOM nothing needing as much or more on that device is launched
    first_oom = next(i for i, s in enumerate(engine.launched) if tuner.candidates.estimate(s).devices[RPC].total > cap)
    threshold = tuner.candidates.estimate(engine.launched[first_oom]).devices[RPC].total
    for s in engine.launched[first_oom + 1:]:
        assert tuner.candidates.estimate(s).devices[RPC].total < threshold
    # every later candidate at or past the boundary was pruned with the reason, not launched
    for e in events:
        if e["kind"] == "pruned" and e["reason"].startswith("learned"):
            assert "ran out of memory" in e["reason"]
    # OOM is a constraint, not a score: no trial value is 0, and the winner fits
    assert result.counts["oom"] == len(ooms) >= 1
    assert tuner.candidates.estimate(tuner.space.settings(**_from(result.best["settings"], tuner))).devices[RPC].total <= cap


def test_learned_thresholds_block_bigger_candidates(models):
    info = inspect(models["q8_0"])
    engine = ScriptedRunner({str(models["q8_0"]): info}, devices=(RPC,))
    tuner = Tuner(str(models["q8_0"]), trials=1, machine=machine(rpc_free=8 << 30), engine=engine,
                  rpc_servers=("127.0.0.1:50052",), **kwargs())
    small, big = (tuner.space.settings(variant=info.path, n_gpu_layers=n, n_ctx=512, kv="f16", flash_attn="on", threads=4,
                                       n_ubatch=512, n_batch=512) for n in (2, 4))
    threshold = tuner.candidates.estimate(big).devices[RPC].total
    tuner.candidates.remember_oom(RPC, threshold)
    assert tuner.candidates.check(small, tuner.candidates.estimate(small)) is None
    reason = tuner.candidates.check(big, tuner.candidates.estimate(big))
    assert reason.startswith(f"learned: a placement needing {threshold / MiB:.0f} MiB on {RPC} ran out of memory")


def _from(settings: dict, tuner: Tuner) -> dict:
    return dict(variant=settings["model_path"], n_gpu_layers=settings["n_gpu_layers"], n_ctx=settings["n_ctx"],
                kv=settings["type_k"], flash_attn=settings["flash_attn"], threads=settings["n_threads"],
                n_ubatch=settings["n_ubatch"], n_batch=settings["n_batch"], offload_kqv=settings["offload_kqv"])


def test_interrupted_study_resumes_without_repeating_trials(models, tuner_home):
    infos = {str(models["q8_0"]): inspect(models["q8_0"])}
    first = ScriptedRunner(infos, interrupt_after=3)
    partial = tune(str(models["q8_0"]), trials=8, machine=machine(), engine=first, **kwargs())
    assert partial.interrupted and len(first.launched) == 3
    # Ctrl-C still wrote the best profile so far
    assert partial.profile_path.exists() and partial.counts["run"] == 3
    second = ScriptedRunner(infos)
    resumed = tune(str(models["q8_0"]), trials=8, machine=machine(), engine=second, **kwargs())
    assert not resumed.interrupted
    keys = lambda runs: {json.dumps(s.to_dict(), sort_keys=True) for s in runs}  # noqa: E731
    completed_first = keys(first.launched)  # the fourth launch was interrupted: it may run again
    trial_runs = second.launched[: 8 - 3]  # then come the winner's (and maybe the runner-up's) re-measure
    assert not (keys(trial_runs) & completed_first)
    assert resumed.counts["run"] == 8


def test_failures_are_recorded_and_never_scored(models):
    infos = {str(models["q8_0"]): inspect(models["q8_0"])}
    engine = ScriptedRunner(infos, fail=lambda s: Outcome.CRASH if s.type_k == "q4_0" else None)
    events = []
    result = tune(str(models["q8_0"]), trials=8, machine=machine(), engine=engine, on_event=events.append, **kwargs())
    assert result.best["settings"]["type_k"] != "q4_0"
    # the crash is a clue (tuner.search.crashes): its check runs are not trials; once the quantized
    # cache is found to crash, no q4_0 cache is launched again
    checks = sum(1 for e in events if e["kind"] == "crash_check")
    learned = [e for e in events if e["kind"] == "crash_learned"]
    assert learned and learned[0]["off"] == ["kv_cache_type"]
    assert result.counts["failed"] == 1
    assert result.counts["failed"] + checks - 1 == sum(1 for s in engine.launched if s.type_k == "q4_0")


def test_nothing_runs_is_a_clear_error(models):
    from tuner.errors import StudyError

    infos = {str(models["q8_0"]): inspect(models["q8_0"])}
    engine = ScriptedRunner(infos, fail=lambda s: Outcome.TIMEOUT)
    with pytest.raises(StudyError, match="no candidate ran successfully"):
        tune(str(models["q8_0"]), trials=3, machine=machine(), engine=engine, **kwargs())


def test_a_study_resumes_after_free_memory_changed_and_checks_again_what_did_not_fit(models, tuner_home):
    """Another app took RAM and VRAM during the first run and gave them back before the second: the
    study is the same one (free memory is not part of its name), and what the first run skipped as
    "predicted not to fit" is checked again with this run's memory, not answered from the record."""
    infos = {str(models["q8_0"]): inspect(models["q8_0"])}

    def busy(ram: int, rpc_free: int) -> Machine:
        rpc = ({"endpoint": "127.0.0.1:50052", "name": "RPC0", "description": "", "memory_free": rpc_free,
                "memory_total": 8 << 30},)
        return dataclasses.replace(machine(), ram_available=ram, rpc_devices=rpc)

    events_first, events_second = [], []
    first = Tuner(str(models["q8_0"]), trials=4, machine=busy(1 * MiB, 64 * MiB), engine=ScriptedRunner(infos, devices=(RPC,)),
                  rpc_servers=("127.0.0.1:50052",), on_event=events_first.append, **kwargs())
    first.run()  # with RAM taken only what runs wholly on the RPC device fits: the rest is skipped
    pruned = [e for e in events_first if e["kind"] == "pruned"]
    launched = {json.dumps(e["settings"], sort_keys=True) for e in events_first if e["kind"] == "launch"}
    assert pruned and all(e["reason"].startswith("predicted not to fit") for e in pruned)
    assert launched and len(launched) < 4  # the space ran out of candidates that fit before the budget

    engine = ScriptedRunner(infos, devices=(RPC,))
    second = Tuner(str(models["q8_0"]), trials=8, machine=busy(12 << 30, 6 << 30), engine=engine,
                   rpc_servers=("127.0.0.1:50052",), on_event=events_second.append, **kwargs())
    assert second.study_name == first.study_name
    result = second.run()
    start = next(e for e in events_second if e["kind"] == "start")
    # only what was measured answers from the record; what was skipped for memory is checked again
    assert start["resumed"] and start["done"] == len(launched)
    assert result.counts["run"] == 8
    again = {json.dumps(e["settings"], sort_keys=True) for e in events_second if e["kind"] == "launch"}
    assert not (again & launched)
