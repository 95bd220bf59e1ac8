"""The two engines side by side: do they measure what llama-bench measures, and what does a tune cost?

1. Parity: for the same settings on the demo model, pp and tg from the python engine
   (llama-cpp-python's worker), the llama-cpp engine (llama-bench through the tuner) and llama-bench
   run directly, in interleaved rounds (the order rotates each round, so drift on a shared machine
   falls on all three alike). Prints the medians and each engine's ratio to llama-bench run directly.
   Target: within 5%.
2. Keeping the model loaded: the llama-cpp engine loads the model once per trial. Prints what that
   costs per trial (wall time outside the timed samples), next to the python engine reusing its
   loaded model for context-only trials, and what llama-bench's own multi-value run (several
   context-only candidates in one invocation, one load) would save.
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
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--n-prompt", type=int, default=256)
    parser.add_argument("--n-gen", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
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
        overhead = {"python": [], "llama-cpp": []}
        with TrialRunner() as python, LlamaCppEngine(llama_bin, timeout_s=900) as binaries:
            direct = [str(llama_bin / "llama-bench"), *binaries.bench_args(settings, bench), "-o", "json"]

            def run_direct() -> None:
                proc = subprocess.run(direct, capture_output=True, text=True, env=clean_env(), timeout=900)
                if proc.returncode != 0:
                    raise SystemExit(proc.stderr[-2000:])
                for row in json.loads(proc.stdout):
                    samples["llama-bench"]["tg" if row["n_gen"] else "pp"].extend(row["samples_ts"])

            def run_engine(name: str, engine) -> None:
                result = engine.run(settings, bench)
                if not result.ok:
                    raise SystemExit(f"{name}: {result.message}")
                samples[name]["pp"].extend(result.pp.samples)
                samples[name]["tg"].extend(result.tg.samples)
                timed = sum(args.n_prompt / x for x in result.pp.samples) + sum(args.n_gen / x for x in result.tg.samples)
                overhead[name].append((result.wall_s - timed, result.reused_model))

            order = [("python", lambda: run_engine("python", python)), ("llama-cpp", lambda: run_engine("llama-cpp", binaries)),
                     ("llama-bench", run_direct)]
            for r in range(args.rounds):
                for _, step in order[r % 3:] + order[: r % 3]:
                    step()

            # What keeping the model loaded would save with llama-bench: three context-only candidates
            # (n_ubatch 128, 256, 512) as one multi-value invocation against three invocations.
            small = BenchSpec(n_prompt=64, n_gen=16, repetitions=1)
            base = binaries.bench_args(settings, small)
            ub = base.index("-ub")
            started = time.monotonic()
            for value in ("128", "256", "512"):
                subprocess.run([*direct[:1], *base[:ub + 1], value, *base[ub + 2:], "-o", "json"], capture_output=True,
                               env=clean_env(), check=True, timeout=900)
            separate = time.monotonic() - started
            started = time.monotonic()
            subprocess.run([*direct[:1], *base[:ub + 1], "128,256,512", *base[ub + 2:], "-o", "json"], capture_output=True,
                           env=clean_env(), check=True, timeout=900)
            together = time.monotonic() - started
            build = binaries.build().describe()

        print(f"model {model.name}, {args.threads} threads, fa on, -p {args.n_prompt} -n {args.n_gen}; llama.cpp {build}")
        print(f"{args.rounds} interleaved rounds x {args.repetitions} repetitions each (order rotating each round)")
        target_met = True
        for kind in ("pp", "tg"):
            ref = statistics.median(samples["llama-bench"][kind])
            line = [f"{kind}: llama-bench direct {ref:8.1f} t/s"]
            for name in ("python", "llama-cpp"):
                med = statistics.median(samples[name][kind])
                ratio = med / ref
                target_met &= abs(ratio - 1) <= 0.05
                line.append(f"{name} engine {med:8.1f} t/s (ratio {ratio:.3f})")
            print("   ".join(line))
        print("target (each engine within 5% of llama-bench run directly):", "met" if target_met else "NOT met")
        for name, values in overhead.items():
            first, rest = values[0][0], [v for v, _ in values[1:]]
            reused = sum(1 for _, r in values if r)
            print(f"{name} engine: seconds per trial outside the timed samples: first {first:.2f}, then median "
                  f"{statistics.median(rest) if rest else float('nan'):.2f} ({reused} of {len(values)} trials reused a loaded model)")
        print(f"llama-bench, 3 context-only candidates (-ub 128/256/512, -p 64 -n 16 -r 1): three runs {separate:.2f} s, "
              f"one multi-value run {together:.2f} s (saves {separate - together:.2f} s, {100 * (separate - together) / separate:.0f}%)")

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
