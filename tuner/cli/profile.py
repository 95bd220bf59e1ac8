"""``offload-tuner profile ...``: list, show, check, export arguments, share bundles.

Thin: parse, call ``tuner.profile.document`` / ``tuner.profile.apps`` / ``tuner.profile.exports``, print. Domain errors become
one line with a message a person can act on, exit code 2 (``ProfileCommandError``), as every command's. Tests pass ``obj={"machine": Machine}``
to inject the machine; without it, commands that need one probe this machine.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import click

from ..errors import TunerError
from ..profile.exports import FORMATS, export_args
from ..paths import ENV_PROFILE_PATH, ENV_REGISTRY, profiles_dir
from ..profile.document import Profile, ProfileWarning, format_bytes
from ..profile.store import import_bundle, list_profiles, profile_search_path, resolve_profile, without_path, write_bundle
from ..report.summary import profile_summary, workload_in_words

class ProfileCommandError(click.ClickException):
    """One line on stderr and exit code 2: the house rule for bad input (a missing, unreadable, foreign
    or newer profile, an invalid bundle entry, a profile that does not fit with --strict)."""

    exit_code = 2


profile_group = click.Group(
    "profile",
    help=(
        "Saved profiles: list, show, check against this machine, print as llama.cpp / ollama arguments, "
        "and share with a team as one bundle file.\n\n"
        "Profiles are looked up in your folder first, then in each folder of OFFLOAD_TUNER_PROFILE_PATH "
        "(separated by ':'; ';' on Windows), then in the team's registry (OFFLOAD_TUNER_REGISTRY, a database "
        "URL: `profile publish` and `profile pull`). A PROFILE argument is a file path or a name from "
        "`offload-tuner profile list`.\n\n"
        "Example:\n\n"
        "    offload-tuner profile list --all"
    ),
)


def _machine(ctx: click.Context) -> Any:
    obj = ctx.obj if isinstance(ctx.obj, dict) else {}
    if obj.get("machine") is not None:
        return obj["machine"]
    from ..profile.apps import this_machine

    return this_machine()


def _resolve(ref: str) -> Profile:
    try:
        return resolve_profile(ref)
    except TunerError as exc:
        raise ProfileCommandError(str(exc)) from None


def _origin_label(origin: Path) -> str:
    if origin.resolve() == profiles_dir().resolve():
        return "your profiles"
    if origin.is_file():
        return f"{ENV_PROFILE_PATH} file"
    return "team folder"


def _show_warnings(caught: list[warnings.WarningMessage]) -> None:
    for warning in caught:
        click.echo(f"warning: {warning.message}", err=True)


def _report_copied(results: list[Any], force: bool, *, label: Any, empty: str, invalid: str) -> None:
    """What an import or a pull did, a line a profile and a summary; one error line (exit 2) when any
    profile was invalid or could not be written."""
    counts: dict[str, int] = {}
    for result in results:
        counts[result.action] = counts.get(result.action, 0) + 1
        where = f" -> {result.path}" if result.action in ("imported", "replaced") else ""
        click.echo(f"{label(result.index)} {result.action}{where}: {result.detail}")
    click.echo(", ".join(f"{n} {action}" for action, n in counts.items()) or empty)
    if counts.get("conflict") or (counts.get("duplicate") and not force):
        click.echo("nothing was overwritten; --force replaces existing profiles", err=True)
    problems = []
    if counts.get("invalid"):
        problems.append(f"{counts['invalid']} profile(s) {invalid}")
    if counts.get("failed"):
        problems.append(f"{counts['failed']} profile(s) could not be written (see above)")
    if problems:
        raise ProfileCommandError("; ".join(problems))


def _chosen_or_all(profiles: tuple[str, ...], hint: str, verb: str = "export") -> list[Profile]:
    """The profiles named, or every readable one in the user's folder (the unreadable ones said on stderr)."""
    if profiles:
        return [_resolve(ref) for ref in profiles]
    entries = list_profiles([profiles_dir()])
    chosen = [e.profile for e in entries if e.profile is not None]
    for entry in entries:
        if entry.error is not None:
            click.echo(f"skipped {entry.path}: {entry.problem}", err=True)
    if not chosen:
        raise ProfileCommandError(f"no profiles in {profiles_dir()} to {verb}; {hint}")
    return chosen


