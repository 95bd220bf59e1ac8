"""Ctrl-C during a tune: immediate while llama.cpp runs, deferred everywhere else."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


class CtrlC:
    """Immediate while llama.cpp runs (the runner kills the worker at once), deferred everywhere
    else, so it never lands in the middle of a write to the study's database. Only the main thread
    can own SIGINT; elsewhere this does nothing."""

    def __init__(self) -> None:
        self.requested = False
        self._immediate = False
        self._previous: Any = None

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
        if self._immediate:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def immediate(self) -> Iterator[None]:
        """Ctrl-C interrupts at once inside this block (an engine running a trial)."""
        if self.requested:
            raise KeyboardInterrupt
        self._immediate = True
        try:
            yield
        finally:
            self._immediate = False
