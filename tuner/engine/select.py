"""Choosing an engine by name (``--engine python|llama-cpp``), and listing the ones this machine has.

    with open_engine("llama-cpp", llama_bin="/opt/llama.cpp/bin", timeout_s=300) as engine:
        ...
    engines_found()   # [{"name": "python", "build": ..., ...}, {"name": "llama-cpp", "error": "..."}]
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import EngineError
from .base import Engine

ENGINE_NAMES = ("python", "llama-cpp")


def engine_name(engine: str | None, llama_bin: str | os.PathLike[str] | None) -> str:
    """The engine a command runs: as named, else ``llama-cpp`` when binaries are given, else ``python``."""
    if engine is None:
        return "llama-cpp" if llama_bin is not None else "python"
    if engine not in ENGINE_NAMES:
        raise EngineError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINE_NAMES)}")
    if engine == "python" and llama_bin is not None:
        raise EngineError("--llama-bin names llama.cpp binaries, which only the llama-cpp engine runs: "
                          "drop --engine python, or drop --llama-bin")
    return engine


def open_engine(
    engine: str | None = None,
    *,
    llama_bin: str | os.PathLike[str] | None = None,
    timeout_s: float = 300.0,
    memory_limit: int | None = None,
) -> Engine:
    """An engine ready to run trials. ``memory_limit`` (bytes of address space for the trial process)
    exists for the python engine's worker only."""
    name = engine_name(engine, llama_bin)
    if name == "python":
        from .python import TrialRunner

        return TrialRunner(timeout_s=timeout_s, memory_limit=memory_limit)
    if memory_limit:
        raise EngineError("--memory-limit caps the python engine's worker; the llama-cpp engine runs your binaries "
                          "as they are (cap a device instead: `offload-tuner rpc-serve --memory-limit`)")
    from .llamacpp import LlamaCppEngine

    return LlamaCppEngine(llama_bin, timeout_s=timeout_s)


def engines_found(llama_bin: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Every engine this machine can run, with its build, or why it cannot run here."""
    out: list[dict[str, Any]] = []
    for name in ENGINE_NAMES:
        entry: dict[str, Any] = {"name": name}
        try:
            with open_engine(name, llama_bin=llama_bin if name == "llama-cpp" else None) as engine:
                build = engine.build()
                entry.update(build.to_dict(), build=build.describe())
                entry.pop("engine", None)
                if name == "llama-cpp":
                    entry["tools"] = {tool: str(path) for tool, path in engine.binaries.tools.items()}  # type: ignore[attr-defined]
        except EngineError as exc:
            entry["error"] = str(exc)
        out.append(entry)
    return out


__all__ = ["ENGINE_NAMES", "engine_name", "open_engine", "engines_found"]