@profile_group.command("list")
@click.option("--all", "show_all", is_flag=True, help="Also profiles of other machines and files that cannot be read.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per profile, for scripts.")
@click.pass_context
def list_command(ctx: click.Context, show_all: bool, as_json: bool) -> None:
    """Profiles on the search path that fit this machine, and where each came from.

    A profile fits this machine when it was tuned on it (machine fingerprint) or on one with the same GPU
    models and memory (hardware class). The first one of a name wins, as with PATH.

    Example:

        offload-tuner profile list --all
    """
    machine = None if show_all else _machine(ctx)
    injected = isinstance(ctx.obj, dict) and ctx.obj.get("machine") is not None
    seen_by: dict[str, Any] = {}  # binaries' folder -> this machine as those binaries see it
    rows = []
    for entry in list_profiles():
        profile = entry.profile
        match = ""
        if profile is not None and machine is not None:
            from ..machine.identity import match as identity_match

            how = identity_match(profile.machine, machine)
            engine = profile.engine
            if (how is None and not injected and engine is not None and engine.name == "llama-cpp" and engine.path
                    and os.path.isdir(engine.path)):
                # measured with the user's binaries (a Vulkan or ROCm build beside a CPU-only
                # llama-cpp-python): this machine as those binaries see it, as load_profile does
                from ..profile.apps import this_machine

                if engine.path not in seen_by:
                    seen_by[engine.path] = this_machine(engine.path)
                how = identity_match(profile.machine, seen_by[engine.path])
            if how in ("fingerprint", "legacy fingerprint"):
                match = "this machine"
            elif how in ("class", "legacy class"):
                match = "same hardware class"
            else:
                continue
        elif profile is None and not show_all:
            continue
        rows.append((entry, profile, match))
    if as_json:
        for entry, profile, match in rows:
            record: dict[str, Any] = {"name": entry.path.stem, "path": str(entry.path), "origin": str(entry.origin)}
            if profile is None:
                record["error"] = str(entry.error)
            else:
                record.update(
                    model=profile.model.file_name,
                    machine=profile.machine.describe(),
                    objective=profile.objective,
                    tg=profile.measured.tg.median,
                    pp=profile.measured.pp.median,
                    created_at=profile.created_at,
                )
                if match:
                    record["match"] = match
            click.echo(json.dumps(record))
        return
    if not rows:
        where = ", ".join(str(p) for p in profile_search_path())
        hint = "" if show_all else " for this machine (--all lists every profile)"
        click.echo(f"no profiles{hint} in {where}")
        return
    for entry, profile, match in rows:
        click.echo(entry.path.stem)
        click.echo(f"    from  {entry.path}  ({_origin_label(entry.origin)}: {entry.origin})")
        if profile is None:
            click.echo(f"    cannot be used: {entry.problem}")
            continue
        s = profile.settings
        click.echo(
            f"    {profile.model.file_name} on {profile.machine.describe()}{f' ({match})' if match else ''}"
        )
        click.echo(
            f"    tg {profile.measured.tg.median:g} t/s, pp {profile.measured.pp.median:g} t/s (objective {profile.objective}); "
            f"n_gpu_layers {s.n_gpu_layers}, n_ctx {s.n_ctx}; tuned {profile.created_at}"
        )


def _workload_lines(p: Any) -> list[str]:
    """What the profile was tuned for (users, their requests) and its figures at that load."""
    w = p.workload
    if w is None:
        return ["  workload  1 user (a profile from before workloads were recorded)"]
    head = (f"  workload  {w.users} user(s) at once, {w.n_prompt} prompt / {w.n_gen} generated tokens at depth {w.depth}, "
            f"objective {w.objective}" + (f", every user at or above {w.min_user_tg:g} t/s" if w.min_user_tg is not None else ""))
    figures = workload_in_words(w)
    lines = [head] + ([f"            {', '.join(figures)}"] if figures else [])
    for point in sorted((c for c in w.curve if c.candidate == "winner"), key=lambda c: c.users):
        if point.aggregate_tg:
            lines.append(f"            at {point.users} user(s): aggregate {point.aggregate_tg.median:.1f} t/s, "
                         f"per user {point.aggregate_tg.median / point.users:.1f} t/s")
    return lines


