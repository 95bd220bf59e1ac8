"""The ``offload-tuner`` command: thin. Parse, call the API, print; domain errors become one line.

Every ``TunerError`` (a bad model path, a truncated GGUF, an invalid setting...) is printed as
``Error: <what is wrong and what to do>`` on stderr with exit code 2 and no traceback;
``--debug`` shows the traceback. Every message loses the credentials of any database URL this
process opened (``tuner.profile.dburl.scrub``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

import click

from .. import __version__
from ..errors import SettingsError, TunerError

MiB = 1 << 20
GIB = 1 << 30


class _Group(click.Group):
    """Turns TunerError, and any command's ClickException, into a clean one-line error (exit 2), unless --debug."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TunerError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            from ..profile.dburl import scrub

            click.echo(f"Error: {scrub(str(exc))}", err=True)
            ctx.exit(2)
        except click.ClickException as exc:
            from ..profile.dburl import scrub

            exc.message = scrub(exc.message)
            exc.exit_code = 2  # one line, exit code 2, whichever command said it
            raise


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="offload-tuner")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Find the fastest way to run a GGUF model with llama.cpp on this machine.

    \b
    Try it on a built-in demo model (no GPU, no download):
      offload-tuner tune --demo
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    _tolerant_output()


def _tolerant_output() -> None:
    """A file name that is not UTF-8 (Linux keeps it as surrogate escapes) is printed as its own
    bytes, and anything the terminal's encoding lacks as an escape, never a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
        try:
            stream.reconfigure(errors="surrogateescape" if encoding == "utf8" else "backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass


def _emit(as_json: bool, data: Any, text: Callable[[], str]) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        click.echo(text())


def engine_options(fn: Callable) -> Callable:
    """--engine and --llama-bin: which llama.cpp runs the trials (shared by tune, bench and probe)."""
    fn = click.option("--llama-bin", "llama_bin", type=click.Path(), default=None,
                      help="Folder of your llama.cpp binaries (llama-bench, llama-server...); implies --engine llama-cpp. "
                           "Default: llama-bench on PATH.")(fn)
    fn = click.option("--engine", "engine", type=click.Choice(["python", "llama-cpp"]), default=None,
                      help="python: llama.cpp inside llama-cpp-python (default); llama-cpp: your own llama.cpp binaries, "
                           "the build you deploy.")(fn)
    return fn


# -- inspect / estimate / probe --------------------------------------------------------------


def _say_fetched(info: Any) -> None:
    """For a model read over the network: how much was fetched, on stderr (stdout stays the
    same answer as for the local file)."""
    if info.fetched:
        from ..model.remote import describe_fetched

        click.echo(describe_fetched(info.fetched), err=True)


@cli.command("inspect")
@click.argument("model", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def inspect_cmd(model: str, as_json: bool) -> None:
    """Shapes, quantization and per-layer sizes of a GGUF model, from its header.

    MODEL is a file, or a URL: https://..., or hf://OWNER/REPO/FILE.gguf (a Hugging Face file;
    hf://OWNER/REPO@REVISION/FILE.gguf for a branch, tag or commit). For a URL only the header and
    tensor table are fetched, with range requests; HF_TOKEN is sent for private repositories.

    \b
    Examples:
      offload-tuner inspect model-Q4_K_M.gguf --json
      offload-tuner inspect hf://OWNER/REPO/model-Q4_K_M.gguf
    """
    from ..model.inspect import describe, inspect

    info = inspect(model)
    _say_fetched(info)
    _emit(as_json, info.to_dict(), lambda: describe(info))


def settings_options(fn: Callable | None = None, *, defaults: dict[str, Any] | None = None, skip: tuple[str, ...] = ()) -> Any:
    """The Settings options of bench and estimate, one per dimension of ``tuner.engine.dimensions``
    (named as llama.cpp's where they exist). ``defaults`` replaces a dimension's default here."""

    def decorate(fn: Callable) -> Callable:
        from ..engine.dimensions import DIMENSIONS

        options = []
        for dim in DIMENSIONS:
            option = dim.option
            if option is None or dim.name in skip:
                continue
            default = (defaults or {}).get(dim.name, dim.default)
            kwargs: dict[str, Any] = {"help": option.help or None}
            if option.switch is not None:
                kwargs.update(is_flag=True, flag_value=option.switch, default=default)
            elif option.bare is not None:
                kwargs.update(is_flag=False, flag_value=option.bare)
            elif option.multiple:
                kwargs.update(multiple=True)
            elif option.parse is not None:
                kwargs.update(default=None)
            if option.switch is None and not option.multiple and option.parse is None:
                kwargs.update(default=default, show_default=default is not None)
                if dim.kind == "choice":
                    kwargs["type"] = click.Choice(list(dim.choices))
                elif dim.kind in ("int", "count"):
                    kwargs["type"] = int
            options.append(click.option(*option.names, dim.name, **kwargs))
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate(fn) if fn is not None else decorate


def settings_from_options(model: str, opts: dict[str, Any]) -> Any:
    """A Settings from the options ``settings_options`` added (popped from ``opts``)."""
    from ..engine.dimensions import DIMENSIONS
    from ..engine.settings import Settings

    values: dict[str, Any] = {"model_path": str(Path(model))}
    for dim in DIMENSIONS:
        if dim.option is None or dim.name not in opts:
            continue
        value = opts.pop(dim.name)
        if dim.option.parse is not None:
            try:
                value = dim.option.parse(value)
            except ValueError as exc:
                raise click.BadParameter(str(exc), param_hint=dim.option.names[0]) from None
            if value is None:
                value = dim.default
        values[dim.name] = value
    return Settings(**values)


def _floats(value: str | None) -> tuple[float, ...] | None:
    if not value:
        return None
    try:
        return tuple(float(x) for x in value.replace("/", ",").split(","))
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None


@cli.command("estimate")
@click.argument("model", type=click.Path())
@click.option("--kv-type", default=None, help="KV cache type for K and V at once (f16, q8_0, q4_0, ...); sets -ctk and -ctv.")
@click.option("--no-flash-attn", "no_flash_attn", is_flag=True, help="The same as --flash-attn off.")
@click.option("--device", "device_specs", multiple=True, metavar="NAME=SIZE",
              help="An accelerator of the machine to size for, e.g. CUDA0=24GiB (repeatable; 12000MiB, 24GB work too).")
@click.option("--ram", default=None, metavar="SIZE", help="The machine's RAM, e.g. 64GiB (checked for the part left on the host).")
@click.option("--machine", "machine_file", type=click.Path(), default=None,
              help="Another machine's `offload-tuner probe --json` output: size for that machine.")
@click.option("--table", is_flag=True,
              help="One row per standard quantization of this model: full offload at 4k/16k/32k/training context, or the most layers.")
@click.option("--devices", default=None, help="Accelerator names for --free or -ngl, e.g. CUDA0,CUDA1 (older form of --device).")
@click.option("--free", "free_mib", default=None, help="Free MiB per device (comma list; older form of --device).")
@click.option("--margin", "margin_mib", type=click.IntRange(min=0), default=512, show_default=True,
              help="MiB kept free on each device when sizing for a machine.")
@click.option("--compare-fit", is_flag=True,
              help="Print llama.cpp's own projection per device (llama-fit-params --fit-print) next to this estimate.")
@click.option("--llama-bin", "llama_bin", type=click.Path(), default=None,
              help="With --compare-fit: the folder of your llama.cpp binaries (default: llama-bench on PATH).")
@click.option("--rpc", "rpc", default=None, help="With --compare-fit: RPC servers host:port,... used as devices.")
@click.option("--users", "users", type=click.IntRange(min=1), default=None,
              help="Concurrent users (llama-server's slots): the KV cache holds every one's context; the same as -np. "
                   "--ctx is then the total they share.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
# (estimate's own --device/--devices describe a machine to size for; the device list is not a sizing question)
@settings_options(defaults={"n_gpu_layers": None}, skip=("rpc_servers", "devices"))
def estimate_cmd(model: str, kv_type: str | None, no_flash_attn: bool, device_specs: tuple[str, ...], ram: str | None,
                 machine_file: str | None, table: bool, devices: str | None, free_mib: str | None, margin_mib: int,
                 compare_fit: bool, llama_bin: str | None, rpc: str | None, users: int | None, as_json: bool,
                 **opts: Any) -> None:
    """Memory per device (weights, KV cache, compute) before loading anything; what fits on a machine.

    Takes bench's settings options (the same names as llama.cpp's); -ngl -1 is every layer.
    MODEL is a file or a URL (as for inspect): a model can be sized before its download.

    With a machine (--device NAME=SIZE, --machine FILE, or --free) and no --n-gpu-layers: the most
    layers that fit per context and KV cache type, whether full offload is possible, and the
    largest standard quantization of this model that runs fully offloaded. --table answers "which
    file should I download?" for the machine (this one when none is given).

    \b
    Examples:
      offload-tuner estimate model.gguf --n-gpu-layers 20 --ctx 8192 --kv-type q8_0
      offload-tuner estimate model.gguf --device CUDA0=24GiB --ram 64GiB --ctx 32768
      offload-tuner estimate hf://OWNER/REPO/model-Q4_K_M.gguf --machine colleague-probe.json --table
      offload-tuner estimate model.gguf --free 8000 --ctx 8192      # older form: most layers in 8000 MiB
      offload-tuner estimate model.gguf -ngl 20 --ctx 8192 --compare-fit --llama-bin ~/llama.cpp/build/bin
      offload-tuner estimate model.gguf -ngl 99 --ctx 32768 --users 4 --kv-unified
    """
    if users is not None:
        opts["n_parallel"] = users
    from ..machine import whatif
    from ..model.estimate import estimate, format_estimate
    from ..model.inspect import inspect
    from ..report import fit

    given = [flag for flag, value in (("--device", device_specs), ("--machine", machine_file), ("--free", free_mib)) if value]
    if len(given) > 1:
        raise click.UsageError(f"{' and '.join(given)}: give the machine one way")
    names = [d for d in devices.split(",") if d] if devices else None
    if machine_file:
        spec = whatif.from_probe_json(machine_file)
    elif device_specs:
        spec = whatif.from_options(device_specs, ram)
    elif free_mib:
        spec = whatif.from_free_list(_floats(free_mib) or (), names)
    else:
        spec = None
    if spec is not None and ram and not device_specs:
        spec = whatif.MachineSpec(spec.devices, whatif.parse_size(ram, what="--ram"), spec.source, spec.names)
    info = inspect(model)
    _say_fetched(info)
    n_gpu_layers = opts["n_gpu_layers"]
    if kv_type is not None:
        opts["type_k"] = opts["type_v"] = kv_type
    if no_flash_attn:
        opts["flash_attn"] = "off"
    settings = settings_from_options(model, {**opts, "n_gpu_layers": n_gpu_layers if n_gpu_layers is not None else 0})
    if compare_fit:
        if n_gpu_layers is None:
            raise click.UsageError("--compare-fit needs --n-gpu-layers (the placement to compare)")
        _compare_fit(info, settings.replace(rpc_servers=tuple(x for x in (rpc or "").split(",") if x)), devices,
                     llama_bin, as_json)
        return
    margin = margin_mib * MiB
    for name in ("type_k", "type_v"):
        if getattr(settings, name) not in info.kv_bytes_per_token:
            raise click.BadParameter(f"{getattr(settings, name)!r} is not a KV cache type for this model "
                                     f"(known: {', '.join(info.kv_bytes_per_token)})", param_hint="--kv-type")

    if table:
        if spec is None:
            from ..profile.apps import this_machine

            spec = whatif.from_machine(this_machine())
        contexts = fit.contexts_for(info)
        rows = fit.quantization_table(info, spec, contexts, settings, margin=margin)
        data = {"machine": spec.to_dict(), "model": Path(info.path).name, "quantization": info.quantization,
                "contexts": contexts, "type_k": settings.type_k, "type_v": settings.type_v, "rows": [r.to_dict() for r in rows]}
        _emit(as_json, data, lambda: "\n".join(
            [f"{Path(info.path).name} ({info.quantization}) on {spec.describe()} ({spec.source}); "
             f"KV {settings.type_k}/{settings.type_v}, margin {margin_mib} MiB",
             f"full offload (yes) or the most layers that fit, of {info.n_layer + 1}, by context:"]
            + fit.format_table(rows, contexts, info.n_ctx_train)))
        return

    if spec is None:
        if n_gpu_layers is None:
            raise click.UsageError("give --n-gpu-layers, or a machine (--device NAME=SIZE, --machine FILE) to find the most layers that fit")
        est = estimate(info, settings.replace(n_gpu_layers=n_gpu_layers), devices=names, cpu=_this_cpu())
        _emit(as_json, est.to_dict(), lambda: format_estimate(est))
        return

    best = fit.most_layers(info, spec, settings, margin)
    chosen = best if n_gpu_layers is None else n_gpu_layers
    est = fit.estimate_on(info, spec, chosen, settings)
    short = fit.over(est, spec, margin)
    data = est.to_dict()
    data["max_gpu_layers"] = best
    data["machine"] = spec.to_dict()
    data["fits"] = not short
    lines = [f"most layers that fit: {best}" + (" (all: full offload)" if best >= info.n_layer + 1 else f" of {info.n_layer + 1}")]
    if n_gpu_layers is not None:
        lines.append(f"n_gpu_layers {n_gpu_layers}: " + ("fits" if not short else "does not fit: " + ", ".join(
            f"{d} short by {b / MiB:.0f} MiB" for d, b in short.items())))
    lines.append(format_estimate(est))
    if n_gpu_layers is None:
        contexts = sorted(set(fit.contexts_for(info)) | {est.n_ctx})
        grid = fit.fit_grid(info, spec, contexts, base=settings, margin=margin)
        largest = fit.largest_quantization_that_fits(info, spec, settings, margin=margin)
        data["fit"] = [g.to_dict() for g in grid]
        data["full_offload"] = any(g.full for g in grid)
        data["largest_quantization"] = largest[0] if largest else None
        lines += fit.answer_lines(info, spec, grid, largest, settings)
    _emit(as_json, data, lambda: "\n".join(lines))


def _this_cpu() -> Any:
    """This machine's CPU features as llama-cpp-python's llama.cpp reports them (which weights it
    repacks); None when it cannot be asked."""
    from ..machine.probe import probe_llama_build
    from ..model.repack import CpuFeatures

    return CpuFeatures.parse(probe_llama_build().system_info)


def _compare_fit(info: Any, settings: Any, devices: str | None, llama_bin: str | None, as_json: bool) -> None:
    """Our arithmetic next to llama.cpp's own projection (llama-fit-params --fit-print), per device."""
    from ..engine.llamacpp import LlamaCppEngine
    from ..model.estimate import CPU, estimate

    servers = settings.rpc_servers
    with LlamaCppEngine(llama_bin) as engine:
        if engine.binaries.get("llama-fit-params") is None:
            raise click.ClickException(f"--compare-fit needs llama-fit-params (llama.cpp 2025-12 or newer), and "
                                       f"{engine.binaries.folder} has none")
        names = [d for d in devices.split(",") if d] if devices else [d.name for d in engine.devices(servers) if d.is_accelerator]
        ours = estimate(info, settings, devices=names)
        fit = engine.fit_memory(settings)
        build = engine.build().describe()
    if fit is None:
        raise click.ClickException("llama-fit-params could not project this placement (run it with --fit-print on to see why)")
    rows = []
    for device in list(dict.fromkeys([*ours.devices, *fit])):
        mine = ours.devices.get(device)
        theirs = fit.get(device)
        rows.append({
            "device": device,
            "ours": mine.to_dict() if mine else None,
            "llama_cpp": None if theirs is None else {**theirs, "total": sum(theirs.values())},
        })
    data = {"settings": settings.to_dict(), "llama_cpp_build": build, "devices": rows,
            "note": "llama.cpp prints whole MiB; its 'context' is the KV cache and the context's other buffers"}
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    mib = lambda b: f"{b / MiB:9.1f}"  # noqa: E731
    s = settings
    lines = [f"{Path(s.model_path).name}: ngl={s.n_gpu_layers} ctx={s.n_ctx} kv={s.type_k}/{s.type_v} ub={s.n_ubatch} fa={s.flash_attn}",
             f"llama.cpp's projection from llama-fit-params ({build}), in MiB:",
             f"{'device':<28}{'ours: weights':>14}{'kv':>10}{'compute':>10}{'total':>10}   "
             f"{'llama.cpp: model':>17}{'context':>10}{'compute':>10}{'total':>10}{'diff':>9}"]
    for row in rows:
        o, t = row["ours"], row["llama_cpp"]
        left = f"{mib(o['weights']):>14}{mib(o['kv']):>10}{mib(o['compute']):>10}{mib(o['total']):>10}" if o else f"{'-':>44}"
        right = (f"{mib(t['weights']):>17}{mib(t['context']):>10}{mib(t['compute']):>10}{mib(t['total']):>10}" if t else f"{'-':>47}")
        diff = f"{(o['total'] - t['total']) / t['total'] * 100:+8.1f}%" if o and t and t["total"] else ""
        label = "CPU (host)" if row["device"] == CPU else row["device"]
        lines.append(f"{label:<28}{left}   {right}{diff}")
    lines.append("(llama.cpp rounds down to whole MiB; our host weights include what mmap maps from the file)")
    click.echo("\n".join(lines))


