"""Tuned for one user or for four: the best settings side by side on the simulated GPU machines.

On each machine of ``benchmarks/search_at_scale.py`` (``tuner.machine.simulated``: the roofline engine
with vendor device figures, batched decode modelled as llama-batched-bench measures it: the weights
read once per step for the N tokens, each sequence's own cache read for its token), the real
``Tuner`` runs twice with the same budget and seed:

- ``--users 1`` (today's default), objective ``tg``;
- ``--users 4``, objective ``aggregate`` (``--min-ctx`` is each user's context: the context is 4x).

It prints each winner's settings and its noiseless figures at 4 users (aggregate t/s, per user,
time to the first token of a 512-token prompt for the four), and what the one-user profile loses
serving four: exported with ``-np 4`` and the same ``-c`` (each user then gets a quarter of the
context it was tuned for), and with ``-c`` x 4 (each user the context it was tuned for; "out of
memory" where that does not fit). Noiseless figures (``RooflineEngine.speed``), so the comparison
is not blurred by the simulated drift.

    python benchmarks/users_at_scale.py [--trials 30] [--machines 24gb-70b,...] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def at_users(engine: Any, s: Any, bench: Any) -> dict[str, Any]:
    """Noiseless figures of ``s`` serving ``bench.users``; ``oom`` naming the device that overflows."""
    over = engine.out_of_memory(engine.memory(s))
    if over is not None:
        return {"oom": over}
    pp, tg = engine.speed(s, bench)
    users = bench.users
    return {"aggregate_tg": tg, "per_user_tg": tg / users, "ttft_s": users * bench.n_prompt / pp if pp else None}


def describe(s: Any) -> str:
    from pathlib import Path as P

    return (f"{P(s.model_path).name} ngl={s.n_gpu_layers} c={s.n_ctx} ub={s.n_ubatch} fa={s.flash_attn} kv={s.type_k}"
            f"{' nkvo' if not s.offload_kqv else ''}{' -ot ' + str(len(s.tensor_overrides)) if s.tensor_overrides else ''}"
            f"{' ncmoe=' + str(s.n_cpu_moe) if s.n_cpu_moe else ''}{' ts=' + ','.join(f'{x:g}' for x in s.tensor_split) if s.tensor_split else ''}"
            f" np={s.n_parallel}{' kvu' if s.kv_unified else ''}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--machines", default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = tmp
        import optuna

        from tuner.engine.base import BenchSpec
        from tuner.engine.settings import Settings
        from tuner.machine.simulated import SIMULATED
        from tuner.search.study import Tuner

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        names = args.machines.split(",") if args.machines else list(SIMULATED)
        out: dict[str, Any] = {}
        n = args.users
        for name in names:
            sim = SIMULATED[name]
            winners = {}
            for users, objective in ((1, "tg"), (n, "aggregate")):
                engine = sim.engine(seed=args.seed)
                tuner = Tuner(sim.main, variants=sim.variants, infos=sim.models, machine=sim.machine(), engine=engine,
                              trials=args.trials, min_ctx=sim.min_ctx, depth=sim.depth, seed=args.seed, users=users,
                              objective=objective, storage=optuna.storages.InMemoryStorage(),
                              study_name=f"{name}-{users}", out=Path(tmp) / f"{name}-{users}.json")
                result = tuner.run()
                winners[users] = Settings.from_dict(result.best["settings"])
            engine = sim.engine(seed=args.seed)
            bench = BenchSpec(n_prompt=512, n_gen=128, depth=sim.depth, users=n)
            one, many = winners[1], winners[n]
            row = {
                "one_user_winner": describe(one),
                f"{n}_user_winner": describe(many),
                f"{n}_user_winner_at_{n}": at_users(engine, many, bench),
                "one_user_winner_at_1": at_users(engine, one, BenchSpec(n_prompt=512, n_gen=128, depth=sim.depth)),
                f"one_user_winner_at_{n}_same_ctx": at_users(engine, one.replace(n_parallel=n), bench),
                f"one_user_winner_at_{n}_ctx_x{n}": at_users(engine, one.replace(n_parallel=n, n_ctx=one.n_ctx * n), bench),
            }
            best = row[f"{n}_user_winner_at_{n}"].get("aggregate_tg")
            for key in (f"one_user_winner_at_{n}_same_ctx", f"one_user_winner_at_{n}_ctx_x{n}"):
                got = row[key].get("aggregate_tg")
                row[key]["vs_tuned_for_%d" % n] = got / best if got and best else None
            out[name] = row
            if not args.json:
                print(f"== {name}: {args.trials} trials each, seed {args.seed}")
                print(f"  tuned for 1 user : {row['one_user_winner']}")
                print(f"  tuned for {n} users: {row[f'{n}_user_winner']}")
                for key, label in ((f"{n}_user_winner_at_{n}", f"{n}-user winner serving {n}"),
                                   ("one_user_winner_at_1", "1-user winner serving 1"),
                                   (f"one_user_winner_at_{n}_same_ctx", f"1-user winner serving {n}, same -c"),
                                   (f"one_user_winner_at_{n}_ctx_x{n}", f"1-user winner serving {n}, -c x{n}")):
                    f = row[key]
                    if "oom" in f:
                        print(f"  {label:<34}: out of memory on {f['oom']}")
                        continue
                    ratio = f.get(f"vs_tuned_for_{n}")
                    print(f"  {label:<34}: aggregate {f['aggregate_tg']:8.1f} t/s, per user {f['per_user_tg']:7.1f} t/s, "
                          f"TTFT {f['ttft_s']:.2f} s" + (f"  ({ratio:.2f} x the {n}-user profile)" if ratio else ""))
        if args.json:
            print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