def _llama_line(p: Profile) -> str:
    """Which llama.cpp measured the profile: the engine and its build (a 1.0 profile: llama-cpp-python)."""
    backends = ", ".join(p.llama_build.backends) or "none recorded"
    if p.engine is not None and p.engine.name == "llama-cpp":
        return f"  llama.cpp your binaries ({p.engine.path or '?'}), build {p.engine.build}, backends {backends}"
    return (f"  llama.cpp llama-cpp-python {p.llama_build.llama_cpp_python or '?'}, build {p.llama_build.llama_cpp_build or '?'}, "
            f"backends {backends}")


@profile_group.command("show")
@click.argument("profile")
@click.option("--json", "as_json", is_flag=True, help="The profile document itself.")
def show_command(profile: str, as_json: bool) -> None:
    """Everything a profile records: machine, model, settings, speeds, memory per device.

    Example:

        offload-tuner profile show Qwen3-8B-Q4_K_M--0123456789abcdef
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileWarning)
        p = _resolve(profile)
    _show_warnings(caught)
    if as_json:
        click.echo(p.to_json(), nl=False)
        return
    m, s = p.measured, p.settings
    out = [
        f"{p.name}  ({p.path})",
        f"  schema {p.schema_version}, written by offload-tuner {p.tool_version} at {p.created_at}",
        f"  model     {p.model.file_name}: {p.model.architecture}, {p.model.quantization or 'unknown quantization'}, "
        f"{p.model.n_layer} layers, {format_bytes(p.model.size)}, header {p.model.header_hash[:12]}",
        f"  machine   {p.machine.describe()}; {p.machine.physical_cores} cores, {format_bytes(p.machine.ram_total)} RAM; "
        f"{p.machine.system} {p.machine.arch}; fingerprint {p.machine.fingerprint}, hardware class {p.machine.hardware_class}",
        _llama_line(p),
        f"  objective {p.objective}; min_ctx {p.min_ctx}",
        f"  measured  tg {m.tg.median:g} t/s (95% CI {m.tg.ci_low:g}-{m.tg.ci_high:g}), "
        f"pp {m.pp.median:g} t/s (95% CI {m.pp.ci_low:g}-{m.pp.ci_high:g}); "
        f"{m.n_prompt} prompt / {m.n_gen} generated tokens at depth {m.depth}",
        f"  offload   {profile_summary(p)}",
        *_workload_lines(p),
        "  settings",
    ]
    out += [f"    {key} = {json.dumps(value)}" for key, value in s.to_dict().items()]
    out.append("  memory (predicted; actual where measured)")
    for device, predicted in p.memory.predicted.items():
        actual = p.memory.actual.get(device)
        line = (
            f"    {device}: {format_bytes(predicted.need)} (weights {format_bytes(predicted.weights)}, "
            f"kv {format_bytes(predicted.kv)}, compute {format_bytes(predicted.compute)})"
        )
        if actual is not None:
            line += f"; actual {format_bytes(actual.need)}"
        out.append(line)
    t = p.trials
    out.append(f"  trials    {t.run} run, {t.pruned} pruned, {t.oom} out of memory, {t.failed} failed")
    if p.runner_up is not None:
        out.append(
            f"  runner-up within noise: tg {p.runner_up.tg.median:g} t/s, pp {p.runner_up.pp.median:g} t/s with "
            f"n_gpu_layers {p.runner_up.settings.n_gpu_layers}, n_ctx {p.runner_up.settings.n_ctx}"
        )
    if p.study is not None:
        out.append(f"  study     {p.study.name} ({p.study.storage or 'storage not recorded'})")
    out.append(f"  run it    {export_args(p, 'llama-server').strip()}")
    out.append("            (the model path as recorded; `offload-tuner profile args PROFILE --model PATH` puts yours)")
    click.echo("\n".join(out))


@profile_group.command("args")
@click.argument("profile")
@click.option(
    "--for", "fmt", type=click.Choice(FORMATS), default="llama-server", show_default=True,
    help="The tool to write the settings for.",
)  # fmt: skip
@click.option("--model", "model_path", type=click.Path(dir_okay=False), help="The model file on this machine (default: the path recorded when tuning).")
@click.option("--llama-bin", "llama_bin", type=click.Path(file_okay=False), default=None,
              help="Check the flags with the llama.cpp binaries in this folder (default: the tool on PATH, if any).")
def args_command(profile: str, fmt: str, model_path: str | None, llama_bin: str | None) -> None:
    """Print a profile as a command line, an ollama Modelfile, LLAMA_ARG_* variables, a llama-swap
    entry, an LM Studio per-model config or a koboldcpp .kcpps (what those cannot say: on stderr).

    When the llama.cpp tool is installed (on PATH, or in --llama-bin), its own argument parser
    checks the flags first; a flag it does not know is a warning on stderr (an older build).

    Examples:

        offload-tuner profile args Qwen3-8B-Q4_K_M--0123456789abcdef --for llama-server --model ~/models/Qwen3-8B-Q4_K_M.gguf

        offload-tuner profile args my.json --for ollama > Modelfile && ollama create qwen3-tuned -f Modelfile

        eval "$(offload-tuner profile args my.json --for env)" && llama-server

        offload-tuner profile args my.json --for kcpps > tuned.kcpps && koboldcpp --config tuned.kcpps
    """
    p = _resolve(profile)
    try:
        text = export_args(p, fmt, model_path=model_path)
    except TunerError as exc:
        raise ProfileCommandError(str(exc)) from None
    _check_with_binaries(p, fmt, model_path, llama_bin)
    click.echo(text, nl=False)
    from ..profile.exports import export_notes

    for note in export_notes(p, fmt):
        click.echo(f"note: not in the {fmt} file: {note}", err=True)


def _check_with_binaries(p: Profile, fmt: str, model_path: str | None, llama_bin: str | None) -> None:
    """The exported flags through the installed llama.cpp's own parser, where there is one."""
    from ..engine.llamacpp import check_exported_flags
    from ..profile.exports import tool_args

    tool = "llama-server" if fmt in ("env", "llama-swap") else fmt
    if tool not in ("llama-server", "llama-cli", "llama-bench"):
        return  # an ollama Modelfile is read by ollama, not by llama.cpp's parser
    if llama_bin is not None and not Path(llama_bin).is_dir():
        raise ProfileCommandError(f"--llama-bin {llama_bin}: no such folder")
    answer = check_exported_flags(tool, tool_args(p, tool, model_path=model_path), llama_bin)
    if answer is None:
        if llama_bin is not None:
            click.echo(f"warning: {llama_bin} has no {tool} (nor another llama.cpp tool that parses its flags): "
                       "the flags were not checked", err=True)
        return
    binary, error = answer
    if error is not None:
        click.echo(f"warning: {binary} does not accept these flags: {error} (an older llama.cpp? upgrade it, "
                   "or drop that setting)", err=True)


