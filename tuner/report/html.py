"""One self-contained HTML report of a tune: it opens offline, with plotly's JavaScript inlined.

    result = write_report("model-Q4_K_M.gguf", out="report.html", png_dir="plots/")
    result.path, result.pngs

The page: a summary (the study, the winner and the runner-up with their confidence intervals, the
trial counts), then each plot of ``tuner.report.plots`` in its own section (a plot that has nothing
to show says why), then the table of trials. ``--png DIR`` writes each plot as a PNG too (plotly's
kaleido, which drives an installed Chrome or Chromium). The file is written atomically.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ReportError
from ..paths import atomic_write_text
from .data import ReportData, open_source, read_report_data
from .plots import Plot, all_plots

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1200px; padding: 1rem 2rem;
       color: #222; }
h1 { font-size: 1.5rem; margin-bottom: 0.2rem; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #ddd; }
.meta { color: #666; font-size: 0.9rem; } .caption { color: #444; font-size: 0.9rem; max-width: 60rem; }
.note { color: #8a6d3b; background: #fcf8e3; padding: 0.5rem 1rem; border-radius: 4px; }
table { border-collapse: collapse; font-size: 0.85rem; } th, td { border-bottom: 1px solid #eee; padding: 0.2rem 0.6rem;
text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.summary td:first-child { color: #666; }
"""


@dataclass
class ReportResult:
    path: Path
    pngs: list[Path] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)  # the ids of the plots drawn
    skipped: dict[str, str] = field(default_factory=dict)  # plot id -> why it has nothing to show


def write_report(source: str | None = None, *, out: str | Path = "report.html", png_dir: str | Path | None = None,
                 storage: str | None = None) -> ReportResult:
    """Write the report of the study that ``source`` names (see ``tuner.report.data.open_source``)."""
    if png_dir is not None and Path(png_dir).exists() and not Path(png_dir).is_dir():
        raise ReportError(f"{png_dir}: not a folder (--png takes a folder for the PNG files)")
    study, profile, storage_url = open_source(source, storage)
    data = read_report_data(study, profile, storage_url)
    if not data.rows:
        raise ReportError(f"the study {data.study_name!r} has no trials yet: nothing to report")
    plots = all_plots(data)
    path = Path(out)
    if path.is_dir():
        raise ReportError(f"{path}: is a directory; give the report's file name, e.g. {path / 'report.html'}")
    atomic_write_text(path, render(data, plots))
    _readable(path)
    result = ReportResult(path=path, plots=[p.id for p in plots if p.figure is not None],
                          skipped={p.id: p.note for p in plots if p.figure is None})
    if png_dir is not None:
        result.pngs = write_pngs(plots, Path(png_dir))
    return result


def render(data: ReportData, plots: list[Plot]) -> str:
    import plotly
    import plotly.io as pio

    sections = []
    config = {"displaylogo": False, "responsive": True}
    for plot in plots:
        if plot.figure is not None:
            body = pio.to_html(plot.figure, full_html=False, include_plotlyjs=False, include_mathjax=False,
                               div_id=plot.id, config=config)
        else:
            body = f'<p class="note" id="{plot.id}-note">{html.escape(plot.note)}</p>'
        sections.append(f'<section class="plot" data-plot="{plot.id}"><h2>{html.escape(plot.title)}</h2>'
                        f'<p class="caption">{html.escape(plot.caption)}</p>{body}</section>')
    js = plotly.offline.get_plotlyjs()
    title = f"offload-tuner report: {data.study_name}"
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
        f"<script type=\"text/javascript\">{js}</script></head><body>"
        f"<h1>{html.escape(title)}</h1>{_summary(data)}{''.join(sections)}"
        f"<section data-plot=\"trials\"><h2>Trials</h2>{_table(data)}</section>"
        "</body></html>\n"
    )


