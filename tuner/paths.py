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


def headers_dir() -> Path:
    """Cached GGUF headers of models read over the network (``tuner.model.header_cache``)."""
    return _subdir("headers")


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically: a temp file in the same folder, then rename."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: a temp file in the same folder, then rename."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
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
