"""What every engine speaks: the ``Engine`` interface, what a trial measures (``BenchSpec``), what it
found (``TrialResult``, ``Stats``), and what llama.cpp build ran it (``EngineBuild``). Light: the search
and the profile read these without starting any llama.cpp.

An engine runs llama.cpp for the tuner::

    with open_engine("llama-cpp", llama_bin="/opt/llama.cpp/bin") as engine:   # tuner.engine.select
        engine.build()                      # EngineBuild: version, commit, backends, where
        engine.devices()                    # [DeviceInfo]: CUDA0, Vulkan0, MTL0, RPC0[host:port]...
        result = engine.run(settings, BenchSpec(n_prompt=512, n_gen=128))
        result.outcome, result.tg.median, result.load.layers_offloaded   # the load log, parsed
        engine.run_paired([a, b, c], bench, rounds=3)   # side by side, for a fair comparison

Implementations: ``python`` (llama-cpp-python in an isolated worker, ``tuner.engine.python``),
``llama-cpp`` (the user's own llama.cpp binaries, ``tuner.engine.llamacpp``) and the scripted fake
(``tuner.engine.fake``, for tests of the search logic only). One contract suite
(``tests/test_engines.py``) runs against all three.
"""

from __future__ import annotations

import abc
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ..model.estimate import CPU
from .devices import DeviceInfo
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
    """What a trial measures (llama-bench's -p, -n, -d, -r), and for how many users at once.

    ``users`` > 1 measures as llama-batched-bench does (-npp P -ntg G -npl N): N sequences decoded
    together in one batch, the KV cache sized for N; pp and tg are then the aggregate S_PP and S_TG.
    ``min_user_tg`` is the floor each user's own generation speed must reach for the ``aggregate``
    objective (``tuner.search.objective``); it is not measured, so the worker ignores it.

    ``batched`` measures one user that way too (batched-bench's -npl 1 row: generation after the
    prompt, at depth + P), where one user is a point among several counts (``bench --users 1,2,4``,
    the report's curve): llama-bench's tg runs at depth 0, and a curve mixing the two methods
    overstates the one-user point (1.6x on a 4-layer model at P=512)."""

    n_prompt: int = 512
    n_gen: int = 128
    depth: int = 0
    repetitions: int = 3
    warmup: bool = True
    seed: int = 1234
    users: int = 1
    min_user_tg: float | None = None
    batched: bool = False

    @property
    def as_served(self) -> bool:
        """Measured as llama-batched-bench does (N sequences in one batch), not as llama-bench."""
        return self.users > 1 or self.batched

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        # one user with no floor is what every spec was before: left out, a study's name stays the same
        if self.users == 1:
            del out["users"]
        if self.min_user_tg is None:
            del out["min_user_tg"]
        if not self.batched:
            del out["batched"]
        return out

    def ttft(self, pp: "Stats | None") -> "Stats | None":
        """Seconds to the first token per repetition: the N prompts of P tokens, processed together
        at ``depth`` (N*P / S_PP; one user: P / pp)."""
        if pp is None or not self.n_prompt:
            return None
        return Stats.of([self.users * self.n_prompt / x for x in pp.samples if x > 0])


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics (numpy's
    default): p50 is the median, p95 of three samples lies between the two largest."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no samples")
    k = (len(ordered) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass(frozen=True)
class StopRule:
    """When a trial may stop repeating before ``bench.repetitions``: once its figure is clearly
    behind the study's leader (every repetition so far scores below ``below``), or, from the second
    repetition on, when its repetitions agree within ``agree`` (relative) and all score below
    ``leader``: more repetitions would not change its rank. The leader itself, and anything near
    it, runs every repetition. Plain data, so a worker process can apply it.

    A repetition's score is the objective's (``tuner.search.objective.score``) of that
    repetition's pp and tg: ``tg``, ``pp``, or ``mixed`` (one request of ``n_prompt`` + ``n_gen``
    tokens)."""

    objective: str
    below: float
    leader: float
    n_prompt: int = 512
    n_gen: int = 128
    min_repetitions: int = 1
    agree: float = 0.02

    def score(self, pp: float | None, tg: float | None) -> float:
        if self.objective == "tg":
            return tg or 0.0
        if self.objective == "pp":
            return pp or 0.0
        seconds = (self.n_prompt / pp if pp else 0.0) + (self.n_gen / tg if tg else 0.0)
        return (self.n_prompt + self.n_gen) / seconds if seconds else 0.0

    def enough(self, pp: Sequence[float], tg: Sequence[float]) -> bool:
        """Whether the repetitions so far (``pp[i]``, ``tg[i]`` one repetition; either may be empty
        when the bench measures only the other) settle the trial's rank."""
        n = max(len(pp), len(tg))
        if n < self.min_repetitions:
            return False
        scores = [self.score(pp[i] if i < len(pp) else None, tg[i] if i < len(tg) else None) for i in range(n)]
        best = max(scores)
        if best < self.below:
            return True
        return n >= 2 and best < self.leader and (best - min(scores)) <= self.agree * best

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StopRule":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


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


@dataclass(frozen=True)
class EngineBuild:
    """The llama.cpp an engine runs, as that llama.cpp reports itself.

    llama.cpp identifies a build by its build number and commit (``version: 6895 (4341dc8bc)`` until
    2026, ``version: 0.5.0-dev (build 1, commit 0c1e570)`` since; llama-bench's ``build_number`` and
    ``build_commit``; ``LLAMA_BUILD_NUMBER`` and ``LLAMA_COMMIT`` in libllama-common)."""

    engine: str  # "python", "llama-cpp" or "fake"
    build_number: int | None = None
    commit: str | None = None
    version: str | None = None  # llama_version() where the build has one, e.g. "0.5.0-dev"
    backends: tuple[str, ...] = ()  # CPU, CUDA, Metal, Vulkan, RPC ...
    path: str | None = None  # the binaries' folder, or llama-cpp-python's package folder
    detail: str | None = None  # "llama-cpp-python 0.3.36", "built with GNU 12.2.0 for Linux x86_64"
    error: str | None = None  # why the build could not be read

    def describe(self) -> str:
        """``'b6895 (4341dc8bc)'`` (with the version in front where there is one): the build string
        profiles record."""
        parts = []
        if self.version:
            parts.append(self.version)
        if self.build_number is not None:
            parts.append(f"b{self.build_number}")
        if self.commit:
            parts.append(f"({self.commit})")
        return " ".join(parts) or "unknown build"

    def same_build(self, other: "EngineBuild") -> bool | None:
        """Whether two engines run the same llama.cpp (by commit, else build number); None: unknown."""
        if self.commit and other.commit:
            return self.commit.startswith(other.commit) or other.commit.startswith(self.commit)
        if self.build_number is not None and other.build_number is not None:
            return self.build_number == other.build_number
        return None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["backends"] = list(self.backends)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "EngineBuild":
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        known["backends"] = tuple(known.get("backends", ()))
        return cls(**known)


class Engine(abc.ABC):
    """Runs llama.cpp for the tuner: one trial at a time, or candidates side by side.

    A trial never raises for what llama.cpp did: out of memory, a crash, a timeout or a refusal is a
    ``TrialResult`` whose ``outcome`` says which (decided by ``tuner.engine.outcome.classify``).
    Engines are context managers; ``close()`` stops every process they started.
    """

    name: str = ""

    @abc.abstractmethod
    def build(self) -> EngineBuild:
        """The llama.cpp build this engine runs."""

    @abc.abstractmethod
    def devices(self, rpc_servers: Sequence[str] = ()) -> list[DeviceInfo]:
        """Every device this llama.cpp sees (the CPU included), with ``rpc_servers`` registered."""

    @abc.abstractmethod
    def run(self, settings: Settings, bench: BenchSpec = BenchSpec(), *, trial_id: Any = None) -> TrialResult:
        """Load the model with ``settings``, measure pp and tg with ``bench``; the load log parsed."""

    @abc.abstractmethod
    def run_paired(self, candidates: list[Settings], bench: BenchSpec = BenchSpec(), *, rounds: int = 5) -> list[TrialResult]:
        """Measure ``candidates`` side by side in rotating rounds (one result each, in order)."""

    def fit(self, settings: Settings, *, margin: int, min_ctx: int) -> "FitAnswer | None":
        """llama.cpp's own fitter's choice for ``settings`` (layers, split, tensor placement), where
        the engine has one; None where it has not."""
        return None

    def supported_settings(self) -> frozenset[str] | None:
        """The settings this engine can set (the search leaves the others at their defaults, saying
        why); None: every one."""
        return None

    def fit_memory(self, settings: Settings) -> dict[str, dict[str, int]] | None:
        """llama.cpp's own projection of memory per device for ``settings`` (without allocating),
        ``{device: {weights, kv, compute}}`` in bytes, where the engine can ask for it."""
        return None

    def close(self) -> None:
        """Stop every process this engine started."""

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class FitAnswer:
    """What llama.cpp's fitter chose, as settings, and the words it printed."""

    settings: Settings
    args: str  # the arguments it printed, e.g. "-c 4096 -ngl 48 -ot ..."
    tool: str  # the binary that answered


__all__ = ["BenchSpec", "percentile", "StopRule", "Stats", "TrialResult", "median_interval", "Engine", "EngineBuild", "FitAnswer", "DeviceInfo"]
