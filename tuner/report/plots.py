"""The report's plots, as plotly figures (optuna's own for parameter importances).

plotly because it draws interactive plots (hover a point: its settings, its outcome) into a page
that works offline with its JavaScript inlined, optuna's visualization module already speaks it
(parameter importances), and the same figures export to PNG (kaleido). Nothing is drawn by hand.

Every string from the study (file names, llama.cpp's messages) is HTML-escaped before it goes into
a hover label: a study is data someone else may have written.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from .data import OK, PRUNED, ReportData, TrialRow

MiB = 1 << 20
_OUTCOME_COLORS = {
    "ok": "#2ca02c", "oom": "#d62728", "pruned": "#7f7f7f", "invalid": "#c7c7c7", "crash": "#9467bd",
    "timeout": "#ff7f0e", "load_error": "#8c564b", "bad_settings": "#e377c2", "interrupted": "#17becf",
}


@dataclass
class Plot:
    id: str  # the HTML element's id and the PNG's file name
    title: str
    caption: str
    figure: Any | None  # a plotly Figure, or None with ``note`` saying why there is none
    note: str = ""


def _esc(text: Any, limit: int = 300) -> str:
    return html.escape(str(text)[:limit])


def _hover(r: TrialRow) -> str:
    s = r.settings or {}
    parts = [f"trial #{r.number}: {r.outcome}", _esc(r.variant),
             f"ngl {s.get('n_gpu_layers')} ctx {s.get('n_ctx')} kv {s.get('type_k')}/{s.get('type_v')} fa {s.get('flash_attn')}",
             f"threads {s.get('n_threads')} ubatch {s.get('n_ubatch')} batch {s.get('n_batch')}"]
    if s.get("tensor_split"):
        parts.append(f"split {_esc(s['tensor_split'])}")
    if s.get("tensor_overrides"):
        parts.append(f"{len(s['tensor_overrides'])} tensor override(s)")
    for key in ("tg", "pp"):
        st = getattr(r, key)
        if st:
            parts.append(f"{key} {st['median']:.1f} t/s (95% CI {st['ci_low']:.1f}-{st['ci_high']:.1f})")
    if r.layers[0] is not None:
        parts.append(f"offloaded {r.layers[0]}/{r.layers[1]} layers")
    if r.reason and r.outcome != OK:
        parts.append(_esc(r.reason, 160))
    return "<br>".join(parts)


def _ci(stats: dict[str, Any] | None) -> tuple[float, float]:
    """Error bar lengths (up, down) of a 95% interval; speed is never below 0."""
    if not stats:
        return 0.0, 0.0
    return max(0.0, stats["ci_high"] - stats["median"]), max(0.0, stats["median"] - max(0.0, stats["ci_low"]))


_PALETTE = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#ff7f0e")


def _colors(variants: list[str]) -> dict[str, str]:
    return {v: _PALETTE[i % len(_PALETTE)] for i, v in enumerate(variants)}


def cliffs(data: ReportData) -> dict[str, dict[str, int | None]]:
    """Per variant: the fewest GPU layers that ran out of memory (``measured``) and that the
    memory arithmetic said would not fit (``predicted``: not launched)."""
    out: dict[str, dict[str, int | None]] = {}
    for variant in _variants(data.rows):
        mine = [r for r in data.rows if r.variant == variant and r.n_gpu_layers is not None]
        out[variant] = {
            "measured": min((r.n_gpu_layers for r in mine if r.outcome == "oom"), default=None),
            "predicted": min((r.n_gpu_layers for r in mine if r.outcome == PRUNED and "predicted not to fit" in r.reason), default=None),
        }
    return out


def _variants(rows: list[TrialRow]) -> list[str]:
    return sorted({r.variant for r in rows if r.variant})


def speed_vs_layers(data: ReportData) -> Plot:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        subplot_titles=("generation (tg), tokens/s", "prompt processing (pp), tokens/s"))
    ok = data.ok
    colors = _colors(_variants(data.rows))
    for variant in _variants(ok):
        mine = [r for r in ok if r.variant == variant]
        for row, key in ((1, "tg"), (2, "pp")):
            pts = [r for r in mine if getattr(r, key)]
            plus, minus = zip(*(_ci(getattr(r, key)) for r in pts)) if pts else ((), ())
            fig.add_trace(go.Scatter(
                x=[r.n_gpu_layers for r in pts], y=[getattr(r, key)["median"] for r in pts], mode="markers", name=_esc(variant),
                legendgroup=variant, showlegend=row == 1, error_y=dict(type="data", array=list(plus), arrayminus=list(minus)),
                text=[_hover(r) for r in pts], hovertemplate="%{text}<extra></extra>",
                marker=dict(size=9, opacity=0.85, color=colors[variant])), row=row, col=1)
    oom = [r for r in data.rows if r.outcome == "oom" and r.n_gpu_layers is not None]
    for row in (1, 2):
        if oom:
            fig.add_trace(go.Scatter(
                x=[r.n_gpu_layers for r in oom], y=[0] * len(oom), mode="markers", name="out of memory", legendgroup="oom",
                showlegend=row == 1, marker=dict(symbol="x", size=12, color=[colors[r.variant] for r in oom],
                                                 line=dict(color=_OUTCOME_COLORS["oom"], width=2)),
                text=[_hover(r) for r in oom], hovertemplate="%{text}<extra></extra>"), row=row, col=1)
    _mark_picks(fig, data, lambda p: p.settings.get("n_gpu_layers"), rows=((1, "tg"), (2, "pp")))
    xs = [r.n_gpu_layers for r in data.rows if r.n_gpu_layers is not None]
    # The cliff, per variant (a smaller quantization fits more layers): a solid line where loading
    # ran out of memory, a dashed one where the arithmetic predicted it would not fit.
    for i, (variant, cliff) in enumerate(cliffs(data).items()):
        measured, predicted = cliff["measured"], cliff["predicted"]
        if measured is not None and xs:
            fig.add_vrect(x0=measured - 0.5, x1=max(xs) + 0.5, fillcolor=colors[variant], opacity=0.07, line_width=0, row="all", col=1)
            fig.add_vline(x=measured - 0.5, line=dict(color=colors[variant], width=2), row="all", col=1,
                          annotation=dict(text=f"{_esc(variant)}: out of memory from {measured} layers", yshift=-14 * i),
                          annotation_position="top right")
        if predicted is not None and predicted != measured:
            fig.add_vline(x=predicted - 0.5, line=dict(color=colors[variant], width=2, dash="dash"), row="all", col=1,
                          annotation=dict(text=f"{_esc(variant)}: predicted not to fit from {predicted} layers", yshift=14 * i),
                          annotation_position="bottom right")
    fig.update_xaxes(title_text="n_gpu_layers", row=2, col=1)
    fig.update_layout(height=640, margin=dict(t=60), legend=dict(orientation="h", y=-0.12))
    return Plot("speed-vs-layers", "Speed against GPU layers",
                "Each successful trial's median speed with its 95% confidence interval, by quantization variant; out-of-memory "
                "trials as crosses at 0. Per variant, the shaded band beyond a solid line is where loading ran out of memory (the "
                "cliff); a dashed line is where the memory arithmetic predicted it would not fit (those were not launched).", fig)


def _mark_picks(fig: Any, data: ReportData, x_of: Any, rows: tuple[tuple[int, str], ...], col: int = 1) -> None:
    """The winner (star) and the runner-up (diamond), with their confidence intervals."""
    import plotly.graph_objects as go

    for pick, label, symbol in ((data.winner, "winner", "star"), (data.runner_up, "runner-up", "diamond")):
        if pick is None or x_of(pick) is None:
            continue
        for row, key in rows:
            stats = getattr(pick, key)
            if not stats:
                continue
            plus, minus = _ci(stats)
            fig.add_trace(go.Scatter(
                x=[x_of(pick)], y=[stats["median"]], mode="markers", name=label, legendgroup=label, showlegend=row == rows[0][0],
                marker=dict(symbol=symbol, size=18, color="#ffbf00" if label == "winner" else "#1f77b4",
                            line=dict(color="black", width=1.5)),
                error_y=dict(type="data", array=[plus], arrayminus=[minus], thickness=2.5, width=8),
                hovertemplate=f"{label}: {key} {stats['median']:.1f} t/s (95% CI {stats['ci_low']:.1f}-{stats['ci_high']:.1f})<extra></extra>"),
                row=row, col=col)


def _device(name: str) -> str:
    """``RPC0[127.0.0.1:50052]`` and ``RPC0`` are one device."""
    return name.split("[", 1)[0]


def speed_vs_memory(data: ReportData) -> Plot:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ok = [r for r in data.ok if r.predicted or r.actual]
    devices: list[str] = []
    for r in ok:
        for name in list(r.predicted) + list(r.actual):
            if _device(name) not in devices:
                devices.append(_device(name))
    devices.sort(key=lambda d: (d == "CPU", d))
    if not devices:
        return Plot("speed-vs-memory", "Speed against memory per device", "", None, "no trial recorded its memory")
    fig = make_subplots(rows=1, cols=len(devices), shared_yaxes=True, subplot_titles=[_esc(d) for d in devices],
                        horizontal_spacing=0.06)
    for col, device in enumerate(devices, start=1):
        for kind, symbol, source in (("predicted", "circle-open", "predicted"), ("actual", "diamond", "actual")):
            xs, ys, texts = [], [], []
            for r in ok:
                mem = next((m for name, m in getattr(r, source).items() if _device(name) == device), None)
                if not mem:
                    continue
                total = mem.get("total") if kind == "predicted" and mem.get("total") is not None else \
                    sum(mem.get(k, 0) for k in ("weights", "kv", "compute"))
                xs.append(total / MiB)
                ys.append(r.value)
                texts.append(f"{kind} on {_esc(device)}: {total / MiB:.0f} MiB (weights {mem.get('weights', 0) / MiB:.0f}, "
                             f"KV {mem.get('kv', 0) / MiB:.0f}, compute {mem.get('compute', 0) / MiB:.0f})<br>" + _hover(r))
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=kind, legendgroup=kind, showlegend=col == 1,
                                     marker=dict(symbol=symbol, size=10, color="#1f77b4" if kind == "predicted" else "#ff7f0e"),
                                     text=texts, hovertemplate="%{text}<extra></extra>"), row=1, col=col)
        fig.update_xaxes(title_text="MiB", row=1, col=col)
    fig.update_yaxes(title_text=f"{data.objective} objective, tokens/s", row=1, col=1)
    fig.update_layout(height=460, legend=dict(orientation="h", y=-0.2))
    return Plot("speed-vs-memory", "Speed against memory per device",
                "Each successful trial's speed against the memory the arithmetic predicted (open circles) and what llama.cpp "
                "actually allocated (diamonds) on each device: weights, KV cache and compute buffers.", fig)


def speed_vs_quality(data: ReportData) -> Plot:
    import plotly.graph_objects as go

    title = "Speed against quality per variant"
    caption = ("Each quantization variant's best measured speed against its KL divergence from the reference (lower is "
               "closer), with 95% confidence intervals; the line is the Pareto front (no variant is both faster and closer).")
    if not data.quality:
        return Plot("speed-vs-quality", title, caption, None,
                    "quality was not measured in this study (tune with a quality budget to measure each variant's KL divergence)")
    points = []
    for variant in _variants(data.ok):
        q = data.quality.get(variant)
        mine = [r for r in data.ok if r.variant == variant]
        if q is None or not mine:
            continue
        best = max(mine, key=lambda r: r.value or 0)
        stats = best.tg if data.objective != "pp" else best.pp
        points.append((variant, q, best, stats))
    if not points:
        return Plot("speed-vs-quality", title, caption, None, "no variant with measured quality ran successfully")
    fig = go.Figure()
    for variant, q, best, stats in points:
        lo, hi = q["kl_ci"]
        plus, minus = _ci(stats)
        fig.add_trace(go.Scatter(
            x=[q["kl_mean"]], y=[best.value], mode="markers+text", name=_esc(variant), text=[_esc(variant)], textposition="top center",
            error_x=dict(type="data", array=[max(0.0, hi - q["kl_mean"])] if hi is not None else [0],
                         arrayminus=[max(0.0, q["kl_mean"] - lo)] if lo is not None else [0]),
            error_y=dict(type="data", array=[plus], arrayminus=[minus]), marker=dict(size=12),
            hovertemplate=f"{_esc(variant)}<br>KL {q['kl_mean']:.4g}" + (f", PPL ratio {q['ppl_ratio']:.4f}" if isinstance(q.get("ppl_ratio"), (int, float)) else "")
            + "<br>%{y:.1f} t/s<extra></extra>"))
    front = []
    for variant, q, best, _ in sorted(points, key=lambda p: (p[1]["kl_mean"], -(p[2].value or 0))):
        if not front or (best.value or 0) > front[-1][1]:
            front.append((q["kl_mean"], best.value or 0))
    fig.add_trace(go.Scatter(x=[p[0] for p in front], y=[p[1] for p in front], mode="lines", name="Pareto front",
                             line=dict(dash="dot", color="#444"), hoverinfo="skip"))
    by_name = {variant: q for variant, q, _, _ in points}

    def kl_of(pick: Any) -> float | None:
        from pathlib import Path

        q = by_name.get(Path(pick.settings.get("model_path", "")).name)
        return q["kl_mean"] if q else None

    key = "pp" if data.objective == "pp" else "tg"
    for pick, label, symbol in ((data.winner, "winner", "star"), (data.runner_up, "runner-up", "diamond")):
        if pick is None or kl_of(pick) is None or not getattr(pick, key):
            continue
        stats = getattr(pick, key)
        plus, minus = _ci(stats)
        fig.add_trace(go.Scatter(x=[kl_of(pick)], y=[stats["median"]], mode="markers", name=label,
                                 marker=dict(symbol=symbol, size=20, color="#ffbf00" if label == "winner" else "#1f77b4",
                                             line=dict(color="black", width=1.5)),
                                 error_y=dict(type="data", array=[plus], arrayminus=[minus], thickness=2.5, width=8),
                                 hovertemplate=f"{label}: {stats['median']:.1f} t/s (95% CI {stats['ci_low']:.1f}-{stats['ci_high']:.1f})<extra></extra>"))
    fig.update_layout(height=480, xaxis_title="KL divergence from the reference (mean per token)",
                      yaxis_title=f"{key} tokens/s", legend=dict(orientation="h", y=-0.2))
    return Plot("speed-vs-quality", title, caption, fig)


def history(data: ReportData) -> Plot:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35], vertical_spacing=0.08,
                        subplot_titles=(f"objective ({data.objective}), tokens/s", "outcome"))
    ok = sorted(data.ok, key=lambda r: r.number)
    fig.add_trace(go.Scatter(x=[r.number for r in ok], y=[r.value for r in ok], mode="markers", name="trial",
                             marker=dict(color=_OUTCOME_COLORS["ok"], size=8), text=[_hover(r) for r in ok],
                             hovertemplate="%{text}<extra></extra>"), row=1, col=1)
    best, xs, ys = None, [], []
    for r in ok:
        best = r.value if best is None else max(best, r.value or 0)
        xs.append(r.number)
        ys.append(best)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(shape="hv", color="#444"), name="best so far"), row=1, col=1)
    outcomes = [o for o in _OUTCOME_COLORS if any(r.outcome == o for r in data.rows)]
    outcomes += sorted({r.outcome for r in data.rows} - set(outcomes))
    for outcome in outcomes:
        mine = [r for r in data.rows if r.outcome == outcome]
        fig.add_trace(go.Scatter(x=[r.number for r in mine], y=[outcome] * len(mine), mode="markers", name=outcome,
                                 marker=dict(color=_OUTCOME_COLORS.get(outcome, "#000000"), size=10, symbol="square"),
                                 text=[_hover(r) for r in mine], hovertemplate="%{text}<extra></extra>"), row=2, col=1)
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=outcomes, row=2, col=1)
    fig.update_xaxes(title_text="trial", row=2, col=1)
    fig.update_layout(height=560, legend=dict(orientation="h", y=-0.15))
    return Plot("history", "Trial history",
                "Every candidate in the order the search asked for it: the objective of those that ran, the best so far, and "
                "each trial's outcome (pruned: not launched because the memory arithmetic or an earlier out-of-memory "
                "failure said it would not fit).", fig)


def importances(data: ReportData) -> Plot:
    title, caption = "Parameter importances", "How much of the variation in speed each setting explains (optuna's fANOVA)."
    if len(data.ok) < 2 or data.study is None:
        return Plot("importances", title, caption, None, "fewer than two successful trials: nothing to compare")
    import optuna

    try:
        fig = optuna.visualization.plot_param_importances(data.study)
    except (ValueError, RuntimeError) as exc:
        return Plot("importances", title, caption, None, f"cannot compute them for this study: {_esc(exc, 200)}")
    if not fig.data or not len(fig.data[0].x or ()):
        return Plot("importances", title, caption, None, "no setting varied among the successful trials")
    fig.update_layout(height=max(320, 40 * len(fig.data[0].x) + 120), title=None)
    return Plot("importances", title, caption, fig)


def users_curve(data: ReportData) -> Plot:
    """Aggregate generation speed, each user's speed and the time to the first token against the
    number of users, for the winner and the next contender (the profile's ``workload.curve``)."""
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    title = "Throughput, per-user speed and time to the first token against users"
    caption = ("The winner and the next contender measured at 1, 2, 4... users up to the workload's, each with its "
               "users' context: where aggregate generation speed stops growing (the knee), what each user gets, and "
               "how long the users' prompts wait for their first token (p50, bars to p95). Intervals: 95% of the median.")
    w = data.workload
    if w is None or not w.curve:
        return Plot("users", title, caption, None,
                    "tuned for one user: tune with --users N to measure the winner at 1, 2, 4... N users")
    fig = make_subplots(rows=1, cols=3, subplot_titles=("aggregate tg, t/s", "per-user tg, t/s", "time to first token, s"))
    colors = {"winner": "#ffbf00", "second": "#1f77b4"}
    for who in ("winner", "second"):
        points = sorted((p for p in w.curve if p.candidate == who), key=lambda p: p.users)
        if not points:
            continue
        xs = [p.users for p in points]
        for col, attr in ((1, "aggregate_tg"), (2, "per_user_tg")):
            vals = [getattr(p, attr) for p in points]
            fig.add_trace(go.Scatter(
                x=[x for x, v in zip(xs, vals) if v], y=[v.median for v in vals if v], mode="lines+markers",
                name=who, legendgroup=who, showlegend=col == 1, line=dict(color=colors[who]),
                error_y=dict(type="data", array=[v.ci_high - v.median for v in vals if v],
                             arrayminus=[v.median - v.ci_low for v in vals if v])), row=1, col=col)
        ttft = [(p.users, p.ttft_s) for p in points if p.ttft_s]
        fig.add_trace(go.Scatter(x=[u for u, _ in ttft], y=[t.p50 for _, t in ttft], mode="lines+markers", name=who,
                                 legendgroup=who, showlegend=False, line=dict(color=colors[who]),
                                 error_y=dict(type="data", array=[t.p95 - t.p50 for _, t in ttft], arrayminus=[0] * len(ttft))),
                      row=1, col=3)
    fig.update_xaxes(title_text="users", type="log", dtick=0.30103)
    fig.update_layout(height=420, legend=dict(orientation="h", y=-0.25))
    return Plot("users", title, caption, fig)


def all_plots(data: ReportData) -> list[Plot]:
    return [speed_vs_layers(data), speed_vs_memory(data), speed_vs_quality(data), users_curve(data), history(data),
            importances(data)]
