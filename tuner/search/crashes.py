"""A crash is a clue: find the optional feature that makes llama.cpp crash here, and stop launching it.

llama.cpp crashes in places that depend on the CPU, the backend and the build (on CPUs with AMX it
repacks weights into an ``AMX`` buffer and may crash at the first decode: ggml-org/llama.cpp#20824).
When a trial crashes (``Outcome.CRASH``: a signal, an abort, an exit without a reply), the same
candidate is run again, with a short benchmark, with optional features off:

1. each feature alone, in ``FEATURES``' order (the likeliest culprit first: weight repacking, then the
   quantized KV cache, flash attention, op offload, the tensor overrides, mmap), stopping at the first
   that runs: one run when the first guess is right;
2. when none alone runs: all of them off together; if that crashes too, the crash is not one of these
   features (nothing is learned, and no later crash is investigated again: it would cost the same runs);
3. when all off runs: each feature turned back on, one at a time, and kept on when it still runs, so
   what is left off is a smallest set that runs (greedy, one run per feature).

A run that ends otherwise than ok or crash (out of memory, a timeout) counts as "does not run". At most
``MAX_RUNS`` runs per investigation. What it finds is a constraint like an out-of-memory limit: every
later candidate is launched with those features off (``avoid``), and the finding is recorded on the
crashed trial (``crash_avoided``) so a resumed study knows it without crashing again.

The study calls this from one place (``Tuner._loop``), and ``offload-tuner bench`` runs the same search.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..engine.base import BenchSpec, TrialResult
from ..engine.dimensions import UNQUANTIZED_KV
from ..engine.outcome import Outcome
from ..engine.settings import Settings
from ..model.repack import CpuFeatures

MAX_RUNS = 12
# the repacking crash on AMX CPUs, as reported upstream
AMX_FAULT = "ggml-org/llama.cpp#20824"


@dataclass(frozen=True)
class Feature:
    """An optional feature the crash search can turn off: its name (a setting's, or the KV cache's),
    what llama.cpp does with it (for the sentence), and the candidate without it (None: already off)."""

    name: str
    doing: str  # "when it ...": completes "llama.cpp crashes on this machine ..."
    tuned: str  # "tuned with ..."
    lever: str  # the flag that turns it off in llama.cpp's tools
    off: Callable[[Settings], Settings | None]


def _kv_off(s: Settings) -> Settings | None:
    if s.type_k in UNQUANTIZED_KV and s.type_v in UNQUANTIZED_KV:
        return None
    return s.replace(type_k="f16", type_v="f16")


def _fa_off(s: Settings) -> Settings | None:
    if s.flash_attn == "off":
        return None
    # a quantized V cache needs flash attention: without it the cache is f16 too
    return s.replace(flash_attn="off", type_k="f16" if s.type_v not in UNQUANTIZED_KV else s.type_k,
                     type_v="f16" if s.type_v not in UNQUANTIZED_KV else s.type_v)


FEATURES: tuple[Feature, ...] = (
    Feature("repack", "when it repacks weights", "repacking off", "--no-repack (llama-bench --repack 0)",
            lambda s: s.replace(repack=False) if s.repack else None),
    Feature("kv_cache_type", "with a quantized KV cache", "an f16 KV cache", "-ctk f16 -ctv f16", _kv_off),
    Feature("flash_attn", "with flash attention on", "flash attention off", "-fa off", _fa_off),
    Feature("op_offload", "when it offloads host operations to the GPU", "op offload off", "--no-op-offload",
            lambda s: s.replace(op_offload=False) if s.op_offload and s.n_gpu_layers else None),
    Feature("tensor_overrides", "with tensors kept on the CPU by overrides", "no tensor overrides",
            "no -ot / --n-cpu-moe",
            lambda s: s.replace(tensor_overrides=(), n_cpu_moe=0) if (s.tensor_overrides or s.n_cpu_moe) else None),
    Feature("use_mmap", "when it maps the model file", "mmap off", "--no-mmap",
            lambda s: s.replace(use_mmap=False, use_mlock=False) if s.use_mmap else None),
)
_BY_NAME = {f.name: f for f in FEATURES}


def without(s: Settings, names: Iterable[str]) -> Settings:
    """``s`` with these features off (each one already off is left as it is)."""
    for name in names:
        off = _BY_NAME[name].off(s)
        if off is not None:
            s = off
    return s


@dataclass(frozen=True)
class Finding:
    """What one investigation found: the features whose being off lets the candidate run (empty: no
    set of them does), the runs it cost, and the sentence that says it."""

    off: tuple[str, ...]
    runs: int
    message: str
    tried: tuple[tuple[tuple[str, ...], str], ...] = ()  # (features off, outcome) per run, in order

    @property
    def found(self) -> bool:
        return bool(self.off)

    def to_dict(self) -> dict[str, Any]:
        return {"off": list(self.off), "runs": self.runs, "message": self.message,
                "tried": [{"off": list(names), "outcome": outcome} for names, outcome in self.tried]}


def describe(off: Sequence[str], cpu: CpuFeatures | None = None) -> str:
    """The finding in words: which feature crashes, and what the tune does instead."""
    if not off:
        return ("llama.cpp crashes with this candidate whatever optional feature is off (weight repacking, a quantized "
                "KV cache, flash attention, op offload, tensor overrides, mmap): not a crash these settings avoid")
    doing = []
    for name in off:
        feature = _BY_NAME[name]
        text = feature.doing
        if name == "repack" and cpu is not None and cpu.amx:
            text = f"when it repacks weights for AMX (a known llama.cpp fault: {AMX_FAULT})"
        elif name == "repack" and cpu is not None and cpu.repack:
            text = "when it repacks weights into its CPU_REPACK buffer"
        doing.append(text)
    where = "on this CPU" if list(off) == ["repack"] else "on this machine"
    tuned = " and ".join(_BY_NAME[n].tuned for n in off)
    levers = ", ".join(_BY_NAME[n].lever for n in off)
    return f"llama.cpp crashes {where} {' and '.join(doing)}; tuned with {tuned} ({levers})"


def check_bench(bench: BenchSpec) -> BenchSpec:
    """The short benchmark a crash check runs: the same prompt and depth (a crash may be in the prompt's
    batch), a few generated tokens, one repetition."""
    return BenchSpec(n_prompt=bench.n_prompt, n_gen=min(bench.n_gen, 8) if bench.n_gen else 0, depth=bench.depth,
                     repetitions=1)


def investigate(s: Settings, run: Callable[[Settings], TrialResult], *, cpu: CpuFeatures | None = None,
                max_runs: int = MAX_RUNS, on_run: Callable[[tuple[str, ...], TrialResult], None] | None = None) -> Finding:
    """The smallest set of features (in ``FEATURES``) whose being off lets ``s`` run. ``run`` launches
    one candidate (a short benchmark); see the module docstring for the order."""
    applicable = [f.name for f in FEATURES if f.off(s) is not None]
    tried: list[tuple[tuple[str, ...], str]] = []

    def runs_without(names: Sequence[str]) -> bool:
        result = run(without(s, names))
        tried.append((tuple(names), result.outcome.value))
        if on_run is not None:
            on_run(tuple(names), result)
        return result.ok

    def finish(off: Sequence[str]) -> Finding:
        return Finding(tuple(off), len(tried), describe(tuple(off), cpu), tuple(tried))

    for name in applicable:
        if len(tried) >= max_runs:
            return finish(())
        if runs_without([name]):
            return finish([name])
    if len(applicable) < 2 or len(tried) >= max_runs or not runs_without(applicable):
        return finish(())
    needed = list(applicable)
    for name in applicable:
        if len(needed) == 1 or len(tried) >= max_runs:
            break
        fewer = [n for n in needed if n != name]
        if runs_without(fewer):
            needed = fewer
    return finish(needed)


class Crashes:
    """What the crashes of one study taught: the features launched off from now on (``avoid``), and
    whether another crash is worth an investigation."""

    def __init__(self, cpu: CpuFeatures | None = None) -> None:
        self.cpu = cpu
        self.off: list[str] = []  # features every candidate is launched without, in FEATURES' order
        self.messages: list[str] = []
        self.unavoidable = False  # an investigation found nothing: later crashes are not investigated

    def remember(self, finding: Mapping[str, Any] | None) -> None:
        """A finding recorded on a trial (now or in an earlier run of the study)."""
        if not finding:
            return
        names = [n for n in finding.get("off", ()) if n in _BY_NAME]
        if not names:
            self.unavoidable = True
            return
        for name in names:
            if name not in self.off:
                self.off.append(name)
        message = str(finding.get("message") or describe(tuple(names), self.cpu))
        if message not in self.messages:
            self.messages.append(message)

    def avoid(self, s: Settings) -> Settings:
        """``s`` with the features that crashed off."""
        return without(s, self.off) if self.off else s

    def worth_investigating(self, s: Settings) -> bool:
        return not self.unavoidable and any(f.off(s) is not None for f in FEATURES)

    def learn(self, s: Settings, engine: Any, bench: BenchSpec,
              on_run: Callable[[tuple[str, ...], TrialResult], None] | None = None) -> Finding:
        """Investigate the crash of ``s`` with ``engine`` and remember what it finds."""
        short = check_bench(bench)
        finding = investigate(s, lambda c: engine.run(c, short), cpu=self.cpu, on_run=on_run)
        self.remember(finding.to_dict())
        return finding


def crashed(result: TrialResult) -> bool:
    return result.outcome is Outcome.CRASH


__all__ = ["AMX_FAULT", "Crashes", "FEATURES", "Feature", "Finding", "MAX_RUNS", "check_bench", "crashed", "describe",
           "investigate", "without"]
