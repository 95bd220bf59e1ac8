"""A profile's settings in other tools' words: command lines, an ollama Modelfile, environment variables.

``export_args(profile, fmt)`` is what ``offload-tuner profile args PROFILE --for FMT`` prints:

- ``llama-server``, ``llama-cli``, ``llama-bench``: one shell-quoted command line from
  ``Settings.cli_args(tool)``; ``llama-bench`` also gets the benchmark's shape (``-p``, ``-n``, ``-d``).
- ``ollama``: a Modelfile with ``FROM`` and the ``PARAMETER`` lines that ollama's runner options take
  (``num_gpu``, ``num_ctx``, ``num_batch``, ``num_thread``, ``main_gpu``, ``use_mmap``: the ``Runner``
  struct of ollama's ``api/types.go``, 2026), and a comment naming the settings a Modelfile cannot say.
- ``env``: ``export LLAMA_ARG_...=...`` lines llama-server reads at start (names from the ``set_env``
  calls in llama.cpp's ``common/arg.cpp``, as vendored by llama-cpp-python 0.3.36), and a comment
  naming the flags that have no variable.
- ``llama-swap``: a ``models:`` entry of llama-swap's config.yaml (``cmd``: llama-server with the
  profile's flags and ``--port ${PORT}``, the macro llama-swap fills; keys of its ``ModelConfig``,
  ``config/config.go``, 2025). Every setting is a llama-server flag, so nothing is lost.
- ``lmstudio``: LM Studio's per-model load config (``{"preset": "", "operation": {"fields": []},
  "load": {"fields": [{"key", "value"}]}}``, the ``llm.load.*`` keys of lmstudio-js's
  ``lms-kv-config`` schema), for ``~/.lmstudio/.internal/user-concrete-model-default-config/
  PUBLISHER/REPO/FILE.gguf.json``.
- ``kcpps``: koboldcpp's ``.kcpps`` settings file (a JSON object of its argparse ``dest`` names,
  loaded with ``koboldcpp --config FILE.kcpps``).

What LM Studio and koboldcpp cannot say (a tensor override in LM Studio, ``n_ubatch`` in either...)
is listed by ``export_notes``; ``profile args`` prints those notes on stderr, so the file stays valid.

Every spelling comes from the dimension table (``tuner.engine.dimensions``): a setting added there
is exported here without a change to this module. ``n_gpu_layers = -1`` (all layers) is written as
the profile's ``layers_total`` (``dimensions.gpu_layers_arg``): since 2026 llama.cpp's common
arguments read ``-ngl -1`` as "auto" (fit to free memory), not "all".
"""

from __future__ import annotations

import json
import os

from ..errors import ProfileError
from .document import Profile
from .quoting import UnsafeValueError, safe, shell_line
from ..engine.dimensions import CLI_TOOLS, DIMENSIONS, OLLAMA_KV_TYPES, Export

from typing import Any

FORMATS = (*CLI_TOOLS, "ollama", "env", "llama-swap", "lmstudio", "kcpps")
JSON_FORMATS = ("lmstudio", "kcpps")


def export_args(profile: Profile, fmt: str, *, model_path: str | os.PathLike[str] | None = None) -> str:
    """The profile as ``fmt`` (one of ``FORMATS``) writes it; ``model_path`` replaces the recorded path."""
    path = os.fspath(model_path) if model_path is not None else None
    if fmt in CLI_TOOLS:
        return shell_line([fmt, *tool_args(profile, fmt, model_path=path)]) + "\n"
    if fmt == "ollama":
        return ollama_modelfile(profile, model_path=path)
    if fmt == "env":
        return llama_server_env(profile, model_path=path)
    if fmt == "llama-swap":
        return llama_swap_entry(profile, model_path=path)
    if fmt == "lmstudio":
        return json.dumps(lmstudio_config(profile, model_path=path), indent=2) + "\n"
    if fmt == "kcpps":
        return json.dumps(kcpps_config(profile, model_path=path), indent=2) + "\n"
    raise ProfileError(f"unknown export format {fmt!r}; expected one of {', '.join(FORMATS)}")


