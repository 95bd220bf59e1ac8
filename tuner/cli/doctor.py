"""``offload-tuner doctor``: each check of this set-up, ok / warning / problem, with its fix.

Thin: call ``tuner.report.doctor.run_checks``, print; exit 1 when any check is a problem.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click


@click.command("doctor")
@click.option("--llama-bin", "llama_bin", type=click.Path(), default=None,
              help="Folder of your llama.cpp binaries to check (default: llama-bench on PATH, if any).")
@click.option("--storage", default=None,
              help="A study database URL to check, as tune's --storage (default: the SQLite file in the data folder).")
@click.option("--json", "as_json", is_flag=True, help='Print {"checks": [{"name", "status", "found", "fix"}]}.')
def doctor_cmd(llama_bin: str | None, storage: str | None, as_json: bool) -> None:
    """Why is it not using my GPU? Each check says ok, warning or problem, what it found and the
    exact fix: the GPUs the OS has against the devices llama.cpp lists (a CPU-only build), GPU offload
    and RPC support, the CUDA driver and runtime, the AMX / weight-repacking crash (a ~10 s decode in
    a child process), GPU memory held by other processes, the data folder and its free disk, the
    study database and profile registry, your llama.cpp binaries, and profiles made with another
    llama.cpp than the one installed. Exit code 1 when any check is a problem.

    \b
    Examples:
      offload-tuner doctor
      offload-tuner doctor --llama-bin ~/llama.cpp/build/bin --json
    """
    from ..report.doctor import failed, format_checks, run_checks

    checks = run_checks(llama_bin=llama_bin, storage=storage)
    if as_json:
        click.echo(json.dumps({"checks": [c.to_dict() for c in checks]}, indent=2))
    else:
        click.echo(format_checks(checks))
    if failed(checks):
        sys.exit(1)


def register(cli: Any) -> None:
    cli.add_command(doctor_cmd)
