"""The ``llama-cpp`` engine: the user's own llama.cpp binaries, the build they deploy.

    with LlamaCppEngine("/opt/llama.cpp/build/bin") as engine:      # or None: llama-bench on PATH
        engine.build()          # from the binaries' --version (or llama-bench's own JSON)
        engine.devices()        # from --list-devices: CUDA0, ROCm0, Vulkan0, MTL0, RPC0[host:port]
        engine.run(settings, BenchSpec(n_prompt=512, n_gen=128))

What each part comes from:

- **speed**: ``llama-bench -o json``, every sample (``samples_ts``); one row for pp, one for tg, at the
  bench's depth (``-d``). The settings become llama-bench flags through ``Settings.cli_args``, the one
  place that spells flags.
- **what happened at load**: llama-bench's own log (``-v`` keeps llama.cpp's log on stderr; without
  it llama-bench installs a null log callback), parsed with the same ``parse_log`` as every log.
- **the outcome**: ``tuner.engine.outcome.classify``, from the exit status, llama-bench's error lines
  and the log's out-of-memory markers, as for the python engine.
- **memory at the real context**: llama-bench sizes its context from ``-p``/``-n``/``-d``, not
  ``-c``, so a trial allocates less KV cache than the profile's ``n_ctx`` needs. Where the folder has
  ``llama-fit-params``, each candidate is first checked with llama.cpp's own projection at ``n_ctx``
  (``--fit-print on``, which sizes every buffer without allocating) against each device's free
  memory; one that does not fit is an ``oom`` outcome, as a real allocation would have been.
- **llama.cpp's fitter** (``llama-fit-params``): ``fit()`` returns the layers, split and tensor
  placement it chooses, which the study measures as one more candidate.

The model is not kept loaded between trials: llama-bench loads it for each invocation (the study asks
one candidate at a time, and llama-server fixes the context at start, so a context-only change would
restart it anyway); ``benchmarks/engines.py`` measures what that costs.

Bad input gets one line: a ``--llama-bin`` folder without llama-bench, a binary that does not start,
a binary too old for a flag a candidate needs (``bad_settings``, naming the flag and the setting).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import EngineError, RPCError
from .base import BenchSpec, Engine, EngineBuild, FitAnswer, Stats, TrialResult
from .devices import DeviceInfo, parse_list_devices
from .logparse import parse_log
from .outcome import Outcome, classify
from .process import MemorySampler, kill_group
from .settings import Settings

MiB = 1 << 20
# The binaries the engine uses, most needed first. llama-bench measures; the others answer
# --version and --list-devices, parse exported flags (common/arg.cpp), and fit.
TOOLS = ("llama-bench", "llama-fit-params", "llama-server", "llama-cli", "llama-batched-bench")
# Tools whose arguments go through common/arg.cpp's parser (the one llama-server and llama-cli use).
COMMON_PARSERS = ("llama-server", "llama-cli", "llama-fit-params")

# The benchmark's own flags (the settings' flags come from tuner.engine.dimensions).
_BENCH_SHAPE_FLAGS = {"-d": "the benchmark depth (--depth)", "--no-warmup": "the warm-up turned off"}

# common/build-info.cpp llama_print_build_info: "version: %s (build %d, commit %s)" (2026);
# before: "version: %d (%s)" with the build number and commit.
_VERSION_NEW = re.compile(r"version: (?P<version>\S+) \(build (?P<number>\d+), commit (?P<commit>[0-9a-fA-F]+|unknown)\)")
_VERSION_OLD = re.compile(r"version: (?P<number>\d+) \((?P<commit>[0-9a-fA-F]+|unknown)\)")
_BUILT_WITH = re.compile(r"built with (?P<compiler>.+) for (?P<target>.+?)\s*$", re.MULTILINE)
# tools/llama-bench parse_cmd_params: fprintf(stderr, "error: invalid parameter for argument: %s\n", ...)
_BENCH_BAD_ARG = re.compile(r"error: invalid parameter for argument: (?P<arg>\S+)")
# tools/llama-bench main loop: "%s: error: failed to load model '%s'", "failed to create context with
# model '%s'", "failed to run prompt warmup" / "failed to run gen" / "failed to decode ... res = %d".
_BENCH_LOAD = re.compile(r"error: failed to load model")
_BENCH_CONTEXT = re.compile(r"error: failed to create context|failed to (?:run (?:prompt|gen|depth)|decode)")
# llama_perf_context_print: "%s:        load time = %10.2f ms\n" (2024-2026)
_LOAD_TIME = re.compile(r"load time =\s+(?P<ms>[\d.]+) ms")
# tools/fit-params: printf("%s ", dev name) then model, context, compute in MiB; "Host" last.
_FIT_PRINT = re.compile(r"^(?P<name>\S+) (?P<model>\d+) (?P<context>\d+) (?P<compute>\d+)\s*$")


def _exe(name: str) -> str:
    return name + ".exe" if sys.platform == "win32" else name


@dataclass(frozen=True)
class Binaries:
    """The llama.cpp tools found, by name; ``folder`` is llama-bench's."""

    folder: Path
    tools: dict[str, Path] = field(default_factory=dict)

    def get(self, tool: str) -> Path | None:
        return self.tools.get(tool)

    @property
    def bench(self) -> Path:
        return self.tools["llama-bench"]


