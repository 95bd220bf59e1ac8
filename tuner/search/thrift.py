"""Spending less of the user's time on what cannot change the answer.

A trial's time on a big model is its load and its repetitions, and most candidates of a search are
clearly slower than the leader after one repetition. Two rules, both measured on the simulated
machines (``benchmarks/search_at_scale.py``: the wall clock to the final profile, the final
ratio kept >= 0.98 of the optimum):

- ``stop_rule``: a trial stops repeating once its rank is settled (``tuner.engine.base.StopRule``):
  every repetition so far below ``1 - BEHIND`` of the leader's figure, or its repetitions agreeing
  within ``AGREE`` while below the leader. The leader, and anything near it, runs every repetition.
  ``BEHIND`` is wider than the drift of a shared machine (speed wanders 10-25% over seconds; the
  simulation's noise band is 20%), so a candidate as fast as the leader is never cut by a slow
  moment.
- ``group_by_model``: the seeds that open a study ordered so that one model file's run together
  and those sharing model-level settings ride on one load.
- ``within_noise``: of the leading candidates, only those whose figure is within noise of the
  leader's are measured again; when none is, the ranking is clear and nothing is re-measured.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..engine.base import BenchSpec, StopRule

# the objectives a single repetition can be scored by (StopRule.score); any other runs every repetition
PER_REPETITION = ("tg", "pp", "mixed")

# A trial whose every repetition scores below (1 - BEHIND) x the leader stops repeating.
BEHIND = 0.25
# Repetitions agreeing within this (relative) settle a trial's rank below the leader.
AGREE = 0.02
# A candidate is within noise of the leader when its figure is within NEAR (relative) of the
# leader's, or when their intervals overlap.
NEAR = 0.10


def stop_rule(objective: str, bench: BenchSpec, leader: float | None) -> StopRule | None:
    """The rule for the next trial, given the leader's figure so far (None: no leader yet, so
    every repetition runs)."""
    if leader is None or leader <= 0 or bench.repetitions <= 1 or objective not in PER_REPETITION:
        return None
    return StopRule(objective=objective, below=leader * (1 - BEHIND), leader=leader, n_prompt=bench.n_prompt,
                    n_gen=bench.n_gen, agree=AGREE)


def within_noise(contenders: Sequence[Any], objective: str) -> list[Any]:
    """The contenders (the leader first, in the order given) worth measuring again: the leader and
    those within noise of it. Just the leader: the ranking is clear."""
    if not contenders:
        return []
    leader = contenders[0]
    key = "pp" if objective == "pp" else "tg"
    lead_stats = getattr(leader, key) or {}
    out = [leader]
    for c in contenders[1:]:
        stats = getattr(c, key) or {}
        near = c.value >= leader.value * (1 - NEAR)
        overlap = bool(stats and lead_stats) and stats.get("ci_high", 0) >= lead_stats.get("ci_low", float("inf"))
        if near or (objective in ("tg", "pp") and overlap):
            out.append(c)
    return out


def group_by_model(seeds: Sequence[Any]) -> list[Any]:
    """Seeds (``Settings``) in an order that spends fewer loads: those of one model file together
    (it stays in the page cache), and within a file those sharing the model-level settings
    (``model_key``) one after another, so a worker that keeps its model loaded (the python engine)
    measures them on one load. Otherwise the order is kept: the first seed stays first."""
    first_path: dict[str, int] = {}
    first_key: dict[tuple, int] = {}
    for i, s in enumerate(seeds):
        first_path.setdefault(s.model_path, i)
        first_key.setdefault(s.model_key, i)
    order = sorted(range(len(seeds)), key=lambda i: (first_path[seeds[i].model_path], first_key[seeds[i].model_key], i))
    return [seeds[i] for i in order]


__all__ = ["AGREE", "BEHIND", "NEAR", "group_by_model", "stop_rule", "within_noise"]