@cli.command("probe")
@click.option("--rpc", "rpc", default=None, help="RPC servers host:port,... to list with their memory.")
@engine_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def probe_cmd(rpc: str | None, engine: str | None, llama_bin: str | None, as_json: bool) -> None:
    """This machine: CPU, RAM, the devices llama.cpp sees, GPUs and who holds their memory, and the
    llama.cpp engines found with their builds.

    \b
    Examples:
      offload-tuner probe --json
      offload-tuner probe --llama-bin ~/llama.cpp/build/bin     # devices as your binaries see them
    """
    from ..engine.select import engine_name, engines_found, open_engine
    from ..machine.probe import probe

    servers = tuple(s for s in (rpc or "").split(",") if s)
    name = engine_name(engine, llama_bin)
    with open_engine(name, llama_bin=llama_bin) as chosen:
        machine = probe(rpc_servers=servers, engine=chosen)
    found = engines_found(llama_bin)
    from ..model.repack import repack_risk

    cpu = machine.cpu_features()
    data = {**machine.to_dict(), "engines": found,
            "cpu_features": sorted(cpu.flags) if cpu is not None else None, "repack": repack_risk(cpu)}
    _emit(as_json, data, lambda: format_machine(machine, found))


def format_machine(m: Any, engines: list[dict] | None = None) -> str:
    lines = [
        f"CPU: {m.cpu_model} ({m.physical_cores} physical / {m.logical_cores} logical cores)",
        f"RAM: {m.ram_total / MiB / 1024:.1f} GiB total, {m.ram_available / MiB / 1024:.1f} GiB available",
        f"GPUs: {m.gpu_status}",
    ]
    for g in m.gpus:
        lines.append(f"  [{g.index}] {g.name} {g.uuid}: {g.memory_free / MiB:.0f} / {g.memory_total / MiB:.0f} MiB free, driver {g.driver}")
        for p in g.processes:
            used = f"{p.used_memory / MiB:.0f} MiB" if p.used_memory else "? MiB"
            lines.append(f"      held by pid {p.pid} ({p.name}): {used}")
    if m.engine:
        lines.append(f"Devices as llama.cpp sees them ({m.engine.get('engine')} engine):")
        from ..engine.devices import DeviceInfo

        listed = [DeviceInfo.from_dict(d) for d in m.devices if d.get("type") != "cpu"]
        for d in listed:
            lines.append(f"  {d.describe()}" + ("" if d.is_accelerator else " (no memory of its own: not an offload target)"))
        if not listed:
            lines.append("  none besides the CPU: every layer runs on the CPU")
    for d in m.rpc_devices:
        if d.get("error"):
            lines.append(f"  RPC {d['endpoint']}: {d['error']}")
        elif not m.engine:
            lines.append(f"  RPC {d['endpoint']}: {d.get('name', '')} {d.get('memory_free', 0) / MiB:.0f} / "
                         f"{d.get('memory_total', 0) / MiB:.0f} MiB free")
    lines.append(f"Unified memory: {'yes' if m.unified_memory else 'no'}")
    b = m.llama
    if b.error:
        lines.append(f"llama.cpp: {b.error}")
    elif b.llama_cpp_python is None and b.llama_cpp_build:
        lines.append(f"llama.cpp: your binaries, build {b.llama_cpp_build}, backends {', '.join(b.backends) or 'cpu'}, "
                     f"GPU offload {'yes' if b.gpu_offload else 'no'}, RPC {'yes' if b.rpc else 'no'}")
    else:
        lines.append(
            f"llama.cpp: llama-cpp-python {b.llama_cpp_python}, build {b.llama_cpp_build or 'not exposed'}, "
            f"backends {', '.join(b.backends) or 'cpu'}, GPU offload {'yes' if b.gpu_offload else 'no'}, RPC {'yes' if b.rpc else 'no'}"
        )
    cpu = m.cpu_features() if hasattr(m, "cpu_features") else None
    if cpu is not None:
        from ..model.repack import repack_risk

        lines.append(f"CPU features (llama.cpp): {', '.join(sorted(cpu.flags)) or 'none'}")
        lines.append(f"Weight repacking: {repack_risk(cpu)}")
    if engines:
        lines.append("Engines:")
        for e in engines:
            if e.get("error"):
                lines.append(f"  {e['name']}: not available: {e['error']}")
            else:
                where = f" at {e['path']}" if e.get("path") else ""
                extra = f", {e['detail']}" if e.get("detail") else ""
                tools = f"; tools: {', '.join(sorted(e['tools']))}" if e.get("tools") else ""
                lines.append(f"  {e['name']}: llama.cpp {e['build']}{where}{extra}{tools}")
    return "\n".join(lines)


