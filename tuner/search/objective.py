"""What the search maximizes, in tokens/sec, for the workload a profile is tuned for.

=============  ======================================================================================
objective      the value (higher is better)
=============  ======================================================================================
``tg``         generation speed (with several users: their aggregate, llama-batched-bench's S_TG)
``pp``         prompt speed (with several users: S_PP)
``mixed``      the throughput of one request of ``n_prompt`` prompt and ``n_gen`` generated tokens
``aggregate``  the users' aggregate generation speed, every user at or above ``min_user_tg``: a
               candidate below the floor scores its per-user speed, which is below every candidate
               that reaches it (N users at the floor make at least N x the floor together)
``per-user``   each user's own generation speed with ``users`` sequences decoded together
``ttft``       the time to the first token of a prompt of ``n_prompt`` tokens at ``depth`` (all
               users' prompts arriving at once), at its 95th percentile over the repetitions,
               as the prompt tokens per second it stands for: ``users * n_prompt / ttft_p95``
=============  ======================================================================================
"""

from __future__ import annotations

from ..engine.base import BenchSpec, Stats, percentile

OBJECTIVES = ("tg", "pp", "mixed", "aggregate", "per-user", "ttft")


def score(objective: str, pp: Stats | None, tg: Stats | None, bench: BenchSpec) -> float:
    """The objective's value for a candidate's figures (see the table above)."""
    users = max(1, bench.users)
    if objective == "tg":
        return tg.median if tg else 0.0
    if objective == "pp":
        return pp.median if pp else 0.0
    if objective == "aggregate":
        if not tg:
            return 0.0
        per_user = tg.median / users
        if bench.min_user_tg is not None and per_user < bench.min_user_tg:
            return per_user
        return tg.median
    if objective == "per-user":
        return tg.median / users if tg else 0.0
    if objective == "ttft":
        ttft = bench.ttft(pp)
        if ttft is None:
            return 0.0
        p95 = percentile(ttft.samples, 95)
        return users * bench.n_prompt / p95 if p95 > 0 else 0.0
    seconds = (bench.n_prompt / pp.median if pp and pp.median else 0.0) + (bench.n_gen / tg.median if tg and tg.median else 0.0)
    return (bench.n_prompt + bench.n_gen) / seconds if seconds else 0.0


def stat_key(objective: str) -> str:
    """Which figure (``pp`` or ``tg``) carries the objective's noise."""
    return "pp" if objective in ("pp", "ttft") else "tg"


def workload_figures(pp: Stats | None, tg: Stats | None, bench: BenchSpec) -> dict[str, object]:
    """The figures at the workload's load, with intervals: aggregate and per-user generation speed
    (t/s) and the time to the first token (seconds, p50 and p95 over the repetitions)."""
    users = max(1, bench.users)
    out: dict[str, object] = {}
    if tg is not None:
        out["aggregate_tg"] = {"median": tg.median, "ci_low": tg.ci_low, "ci_high": tg.ci_high}
        out["per_user_tg"] = {"median": tg.median / users, "ci_low": tg.ci_low / users, "ci_high": tg.ci_high / users}
    ttft = bench.ttft(pp)
    if ttft is not None:
        out["ttft_s"] = {"p50": percentile(ttft.samples, 50), "p95": percentile(ttft.samples, 95),
                         "ci_low": ttft.ci_low, "ci_high": ttft.ci_high, "samples": list(ttft.samples)}
    return out
