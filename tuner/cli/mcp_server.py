"""``offload-tuner mcp``: the tuner as a Model Context Protocol server (stdio), for agents.

Five tools, each the answer a command gives, validated as the command line validates it:

- ``estimate``: will a model (a path or a URL: only its header is fetched) fit on a machine (another
  machine's ``probe --json`` file, ``NAME=SIZE`` devices, or this one), and what fits: ``estimate --json``;
- ``best_settings``: the profile for a model on this machine, checked to fit now, with its command
  lines for llama-server, llama-cli, Ollama (a Modelfile) and llama-cpp-python;
- ``diagnose``: what a llama.cpp log's text says went wrong and what would fix it: ``diagnose --json``;
- ``doctor``: each check of this set-up with its fix: ``doctor --json``;
- ``tune``: a bounded number of trials (at most ``MAX_TRIALS``), one progress notification per trial.

Local paths are refused unless they lie inside a folder the user allowed (``--allow DIR``,
repeatable), after following links: an agent cannot make the tuner read, run or list anything else.

The official ``mcp`` SDK (``pip install 'offload-tuner[mcp]'``, 2.x: ``MCPServer``) is imported only
here. Its stdio transport serves the protocol from a private copy of standard output and diverts
file descriptor 1, so nothing llama.cpp or a child process prints can corrupt it; the commands' own
output is captured in memory.
"""

# No `from __future__ import annotations`: the SDK reads the tools' annotations at registration, and
# Context is imported inside build_server (mcp is an optional extra).

import contextlib
import io
import json
import os
import threading
from pathlib import Path
from typing import Any, Literal, Sequence

import click

MAX_TRIALS = 50  # an agent's tune is bounded: a longer one belongs on the command line
MAX_LOG_BYTES = 16 << 20  # a pasted log; diagnose on the command line takes a file of any size
URL_SCHEMES = ("https://", "http://", "hf://")

_cli_lock = threading.Lock()  # the commands print to sys.stdout: one at a time


class PathNotAllowed(Exception):
    pass


class Allowed:
    """The folders the user allowed; ``check`` resolves a path (links followed) and refuses one outside."""

    def __init__(self, folders: Sequence[str | os.PathLike[str]]) -> None:
        self.folders = [Path(f).expanduser().resolve() for f in folders]

    def check(self, path: str, what: str) -> str:
        if not isinstance(path, str) or not path or "\x00" in path:
            raise PathNotAllowed(f"{what}: expected a file path")
        resolved = Path(path).expanduser().resolve()
        for folder in self.folders:
            if resolved == folder or folder in resolved.parents:
                return str(resolved)
        where = ", ".join(str(f) for f in self.folders) or "none: the server was started without --allow"
        raise PathNotAllowed(f"{what} {path}: outside the folders this server may read (allowed: {where}); "
                             "start it with --allow DIR for that folder")

    def model(self, model: str, what: str = "model") -> str:
        """A model reference: a URL as it is (only its header is read), a path only inside the allowed folders."""
        if isinstance(model, str) and model.lower().startswith(URL_SCHEMES):
            return model
        return self.check(model, what)


_commands: list[click.Group] = []  # the offload-tuner group that started the server (no import of .main: a circle)


def run_command(args: list[str], stdin: bytes | None = None) -> Any:
    """Run one ``offload-tuner`` command in this process, as the command line would (same parsing,
    same validation, same one-line errors), and return its ``--json`` output. Raises ``CommandFailed``
    with the command's error line."""
    from ..profile.dburl import scrub

    cli = _commands[0]
    out, err = io.StringIO(), io.StringIO()
    stream = io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8")
    with _cli_lock, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), _stdin(stream):
        try:
            code = cli.main(args=args, prog_name="offload-tuner", standalone_mode=False, obj={})
        except click.ClickException as exc:
            raise CommandFailed(scrub(exc.format_message())) from None
        except click.exceptions.Abort:
            raise CommandFailed("aborted") from None
        except SystemExit as exc:
            code = exc.code
    text = out.getvalue()
    if code not in (None, 0):
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        message = next((line[len("Error: "):] for line in reversed(lines) if line.startswith("Error: ")),
                       lines[-1] if lines else f"exit code {code}")
        raise CommandFailed(scrub(message))
    try:
        return json.loads(text)
    except ValueError:
        return {"output": text}