# -- bench / parse-log ---------------------------------------------------------------------------


@cli.command("bench")
@click.argument("model", type=click.Path())
@settings_options
@click.option("--n-prompt", "-p", type=int, default=512, show_default=True, help="Prompt tokens per pp sample.")
@click.option("--n-gen", "-n", type=int, default=128, show_default=True, help="Generated tokens per tg sample.")
@click.option("--depth", "-d", type=int, default=0, show_default=True, help="Tokens already in the context.")
@click.option("--repetitions", "-r", type=int, default=3, show_default=True)
@click.option("--users", "users_text", default=None, metavar="N[,N...]",
              help="Concurrent users: N sequences decoded together, as llama-batched-bench -npl N (a list: each in turn). "
                   "Sets -np to N; -c is shared by them.")
@click.option("--timeout", "timeout_s", type=float, default=600, show_default=True, help="Kill the trial after this many seconds.")
@click.option("--memory-limit", "memory_limit_mib", type=int, default=None, help="Address-space cap for the worker, MiB.")
@click.option("--log", "log_path", type=click.Path(), default=None, help="Also write llama.cpp's full log here.")
@engine_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def bench_cmd(model: str, n_prompt: int, n_gen: int, depth: int, repetitions: int, users_text: str | None, timeout_s: float,
              memory_limit_mib: int | None, log_path: str | None, engine: str | None, llama_bin: str | None,
              as_json: bool, **opts: Any) -> None:
    """Run one trial: load MODEL in an isolated llama.cpp process, measure pp and tg.

    With --engine llama-cpp (or --llama-bin DIR) the trial is your own llama-bench, and its JSON
    samples and log are read the same way.

    \b
    Examples:
      offload-tuner bench model.gguf -ngl 20 -c 8192 -fa on -p 512 -n 128 -r 5
      offload-tuner bench model.gguf -ngl 99 --llama-bin ~/llama.cpp/build/bin
      offload-tuner bench model.gguf -c 16384 --users 1,2,4,8 -p 512 -n 128
    """
    from ..model.inspect import check_model_file
    from ..engine.base import BenchSpec
    from ..engine.select import open_engine

    check_model_file(model)  # a bad file (a truncated one too) is a clear error here, not a trial outcome
    settings = settings_from_options(model, opts)
    if settings.rpc_servers:
        from ..engine.rpc import unreachable
        from ..errors import RPCError

        for endpoint in settings.rpc_servers:
            why = unreachable(endpoint)
            if why:
                raise RPCError(why)
    if repetitions < 1:
        raise click.BadParameter("at least 1", param_hint="--repetitions")
    bench = BenchSpec(n_prompt=n_prompt, n_gen=n_gen, depth=depth, repetitions=repetitions)
    users = parse_users(users_text) if users_text else None
    if users is not None and len(users) > 1:
        _bench_users(settings, bench, users, engine=engine, llama_bin=llama_bin, timeout_s=timeout_s,
                     memory_limit=memory_limit_mib * MiB if memory_limit_mib else None, as_json=as_json)
        return
    if users is not None:
        settings = settings.replace(n_parallel=users[0])
    bench = dataclasses.replace(bench, users=settings.n_parallel)
    crash = None
    with open_engine(engine, llama_bin=llama_bin, timeout_s=timeout_s,
                     memory_limit=memory_limit_mib * MiB if memory_limit_mib else None) as runner:
        result = runner.run(settings, bench)
        if result.outcome.value == "crash":
            # a crash is a clue: the same settings with optional features off, then measured as asked
            crash = _avoid_crash(runner, settings, bench, as_json)
            if crash is not None and crash[0].found:
                first_log = result.log
                result = runner.run(crash[1], bench)
                result_log = first_log + "\n" + result.log
            else:
                result_log = result.log
        else:
            result_log = result.log
        note = (_context_note(runner, result.settings, bench)
                if runner.name == "llama-cpp" and bench.users == 1 else None)
    if log_path:
        Path(log_path).write_text(result_log, encoding="utf-8")
    data = result.to_dict()
    if crash is not None:
        data["crash_avoided"] = {**crash[0].to_dict(), "settings": crash[1].to_dict() if crash[0].found else None}
        note = crash[0].message + (f"\nnote: {note}" if note else "")
    if note is not None:
        data["context_note"] = note
    _emit(as_json, data, lambda: format_result(result) + (f"\nnote: {note}" if note else ""))
    if not result.ok:
        # the report above says what the log showed; the error is one line, exit code 2 (a crash, OOM, timeout)
        click.echo(f"Error: the trial did not run to the end: {result.outcome.value}"
                   + (f" - {result.message}" if result.message else ""), err=True)
        sys.exit(2)


