"""Shared fixtures. Tests never touch the real user folder: OFFLOAD_TUNER_HOME points at a
temporary folder for every test. Models are made, never downloaded."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tuner.testing import ModelShape, make_model, quantize

TINY = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx_train=4096)
MOE = ModelShape(n_layer=3, n_embd=256, n_head=4, n_head_kv=4, n_ff=256, n_vocab=512, n_expert=4, n_expert_used=2)
# Gemma-3-style: 7 of 8 layers attend to a 256-token window (every 6th layer sees everything), output tied to the embedding
SWA = ModelShape(architecture="gemma3", n_layer=8, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512,
                 n_ctx_train=8192, sliding_window=256, swa_period=6)


@pytest.fixture(autouse=True)
def tuner_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "offload-tuner-home"
    monkeypatch.setenv("OFFLOAD_TUNER_HOME", str(home))
    monkeypatch.delenv("OFFLOAD_TUNER_PROFILE_PATH", raising=False)
    monkeypatch.delenv("OFFLOAD_TUNER_REGISTRY", raising=False)
    # the machine lock of each test is its own: tests (and other people's test runs) on this
    # machine do not wait for each other
    monkeypatch.setenv("OFFLOAD_TUNER_LOCK_DIR", str(tmp_path / "locks"))
    return home


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL server for the session (``tuner.testing.PostgresServer``).

    Without PostgreSQL installed these tests are skipped, except under CI (``CI`` set), where
    ``.ci/run`` installs it and its absence is a failure."""
    from tuner.testing import PostgresServer, postgres_bindir

    if postgres_bindir() is None:
        message = "PostgreSQL is not installed (apt-get install postgresql; .ci/run does it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = PostgresServer()
    yield server
    server.close()


@pytest.fixture
def pg_url(postgres) -> str:
    """A new, empty PostgreSQL database for one test: its URL, with the password."""
    return postgres.create_database(f"t_{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small real GGUF models: F16, its Q8_0 and Q4_K_M quantizations, an MoE, a split model and a
    sliding-window (gemma3) model."""
    folder = tmp_path_factory.mktemp("models")
    f16 = make_model(folder / "tiny-F16.gguf", TINY)
    return {
        "f16": f16,
        "q8_0": quantize(f16, folder / "tiny-Q8_0.gguf", "Q8_0"),
        "q4_k_m": quantize(f16, folder / "tiny-Q4_K_M.gguf", "Q4_K_M"),
        "moe": make_model(folder / "moe-F16.gguf", MOE),
        "split": make_model(folder / "split" / "tiny.gguf", TINY, split_max_tensors=15),
        "swa": make_model(folder / "swa-F16.gguf", SWA),
    }


@pytest.fixture
def rpc_servers():
    """Start local llama.cpp RPC servers: ``rpc_servers(2, memory_limits=[None, 200 << 20])``.

    Every server started here is stopped at teardown, whatever the test did, and the test fails
    if one outlived its stop (an orphan process).
    """
    from tuner.engine.rpc import start_servers

    started = []

    def start(count: int = 1, **kwargs):
        servers = start_servers(count, threads=1, **kwargs)
        started.extend(servers)
        return servers

    yield start
    for server in started:
        proc = server.proc
        server.stop()
        if proc is not None:
            assert proc.poll() is not None, f"RPC server {server.endpoint} outlived its stop"


def _llama_cpp_build(tmp_path_factory: pytest.TempPathFactory, variable: str, build: str, folder: str) -> Path:
    """``variable``'s path when set (``.ci/run`` builds once per CI run), else ``tuner.testing.<build>``
    into a new temporary ``folder`` from the llama.cpp sources that match the installed
    llama-cpp-python (``LLAMA_CPP_SOURCE``); a skip saying why when that cannot be."""
    import tuner.testing
    from tuner.errors import TunerError

    given = os.environ.get(variable)
    if given:
        return Path(given)
    if tuner.testing.llama_cpp_source() is None:
        pytest.skip("llama.cpp sources not found: set LLAMA_CPP_SOURCE to an unpacked llama-cpp-python sdist's vendor/llama.cpp")
    try:
        return getattr(tuner.testing, build)(tmp_path_factory.mktemp(folder))
    except TunerError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def llama_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of real llama.cpp binaries (llama-bench, llama-fit-params, llama-batched-bench) for the
    llama-cpp engine: ``OFFLOAD_TUNER_LLAMA_BIN``, else built here."""
    return _llama_cpp_build(tmp_path_factory, "OFFLOAD_TUNER_LLAMA_BIN", "build_llama_cpp_tools", "llama-bin")


@pytest.fixture(scope="session")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama-server built from the llama.cpp sources that match the installed llama-cpp-python, against
    its libraries: ``OFFLOAD_TUNER_LLAMA_SERVER`` (a folder of its own in CI, apart from the engine's
    tools), else built here (about four minutes on two cores)."""
    return _llama_cpp_build(tmp_path_factory, "OFFLOAD_TUNER_LLAMA_SERVER", "build_llama_server", "llama-server")


@pytest.fixture(scope="session")
def llama_parsers(tmp_path_factory):
    """(harness, llama-bench, environment) built from llama.cpp's sources (tests/parsers.py), or a skip."""
    from tests.parsers import build_parsers

    return build_parsers(tmp_path_factory)
