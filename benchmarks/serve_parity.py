"""A profile tuned for four users, served its way: memory and aggregate speed against the profile.

For a dense and a sliding-window model made here, ``tune --users 4 --objective aggregate`` (the python
engine) writes a profile; its exported llama-server flags (``profile args --for llama-server``) are then
run by llama.cpp's own llama-batched-bench, built from the same sources, with four parallel sequences
(``-npl 4``; batched-bench parses the same common arguments as llama-server, minus ``-np``, which
``-npl`` replaces). Printed per model:

- the KV cache and compute buffers llama.cpp allocated (its log) against the memory arithmetic's
  prediction that the profile records, and their ratio;
- batched-bench's S_TG (median over its rows) against the profile's aggregate generation speed and
  its interval, measured in the same run (the tune just before).

Why llama-batched-bench and not llama-server itself: llama-server links llama.cpp's multimodal
library and a web UI whose assets its build fetches; built with cmake on this 2-core machine it had
reached 6% after five minutes, so it is not built here (see the closing note of issue 21).

    LLAMA_CPP_SOURCE=.../llama_cpp_python-0.3.36/vendor/llama.cpp python benchmarks/serve_parity.py
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

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--rows", type=int, default=5, help="batched-bench rows (the first warms up)")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="serve-parity-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OFFLOAD_TUNER_HOME", str(work / "home"))
    import optuna

    from tuner.engine.logparse import parse_log
    from tuner.profile.exports import tool_args
    from tuner.search.study import tune
    from tuner.testing import ModelShape, build_llama_cpp_tools, llama_cpp_env, make_model

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    binary = build_llama_cpp_tools(work / "bin") / "llama-batched-bench"
    shapes = {
        "dense": ModelShape(n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024, n_vocab=2048, n_ctx_train=8192),
        "swa": ModelShape(architecture="gemma3", n_layer=6, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024, n_vocab=2048,
                          n_ctx_train=8192, sliding_window=256, swa_period=6),
    }
    n = args.users
    n_prompt, n_gen = 128, 32
    for name, shape in shapes.items():
        path = work / f"{name}.gguf"
        if not path.exists():
            make_model(path, shape)
        result = tune(str(path), users=n, objective="aggregate", trials=args.trials, min_ctx=512, n_prompt=n_prompt,
                      n_gen=n_gen, repetitions=3, out=work / f"{name}-profile.json", measure_quality=False,
                      study_name=f"serve-parity-{name}-{os.getpid()}")
        profile = result.profile
        flags = tool_args(profile, "llama-server", model_path=str(path))
        assert "-np" in flags and flags[flags.index("-np") + 1] == str(n)
        run = [f for i, f in enumerate(flags) if f != "-np" and (i == 0 or flags[i - 1] != "-np")]
        cmd = [str(binary), *run, "-npp", str(n_prompt), "-ntg", str(n_gen), "-npl", ",".join([str(n)] * args.rows),
               "--output-format", "jsonl", "-v"]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=llama_cpp_env(), timeout=900)
        if proc.returncode != 0:
            print(f"{name}: llama-batched-bench failed ({proc.returncode}): {proc.stderr[-800:]}")
            return 1
        rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")][1:]
        load = parse_log(proc.stderr)
        kv, compute = sum(load.kv_buffers.values()), sum(load.compute_buffers.values())
        predicted = profile.memory.predicted
        kv_est, compute_est = sum(m.kv for m in predicted.values()), sum(m.compute for m in predicted.values())
        s_tg = statistics.median(r["speed_tg"] for r in rows)
        agg = profile.workload.aggregate_tg
        print(f"== {name}: {' '.join(flags)}")
        print(f"   KV cache  : llama.cpp {kv / MiB:8.2f} MiB, arithmetic {kv_est / MiB:8.2f} MiB, ratio {kv / kv_est:.3f}")
        print(f"   compute   : llama.cpp {compute / MiB:8.2f} MiB, arithmetic {compute_est / MiB:8.2f} MiB, "
              f"ratio {compute / compute_est:.3f}")
        inside = agg.ci_low <= s_tg <= agg.ci_high
        shown = ", ".join(f"{r['speed_tg']:.1f}" for r in rows)
        print(f"   aggregate : batched-bench S_TG {s_tg:.1f} t/s (rows {shown}); "
              f"profile {agg.median:.1f} t/s [{agg.ci_low:.1f}, {agg.ci_high:.1f}]: ratio {s_tg / agg.median:.3f}, "
              f"{'within' if inside else 'outside'} the interval")
    return 0


if __name__ == "__main__":
    sys.exit(main())
