"""What every engine speaks: what a trial measures (``BenchSpec``), what it found (``TrialResult``,
``Stats``). Light: the search and the profile read these without starting any llama.cpp.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from ..model.estimate import CPU
from .logparse import LoadReport, parse_log
from .outcome import Outcome
from .settings import Settings

CONFIDENCE = 0.95


def median_interval(values: list[float] | tuple[float, ...], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: two of the samples themselves.

    With the samples sorted, ``[x_(j), x_(n+1-j)]`` holds the true median with probability
    ``1 - 2 P(B < j)``, ``B ~ Binomial(n, 1/2)``, whatever the distribution (the order-statistic
    interval); ``j`` is the largest that keeps that at ``confidence`` or more. Why this and not
    ``mean +- t sd / sqrt(n)``: speed samples are skewed (one stalled run on a busy machine), and with
    three samples such as [1.4, 900, 929] the t interval reached -1,100 t/s, below any possible speed.
    This one never leaves the samples' range, describes the median the profile reports, needs no
    random resampling (a bootstrap of three samples is no better and not reproducible), and is exact.
    Below 6 samples no pair reaches 95%; it is then the samples' range, whose coverage is
    ``1 - 2^(1-n)`` (75% for 3 samples, 94% for 5).
    """
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("no samples")
    j = 1
    below = 1  # sum of C(n, i) for i < j: the count of outcomes with fewer than j successes
    while j < (n + 1) // 2:
        below_next = below + math.comb(n, j)
        if 1 - 2 * below_next / 2 ** n < confidence:
            break
        j, below = j + 1, below_next
    return ordered[j - 1], ordered[n - j]


@dataclass(frozen=True)
class BenchSpec:
    """What a trial measures (llama-bench's -p, -n, -d, -r)."""

    n_prompt: int = 512
    n_gen: int = 128
    depth: int = 0
    repetitions: int = 3
    warmup: bool = True
    seed: int = 1234

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Stats:
    """Tokens/sec over repetitions: every sample kept."""

    samples: tuple[float, ...]
    median: float
    mean: float
    stddev: float
    ci_low: float  # 95% confidence interval of the median (see median_interval): within the samples' range
    ci_high: float

    @classmethod
    def of(cls, samples: list[float] | tuple[float, ...]) -> "Stats | None":
        if not samples:
            return None
        values = tuple(float(x) for x in samples)
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        low, high = median_interval(values)
        return cls(values, statistics.median(values), mean, sd, low, high)

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "mean": self.mean, "stddev": self.stddev,
                "ci_low": self.ci_low, "ci_high": self.ci_high, "samples": list(self.samples)}


@dataclass
class TrialResult:
    outcome: Outcome
    message: str
    settings: Settings
    bench: BenchSpec
    pp: Stats | None = None
    tg: Stats | None = None
    load: LoadReport = field(default_factory=lambda: parse_log(""))
    log: str = ""
    peak_rss: int | None = None
    peak_vram: dict[str, int] = field(default_factory=dict)
    signal: str | None = None
    returncode: int | None = None
    wall_s: float = 0.0
    load_s: float = 0.0
    reused_model: bool = False

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    def actual_memory(self) -> dict[str, dict[str, int]]:
        """Per device, what llama.cpp allocated: ``{device: {weights, kv, compute}}`` in bytes, the
        host's buffer labels (``CPU_Mapped``, ``CUDA_Host``, ``AMX``...) folded into ``CPU``."""
        out: dict[str, dict[str, int]] = {}
        for label, size in self.load.model_buffers.items():
            device = CPU if label.startswith("CPU") or label in ("AMX", "CUDA_Host") else label
            out.setdefault(device, {"weights": 0, "kv": 0, "compute": 0})["weights"] += size
        for kind, buffers in (("kv", self.load.kv_buffers), ("compute", self.load.compute_buffers)):
            for label, size in buffers.items():
                device = CPU if label.startswith("CPU") or label == "CUDA_Host" else label
                out.setdefault(device, {"weights": 0, "kv": 0, "compute": 0})[kind] += size
        return out

    def to_dict(self, *, include_log: bool = False) -> dict[str, Any]:
        out = {
            "outcome": self.outcome.value,
            "message": self.message,
            "settings": self.settings.to_dict(),
            "bench": self.bench.to_dict(),
            "pp": self.pp.to_dict() if self.pp else None,
            "tg": self.tg.to_dict() if self.tg else None,
            "load": self.load.to_dict(),
            "peak_rss": self.peak_rss,
            "peak_vram": self.peak_vram,
            "signal": self.signal,
            "returncode": self.returncode,
            "wall_s": self.wall_s,
            "load_s": self.load_s,
            "reused_model": self.reused_model,
        }
        if include_log:
            out["log"] = self.log
        return out


__all__ = ["BenchSpec", "Stats", "TrialResult", "median_interval"]
