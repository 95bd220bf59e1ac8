"""Where the tuner keeps its files: studies, profiles and made models.

``OFFLOAD_TUNER_HOME`` overrides the platform data folder (tests always set it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ENV_HOME = "OFFLOAD_TUNER_HOME"
ENV_PROFILE_PATH = "OFFLOAD_TUNER_PROFILE_PATH"


def data_dir() -> Path:
    override = os.environ.get(ENV_HOME)
    if override:
        path = Path(override).expanduser()
    else:
        import platformdirs

        path = Path(platformdirs.user_data_dir("offload-tuner", appauthor=False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _subdir(name: str) -> Path:
    path = data_dir() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def profiles_dir() -> Path:
    return _subdir("profiles")


def studies_dir() -> Path:
    return _subdir("studies")


def models_dir() -> Path:
    return _subdir("models")


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a temp file in the same folder, then rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target
