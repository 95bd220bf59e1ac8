"""The conditional search space: every proposal valid by construction, each dimension asked only
where it can matter, and the table's dimensions all reachable by the search.

The draws use the study's own sampler (multivariate TPE, grouped) through Optuna's ask/tell, as the
tune loop does. Pure Python: no llama.cpp runs here.
"""

from __future__ import annotations

import json
import warnings

import pytest

from tuner.engine.dimensions import DIMENSIONS, offloaded_repeating_layers
from tuner.engine.fake import ScriptedRunner
from tuner.engine.settings import Settings
from tuner.model.estimate import estimate
from tuner.model.inspect import inspect
from tuner.search.space import SEARCHED, Device, build_space
from tuner.search.study import Tuner, make_sampler, tune

from .test_study import RPC, kwargs, machine

GiB = 1 << 30


from tuner.model.repack import CpuFeatures


def _spaces(models) -> dict:
    one = (Device(RPC, 8 * GiB, 8 * GiB),)
    two = (Device("CUDA0", 8 * GiB, 8 * GiB), Device("CUDA1", 4 * GiB, 4 * GiB))
    q8, q4 = inspect(models["q8_0"]), inspect(models["q4_k_m"])
    common = dict(physical_cores=2, logical_cores=4, min_ctx=512, n_prompt=1024)
    return {
        "cpu": build_space([q8, q4], **common),
        # an AVX2 CPU as llama.cpp reports it: it repacks the Q4_K_M variant's Q4_K weights
        "cpu that repacks": build_space([q8, q4], cpu=CpuFeatures.of(["AVX2", "REPACK"]), **common),
        "one device": build_space([q8], devices=one, **common),
        "two devices": build_space([q8, q4], devices=two, **common),
        "moe": build_space([inspect(models["moe"])], devices=two, **common),
        "swa": build_space([inspect(models["swa"])], devices=one, **common),
        "four users": build_space([q8], devices=one, users=4, **common),
    }


def _conditions_hold(space, s: Settings, params: dict) -> None:
    """What the conditional space promises, checked on one proposal and the parameters asked for it."""
    offloaded = offloaded_repeating_layers(s.n_gpu_layers, space.n_layer)
    if s.flash_attn == "off":
        assert s.type_k == s.type_v == "f16" and "type_k" not in params
    assert s.type_v == s.type_k and s.n_threads_batch == s.n_threads
    if len(space.devices) < 2 or offloaded + 1 < 2:
        assert s.tensor_split is None and not any(p.startswith("layers_on[") for p in params)
    if offloaded == 0:
        assert s.offload_kqv is True and s.tensor_overrides == () and s.n_cpu_moe == 0
        assert not {"offload_kqv", "placement", "placement_layers", "n_cpu_moe"} & set(params)
    if "placement" in params and params["placement"] == "none":
        assert "placement_layers" not in params and s.tensor_overrides == ()
    if not space.is_moe:
        assert s.n_cpu_moe == 0 and "n_cpu_moe" not in params
    if not space.has_swa:
        assert s.swa_full is False and "swa_full" not in params
    assert s.n_cpu_moe <= space.n_layer


@pytest.mark.parametrize("name", ["cpu", "one device", "two devices", "moe", "swa"])
def test_a_thousand_draws_are_all_valid(models, name):
    """The first 200 draws come from the tune's own sampler (grouped multivariate TPE, relative
    sampling after 4 startup trials); the other 800 from Optuna's random sampler on the same study,
    which reaches every branch (TPE's cost grows with the trials: 1000 took 2 minutes a space here)."""
    import optuna

    space = _spaces(models)[name]
    infos = {v: inspect(v) for v in space.variants}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=make_sampler(0))
    seen = set()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna's warnings too: an inconsistent distribution would be one
        for i in range(1000):
            if i == 200:
                study.sampler = optuna.samplers.RandomSampler(seed=1)
            trial = study.ask()
            s = space.suggest(trial)  # a Settings: validated on construction
            _conditions_hold(space, s, trial.params)
            est = estimate(infos[s.model_path], s, devices=[d.name for d in space.devices])
            seen.add(json.dumps(s.to_dict(), sort_keys=True))
            # a score that rewards offload and penalizes size, so TPE moves around the space
            study.tell(trial, 100.0 * (s.n_gpu_layers + 1) / (est.devices["CPU"].total / 2**20 + 1) + (i % 7))
    assert len(seen) > 20


@pytest.mark.parametrize("name", ["cpu", "one device", "two devices", "moe", "swa"])
def test_the_grid_is_counted_and_every_candidate_is_spelled_back(models, name):
    from optuna.trial import FixedTrial

    space = _spaces(models)[name]
    if name != "cpu":  # fewer of the unconditional values: the conditional tree stays whole
        space = space.narrowed(n_ctx=space.n_ctx[:1], n_threads=space.threads[:1], n_ubatch=(512,))
    grid = list(space.grid())
    assert len(grid) == space.grid_size() == len({json.dumps(s.to_dict(), sort_keys=True) for s in grid})
    for s in grid:
        assert space.suggest(FixedTrial(space.params_for(s))) == s


def test_the_cpu_space_is_the_valid_part_of_the_old_grid(models):
    """Without devices the conditional space is exactly what the old product minus its invalid
    combinations was (a quantized KV cache without flash attention): the same candidates, none drawn
    and skipped."""
    space = _spaces(models)["cpu"]
    old = set()
    for variant in space.variants:
        for ctx in space.n_ctx:
            for kv in space.kv_types:
                for fa in space.flash_attn:
                    for threads in space.threads:
                        for ub in space.n_ubatch:
                            for batch in space.n_batch:
                                if kv != "f16" and fa == "off":
                                    continue
                                old.add(json.dumps(space.settings(variant=variant, n_ctx=ctx, kv=kv, flash_attn=fa, threads=threads,
                                                                  n_ubatch=ub, n_batch=batch).to_dict(), sort_keys=True))
    assert {json.dumps(s.to_dict(), sort_keys=True) for s in space.grid()} == old


