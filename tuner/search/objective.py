"""What the search maximizes, in tokens/sec."""

from __future__ import annotations

from ..engine.base import BenchSpec, Stats

OBJECTIVES = ("tg", "pp", "mixed")


def score(objective: str, pp: Stats | None, tg: Stats | None, bench: BenchSpec) -> float:
    """``tg``: generation speed; ``pp``: prompt speed; ``mixed``: the throughput of one request of
    ``bench.n_prompt`` prompt tokens and ``bench.n_gen`` generated ones."""
    if objective == "tg":
        return tg.median if tg else 0.0
    if objective == "pp":
        return pp.median if pp else 0.0
    seconds = (bench.n_prompt / pp.median if pp and pp.median else 0.0) + (bench.n_gen / tg.median if tg and tg.median else 0.0)
    return (bench.n_prompt + bench.n_gen) / seconds if seconds else 0.0
