"""One tuner measures on a machine at a time: two tuners on one GPU (or one CPU) would each measure
the other's load, and each would plan with memory the other holds.

    with MachineLock.for_machine(machine=None, what="tune model.gguf") as lock:
        lock.acquire(wait=True, on_wait=print_message)   # or wait=False: MachineBusyError
        ...measure...

The lock is an OS file lock (``flock``; ``msvcrt.locking`` on Windows) on a file in
``tuner.paths.locks_dir()``: the kernel drops it when its holder exits, however it exits (SIGKILL
included), so a dead tuner never blocks the next one. The file says who holds it (pid, what it
runs, since when) for the message the next one prints.

The folder is shared by every user of the machine (sticky, like /tmp), so the file is hostile
text: it is created 0644 (only its creator writes the record; the others lock it through a read
handle), the user named is the file's owner as the OS says, never what the record claims, and
every field of the record is printed escaped (a control character never reaches the terminal).

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
        """Who holds it, as they wrote it ({} when unknown), with ``owner``: the user the OS says owns
        the file (the only one who could write the record)."""
        try:
            with open(self.path, "rb") as handle:
                owner = _owner(os.fstat(handle.fileno()))
                text = handle.read(_MAX_RECORD + 1)
            if len(text) > _MAX_RECORD:
                return {"owner": owner} if owner else {}
            data = json.loads(text.decode("utf-8", errors="replace") or "{}")
            data = data if isinstance(data, dict) else {}
        except (OSError, ValueError, RecursionError):
            return {}
        data.pop("owner", None)
        if owner:
            data["owner"] = owner
        return data

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
        pid = h.get("pid")
        parts = [f"pid {pid if isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid < 1 << 32 else '?'}"]
        if h.get("owner"):
            parts.append(f"user {_escaped(h['owner'], 64)}")
        if h.get("what"):
            parts.append(_escaped(h["what"], 200))
        if h.get("since"):
            parts.append(f"since {_escaped(h['since'], 40)}")
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
            fd = os.open(self.path, flags, 0o644)
        except PermissionError:
            # another user's lock file we may not write: locking needs only a read handle
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            return os.fdopen(fd, "r", encoding="utf-8")
        try:
            st = os.fstat(fd)
            if hasattr(os, "fchmod") and st.st_uid == os.getuid() and st.st_mode & 0o022:
                os.fchmod(fd, 0o644)  # (older versions made it 0666: anyone could write the record)
            elif hasattr(os, "getuid") and st.st_uid != os.getuid():
                # another user's file that this user may write (0666): lock it, never write into it
                os.close(fd)
                fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
                return os.fdopen(fd, "r", encoding="utf-8")
        except OSError:
            pass
        return os.fdopen(fd, "r+", encoding="utf-8")


# a record is one short JSON line; anything longer is not a tuner's
_MAX_RECORD = 4096


def _owner(st: os.stat_result) -> str:
    """The name of the user owning a file (its uid when the name is unknown); "" on Windows."""
    if not hasattr(os, "getuid"):
        return ""
    try:
        import pwd

        return pwd.getpwuid(st.st_uid).pw_name
    except (ImportError, KeyError):
        return f"uid {st.st_uid}"


def _escaped(value: Any, width: int) -> str:
    """A record field for the terminal: control characters (escapes, newlines) as Python writes them
    in a string literal, cut to ``width``."""
    from ..limits import _CONTROL

    text = str(value)[: width * 4]
    text = _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)
    return text if len(text) <= width else text[: width - 3] + "..."


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