def _avoid_crash(runner: Any, settings: Any, bench: Any, quiet: bool) -> Any:
    """``bench``'s crash search (``tuner.search.crashes``): (the finding, the settings that run)."""
    from ..machine.probe import probe_llama_build
    from ..model.repack import CpuFeatures
    from ..search.crashes import check_bench, investigate, without

    cpu = CpuFeatures.parse(probe_llama_build().system_info) if runner.name == "python" else None
    if not quiet:
        click.echo("llama.cpp crashed: running the same settings with optional features off", err=True)

    def said(off: tuple[str, ...], result: Any) -> None:
        if not quiet:
            click.echo(f"  crash check with {', '.join(off)} off -> {result.outcome.value}", err=True)

    finding = investigate(settings, lambda c: runner.run(c, check_bench(bench)), cpu=cpu, on_run=said)
    return finding, without(settings, finding.off)


def parse_users(text: str) -> tuple[int, ...]:
    """``4`` or ``1,2,4,8`` -> the counts of users, each from 1 to llama.cpp's most sequences."""
    from .. import limits

    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"expected a count or a comma-separated list of counts, got {text!r}", param_hint="--users") from None
    if not values or any(not 1 <= v <= limits.MAX_PARALLEL for v in values):
        raise click.BadParameter(f"expected counts from 1 to {limits.MAX_PARALLEL}, got {text!r}", param_hint="--users")
    return values


