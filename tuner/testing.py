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
