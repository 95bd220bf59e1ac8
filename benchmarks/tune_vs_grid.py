"""Does the tuner find the best settings without trying them all?

Makes the demo model in two quantizations (Q8_0, Q4_K_M), then, on this machine:

1. measures an exhaustive grid over the tuner's own search space (every valid candidate), and
2. runs the tuner on the same space with a quarter of the grid's trials.

A single measurement on a busy machine is noisy (we saw 10% between identical trials on 2 shared
cores), and the best of 96 noisy figures is biased upwards. So the comparison that decides is a
head-to-head at the end: the grid's three best and the tuner's winner are measured again, in
alternating rounds, with many repetitions each; the grid's best is the best of those. It prints
the raw figures too, the ratio, and the trial counts. Target: the winner reaches at least 0.97 x
the grid's best tg with at most a quarter of the grid's trials.

    python benchmarks/tune_vs_grid.py [--min-ctx 4096] [--n-gen 128] [--repetitions 3]
"""

from __future__ import annotations

import argparse
import itertools
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
        from tuner.errors import SettingsError
        from tuner.runner import BenchSpec, TrialRunner
        from tuner.study import Tuner, score
        from tuner.testing import demo_models

        q8, q4 = demo_models(Path(tmp) / "models")
        tuner = Tuner(str(q8), variants=[str(q4)], min_ctx=args.min_ctx, n_prompt=args.n_prompt, n_gen=args.n_gen,
                      repetitions=args.repetitions, seed=args.seed, trials=1)
        space = tuner.space
        print(space.describe())
        bench = BenchSpec(n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=args.repetitions)

        # 1. the exhaustive grid (invalid combinations, like a quantized V cache without flash
        #    attention, are not candidates); grouped by model so one worker serves each variant
        grid = []
        for variant, ctx, kv, fa, threads, ub in itertools.product(space.variants, space.n_ctx, space.kv_types,
                                                                     space.flash_attn, space.threads, space.n_ubatch):
            try:
                grid.append(space.settings(variant=variant, n_ctx=ctx, kv=kv, flash_attn=fa, threads=threads,
                                           n_ubatch=ub, n_batch=space.n_batch[0]))
            except SettingsError:
                continue
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

        # 3. head-to-head: the grid's top and the tuner's winner, alternating rounds
        from tuner.settings import Settings

        top = sorted(measured, key=measured.get, reverse=True)[: args.top]
        contenders = list(dict.fromkeys(top + [winner_key]))
        samples: dict[str, list[float]] = {k: [] for k in contenders}
        final = BenchSpec(n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=args.h2h_repetitions)
        with TrialRunner() as runner:
            for _ in range(args.rounds):
                for key in contenders:
                    r = runner.run(Settings.from_dict(json.loads(key)), final)
                    if r.ok:
                        samples[key].extend(r.tg.samples)
        import statistics

        h2h = {k: statistics.median(v) for k, v in samples.items() if v}
        h2h_best_key = max((k for k in h2h if k in top), key=h2h.get)
        ratio = h2h[winner_key] / h2h[h2h_best_key]

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
    print(f"head-to-head ({args.rounds} alternating rounds x {args.h2h_repetitions} repetitions, medians):")
    for key in contenders:
        tag = " <- tuner's winner" if key == winner_key else (" <- grid's best here" if key == h2h_best_key else "")
        d = json.loads(key)
        print(f"        {h2h.get(key, 0):7.1f} t/s  {d['model_path'].rsplit('/', 1)[-1]} "
              + " ".join(f"{k}={d[k]}" for k in ('n_ctx', 'type_k', 'flash_attn', 'n_threads', 'n_ubatch')) + tag)
    print(f"ratio: tuner's winner / grid's best = {ratio:.3f}")
    print(f"trials: tuner {result.counts['run']} / grid {len(grid)} = {result.counts['run'] / len(grid):.3f}")
    ok = ratio >= 0.97 and result.counts["run"] <= len(grid) / 4
    print("target (>= 0.97 x grid best with <= 1/4 of the trials):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