class CommandFailed(Exception):
    pass


@contextlib.contextmanager
def _stdin(stream: io.TextIOWrapper):
    import sys

    saved = sys.stdin
    sys.stdin = stream
    try:
        yield
    finally:
        sys.stdin = saved


def settings_for(model_path: str) -> dict[str, Any]:
    """The profile for ``model_path`` on this machine (checked to fit now) and its command lines."""
    import warnings

    from ..profile.apps import load_profile
    from ..profile.exports import export_args

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = load_profile(model_path)
    kwargs = profile.llama_kwargs(model_path)
    python = (f"import tuner\n"
              f"llm = tuner.Llama({model_path!r})  # loads this profile: every setting, tensor overrides included\n"
              f"# or, with llama_cpp.Llama itself:\n"
              f"# llama_cpp.Llama(**{json.dumps(kwargs)})")
    return {
        "profile": profile.name,
        "model": profile.model.file_name,
        "machine": profile.machine.describe(),
        "created_at": profile.created_at,
        "measured": {"tg": profile.measured.tg.median, "pp": profile.measured.pp.median,
                     "n_prompt": profile.measured.n_prompt, "n_gen": profile.measured.n_gen},
        "settings": profile.settings.to_dict(),
        "adjusted_to_fit_now": list(profile.degradation),
        "warnings": [str(w.message) for w in caught],
        "commands": {
            "llama-server": export_args(profile, "llama-server", model_path=model_path).strip(),
            "llama-cli": export_args(profile, "llama-cli", model_path=model_path).strip(),
            "ollama": export_args(profile, "ollama", model_path=model_path),
            "llama-cpp-python": python,
        },
        "llama_kwargs": kwargs,
    }


