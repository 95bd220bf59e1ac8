"""Does the tuner find the best settings without trying them all?

Makes the demo model in two quantizations (Q8_0, Q4_K_M), then, on this machine:

1. measures an exhaustive grid over the tuner's own search space (every valid candidate), and
2. runs the tuner on the same space with a quarter of the grid's trials.

A single measurement on a busy machine is noisy (we saw 10-20% between identical trials on 2
shared cores), and the best of 96 noisy figures is biased upwards. So the comparison that decides
is a head-to-head at the end: the grid's three best and the tuner's winner, measured side by side
in one worker (tuner.engine.python.TrialRunner.run_paired), with an identical twin of the grid's best as
a control whose gap shows the noise floor; the grid's best is the best of the grid's three. It prints
the raw figures too, the ratio, and the trial counts. Target: the winner reaches at least 0.97 x
the grid's best tg with at most a quarter of the grid's trials.

    python benchmarks/tune_vs_grid.py [--min-ctx 4096] [--n-gen 128] [--repetitions 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-ctx", type=int, default=4096)
    parser.add_argument("--n-prompt", type=int, default=256)
    parser.add_argument("--n-gen", type=int, default=128)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=10, help="head-to-head rounds (each: every contender once)")
    parser.add_argument("--h2h-repetitions", type=int, default=2, help="repetitions per contender per round")
    parser.add_argument("--top", type=int, default=3, help="grid candidates in the head-to-head")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = tmp  # a fresh study, nothing resumed
        from tuner.engine.base import BenchSpec
        from tuner.engine.python import TrialRunner
        from tuner.search.study import Tuner, score
        from tuner.testing import demo_models

        q8, q4 = demo_models(Path(tmp) / "models")
        tuner = Tuner(str(q8), variants=[str(q4)], min_ctx=args.min_ctx, n_prompt=args.n_prompt, n_gen=args.n_gen,
                      repetitions=args.repetitions, seed=args.seed, trials=1)
        space = tuner.space
        print(space.describe())
        bench = BenchSpec(n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=args.repetitions)

        # 1. the exhaustive grid: every candidate of the (conditional) space, each once; grouped
        #    by model so one worker serves each variant
        grid = sorted(space.grid(), key=lambda s: s.model_path)
        print(f"\ngrid: {len(grid)} valid candidates")
        measured: dict[str, float] = {}
        started = time.monotonic()
        with TrialRunner() as runner:
            for i, s in enumerate(grid, 1):
                result = runner.run(s, bench)
                key = json.dumps(s.to_dict(), sort_keys=True)
                measured[key] = score("tg", result.pp, result.tg, bench) if result.ok else 0.0
                if i % 12 == 0:
                    print(f"  {i}/{len(grid)} measured ({time.monotonic() - started:.0f} s)", flush=True)
        grid_s = time.monotonic() - started
        best_key = max(measured, key=measured.get)
        grid_best = measured[best_key]

        # 2. the tuner, a quarter of the grid's trials
        budget = len(grid) // 4
        started = time.monotonic()
        tuner = Tuner(str(q8), variants=[str(q4)], min_ctx=args.min_ctx, n_prompt=args.n_prompt, n_gen=args.n_gen,
                      repetitions=args.repetitions, seed=args.seed, trials=budget)
        result = tuner.run()
        tune_s = time.monotonic() - started
        winner_key = json.dumps(result.best["settings"], sort_keys=True)
        winner_in_grid = measured.get(winner_key)

        # 3. head-to-head: the grid's top and the tuner's winner side by side in one worker (all
        #    loaded, measured in rotating rounds within the same seconds), plus an identical twin
        #    of the grid's best as a control: the gap between twins is this machine's noise floor
        import statistics

        from tuner.engine.settings import Settings

        top = sorted(measured, key=measured.get, reverse=True)[: args.top]
        contenders = list(dict.fromkeys(top + [winner_key])) + [top[0]]
        final = BenchSpec(n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=args.h2h_repetitions)
        with TrialRunner() as runner:
            results = runner.run_paired([Settings.from_dict(json.loads(k)) for k in contenders], final, rounds=args.rounds)
        assert all(r.ok for r in results), results[0].message
        h2h = [statistics.median(r.tg.samples) for r in results]
        twin_gap = abs(h2h[-1] - h2h[0]) / max(h2h[0], h2h[-1])
        grid_top = max(h2h[i] for i, k in enumerate(contenders[:-1]) if k in top)
        winner_h2h = h2h[contenders.index(winner_key)]
        ratio = winner_h2h / grid_top

    print(f"\ngrid:  {len(grid)} trials in {grid_s:.0f} s; best tg {grid_best:.1f} t/s")
    print(f"        best: {json.loads(best_key)['model_path'].rsplit('/', 1)[-1]} "
          + " ".join(f"{k}={v}" for k, v in json.loads(best_key).items() if k in ('n_ctx', 'type_k', 'flash_attn', 'n_threads', 'n_ubatch')))
    w = result.best["settings"]
    print(f"tuner: {result.counts['run']} trials launched ({result.counts['pruned']} candidates skipped without launch) "
          f"in {tune_s:.0f} s, re-measure included")
    print(f"        winner: {w['model_path'].rsplit('/', 1)[-1]} "
          + " ".join(f"{k}={w[k]}" for k in ('n_ctx', 'type_k', 'flash_attn', 'n_threads', 'n_ubatch')))
    print(f"        winner's tg as the grid measured it: {winner_in_grid:.1f} t/s (ratio {winner_in_grid / grid_best:.3f} to the grid's single-shot best)")
    print(f"        winner's tg re-measured by the tuner: {result.best['tg']['median']:.1f} t/s "
          f"(95% CI {result.best['tg']['ci_low']:.1f}-{result.best['tg']['ci_high']:.1f})")
    print(f"head-to-head, side by side in one worker ({args.rounds} rotating rounds x {args.h2h_repetitions} repetitions, medians):")
    for i, key in enumerate(contenders):
        d = json.loads(key)
        tag = " <- tuner's winner" if key == winner_key and i < len(contenders) - 1 else ""
        tag += " <- grid's best here" if h2h[i] == grid_top and i < len(contenders) - 1 else ""
        tag += " <- identical twin of the grid's single-shot best (control)" if i == len(contenders) - 1 else ""
        print(f"        {h2h[i]:7.1f} t/s  {d['model_path'].rsplit('/', 1)[-1]} "
              + " ".join(f"{k}={d[k]}" for k in ('n_ctx', 'type_k', 'flash_attn', 'n_threads', 'n_ubatch')) + tag)
    print(f"noise floor: identical twins differ by {twin_gap * 100:.1f}%")
    print(f"ratio: tuner's winner / grid's best = {ratio:.3f}")
    print(f"trials: tuner {result.counts['run']} / grid {len(grid)} = {result.counts['run'] / len(grid):.3f}")
    ok = ratio >= 0.97 and result.counts["run"] <= len(grid) / 4
    print("target (>= 0.97 x grid best with <= 1/4 of the trials):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
