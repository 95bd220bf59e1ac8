"""The ``python`` engine: llama.cpp through llama-cpp-python, each trial in an isolated worker process.

    with TrialRunner(timeout_s=120) as runner:
        result = runner.run(settings, BenchSpec(n_prompt=512, n_gen=128))
        result.outcome, result.tg.median, result.load.layers_offloaded

Each worker is spawned in its own process group (``start_new_session``), so a crash, an abort,
a hang or an out-of-memory in llama.cpp never takes the caller down, and a timeout kills the
whole group. A worker is kept while trials share the model-level settings
(``Settings.model_key``): the model is loaded once and each trial gets a new context. Any failed
trial retires its worker; the next trial starts a fresh one.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .base import BenchSpec, Engine, EngineBuild, Stats, StopRule, TrialResult
from .devices import DeviceInfo
from .logparse import LoadReport, parse_log
from .outcome import Classification, Outcome, classify
from .process import ENV_PARENT_PID, LOG_MARK, WORKER_GRACE_S, MemorySampler, kill_group, project_pythonpath
from .settings import Settings

if TYPE_CHECKING:
    from .scoring import ScoringJob, ScoringResult

CONTEXT_MARK = f"{LOG_MARK} context begins"


# The sampler lives with the other child-process helpers; both engines use it.
_Sampler = MemorySampler


class TrialRunner(Engine):
    """Runs trials in isolated worker processes, reusing a worker while the model stays the same.

    The ``python`` engine (``PythonEngine`` is the same class): llama.cpp as llama-cpp-python built it.
    """

    name = "python"
    loads_candidates_together = True  # run_paired loads every candidate in one worker
    stops_early = True  # run() takes a StopRule

    def __init__(
        self,
        *,
        timeout_s: float = 300.0,
        memory_limit: int | None = None,
        python: str | None = None,
        env: dict[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        reuse_model: bool = True,
    ) -> None:
        self.timeout_s = timeout_s
        self.memory_limit = memory_limit
        self.python = python or sys.executable
        self.env = dict(env) if env is not None else dict(os.environ)
        self.reuse_model = reuse_model
        self._tmp = tempfile.TemporaryDirectory(prefix="offload-tuner-") if log_dir is None else None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._proc: subprocess.Popen | None = None
        self._log_path: Path | None = None
        self._model_key: Any = None
        self._model_log = ""
        self._count = 0
        self._build: dict[str, Any] | None = None
        # told how a long model load goes: {"load": share, "bytes", "total", "seconds"} (the tuner sets it)
        self.on_load: Callable[[dict[str, Any]], None] | None = None

    # -- what this llama.cpp is -------------------------------------------------------------------

    def _probe(self) -> dict[str, Any]:
        if self._build is None:
            self._build = read_build(self.python, env=self.env)
        return self._build

    def build(self) -> EngineBuild:
        data = self._probe()
        return EngineBuild(
            engine=self.name, build_number=data.get("build_number"), commit=data.get("commit"),
            version=data.get("version"), backends=tuple(data.get("backends", ())), path=data.get("path"),
            detail=f"llama-cpp-python {data['llama_cpp_python']}" if data.get("llama_cpp_python") else None,
            error=data.get("error"),
        )

    def devices(self, rpc_servers: Sequence[str] = ()) -> list[DeviceInfo]:
        """llama.cpp's devices through ``ggml_backend_dev_*`` in a child process; each RPC server is
        asked in a child of its own, so one that does not answer is named, not fatal."""
        from ..errors import RPCError
        from .rpc import query_devices

        out = [DeviceInfo.from_dict(d) for d in self._probe().get("devices", [])]
        for i, entry in enumerate(query_devices(tuple(rpc_servers)) if rpc_servers else []):
            if "error" in entry:
                raise RPCError(f"RPC server {entry['endpoint']}: {entry['error']}; start it with `offload-tuner rpc-serve`",
                               reason=entry["error"])
            out.append(DeviceInfo(name=entry["name"], description=entry.get("description", entry["endpoint"]), type="gpu",
                                  memory_free=int(entry["memory_free"]), memory_total=int(entry["memory_total"]),
                                  # ggml numbers RPC devices across servers, in the order --rpc registers them
                                  backend="RPC", ggml_name=f"RPC{i}", rpc_endpoint=entry["endpoint"]))
        return out

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> "TrialRunner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._retire(graceful=True)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def _start(self) -> None:
        self._count += 1
        self._log_path = self.log_dir / f"worker-{os.getpid()}-{self._count}.log"
        env = project_pythonpath(dict(self.env))
        env["PYTHONUNBUFFERED"] = "1"
        env[ENV_PARENT_PID] = str(os.getpid())  # the worker ends itself when this process is gone
        if self.memory_limit:
            env["OFFLOAD_TUNER_WORKER_MEMORY_LIMIT"] = str(int(self.memory_limit))
        with open(self._log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [self.python, "-m", "tuner.engine.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
                start_new_session=True,  # its own process group: killpg reaches every thread and child
            )
        self._model_key = None
        self._model_log = ""

    def _retire(self, graceful: bool = False) -> None:
        proc, self._proc = self._proc, None
        self._model_key = None
        if proc is None:
            return
        if graceful and proc.poll() is None:
            try:
                proc.stdin.write(b'{"op": "exit"}\n')
                proc.stdin.flush()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        kill_group(proc)
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    # -- one trial ---------------------------------------------------------------------------

    @property
    def worker_pid(self) -> int | None:
        """The live worker's pid (its process group id too), or None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def pre_check(self, settings: Settings, bench: BenchSpec) -> str | None:
        """Why the trial must not launch, or None."""
        path = Path(settings.model_path)
        if not path.is_file():
            return f"model file not found: {settings.model_path}"
        need = bench.depth + max(bench.n_prompt, bench.n_gen)
        if settings.n_ctx and need > settings.n_ctx:
            return f"n_ctx {settings.n_ctx} is smaller than depth {bench.depth} + {max(bench.n_prompt, bench.n_gen)} test tokens"
        if bench.users > 1 and settings.n_parallel < bench.users:
            return f"{bench.users} users need n_parallel {bench.users} or more, got {settings.n_parallel}"
        return None

    def run(self, settings: Settings, bench: BenchSpec = BenchSpec(), *, trial_id: Any = None,
            stop: StopRule | None = None) -> TrialResult:
        """One trial; ``stop``: when it may end before ``bench.repetitions`` (the worker applies it)."""
        started = time.perf_counter()
        rejected = self.pre_check(settings, bench)
        if rejected:
            c = classify(rejected=rejected)
            return TrialResult(c.outcome, c.message, settings, bench, wall_s=time.perf_counter() - started)

        key = settings.model_key
        if self._proc is not None and (not self.reuse_model or key != self._model_key or self._proc.poll() is not None):
            self._retire(graceful=True)
        request = {
            "trial_id": trial_id if trial_id is not None else self._count,
            "settings": _wire(settings),
            "bench": bench.to_dict(),
        }
        if stop is not None:
            request["stop"] = stop.to_dict()
        x = self._exchange(request, started + self.timeout_s)
        if x.reply is not None and not x.reply.get("reused_model"):
            # keep this load's model lines for later trials that reuse the model
            self._model_log = x.segment.split(CONTEXT_MARK, 1)[0] if CONTEXT_MARK in x.segment else x.segment
        full_log = x.segment if x.reply is None or not x.reply.get("reused_model") else self._model_log + x.segment
        report = parse_log(full_log)
        c = self._classify(x, report)
        if c.outcome is Outcome.OK:
            self._model_key = key
        reply = x.reply or {}
        return TrialResult(
            outcome=c.outcome,
            message=c.message,
            settings=settings,
            bench=bench,
            pp=Stats.of(reply.get("pp_samples", [])),
            tg=Stats.of(reply.get("tg_samples", [])),
            load=report,
            log=full_log,
            peak_rss=max(x.sampler.peak_rss, reply.get("peak_rss") or 0) or None,
            peak_vram=dict(x.sampler.peak_vram),
            signal=c.signal_name,
            returncode=x.returncode,
            wall_s=time.perf_counter() - started,
            load_s=float(reply.get("load_s", 0.0)),
            reused_model=bool(reply.get("reused_model", False)),
        )

    def run_paired(self, candidates: list[Settings], bench: BenchSpec = BenchSpec(), *, rounds: int = 5) -> list[TrialResult]:
        """Measure candidates side by side in one worker: all loaded at once, then ``rounds``
        rounds of ``bench.repetitions`` each, in rotating order (see ``tuner.engine.worker.paired``).

        Every candidate must fit in memory together with the others. Each result carries that
        candidate's samples; the outcome and log are shared (one process ran them all)."""
        started = time.perf_counter()
        for s in candidates:
            rejected = self.pre_check(s, bench)
            if rejected:
                c = classify(rejected=rejected)
                return [TrialResult(c.outcome, c.message, x, bench) for x in candidates]
        self._retire(graceful=True)  # the paired run loads its own models
        request = {"op": "paired", "candidates": [_wire(s) for s in candidates], "bench": bench.to_dict(), "rounds": rounds}
        x = self._exchange(request, started + self.timeout_s * max(1, len(candidates)))
        report = parse_log(x.segment)
        c = self._classify(x, report)
        self._model_key = None  # the worker freed what it loaded
        reply = x.reply or {}
        pp = reply.get("pp_samples") or [[] for _ in candidates]
        tg = reply.get("tg_samples") or [[] for _ in candidates]
        return [
            TrialResult(outcome=c.outcome, message=c.message, settings=s, bench=bench, pp=Stats.of(pp[i]), tg=Stats.of(tg[i]),
                        load=report, log=x.segment, peak_rss=max(x.sampler.peak_rss, reply.get("peak_rss") or 0) or None,
                        peak_vram=dict(x.sampler.peak_vram), signal=c.signal_name, returncode=x.returncode,
                        wall_s=time.perf_counter() - started)
            for i, s in enumerate(candidates)
        ]

    def score_corpus(self, settings: Settings, job: "ScoringJob", *,
                     on_progress: Callable[[dict[str, Any]], None] | None = None) -> "ScoringResult":
        """One pass over a text for quality (``tuner.engine.scoring``): the reference's compact
        distributions, or another model's KL against them, written to ``job.out``.

        The model is loaded (or reused) as ``settings`` say; the context is ``job.n_ctx`` tokens.
        The time limit is ``timeout_s`` without progress: each scored chunk resets it."""
        from .scoring import ScoringResult

        started = time.perf_counter()
        if not Path(settings.model_path).is_file():
            c = classify(rejected=f"model file not found: {settings.model_path}")
            return ScoringResult(c.outcome, c.message, job)
        if self._proc is not None and (not self.reuse_model or settings.model_key != self._model_key or self._proc.poll() is not None):
            self._retire(graceful=True)
        request = {"op": "score", "settings": _wire(settings), "job": job.to_dict()}
        x = self._exchange(request, started + self.timeout_s, on_progress=on_progress)
        report = parse_log(x.segment)
        c = self._classify(x, report)
        reply = x.reply or {}
        self._model_key = settings.model_key if c.outcome is Outcome.OK or (reply and c.outcome is Outcome.BAD_SETTINGS) else None
        return ScoringResult(
            outcome=c.outcome, message=c.message, job=job, corpus_tokens=reply.get("corpus_tokens"),
            tokens_needed=reply.get("tokens_needed"), rows=int(reply.get("rows") or 0), n_vocab=reply.get("n_vocab"),
            bytes=int(reply.get("bytes") or 0), seconds=float(reply.get("seconds") or time.perf_counter() - started),
            mean_entries=reply.get("mean_entries"), log=x.segment,
        )

    def _exchange(self, request: dict[str, Any], deadline: float,
                  on_progress: Callable[[dict[str, Any]], None] | None = None) -> "_Exchange":
        """Send one request to the worker (started if needed) and wait for its reply or its end."""
        if self._proc is None:
            self._start()
        proc = self._proc
        assert proc is not None and self._log_path is not None
        offset = self._log_path.stat().st_size
        sampler = _Sampler(proc.pid)
        sampler.start()
        reply: dict[str, Any] | None = None
        timed_out = False
        # the worker enforces the limit too, a little later: if this process is stuck or gone
        request = {**request, "timeout_s": max(1.0, deadline - time.perf_counter()) + WORKER_GRACE_S}
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            reply, timed_out = self._await_reply(proc, deadline, on_progress)
        except BrokenPipeError:
            reply = None
        except BaseException:
            # Ctrl-C (or anything else) in the caller: never leave a worker behind.
            sampler.stop()
            self._retire()
            raise
        finally:
            sampler.stop()
        if timed_out:
            kill_group(proc)
        returncode = None
        if reply is None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                kill_group(proc)
            returncode = proc.returncode
        return _Exchange(reply, timed_out, returncode, self._read_log(offset), sampler)

    def _classify(self, x: "_Exchange", report: LoadReport) -> Classification:
        c = classify(timed_out=x.timed_out, timeout_s=self.timeout_s, reply=x.reply, returncode=x.returncode,
                     oom_in_log=report.oom, error_lines=tuple(report.errors))
        if c.outcome not in (Outcome.OK, Outcome.BAD_SETTINGS):
            self._retire()  # a failed worker is never reused
        return c

    def _await_reply(self, proc: subprocess.Popen, deadline: float,
                     on_progress: Callable[[dict[str, Any]], None] | None = None) -> tuple[dict[str, Any] | None, bool]:
        """The worker's reply. Lines ``{"progress": ...}`` before it (long passes send them) go to
        ``on_progress`` and move the deadline: the limit is then on time without progress."""
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        buffer = b""
        try:
            while True:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return None, True
                if not sel.select(timeout=min(remaining, 0.5)):
                    if proc.poll() is not None:
                        return None, False
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    return None, False
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    try:
                        message = json.loads(line)
                    except ValueError:
                        return {"status": "error", "message": f"unreadable reply: {line[:200]!r}"}, False
                    if isinstance(message, dict) and "progress" in message and "status" not in message:
                        deadline = time.perf_counter() + self.timeout_s
                        progress = message["progress"]
                        if isinstance(progress, dict) and "load" in progress:
                            # a long model load: bytes read of the file's size (worker._load_progress)
                            if self.on_load is not None:
                                self.on_load(progress)
                        elif on_progress is not None:
                            on_progress(progress)
                        continue
                    return message, False
        finally:
            sel.close()

    def _read_log(self, offset: int) -> str:
        assert self._log_path is not None
        try:
            with open(self._log_path, "rb") as handle:
                handle.seek(offset)
                return handle.read().decode("utf-8", errors="replace")
        except OSError:
            return ""


