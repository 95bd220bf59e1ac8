"""Child-process helpers shared by the trial runner, the worker and the RPC servers."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

# The worker's own lines in llama.cpp's log (trial and context boundaries) start with this.
LOG_MARK = "offload-tuner:"
# The runner tells its worker who its parent is (the pid the worker must outlive no longer than a
# poll), and each request how long it may take.
ENV_PARENT_PID = "OFFLOAD_TUNER_PARENT_PID"
# The worker ends a request this much after the runner's own deadline: the runner normally kills
# it first and classifies the timeout; the worker's limit is for when the runner cannot.
WORKER_GRACE_S = 5.0


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


class Watchdog(threading.Thread):
    """In a worker: ends the worker's process group when the process that started it is gone (a
    tuner killed with SIGKILL cannot kill its worker), or when the request being served runs past
    its deadline (``arm``). A thread that polls twice a second: it runs while llama.cpp computes
    (ctypes releases the GIL) and costs nothing measurable. A request that reports progress (a long
    scoring pass) gets its limit again at each report, as the runner gives it. Polling ``getppid``
    rather than ``PR_SET_PDEATHSIG``: the latter fires when the parent *thread* exits, which would
    kill the worker of a runner used from a short-lived thread."""

    def __init__(self, parent_pid: int | None, interval: float = 0.5) -> None:
        super().__init__(name="offload-tuner-watchdog", daemon=True)
        self.parent_pid = parent_pid
        self.interval = interval
        self._deadline: float | None = None
        self._limit = 0.0

    @classmethod
    def from_environment(cls) -> "Watchdog":
        value = os.environ.get(ENV_PARENT_PID, "")
        return cls(int(value) if value.isdigit() else None)

    def arm(self, seconds: float | None) -> None:
        """The request now being served must end within ``seconds`` (None: no limit)."""
        self._limit = float(seconds) if seconds else 0.0
        self._deadline = time.monotonic() + float(seconds) if seconds else None

    def progress(self) -> None:
        """The request reported progress: its limit starts again (long passes report each step)."""
        if self._deadline is not None:
            self._deadline = time.monotonic() + self._limit

    def disarm(self) -> None:
        self._deadline = None

    def run(self) -> None:
        while True:
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                _end_worker(f"the tuner (pid {self.parent_pid}) is gone")
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                _end_worker(f"the trial ran past its {self._limit:.0f} s limit")
            time.sleep(self.interval)


def _end_worker(reason: str) -> None:
    try:
        os.write(2, f"{LOG_MARK} {reason}: the worker ends itself\n".encode())
    except OSError:
        pass
    if hasattr(os, "killpg") and os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)  # it leads its group (start_new_session): all of it
    os._exit(124)


class MemorySampler(threading.Thread):
    """Samples a trial process's RSS (psutil) and, with NVML, its memory on each GPU.

    Four times a second, not more: every wake-up of this process can preempt one of llama.cpp's
    compute threads, and on a machine with as many threads as cores that stalls them all. The
    exact host peak comes from the worker itself (VmHWM); this sampler is for GPU memory.
    """

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_rss = 0
        self.peak_vram: dict[str, int] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            proc = psutil.Process(self.pid)
        except psutil.Error:
            return
        nvml = _nvml_handles()
        while not self._halt.is_set():
            try:
                self.peak_rss = max(self.peak_rss, proc.memory_info().rss)
            except psutil.Error:
                return
            for name, (pynvml, handle) in nvml.items():
                try:
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                        if p.pid == self.pid and p.usedGpuMemory:
                            self.peak_vram[name] = max(self.peak_vram.get(name, 0), int(p.usedGpuMemory))
                except Exception:
                    pass
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=2)


def _nvml_handles() -> dict[str, tuple[Any, Any]]:
    try:
        import pynvml

        pynvml.nvmlInit()
        return {f"CUDA{i}": (pynvml, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())}
    except Exception:
        return {}