@profile_group.command("check")
@click.argument("model_path", type=click.Path(dir_okay=False))
@click.option("--strict", is_flag=True, help="Fail instead of reporting the changes needed to fit.")
@click.pass_context
def check_command(ctx: click.Context, model_path: str, strict: bool) -> None:
    """Which profile an app would load for MODEL_PATH here, and whether it still fits in free memory now.

    Example:

        offload-tuner profile check ~/models/Qwen3-8B-Q4_K_M.gguf
    """
    from ..profile.apps import load_profile

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileWarning)
        try:
            # no injected machine: load_profile probes this one as an app does (and, for a profile measured
            # with llama.cpp binaries, as those binaries see it)
            injected = ctx.obj.get("machine") if isinstance(ctx.obj, dict) else None
            p = load_profile(model_path, machine=injected, strict=strict)
        except TunerError as exc:
            _show_warnings(caught)
            raise ProfileCommandError(str(exc)) from None
    _show_warnings(caught)
    click.echo(f"{p.name}  ({p.path})")
    if p.degradation:
        click.echo("changed to fit this machine now:")
        for change in p.degradation:
            click.echo(f"  - {change}")
    else:
        click.echo("fits as recorded")
    click.echo(export_args(p, "llama-server").strip())


@profile_group.command("export")
@click.argument("profiles", nargs=-1)
@click.option("-o", "--output", required=True, type=click.Path(), help="The bundle file to write.")
def export_command(profiles: tuple[str, ...], output: str) -> None:
    """Write profiles to one bundle file for a teammate (`profile import`). No PROFILES: all of yours.

    Example:

        offload-tuner profile export -o team-profiles.json
    """
    if os.path.isdir(output):  # (one line, as every bad input: click's own check printed its usage)
        raise ProfileCommandError(f"-o {output}: is a folder; give the bundle's file name, e.g. "
                                  f"{os.path.join(output, 'profiles.json')}")
    chosen = _chosen_or_all(profiles, "name the ones to export")
    try:
        path = write_bundle(chosen, output)
    except TunerError as exc:
        raise ProfileCommandError(str(exc)) from None
    click.echo(f"wrote {len(chosen)} profile(s) to {path}")


