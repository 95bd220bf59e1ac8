"""Does use_mmap change the tokens/sec a trial measures? (Why the search leaves it out.)

The demo model in two quantizations, each loaded twice in one worker (with and without mmap) and
measured side by side in rotating rounds (``TrialRunner.run_paired``), so both see the same
seconds of a shared machine. Prints each speed's median and the per-round ratio mmap / no-mmap
(median and range). A median ratio within the rounds' spread says the setting does not matter here.

On a machine with transparent huge pages set to "always", buffers read without mmap can get huge
pages and run faster on the CPU; this machine has them on "madvise" (``/sys/kernel/mm/
transparent_hugepage/enabled`` is printed).

    python benchmarks/load_mode.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = tmp
        from tuner.engine.base import BenchSpec
        from tuner.engine.python import TrialRunner
        from tuner.engine.settings import Settings
        from tuner.testing import demo_models

        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
        print(f"transparent huge pages: {thp.read_text().strip() if thp.exists() else 'n/a'}")
        bench = BenchSpec(n_prompt=256, n_gen=64, repetitions=2)
        with TrialRunner(timeout_s=1800) as runner:  # a shared machine can be slow
            for path in demo_models(Path(tmp) / "models"):
                pair = [Settings(model_path=str(path), n_ctx=1024, n_threads=args.threads, flash_attn="on", use_mmap=m)
                        for m in (True, False)]
                mmap, plain = runner.run_paired(pair, bench, rounds=args.rounds)
                if not (mmap.ok and plain.ok):
                    print(f"{path.name}: {mmap.message or plain.message}")
                    return 1
                for kind in ("tg", "pp"):
                    a, b = getattr(mmap, kind).samples, getattr(plain, kind).samples
                    ratios = sorted(x / y for x, y in zip(a, b))
                    print(f"{path.name} {kind}: mmap {statistics.median(a):.1f} t/s, no mmap {statistics.median(b):.1f} t/s; "
                          f"per-round ratio median {statistics.median(ratios):.3f} (range {ratios[0]:.3f}-{ratios[-1]:.3f}, "
                          f"{len(ratios)} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
