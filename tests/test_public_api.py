"""The public surface is curated: this list changes only on purpose."""

from __future__ import annotations

import subprocess
import sys

import tuner

EXPECTED = [
    "BenchSpec", "Engine", "EngineError", "Llama", "LoadReport", "Machine", "MemoryEstimate", "ModelError", "ModelInfo",
    "NoMatchingProfileError", "Outcome", "Profile", "ProfileError", "ProfileMismatchError", "ProfileValidationError",
    "QualityError", "QualityReport", "QuantizeError",
    "RPCError", "SchemaVersionError", "Settings", "SettingsError", "StudyError", "TrialResult", "TrialRunner",
    "TuneResult", "Tuner", "TunerError", "__version__", "check_profile", "estimate", "inspect", "list_profiles",
    "load_profile", "max_gpu_layers", "open_engine", "parse_log", "probe", "quality", "read_profile", "run_trial", "tune",
]


def test_all_is_pinned():
    assert sorted(tuner.__all__) == sorted(EXPECTED)


def test_every_public_name_resolves():
    for name in tuner.__all__:
        assert getattr(tuner, name) is not None, name


def test_importing_tuner_is_light():
    code = "import sys, tuner; print(sorted(m for m in ('optuna', 'gguf', 'llama_cpp', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