def _bench_users(settings: Any, bench: Any, users: tuple[int, ...], *, engine: str | None, llama_bin: str | None,
                 timeout_s: float, memory_limit: int | None, as_json: bool) -> None:
    """One trial per count of users, printed as llama-batched-bench's table (PP, TG, B, S_PP, S_TG,
    each user's speed and the time to the first token)."""
    from ..engine.select import open_engine
    from ..search.objective import workload_figures

    rows = []
    with open_engine(engine, llama_bin=llama_bin, timeout_s=timeout_s, memory_limit=memory_limit) as runner:
        for n in users:
            # every row as llama-batched-bench measures it, the one-user row too (its -npl 1 row)
            spec = dataclasses.replace(bench, users=n, batched=True)
            result = runner.run(settings.replace(n_parallel=n), spec)
            rows.append({"users": n, "outcome": result.outcome.value, "message": result.message,
                         "s_pp": result.pp.median if result.pp else None, "s_tg": result.tg.median if result.tg else None,
                         **workload_figures(result.pp, result.tg, spec)})
    if as_json:
        click.echo(json.dumps({"settings": settings.to_dict(), "bench": bench.to_dict(), "rows": rows}, indent=2))
    else:
        click.echo(f"{'B':>4} | {'S_PP t/s':>10} | {'S_TG t/s':>10} | {'per user':>9} | {'TTFT p50 s':>10} | {'TTFT p95 s':>10}")
        for r in rows:
            if r["outcome"] != "ok":
                click.echo(f"{r['users']:>4} | {r['outcome']}: {r['message']}")
                continue
            ttft = r.get("ttft_s") or {}
            per_user = (r.get("per_user_tg") or {}).get("median")
            cell = lambda v, f: format(v, f) if v is not None else "-"  # noqa: E731
            click.echo(f"{r['users']:>4} | {cell(r['s_pp'], '10.2f')} | {cell(r['s_tg'], '10.2f')} | {cell(per_user, '9.2f')} | "
                       f"{cell(ttft.get('p50'), '10.3f')} | {cell(ttft.get('p95'), '10.3f')}")
    if any(r["outcome"] != "ok" for r in rows):
        sys.exit(2)


def _context_note(engine: Any, settings: Any, bench: Any) -> str:
    """llama-bench sizes its context from -p/-n/-d, not -c: say so, with llama.cpp's own projection at -c."""
    used = bench.depth + bench.n_prompt + bench.n_gen
    text = f"llama-bench sizes its context from -p/-n/-d ({used} tokens here), not -c {settings.n_ctx}"
    try:
        projected = engine.fit_memory(settings)
    except TunerError:
        projected = None
    if projected:
        per_device = ", ".join(f"{d} {sum(m.values()) / MiB:.0f} MiB" for d, m in projected.items())
        text += f"; llama.cpp projects at -c {settings.n_ctx}: {per_device}"
    return text


def format_result(r: Any) -> str:
    from ..engine.logparse import format_report

    s = r.settings
    head = (f"{Path(s.model_path).name} ngl={s.n_gpu_layers} ctx={s.n_ctx} b={s.n_batch} ub={s.n_ubatch} "
            f"t={s.n_threads or 'default'} fa={s.flash_attn} kv={s.type_k}/{s.type_v}"
            + (f" ts={','.join(map(str, s.tensor_split))}" if s.tensor_split else "")
            + (f" ot={len(s.tensor_overrides)}" if s.tensor_overrides else "")
            + (f" rpc={','.join(s.rpc_servers)}" if s.rpc_servers else ""))
    lines = [head, f"outcome: {r.outcome.value}" + ("" if r.ok else f" - {r.message}")]
    for name, stats, n in (("pp", r.pp, r.bench.n_prompt), ("tg", r.tg, r.bench.n_gen)):
        if stats:
            lines.append(f"{name}{n}{'@d' + str(r.bench.depth) if r.bench.depth else ''}: {stats.median:10.2f} t/s median, "
                         f"{stats.mean:.2f} ± {stats.stddev:.2f} over {len(stats.samples)} runs")
    if r.peak_rss:
        lines.append(f"peak RSS: {r.peak_rss / MiB:.0f} MiB" + "".join(f", {d} {b / MiB:.0f} MiB" for d, b in r.peak_vram.items()))
    lines.append(format_report(r.load))
    return "\n".join(lines)


@cli.command("parse-log")
@click.argument("file", type=click.File("r", encoding="utf-8", errors="replace"))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def parse_log_cmd(file: Any, as_json: bool) -> None:
    """What a llama.cpp log says: layers offloaded, buffers per device, KV, OOM, speed.

    \b
    Examples:
      offload-tuner parse-log server.log
      llama-cli -m model.gguf -ngl 99 2>&1 | offload-tuner parse-log -
    """
    from ..engine.logparse import format_report, parse_log

    report = parse_log(file.read())
    _emit(as_json, report.to_dict(), lambda: format_report(report))


def _summary(s: dict[str, Any]) -> str:
    parts = [Path(s["model_path"]).name]
    if s.get("n_gpu_layers"):
        parts.append(f"ngl={s['n_gpu_layers']}")
    if s.get("tensor_split"):
        parts.append("ts=" + ",".join(f"{x:g}" for x in s["tensor_split"]))
    parts += [f"ctx={s['n_ctx']}", f"kv={s['type_k']}", f"fa={s['flash_attn']}", f"t={s['n_threads'] or 'default'}",
              f"ub={s['n_ubatch']}"]
    if s.get("tensor_overrides"):
        parts.append(f"ot={len(s['tensor_overrides'])}")
    if not s.get("offload_kqv", True):
        parts.append("nkvo")
    return " ".join(parts)


class _Progress:
    """Live progress on a terminal: trial n of N, the settings, the outcome, the best so far, time left."""

    def __init__(self, quiet: bool) -> None:
        from .quality import QualityProgress

        self.quiet = quiet
        self.quality = QualityProgress(quiet)

    def __call__(self, e: dict[str, Any]) -> None:
        kind = e["kind"]
        if self.quiet and kind != "waiting":  # waiting is said even then: a silent wait looks like a hang
            return
        if kind == "quality_excluded":
            click.echo(f"not tuned: {Path(e['path']).name}: {e['reason']}", err=True)
            return
        if kind == "margin":
            click.echo(e["message"], err=True)
            return
        if kind == "quality_engine":
            click.echo(e["message"], err=True)
            return
        if kind == "quality_skipped":
            click.echo(f"quality not measured: {e['reason']}", err=True)
            return
        if kind == "target_missed":
            when = " after the re-measure" if e.get("after_remeasure") else ""
            click.echo(f"no configuration reaches the target{when}: the best found is tg {e.get('best_tg') or 0:.1f} t/s, "
                       f"pp {e.get('best_pp') or 0:.1f} t/s; the profile will be the fastest", err=True)
            return
        if self.quality(e):
            return
        out = lambda text: click.echo(text, err=True)  # noqa: E731  (stdout stays for results)
        if kind == "waiting":
            out(e["message"])
        elif kind == "start":
            out(f"study {e['study']} ({'resumed: ' + str(e['done']) + ' candidates known' if e['resumed'] else 'new'}) "
                f"in {e['storage']}")
            if e.get("recovered"):
                numbers = ", ".join(f"#{n}" for n in e["recovered"])
                out(f"trial(s) {numbers} were left running by a tuner that died: marked failed, measured again")
            out(e["space"])
            budget = f"{e['trials']} trials" if e["trials"] else f"{e['time_budget']:.0f} s"
            out(f"grid of {e['grid']} candidates; budget {budget}")
        elif kind == "rejected":
            out(f"variant rejected: {e['path']}: {e['reason']}")
        elif kind == "launch":
            total = f"/{e['total']}" if e.get("total") else ""
            self.current = f"[{e['n']}{total}] {_summary(e['settings'])}"
        elif kind == "result":
            value = f"{e['value']:.1f} t/s" if e.get("value") is not None else e["message"][:120]
            best = f"best {e['best']:.1f}" if e.get("best") is not None else "no result yet"
            left = f", ~{e['time_left']:.0f} s left" if e.get("time_left") is not None else ""
            layers = e.get("layers") or (None, None)
            offload = f" layers {layers[0]}/{layers[1]}" if layers[0] is not None and layers[0] > 0 else ""
            out(f"{getattr(self, 'current', '')} -> {e['outcome']}{offload}: {value} ({best}{left})")
        elif kind == "invalid":
            out(f"      skipped an invalid combination: {e['reason']}")
        elif kind == "pruned":
            out(f"      skipped {_summary(e['settings'])}: {e['reason']}")
        elif kind == "fit_seed":
            if e.get("settings"):
                out(f"llama.cpp's fitter proposes: {e['message']} (queued as a candidate)")
            else:
                out(e["message"])
        elif kind == "remeasure":
            how = "side by side, in rotating rounds" if e.get("paired") else "in alternating rounds"
            out(f"re-measuring the {len(e['candidates'])} leading candidates {how} ({e['rounds']} rounds, "
                f"{e['repetitions']} repetitions each)")
        elif kind == "remeasure_skipped":
            out(f"not re-measured: {e['message']}")
        elif kind == "load_progress":
            out(f"      loading the model: {e['bytes'] / GIB:.1f} of {e['total'] / GIB:.1f} GiB read ({e['load']:.0%}, "
                f"{e['seconds']:.0f} s)")
        elif kind == "paired_failed":
            out(f"the side-by-side measurement failed ({e['message'][:200]}); measuring one after another instead")
        elif kind == "interrupted":
            out("interrupted: the running trial was stopped; writing the best profile so far")
        elif kind == "exhausted":
            out("every candidate the search proposes has been tried: stopping early")
        elif kind == "crash_search":
            out(f"      {e['message']}")
        elif kind == "crash_check":
            off = ", ".join(e["off"])
            out(f"      crash check with {off} off -> {e['outcome']}")
        elif kind == "crash_learned":
            out(f"{e['message']} [{e['runs']} check run(s)]")
        elif kind == "crash_avoided":
            pass  # said once, when it was learned


