"""How a trial ended: one enum, decided in one place (``classify``).

Every way a trial can end is an ``Outcome``; no trial outcome is ever an exception in the
caller. ``classify`` looks, in this order, at: rejected before launch, killed at the time
limit, llama.cpp's own out-of-memory markers in the log (they win over the way the process
died: an allocation failure often ends in an abort), a clean reply from the worker, a death by
signal, and a refusal to load.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass
from typing import Any


class Outcome(str, enum.Enum):
    OK = "ok"
    OOM = "oom"  # device or host memory ran out (llama.cpp said so, or the allocator did)
    CRASH = "crash"  # the worker died: killed by a signal, or exited without a reply
    TIMEOUT = "timeout"  # the whole process group was killed at the time limit
    LOAD_ERROR = "load_error"  # llama.cpp refused the model or the settings
    BAD_SETTINGS = "bad_settings"  # rejected before launch

    def __str__(self) -> str:
        return self.value

    @property
    def is_failure(self) -> bool:
        return self is not Outcome.OK


@dataclass(frozen=True)
class Classification:
    outcome: Outcome
    message: str
    signal_name: str | None = None


def signal_name(returncode: int | None) -> str | None:
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def classify(
    *,
    rejected: str | None = None,
    timed_out: bool = False,
    timeout_s: float | None = None,
    reply: dict[str, Any] | None = None,
    returncode: int | None = None,
    oom_in_log: bool = False,
    error_lines: tuple[str, ...] = (),
    process: str = "worker",
) -> Classification:
    """Decide a trial's outcome from everything the runner saw. ``process`` names what ran the trial
    in the messages (the python engine's worker, or llama-bench)."""
    if rejected is not None:
        return Classification(Outcome.BAD_SETTINGS, rejected)
    if timed_out:
        return Classification(Outcome.TIMEOUT, f"killed after {timeout_s:g} s without finishing (the whole process group)")
    first_error = error_lines[0] if error_lines else None
    status = (reply or {}).get("status")
    if oom_in_log or status == "oom":
        detail = "; ".join(error_lines[:3]) or (reply or {}).get("message") or "allocation failed"
        return Classification(Outcome.OOM, f"out of memory: {detail}")
    if status == "ok":
        return Classification(Outcome.OK, "ok")
    name = signal_name(returncode)
    if name is not None:
        hint = {
            "SIGKILL": " (not by the tuner: the kernel's out-of-memory killer sends this)",
            "SIGSEGV": " (llama.cpp crashed: a segmentation fault)",
            "SIGABRT": " (llama.cpp aborted: an assert or a fatal error)",
        }.get(name, "")
        detail = f": {first_error}" if first_error else ""
        return Classification(Outcome.CRASH, f"{process} killed by {name}{hint}{detail}", signal_name=name)
    if status in ("load_error", "context_error"):
        message = (reply or {}).get("message") or "llama.cpp refused the model or settings"
        if first_error and first_error not in message:
            message = f"{message}: {first_error}"
        return Classification(Outcome.LOAD_ERROR, message)
    if status == "bad_settings":
        return Classification(Outcome.BAD_SETTINGS, (reply or {}).get("message", "rejected by the worker"))
    detail = (reply or {}).get("message") or first_error or "no reply"
    return Classification(Outcome.CRASH, f"{process} exited with code {returncode} without a result: {detail}")