def find_binaries(llama_bin: str | os.PathLike[str] | None = None) -> Binaries:
    """The user's llama.cpp tools: in ``llama_bin`` when given (a folder), else llama-bench on PATH and
    the other tools beside it (or on PATH). Raises ``EngineError`` naming what is missing."""
    if llama_bin is not None:
        folder = Path(llama_bin).expanduser()
        if not folder.exists():
            raise EngineError(f"--llama-bin {folder}: no such folder")
        if not folder.is_dir():
            raise EngineError(f"--llama-bin {folder}: not a folder; give the folder that holds llama-bench "
                              "(e.g. llama.cpp/build/bin)")
        tools = {t: folder / _exe(t) for t in TOOLS if (folder / _exe(t)).is_file() and os.access(folder / _exe(t), os.X_OK)}
        if "llama-bench" not in tools:
            present = sorted(p.name for p in folder.iterdir() if p.name.startswith("llama-"))[:8]
            found = f" (it has: {', '.join(present)})" if present else " (it has no llama.cpp tools)"
            raise EngineError(f"--llama-bin {folder}: no executable llama-bench there{found}; the llama-cpp engine "
                              "measures with llama-bench: build it (cmake --build build --target llama-bench) or "
                              "point --llama-bin at the folder that has it")
        return Binaries(folder.resolve(), tools)
    bench = shutil.which("llama-bench")
    if bench is None:
        raise EngineError("the llama-cpp engine needs llama.cpp's llama-bench, and it is not on PATH: pass "
                          "--llama-bin DIR (the folder with llama-bench, llama-server...), or use --engine python")
    folder = Path(bench).resolve().parent
    tools: dict[str, Path] = {"llama-bench": Path(bench)}
    for tool in TOOLS[1:]:
        beside = folder / _exe(tool)
        found = beside if beside.is_file() else (Path(p) if (p := shutil.which(tool)) else None)
        if found is not None:
            tools[tool] = found
    return Binaries(folder, tools)


def parse_version(text: str) -> dict[str, Any]:
    """``--version`` output -> ``{build_number, commit, version, detail}`` (what it says, nothing more)."""
    out: dict[str, Any] = {}
    m = _VERSION_NEW.search(text)
    if m:
        out.update(version=m["version"], build_number=int(m["number"]), commit=m["commit"])
    else:
        m = _VERSION_OLD.search(text)
        if m:
            out.update(build_number=int(m["number"]), commit=m["commit"])
    if out.get("commit") == "unknown":
        out["commit"] = None
    m = _BUILT_WITH.search(text)
    if m:
        out["detail"] = f"built with {m['compiler']} for {m['target']}"
    return out


