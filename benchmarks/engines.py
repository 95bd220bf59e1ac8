"""The two engines side by side: do they measure what llama-bench measures, and what does a tune cost?

1. Parity: for the same settings on the demo model, pp and tg from the python engine
   (llama-cpp-python's worker), the llama-cpp engine (llama-bench through the tuner) and llama-bench
   run directly, in interleaved rounds (the order rotates each round, so drift on a shared machine
   falls on all three alike). Prints the medians, and each engine's ratio to llama-bench run
   directly: the ratio of the medians and the median of the per-round (paired) ratios.
   Target: within 5%. One thread by default: on a shared machine with as many busy threads as
   cores, a second compute thread waits on the first whenever it is preempted, and the figures
   scatter several-fold (``--threads`` to change it).
2. Keeping the model loaded: the llama-cpp engine loads the model for every trial. Prints llama.cpp's
   own model load time per trial (its ``load time`` line) and its share of the trial, next to the
   python engine, which reuses its loaded model for context-only trials: the most that keeping the
   model loaded with the binaries (one llama-server per model, or llama-bench's multi-value runs)
   could save per trial.
3. A 12-trial tune of the demo (Q8_0 and Q4_K_M, as ``tune --demo``) on each engine: seconds.

The binaries are llama-bench and llama-fit-params built from the sources that match the installed
llama-cpp-python (``OFFLOAD_TUNER_LLAMA_BIN``, or built here from ``LLAMA_CPP_SOURCE``).

    LLAMA_CPP_SOURCE=.../llama_cpp_python-0.3.36/vendor/llama.cpp python benchmarks/engines.py [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--n-prompt", type=int, default=128)
    parser.add_argument("--n-gen", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tune-trials", type=int, default=12)
    parser.add_argument("--skip-tune", action="store_true")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = tmp
        from tuner.engine.base import BenchSpec
        from tuner.engine.llamacpp import LlamaCppEngine, clean_env
        from tuner.engine.python import TrialRunner
        from tuner.engine.settings import Settings
        from tuner.testing import build_llama_cpp_tools, demo_models

        llama_bin = Path(os.environ.get("OFFLOAD_TUNER_LLAMA_BIN") or build_llama_cpp_tools(Path(tmp) / "bin"))
        models = demo_models(Path(tmp) / "models")
        model = next(m for m in models if args.quant in m.name)
        settings = Settings(model_path=str(model), n_ctx=args.n_prompt + args.n_gen + 256, n_batch=512, n_ubatch=512,
                            n_threads=args.threads, n_threads_batch=args.threads, flash_attn="on")
        bench = BenchSpec(n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=args.repetitions)
        samples = {name: {"pp": [], "tg": []} for name in ("python", "llama-cpp", "llama-bench")}
        per_round: list[dict[str, dict[str, float]]] = []
        loads = {"python": [], "llama-cpp": []}
        with TrialRunner() as python, LlamaCppEngine(llama_bin, timeout_s=900) as binaries:
            direct = [str(llama_bin / "llama-bench"), *binaries.bench_args(settings, bench), "-o", "json"]

            def run_direct() -> dict[str, list[float]]:
                proc = subprocess.run(direct, capture_output=True, text=True, env=clean_env(), timeout=900)
                if proc.returncode != 0:
                    raise SystemExit(proc.stderr[-2000:])
                got: dict[str, list[float]] = {"pp": [], "tg": []}
                for row in json.loads(proc.stdout):
                    got["tg" if row["n_gen"] else "pp"].extend(row["samples_ts"])
                return got

            def run_engine(name: str, engine) -> dict[str, list[float]]:
                result = engine.run(settings, bench)
                if not result.ok:
                    raise SystemExit(f"{name}: {result.message}")
                loads[name].append((result.load_s, result.wall_s, result.reused_model))
                return {"pp": list(result.pp.samples), "tg": list(result.tg.samples)}

            order = [("python", lambda: run_engine("python", python)), ("llama-cpp", lambda: run_engine("llama-cpp", binaries)),
                     ("llama-bench", run_direct)]
            for r in range(args.rounds):
                this_round: dict[str, dict[str, float]] = {}
                for name, step in order[r % 3:] + order[: r % 3]:
                    got = step()
                    for kind in ("pp", "tg"):
                        samples[name][kind].extend(got[kind])
                    this_round[name] = {kind: statistics.median(got[kind]) for kind in ("pp", "tg")}
                per_round.append(this_round)
            build = binaries.build().describe()

        print(f"model {model.name}, {args.threads} threads, fa on, -p {args.n_prompt} -n {args.n_gen}; llama.cpp {build}")
        print(f"{args.rounds} interleaved rounds x {args.repetitions} repetitions each (order rotating each round)")
        target_met = True
        for kind in ("pp", "tg"):
            ref = statistics.median(samples["llama-bench"][kind])
            line = [f"{kind}: llama-bench direct {ref:8.1f} t/s"]
            for name in ("python", "llama-cpp"):
                med = statistics.median(samples[name][kind])
                paired = [r[name][kind] / r["llama-bench"][kind] for r in per_round]
                ratio = statistics.median(paired)
                target_met &= abs(ratio - 1) <= 0.05
                line.append(f"{name} engine {med:8.1f} t/s (ratio of medians {med / ref:.3f}, median paired ratio {ratio:.3f}, "
                            f"rounds {min(paired):.2f}-{max(paired):.2f})")
            print("\n   ".join(line))
        print("target (each engine's median paired ratio within 5% of llama-bench run directly):",
              "met" if target_met else "NOT met")
        for name, values in loads.items():
            loaded = [(load, wall) for load, wall, reused in values if not reused]
            reused = sum(1 for *_, r in values if r)
            share = statistics.median(load / wall for load, wall in loaded) if loaded else 0.0
            print(f"{name} engine: model loads in {len(loaded)} of {len(values)} trials, median {statistics.median(l for l, _ in loaded) if loaded else 0:.2f} s "
                  f"({100 * share:.1f}% of such a trial's wall time); {reused} trials reused the loaded model")

        if not args.skip_tune:
            from tuner.search.study import tune

            demo = [m for m in models]
            for name in ("python", "llama-cpp"):
                engine = TrialRunner(timeout_s=600) if name == "python" else LlamaCppEngine(llama_bin, timeout_s=600)
                started = time.monotonic()
                with engine:
                    result = tune(str(demo[0]), variants=[str(m) for m in demo[1:]], trials=args.tune_trials, min_ctx=1024,
                                  n_prompt=256, n_gen=64, engine=engine, storage=f"sqlite:///{tmp}/{name}.db")
                seconds = time.monotonic() - started
                best = result.best["settings"]
                print(f"{args.tune_trials}-trial tune of the demo ({', '.join(m.name for m in demo)}) on the {name} engine: "
                      f"{seconds:.0f} s ({result.counts['run']} run, {result.counts['pruned']} not launched); "
                      f"winner {Path(best['model_path']).name} t={best['n_threads']} ub={best['n_ubatch']} "
                      f"kv={best['type_k']} fa={best['flash_attn']}: tg {result.best['tg']['median']:.1f} t/s")
    return 0 if target_met else 1


if __name__ == "__main__":
    sys.exit(main())
