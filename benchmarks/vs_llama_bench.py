"""Does `offload-tuner bench` measure what llama-bench measures?

Builds llama-bench from the llama.cpp sources inside the llama-cpp-python sdist (against the
libraries llama-cpp-python installed, so both run the same llama.cpp), then measures tg (and pp)
on the demo model with the same settings, alternating the two tools over several rounds, and
prints the medians and the ratio. Target: tg within 5%.

    LLAMA_CPP_SOURCE=.../llama_cpp_python-0.3.36/vendor/llama.cpp python benchmarks/vs_llama_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--n-gen", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    from tuner.engine.base import BenchSpec
    from tuner.engine.python import TrialRunner
    from tuner.engine.settings import Settings
    from tuner.testing import build_against_llama_cpp, demo_models, llama_cpp_env, llama_cpp_source

    source = llama_cpp_source()
    if source is None:
        print("llama.cpp sources not found: set LLAMA_CPP_SOURCE to an unpacked llama-cpp-python sdist's vendor/llama.cpp")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = tmp
        bench_dir = source / "tools" / "llama-bench"
        llama_bench = build_against_llama_cpp("llama-bench", [bench_dir / "llama-bench.cpp", bench_dir / "main.cpp"],
                                              Path(tmp) / "bin", source=source, optimize="-O2")
        (model,) = demo_models(Path(tmp) / "models", quants=(args.quant,))
        settings = Settings(model_path=str(model), n_ctx=args.n_prompt + args.n_gen + 256, n_batch=512, n_ubatch=512,
                            n_threads=args.threads, n_threads_batch=args.threads, flash_attn="on")
        flags = settings.cli_args("llama-bench")
        ours = {"pp": [], "tg": []}
        theirs = {"pp": [], "tg": []}
        with TrialRunner() as runner:
            for _ in range(args.rounds):
                cmd = [str(llama_bench), *flags, "-p", str(args.n_prompt), "-n", str(args.n_gen),
                       "-r", str(args.repetitions), "-o", "json"]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=llama_cpp_env(), timeout=600)
                if proc.returncode != 0:
                    print(proc.stderr[-2000:])
                    return 1
                for row in json.loads(proc.stdout):
                    kind = "pp" if row["n_prompt"] else "tg"
                    theirs[kind].extend(row["samples_ts"])
                r = runner.run(settings, BenchSpec(n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=args.repetitions))
                assert r.ok, r.message
                ours["pp"].extend(r.pp.samples)
                ours["tg"].extend(r.tg.samples)
    print(f"model {model.name}, flags: {' '.join(flags[2:])} -p {args.n_prompt} -n {args.n_gen}")
    print(f"{args.rounds} alternating rounds x {args.repetitions} repetitions each")
    for kind in ("pp", "tg"):
        a, b = statistics.median(ours[kind]), statistics.median(theirs[kind])
        print(f"{kind}: offload-tuner bench {a:8.1f} t/s   llama-bench {b:8.1f} t/s   ratio {a / b:.3f}")
    ratio = statistics.median(ours["tg"]) / statistics.median(theirs["tg"])
    print("target (tg within 5%):", "met" if abs(ratio - 1) <= 0.05 else "NOT met")
    return 0 if abs(ratio - 1) <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
