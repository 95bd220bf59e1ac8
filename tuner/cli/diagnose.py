"""``offload-tuner diagnose``: a llama.cpp log in plain words, with what would fix it.

Thin: read the log, call ``tuner.report.diagnose``, print. Tests pass ``obj={"gpus": [...]}`` to
inject this machine's GPUs (as ``machine.probe.probe_gpus`` returns them); without it NVML is asked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import LogUnreadableError

MiB = 1 << 20
_MAX_LOG = 512 * MiB  # a pasted log is kilobytes; a server's whole history can be large, not this


def read_log(source: str) -> bytes:
    """The log's bytes from a file or ``-`` (stdin); one clear error for anything else."""
    if source == "-":
        data = sys.stdin.buffer.read(_MAX_LOG + 1)
    else:
        path = Path(source)
        if not path.exists():
            raise LogUnreadableError(f"{path}: no such file")
        if path.is_dir():
            raise LogUnreadableError(f"{path}: is a directory, not a log file")
        try:
            with open(path, "rb") as handle:
                data = handle.read(_MAX_LOG + 1)
        except OSError as exc:
            raise LogUnreadableError(f"{path}: cannot read it ({exc.strerror or exc.__class__.__name__})") from None
    if len(data) > _MAX_LOG:
        raise LogUnreadableError(f"{source}: larger than {_MAX_LOG // MiB} MiB; give the part from the model load on")
    name = "standard input" if source == "-" else source
    if not data.strip():
        raise LogUnreadableError(f"{name}: the log is empty: pipe or paste llama.cpp's output (2>&1), from its first line")
    sample = data[:65536]
    if b"\x00" in sample or sum(b < 9 or 13 < b < 32 for b in sample) > len(sample) // 20:
        raise LogUnreadableError(f"{name}: binary data, not a text log; give llama.cpp's printed output")
    return data


@click.command("diagnose")
@click.argument("log", required=False, default="-", type=click.Path(allow_dash=True))
@click.option("--model", "model_path", type=click.Path(), default=None,
              help="The model the log loaded: levers use its exact tensor sizes (else the log's own numbers).")
@click.option("--device", "devices", multiple=True, metavar="NAME=SIZE",
              help="What an accelerator can give, e.g. CUDA0=24GiB (repeatable); overrides the log's free memory.")
@click.option("--margin", "margin_mib", type=click.IntRange(min=0), default=512, show_default=True,
              help="MiB kept free on each accelerator when judging whether a lever reaches full offload.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: what_happened, memory, levers.")
@click.pass_context
def diagnose_cmd(ctx: click.Context, log: str, model_path: str | None, devices: tuple[str, ...], margin_mib: int,
                 as_json: bool) -> None:
    """Say what a llama.cpp load log shows and what would fix it, with numbers.

    LOG is a file or - (standard input, the default). What happened (layers offloaded, partial
    offload, out of memory and where, a silent CPU fallback), where the memory went per device,
    and the levers ranked by effect: a smaller quantization, a smaller context, a q8_0/q4_0 KV
    cache, experts or FFN on the CPU, the KV cache on the host, memory held by other processes.

    \b
    Examples:
      llama-server -m model.gguf -ngl 99 2>&1 | offload-tuner diagnose
      offload-tuner diagnose server.log --model model-Q4_K_M.gguf --device CUDA0=12GiB
      offload-tuner diagnose server.log --json
    """
    from ..machine.whatif import from_options
    from ..report.diagnose import diagnose

    text = read_log(log)
    info = None
    if model_path:
        from ..model.inspect import inspect

        info = inspect(model_path)
    machine = from_options(devices) if devices else None
    obj = ctx.obj if isinstance(ctx.obj, dict) else {}
    result = diagnose(text, model=info, machine=machine, local_gpus=obj.get("gpus"), margin=margin_mib * MiB)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(result.format())


def register(cli: Any) -> None:
    cli.add_command(diagnose_cmd)