def clean_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the user's binaries: LLAMA_ARG_* variables would change what a trial runs
    (common/arg.cpp reads them for every flag left unset), so none reach a trial."""
    base = dict(os.environ if env is None else env)
    return {k: v for k, v in base.items() if not k.startswith("LLAMA_ARG_")}


class LlamaCppEngine(Engine):
    """Trials with the user's llama.cpp binaries (llama-bench), each in its own process group."""

    name = "llama-cpp"
    loads_candidates_together = False  # run_paired runs one llama-bench per candidate, in rotating rounds

    def __init__(
        self,
        llama_bin: str | os.PathLike[str] | None = None,
        *,
        timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        check_context_memory: bool = True,
    ) -> None:
        self.binaries = find_binaries(llama_bin)
        self.timeout_s = timeout_s
        self.env = clean_env(env)
        self.check_context_memory = check_context_memory
        self._tmp = tempfile.TemporaryDirectory(prefix="offload-tuner-llama-") if log_dir is None else None
        self.log_dir = Path(log_dir) if log_dir is not None else Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._help: dict[str, str] = {}
        self._version: dict[str, Any] | None = None
        self._bench_build: dict[str, Any] = {}
        self._devices: dict[tuple[str, ...], list[DeviceInfo]] = {}
        self._live: set[subprocess.Popen] = set()
        self._count = 0

    # -- lifecycle ----------------------------------------------------------------------------------

    def close(self) -> None:
        for proc in list(self._live):
            kill_group(proc)
        self._live.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- what this llama.cpp is ---------------------------------------------------------------------

    def _run_tool(self, tool: Path, args: Sequence[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
        """A quick, non-measuring call (--version, --list-devices, --help, a fit): one clear line when
        the binary does not start or dies."""
        try:
            proc = subprocess.run([str(tool), *args], capture_output=True, text=True, errors="replace",
                                  env=self.env, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise EngineError(f"{tool} {' '.join(args)} did not finish within {timeout:g} s") from None
        except OSError as exc:
            raise EngineError(f"{tool} cannot be started: {exc.strerror or exc}") from None
        if proc.returncode < 0:
            from .outcome import signal_name

            raise EngineError(f"{tool} {' '.join(args)} crashed: killed by {signal_name(proc.returncode)}"
                              + _tail(proc.stderr))
        return proc

    def _version_info(self) -> dict[str, Any]:
        if self._version is None:
            info: dict[str, Any] = {}
            for tool in ("llama-bench", *COMMON_PARSERS):
                path = self.binaries.get(tool)
                if path is None:
                    continue
                proc = self._run_tool(path, ["--version"])
                info = parse_version(proc.stdout + "\n" + proc.stderr)
                if info.get("build_number") is not None or info.get("commit"):
                    info["tool"] = tool
                    break
            self._version = info
        return self._version

    def build(self) -> EngineBuild:
        info = dict(self._version_info())
        # An older llama-bench has no --version: its JSON rows carry build_number and build_commit.
        for key in ("build_number", "commit"):
            if info.get(key) is None and self._bench_build.get(key) is not None:
                info[key] = self._bench_build[key]
        backends = ["CPU"]
        for d in self._devices.get((), []):
            if d.backend and d.backend not in backends and d.type != "cpu":
                backends.append(d.backend)
        for b in self._bench_build.get("backends", ()):
            if b not in backends:
                backends.append(b)
        error = None
        if info.get("build_number") is None and not info.get("commit"):
            error = ("these binaries did not say their build (no --version); it is read from llama-bench's "
                     "first benchmark")
        return EngineBuild(engine=self.name, build_number=info.get("build_number"), commit=info.get("commit"),
                           version=info.get("version"), backends=tuple(backends), path=str(self.binaries.folder),
                           detail=info.get("detail"), error=error)

    def devices(self, rpc_servers: Sequence[str] = ()) -> list[DeviceInfo]:
        """``--list-devices`` (with ``--rpc`` for the servers), the CPU added from this machine."""
        key = tuple(rpc_servers)
        if key in self._devices:
            return list(self._devices[key])
        rpc = ["--rpc", ",".join(rpc_servers)] if rpc_servers else []
        last = ""
        from .recorded import recorded_machine

        recorded = recorded_machine()  # a test seam: a recorded machine's --list-devices output
        for tool in (*COMMON_PARSERS, "llama-bench"):
            path = self.binaries.get(tool)
            if path is None:
                continue
            if recorded is not None:
                text = recorded.list_devices_text() or ""
                if not rpc_servers:  # RPC servers are listed only when --rpc names them
                    text = "\n".join(line for line in text.splitlines() if not re.match(r"\s+RPC", line))
                proc = subprocess.CompletedProcess([], 0, text, "")
            else:
                proc = self._run_tool(path, [*rpc, "--list-devices"])
            text = proc.stdout + "\n" + proc.stderr
            if proc.returncode == 0 and "Available devices:" in text:
                found = [d for d in parse_list_devices(text) if d.type != "cpu"]
                if rpc_servers:
                    missing = [ep for ep in rpc_servers if not any(d.rpc_endpoint == ep for d in found)]
                    if missing:
                        raise RPCError(f"RPC server {missing[0]}: {Path(path).name} lists no device for it; start it "
                                       "with `offload-tuner rpc-serve`", reason=f"{Path(path).name} lists no device for it")
                devices = [_cpu_device()] + found
                self._devices[key] = devices
                return list(devices)
            last = f"{Path(path).name}: " + (_first_error(text) or f"exit code {proc.returncode}")
            if proc.returncode == 127 or "shared librar" in text:
                raise EngineError(f"{path} cannot start: {_first_error(text) or 'exit code 127'}")
        if rpc_servers and re.search(r"RPC|connect|handshake", last, re.IGNORECASE):
            raise RPCError(f"RPC server {','.join(rpc_servers)}: {last}; start it with `offload-tuner rpc-serve`", reason=last)
        raise EngineError(f"the llama.cpp binaries in {self.binaries.folder} cannot list their devices "
                          f"(--list-devices, llama.cpp 2024-11 or newer): {last or 'no tool answered'}")

    def _help_text(self, tool: str) -> str:
        if tool not in self._help:
            path = self.binaries.get(tool)
            if path is None:
                return ""
            proc = self._run_tool(path, ["--help"])
            self._help[tool] = proc.stdout + "\n" + proc.stderr
        return self._help[tool]

    def unknown_flags(self, tool: str, args: Sequence[str]) -> list[str]:
        """Flags in ``args`` that ``tool``'s --help does not list (a build too old for them)."""
        text = self._help_text(tool)
        if not text:
            return []
        known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))
        return [a for a in args if a.startswith("-") and not re.fullmatch(r"-\d.*", a) and a not in known]

    # -- one trial ------------------------------------------------------------------------------------

    def supported_settings(self) -> frozenset[str]:
        """The settings this llama-bench can set: those whose flag its --help lists (from the
        dimension table's llama-bench spellings), and the ones handled without a flag (the model, the
        context: sized by llama.cpp's projection, the batch thread count: llama-bench's -t sets both).
        ``swa_full`` and ``kv_unified`` are not among them: llama-bench has no option for them."""
        from .dimensions import DIMENSIONS, Export

        known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", self._help_text("llama-bench")))
        out = {"model_path", "n_ctx", "n_threads_batch"}
        for dim in DIMENSIONS:
            writer = dim.flags.get("llama-bench")
            if writer is None:
                continue
            probe = _non_default(dim)
            words = writer(probe, Export(tool="llama-bench")) if probe is not None else []
            flags = [w for w in words if w.startswith("-") and not re.fullmatch(r"-\d.*", w)]
            if all(f in known for f in flags):
                out.add(dim.name)
        # a setting another one's flag carries (use_mlock in -lm)
        out |= {dim.name for dim in DIMENSIONS if dim.spelled_by and dim.spelled_by in out}
        if self.binaries.get("llama-batched-bench") is not None:
            # several users are measured with llama-batched-bench, which takes -kvu (and sizes n_seq_max)
            out |= {"kv_unified", "n_parallel"}
        return frozenset(out)

    def bench_args(self, settings: Settings, bench: BenchSpec) -> list[str]:
        """llama-bench's argv (without the program) for one trial: the settings' flags from
        ``Settings.cli_args`` (the one place flags are spelled), then the bench's shape."""
        args = settings.cli_args("llama-bench")
        args += ["-p", str(bench.n_prompt), "-n", str(bench.n_gen), "-r", str(bench.repetitions)]
        if bench.depth:
            args += ["-d", str(bench.depth)]
        if not bench.warmup:
            args.append("--no-warmup")
        return args

    def pre_check(self, settings: Settings, bench: BenchSpec) -> str | None:
        """Why the trial must not launch, or None."""
        if not Path(settings.model_path).is_file():
            return f"model file not found: {settings.model_path}"
        need = bench.depth + max(bench.n_prompt, bench.n_gen)
        if settings.n_ctx and need > settings.n_ctx:
            return f"n_ctx {settings.n_ctx} is smaller than depth {bench.depth} + {max(bench.n_prompt, bench.n_gen)} test tokens"
        if settings.n_threads_batch is not None and settings.n_threads_batch != settings.n_threads:
            return (f"llama-bench runs prompt and generation with one thread count (-t): n_threads_batch "
                    f"{settings.n_threads_batch} differs from n_threads {settings.n_threads}; use the python engine for that")
        from .dimensions import DIMENSIONS

        for dim in DIMENSIONS:
            # a setting llama-bench has no option for runs at llama-bench's own value: only that one
            # can be measured (the context and the batch thread count are handled above)
            why = dim.no_flag.get("llama-bench")
            if why and dim.name not in ("n_ctx", "n_threads_batch") and getattr(settings, dim.name) != dim.default:
                return f"{dim.name} {getattr(settings, dim.name)!r} cannot be measured with llama-bench: {why}"
        return None

    # -- several users: llama-batched-bench ------------------------------------------------------------

    def batched_args(self, settings: Settings, bench: BenchSpec) -> list[str]:
        """llama-batched-bench's argv for ``bench.users`` sequences: the settings' llama-server flags
        (common/arg.cpp parses both; -np is the one it does not take: -npl sizes n_seq_max), and one
        -npl row per repetition plus a first one that warms up (its own warm-up is 16 tokens)."""
        args = _drop_flags(settings.cli_args("llama-server"), {"-np"})
        rows = ",".join([str(bench.users)] * (bench.repetitions + (1 if bench.warmup else 0)))
        return [*args, "-npp", str(bench.n_prompt), "-ntg", str(bench.n_gen), "-npl", rows, "--output-format", "jsonl"]

    def _batched_pre_check(self, settings: Settings, bench: BenchSpec) -> str | None:
        if self.binaries.get("llama-batched-bench") is None:
            return (f"{bench.users} users are measured with llama-batched-bench, and {self.binaries.folder} has none: "
                    "build it (cmake --build build --target llama-batched-bench) or use --engine python")
        if not Path(settings.model_path).is_file():
            return f"model file not found: {settings.model_path}"
        if bench.depth:
            return "llama-batched-bench has no depth (-d): measure several users at a depth with --engine python"
        if settings.n_parallel != bench.users:
            return f"n_parallel {settings.n_parallel} differs from the {bench.users} users measured"
        need = bench.users * (bench.n_prompt + bench.n_gen)
        if settings.n_ctx and need > settings.n_ctx:
            return f"n_ctx {settings.n_ctx} is smaller than {bench.users} users x {bench.n_prompt + bench.n_gen} tokens"
        return None

    def _run_batched(self, settings: Settings, bench: BenchSpec, started: float) -> TrialResult:
        rejected = self._batched_pre_check(settings, bench)
        if rejected is not None:
            c = classify(rejected=rejected)
            return TrialResult(c.outcome, c.message, settings, bench, wall_s=time.perf_counter() - started)
        tool = self.binaries.get("llama-batched-bench")
        assert tool is not None
        # -v: without it the tool prints no llama.cpp log with --output-format jsonl
        x = self._invoke(self.batched_args(settings, bench), self.timeout_s, tool=tool, json_flags=("-v",))
        report = parse_log(x.log)
        rows = []
        for line in x.stdout.splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("speed_pp"), (int, float)) and isinstance(row.get("speed_tg"), (int, float)):
                    rows.append(row)
        if bench.warmup:
            rows = rows[1:]
        reply: dict[str, Any] | None = None
        if x.returncode == 0:
            # a row whose context did not fit is skipped without a word (n_ctx_req > n_kv_max): no row is an error
            reply = {"status": "ok"} if rows else {"status": "error", "message": "llama-batched-bench printed no result row"}
        elif not x.timed_out and x.returncode is not None and x.returncode > 0:
            reply = _failure_reply(x.log)
        c = classify(timed_out=x.timed_out, timeout_s=self.timeout_s, reply=reply, returncode=x.returncode,
                     oom_in_log=report.oom, error_lines=tuple(report.errors) or _error_lines(x.log),
                     process="llama-batched-bench")
        ok = c.outcome is Outcome.OK
        pp = [float(r["speed_pp"]) for r in rows if bench.n_prompt and r["speed_pp"] > 0]
        tg = [float(r["speed_tg"]) for r in rows if bench.n_gen and r["speed_tg"] > 0]
        return TrialResult(outcome=c.outcome, message=c.message, settings=settings, bench=bench,
                           pp=Stats.of(pp) if ok else None, tg=Stats.of(tg) if ok else None, load=report, log=x.log,
                           peak_rss=x.peak_rss or None, peak_vram=x.peak_vram, signal=c.signal_name,
                           returncode=x.returncode, wall_s=time.perf_counter() - started)

    def run(self, settings: Settings, bench: BenchSpec = BenchSpec(), *, trial_id: Any = None) -> TrialResult:
        started = time.perf_counter()
        if bench.as_served:
            return self._run_batched(settings, bench, started)
        rejected = self.pre_check(settings, bench)
        args = self.bench_args(settings, bench)
        if rejected is None:
            unknown = self.unknown_flags("llama-bench", [*args, "-o", "-v"])
            if unknown:
                flag = unknown[0]
                rejected = (f"llama-bench in {self.binaries.folder} ({self.build().describe()}) does not know {flag} "
                            f"({_setting_of_flag(settings, flag)}): it is too old for it; upgrade llama.cpp, "
                            "or leave that setting at llama.cpp's default")
        if rejected is None and self.check_context_memory:
            rejected_oom = self._context_memory_check(settings)
            if rejected_oom is not None:
                c = classify(oom_in_log=True, error_lines=(rejected_oom,))
                return TrialResult(c.outcome, c.message, settings, bench, wall_s=time.perf_counter() - started)
        if rejected is not None:
            c = classify(rejected=rejected)
            return TrialResult(c.outcome, c.message, settings, bench, wall_s=time.perf_counter() - started)
        x = self._invoke(args, self.timeout_s)
        return self._result(x, settings, bench, started)

    def run_paired(self, candidates: list[Settings], bench: BenchSpec = BenchSpec(), *, rounds: int = 5) -> list[TrialResult]:
        """Candidates side by side: ``rounds`` rounds in rotating order, one llama-bench run of
        ``bench.repetitions`` each per round (llama-bench loads one model configuration at a time, so
        "side by side" is interleaving within seconds, not loading all at once)."""
        samples: list[dict[str, list[float]]] = [{"pp": [], "tg": []} for _ in candidates]
        last: list[TrialResult | None] = [None] * len(candidates)
        order = list(range(len(candidates)))
        for r in range(max(1, rounds)):
            for i in order[r % len(order):] + order[: r % len(order)]:
                result = self.run(candidates[i], bench, trial_id=f"paired-{r}-{i}")
                if not result.ok:
                    return [TrialResult(result.outcome, result.message, s, bench, load=result.load, log=result.log,
                                        signal=result.signal, returncode=result.returncode) for s in candidates]
                last[i] = result
                samples[i]["pp"] += list(result.pp.samples) if result.pp else []
                samples[i]["tg"] += list(result.tg.samples) if result.tg else []
        out = []
        for i, s in enumerate(candidates):
            base = last[i]
            assert base is not None
            out.append(TrialResult(Outcome.OK, "ok", s, bench, pp=Stats.of(samples[i]["pp"]), tg=Stats.of(samples[i]["tg"]),
                                   load=base.load, log=base.log, peak_rss=base.peak_rss, peak_vram=base.peak_vram,
                                   wall_s=base.wall_s, load_s=base.load_s))
        return out

    def _invoke(self, args: Sequence[str], timeout: float, *, tool: Path | None = None,
                json_flags: Sequence[str] = ("-o", "json", "-v")) -> "_Invocation":
        """Run llama-bench (or ``tool``) in its own process group, stdout (JSON) in a pipe, the log in a file."""
        self._count += 1
        program = tool or self.binaries.bench
        log_path = self.log_dir / f"{program.name}-{os.getpid()}-{self._count}.log"
        cmd = [str(program), *args, *json_flags]
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=self.env,
                                        start_new_session=True)
            except OSError as exc:
                raise EngineError(f"{program} cannot be started: {exc.strerror or exc}") from None
        self._live.add(proc)
        sampler = MemorySampler(proc.pid)
        sampler.start()
        timed_out = False
        try:
            stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc)
            stdout = proc.stdout.read() if proc.stdout else b""
        except BaseException:
            # Ctrl-C (or anything else) in the caller: never leave a llama-bench behind.
            sampler.stop()
            kill_group(proc)
            self._live.discard(proc)
            raise
        finally:
            sampler.stop()
        kill_group(proc)  # anything it left in its group
        self._live.discard(proc)
        try:
            log_text = log_path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            log_text = ""
        return _Invocation(cmd, proc.returncode, timed_out, stdout.decode("utf-8", errors="replace"), log_text,
                           sampler.peak_rss, dict(sampler.peak_vram))

    def _result(self, x: "_Invocation", settings: Settings, bench: BenchSpec, started: float) -> TrialResult:
        report = parse_log(x.log)
        rows, parse_error = _bench_rows(x.stdout)
        reply: dict[str, Any] | None = None
        pp: list[float] = []
        tg: list[float] = []
        if x.returncode == 0 and rows:
            for row in rows:
                samples = _row_samples(row)
                if int(row.get("n_gen") or 0) > 0:
                    tg += samples
                elif int(row.get("n_prompt") or 0) > 0:
                    pp += samples
            first = rows[0]
            self._bench_build = {"build_number": first.get("build_number"), "commit": first.get("build_commit"),
                                 "backends": [b for b in str(first.get("backends") or "").split(",") if b]}
            if (bench.n_prompt and not pp) or (bench.n_gen and not tg):
                reply = {"status": "error", "message": "llama-bench printed no samples for this test"}
            else:
                reply = {"status": "ok"}
        elif x.returncode == 0:
            reply = {"status": "error", "message": f"llama-bench printed no result ({parse_error})"}
        elif not x.timed_out and x.returncode is not None and x.returncode > 0:
            reply = _failure_reply(x.log)
        c = classify(timed_out=x.timed_out, timeout_s=self.timeout_s, reply=reply, returncode=x.returncode,
                     oom_in_log=report.oom, error_lines=tuple(report.errors) or _error_lines(x.log), process="llama-bench")
        load_ms = _LOAD_TIME.search(x.log)
        return TrialResult(
            outcome=c.outcome, message=c.message, settings=settings, bench=bench,
            pp=Stats.of(pp) if c.outcome is Outcome.OK else None, tg=Stats.of(tg) if c.outcome is Outcome.OK else None,
            load=report, log=x.log, peak_rss=x.peak_rss or None, peak_vram=x.peak_vram, signal=c.signal_name,
            returncode=x.returncode, wall_s=time.perf_counter() - started,
            load_s=float(load_ms["ms"]) / 1000 if load_ms else 0.0, reused_model=False,
        )

    # -- llama.cpp's fitter ---------------------------------------------------------------------------

    def _fit_args(self, settings: Settings, *, keep_placement: bool) -> list[str]:
        """llama-fit-params' argv from the settings' llama-server flags (common/arg.cpp parses both;
        -kvu is llama-server's only: left out, fit sizes one stream per sequence, -np of them)."""
        args = [a for a in settings.cli_args("llama-server") if a != "-kvu"]  # a switch: no value follows
        if not keep_placement:
            # Leave the layers, the split and the tensor placement unset: those are what fit chooses.
            args = _drop_flags(args, {"-ngl", "-ts", "-ot"})
        elif settings.n_gpu_layers < 0:
            args[args.index("-ngl") + 1] = "999"  # every layer; "all" is 2026-only and -1 is "auto" there
        return args

    def fit(self, settings: Settings, *, margin: int, min_ctx: int) -> FitAnswer | None:
        """What ``llama-fit-params`` chooses for ``settings`` at its context: layers, split, placement."""
        tool = self.binaries.get("llama-fit-params")
        if tool is None:
            return None
        args = self._fit_args(settings, keep_placement=False)
        args += ["-fitt", str(max(0, margin // MiB)), "-fitc", str(min_ctx)]
        proc = self._run_tool(tool, args, timeout=120)
        lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("-c ")]
        if proc.returncode != 0 or not lines:
            return None
        answer = lines[-1].strip()
        return FitAnswer(settings=_apply_fit(settings, answer), args=answer, tool=str(tool))

    def fit_memory(self, settings: Settings) -> dict[str, dict[str, int]] | None:
        """llama.cpp's own projection of each device's memory for ``settings`` at its ``n_ctx``
        (``llama-fit-params --fit-print on``: buffers sized, nothing allocated). MiB resolution."""
        tool = self.binaries.get("llama-fit-params")
        if tool is None:
            return None
        try:
            proc = self._run_tool(tool, [*self._fit_args(settings, keep_placement=True), "--fit-print", "on"], timeout=120)
        except EngineError:
            # the projection itself crashed or hung (llama.cpp aborts in it on some backends, e.g. a KV
            # tensor Vulkan cannot hold): no projection; the trial then says what llama.cpp does
            return None
        if proc.returncode != 0:
            return None
        labels = {d.ggml_name or d.name: d.name for d in self.devices(settings.rpc_servers)}
        out: dict[str, dict[str, int]] = {}
        for line in proc.stdout.splitlines():
            m = _FIT_PRINT.match(line.strip())
            if m:
                name = "CPU" if m["name"] == "Host" else labels.get(m["name"], m["name"])
                out[name] = {"weights": int(m["model"]) * MiB, "context": int(m["context"]) * MiB,
                             "compute": int(m["compute"]) * MiB}
        return out or None

    def _context_memory_check(self, settings: Settings) -> str | None:
        """Why llama.cpp's projection at ``n_ctx`` does not fit a device's free memory, or None."""
        if settings.n_gpu_layers == 0 or self.binaries.get("llama-fit-params") is None:
            return None
        projected = self.fit_memory(settings)
        if not projected:
            return None
        free = {d.name: d.memory_free for d in self.devices(settings.rpc_servers) if d.is_accelerator}
        for name, need in projected.items():
            have = free.get(name)
            total = sum(need.values())
            if have is not None and total > have:
                return (f"{name}: llama.cpp projects {total / MiB:.0f} MiB at n_ctx {settings.n_ctx} "
                        f"({need['weights'] / MiB:.0f} weights, {need['context'] / MiB:.0f} context, "
                        f"{need['compute'] / MiB:.0f} compute), {have / MiB:.0f} MiB free "
                        "(llama-bench itself would allocate only the benchmark's context)")
        return None

    # -- exported flags -------------------------------------------------------------------------------

    def check_flags(self, tool: str, args: Sequence[str]) -> tuple[str, str | None] | None:
        """Whether these binaries' own parser accepts ``args`` for ``tool``: see ``check_exported_flags``."""
        return check_exported_flags(tool, args, self.binaries.folder, env=self.env)


def binaries_build(folder: str | os.PathLike[str], *, env: dict[str, str] | None = None) -> EngineBuild:
    """The build of the llama.cpp tools in ``folder`` (whichever answers ``--version``: llama-server,
    llama-cli, llama-bench, llama-fit-params), for an app that runs them without llama-bench."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise EngineError(f"{path}: no such folder")
    for tool in ("llama-server", "llama-cli", "llama-bench", "llama-fit-params"):
        binary = path / _exe(tool)
        if not binary.is_file():
            continue
        try:
            proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, errors="replace",
                                  env=clean_env(env), timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            continue
        info = parse_version(proc.stdout + "\n" + proc.stderr)
        if info.get("build_number") is not None or info.get("commit"):
            return EngineBuild(engine="llama-cpp", build_number=info.get("build_number"), commit=info.get("commit"),
                               version=info.get("version"), path=str(path.resolve()), detail=info.get("detail"))
    raise EngineError(f"{path}: no llama.cpp tool there says its build (--version)")


def check_exported_flags(tool: str, args: Sequence[str], llama_bin: str | os.PathLike[str] | None = None, *,
                         env: dict[str, str] | None = None) -> tuple[str, str | None] | None:
    """Whether llama.cpp's own parser accepts ``args`` for ``tool`` (llama-server, llama-cli or
    llama-bench), run as ``TOOL ARGS --help``: every argument is parsed before the help exits, so the
    exit status says whether they all were understood (common/arg.cpp common_params_parse; llama-bench's
    parse_cmd_params). llama-server's flags are parsed by llama-server, else llama-cli or
    llama-fit-params (the same common parser). Looks in ``llama_bin``, else on PATH.

    Returns ``(the binary that parsed them, None)`` when accepted, ``(binary, its error line)`` when
    not, and None when no such binary is there. ``--rpc`` is left out: parsing it connects."""
    args = _drop_flags(list(args), {"--rpc"})
    candidates = ["llama-bench"] if tool == "llama-bench" else [tool] + [t for t in COMMON_PARSERS if t != tool]
    for name in candidates:
        if tool == "llama-server" and name != "llama-server":
            # -kvu is set for llama-server (and batched, perplexity, bench) only: another parser refuses it
            args = [a for a in args if a != "-kvu"]  # a switch: no value follows
        if llama_bin is not None:
            path = Path(llama_bin) / _exe(name)
            found = str(path) if path.is_file() else None
        else:
            found = shutil.which(name)
        if found is None:
            continue
        try:
            proc = subprocess.run([found, *args, "--help"], capture_output=True, text=True, errors="replace",
                                  env=clean_env(env), timeout=60, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return found, f"could not run it: {exc}"
        if proc.returncode == 0:
            return found, None
        return found, _first_error(proc.stdout + "\n" + proc.stderr) or f"exit code {proc.returncode}"
    return None


@dataclass
class _Invocation:
    cmd: list[str]
    returncode: int | None
    timed_out: bool
    stdout: str
    log: str
    peak_rss: int
    peak_vram: dict[str, int]


def _cpu_device() -> DeviceInfo:
    import platform

    import psutil

    memory = psutil.virtual_memory()
    return DeviceInfo("CPU", platform.processor() or platform.machine() or "CPU", "cpu", int(memory.available),
                      int(memory.total), "CPU")


def _bench_rows(stdout: str) -> tuple[list[dict[str, Any]], str | None]:
    """llama-bench's ``-o json`` array (an older build may print some text before it)."""
    text = stdout.strip()
    start = text.find("[")
    if start < 0:
        return [], "no JSON array on stdout"
    try:
        rows = json.loads(text[start:])
    except ValueError as exc:
        return [], f"unreadable JSON: {exc}"
    if not isinstance(rows, list):
        return [], "the JSON is not a list of tests"
    return [r for r in rows if isinstance(r, dict)], None


def _row_samples(row: dict[str, Any]) -> list[float]:
    """Every sample's tokens/sec: ``samples_ts`` (2024-06 onward), else from ``samples_ns``."""
    ts = row.get("samples_ts")
    if isinstance(ts, list) and ts:
        return [float(x) for x in ts if isinstance(x, (int, float))]
    ns = row.get("samples_ns")
    tokens = int(row.get("n_prompt") or 0) + int(row.get("n_gen") or 0)
    if isinstance(ns, list) and ns and tokens:
        return [tokens / (float(x) / 1e9) for x in ns if isinstance(x, (int, float)) and x > 0]
    avg = row.get("avg_ts")
    return [float(avg)] if isinstance(avg, (int, float)) else []


def _failure_reply(log: str) -> dict[str, Any] | None:
    """What llama-bench said when it exited with an error, as the worker's reply would say it."""
    m = _BENCH_BAD_ARG.search(log)
    if m:
        return {"status": "bad_settings", "message": f"llama-bench rejected {m['arg']}: {_first_error(log) or 'invalid parameter'}"}
    if _BENCH_LOAD.search(log):
        return {"status": "load_error", "message": "llama-bench failed to load the model"}
    if _BENCH_CONTEXT.search(log):
        return {"status": "context_error", "message": "llama-bench failed to create or run the context"}
    return None


def _error_lines(log: str) -> tuple[str, ...]:
    return tuple(line.strip() for line in log.splitlines() if "error" in line.lower())[:5]


def _first_error(text: str) -> str | None:
    for line in text.splitlines():
        if "error" in line.lower() or "invalid" in line.lower() or "unknown" in line.lower():
            return line.strip()[:300]
    return None


def _tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return f": {lines[-1][:300]}" if lines else ""


def _non_default(dim: Any) -> Settings | None:
    """Settings with ``dim`` away from its default, to see which flag it writes (None where no such
    value validates)."""
    default = dim.default
    number = default + 1 if isinstance(default, int) and not isinstance(default, bool) else 1
    candidates: list[Any] = {
        "bool": [not default], "int": [number, 1, 2], "count": [number, 1, 2],
        "choice": [c for c in dim.choices if c != default][:1], "proportions": [(1.0, 1.0)],
        "patterns": [("x",)], "endpoints": [("127.0.0.1:1",)], "devices": [("CUDA0",)],
    }.get(dim.kind, [])
    for value in candidates:
        try:
            return Settings(model_path="m.gguf", **{dim.name: value})
        except (ValueError, TypeError):
            continue
    return None


def _setting_of_flag(settings: Settings, flag: str) -> str:
    """The setting whose llama-bench flag ``flag`` is, read from the dimension table."""
    from .dimensions import DIMENSIONS, Export

    if flag in _BENCH_SHAPE_FLAGS:
        return _BENCH_SHAPE_FLAGS[flag]
    for dim in DIMENSIONS:
        writer = dim.flags.get("llama-bench")
        if writer is not None and flag in writer(settings, Export(tool="llama-bench")):
            return dim.name
    return "that setting"


def _drop_flags(args: list[str], flags: set[str]) -> list[str]:
    """``args`` without the given value-taking flags and their values."""
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        out.append(a)
    return out


def _apply_fit(settings: Settings, answer: str) -> Settings:
    """Settings with what llama-fit-params printed: ``-c N -ngl N [-ts a,b] [-ot "pattern=BUFT,..."]``
    (tools/fit-params/fit-params.cpp, 2025-12 onward). Overrides to the CPU become tensor_overrides;
    ``-ngl -1`` is every layer (the value of llama_model_params it prints)."""
    tokens = shlex.split(answer)
    changes: dict[str, Any] = {}
    i = 0
    while i + 1 < len(tokens):
        flag, value = tokens[i], tokens[i + 1]
        if flag == "-c":
            changes["n_ctx"] = int(value)
        elif flag == "-ngl":
            changes["n_gpu_layers"] = max(-1, int(value))
        elif flag == "-ts":
            parts = tuple(float(x) for x in value.replace("/", ",").split(",") if x)
            changes["tensor_split"] = parts if sum(parts) > 0 else None
        elif flag == "-ot":
            changes["tensor_overrides"] = tuple(p.rsplit("=", 1)[0] for p in value.split(",")
                                                if p.rsplit("=", 1)[-1].upper() == "CPU")
        i += 2
    return settings.replace(**changes)


__all__ = ["LlamaCppEngine", "Binaries", "find_binaries", "binaries_build", "parse_version", "clean_env",
           "check_exported_flags", "TOOLS"]