def _speed(stats: dict[str, Any] | None) -> str:
    if not stats:
        return "-"
    return f"{stats['median']:.1f} t/s (95% CI {stats['ci_low']:.1f}-{stats['ci_high']:.1f}, {len(stats.get('samples') or ())} samples)"


def _settings(s: dict[str, Any]) -> str:
    keys = ("n_gpu_layers", "tensor_split", "n_ctx", "type_k", "type_v", "flash_attn", "n_threads", "n_ubatch", "n_batch",
            "tensor_overrides", "offload_kqv")
    shown = {k: s.get(k) for k in keys if s.get(k) not in (None, (), [])}
    return f"{Path(s.get('model_path', '')).name}: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in shown.items())


def _summary(data: ReportData) -> str:
    counts: dict[str, int] = {}
    for r in data.rows:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    rows = [("study", f"{data.study_name} in {data.storage}")]
    if data.profile_path:
        rows.append(("profile", data.profile_path))
    rows.append(("trials", ", ".join(f"{n} {o}" for o, n in sorted(counts.items(), key=lambda kv: -kv[1]))))
    if data.winner is not None:
        rows.append(("chosen by", "the profile: re-measured side by side" if data.profile_path else
                     "the study's best trial as first measured (the profile's winner was re-measured: give the profile to see it)"))
    for label, pick in (("winner", data.winner), ("runner-up", data.runner_up)):
        if pick is not None:
            rows.append((label, _settings(pick.settings) + (f" (trial #{pick.number})" if pick.number is not None else "")))
            rows.append((f"{label} tg", _speed(pick.tg)))
            rows.append((f"{label} pp", _speed(pick.pp)))
    if data.time and data.time.get("total_s"):
        from ..search.timing import describe

        rows.append(("time", describe(data.time).split(": ", 1)[1]))
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f'<table class="summary">{cells}</table>'


def _table(data: ReportData) -> str:
    head = "".join(f"<th>{h}</th>" for h in ("#", "outcome", "variant", "ngl", "ctx", "KV", "fa", "threads", "ubatch",
                                              "tg t/s", "pp t/s", "layers", "why / message"))
    body = []
    for r in data.rows:
        s = r.settings or {}
        cells = [str(r.number), r.outcome, r.variant, s.get("n_gpu_layers", ""), s.get("n_ctx", ""),
                 f"{s.get('type_k', '')}/{s.get('type_v', '')}" if s else "", s.get("flash_attn", ""), s.get("n_threads") or "",
                 s.get("n_ubatch", ""), f"{r.tg['median']:.1f}" if r.tg else "", f"{r.pp['median']:.1f}" if r.pp else "",
                 f"{r.layers[0]}/{r.layers[1]}" if r.layers[0] is not None else "", r.reason[:200] if r.outcome != "ok" else ""]
        body.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _readable(path: Path) -> None:
    """A report is for sharing: the usual permissions for a new file, not the temp file's 0600."""
    import os

    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def write_pngs(plots: list[Plot], folder: Path) -> list[Path]:
    """Each drawn plot as ``FOLDER/<id>.png``."""
    import plotly.io as pio

    drawn = [p for p in plots if p.figure is not None]
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{p.id}.png" for p in drawn]
    try:
        # one browser session for all of them; each file written whole or not at all by kaleido
        pio.write_images([p.figure for p in drawn], paths, width=[1200] * len(drawn),
                         height=[int(p.figure.layout.height or 500) for p in drawn])
    except Exception as exc:  # noqa: BLE001 (kaleido raises many kinds; all mean the same to the user)
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise ReportError(f"cannot write the PNG files ({first}); plotly's image export (kaleido) needs Chrome or "
                          "Chromium installed: the HTML report was written") from None
    missing = [p.name for p in paths if not p.is_file() or p.stat().st_size == 0]
    if missing:
        raise ReportError(f"plotly's image export wrote no {', '.join(missing)} in {folder}: the HTML report was written")
    return paths
