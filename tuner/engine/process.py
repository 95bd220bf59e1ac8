"""Child-process helpers shared by the trial runner, the worker and the RPC servers."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

# The worker's own lines in llama.cpp's log (trial and context boundaries) start with this.
LOG_MARK = "offload-tuner:"


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a child's whole process group (it leads its own: ``start_new_session``) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def status_bytes(field: str) -> int | None:
    """A size line of /proc/self/status (``VmSize``, ``VmHWM``...) in bytes; None where unknown."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def vm_size() -> int:
    """This process's mapped address space in bytes (Linux), 0 where unknown."""
    return status_bytes("VmSize") or 0


def cap_address_space(limit: int) -> int:
    """Cap this process's address space at what is mapped now plus ``limit`` bytes.

    What is mapped now is the interpreter and llama.cpp's libraries; the limit covers what comes
    next: weights, KV cache and buffers, and the stacks of threads started later. Returns the cap.
    """
    import resource

    cap = vm_size() + int(limit)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return cap


def project_pythonpath(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this package's folder first on PYTHONPATH, so ``python -m tuner...`` children
    import the same tuner as their parent."""
    root = str(Path(__file__).resolve().parent.parent.parent)
    parts = [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    return env
