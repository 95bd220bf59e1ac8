"""Where a tune's wall time goes: loading, measuring, quality scoring, re-measuring, the tuner itself.

    ledger = TimeLedger()                 # the clock starts
    ledger.trial(result)                  # a trial's TrialResult: its load_s, the rest of its wall_s
    with ledger.part("quality"): ...      # a block timed whole
    ledger.to_dict()  # {"load_s", "measure_s", "quality_s", "remeasure_s", "tuner_s", "total_s"}

``load_s`` is what the engines report as the model load of each trial (llama.cpp's load, a worker
reusing its model reports 0); ``measure_s`` the rest of each trial's wall time (the process start,
the context, the warm-up, the repetitions); ``quality_s`` and ``remeasure_s`` the quality scoring
and the re-measure of the leaders, whole (their own loads included); ``tuner_s`` everything else
(probing, the memory arithmetic, the sampler, the study's database, quantizing ``--quantize``
variants); ``total_s`` the wall time from the start.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator

PARTS = ("load", "measure", "quality", "remeasure")


class TimeLedger:
    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.started = clock()
        self.seconds = {part: 0.0 for part in PARTS}

    def trial(self, result: Any) -> None:
        """One trial's time, from its result (``wall_s``, ``load_s``)."""
        wall = max(0.0, float(getattr(result, "wall_s", 0.0) or 0.0))
        load = min(wall, max(0.0, float(getattr(result, "load_s", 0.0) or 0.0)))
        self.seconds["load"] += load
        self.seconds["measure"] += wall - load

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time a block as ``name`` (quality, remeasure)."""
        started = self.clock()
        try:
            yield
        finally:
            self.seconds[name] += self.clock() - started

    def to_dict(self) -> dict[str, float]:
        total = self.clock() - self.started
        out = {f"{part}_s": round(self.seconds[part], 3) for part in PARTS}
        out["tuner_s"] = round(max(0.0, total - sum(self.seconds.values())), 3)
        out["total_s"] = round(total, 3)
        return out


def describe(split: dict[str, float]) -> str:
    """``time: 95 s: load 12 s (13%), measure 70 s, ...`` for the end of a tune."""
    total = split.get("total_s") or 0.0

    def part(name: str, key: str) -> str:
        value = split.get(key, 0.0)
        share = f" ({value / total:.0%})" if total > 0 else ""
        return f"{name} {_seconds(value)}{share}"

    return (f"time: {_seconds(total)}: " + ", ".join(part(n, k) for n, k in (
        ("loading", "load_s"), ("measuring", "measure_s"), ("quality", "quality_s"), ("re-measuring", "remeasure_s"),
        ("tuner", "tuner_s"))))


def _seconds(value: float) -> str:
    if value >= 120:
        return f"{value / 60:.1f} min"
    return f"{value:.1f} s"


__all__ = ["PARTS", "TimeLedger", "describe"]
