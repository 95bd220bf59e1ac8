"""Does `offload-tuner quality` measure what llama.cpp's `llama-perplexity --kl-divergence` measures?

Builds llama-perplexity from the llama.cpp sources inside the llama-cpp-python sdist (against the
libraries llama-cpp-python installed, so both run the same llama.cpp), makes a model (the demo
shape, F16, with a peaked output head so its next-token distributions look like a trained model's)
and its quantization, and measures the variant against the F16 reference both ways on the same
corpus, context and chunk count:

    llama-perplexity -m REF -f CORPUS -c CTX --chunks N -b CTX --kl-divergence-base ref.kld
    llama-perplexity -m VAR -f CORPUS -c CTX --chunks N -b CTX --kl-divergence-base ref.kld --kl-divergence
    tuner.quality(REF, variants=[VAR], corpus=CORPUS, n_ctx=CTX, chunks=N)

and prints both tools' mean KL, both perplexities and the top-1 agreement, with the relative
differences (target: KL mean and perplexity within 1%). Then what one variant's quality costs in
time next to one speed trial of it (`offload-tuner bench`'s default: pp512, tg128, 3 repetitions).

    LLAMA_CPP_SOURCE=.../llama_cpp_python-0.3.36/vendor/llama.cpp python benchmarks/quality_vs_llama_perplexity.py
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# llama-perplexity's summary lines (tools/perplexity/perplexity.cpp, kl_divergence(), 2025-2026):
#   LOG("Mean PPL(Q)                   : %10.6lf ± %10.6lf\n", ...)
#   LOG("Mean PPL(base)                : %10.6lf ± %10.6lf\n", ...)
#   LOG("Mean PPL(Q)/PPL(base)         : %10.6lf ± %10.6lf\n", ...)
#   LOG("Mean    KLD: %10.6lf ± %10.6lf\n", ...)
#   LOG("Same top p: %6.3lf ± %5.3lf %%\n", ...)
_LINES = {
    "ppl": re.compile(r"^Mean PPL\(Q\)\s+:\s+([\d.]+)", re.M),
    "ppl_base_16bit": re.compile(r"^Mean PPL\(base\)\s+:\s+([\d.]+)", re.M),
    "ppl_ratio_16bit": re.compile(r"^Mean PPL\(Q\)/PPL\(base\)\s+:\s+([\d.]+)", re.M),
    "kl_mean": re.compile(r"^Mean\s+KLD:\s+([\d.eE+-]+)", re.M),
    "top1": re.compile(r"^Same top p:\s+([\d.]+)", re.M),
}
# The reference's own perplexity, from the --kl-divergence-base run (perplexity(), 2024-2026):
#   LOG_INF("Final estimate: PPL = %.4lf +/- %.5lf\n", ppl, nll2*ppl);
# The KL run's "Mean PPL(base)" is not it: it reads the base's log-probabilities back from the
# 16-bit file, where anything more than 16 below the top logit is clamped (a made model's real
# next tokens often are, so that figure is far too low for it).
_BASE_PPL = re.compile(r"Final estimate: PPL = ([\d.]+)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quant", default="Q4_K_M", help="the variant's quantization (default Q4_K_M)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--corpus", default=None, help="UTF-8 text (default: the packaged corpus)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-exact", dest="exact", action="store_false",
                        help="skip keeping every log-probability (the exact KL next to the compact one)")
    args = parser.parse_args()
    from dataclasses import replace

    from tuner.engine.base import BenchSpec
    from tuner.engine.python import TrialRunner
    from tuner.engine.scoring import load
    from tuner.engine.settings import Settings
    from tuner.search.quality import default_corpus, quality
    from tuner.testing import DEMO_SHAPE, build_against_llama_cpp, llama_cpp_env, llama_cpp_source, make_model, quantize

    source = llama_cpp_source()
    if source is None:
        print("llama.cpp sources not found: set LLAMA_CPP_SOURCE to an unpacked llama-cpp-python sdist's vendor/llama.cpp")
        return 2
    corpus = Path(args.corpus) if args.corpus else default_corpus()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = str(Path(tmp) / "home")
        started = time.perf_counter()
        tool_dir = source / "tools" / "perplexity"
        perplexity = build_against_llama_cpp("llama-perplexity", [tool_dir / "perplexity.cpp", tool_dir / "main.cpp"],
                                             Path(tmp) / "bin", source=source, optimize="-O2")
        print(f"built llama-perplexity in {time.perf_counter() - started:.0f} s")
        shape = replace(DEMO_SHAPE, name="quality benchmark")
        ref = make_model(Path(tmp) / "bench-F16.gguf", shape, output_std=5 / math.sqrt(shape.n_embd))
        var = quantize(ref, Path(tmp) / f"bench-{args.quant}.gguf", args.quant)
        common = ["-f", str(corpus), "-c", str(args.ctx), "--chunks", str(args.chunks), "-b", str(args.ctx),
                  "-t", str(args.threads), "-ngl", "0"]
        kld = Path(tmp) / "ref.kld"
        theirs_s: dict[str, float] = {}
        outputs: dict[str, str] = {}
        for name, model, extra in (("reference", ref, ["--kl-divergence-base", str(kld)]),
                                   ("variant", var, ["--kl-divergence-base", str(kld), "--kl-divergence"])):
            t0 = time.perf_counter()
            proc = subprocess.run([str(perplexity), "-m", str(model), *common, *extra], capture_output=True, text=True,
                                  env=llama_cpp_env(), timeout=3600)
            theirs_s[name] = time.perf_counter() - t0
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-2000:])
                return 1
            outputs[name] = proc.stdout + proc.stderr
        output = outputs["variant"]
        theirs = {k: float(m[1]) for k, r in _LINES.items() if (m := r.search(output))}
        base = _BASE_PPL.search(outputs["reference"])
        if len(theirs) != len(_LINES) or base is None:
            print("could not read llama-perplexity's summary:\n" + output[-3000:])
            return 1
        theirs["top1"] /= 100.0
        theirs["ppl_base"] = float(base[1])
        theirs["ppl_ratio"] = theirs["ppl"] / theirs["ppl_base"]

        t0 = time.perf_counter()
        report = quality(ref, variants=[var], corpus=corpus, n_ctx=args.ctx, chunks=args.chunks, n_gpu_layers=0,
                         n_threads=args.threads, exact=args.exact)
        ours_total = time.perf_counter() - t0
        v, r = report.variants[var.name], report.variants[ref.name]
        ours = {"kl_mean": v.kl_mean, "ppl": v.ppl, "ppl_base": r.ppl, "ppl_ratio": v.ppl_ratio, "top1": v.top1_agreement}

        print(f"\nmodel: demo shape ({shape.n_layer} layers, n_embd {shape.n_embd}, vocab {shape.n_vocab}), F16 reference, "
              f"{args.quant} variant; corpus {corpus.name} ({report.corpus_tokens} tokens); ctx {args.ctx}, "
              f"{args.chunks} chunks, {report.scored_tokens} tokens scored")
        print(f"{'':14} {'offload-tuner':>14} {'llama-perplexity':>17} {'relative diff':>14}")
        worst = 0.0
        for key, label in (("kl_mean", "KL mean"), ("ppl", "PPL variant"), ("ppl_base", "PPL reference"),
                           ("ppl_ratio", "PPL ratio"), ("top1", "top-1 agreement")):
            diff = (ours[key] - theirs[key]) / theirs[key] if theirs[key] else float("nan")
            if key in ("kl_mean", "ppl", "ppl_base"):
                worst = max(worst, abs(diff))
            print(f"{label:14} {ours[key]:14.6f} {theirs[key]:17.6f} {diff * 100:+13.3f}%")
        print(f"worst of KL mean and perplexities: {worst * 100:.3f}% (target: within 1%)")
        print(f"(llama-perplexity's own PPL(base) {theirs['ppl_base_16bit']:.6f} and ratio {theirs['ppl_ratio_16bit']:.6f} "
              "come from its 16-bit file, clamped 16 below the top logit; the reference's exact PPL is from its base run)")
        if v.kl_exact is not None:
            print(f"KL from the compact cache {v.kl_mean:.6f} vs from every log-probability {v.kl_exact:.6f}: "
                  f"{(v.kl_mean - v.kl_exact) / v.kl_exact * 100:+.4f}%")
        _, meta = load(report.cache_path)
        print(f"cache: {meta['compact_bytes'] / 1024:.0f} KiB of compact reference distributions for {report.scored_tokens} "
              f"tokens, {meta['mean_entries']:.0f} of {shape.n_vocab} tokens kept per position on average "
              f"(llama-perplexity's 16-bit file: {kld.stat().st_size / 1024:.0f} KiB)")

        # What one variant's quality costs next to one speed trial of it.
        settings = Settings(model_path=str(var), n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=args.threads,
                            n_threads_batch=args.threads)
        t0 = time.perf_counter()
        with TrialRunner(timeout_s=1800) as runner:
            trial = runner.run(settings, BenchSpec())
        trial_s = time.perf_counter() - t0
        print(f"\none variant's quality pass: {v.seconds:.1f} s ({args.chunks} chunks of {args.ctx}; llama-perplexity "
              f"took {theirs_s['variant']:.1f} s for the same); the reference's pass is paid once and cached")
        print(f"one speed trial of it (pp512 + tg128, 3 repetitions, a fresh worker): {trial_s:.1f} s "
              f"(tg {trial.tg.median if trial.tg else float('nan'):.1f} t/s)")
        print(f"ratio quality / trial: {v.seconds / trial_s:.2f}   (the whole quality() call, reference included: "
              f"{ours_total:.1f} s)")
        return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