@cli.command("tune")
@click.argument("model", type=click.Path(), required=False)
@click.option("--demo", is_flag=True, help="Tune a built-in demo model (made here, two quantizations; no GPU or download needed).")
@click.option("--variant", "variants", multiple=True, type=click.Path(),
              help="The same model in another quantization (repeatable; a folder of GGUF files works too).")
@click.option("--trials", type=int, default=None, help="Trials to launch (default 20, or unlimited with --time-budget).")
@click.option("--time-budget", type=float, default=None, help="Stop starting trials after this many seconds.")
@click.option("--objective", type=click.Choice(["tg", "pp", "mixed", "aggregate", "per-user", "ttft"]), default="tg",
              show_default=True,
              help="tg: generation speed; pp: prompt speed; mixed: one request of --n-prompt + --n-gen tokens; "
                   "aggregate: the --users' generation speed together, each at or above --min-user-tg; "
                   "per-user: each user's own generation speed; ttft: the time to the first token of --n-prompt "
                   "tokens at --depth (p95 over the repetitions).")
@click.option("--users", "users_text", default="1", show_default=True, metavar="N[,N...]",
              help="Concurrent users the profile serves: N sequences decoded together (llama-server's -np N). "
                   "A list tunes for each in turn (one profile each) and compares them.")
@click.option("--min-user-tg", type=float, default=None,
              help="With --objective aggregate: the generation speed (t/s) every user must keep.")
@click.option("--min-ctx", type=int, default=4096, show_default=True, help="The context you need: never tuned below.")
@click.option("--depth", type=int, default=0, show_default=True, help="Measure at this many tokens already in context.")
@click.option("--n-prompt", type=int, default=512, show_default=True, help="Prompt tokens per pp sample.")
@click.option("--n-gen", type=int, default=128, show_default=True, help="Generated tokens per tg sample.")
@click.option("--repetitions", "-r", type=int, default=3, show_default=True, help="Samples per trial.")
@click.option("--vram-margin", type=int, default=None,
              help="MiB kept free on each device beyond the memory arithmetic. Default: 512 until a trial measures "
                   "(NVML) what llama.cpp used there beyond the arithmetic; then that, its spread and 32 MiB.")
@click.option("--rpc", "rpc", default=None, help="RPC servers host:port,... used as devices.")
@click.option("--storage", default=None, help="Optuna storage URL (default: SQLite in the data folder; PostgreSQL for a team).")
@click.option("--study", "study_name", default=None, help="Study name (default: from machine and model fingerprints).")
@click.option("--out", type=click.Path(), default=None,
              help="Write the profile to this file, or into this folder (default: the data folder's profiles).")
@click.option("--trial-timeout", type=float, default=300, show_default=True, help="Kill a trial after this many seconds.")
@click.option("--no-wait", is_flag=True,
              help="If another tuner is measuring on this machine, stop (exit 2) instead of waiting for it.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--max-kl", type=float, default=None,
              help="Quality budget: variants whose mean KL divergence from the reference is above this are not tuned.")
@click.option("--max-ppl-increase", type=float, default=None,
              help="Quality budget: variants whose perplexity is more than this many percent above the reference's are not tuned.")
@click.option("--min-tg", type=float, default=None,
              help="Target mode: among configurations reaching this generation speed (t/s), the highest-quality variant wins.")
@click.option("--min-pp", type=float, default=None, help="Target mode, for prompt speed (t/s); with or without --min-tg.")
@click.option("--reference", type=click.Path(), default=None,
              help="Measure quality against this file (default: the variant with the most bits per weight).")
@click.option("--corpus", type=click.Path(), default=None, help="UTF-8 text for quality, as in `quality` (default: the packaged one).")
@click.option("--chunks", type=int, default=20, show_default=True, help="Chunks scored for quality, as in `quality`.")
@click.option("--ctx", "quality_ctx", type=int, default=512, show_default=True, help="Tokens per quality chunk, as in `quality`.")
@click.option("--quantize", "quantize_types", default=None,
              help="Make these variants of MODEL first (llama.cpp's quantizer, cached), e.g. Q4_K_M,Q5_K_M,Q6_K,Q8_0.")
@click.option("--imatrix", type=click.Path(), default=None, help="Importance matrix for --quantize.")
@click.option("--allow-requantize", is_flag=True, help="Let --quantize start from an already-quantized MODEL.")
@click.option("--no-quality", is_flag=True, help="Skip measuring the variants' quality (speed only) when no budget or target needs it.")
@engine_options
@click.option("--quiet", "-q", is_flag=True, help="No progress; print only the profile path (and the report's, with --report).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (no progress).")
@click.option("--report", "report_path", is_flag=False, flag_value="", default=None, metavar="[FILE.html]",
              help="At the end, write the HTML report (to FILE.html, or the data folder's reports/) and print its path.")