def test_each_searched_dimension_is_asked_somewhere(models):
    """The table drives the search: every dimension with a Search is asked in some space (or left
    out with its reason), and no parameter is asked that the table does not declare."""
    asked = set()
    for space in _spaces(models).values():
        asked |= set(space.dimensions())
    declared = {d.name for d in SEARCHED if d.search.ask is None} - {"n_threads_batch", "type_v", "rpc_servers", "devices", "model_path", "n_parallel"}
    assert declared <= asked, declared - asked
    extra = {"variant", "placement", "placement_layers", "n_gpu_layers", "n_cpu_moe"} | {p for p in asked if p.startswith("layers_on[")}
    assert asked <= declared | extra, asked - declared - extra
    # what the table does not search, it says why
    for dim in DIMENSIONS:
        assert dim.search is not None or dim.not_searched, dim.name


def test_several_users_search_the_kv_layout_and_size_the_context_for_all(models):
    """--users 4: every candidate decodes 4 sequences (n_parallel 4), the context candidates are 4 x
    each user's, and the KV layout (one unified stream or one per sequence) is asked; one user asks
    no layout (llama.cpp builds the same cache either way)."""
    spaces = _spaces(models)
    four, one = spaces["four users"], spaces["one device"]
    assert "kv_unified" in four.dimensions() and "kv_unified" not in one.dimensions()
    assert four.n_ctx == tuple(4 * c for c in one.n_ctx)
    seen = {(s.n_parallel, s.kv_unified) for s in four.grid()}
    assert seen == {(4, False), (4, True)}
    assert {s.n_parallel for s in one.grid()} == {1} and not any(s.kv_unified for s in one.grid())
    assert four.fingerprint() != build_space([inspect(models["q8_0"])], devices=one.devices, physical_cores=2, logical_cores=4,
                                             min_ctx=512, n_prompt=1024).fingerprint()


def test_placement_and_n_cpu_moe_count_from_the_first_offloaded_layer(models):
    from optuna.trial import FixedTrial

    space = _spaces(models)["moe"]
    n = space.n_layer  # 3 repeating layers
    s = space.suggest(FixedTrial({"n_gpu_layers": 3, "layers_on[CUDA0]": 3, "n_ctx": 512, "flash_attn": "on", "type_k": "f16",
                                  "n_threads": 2, "n_ubatch": 512, "n_batch": 512, "placement": "attn_cpu", "placement_layers": 1,
                                  "n_cpu_moe": 2, "offload_kqv": True}))
    # ngl 3: the output layer and layers 1..2; the first offloaded layer is 1
    assert s.tensor_overrides == (r"^blk\.(1)\.attn_(q|k|v|output|qkv)\.weight$",)
    assert s.n_cpu_moe == 3 and n == 3  # layer 0 is on the CPU already: --n-cpu-moe 3 covers layers 1 and 2


def test_an_interrupted_study_with_the_new_parameters_resumes(models, tuner_home):
    """On a conditional space (an MoE model, a device: split, placement, n_cpu_moe, offload_kqv asked
    where they matter), a study stopped after 4 launches resumes: nothing completed runs again."""
    info = inspect(models["moe"])
    infos = {str(models["moe"]): info}
    common = dict(machine=machine(rpc_free=8 << 30), rpc_servers=("127.0.0.1:50052",), **kwargs())
    first = ScriptedRunner(infos, devices=(RPC,), interrupt_after=4)
    events = []
    partial = tune(str(models["moe"]), trials=10, engine=first, on_event=events.append, **common)
    assert partial.interrupted and len(first.launched) == 4
    assert not [e for e in events if e["kind"] == "invalid"]
    second = ScriptedRunner(infos, devices=(RPC,))
    events = []
    resumed = tune(str(models["moe"]), trials=10, engine=second, on_event=events.append, **common)
    assert not resumed.interrupted and resumed.study_name == partial.study_name
    start = next(e for e in events if e["kind"] == "start")
    assert start["resumed"] and start["done"] >= 4
    keys = lambda runs: {json.dumps(s.to_dict(), sort_keys=True) for s in runs}  # noqa: E731
    assert not (keys(second.launched[: 10 - 4]) & keys(first.launched))
    assert resumed.counts["run"] == 10
    assert not [e for e in events if e["kind"] == "invalid"]
    # the study asked the conditional parameters
    import optuna

    study = optuna.load_study(study_name=resumed.study_name, storage=resumed.storage)
    names = set().union(*(t.params for t in study.trials))
    assert {"n_gpu_layers", "flash_attn"} <= names
    assert "kv_types" not in names and "threads" not in names and "placements" not in names


def test_a_tune_never_skips_an_invalid_combination(models, tuner_home):
    """The tune loop's own view: on a space that used to draw invalid KV/flash-attention pairs and
    splits, no trial is pruned as invalid."""
    info = inspect(models["q8_0"])
    engine = ScriptedRunner({str(models["q8_0"]): info}, devices=(RPC,))
    events = []
    Tuner(str(models["q8_0"]), trials=25, machine=machine(rpc_free=8 << 30), engine=engine, rpc_servers=("127.0.0.1:50052",),
          on_event=events.append, **kwargs()).run()
    assert not [e for e in events if e["kind"] == "invalid"]
