"""A trustworthy winner: the leading candidates measured again, side by side, before one is chosen.

A first measurement of a few repetitions is noisy, and the top of a noisy ranking is biased upwards.
So the leading candidates are measured again with more repetitions and the winner is chosen on those
figures. On a shared machine speed drifts over seconds, so the candidates share the same seconds:
all loaded in one worker and measured in rotating rounds when they fit in memory together (the
engine's ``run_paired``), else one after another in alternating rounds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..engine.base import BenchSpec, Stats, TrialResult
from ..engine.settings import Settings
from .interrupt import CtrlC
from .objective import score, stat_key


@dataclass
class Contender:
    """One leading candidate of the study, with its figures (the study's, or the re-measure's)."""

    number: int  # the study's trial number
    settings: Settings
    pp: dict[str, Any] | None
    tg: dict[str, Any] | None
    value: float
    predicted: dict[str, Any] = field(default_factory=dict)
    actual: dict[str, Any] = field(default_factory=dict)
    layers: list[Any] = field(default_factory=lambda: [None, None])
    remeasured: bool = False

    @classmethod
    def from_trial(cls, t: Any) -> "Contender":
        """From a completed Optuna trial of the study (its user attributes)."""
        a = t.user_attrs
        return cls(number=t.number, settings=Settings.from_dict(a["settings"]), pp=_restat(a.get("pp")), tg=_restat(a.get("tg")),
                   value=t.value, predicted=a.get("predicted", {}), actual=a.get("actual", {}),
                   layers=a.get("layers", [None, None]))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["settings"] = self.settings.to_dict()
        return out


class Remeasure:
    """Measures contenders again: ``repetitions`` samples each, spread over ``rounds`` rounds."""

    def __init__(self, engine: Any, *, objective: str, bench: BenchSpec, repetitions: int, rounds: int,
                 fit_together: Callable[[Sequence[Settings]], bool], emit: Callable[[dict[str, Any]], None] = lambda e: None) -> None:
        self.engine = engine
        self.objective = objective
        self.rounds = max(1, min(rounds, repetitions))
        per_round = max(1, math.ceil(repetitions / self.rounds))
        self.final = dataclasses.replace(bench, repetitions=per_round)  # the same workload, fewer samples per round
        self.fit_together = fit_together
        self.emit = emit

    def run(self, contenders: list[Contender], ctrl_c: CtrlC) -> tuple[list[Contender], bool]:
        """The contenders with their re-measured figures where the re-measure ran; and whether it was
        interrupted (Ctrl-C): then what was measured so far is kept."""
        samples: dict[int, dict[str, list[float]]] = {c.number: {"pp": [], "tg": []} for c in contenders}
        last: dict[int, TrialResult] = {}
        settings = [c.settings for c in contenders]
        # An engine that loads the candidates together (the python worker) needs them to fit at once;
        # one that runs them one at a time in rotating rounds (llama-bench, the fake) does not.
        paired = len(contenders) > 1 and (not getattr(self.engine, "loads_candidates_together", True)
                                          or self.fit_together(settings))
        self.emit({"kind": "remeasure", "candidates": [c.number for c in contenders], "rounds": self.rounds,
                   "repetitions": self.rounds * self.final.repetitions, "paired": paired})
        interrupted = False
        try:
            if paired:
                # measured within the same seconds, round after round
                with ctrl_c.immediate():
                    results = self.engine.run_paired(settings, self.final, rounds=self.rounds)
                if not all(r.ok for r in results):
                    self.emit({"kind": "paired_failed", "message": results[0].message})
                    paired = False
                else:
                    for c, r in zip(contenders, results):
                        last[c.number] = r
                        samples[c.number] = {"pp": list(r.pp.samples) if r.pp else [], "tg": list(r.tg.samples) if r.tg else []}
            if not paired:
                for _ in range(self.rounds):
                    for c in contenders:
                        with ctrl_c.immediate():
                            again = self.engine.run(c.settings, self.final, trial_id=f"final-{c.number}")
                        if again.ok:
                            last[c.number] = again
                            samples[c.number]["pp"] += list(again.pp.samples) if again.pp else []
                            samples[c.number]["tg"] += list(again.tg.samples) if again.tg else []
        except KeyboardInterrupt:
            interrupted = True
        out = []
        for c in contenders:
            got = samples[c.number]
            if c.number in last and (got["tg"] or got["pp"]):
                pp, tg = Stats.of(got["pp"]), Stats.of(got["tg"])
                c = dataclasses.replace(c, pp=pp.to_dict() if pp else None, tg=tg.to_dict() if tg else None,
                                        value=score(self.objective, pp, tg, self.final), remeasured=True)
            out.append(c)
        return out, interrupted


def _restat(stats: dict[str, Any] | None) -> dict[str, Any] | None:
    """The figures of a recorded trial worked out again from its samples: a study written by an
    older version holds intervals that could leave the samples' range (below 0 t/s)."""
    if not stats or not stats.get("samples"):
        return stats
    fresh = Stats.of(stats["samples"])
    return fresh.to_dict() if fresh else stats


def pick_winner(contenders: Sequence[Contender], objective: str) -> tuple[Contender, Contender | None]:
    """The best contender (re-measured ones first), and the runner-up when it is within noise: its
    confidence interval reaches the winner's."""
    measured = [c for c in contenders if c.remeasured] or list(contenders)
    measured = sorted(measured, key=lambda c: c.value, reverse=True)
    best = measured[0]
    if len(measured) > 1:
        key = stat_key(objective)
        second = measured[1]
        win, sec = getattr(best, key) or {}, getattr(second, key) or {}
        if win and sec and sec.get("ci_high", 0) >= win.get("ci_low", math.inf):
            return best, second
    return best, None
