"""The roofline engine (simulation only): its physics are sane, its noise is seeded and bounded.

Pure Python, no llama.cpp: the models are built from real shapes without a file.
"""

from __future__ import annotations

import statistics

import pytest

from tuner.engine.base import BenchSpec
from tuner.engine.outcome import Outcome
from tuner.engine.roofline import DEVICES, Drift, RooflineEngine
from tuner.engine.settings import Settings
from tuner.machine.simulated import SIMULATED, model
from tuner.model.estimate import CPU

GiB = 1 << 30
BENCH = BenchSpec(n_prompt=512, n_gen=128, depth=4096, repetitions=3)


def one_gpu(gpu: str = "rtx3090", ram: int = 60 * GiB, noise: float = 0.0, seed: int = 0, *quants: str) -> tuple[RooflineEngine, str]:
    info = model("Llama-3.1-70B", "Q4_K_M")
    return RooflineEngine({info.path: info}, host=DEVICES["ryzen9-7950x"], ram=ram, accelerators=[("CUDA0", DEVICES[gpu])],
                          noise=noise, seed=seed), info.path


def test_more_layers_on_the_faster_device_is_faster_until_out_of_memory():
    engine, path = one_gpu()
    n_layer = engine.models[path].n_layer
    speeds, fits = [], []
    for ngl in range(n_layer + 2):
        s = Settings(model_path=path, n_gpu_layers=ngl, n_ctx=8192, flash_attn="on", n_threads=16)
        speeds.append(engine.speed(s, BENCH)[1])
        fits.append(engine.out_of_memory(engine.memory(s)) is None)
    assert all(b > a for a, b in zip(speeds, speeds[1:])), "each layer moved to the GPU must make generation faster"
    boundary = fits.index(False)
    assert 20 < boundary < n_layer and not any(fits[boundary:])  # a 70B Q4_K_M does not fit a 24 GB card
    ok = engine.run(Settings(model_path=path, n_gpu_layers=boundary - 1, n_ctx=8192, flash_attn="on"), BENCH)
    oom = engine.run(Settings(model_path=path, n_gpu_layers=boundary, n_ctx=8192, flash_attn="on"), BENCH)
    assert ok.outcome is Outcome.OK and ok.tg.median > 0 and ok.load.layers_offloaded == boundary - 1
    assert oom.outcome is Outcome.OOM and "failed to allocate CUDA0 buffer" in oom.message and oom.load.oom
    # the cliff: the last layers on the CPU cost most of the speed
    assert speeds[-1] > 5 * speeds[boundary - 1] > 5 * speeds[0]


def test_batched_decode_reads_the_weights_once_for_all_users():
    """Four users decoding together (issue 21): each step reads the weights once for four tokens and
    every user's own cache, so aggregate speed grows (nearly 4x while the weights dominate, less when
    the caches do) and each user's own speed falls; their four prompts take longer to the first token;
    four users' caches need memory a single user's does not."""
    engine, path = one_gpu("a100-80g")
    n_layer = engine.models[path].n_layer
    s1 = Settings(model_path=path, n_gpu_layers=n_layer + 1, n_ctx=8192, flash_attn="on", type_k="q8_0", type_v="q8_0")
    s4 = s1.replace(n_parallel=4, n_ctx=4 * 8192)
    shallow = dict(n_prompt=512, n_gen=128, depth=0)
    pp1, one = engine.speed(s1, BenchSpec(**shallow))
    pp4, four = engine.speed(s4, BenchSpec(**shallow, users=4))
    assert 3.0 * one < four < 4.0 * one and four / 4 < one
    deep = dict(n_prompt=512, n_gen=128, depth=6000)
    _, one_deep = engine.speed(s1, BenchSpec(**deep))
    _, four_deep = engine.speed(s4, BenchSpec(**deep, users=4))
    assert four_deep / one_deep < four / one  # at depth the caches, read per user, weigh more
    assert 4 * 512 / pp4 > 512 / pp1  # time to the first token of four prompts at once
    assert engine.memory(s4).devices["CUDA0"].kv > 3 * engine.memory(s1).devices["CUDA0"].kv


