"""offload-tuner: find the fastest way to run a GGUF model with llama.cpp on this machine.

The public surface is listed in ``__all__``. Importing ``tuner`` is light: heavy parts (optuna,
gguf, llama.cpp) load only when the function that needs them is first used, so an app that
only loads a profile never pays for the tuner.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first use)
_EXPORTS = {
    # errors
    "TunerError": "errors",
    "ModelError": "errors",
    "SettingsError": "errors",
    "ProfileError": "errors",
    "ProfileValidationError": "errors",
    "SchemaVersionError": "errors",
    "NoMatchingProfileError": "errors",
    "ProfileMismatchError": "errors",
    "StudyError": "errors",
    "RPCError": "errors",
    "QualityError": "errors",
    "QuantizeError": "errors",
    "EngineError": "errors",
    # foundation
    "Settings": "engine.settings",
    "Machine": "machine.probe",
    "probe": "machine.probe",
    "inspect": "model.inspect",
    "ModelInfo": "model.inspect",
    "estimate": "model.estimate",
    "MemoryEstimate": "model.estimate",
    "max_gpu_layers": "model.estimate",
    # runner
    "parse_log": "engine.logparse",
    "LoadReport": "engine.logparse",
    "Outcome": "engine.outcome",
    "TrialResult": "engine.base",
    "run_trial": "engine.python",
    "TrialRunner": "engine.python",
    "BenchSpec": "engine.base",
    # engines: llama-cpp-python or the user's own llama.cpp binaries
    "Engine": "engine.base",
    "open_engine": "engine.select",
    # tune
    "tune": "search.study",
    "Tuner": "search.study",
    "TuneResult": "search.study",
    # quality
    "quality": "search.quality",
    "QualityReport": "search.quality",
    # profiles and apps
    "Profile": "profile.document",
    "read_profile": "profile.store",
    "list_profiles": "profile.store",
    "load_profile": "profile.apps",
    "check_profile": "profile.apps",
    "Llama": "profile.apps",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tuner' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