def tool_args(profile: Profile, tool: str, *, model_path: str | None = None) -> list[str]:
    """argv for ``llama-server``, ``llama-cli`` or ``llama-bench`` (without the program name)."""
    args = profile.settings.cli_args(tool, model_path=model_path, layers_total=profile.layers_total or None)
    if tool == "llama-bench":
        measured = profile.measured
        args += ["-p", str(measured.n_prompt), "-n", str(measured.n_gen)]
        if measured.depth:
            args += ["-d", str(measured.depth)]
    return args


def llama_server_env(profile: Profile, *, model_path: str | None = None) -> str:
    """``export LLAMA_ARG_...`` lines for llama-server; flags without a variable in a comment."""
    settings = profile.settings
    export = Export(tool="llama-server", layers_total=profile.layers_total or None, model_path=model_path)
    lines = [_comment(f"llama-server settings of offload-tuner profile {profile.name} ({profile.model.file_name})")]
    flags_only: list[str] = []
    for dim in DIMENSIONS:
        writer = dim.flags.get("llama-server")
        args = writer(settings, export) if writer is not None else []
        if not args:
            continue
        if dim.env is None:
            flags_only.append(shell_line(args))
        else:
            value = dim.env.value if dim.env.value is not None else args[1]
            lines.append(f"export {dim.env.name}={safe(value, 'shell')}")
    if flags_only:
        lines.append(_comment(f"llama-server reads no environment variable for these; pass them as flags: {' '.join(flags_only)}"))
    return "\n".join(lines) + "\n"


def ollama_modelfile(profile: Profile, *, model_path: str | None = None) -> str:
    """A Modelfile: ``FROM``, the ``PARAMETER`` lines that map, and what does not map, in a comment."""
    s = profile.settings
    measured = profile.measured
    export = Export(tool="ollama", layers_total=profile.layers_total or None, model_path=model_path)
    lines = [
        _comment(f"Modelfile from offload-tuner profile {profile.name}"),
        _comment(f"{profile.model.file_name} on {profile.machine.describe()}; tuned {profile.created_at}: "
                 f"tg {measured.tg.median:g} t/s, pp {measured.pp.median:g} t/s with llama.cpp"),
    ]
    spelled = [d.ollama for d in DIMENSIONS if d.ollama is not None]
    for ollama in sorted(spelled, key=lambda o: o.order):
        line = ollama.line(s, export) if ollama.line else None
        if line:
            lines.append(_instruction(line))
    # ollama starts llama-server with -c num_ctx x OLLAMA_NUM_PARALLEL (llm/llama_server.go).
    n = s.n_parallel
    lines.append(f"# num_ctx is per parallel request: the memory this profile measured holds with OLLAMA_NUM_PARALLEL={n}"
                 + (f" (num_ctx {s.n_ctx // n} each)" if n > 1 else ""))
    notes = [n for n in (o.note(s, export) if o.note else None for o in sorted(spelled, key=lambda o: o.order)) if n]
    if notes:
        lines.append("# not expressible in a Modelfile:")
        lines += [_comment(f"  {item}") for item in notes]
    return "\n".join(lines) + "\n"