def test_a_faster_gpu_and_a_faster_host_are_faster():
    slow, path = one_gpu("rtx4060ti16")
    fast, _ = one_gpu("rtx4090")
    s = Settings(model_path=path, n_gpu_layers=20, n_ctx=8192, flash_attn="on", n_threads=16)
    assert fast.speed(s, BENCH)[1] > slow.speed(s, BENCH)[1]
    everything = Settings(model_path=path, n_gpu_layers=81, n_ctx=8192, flash_attn="on")
    assert fast.speed(everything, BENCH)[1] / slow.speed(everything, BENCH)[1] == pytest.approx(1008 / 288, rel=0.1)


def test_a_split_costs_bus_time():
    info = model("Qwen2.5-32B", "Q4_K_M")
    twins = RooflineEngine({info.path: info}, host=DEVICES["ryzen9-7950x"], ram=60 * GiB,
                           accelerators=[("CUDA0", DEVICES["rtx3090"]), ("CUDA1", DEVICES["rtx3090"])], noise=0.0)
    whole = Settings(model_path=info.path, n_gpu_layers=info.n_layer + 1, tensor_split=(1.0, 0.0), n_ctx=8192, flash_attn="on")
    split = Settings(model_path=info.path, n_gpu_layers=info.n_layer + 1, tensor_split=(32.0, 33.0), n_ctx=8192, flash_attn="on")
    assert set(twins.placement(whole)) == {"CUDA0"} and set(twins.placement(split)) == {"CUDA0", "CUDA1"}
    t_whole, t_split = 1 / twins.speed(whole, BENCH)[1], 1 / twins.speed(split, BENCH)[1]
    # same bytes on same-speed devices: the difference is one hop of the activations between them
    hop = twins.crossing("CUDA0", "CUDA1", info.n_embd * 4)
    assert t_split - t_whole == pytest.approx(hop, rel=1e-6) and hop > 10e-6
    # consumer GPUs have no peer-to-peer link: the hop goes through the host, both PCIe legs
    assert twins.link("CUDA0", "CUDA1").latency == 2 * twins.link("CUDA0", CPU).latency
    # a split over unequal GPUs puts layers on the slow one: slower than the fast one alone
    sim = SIMULATED["2gpu-32b"]
    engine = sim.engine(noise=0.0)
    path = next(p for p in sim.models if p.endswith("Q4_K_M.gguf"))
    fast_only = Settings(model_path=path, n_gpu_layers=info.n_layer + 1, tensor_split=(65.0, 0.0), n_ctx=8192, flash_attn="on")
    even = Settings(model_path=path, n_gpu_layers=info.n_layer + 1, tensor_split=(33.0, 32.0), n_ctx=8192, flash_attn="on")
    assert engine.speed(fast_only, BENCH)[1] > 1.5 * engine.speed(even, BENCH)[1]


def test_host_threads_saturate_bandwidth_and_hyperthreads_cost():
    engine, path = one_gpu()
    tg = {t: engine.speed(Settings(model_path=path, n_gpu_layers=0, n_ctx=8192, flash_attn="on", n_threads=t), BENCH)[1]
          for t in (2, 4, 8, 16, 32)}
    assert tg[2] < tg[4] < tg[8] == tg[16] > tg[32]


def test_kv_placement_and_flash_attention():
    engine, path = one_gpu()
    base = dict(model_path=path, n_gpu_layers=30, n_ctx=8192, n_threads=16)
    on = engine.speed(Settings(**base, flash_attn="on"), BENCH)[1]
    assert engine.speed(Settings(**base, flash_attn="on", offload_kqv=False), BENCH)[1] < on
    assert engine.speed(Settings(**base, flash_attn="off"), BENCH)[1] < on
    # at 4096 tokens of depth a q8_0 cache reads fewer bytes, dequantizing costs less than it saves
    assert engine.speed(Settings(**base, flash_attn="on", type_k="q8_0", type_v="q8_0"), BENCH)[1] > on
    # at no depth there is next to nothing to read: the cache type hardly matters
    shallow = BenchSpec(n_prompt=512, n_gen=2, depth=0)
    assert (engine.speed(Settings(**base, flash_attn="on", type_k="q8_0", type_v="q8_0"), shallow)[1]
            == pytest.approx(engine.speed(Settings(**base, flash_attn="on"), shallow)[1], rel=1e-3))


