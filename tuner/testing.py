"""Public helpers for tests, demos and benchmarks (``tuner.model.make``): make real GGUF models of
any shape, quantize them with llama.cpp's own quantizer, and build llama.cpp's tools from the
sources that match the installed llama-cpp-python; start a throwaway PostgreSQL server.

    from tuner.testing import ModelShape, make_model, quantize, postgres_server
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from .model.make import (
    DEMO_SHAPE,
    FTYPES,
    ModelShape,
    build_against_llama_cpp,
    build_llama_cpp_tools,
    build_llama_server,
    demo_models,
    llama_cpp_env,
    llama_cpp_source,
    make_model,
    quantize,
)

__all__ = [
    "DEMO_SHAPE",
    "FTYPES",
    "ModelShape",
    "build_against_llama_cpp",
    "build_llama_cpp_tools",
    "build_llama_server",
    "demo_models",
    "llama_cpp_env",
    "llama_cpp_source",
    "make_model",
    "quantize",
]


# -- a throwaway PostgreSQL server (tests and benchmarks of the shared study store) ----------------

ENV_POSTGRES_BIN = "OFFLOAD_TUNER_POSTGRES_BIN"


def postgres_bindir() -> Path | None:
    """The folder holding PostgreSQL's ``initdb`` and ``postgres``: ``OFFLOAD_TUNER_POSTGRES_BIN``,
    then PATH, then Debian's ``/usr/lib/postgresql/<version>/bin`` (not on PATH), newest first."""
    candidates = []
    if os.environ.get(ENV_POSTGRES_BIN):
        candidates.append(Path(os.environ[ENV_POSTGRES_BIN]))
    found = shutil.which("initdb")
    if found:
        candidates.append(Path(found).resolve().parent)
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: _version_key(p.parent.name), reverse=True)
    candidates += debian + [Path("/usr/local/pgsql/bin")]
    for folder in candidates:
        if (folder / "initdb").is_file() and (folder / "postgres").is_file():
            return folder
    return None


def _version_key(text: str) -> tuple:
    return tuple(int(x) if x.isdigit() else 0 for x in text.split("."))