def tune_cmd(model: str | None, demo: bool, variants: tuple[str, ...], trials: int | None, time_budget: float | None,
             objective: str, users_text: str, min_user_tg: float | None, min_ctx: int, depth: int, n_prompt: int, n_gen: int,
             repetitions: int, vram_margin: int | None,
             rpc: str | None, storage: str | None, study_name: str | None, out: str | None, trial_timeout: float,
             no_wait: bool, seed: int, max_kl: float | None, max_ppl_increase: float | None, min_tg: float | None,
             min_pp: float | None, reference: str | None, corpus: str | None, chunks: int, quality_ctx: int,
             quantize_types: str | None,
             imatrix: str | None, allow_requantize: bool, no_quality: bool, engine: str | None,
             llama_bin: str | None, quiet: bool, as_json: bool,
             report_path: str | None) -> None:
    """Find the fastest settings for MODEL on this machine and save them as a profile.

    Running the same command again resumes the study; Ctrl-C stops the running trial and still
    writes the best profile so far. With variants, each one's quality is measured first (cached)
    and the tune ends with the trade: each variant's best speed and its quality. One tuner measures
    on a machine at a time: a second one waits for the first (or, with --no-wait, stops).

    \b
    Examples:
      offload-tuner tune --demo
      offload-tuner tune model-Q4_K_M.gguf --variant model-Q5_K_M.gguf --min-ctx 8192 --trials 30
      offload-tuner tune model.gguf --variant ./quants/ --objective mixed --time-budget 1800
      offload-tuner tune model.gguf --trials 30 --report tune.html
      offload-tuner tune model-F16.gguf --quantize Q4_K_M,Q6_K,Q8_0 --max-kl 0.05
      offload-tuner tune model-F16.gguf --quantize Q4_K_M,Q6_K,Q8_0 --min-tg 30
      offload-tuner tune model.gguf --storage postgresql://tuner@db.example/tuning --no-wait
      offload-tuner tune model.gguf --engine llama-cpp --llama-bin ~/llama.cpp/build/bin
    """
    from ..engine.select import open_engine
    from ..search.study import tune

    if report_path and report_path.lower().endswith(".gguf"):
        raise click.UsageError(f"--report takes the report's file name, not a model ({report_path}): "
                               "put --report after MODEL, or give it a .html name")
    if demo:
        if model:
            raise click.UsageError("give MODEL or --demo, not both")
        from ..model.make import demo_models

        if not (quiet or as_json):
            click.echo("making the demo model (random weights, real llama.cpp quantizations)...", err=True)
        made = demo_models()
        model, variants = str(made[0]), tuple(str(p) for p in made[1:]) + variants
        trials = trials or 12
        if min_ctx == 4096:
            min_ctx = 1024
        n_prompt, n_gen = min(n_prompt, 256), min(n_gen, 64)
        # a quick look at the quality trade: a few chunks (the numbers of a random-weight model
        # only show that quantization costs, not how much a trained model loses)
        chunks, quality_ctx = min(chunks, 4), min(quality_ctx, 256)
    if not model:
        raise click.UsageError("give a MODEL (a .gguf file), or --demo")
    from ..model.gguf import check_path

    for path in (model, *variants):
        check_path(path)  # a URL: tune runs the model, so it must be on disk
    if vram_margin is not None and vram_margin < 0:
        raise SettingsError("--vram-margin", f"expected MiB >= 0, got {vram_margin}")
    users = parse_users(users_text)
    if len(users) > 1:
        if out and Path(out).suffix.lower() == ".json":
            raise click.UsageError("--users with a list writes one profile per count: give --out a folder, not a file")
        if study_name:
            raise click.UsageError("--users with a list runs one study per count: leave --study out")
    results = []
    for n in users:
        result = _tune_one(model, users=n, variants=variants, trials=trials, time_budget=time_budget, objective=objective,
                           min_user_tg=min_user_tg, min_ctx=min_ctx, depth=depth, n_prompt=n_prompt, n_gen=n_gen,
                           repetitions=repetitions, vram_margin=vram_margin, storage=storage, study_name=study_name, out=out,
                           rpc=rpc, trial_timeout=trial_timeout, seed=seed, quiet=quiet or as_json, max_kl=max_kl,
                           max_ppl_increase=max_ppl_increase, min_tg=min_tg, min_pp=min_pp, reference=reference,
                           corpus=corpus, chunks=chunks, quality_ctx=quality_ctx, quantize_types=quantize_types,
                           imatrix=imatrix, allow_requantize=allow_requantize, no_quality=no_quality, no_wait=no_wait,
                           engine=engine, llama_bin=llama_bin)
        results.append((n, result))
        if len(users) > 1 and not (quiet or as_json):
            click.echo(f"users {n}: {_workload_line(result)}", err=True)
    if len(users) > 1 and not (quiet or as_json):
        click.echo("compared:", err=True)
        for n, r in results:
            click.echo(f"  {n} user(s): {_workload_line(r)} -> {r.profile_path}", err=True)
    result = results[-1][1]
    report = _tune_report(result, report_path, storage) if report_path is not None else None
    if as_json or quiet:
        if as_json:
            data = result.to_dict()
            if report is not None:
                data["report"] = str(report)
            click.echo(json.dumps(data, indent=2, default=str))
        elif result.profile_path:
            click.echo(str(result.profile_path))
        if quiet and not as_json and report is not None:
            click.echo(str(report))
        _tune_exit(result)
        return
    best = result.best
    tg, pp = best.get("tg") or {}, best.get("pp") or {}
    click.echo(f"best: {_summary(best['settings'])}")
    if result.profile is not None:
        from ..report.summary import profile_summary

        click.echo(f"  {profile_summary(result.profile)}")
    if tg:
        click.echo(f"  tg {tg['median']:.1f} t/s (95% CI {tg['ci_low']:.1f}-{tg['ci_high']:.1f}, {len(tg['samples'])} samples)")
    if pp:
        click.echo(f"  pp {pp['median']:.1f} t/s (95% CI {pp['ci_low']:.1f}-{pp['ci_high']:.1f})")
    if result.runner_up:
        click.echo(f"  runner-up within noise: {_summary(result.runner_up['settings'])}")
    c = result.counts
    click.echo(f"trials: {c['run']} run, {c['pruned']} not launched (invalid, predicted not to fit, or past a learned "
               f"out-of-memory boundary), {c['oom']} out of memory, {c['failed']} failed")
    if result.time:
        from ..search.timing import describe as describe_time

        click.echo(describe_time(result.time))
    if result.profile_path:
        click.echo(f"profile: {result.profile_path}")
    if report is not None:
        click.echo(f"report: {report}")
    if result.profile is not None and result.profile.engine is not None:
        click.echo(f"measured with: {result.profile.engine.name} engine, llama.cpp {result.profile.engine.build}"
                   + (f" ({result.profile.engine.path})" if result.profile.engine.name == "llama-cpp" else ""))
    from ..engine.settings import Settings

    click.echo(f"llama-server flags: {Settings.from_dict(best['settings']).command_line('llama-server')}")
    if result.target is not None:
        click.echo(format_target(result.target, result.best))
    if result.trade:
        click.echo(format_trade(result.trade, result.quality))
    check = result.flags_check
    if check is not None:
        if check["accepted"]:
            click.echo(f"  (accepted by your binaries' own parser: {Path(check['parser']).name})")
        else:
            click.echo(f"warning: your binaries' parser ({check['parser']}) rejects these flags: {check['error']}", err=True)
    if result.interrupted:
        click.echo("interrupted: run the same command again to resume the study", err=True)
    _tune_exit(result)


def _tune_exit(result: Any) -> None:
    """A profile that could not be written is an error (exit 2, after the results were printed);
    Ctrl-C is 130, as a shell reports it."""
    if result.profile_error:
        click.echo(f"Error: {result.profile_error}", err=True)
        sys.exit(2)
    if result.interrupted:
        sys.exit(130)