def test_moe_reads_only_the_experts_it_uses():
    sim = SIMULATED["16gb-moe"]
    engine = sim.engine(noise=0.0)
    info = sim.models[sim.main]
    all_gpu = Settings(model_path=sim.main, n_gpu_layers=info.n_layer + 1, n_ctx=8192, flash_attn="on", n_threads=16)
    work = engine.work(all_gpu, 1, 4096)
    routed = sum(t.n_bytes for t in info.tensors if "_exps." in t.name)
    # a generated token reads 8 of 128 experts' bytes
    assert sum(work.kept_bytes) < sum(t.n_bytes for t in info.tensors) - routed * (1 - 8 / 128) + 1
    assert sum(work.kept_bytes) > sum(t.n_bytes for t in info.tensors) - routed - info.nonrepeating_bytes["token_embd"]
    # experts of every layer on the host (llama.cpp's --cpu-moe): fits the 16 GB card, far faster
    # than offloading as many whole layers as fit
    experts = Settings(model_path=sim.main, n_gpu_layers=info.n_layer + 1, n_ctx=8192, flash_attn="on", n_threads=16,
                       tensor_overrides=(r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$",))
    assert engine.out_of_memory(engine.memory(experts)) is None
    layers = max(n for n in range(info.n_layer + 2) if engine.out_of_memory(engine.memory(
        Settings(model_path=sim.main, n_gpu_layers=n, n_ctx=8192, flash_attn="on", n_threads=16))) is None)
    partial = Settings(model_path=sim.main, n_gpu_layers=layers, n_ctx=8192, flash_attn="on", n_threads=16)
    assert engine.speed(experts, BENCH)[1] > 1.3 * engine.speed(partial, BENCH)[1]
    # prompt micro-batches touch nearly every expert; a bigger micro-batch streams the host's experts less often
    assert engine.work(all_gpu, 512, 4096).kept_bytes.sum() > 5 * work.kept_bytes.sum()
    small = engine.speed(Settings(model_path=sim.main, n_gpu_layers=info.n_layer + 1, n_ctx=8192, n_ubatch=128, n_batch=512,
                                  flash_attn="on", tensor_overrides=experts.tensor_overrides), BENCH)[0]
    assert engine.speed(experts, BENCH)[0] > small


def test_noise_is_seeded_and_within_its_band():
    s = dict(n_gpu_layers=30, n_ctx=8192, flash_attn="on", n_threads=16)
    runs = {}
    for seed in (1, 1, 2):
        engine, path = one_gpu("rtx3090", 60 * GiB, 0.2, seed)
        runs.setdefault(seed, []).append([engine.run(Settings(model_path=path, **s), BENCH).tg.samples for _ in range(50)])
    assert runs[1][0] == runs[1][1] and runs[1][0] != runs[2][0]
    engine, path = one_gpu("rtx3090", 60 * GiB, 0.2, 3)
    true = engine.speed(Settings(model_path=path, **s), BENCH)[1]
    factors = [x / true for _ in range(200) for x in engine.run(Settings(model_path=path, **s), BENCH).tg.samples]
    assert all(0.8 - 1e-12 <= f <= 1.0 for f in factors)
    assert min(factors) < 0.88 and max(factors) > 0.95  # it does drift across the band
    drift = Drift(0.0, 5)
    assert {drift.factor() for _ in range(10)} == {1.0}
    with pytest.raises(ValueError):
        Drift(1.5, 0)


def test_paired_measurements_share_the_drift():
    engine, path = one_gpu("rtx3090", 60 * GiB, 0.25, 7)
    a = Settings(model_path=path, n_gpu_layers=30, n_ctx=8192, flash_attn="on")
    b = Settings(model_path=path, n_gpu_layers=30, n_ctx=8192, flash_attn="on", n_ubatch=256)
    ra, rb = engine.run_paired([a, b], BENCH, rounds=5)
    assert ra.ok and rb.ok and len(ra.tg.samples) == 15
    ratios = [x / y for x, y in zip(ra.tg.samples, rb.tg.samples)]
    jitter = engine.drift.jitter
    assert all(1 - jitter - 1e-9 <= r <= 1 / (1 - jitter) + 1e-9 for r in ratios)
    # measured one after another, the same two drift apart by more than the jitter
    apart = [engine.run(a, BENCH).tg.median / engine.run(b, BENCH).tg.median for _ in range(30)]
    assert max(apart) - min(apart) > 2 * jitter
    # loaded together they need both contexts: a pair that cannot share the card runs out of memory
    big = Settings(model_path=path, n_gpu_layers=44, n_ctx=8192, flash_attn="on")
    assert engine.out_of_memory(engine.memory(big)) is None
    assert all(r.outcome is Outcome.OOM for r in engine.run_paired([big, Settings(model_path=path, n_gpu_layers=0, n_ctx=131072)], BENCH))


def test_device_table_cites_its_sources():
    for key, spec in DEVICES.items():
        assert spec.source and spec.bandwidth > 0 and spec.flops > 0, key
        assert (spec.memory > 0) == (spec.kind == "gpu"), key
        assert spec.kind == "cpu" or spec.link is not None, key
    assert DEVICES["rtx3090"].memory == 24 * GiB and DEVICES["rtx4060ti16"].bandwidth == 288e9


def test_unified_memory_shares_one_pool():
    info = model("Qwen2.5-32B", "Q4_K_M")
    mac = RooflineEngine({info.path: info}, host=DEVICES["m2max-cpu"], ram=64 * GiB, accelerators=[("MTL0", DEVICES["m2max-gpu"])])
    # Metal wires at most ~3/4 of the machine's memory, and host and GPU draw on the same RAM
    assert mac.capacity["MTL0"] == int(64 * GiB * 0.75)
    s = Settings(model_path=info.path, n_gpu_layers=info.n_layer + 1, n_ctx=8192, flash_attn="on")
    assert mac.out_of_memory(mac.memory(s)) is None
    huge = Settings(model_path=info.path, n_gpu_layers=info.n_layer + 1, n_ctx=32768 * 4, flash_attn="on")
    assert mac.out_of_memory(mac.memory(huge)) == "MTL0"


def test_simulated_machines_describe_real_hardware_and_models():
    for name, sim in SIMULATED.items():
        machine = sim.machine()
        assert machine.gpus and all(g.memory_free < g.memory_total for g in machine.gpus), name
        assert len(sim.models) >= 3 and sim.min_ctx >= sim.depth + 512, name
        sizes = [m.file_size for m in sim.models.values()]
        assert len(set(sizes)) == len(sizes), name
    # sizes as llama.cpp writes them (within a few percent of the published GGUF files)
    assert model("Llama-3.1-70B", "Q4_K_M").file_size / 1e9 == pytest.approx(42.5, rel=0.03)
    assert model("Qwen2.5-32B", "Q4_K_M").file_size / 1e9 == pytest.approx(19.9, rel=0.03)
    glm = model("GLM-4.5-Air", "Q4_K_M")
    assert glm.is_moe and glm.expert_used_count == 8 and 100e9 < glm.n_params < 112e9
    assert any("shexp" in t.name for t in glm.tensors) and not any(t.name.startswith("blk.0.ffn_gate_exps") for t in glm.tensors)
    assert statistics.mean([glm.file_size]) > model("GLM-4.5-Air", "Q2_K").file_size


def test_it_is_an_engine_that_lists_its_devices_as_llama_cpp_names_them():
    from tuner.engine.base import Engine
    from tuner.search.candidates import accelerator_devices

    sim = SIMULATED["2gpu-32b"]
    engine = sim.engine()
    assert isinstance(engine, Engine) and engine.fit(Settings(model_path=sim.main), margin=0, min_ctx=8192) is None
    build = engine.build()
    assert build.engine == engine.name == "roofline" and build.backends == ("CPU", "CUDA") and "simulation" in build.detail
    devices = engine.devices()
    assert [(d.name, d.type, d.backend) for d in devices] == [("CPU", "cpu", "CPU"), ("CUDA0", "gpu", "CUDA"), ("CUDA1", "gpu", "CUDA")]
    assert [d.memory_total for d in devices[1:]] == [24 * GiB, 16 * GiB]
    # the simulated machine reports those devices; the tuner plans with their free memory, and
    # llama.cpp can allocate a little less (its own CUDA context)
    planned = accelerator_devices(sim.machine())
    assert [(d.name, d.free) for d in planned] == [(d.name, d.memory_free) for d in devices[1:]]
    assert all(engine.capacity[d.name] < d.free for d in planned)
    mac = RooflineEngine({}, host=DEVICES["m2max-cpu"], ram=64 * GiB, accelerators=[("MTL0", DEVICES["m2max-gpu"])])
    assert [(d.name, d.backend, d.unified_memory) for d in mac.devices()[1:]] == [("MTL0", "Metal", True)]