class PostgresServer:
    """A PostgreSQL cluster of its own in a temporary folder, on a free port of 127.0.0.1, with a
    password-protected role for the tests (``user`` / ``password``) and trust only on its unix
    socket for the superuser. Made for tests and benchmarks: nothing kept, and fsync off unless
    ``durable`` (a benchmark compares it with a SQLite file, which does fsync).

    initdb and the server refuse to run as root; as root they run as the ``postgres`` user (the
    Debian package creates it), which owns the folder."""

    def __init__(self, *, user: str = "tuner", password: str = "s3cret-Pa55;word", durable: bool = False) -> None:
        bindir = postgres_bindir()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed (no initdb): apt-get install postgresql, or set "
                               f"{ENV_POSTGRES_BIN} to the folder holding initdb and postgres")
        self.bindir = bindir
        self.user, self.password = user, password
        self.durable = durable
        self.base = Path(tempfile.mkdtemp(prefix="offload-tuner-pg-"))
        self.data = self.base / "data"
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self._run_as: dict = {}
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            import pwd

            try:
                entry = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root and there is no 'postgres' user to run PostgreSQL as "
                                   "(apt-get install postgresql creates it)") from None
            os.chown(self.base, entry.pw_uid, entry.pw_gid)
            self._run_as = {"user": entry.pw_uid, "group": entry.pw_gid}
        subprocess.run(
            [str(bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "-E", "UTF8", "--locale=C",
             "--auth-local=trust", "--auth-host=scram-sha-256", "--no-sync"],
            check=True, capture_output=True, cwd=self.base, **self._run_as,
        )
        self.start()
        self.superuser_sql(f"CREATE ROLE {user} LOGIN CREATEDB PASSWORD '{password}'")

    def start(self) -> None:
        """Start (or start again after ``stop``) the server and wait until it accepts connections."""
        log = open(self.base / "server.log", "ab")
        fast = [] if self.durable else ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        self.proc = subprocess.Popen(
            [str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.base),
             "-c", "listen_addresses=127.0.0.1", *fast, "-c", "max_connections=200", "-c", "shared_buffers=32MB"],
            stdout=log, stderr=log, cwd=self.base, start_new_session=True, **self._run_as,
        )
        log.close()
        deadline = time.monotonic() + 60
        while True:
            try:
                self.superuser_sql("SELECT 1")
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = (self.base / "server.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"PostgreSQL did not start:\n{tail}") from None
                time.sleep(0.2)

    def superuser_sql(self, sql: str) -> list:
        import psycopg

        with psycopg.connect(host=str(self.base), port=self.port, user="postgres", dbname="postgres",
                             autocommit=True, connect_timeout=5) as connection:
            cursor = connection.execute(sql)
            return cursor.fetchall() if cursor.description else []

    def url(self, database: str, *, password: bool = True) -> str:
        """``postgresql://user:password@127.0.0.1:port/database``."""
        auth = f"{self.user}:{_quote(self.password)}" if password else self.user
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """A new empty database owned by the test role; returns its URL (with the password)."""
        self.superuser_sql(f'CREATE DATABASE "{name}" OWNER {self.user}')
        return self.url(name)

    def stop(self) -> None:
        """Stop the server (a fast shutdown); its data stays, ``start`` brings it back."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


def _quote(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def postgres_server(**kwargs) -> Iterator[PostgresServer]:
    """``with postgres_server() as pg: url = pg.create_database("x")`` — stopped and removed after."""
    server = PostgresServer(**kwargs)
    try:
        yield server
    finally:
        server.close()


__all__ += ["PostgresServer", "postgres_server", "postgres_bindir"]


# -- llama-server, started for real (tests and benchmarks of a profile's llama-server export) -------


class ServedRound:
    """One round of ``users`` requests sent to llama-server at once, as the server's own ``timings``
    report them per request, with the moment each answer arrived here (``ended_s``, seconds after
    the requests left).

    - ``ttft_s``: per request, the server's ``prompt_ms`` (its prompt processed, the first token out);
    - ``per_user_tg``: per request, the server's ``predicted_per_second``;
    - ``aggregate_tg``: their sum, the server's generation throughput while its slots decode side by
      side (one token each per batch: llama-batched-bench's S_TG);
    - ``overlap``: how far the slots did decode side by side: the stretch where every request was
      generating (each one's generation ends when its answer arrives and began ``predicted_ms``
      before) over the longest generation; 1.0 when the prompts went in one batch and the slots
      stepped together all the way. Below 1 (prompts longer than one batch together: llama-server
      starts a slot's generation as soon as its own prompt is done) the sum over-counts."""

    def __init__(self, replies: list[dict], ended_s: list[float], wall_s: float) -> None:
        self.replies, self.ended_s, self.wall_s = replies, ended_s, wall_s
        timings = [r.get("timings") or {} for r in replies]
        self.prompt_n = [int(t.get("prompt_n", 0)) for t in timings]
        self.predicted_n = [int(t.get("predicted_n", 0)) for t in timings]
        self.per_user_tg = [float(t.get("predicted_per_second", 0.0)) for t in timings]
        self.ttft_s = [float(t.get("prompt_ms", 0.0)) / 1000 for t in timings]
        spans = [float(t.get("predicted_ms", 0.0)) / 1000 for t in timings]
        starts = [end - span for end, span in zip(ended_s, spans)]
        both = min(ended_s, default=0.0) - max(starts, default=0.0)
        self.overlap = max(0.0, min(1.0, both / max(spans))) if spans and max(spans) > 0 else 0.0

    @property
    def aggregate_tg(self) -> float:
        return sum(self.per_user_tg)


class LlamaServer:
    """llama-server (``binary``) started with ``args`` on a free port of 127.0.0.1, its log (stdout
    and stderr) in a file, stopped by ``close``. ``complete_together`` sends requests at once, as
    several users of an app would; ``rss`` is the process's resident memory now."""

    def __init__(self, binary: str | os.PathLike[str], args: list[str], *, env: dict[str, str] | None = None,
                 timeout_s: float = 300) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="offload-tuner-llama-server-"))
        self.log_path = self.base / "server.log"
        self.port = _free_port()
        self.args = [*args, "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([str(binary), *self.args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:
            status = self._health()
            if status == 200:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close(keep_log=True)
                raise RuntimeError(f"llama-server did not become ready (exit {self.proc.returncode}):\n{self.log[-3000:]}")
            time.sleep(0.2)

    def _health(self) -> int | None:
        import http.client

        try:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            connection.request("GET", "/health")
            status = connection.getresponse().status
            connection.close()
            return status
        except OSError:
            return None

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def complete_together(self, users: int, n_prompt: int, n_gen: int, *, n_vocab: int, seed: int = 0) -> ServedRound:
        """``users`` /completion requests sent at the same moment (a barrier), each a prompt of
        ``n_prompt`` random token ids (as llama-batched-bench's prompts) generating exactly ``n_gen``
        tokens (``ignore_eos``), the prompt cache off: every request's prompt is processed. Not
        streamed: the client's threads stay asleep while the server decodes (this machine's cores
        are the server's)."""
        import http.client
        import json
        import random
        import threading

        rng = random.Random(seed)
        prompts = [[rng.randrange(n_vocab) for _ in range(n_prompt)] for _ in range(users)]
        barrier = threading.Barrier(users + 1)
        replies: list[dict | BaseException | None] = [None] * users
        ended = [0.0] * users
        sent = [0.0]

        def one(i: int) -> None:
            body = json.dumps({"prompt": prompts[i], "n_predict": n_gen, "ignore_eos": True, "cache_prompt": False,
                               "temperature": 0.0, "stream": False})
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            try:
                connection.connect()
                barrier.wait()
                connection.request("POST", "/completion", body=body, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                data = response.read()
                ended[i] = time.perf_counter() - sent[0]
                if response.status != 200:
                    raise RuntimeError(f"llama-server answered {response.status}: {data[:500]!r}")
                replies[i] = json.loads(data)
            except BaseException as exc:  # noqa: BLE001 - reported below, in the caller's thread
                replies[i] = exc
            finally:
                connection.close()

        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(users)]
        for t in threads:
            t.start()
        sent[0] = time.perf_counter()
        barrier.wait()
        for t in threads:
            t.join()
        wall = time.perf_counter() - sent[0]
        for r in replies:
            if not isinstance(r, dict):
                raise RuntimeError(f"a request to llama-server failed: {r}")
        return ServedRound([r for r in replies if isinstance(r, dict)], ended, wall)

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss

    def close(self, *, keep_log: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not keep_log:
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ += ["LlamaServer", "ServedRound"]
