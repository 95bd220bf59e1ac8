"""Where the tuner keeps its files: studies, profiles and made models.

``OFFLOAD_TUNER_HOME`` overrides the platform data folder (tests always set it).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import FileWriteError

ENV_HOME = "OFFLOAD_TUNER_HOME"
ENV_PROFILE_PATH = "OFFLOAD_TUNER_PROFILE_PATH"
ENV_LOCK_DIR = "OFFLOAD_TUNER_LOCK_DIR"
ENV_REGISTRY = "OFFLOAD_TUNER_REGISTRY"


def data_dir() -> Path:
    override = os.environ.get(ENV_HOME)
    if override:
        path = Path(override).expanduser()
    else:
        import platformdirs

        path = Path(platformdirs.user_data_dir("offload-tuner", appauthor=False))
    _make(path)
    return path


def _subdir(name: str) -> Path:
    path = data_dir() / name
    _make(path)
    return path


def _make(path: Path) -> None:
    # A folder that cannot be made (a read-only disk) is not an error for whoever only reads it
    # (`profile list` finds nothing there); whoever writes checks with ensure_writable first, or
    # gets a FileWriteError from atomic_write_text.
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def ensure_writable(folder: str | os.PathLike[str]) -> Path:
    """Make ``folder`` if needed and check that a file can be created in it (a read-only disk, a
    file in the way or a missing permission fail here, before hours of work), or FileWriteError."""
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".offload-tuner-probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise FileWriteError(path, f"{_reason(exc)} (this folder must be writable)") from None
    return path


def profiles_dir() -> Path:
    return _subdir("profiles")


def studies_dir() -> Path:
    return _subdir("studies")


def models_dir() -> Path:
    return _subdir("models")


def study_storage_url() -> str:
    """The default Optuna storage: SQLite in the data folder's ``studies/``."""
    return f"sqlite:///{studies_dir() / 'studies.db'}"


def headers_dir() -> Path:
    """Cached GGUF headers of models read over the network (``tuner.model.header_cache``)."""
    return _subdir("headers")
def locks_dir() -> Path:
    """Where tuners on this machine take turns measuring: ``OFFLOAD_TUNER_LOCK_DIR``, else one folder
    in the system's temporary folder shared by every user of the machine (they share its GPUs)."""
    override = os.environ.get(ENV_LOCK_DIR)
    if override:
        path = Path(override).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(tempfile.gettempdir()) / "offload-tuner-locks"
    try:
        path.mkdir(exist_ok=True)
        if hasattr(os, "getuid") and path.stat().st_uid == os.getuid():
            os.chmod(path, 0o1777)  # shared and sticky, like /tmp: every user's tuner takes the same lock
    except OSError:
        pass
    return path


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically (``atomic_write_bytes``)."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: a temp file in the same folder, then rename.

    Either the whole new file is there or the old one is untouched; a failure (a read-only or full
    disk, a folder at ``path``) raises FileWriteError naming the path and the system's reason.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name[:64]}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise FileWriteError(target, _reason(exc)) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise FileWriteError(target, _reason(exc)) from None
        raise
    return target
