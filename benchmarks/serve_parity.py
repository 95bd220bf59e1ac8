"""A profile tuned for four users, served by llama-server: memory and aggregate speed against the profile.

For a dense and a sliding-window model made here, ``tune --users 4 --objective aggregate`` (the python
engine) writes a profile; its exported llama-server command (``offload-tuner profile args P --for
llama-server``, the line a user pastes) is started for real, llama-server built from the same llama.cpp
sources and linked to the same libraries as llama-cpp-python (``tuner.testing.build_llama_server``).
Four ``/completion`` requests are then sent at once, round after round (the first round warms up), each
a prompt of the workload's P random tokens generating exactly its G tokens. The default P (128) keeps
the four prompts within one batch (N x P <= n_batch), so the server processes them together and its
slots step together, as llama-batched-bench's rows do (with longer prompts llama-server starts
generating for the first slots while later prompts are still processed: another quantity). Printed
per model:

- the KV cache and compute buffers llama-server allocated (its log) against the memory arithmetic's
  prediction the profile records, with their ratios, and the server's resident memory against the
  prediction's total (the server adds its own code and HTTP threads: said as the difference);
- the aggregate generation speed (the sum of the four users' speeds as llama-server's ``timings``
  report them; the slots step together) against the profile's aggregate figure and its interval;
  each user's speed and the time to the first token against the profile's.

The tune and the server run one after the other; this machine's speed drifts 10-25% over seconds, so
besides the profile's interval each server round is paired with the profile's settings measured again
by the python engine right after it (one repetition, the tune's own measurement), and the median of
those ratios is printed too. ``--rounds`` sets how many rounds.

    LLAMA_CPP_SOURCE=.../llama_cpp_python-0.3.36/vendor/llama.cpp python benchmarks/serve_parity.py
    python benchmarks/serve_parity.py --rounds 9 --workdir /tmp/serve   # keeps the build between runs
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7, help="rounds of --users requests (after one that warms up)")
    parser.add_argument("--n-prompt", type=int, default=128)
    parser.add_argument("--n-gen", type=int, default=64)
    parser.add_argument("--models", default="dense,swa")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the build and models here between runs")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="serve-parity-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OFFLOAD_TUNER_HOME", str(work / "home"))
    import optuna

    from tuner.engine.base import BenchSpec
    from tuner.engine.logparse import parse_log
    from tuner.engine.python import TrialRunner
    from tuner.search.study import tune
    from tuner.testing import LlamaServer, ModelShape, build_llama_server, llama_cpp_env, make_model

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    started = time.perf_counter()
    server_bin = build_llama_server(work / "bin")
    print(f"llama-server {server_bin} built (or reused) in {time.perf_counter() - started:.0f} s, "
          "from the llama.cpp sources of llama-cpp-python, linked to its libraries", flush=True)
    # big enough that a decode step takes tens of milliseconds, as a real model's does: on a 4-layer toy
    # model a step is ~5 ms and llama-server's own work per step (its slots, sampling) shows as a loss
    shapes = {
        "dense": ModelShape(n_layer=8, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, n_vocab=8192, n_ctx_train=8192),
        # gemma3-style: 5 of 6 layers attend to a 256-token window
        "swa": ModelShape(architecture="gemma3", n_layer=6, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, n_vocab=8192,
                          n_ctx_train=8192, sliding_window=256, swa_period=6),
    }
    n, P, G = args.users, args.n_prompt, args.n_gen
    worst = 0.0
    for name in args.models.split(","):
        shape = shapes[name]
        path = work / f"{name}.gguf"
        if not path.exists():
            make_model(path, shape)
        out = work / f"{name}-{n}users.json"
        result = tune(str(path), users=n, objective="aggregate", trials=args.trials, min_ctx=2 * (P + G), n_prompt=P,
                      n_gen=G, repetitions=3, out=out, measure_quality=False, study_name=f"serve-parity-{name}-{os.getpid()}")
        profile = result.profile
        line = subprocess.run([sys.executable, "-m", "tuner", "profile", "args", str(out), "--for", "llama-server",
                               "--model", str(path)], capture_output=True, text=True, check=True).stdout.strip()
        words = shlex.split(line.splitlines()[-1])
        flags = words[1:] if words and words[0].endswith("llama-server") else words
        print(f"== {name}: {line.splitlines()[-1]}", flush=True)
        # -lv 4: llama-server prints llama.cpp's load log (the buffers) only from this verbosity on
        server = LlamaServer(server_bin, [*flags, "-lv", "4"], env=llama_cpp_env())
        rounds, now = [], []
        try:
            server.complete_together(n, P, G, n_vocab=shape.n_vocab, seed=0)  # warms up
            # each round of the server followed by the profile's settings measured again by the python
            # engine (the tune's own measurement, one repetition): the pair sees the same machine
            with TrialRunner(timeout_s=600) as runner:
                for r in range(args.rounds):
                    rounds.append(server.complete_together(n, P, G, n_vocab=shape.n_vocab, seed=r + 1))
                    again = runner.run(profile.settings, BenchSpec(n_prompt=P, n_gen=G, repetitions=1, users=n))
                    now.append(again.tg.median if again.ok and again.tg else float("nan"))
            rss = server.rss()
            log = server.log
        finally:
            server.close()
        bad = [r for r in rounds if r.prompt_n != [P] * n or r.predicted_n != [G] * n]
        if bad:
            print(f"   the server did not process the requests as sent: prompt_n {bad[0].prompt_n}, predicted_n {bad[0].predicted_n}")
            return 1
        load = parse_log(log)
        kv, compute = sum(load.kv_buffers.values()), sum(load.compute_buffers.values())
        predicted = profile.memory.predicted
        kv_est, compute_est = sum(m.kv for m in predicted.values()), sum(m.compute for m in predicted.values())
        total_est = sum(m.need for m in predicted.values())
        print(f"   KV cache  : llama-server {kv / MiB:8.2f} MiB, arithmetic {kv_est / MiB:8.2f} MiB, ratio {kv / kv_est:.3f}")
        print(f"   compute   : llama-server {compute / MiB:8.2f} MiB, arithmetic {compute_est / MiB:8.2f} MiB, "
              f"ratio {compute / compute_est:.3f}")
        print(f"   resident  : llama-server {rss / MiB:8.1f} MiB, arithmetic's total {total_est / MiB:8.1f} MiB "
              f"(+{(rss - total_est) / MiB:.1f} MiB: the server's code, libraries and threads)")
        # the rounds whose slots stepped together (one request can reach the server a moment before
        # the others and start alone); the profile's figure is batched-bench's, every slot decoding
        paired = [(r.aggregate_tg, x) for r, x in zip(rounds, now) if r.overlap >= 0.9 and x == x]
        together = [r for r in rounds if r.overlap >= 0.9] or rounds
        agg = statistics.median(r.aggregate_tg for r in together)
        per_user = statistics.median(statistics.median(r.per_user_tg) for r in together)
        ttft = statistics.median(max(r.ttft_s) for r in together)
        w = profile.workload
        a = w.aggregate_tg
        inside = a.ci_low <= agg <= a.ci_high
        worst = max(worst, abs(agg / a.median - 1))
        print(f"   aggregate : llama-server {agg:8.1f} t/s, median of the {len(together)} of {len(rounds)} rounds whose slots "
              f"stepped together (rounds: {', '.join(f'{r.aggregate_tg:.1f}@{r.overlap:.2f}' for r in rounds)}, t/s@overlap)")
        print(f"               profile      {a.median:8.1f} t/s [{a.ci_low:.1f}, {a.ci_high:.1f}]: ratio {agg / a.median:.3f}, "
              f"{'within' if inside else 'OUTSIDE'} the interval")
        if paired:
            ratio = statistics.median(a / b for a, b in paired)
            worst_paired = max(abs(a / b - 1) for a, b in paired)
            print(f"   paired    : the profile's settings measured again after each round (python engine): "
                  f"{statistics.median(b for _, b in paired):.1f} t/s; llama-server / that, median over {len(paired)} "
                  f"rounds {ratio:.3f} (furthest round {worst_paired:.3f} from 1)")
        if w.per_user_tg is not None:
            print(f"   per user  : llama-server {per_user:8.1f} t/s, profile {w.per_user_tg.median:.1f} t/s: "
                  f"ratio {per_user / w.per_user_tg.median:.3f}")
        if w.ttft_s is not None:
            print(f"   first tok : llama-server {ttft * 1000:8.1f} ms (the last user's prompt_ms, {n} prompts together), profile "
                  f"{w.ttft_s.p50 * 1000:.1f} ms: ratio {ttft / w.ttft_s.p50:.3f}")
    print(f"largest aggregate deviation from the profile: {worst:.3f}; {time.perf_counter() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
