"""What does reusing the loaded model save, for trials that only change the context?

Runs the same list of context-only candidates (n_ctx, n_ubatch, KV type, flash attention,
threads) twice on the demo model: once with one worker that keeps the model loaded and makes a new
context per trial (what the tuner does), once with a fresh worker and a fresh model load per trial.
Prints the wall time of each, per trial, and the saving.

    python benchmarks/model_reuse.py [--trials 12] [--quant Q8_0]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--quant", default="Q8_0")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = tmp
        from tuner.engine.base import BenchSpec
        from tuner.engine.python import TrialRunner
        from tuner.engine.settings import Settings
        from tuner.testing import demo_models

        (model,) = demo_models(Path(tmp) / "models", quants=(args.quant,))
        combos = itertools.cycle(itertools.product((1024, 2048), (256, 512), ("f16", "q8_0"), ("on",)))
        candidates = [Settings(model_path=str(model), n_ctx=c, n_ubatch=u, n_batch=512, type_k=k, type_v=k, flash_attn=f,
                               n_threads=2) for c, u, k, f in itertools.islice(combos, args.trials)]
        bench = BenchSpec(n_prompt=64, n_gen=16, repetitions=1)
        results = {}
        for reuse in (True, False):
            started = time.monotonic()
            with TrialRunner(reuse_model=reuse) as runner:
                outcomes = [runner.run(s, bench) for s in candidates]
            results[reuse] = time.monotonic() - started
            assert all(r.ok for r in outcomes), [r.message for r in outcomes if not r.ok]
            loads = sum(r.load_s for r in outcomes)
            print(f"{'reuse the model' if reuse else 'fresh worker   '}: {len(candidates)} trials in {results[reuse]:.2f} s "
                  f"({results[reuse] / len(candidates):.2f} s per trial; llama.cpp model loads {loads:.2f} s)")
        size = model.stat().st_size / (1 << 20)
    saved = results[False] - results[True]
    print(f"model: {model.name} ({size:.0f} MiB); saving: {saved:.2f} s over {len(candidates)} trials "
          f"({saved / len(candidates):.2f} s per trial, {100 * saved / results[False]:.0f}% of the fresh-worker time)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