def _tune_report(result: Any, report_path: str, storage: str | None) -> Path:
    """The HTML report of the study just tuned (``tune --report``)."""
    from ..paths import data_dir, study_storage_url
    from ..report.html import write_report

    path = Path(report_path) if report_path else data_dir() / "reports" / f"{result.study_name}.html"
    # from the profile: it names the study, and its winner is the re-measured one
    source = str(result.profile_path) if result.profile_path else result.study_name
    written = write_report(source, out=path, storage=storage or study_storage_url())
    return written.path


def format_target(target: dict[str, Any], best: dict[str, Any]) -> str:
    asked = " and ".join(f"{name} {target[key]:g} t/s" for key, name in (("min_tg", "--min-tg"), ("min_pp", "--min-pp"))
                         if target.get(key) is not None)
    if target["met"]:
        return f"target {asked}: reached; the highest-quality variant that reaches it won ({Path(best['settings']['model_path']).name})"
    found = ", ".join(f"{k[5:]} {target[k]:.1f} t/s" for k in ("best_tg", "best_pp") if target.get(k) is not None)
    return f"target {asked}: NOT reached by any configuration tried; the best speed found: {found}. The profile is the fastest."


def format_trade(rows: list[dict[str, Any]], report: Any) -> str:
    """The trade: each variant's best speed found and its quality, best quality first."""
    ref = Path(report.reference).name if report is not None else "?"
    lines = [f"the trade (quality against {ref}; speed: the best this tune found):",
             f"  {'variant':<30} {'bpw':>5} {'KL mean':>9} {'PPL ratio':>9} {'top-1':>7} {'tg t/s':>8} {'pp t/s':>8}"]
    for r in rows:
        q, b = r["quality"] or {}, r["best"] or {}
        speed = (f"{b['tg']:8.1f} " if b.get("tg") is not None else f"{'-':>8} ") + (f"{b['pp']:8.1f}" if b.get("pp") is not None else f"{'-':>8}")
        quality = (f"{q['bits_per_weight']:5.2f} {q['kl_mean']:9.5f} {q['ppl_ratio']:9.4f} {q['top1_agreement'] * 100:6.1f}%"
                   if q else f"{'':5} {'':9} {'':9} {'':7}")
        line = f"  {r['variant'][:30]:<30} {quality} {speed}"
        if r.get("excluded"):
            line = f"  {r['variant'][:30]:<30} {quality}   not tuned: {r['excluded']}"
        lines.append(line)
    return "\n".join(lines)


def _tune_one(model: str, *, users: int, variants: tuple[str, ...], trials: int | None, time_budget: float | None,
              objective: str, min_user_tg: float | None, min_ctx: int, depth: int, n_prompt: int, n_gen: int,
              repetitions: int, vram_margin: int | None, storage: str | None, study_name: str | None, out: str | None,
              rpc: str | None, trial_timeout: float, seed: int, quiet: bool, max_kl: float | None,
              max_ppl_increase: float | None, min_tg: float | None, min_pp: float | None, reference: str | None,
              corpus: str | None, chunks: int, quality_ctx: int, quantize_types: str | None, imatrix: str | None,
              allow_requantize: bool, no_quality: bool, no_wait: bool, engine: str | None, llama_bin: str | None) -> Any:
    """One tune for one count of users (the API's names turned back into the options' on a bad value)."""
    from ..engine.select import open_engine
    from ..search.study import tune

    try:
        with open_engine(engine, llama_bin=llama_bin, timeout_s=trial_timeout) as runner:
            result = tune(model, variants=variants, trials=trials, time_budget=time_budget, objective=objective, users=users, min_user_tg=min_user_tg,
                          min_ctx=min_ctx, depth=depth, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions,
                          vram_margin=None if vram_margin is None else vram_margin * MiB, storage=storage, study_name=study_name, out=out,
                          rpc_servers=tuple(x for x in (rpc or "").split(",") if x), trial_timeout=trial_timeout, seed=seed,
                          on_event=_Progress(quiet), max_kl=max_kl, max_ppl_increase=max_ppl_increase,
                          min_tg=min_tg, min_pp=min_pp, reference=reference, corpus=corpus, chunks=chunks,
                          quality_ctx=quality_ctx, quantize=quantize_types or (), imatrix=imatrix,
                          allow_requantize=allow_requantize, measure_quality=not no_quality, wait=not no_wait,
                          engine=runner)
    except SettingsError as exc:
        # the API names its arguments (time_budget); the command line names its options
        option = {"time_budget": "--time-budget", "trial_timeout": "--trial-timeout", "min_ctx": "--min-ctx",
                  "depth": "--depth", "n_prompt": "--n-prompt", "n_gen": "--n-gen", "repetitions": "--repetitions",
                  "trials": "--trials", "objective": "--objective", "max_kl": "--max-kl",
                  "max_ppl_increase": "--max-ppl-increase", "min_tg": "--min-tg", "min_pp": "--min-pp",
                  "users": "--users", "min_user_tg": "--min-user-tg"}.get(exc.field)
        if option is None:
            raise
        raise SettingsError(option, str(exc)[len(exc.field) + 2:]) from None
    return result


def _workload_line(result: Any) -> str:
    """Aggregate and per-user generation speed and the time to the first token of a tune's winner."""
    w = result.profile.workload if result.profile is not None else None
    if w is None:
        return "no profile"
    from ..report.summary import workload_in_words

    parts = workload_in_words(w)
    return ", ".join(parts) or "no figures"


@cli.command("rpc-serve")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. The RPC protocol has no authentication: keep it on loopback or a trusted network.")
@click.option("--port", type=int, default=50052, show_default=True)
@click.option("--memory-limit", "memory_limit_mib", type=int, default=None,
              help="Cap the server's memory (MiB of address space beyond its own code): a small simulated GPU.")
@click.option("--threads", type=int, default=None, help="CPU threads for the server's compute (default: all).")
def rpc_serve_cmd(host: str, port: int, memory_limit_mib: int | None, threads: int | None) -> None:
    """Serve this machine's CPU as a llama.cpp RPC device (a simulated GPU), until Ctrl-C.

    \b
    Example (offload without a GPU):
      offload-tuner rpc-serve --port 50052 --memory-limit 200 &
      offload-tuner bench model.gguf --rpc 127.0.0.1:50052 -ngl 99
    """
    from .. import limits
    from ..engine.rpc import serve

    if not limits.MIN_PORT <= port <= limits.MAX_PORT:
        raise SettingsError("--port", f"expected a port from {limits.MIN_PORT} to {limits.MAX_PORT}, got {port}")
    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"warning: serving on {host}: anyone who can reach this port can use (and write into) this "
                   "server's memory; llama.cpp's RPC server is meant for trusted networks only", err=True)
    try:
        serve(host, port, memory_limit_mib * MiB if memory_limit_mib else None, threads)
    except KeyboardInterrupt:
        pass


def _mount_subcommands() -> None:
    """Subcommands that live in their own modules."""
    from .diagnose import register as register_diagnose
    from .doctor import register as register_doctor
    from .mcp_server import register as register_mcp
    from .profile import profile_group
    from .quality import quality_cmd
    from .report import report_cmd

    cli.add_command(profile_group)
    cli.add_command(quality_cmd)
    register_diagnose(cli)
    register_doctor(cli)
    register_mcp(cli)
    cli.add_command(report_cmd)


_mount_subcommands()


def main() -> None:
    cli(obj={})