def build_server(allowed: Allowed, commands: click.Group) -> Any:
    """The MCP server with its five tools (``mcp`` 2.x ``MCPServer``); ``commands`` is the
    ``offload-tuner`` group whose commands the tools run."""
    import anyio
    import anyio.from_thread
    import anyio.to_thread
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    from .. import __version__
    from ..errors import TunerError
    from ..profile.dburl import scrub

    _commands[:] = [commands]
    server = MCPServer(
        "offload-tuner", version=__version__,
        instructions=("Sizes and tunes GGUF models for llama.cpp on this machine. estimate: will a model fit "
                      "(before the download, a URL works); best_settings: the measured best way to run a model "
                      "here, as command lines; diagnose: what a llama.cpp log says went wrong; doctor: why the "
                      "GPU is not used; tune: measure (bounded trials). Local paths must be inside the folders "
                      "the user allowed."),
    )

    def refuse(exc: BaseException) -> ToolError:
        return ToolError(scrub(str(exc)))

    @server.tool()
    def estimate(model: str, machine: str | None = None, devices: list[str] | None = None, ram: str | None = None,
                 ctx: int | None = None, n_gpu_layers: int | None = None, kv_type: str | None = None,
                 table: bool = False) -> dict[str, Any]:
        """Memory a GGUF model needs per device, and what fits on a machine, before loading or downloading it.

        model: a .gguf path inside the allowed folders, or a URL (https://... or hf://OWNER/REPO/FILE.gguf:
        only its header is fetched). The machine: machine (a path to another machine's `offload-tuner probe
        --json` output), or devices (["CUDA0=24GiB", ...]) with ram ("64GiB"), or neither for this machine.
        ctx: context tokens; n_gpu_layers: a placement to check (-1: all), else the most layers that fit;
        kv_type: f16, q8_0, q4_0...; table: one row per standard quantization of this model."""
        try:
            args = ["estimate", allowed.model(model), "--json"]
            if machine is not None:
                args += ["--machine", allowed.check(machine, "machine")]
            for spec in devices or ():
                args += ["--device", spec]
            if ram is not None:
                args += ["--ram", ram]
            if machine is None and not devices:
                args += ["--machine", _this_machine_file()]
            if ctx is not None:
                args += ["--ctx", str(ctx)]
            if n_gpu_layers is not None:
                args += ["--n-gpu-layers", str(n_gpu_layers)]
            if kv_type is not None:
                args += ["--kv-type", kv_type]
            if table:
                args.append("--table")
            return run_command(args)
        except (PathNotAllowed, CommandFailed, TunerError) as exc:
            raise refuse(exc) from None

    @server.tool()
    def best_settings(model: str) -> dict[str, Any]:
        """The fastest settings measured for this model on this machine (its profile, checked to fit in
        the memory free now), with ready command lines for llama-server, llama-cli, Ollama (a Modelfile)
        and llama-cpp-python. model: the .gguf path, inside the allowed folders. No profile yet: run tune."""
        try:
            return settings_for(allowed.check(model, "model"))
        except (PathNotAllowed, TunerError) as exc:
            raise refuse(exc) from None

    @server.tool()
    def diagnose(log: str, model: str | None = None, devices: list[str] | None = None) -> dict[str, Any]:
        """What a llama.cpp / llama-server / Ollama load log says happened (layers offloaded, out of memory,
        CPU fallback), where the memory went, and the levers that would fix it, ranked. log: the log's text.
        model: the .gguf it loaded (allowed folders), for exact sizes; devices: ["CUDA0=12GiB", ...]."""
        data = log.encode("utf-8", errors="surrogateescape") if isinstance(log, str) else b""
        if len(data) > MAX_LOG_BYTES:
            raise ToolError(f"log: larger than {MAX_LOG_BYTES >> 20} MiB; give the part from the model load on")
        try:
            args = ["diagnose", "-", "--json"]
            if model is not None:
                args += ["--model", allowed.check(model, "model")]
            for spec in devices or ():
                args += ["--device", spec]
            return run_command(args, stdin=data)
        except (PathNotAllowed, CommandFailed, TunerError) as exc:
            raise refuse(exc) from None

    @server.tool()
    def doctor(llama_bin: str | None = None, repack_probe: bool = True) -> dict[str, Any]:
        """Checks of this set-up, each ok / warning / problem with what it found and the exact fix: a
        CPU-only llama.cpp build on a GPU machine, CUDA driver vs runtime, the AMX repack crash, GPU memory
        held by other processes, disk, databases, the user's llama.cpp binaries (llama_bin: their folder,
        inside the allowed folders), stale profiles. repack_probe: false skips the few-second decode probe."""
        from ..report.doctor import run_checks

        try:
            folder = allowed.check(llama_bin, "llama_bin") if llama_bin is not None else None
            checks = run_checks(llama_bin=folder, probe=repack_probe)
        except (PathNotAllowed, TunerError) as exc:
            raise refuse(exc) from None
        return {"checks": [c.to_dict() for c in checks]}

    @server.tool()
    async def tune(model: str, ctx: Context, trials: int = 10, min_ctx: int = 4096,
                   objective: Literal["tg", "pp", "mixed"] = "tg", variants: list[str] | None = None,
                   n_prompt: int = 512, n_gen: int = 128, repetitions: int = 3,
                   trial_timeout: float = 300.0) -> dict[str, Any]:
        """Measure the fastest llama.cpp settings for a model on this machine and save them as its profile
        (then best_settings answers). model and variants (the same model in other quantizations): .gguf
        paths inside the allowed folders. trials: 1 to 50; one progress notification per trial. min_ctx:
        the context the user needs; objective: tg (generation speed), pp (prompt) or mixed; n_prompt, n_gen,
        repetitions: the benchmark's shape per trial, as tune's options of the same names."""
        try:
            path = allowed.check(model, "model")
            others = tuple(allowed.check(v, f"variants[{i}]") for i, v in enumerate(variants or ()))
        except PathNotAllowed as exc:
            raise refuse(exc) from None
        if not isinstance(trials, int) or not 1 <= trials <= MAX_TRIALS:
            raise ToolError(f"trials: expected 1 to {MAX_TRIALS} (a longer tune: offload-tuner tune on the command line), got {trials}")
        done = [0]

        def on_event(event: dict[str, Any]) -> None:
            if event.get("kind") != "result":
                return
            done[0] += 1
            value = f"{event['value']:.1f} t/s" if event.get("value") is not None else str(event.get("message", ""))[:120]
            anyio.from_thread.run(ctx.report_progress, min(done[0], trials), trials,
                                  f"trial {done[0]}: {event.get('outcome')}: {value}")

        def work() -> dict[str, Any]:
            from ..engine.select import open_engine
            from ..engine.settings import Settings
            from ..model.gguf import check_path
            from ..search.study import tune as run_tune

            for p in (path, *others):
                check_path(p)
            with open_engine("python", timeout_s=trial_timeout) as engine:
                result = run_tune(path, variants=others, trials=trials, min_ctx=min_ctx, objective=objective,
                                  n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions, trial_timeout=trial_timeout, on_event=on_event, wait=False, engine=engine)
            best = result.best or {}
            return {
                "profile_path": str(result.profile_path) if result.profile_path else None,
                "profile_error": result.profile_error,
                "best_settings": best.get("settings"),
                "tg": (best.get("tg") or {}).get("median"),
                "pp": (best.get("pp") or {}).get("median"),
                "trials": result.counts,
                "llama_server_flags": Settings.from_dict(best["settings"]).command_line("llama-server")
                if best.get("settings") else None,
            }

        try:
            return await anyio.to_thread.run_sync(work)
        except TunerError as exc:
            raise refuse(exc) from None

    return server


