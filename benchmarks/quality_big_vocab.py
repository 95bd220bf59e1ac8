"""How big is the reference cache for a 262k-token vocabulary, and how close is its KL to the exact one?

Makes a small model with a 262,144-token vocabulary (Gemma 3's size; F16, a peaked output head) and
its Q4_K_M, scores the reference keeping every log-probability as well as the compact form, and
prints: the compact form's bytes per scored token next to llama.cpp's 16-bit file's
(``2 * n_vocab + 8`` bytes per token), how much probability the compact form merged, and the KL
from the compact form against the exact KL (target: within 1%).

    python benchmarks/quality_big_vocab.py            # about 2 minutes on 2 cores, ~300 MB of disk
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--ctx", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--output-std", type=float, default=0.4)
    args = parser.parse_args()
    from tuner.engine.scoring import load
    from tuner.model.inspect import inspect
    from tuner.search.quality import QualityMeter
    from tuner.testing import ModelShape, make_model, quantize

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = str(Path(tmp) / "home")
        started = time.perf_counter()
        shape = ModelShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=args.vocab, n_ctx_train=2048)
        ref = make_model(Path(tmp) / "big-F16.gguf", shape, output_std=args.output_std)
        var = quantize(ref, Path(tmp) / "big-Q4_K_M.gguf", "Q4_K_M")
        print(f"made a {args.vocab}-token model and its Q4_K_M in {time.perf_counter() - started:.0f} s")
        with QualityMeter(inspect(ref), n_ctx=args.ctx, chunks=args.chunks, exact=True) as meter:
            path, meta, _ = meter.ensure_reference()
            arrays, _ = load(str(path))
            v = meter.measure_variant(inspect(var), path, meter.reference_key())
        rows = int(meta["rows"])
        per_token = meta["compact_bytes"] / rows
        llama = 2 * ((args.vocab + 1) // 2) + 4  # uint16 values per token in llama-perplexity's file
        print(f"scored tokens: {rows}; vocabulary: {args.vocab}")
        print(f"compact form: {per_token / 1024:.1f} KiB per token ({meta['mean_entries']:.0f} tokens kept on average, "
              f"at most {meta['max_top']}); llama.cpp's 16-bit file: {llama * 2 / 1024:.1f} KiB per token "
              f"({llama * 2 / per_token:.0f}x more)")
        print(f"for 20 chunks of 512 (the default): {per_token * 20 * 255 / (1 << 20):.0f} MiB compact, "
              f"{llama * 2 * 20 * 255 / (1 << 20):.0f} MiB in llama.cpp's form")
        print(f"probability merged into the rest: mean {arrays['rest'].mean() * 100:.3f}%, max {arrays['rest'].max() * 100:.3f}%")
        assert v.kl_exact is not None
        rel = (v.kl_mean - v.kl_exact) / v.kl_exact
        print(f"KL of the Q4_K_M: {v.kl_mean:.6f} from the compact form, {v.kl_exact:.6f} exact: {rel * 100:+.3f}% "
              f"(target: within 1%)")
        return 0 if abs(rel) <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
