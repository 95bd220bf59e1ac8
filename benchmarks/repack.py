"""Weight repacking on and off: speed side by side, and the estimate's error on llama.cpp's buffers.

The demo model in Q4_0 and Q4_K_M (both repacked into CPU_REPACK on an AVX2 CPU; llama.cpp's own
features decide), each loaded twice in one worker (``repack`` on and off) and measured side by side in
rotating rounds (``TrialRunner.run_paired``), so both see the same seconds of a shared machine. Prints
each speed's median, the per-round ratio on / off (median and range), and per load the model buffers
llama.cpp printed next to ``tuner.model.estimate``'s prediction (with mmap, as the trials load; each
setting loaded alone for that, since a paired run's log holds both loads).

    python benchmarks/repack.py [--rounds 6] [--threads 2] [--quants Q4_0,Q4_K_M] [--n-prompt 256] [--n-gen 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quants", default="Q4_0,Q4_K_M", help="the demo model's quantizations to measure")
    parser.add_argument("--n-prompt", type=int, default=256)
    parser.add_argument("--n-gen", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = tmp
        from tuner.engine.base import BenchSpec
        from tuner.engine.python import TrialRunner
        from tuner.engine.settings import Settings
        from tuner.machine.probe import probe_llama_build
        from tuner.model.estimate import CPU, estimate
        from tuner.model.inspect import inspect
        from tuner.model.repack import CpuFeatures
        from tuner.testing import demo_models

        cpu = CpuFeatures.parse(probe_llama_build().system_info)
        print(f"llama.cpp CPU features: {cpu.describe() if cpu else 'not reported'}")
        bench = BenchSpec(n_prompt=args.n_prompt, n_gen=args.n_gen, repetitions=2)
        with TrialRunner(timeout_s=1800) as runner:  # a shared machine can be slow
            for path in demo_models(Path(tmp) / "models", quants=tuple(args.quants.split(","))):
                info = inspect(path)
                pair = [Settings(model_path=str(path), n_ctx=1024, n_threads=args.threads, flash_attn="on", repack=r)
                        for r in (True, False)]
                on, off = runner.run_paired(pair, bench, rounds=args.rounds)
                if not (on.ok and off.ok):
                    print(f"{path.name}: {on.message or off.message}")
                    return 1
                for kind in ("tg", "pp"):
                    a, b = getattr(on, kind).samples, getattr(off, kind).samples
                    ratios = sorted(x / y for x, y in zip(a, b))
                    print(f"{path.name} {kind}: repack on {statistics.median(a):.1f} t/s, off {statistics.median(b):.1f} t/s; "
                          f"per-round ratio on/off median {statistics.median(ratios):.3f} (range {ratios[0]:.3f}-"
                          f"{ratios[-1]:.3f}, {len(ratios)} rounds)")
                # the buffers of each load alone (a paired run's log holds both loads)
                for s in pair:
                    result = runner.run(s, BenchSpec(n_prompt=16, n_gen=4, repetitions=1))
                    predicted = estimate(info, s, devices=[], cpu=cpu).buffers[CPU]
                    real = result.load.model_buffers
                    shown = ", ".join(f"{name} {real.get(name, 0) / MiB:.2f} vs {size / MiB:.2f} MiB "
                                      f"({(size - real.get(name, 0)) / max(1, real.get(name, 0)) * 100:+.2f}%)"
                                      for name, size in predicted.items())
                    extra = sorted(set(real) - set(predicted))
                    print(f"  repack {'on' if s.repack else 'off'}: llama.cpp vs estimate: {shown}"
                          + (f"; not predicted: {extra}" if extra else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