def llama_swap_entry(profile: Profile, *, model_path: str | None = None) -> str:
    """A ``models:`` entry of llama-swap's config.yaml: the profile's llama-server command on ``${PORT}``.

    Strings are written as JSON strings, which YAML reads as double-quoted scalars, so no value (a
    path with ``: `` or ``#``) can change the document's structure."""
    args = tool_args(profile, "llama-server", model_path=model_path)
    for arg in args:
        if "\n" in arg or "\r" in arg:
            # llama-swap reads cmd line by line and drops lines that start with '#'
            raise UnsafeValueError(f"cannot write a llama-swap cmd with a line break in {arg!r}: give the model's "
                                   "path on this machine with --model PATH")
    cmd = "llama-server --port ${PORT} " + shell_line(args)
    measured = profile.measured
    description = (f"offload-tuner profile {profile.name}: tg {measured.tg.median:.1f} t/s, pp {measured.pp.median:.1f} t/s "
                   f"on {profile.machine.describe()}")
    lines = [
        _comment(f"llama-swap entry from offload-tuner profile {profile.name}; add it under models: in config.yaml"),
        "models:",
        f"  {json.dumps(profile.name)}:",
        f"    name: {json.dumps(profile.model.file_name)}",
        f"    description: {json.dumps(description)}",
        f"    cmd: {json.dumps(cmd)}",
    ]
    return "\n".join(lines) + "\n"


def _foreign(profile: Profile, app: str, model_path: str | None) -> tuple[dict[str, Any], list[str]]:
    """The fields of every dimension in ``app``'s words (``lmstudio`` or ``kcpps``) and the notes of
    what it cannot say, from the dimension table."""
    export = Export(tool=app, layers_total=profile.layers_total or None, model_path=model_path,
                    sliding_window=profile.sizing.sliding_window)
    fields: dict[str, Any] = {}
    notes: list[str] = []
    for dim in DIMENSIONS:
        spelling = getattr(dim, app)
        if spelling is None:
            continue
        if spelling.write is not None:
            fields.update(spelling.write(profile.settings, export))
        if spelling.note is not None:
            note = spelling.note(profile.settings, export)
            if note:
                notes.append(note)
    return fields, notes


def lmstudio_config(profile: Profile, *, model_path: str | None = None) -> dict[str, Any]:
    """LM Studio's per-model load config for this profile's settings."""
    fields, _ = _foreign(profile, "lmstudio", model_path)
    return {"preset": "", "operation": {"fields": []},
            "load": {"fields": [{"key": key, "value": value} for key, value in fields.items()]}}


def kcpps_config(profile: Profile, *, model_path: str | None = None) -> dict[str, Any]:
    """koboldcpp's ``.kcpps`` settings for this profile (a backend flag from the profile's build:
    ``usecuda`` / ``usevulkan`` / ``usecpu``)."""
    fields, _ = _foreign(profile, "kcpps", model_path)
    backends = [b.lower() for b in profile.llama_build.backends]
    if any(b in ("cuda", "hip", "rocm") for b in backends):
        fields["usecuda"] = ["normal"]
    elif "vulkan" in backends:
        fields["usevulkan"] = []
    elif profile.settings.n_gpu_layers == 0:
        fields["usecpu"] = True
    return {"model": [], **fields}


def export_notes(profile: Profile, fmt: str) -> list[str]:
    """What ``fmt`` cannot say of this profile (empty for the llama.cpp tools and llama-swap, which take
    every flag; the Modelfile says its own in comments)."""
    if fmt not in JSON_FORMATS:
        return []
    return _foreign(profile, fmt, None)[1]


def _comment(text: str) -> str:
    """A ``#`` line that stays one comment line whatever ``text`` holds (shell, env file, Modelfile)."""
    return "# " + safe(text, "comment")


def _instruction(line: str) -> str:
    """A Modelfile instruction (``FROM PATH``, ``PARAMETER num_ctx 8192``) whose value is plain, or
    ``UnsafeValueError`` saying why it cannot be written."""
    name, _, value = line.partition(" ")
    try:
        return f"{name} {safe(value, 'modelfile')}"
    except UnsafeValueError as exc:
        hint = " Give the model's path on this machine with --model PATH (a link with a plain name works)." if name == "FROM" else ""
        raise UnsafeValueError(f"cannot write the Modelfile's {name} line: {exc}.{hint}") from None


__all__ = ["FORMATS", "OLLAMA_KV_TYPES", "export_args", "tool_args", "llama_server_env", "ollama_modelfile",
           "llama_swap_entry", "lmstudio_config", "kcpps_config", "export_notes"]
