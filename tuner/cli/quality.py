"""``offload-tuner quality``: what each quantization costs against a reference. Thin: parse, call
``tuner.search.quality.quality``, print. The progress printer here also serves ``tune``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

MiB = 1 << 20


class QualityProgress:
    """Quality and quantization progress on stderr: a line per step, chunk counts in place on a
    terminal. Returns True for the events it printed (``tune`` hands it the ones it does not know)."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self._open = False

    def _line(self, text: str) -> None:
        if self._open:
            click.echo("", err=True)
            self._open = False
        click.echo(text, err=True)

    def _inline(self, text: str) -> None:
        if self.tty:
            click.echo("\r" + text, nl=False, err=True)
            self._open = True

    def __call__(self, e: dict[str, Any]) -> bool:
        kind = e.get("kind", "")
        if not (kind.startswith("quality") or kind.startswith("quantize")):
            return False
        if self.quiet:
            return True
        name = Path(e.get("path", "")).name
        if kind == "quantize":
            self._line(f"quantizing to {e['type']} ({e['index']}/{e['count']}): {e['path']}")
        elif kind == "quantize_progress":
            self._inline(f"  {e['type']}: tensor {e['tensor']}/{e['tensors']}")
        elif kind == "quantize_done":
            self._line(f"  made {name} ({e['size'] / MiB:.1f} MiB)")
        elif kind == "quantize_reused":
            self._line(f"{e['type']}: reusing {e['path']}")
        elif kind == "quality_hash":
            self._inline(f"hashing {name}: {e['done'] / e['total'] * 100:.0f}%")
        elif kind == "quality_pass":
            if e["chunk"] == 0:
                what = "reference distributions of" if e["role"] == "reference" else "quality of"
                self._line(f"scoring the {what} {name} ({e['of']} chunks)")
            else:
                self._inline(f"  chunk {e['chunk']}/{e['of']}")
        elif kind == "quality_reference":
            how = "reused from" if e["reused"] else "cached in"
            self._line(f"reference distributions of {name}: {e['bytes'] / MiB:.1f} MiB, {how} {e['cache']}")
        elif kind == "quality_variant" and e.get("reused"):
            self._line(f"quality of {name}: reused from the cache")
        elif kind == "quality_fallback":
            self._line(f"{name} does not fit on the GPU whole ({e['reason'][:160]}); scoring it on the CPU")
        elif kind == "quality_cache_bad":
            self._line(f"ignoring a damaged cache file {e['cache']} ({e['reason'][:160]}); measuring again")
        return True


@click.command("quality")
@click.argument("model", type=click.Path())
@click.option("--variant", "variants", multiple=True, type=click.Path(),
              help="The same model in another quantization (repeatable; a folder of GGUF files works too).")
@click.option("--reference", type=click.Path(), default=None,
              help="Compare against this file (default: the one with the most bits per weight).")
@click.option("--corpus", type=click.Path(), default=None,
              help="UTF-8 text to score (default: Genesis, King James Version, shipped with the package).")
@click.option("--chunks", type=int, default=20, show_default=True, help="Chunks of --ctx tokens to score.")
@click.option("--ctx", "n_ctx", type=int, default=512, show_default=True, help="Tokens per chunk (the second half is scored).")
@click.option("--quantize", "quantize_types", default=None,
              help="Make these variants of MODEL first with llama.cpp's quantizer, e.g. Q4_K_M,Q5_K_M,Q6_K,Q8_0 (cached).")
@click.option("--imatrix", type=click.Path(), default=None, help="Importance matrix for --quantize (llama-imatrix's file).")
@click.option("--allow-requantize", is_flag=True, help="Let --quantize start from an already-quantized MODEL.")
@click.option("--n-gpu-layers", "-ngl", type=int, default=-1, show_default=True,
              help="Layers to offload while scoring (-1: all; a model that does not fit is scored on the CPU).")
@click.option("--threads", "-t", "n_threads", type=int, default=None, help="CPU threads (default: llama.cpp's).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (no progress).")
def quality_cmd(model: str, variants: tuple[str, ...], reference: str | None, corpus: str | None, chunks: int, n_ctx: int,
                quantize_types: str | None, imatrix: str | None, allow_requantize: bool, n_gpu_layers: int,
                n_threads: int | None, as_json: bool) -> None:
    """What each quantization of MODEL costs: KL divergence, top-1 agreement and perplexity against
    the highest-precision file, as llama-perplexity --kl-divergence measures them.

    The reference's token distributions are computed once and cached in the data folder; so is
    each variant's result.

    \b
    Examples:
      offload-tuner quality model-F16.gguf --variant model-Q8_0.gguf --variant model-Q4_K_M.gguf
      offload-tuner quality model-F16.gguf --quantize Q4_K_M,Q5_K_M,Q6_K,Q8_0 --chunks 40 --json
    """
    from ..search.quality import format_quality, quality

    report = quality(model, variants=variants, reference=reference, corpus=corpus, chunks=chunks, n_ctx=n_ctx,
                     quantize=quantize_types or (), imatrix=imatrix, allow_requantize=allow_requantize,
                     n_gpu_layers=n_gpu_layers, n_threads=n_threads, on_event=QualityProgress(quiet=as_json))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(format_quality(report))
