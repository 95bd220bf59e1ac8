"""One tuner measures on a machine at a time: two tuners on one GPU (or one CPU) would each measure
the other's load, and each would plan with memory the other holds.

    with MachineLock.for_machine(machine=None, what="tune model.gguf") as lock:
        lock.acquire(wait=True, on_wait=print_message)   # or wait=False: MachineBusyError
        ...measure...

The lock is an OS file lock (``flock``; ``msvcrt.locking`` on Windows) on a file in
``tuner.paths.locks_dir()``: the kernel drops it when its holder exits, however it exits (SIGKILL
included), so a dead tuner never blocks the next one. The file says who holds it (pid, user,
what it runs, since when) for the message the next one prints.

Per machine, not per device: tuners on two GPUs of one machine still share its CPU threads, RAM
and PCIe bus, so their measurements would disturb each other. A machine injected by a test or an
app (``Tuner(machine=...)``) is its own machine: simulated machines in one process do not wait for
each other, and do not wait for this real machine either.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import hashlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import MachineBusyError
from ..paths import locks_dir


class MachineLock:
    def __init__(self, key: str, *, what: str = "", folder: str | os.PathLike[str] | None = None) -> None:
        self.key = key
        self.what = what
        self.path = Path(folder) if folder is not None else locks_dir()
        self.path = self.path / f"machine-{hashlib.sha256(key.encode()).hexdigest()[:16]}.lock"
        self._handle: Any = None
        self.waited = False

    @classmethod
    def for_machine(cls, machine: Any = None, *, what: str = "") -> "MachineLock":
        """The lock of this machine (``machine=None``), or of an injected ``Machine``."""
        host = socket.gethostname()
        key = host if machine is None else f"{host}/injected/{machine.fingerprint()}"
        return cls(key, what=what)

    @property
    def held(self) -> bool:
        return self._handle is not None

    def holder(self) -> dict[str, Any]:
        """Who holds it, as they wrote it ({} when unknown)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8") or "{}")
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def acquire(self, *, wait: bool = True, on_wait: Callable[[str], None] | None = None, poll: float = 0.25) -> None:
        """Take the lock; if another tuner holds it, wait (telling ``on_wait`` once, in words) or,
        with ``wait=False``, raise ``MachineBusyError``. Ctrl-C while waiting stops the wait."""
        if self._handle is not None:
            return
        handle = self._open()
        try:
            if not _try_lock(handle):
                message = self.describe_holder()
                if not wait:
                    raise MachineBusyError(f"{message}; not waiting (--no-wait). Run again when it has finished, "
                                           "or without --no-wait to wait for it")
                if on_wait is not None:
                    on_wait(f"{message}; waiting for it to finish (Ctrl-C stops; --no-wait refuses instead)")
                self.waited = True
                while not _try_lock(handle):
                    time.sleep(poll)
        except BaseException:
            handle.close()
            raise
        self._handle = handle
        record = {"pid": os.getpid(), "host": socket.gethostname(), "user": _user(), "what": self.what,
                  "since": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")}
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(record))
            handle.flush()
        except OSError:
            pass  # the lock holds; only the note for others is missing

    def describe_holder(self) -> str:
        h = self.holder()
        if not h:
            return "another tuner is measuring on this machine"
        parts = [f"pid {h.get('pid', '?')}"]
        if h.get("user"):
            parts.append(f"user {h['user']}")
        if h.get("what"):
            parts.append(str(h["what"])[:200])
        if h.get("since"):
            parts.append(f"since {h['since']}")
        return f"another tuner is measuring on this machine ({', '.join(parts)})"

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        try:
            handle.seek(0)
            handle.truncate()
        except OSError:
            pass
        _unlock(handle)
        handle.close()

    def __enter__(self) -> "MachineLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _open(self) -> Any:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        try:
            fd = os.open(self.path, flags, 0o666)
        except PermissionError:
            # another user's lock file we may not write: locking needs only a read handle
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            return os.fdopen(fd, "r", encoding="utf-8")
        try:
            if hasattr(os, "fchmod") and os.fstat(fd).st_uid == os.getuid():
                os.fchmod(fd, 0o666)  # other users' tuners on this machine take it too
        except OSError:
            pass
        return os.fdopen(fd, "r+", encoding="utf-8")


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return ""


try:
    import fcntl

    def _try_lock(handle: Any) -> bool:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _unlock(handle: Any) -> None:
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

except ImportError:  # Windows
    import msvcrt

    def _try_lock(handle: Any) -> bool:
        try:
            handle.seek(0)
            msvcrt.locking(handle.fileno(), msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False

    def _unlock(handle: Any) -> None:
        handle.seek(0)
        msvcrt.locking(handle.fileno(), msvcrt.LK_UNLCK, 1)


__all__ = ["MachineLock"]