_machine_file: list[str] = []


def _this_machine_file() -> str:
    """This machine as ``probe --json`` describes it (llama.cpp's devices), written once per server."""
    if not _machine_file:
        import tempfile

        data = run_command(["probe", "--json"])
        fd, path = tempfile.mkstemp(prefix="offload-tuner-mcp-machine-", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
        _machine_file.append(path)
        import atexit

        atexit.register(lambda: os.path.exists(path) and os.unlink(path))
    return _machine_file[0]


@click.command("mcp")
@click.option("--allow", "allow", multiple=True, type=click.Path(), metavar="DIR",
              help="A folder whose models, logs and binaries the agent may name (repeatable); paths elsewhere are refused.")
@click.pass_context
def mcp_cmd(ctx: click.Context, allow: tuple[str, ...]) -> None:
    """Serve the tuner to AI agents over the Model Context Protocol (stdio): the tools estimate,
    best_settings, diagnose, doctor and tune (bounded trials, with progress). Needs the mcp package:
    pip install 'offload-tuner[mcp]'. A path outside the --allow folders is refused.

    \b
    Example (the command an MCP client starts):
      offload-tuner mcp --allow ~/models
    """
    for folder in allow:
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise click.BadParameter(f"{folder}: not a folder", param_hint="--allow")
    try:
        import mcp.server.mcpserver  # noqa: F401
    except ImportError:
        raise click.ClickException("the MCP server needs the mcp package (2.x): pip install 'offload-tuner[mcp]'") from None
    root = ctx.find_root().command
    assert isinstance(root, click.Group)
    build_server(Allowed(allow), root).run("stdio")


def register(cli: Any) -> None:
    cli.add_command(mcp_cmd)
