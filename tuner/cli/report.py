"""``offload-tuner report``: the HTML report of a study (thin: resolve, call, print)."""

from __future__ import annotations

import click


@click.command("report")
@click.argument("source", required=False)
@click.option("-o", "--out", "out", type=click.Path(), default="report.html", show_default=True, help="The HTML file to write.")
@click.option("--png", "png_dir", type=click.Path(), default=None, help="Also write each plot as a PNG in this folder.")
@click.option("--storage", default=None, help="Optuna storage URL of the study (default: SQLite in the data folder).")
def report_cmd(source: str | None, out: str, png_dir: str | None, storage: str | None) -> None:
    """One self-contained HTML report of a tune: speed against GPU layers with the out-of-memory
    cliff, speed against memory per device, speed against quality per variant (when measured),
    the trial history and parameter importances. It opens offline (no network, no external script).

    SOURCE is a study name, a profile (file or name: it names its study), or a model file (its most
    recent study); omitted, the most recent study in the storage.

    \b
    Examples:
      offload-tuner report model-Q4_K_M.gguf -o report.html
      offload-tuner report Qwen3-8B-Q4_K_M--0123456789abcdef -o report.html --png plots/
      offload-tuner report my-study --storage postgresql://me@db/tuning -o report.html
    """
    from ..report.html import write_report

    result = write_report(source, out=out, png_dir=png_dir, storage=storage)
    for plot, why in result.skipped.items():
        click.echo(f"{plot}: not drawn: {why}", err=True)
    for png in result.pngs:
        click.echo(f"png: {png}", err=True)
    click.echo(str(result.path))
