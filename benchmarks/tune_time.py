"""Where a real tune's time goes here, beside what the simulation predicts for this machine.

Makes real GGUF models (``tuner.model.make``: the demo-sized llama, and a Gemma-3-270M-sized
shape: 18 layers, 640 wide, 4 heads with 1 KV head, FFN 2048, a 262,144-token vocabulary, a
512-token sliding window, from google/gemma-3-270m's config.json; its head size is 160 where the
real one's is 256, since the maker derives it), then per model:

- a real ``tune`` with the python engine (``--trials N``, no quality pass): its ``time`` split
  (``tuner.search.timing``) and its model loads;
- the same tune with the roofline engine describing this machine (``tuner.engine.roofline``: the
  host's cores from the probe, its memory bandwidth and f32 matmul throughput measured here with
  numpy, storage ``--storage``) and the same seed: the simulated clock by kind.

    python benchmarks/tune_time.py [--trials 6] [--storage nvme] [--json]

The two runs search the same space with the same seed but see different speeds, so they need not
launch the same candidates; what is compared is where the time goes and how much of it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# google/gemma-3-270m config.json: hidden_size 640, intermediate_size 2048, num_hidden_layers 18,
# num_attention_heads 4, num_key_value_heads 1, vocab_size 262144, sliding_window 512, max_position_embeddings 32768
GEMMA_270M = dict(n_layer=18, n_embd=640, n_head=4, n_head_kv=1, n_ff=2048, n_vocab=262144, n_ctx_train=32768,
                  architecture="gemma3", sliding_window=512, name="gemma-3-270m-sized")


def host_spec() -> Any:
    """This machine's CPU as a roofline DeviceSpec: cores from the probe, bandwidth and throughput
    measured with numpy (a large copy, a f32 matmul), the best of three."""
    import numpy as np

    from tuner.engine.roofline import DeviceSpec
    from tuner.machine.probe import probe

    m = probe()
    a = np.ones(64 << 20, dtype=np.float32)  # 256 MiB
    b = np.empty_like(a)
    copies = []
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(b, a)
        copies.append(2 * a.nbytes / (time.perf_counter() - t0))  # read + write
    x = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)
    flops = []
    for _ in range(3):
        t0 = time.perf_counter()
        x @ x
        flops.append(2 * 1024 ** 3 / (time.perf_counter() - t0))
    return DeviceSpec(m.cpu_model or "this CPU", "cpu", 0, max(copies), max(flops), cores=m.physical_cores,
                      threads=m.logical_cores, source="measured here (numpy copy and matmul)"), m


def real_tune(model: Path, variants: list[Path], trials: int, seed: int, out: Path) -> dict[str, Any]:
    from tuner.engine.python import TrialRunner
    from tuner.search.study import Tuner

    loads = {"loads": 0, "reused": 0, "progress_lines": 0}

    def on_event(e: dict[str, Any]) -> None:
        if e["kind"] == "load_progress":
            loads["progress_lines"] += 1

    with TrialRunner(timeout_s=300) as engine:
        original = engine.run

        def counted(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            loads["reused" if result.reused_model else "loads"] += 1
            return result

        engine.run = counted  # type: ignore[method-assign]
        tuner = Tuner(model, variants=[str(v) for v in variants], trials=trials, seed=seed, engine=engine,
                      min_ctx=1024, n_prompt=256, n_gen=64, measure_quality=False, out=out / f"{model.stem}.json",
                      storage=f"sqlite:///{out / (model.stem + '.db')}", on_event=on_event)
        result = tuner.run()
    return {"time": result.time, **loads, "trials": result.counts}


def simulated_tune(model: Path, variants: list[Path], trials: int, seed: int, out: Path, host: Any, machine: Any,
                   storage: str) -> dict[str, Any]:
    import optuna

    from tuner.engine.roofline import RooflineEngine
    from tuner.model.inspect import inspect
    from tuner.search.study import Tuner

    infos = {str(p): inspect(p) for p in [model, *variants]}
    engine = RooflineEngine(infos, host=host, ram=machine.ram_available, noise=0.2, seed=seed, storage=storage)
    tuner = Tuner(model, variants=[str(v) for v in variants], trials=trials, seed=seed, engine=engine, machine=machine,
                  infos=infos, min_ctx=1024, n_prompt=256, n_gen=64, measure_quality=False, out=out / f"sim-{model.stem}.json",
                  storage=optuna.storages.InMemoryStorage(), study_name=f"sim-{model.stem}")
    tuner.run()
    return {"spent": {k: round(v, 3) for k, v in engine.spent.items()}, "clock_s": round(engine.clock, 3), "loads": engine.loads}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--storage", default="nvme", help="the simulation's storage class (tuner.engine.roofline.STORAGE)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = tmp
        from tuner.model.make import DEMO_SHAPE, ModelShape, make_model, quantize

        work = Path(tmp)
        host, machine = host_spec()
        say = (lambda *a: None) if args.json else (lambda *a: print(*a, flush=True))
        say(f"this machine: {host.cores} cores, measured {host.bandwidth / 1e9:.1f} GB/s copy, {host.flops / 1e9:.0f} GFLOP/s f32")
        out: dict[str, Any] = {"host": {"cores": host.cores, "bandwidth": host.bandwidth, "flops": host.flops}}
        for label, shape in (("demo", DEMO_SHAPE), ("gemma-3-270m-sized", ModelShape(**GEMMA_270M))):
            f16 = make_model(work / f"{label}-F16.gguf", shape)
            models = [quantize(f16, work / f"{label}-{q}.gguf", q) for q in ("Q8_0", "Q4_K_M")]
            real = real_tune(models[0], models[1:], args.trials, args.seed, work)
            sim = simulated_tune(models[0], models[1:], args.trials, args.seed, work, host, machine, args.storage)
            out[label] = {"file_bytes": models[0].stat().st_size, "real": real, "simulated": sim}
            t, s = real["time"], sim["spent"]
            say(f"\n{label} ({models[0].stat().st_size / 2**20:.0f} MiB Q8_0 + Q4_K_M), {args.trials} trials:")
            say(f"  real:      total {t['total_s']:.1f} s = load {t['load_s']:.1f} + measure {t['measure_s']:.1f} + "
                f"re-measure {t['remeasure_s']:.1f} + quality {t['quality_s']:.1f} + tuner {t['tuner_s']:.1f}; "
                f"{real['loads']} trial loads, {real['reused']} trials on a loaded model, {real['progress_lines']} load progress lines")
            say(f"  simulated: {sim['clock_s']:.1f} s = load {s['load']:.1f} + context {s['context']:.1f} + warm-up "
                f"{s['warmup']:.1f} + measure {s['measure']:.1f} (re-measure included); {sim['loads']} loads")
        if args.json:
            print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
