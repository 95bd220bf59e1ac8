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

# two-sided 95% Student t quantiles by degrees of freedom (1..30); beyond, the normal's 1.96
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


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
    ci_low: float  # 95% confidence interval of the mean
    ci_high: float

    @classmethod
    def of(cls, samples: list[float] | tuple[float, ...]) -> "Stats | None":
        if not samples:
            return None
        values = tuple(float(x) for x in samples)
        mean = statistics.fmean(values)
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        t = _T95[min(len(values) - 2, len(_T95) - 1)] if len(values) > 1 else 0.0
        if len(values) > 31:
            t = 1.96
        half = t * sd / math.sqrt(len(values))
        return cls(values, statistics.median(values), mean, sd, mean - half, mean + half)

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


__all__ = ["BenchSpec", "Stats", "TrialResult"]
