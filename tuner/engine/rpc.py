"""llama.cpp RPC devices: servers that expose this machine's CPU as a device, and clients that use them.

To llama.cpp an RPC server is a GPU: layers are offloaded to it, a tensor split spreads them over
several, and a server whose memory is capped fails allocations with llama.cpp's real
out-of-memory messages. That makes real offload testable without a GPU, and serves users who
spread one model over several machines.

    with RPCServer(memory_limit=200 << 20) as server:      # 127.0.0.1, a free port
        Settings(model_path=..., n_gpu_layers=5, rpc_servers=(server.endpoint,))

Servers bind to 127.0.0.1 unless told otherwise: llama.cpp warns that the RPC server is unsafe
on an open network (no authentication, arbitrary memory writes).

It takes no extra dependency: llama-cpp-python built with ``CMAKE_ARGS="-DGGML_RPC=on"`` ships
libggml-rpc, whose ``ggml_backend_rpc_start_server`` runs a server and whose
``ggml_backend_rpc_add_server`` (registered with libggml's ``ggml_backend_register``) makes one
visible to llama.cpp. Server processes import llama_cpp; the tuner's own process never does.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from ..errors import RPCError
from .process import cap_address_space, kill_group, project_pythonpath

MiB = 1 << 20
_LIVE: set["RPCServer"] = set()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RPCServer:
    """An RPC server in its own process group, serving this machine's CPU device."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        memory_limit: int | None = None,
        threads: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.memory_limit = memory_limit
        self.threads = threads
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "RPCServer":
        cmd = [sys.executable, "-m", "tuner.engine.rpc", "--host", self.host, "--port", str(self.port)]
        if self.memory_limit:
            cmd += ["--memory-limit-bytes", str(int(self.memory_limit))]
        if self.threads:
            cmd += ["--threads", str(self.threads)]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         env=project_pythonpath(dict(os.environ)), start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        _LIVE.add(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RPCError(f"the RPC server on {self.endpoint} exited at start (code {self.proc.returncode}); "
                               "is the port taken, or llama-cpp-python built without -DGGML_RPC=on?")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RPCError(f"the RPC server on {self.endpoint} did not accept connections within {timeout_s:g} s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        _LIVE.discard(self)
        if proc is not None:
            kill_group(proc)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> "RPCServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __hash__(self) -> int:
        return id(self)


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop()


def start_servers(count: int, *, memory_limits: Sequence[int | None] | None = None, threads: int | None = None,
                  host: str = "127.0.0.1") -> list[RPCServer]:
    """Start ``count`` local servers (all stopped again if one fails to start)."""
    limits = list(memory_limits) if memory_limits else [None] * count
    servers: list[RPCServer] = []
    try:
        for i in range(count):
            servers.append(RPCServer(host=host, memory_limit=limits[i], threads=threads).start())
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


# -- client side (trial worker / apps): make servers visible to llama.cpp --------------------------


def register_servers(endpoints: Iterable[str]) -> list[str]:
    """Register RPC servers with llama.cpp's device registry (in this process). Returns device names."""
    from .ggml import list_devices, load

    rpc = load("ggml-rpc")
    ggml = load("ggml")
    rpc.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
    ggml.ggml_backend_register.restype = None
    ggml.ggml_backend_register.argtypes = [ctypes.c_void_p]
    for endpoint in endpoints:
        # llama.cpp aborts the process when a server it was given does not answer: ask first
        why = unreachable(endpoint)
        if why:
            raise RPCError(why)
        reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
        if not reg:
            raise RPCError(f"cannot reach the RPC server at {endpoint}")
        ggml.ggml_backend_register(reg)
    return [d["name"] for d in list_devices()]


_QUERY = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from tuner.engine.rpc import register_servers
from tuner.engine.ggml import list_devices
register_servers(sys.argv[2].split(","))
print(json.dumps(list_devices()))
"""


def unreachable(endpoint: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at ``endpoint`` (``host:port``), in words, or None when something does."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except socket.timeout:
        return f"no answer from {endpoint} within {timeout_s:g} s"
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        return f"cannot connect to {endpoint}: {reason}" + ("; is `offload-tuner rpc-serve` running there?" if isinstance(exc, ConnectionRefusedError) else "")


def query_devices(endpoints: Sequence[str], timeout_s: float = 30.0) -> list[dict]:
    """What each RPC server reports (in a child process: a dead server cannot hang the caller).
    An entry that could not be read has ``error``, in words."""
    root = str(Path(__file__).resolve().parent.parent)
    out = []
    from .recorded import recorded_machine

    recorded = recorded_machine()
    for endpoint in endpoints:
        entry: dict = {"endpoint": endpoint}
        out.append(entry)
        if recorded is not None:  # a test seam: the RPC devices a recorded --list-devices printed
            found = [d for d in recorded.devices() if d.rpc_endpoint == endpoint]
            if found:
                entry.update(name=found[0].name, description=found[0].description, memory_free=found[0].memory_free,
                             memory_total=found[0].memory_total)
            else:
                entry["error"] = f"{endpoint} is not among the recorded machine's RPC devices"
            continue
        why = unreachable(endpoint)
        if why:
            entry["error"] = why
            continue
        try:
            proc = subprocess.run([sys.executable, "-c", _QUERY, root, endpoint], capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            entry["error"] = f"{endpoint} accepted a connection but did not answer as a llama.cpp RPC server within {timeout_s:g} s"
            continue
        except OSError as exc:
            entry["error"] = f"could not query {endpoint}: {exc.strerror or exc}"
            continue
        try:
            devices = [d for d in json.loads(proc.stdout.strip().splitlines()[-1]) if d["name"].startswith("RPC")]
        except (ValueError, IndexError, KeyError, TypeError):
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
            entry["error"] = f"{endpoint} did not answer as a llama.cpp RPC server ({last})"
            continue
        if devices:
            entry.update(name=devices[0]["name"], description=devices[0]["description"],
                         memory_free=devices[0]["memory_free"], memory_total=devices[0]["memory_total"])
        else:
            entry["error"] = f"{endpoint} reported no device"
    return out


# -- server side ---------------------------------------------------------------------------------


def serve(host: str, port: int, memory_limit: int | None, threads: int | None) -> None:
    """Run an RPC server for the CPU device until killed (blocks)."""
    from .ggml import GGML_BACKEND_DEVICE_TYPE_CPU, load

    rpc = load("ggml-rpc")
    ggml = load("ggml")
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    dev = ggml.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        raise RPCError("llama.cpp has no CPU device to serve")
    n_threads = threads or max(1, os.cpu_count() or 1)
    if memory_limit:
        # the limit covers the buffers clients allocate and the compute threads' stacks (8 MiB each)
        cap_address_space(int(memory_limit))
    rpc.ggml_backend_rpc_start_server.restype = None
    rpc.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                                                   ctypes.POINTER(ctypes.c_void_p)]
    devices = (ctypes.c_void_p * 1)(dev)
    # llama.cpp's server prints why it could not listen and returns; find out first, in words
    # (and a return from it below is always a failure: it serves until killed).
    try:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host.strip("[]"), port))
    except OSError as exc:
        raise RPCError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None
    print(f"offload-tuner: RPC server on {host}:{port}, {n_threads} threads"
          + (f", memory capped at {memory_limit / MiB:.0f} MiB" if memory_limit else ""), flush=True)
    rpc.ggml_backend_rpc_start_server(f"{host}:{port}".encode(), None, n_threads, 1, devices)
    raise RPCError(f"the RPC server on {host}:{port} stopped: llama.cpp could not listen there (its message is above)")


def main(argv: Sequence[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tuner.engine.rpc", description="Run a llama.cpp RPC server for this CPU.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--memory-limit-bytes", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        serve(args.host, args.port, args.memory_limit_bytes, args.threads)
    except RPCError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