@profile_group.command("import")
@click.argument("bundle", type=click.Path())
@click.option("--force", is_flag=True, help="Replace profiles that are already there.")
@click.option("--to", "dest", type=click.Path(file_okay=False), help="The folder to import into (default: your profiles).")
def import_command(bundle: str, force: bool, dest: str | None) -> None:
    """Read a bundle from `profile export`: each profile is validated; duplicates are reported, not overwritten.

    Example:

        offload-tuner profile import team-profiles.json
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileWarning)
        try:
            results = import_bundle(bundle, dest=dest, force=force)
        except TunerError as exc:
            raise ProfileCommandError(f"{bundle}: {without_path(str(exc), bundle)}") from None
    _show_warnings(caught)
    _report_copied(results, force, label=lambda i: f"profiles[{i}]", empty="the bundle is empty",
                   invalid=f"in {bundle} are invalid and were not imported")


def _registry_url(url: str | None, flag: str) -> str:
    if not url:
        raise click.UsageError(f"give {flag} URL (the team's database, e.g. postgresql://tuner@db.example/tuning), "
                               f"or set {ENV_REGISTRY}")
    return url


@profile_group.command("publish")
@click.argument("profiles", nargs=-1)
@click.option("--to", "url", envvar=ENV_REGISTRY, show_envvar=True,
              help="The registry: a database URL (PostgreSQL for a team; any SQLAlchemy URL works).")
@click.option("--force", is_flag=True, help="Replace a different profile of the same model and machine in the registry.")
def publish_command(profiles: tuple[str, ...], url: str | None, force: bool) -> None:
    """Publish profiles to the team's registry, for machines of the same hardware class. No PROFILES: all of yours.

    Each profile is validated; the same profile again is reported as a duplicate, and another profile of
    the same model on the same machine is not replaced without --force.

    Example:

        offload-tuner profile publish --to postgresql://tuner@db.example/tuning
    """
    from ..profile.registry import publish

    url = _registry_url(url, "--to")
    chosen = _chosen_or_all(profiles, "tune first, or name the ones to publish", verb="publish")
    try:
        results = publish(chosen, url, force=force)
    except TunerError as exc:
        raise ProfileCommandError(str(exc)) from None
    counts: dict[str, int] = {}
    for result in results:
        counts[result.action] = counts.get(result.action, 0) + 1
        click.echo(f"{result.name}: {result.action}: {result.detail}")
    click.echo(", ".join(f"{n} {action}" for action, n in counts.items()))
    if counts.get("conflict"):
        click.echo("nothing was overwritten; --force replaces the registry's profile", err=True)
    if counts.get("invalid"):
        raise ProfileCommandError(f"{counts['invalid']} profile(s) are invalid and were not published")


@profile_group.command("pull")
@click.option("--from", "url", envvar=ENV_REGISTRY, show_envvar=True, help="The registry's database URL.")
@click.option("--class", "hardware_class", default=None,
              help="The hardware class to fetch (default: this machine's; `offload-tuner probe --json` shows it).")
@click.option("--force", is_flag=True, help="Replace profiles that are already in your folder.")
@click.pass_context
def pull_command(ctx: click.Context, url: str | None, hardware_class: str | None, force: bool) -> None:
    """Copy the team's profiles for this machine's hardware class from the registry into your folder.

    A machine of a known hardware class gets the team's profiles without tuning. Each profile is validated;
    duplicates are reported, and nothing is overwritten without --force.

    Example:

        offload-tuner profile pull --from postgresql://tuner@db.example/tuning
    """
    from ..profile.registry import pull

    url = _registry_url(url, "--from")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileWarning)
        try:
            results = pull(url, hardware_class=hardware_class, machine=None if hardware_class else _machine(ctx), force=force)
        except TunerError as exc:
            raise ProfileCommandError(str(exc)) from None
    _show_warnings(caught)
    _report_copied(results, force, label=lambda i: f"registry #{i}", empty="the registry has no profile for this hardware class",
                   invalid="in the registry are invalid and were not pulled")


__all__ = ["profile_group"]
