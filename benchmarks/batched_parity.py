"""Does `bench --users N` measure what llama-batched-bench measures? Side by side, in one run.

Builds llama-batched-bench from the llama.cpp sources inside the llama-cpp-python sdist (against the
libraries llama-cpp-python installed: the same llama.cpp as the python engine), makes a dense and a
sliding-window model here, then for each count of users N measures the same row of batched-bench's
-npp/-ntg/-npl table both ways, with the same settings (-c, -b, -ub, -t, -fa, -kvu; n_seq_max = N on
both sides: batched-bench is run with -npl N,N and its second row kept, the first warming up as
our full-size warm-up repetition does; one user is measured the batched way too, as `bench --users 1,2,4`
does, generation after the prompt), alternating the tools round after round (a
shared machine drifts over seconds: each round's pair sees the same machine). It prints per row
S_PP and S_TG (t/s, medians over the rounds) of both, and the median of the per-round ratios
(ours / batched-bench), with the quartiles of those ratios (how much the machine moved between the
two sides of a round). Target: every ratio within 5% of 1.

    LLAMA_CPP_SOURCE=.../llama_cpp_python-0.3.36/vendor/llama.cpp python benchmarks/batched_parity.py
    python benchmarks/batched_parity.py --users 1,2,4,8 --rounds 7 --kv-unified
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
    parser.add_argument("--users", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n-prompt", type=int, default=128)
    parser.add_argument("--n-gen", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--kv-unified", action="store_true")
    parser.add_argument("--models", default="dense,swa")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the binaries and models here between runs")
    args = parser.parse_args()
    from tuner.engine.base import BenchSpec
    from tuner.engine.python import TrialRunner
    from tuner.engine.settings import Settings
    from tuner.testing import ModelShape, build_llama_cpp_tools, llama_cpp_env, make_model

    work = args.workdir or Path(tempfile.mkdtemp(prefix="batched-parity-"))
    work.mkdir(parents=True, exist_ok=True)
    binary = build_llama_cpp_tools(work / "bin") / "llama-batched-bench"
    shapes = {
        "dense": ModelShape(n_layer=4, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024, n_vocab=2048, n_ctx_train=8192),
        # gemma3-style: 5 of 6 layers attend to a 256-token window
        "swa": ModelShape(architecture="gemma3", n_layer=6, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024, n_vocab=2048,
                          n_ctx_train=8192, sliding_window=256, swa_period=6),
    }
    users = [int(x) for x in args.users.split(",")]
    env = llama_cpp_env()
    rows = []
    print(f"llama-batched-bench {binary} (same llama.cpp as llama-cpp-python); -npp {args.n_prompt} -ntg {args.n_gen} "
          f"-c {args.ctx} -t {args.threads}{' -kvu' if args.kv_unified else ''}; {args.rounds} rounds, interleaved")
    print(f"{'model':<6} {'N':>3} | {'S_PP ours':>10} {'S_PP bb':>10} {'ratio':>6} | {'S_TG ours':>10} {'S_TG bb':>10} {'ratio':>6}",
          flush=True)
    with TrialRunner(timeout_s=600) as runner:
        for name in args.models.split(","):
            path = work / f"{name}.gguf"
            if not path.exists():
                make_model(path, shapes[name])
            for n in users:
                s = Settings(model_path=str(path), n_ctx=args.ctx, n_threads=args.threads, n_threads_batch=args.threads,
                             flash_attn="auto", kv_unified=args.kv_unified, n_parallel=n)
                bench = BenchSpec(n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=1, users=n, batched=True)
                cmd = [str(binary), "-m", str(path), "-c", str(args.ctx), "-b", str(s.n_batch), "-ub", str(s.n_ubatch),
                       "-t", str(args.threads), "-ngl", "0", "-fa", "auto", "-npp", str(args.n_prompt),
                       "-ntg", str(args.n_gen), "-npl", f"{n},{n}", "--output-format", "jsonl"] + (["-kvu"] if args.kv_unified else [])
                ours: dict[str, list[float]] = {"pp": [], "tg": []}
                theirs: dict[str, list[float]] = {"pp": [], "tg": []}
                for r in range(args.rounds):
                    order = ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")
                    for who in order:
                        if who == "ours":
                            result = runner.run(s, bench)
                            if not result.ok:
                                print(f"{name} N={n}: our trial failed: {result.outcome.value} {result.message}")
                                return 1
                            ours["pp"].append(result.pp.median)
                            ours["tg"].append(result.tg.median)
                        else:
                            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
                            # the second row: the first warms up (batched-bench's own warm-up is 16 tokens;
                            # our worker's is a full-size repetition, as for llama-bench)
                            line = ([x for x in proc.stdout.splitlines() if x.startswith("{")] or [None])[-1]
                            if proc.returncode != 0 or line is None:
                                print(f"{name} N={n}: llama-batched-bench failed ({proc.returncode}): {proc.stderr[-800:]}")
                                return 1
                            data = json.loads(line)
                            theirs["pp"].append(data["speed_pp"])
                            theirs["tg"].append(data["speed_tg"])
                per_round = {k: [a / b for a, b in zip(ours[k], theirs[k])] for k in ("pp", "tg")}
                ratio = {k: statistics.median(v) for k, v in per_round.items()}
                spread = {k: (statistics.quantiles(v, n=4)[0], statistics.quantiles(v, n=4)[2]) if len(v) > 1 else (v[0], v[0])
                          for k, v in per_round.items()}
                o, t = ({k: statistics.median(v) for k, v in side.items()} for side in (ours, theirs))
                rows.append(ratio)
                print(f"{name:<6} {n:>3} | {o['pp']:10.1f} {t['pp']:10.1f} {ratio['pp']:6.3f} | {o['tg']:10.1f} {t['tg']:10.1f} "
                      f"{ratio['tg']:6.3f} | quartiles of the rounds' ratios: pp {spread['pp'][0]:.3f}-{spread['pp'][1]:.3f}, "
                      f"tg {spread['tg'][0]:.3f}-{spread['tg'][1]:.3f}", flush=True)
    worst = max((abs(r[k] - 1) for r in rows for k in ("pp", "tg")), default=0.0)
    print(f"largest deviation from 1: {worst:.3f} (target: within 0.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
