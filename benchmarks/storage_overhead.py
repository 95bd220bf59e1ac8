"""What does a team's PostgreSQL study store cost the tuner, next to the default SQLite file?

Runs the same 30-trial study of the demo model (its two quantizations) once on a fresh SQLite
file and once on a fresh PostgreSQL database (a throwaway server on 127.0.0.1 started here, with
fsync on as a team's server runs; a real one across a LAN adds its round trips), in alternating
order over several rounds
(paired: speed on a shared machine drifts over seconds). For each run it splits the tuner's wall
time into time inside the trials (the engine's ``run`` and ``run_paired``: llama.cpp, or the
scripted engine) and everything else: the study store (heartbeats, recovery sweeps, every
ask/tell and attribute write), Optuna's sampler, the memory checks, the profile. The store is the
only difference between the two columns. Prints each round, the medians, and PostgreSQL's extra
seconds and ratio.

    python benchmarks/storage_overhead.py                      # real llama.cpp trials (minutes)
    python benchmarks/storage_overhead.py --engine scripted    # the scripted engine: store and loop only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


class Stopwatch:
    """An engine that times what the engine it wraps spends inside trials."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.inside = 0.0

    def run(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self.inner.run(*args, **kwargs)
        finally:
            self.inside += time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)  # AttributeError when the engine has no such thing
        if name != "run_paired":
            return attribute

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                self.inside += time.perf_counter() - started

        return timed

    def close(self) -> None:
        self.inner.close()


def one_run(models: list[Path], storage: str, trials: int, engine_kind: str, out: Path) -> tuple[float, float, int]:
    """(wall seconds, seconds inside trials, trials run) of one tune."""
    from tuner.engine.python import TrialRunner
    from tuner.search.study import Tuner

    if engine_kind == "scripted":
        from tuner.engine.fake import ScriptedRunner
        from tuner.model.inspect import inspect

        inner: Any = ScriptedRunner({str(p): inspect(p) for p in models})
    else:
        inner = TrialRunner(timeout_s=300)
    engine = Stopwatch(inner)
    started = time.perf_counter()
    # the demo's settings (offload-tuner tune --demo): min_ctx 1024, 256 prompt and 64 generated tokens
    tuner = Tuner(str(models[0]), variants=[str(p) for p in models[1:]], trials=trials, min_ctx=1024, n_prompt=256,
                  n_gen=64, storage=storage, out=out, engine=engine, study_name=f"bench-{uuid.uuid4().hex[:8]}",
                  measure_quality=False)  # the variants' quality pass (once, then cached) is not the store's time
    result = tuner.run()
    wall = time.perf_counter() - started
    engine.close()
    return wall, engine.inside, result.counts["run"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engine", choices=("real", "scripted"), default="real")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = tmp
        os.environ["OFFLOAD_TUNER_LOCK_DIR"] = str(Path(tmp) / "locks")
        from tuner.profile.dburl import redact_url
        from tuner.testing import demo_models, postgres_server

        models = demo_models(Path(tmp) / "models")
        with postgres_server(durable=True) as pg:  # fsync on, as a team's server runs
            rows: dict[str, list[tuple[float, float, int]]] = {"sqlite": [], "postgresql": []}
            for r in range(args.rounds):
                order = ["sqlite", "postgresql"] if r % 2 == 0 else ["postgresql", "sqlite"]
                for kind in order:
                    url = (f"sqlite:///{Path(tmp) / f'studies-{r}.db'}" if kind == "sqlite"
                           else pg.create_database(f"bench_{r}"))
                    wall, inside, run = one_run(models, url, args.trials, args.engine, Path(tmp) / f"{kind}-{r}.json")
                    rows[kind].append((wall, inside, run))
                    print(f"round {r + 1} {kind:10s} {redact_url(url)}: {run} trials, wall {wall:7.2f} s, "
                          f"inside trials {inside:7.2f} s, outside {wall - inside:6.2f} s "
                          f"({1000 * (wall - inside) / max(run, 1):.0f} ms per trial)", flush=True)
    outside = {k: [w - i for w, i, _ in v] for k, v in rows.items()}
    sqlite, postgres = statistics.median(outside["sqlite"]), statistics.median(outside["postgresql"])
    paired = [p - s for p, s in zip(outside["postgresql"], outside["sqlite"])]
    print(f"\n{args.trials}-trial study of the demo model, {args.engine} engine, {args.rounds} rounds (alternating order)")
    print(f"tuner time outside the trials, median: SQLite {sqlite:.2f} s, PostgreSQL {postgres:.2f} s")
    print(f"PostgreSQL - SQLite, paired by round: {', '.join(f'{d:+.2f}' for d in paired)} s "
          f"(median {statistics.median(paired):+.2f} s, {1000 * statistics.median(paired) / args.trials:+.0f} ms per trial); "
          f"ratio {postgres / sqlite:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