@dataclass
class _Exchange:
    reply: dict[str, Any] | None
    timed_out: bool
    returncode: int | None
    segment: str
    sampler: _Sampler


def _wire(settings: Settings) -> dict[str, Any]:
    """Settings as the worker reads them (``Settings.from_dict`` there)."""
    return settings.to_dict()


def run_trial(settings: Settings, bench: BenchSpec = BenchSpec(), **runner_kwargs: Any) -> TrialResult:
    """One trial in a fresh worker."""
    with TrialRunner(**runner_kwargs) as runner:
        return runner.run(settings, bench)


PythonEngine = TrialRunner


# What llama-cpp-python's llama.cpp is and which devices it sees, read in a child process (only
# workers import llama_cpp in the tuner).
_BUILD_SCRIPT = r"""
import json, sys
out = {}
try:
    import llama_cpp
    import ctypes, os, glob, sysconfig
    out["llama_cpp_python"] = getattr(llama_cpp, "__version__", None)
    out["path"] = os.path.dirname(llama_cpp.__file__)
    out["gpu_offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    out["rpc"] = bool(llama_cpp.llama_supports_rpc())
    info = llama_cpp.llama_print_system_info()
    out["system_info"] = info.decode(errors="replace") if isinstance(info, bytes) else str(info)
    backends = []
    libdir = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    for path in sorted(glob.glob(os.path.join(libdir, "libggml-*.so*")) + glob.glob(os.path.join(libdir, "ggml-*.dll")) + glob.glob(os.path.join(libdir, "libggml-*.dylib"))):
        name = os.path.basename(path).split(".")[0].replace("libggml-", "").replace("ggml-", "")
        if name not in ("base",) and name not in backends:
            backends.append(name)
    out["backends"] = backends
    # llama.cpp's own version (llama_version(), 2026) and, where llama.cpp's common library was
    # installed beside it, the commit and build number it was compiled from.
    # the library names of this platform (libllama.so on Linux, libllama.dylib on macOS, llama.dll)
    names = {"linux": ("lib{}.so",), "darwin": ("lib{}.dylib", "lib{}.0.dylib"), "win32": ("{}.dll",)}.get(sys.platform, ("lib{}.so",))
    for name in names:
        try:
            lib = ctypes.CDLL(os.path.join(libdir, name.format("llama")))
            lib.llama_version.restype = ctypes.c_char_p
            out["version"] = lib.llama_version().decode()
            break
        except (OSError, AttributeError):
            continue
    commons = [os.path.join(d, n.format("llama-common")) for n in names
               for d in (libdir, os.path.join(sysconfig.get_paths()["purelib"], "lib"))]
    for common in commons:
        if os.path.exists(common):
            try:
                c = ctypes.CDLL(common)
                out["commit"] = ctypes.c_char_p.in_dll(c, "LLAMA_COMMIT").value.decode()
                out["build_number"] = ctypes.c_int.in_dll(c, "LLAMA_BUILD_NUMBER").value
            except (OSError, ValueError, AttributeError):
                pass
            break
    sys.path.insert(0, sys.argv[1])
    from tuner.engine.ggml import list_devices
    out["devices"] = list_devices()
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def read_build(python: str | None = None, timeout: float = 60.0, env: dict[str, str] | None = None) -> dict[str, Any]:
    """llama-cpp-python's llama.cpp, read in a child process: ``llama_cpp_python`` (version), ``version``,
    ``build_number``, ``commit``, ``backends``, ``gpu_offload``, ``rpc``, ``system_info``, ``path``,
    ``devices`` (``tuner.engine.ggml.list_devices``), or ``error`` saying why it could not be read."""
    root = str(Path(__file__).resolve().parent.parent.parent)
    try:
        proc = subprocess.run([python or sys.executable, "-c", _BUILD_SCRIPT, root], capture_output=True, text=True,
                              timeout=timeout, env=env)
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"error": f"could not read the llama.cpp build: {exc}"}
    if not isinstance(data, dict):
        return {"error": "could not read the llama.cpp build: unexpected output"}
    return data


__all__ = ["TrialRunner", "PythonEngine", "run_trial", "read_build"]
