"""The trial worker: the only process that imports llama_cpp. Run as ``python -m tuner.engine.worker``.

The runner starts it in a new process group with fd 2 redirected to a log file, and talks to it
in JSON lines: one request per trial on stdin, one reply on a private copy of stdout (fd 1 itself
is pointed at the log too, so nothing llama.cpp prints can corrupt the protocol). Every llama.cpp
log line, debug level included, goes through the log callback to fd 2, in order with whatever
ggml writes there directly.

One worker serves several trials that share the model-level settings (``Settings.model_key``):
the model stays loaded and each trial gets a fresh context, as llama-bench does.

Measurement follows llama-bench (tools/llama-bench/llama-bench.cpp): tokens drawn at random from
the vocabulary (BOS first), no tokenizer or sampler in the timed region; pp feeds P tokens in
n_batch chunks; tg decodes G tokens one at a time after D tokens of depth; the cache is cleared
before each repetition; one warm-up; ``llama_synchronize`` closes each timed region.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import sys
import time
import traceback
from typing import Any

from .dimensions import DIMENSIONS
from .process import LOG_MARK
from .base import BenchSpec, StopRule

# a load that takes longer than this says how far it is, every LOAD_PROGRESS_EVERY_S (the tests set
# OFFLOAD_TUNER_LOAD_PROGRESS_AFTER_S=0 to see the lines of a small model's short load)
LOAD_PROGRESS_AFTER_S = float(os.environ.get("OFFLOAD_TUNER_LOAD_PROGRESS_AFTER_S", "2"))
LOAD_PROGRESS_EVERY_S = 1.0
from .settings import MODEL_KEYS, Settings


def _log(text: str) -> None:
    os.write(2, text.encode("utf-8", errors="replace"))


class Worker:
    def __init__(self, reply_fd: int) -> None:
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.reply = os.fdopen(reply_fd, "w", buffering=1)
        self.model = None
        self.model_key: Any = None
        self.keepalive: list[Any] = []
        self.registered_rpc: set[str] = set()
        self.watchdog: Any = None  # tuner.engine.process.Watchdog, started by main()
        self.threadpools: dict[Any, Any] = {}  # context -> its ggml.Threadpools

        @llama_cpp.llama_log_callback
        def on_log(level: int, text: bytes, user_data: Any) -> None:  # every level, debug too
            if text:
                os.write(2, text)

        self._on_log = on_log  # keep the callback alive
        llama_cpp.llama_log_set(on_log, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()

    # -- protocol ------------------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        self.reply.write(json.dumps(message) + "\n")
        self.reply.flush()
        if self.watchdog is not None and "progress" in message:
            self.watchdog.progress()  # as the runner does: the limit is on time without progress

    def serve(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            request = json.loads(line)
            if request.get("op") == "exit":
                break
            if self.watchdog is not None:
                self.watchdog.arm(request.get("timeout_s"))
            try:
                op = request.get("op")
                if op == "paired":
                    self.send(paired(self, request))
                elif op == "score":  # a pass over a text for quality (tuner.engine.scoring)
                    from .scoring import score_corpus

                    self.send(score_corpus(self, request))
                else:
                    self.send(self.trial(request))
            except Exception as exc:  # a Python-side failure is a reply, not a silent death
                _log(traceback.format_exc())
                self.send({"status": "error", "message": f"{type(exc).__name__}: {exc}"})
            finally:
                if self.watchdog is not None:
                    self.watchdog.disarm()
        self.free_model()

    # -- model and context --------------------------------------------------------------------

    def free_model(self) -> None:
        if self.model is not None:
            self.llama_cpp.llama_model_free(self.model)
            self.model = None
            self.model_key = None
            self.keepalive = []

    def load_model(self, s: dict[str, Any]) -> tuple[bool, str | None, float]:
        """Load unless the loaded model has the same model-level settings. (reused, error, seconds)"""
        key = json.dumps([s[k] for k in MODEL_KEYS])
        if self.model is not None and key == self.model_key:
            return True, None, 0.0
        self.free_model()
        model, keep, error, seconds = self._load(s)
        if error:
            return False, error, seconds
        self.model, self.model_key, self.keepalive = model, key, keep
        return False, None, seconds

    def _load(self, s: dict[str, Any]) -> tuple[Any, list[Any], str | None, float]:
        lc = self.llama_cpp
        if s.get("rpc_servers"):
            from .rpc import register_servers

            new = [e for e in s["rpc_servers"] if e not in self.registered_rpc]
            if new:
                register_servers(new)
                self.registered_rpc.update(new)
        settings = Settings.from_dict(s)
        params = lc.llama_model_default_params()
        _set_fields(params, "model", settings)
        keep: list[Any] = []
        # the fields that point at memory this process keeps alive (dimensions.c_api_by_worker)
        if settings.tensor_split:
            n = lc.llama_max_devices()
            split = (ctypes.c_float * n)(*([float(x) for x in settings.tensor_split] + [0.0] * n)[:n])
            params.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
            keep.append(split)
        if settings.devices:
            from .ggml import DeviceArray

            devices = DeviceArray(settings.devices)
            params.devices = devices.address
            keep.append(devices)
        if settings.host_overrides:
            from .ggml import OverrideArray

            overrides = OverrideArray(settings.host_overrides, s["model_path"])
            params.tensor_buft_overrides = overrides.address
            keep.append(overrides)
        started = time.perf_counter()
        progress = self._load_progress(s["model_path"], started)
        params.progress_callback = progress
        keep.append(progress)
        # (os.fsencode: a path that is not UTF-8 reaches here with surrogate escapes; these are its bytes)
        model = lc.llama_model_load_from_file(os.fsencode(s["model_path"]), params)
        seconds = time.perf_counter() - started
        if not model:
            return None, keep, "llama.cpp failed to load the model", seconds
        return model, keep, None, seconds

    def _load_progress(self, path: str, started: float) -> Any:
        """llama.cpp's load progress callback (``llama_model_params.progress_callback``, called with
        the share of the tensor data loaded so far): a progress line of bytes read of the file's size,
        once a load has taken LOAD_PROGRESS_AFTER_S, then every LOAD_PROGRESS_EVERY_S. A short load
        sends none. Returns True: never cancel."""
        try:
            total = os.path.getsize(path)
        except OSError:
            total = 0
        last = [started]

        def on_progress(fraction: float, _user: Any) -> bool:
            now = time.perf_counter()
            if now - started >= LOAD_PROGRESS_AFTER_S and (now - last[0] >= LOAD_PROGRESS_EVERY_S or fraction >= 1.0):
                last[0] = now
                self.send({"progress": {"load": round(min(1.0, max(0.0, float(fraction))), 4),
                                        "bytes": int(total * min(1.0, max(0.0, float(fraction)))), "total": total,
                                        "seconds": round(now - started, 1)}})
            return True

        return self.llama_cpp.llama_progress_callback(on_progress)

    def new_context(self, s: dict[str, Any], model: Any = None, *, threadpools: bool = False):
        """A context for ``s``; with ``threadpools``, the CPU threadpools llama-bench attaches
        (``ggml.Threadpools``): contexts that measure speed have them, and ``free_context`` frees them."""
        lc = self.llama_cpp
        params = lc.llama_context_default_params()
        _set_fields(params, "context", Settings.from_dict(s))
        params.no_perf = False
        _log(f"{LOG_MARK} context begins\n")
        ctx = lc.llama_init_from_model(model or self.model, params)
        if ctx and threadpools:
            from .ggml import Threadpools

            pools = Threadpools(ctx, lc.llama_n_threads(ctx), lc.llama_n_threads_batch(ctx))
            if pools.attached:
                self.threadpools[ctx] = pools
        return ctx

    def free_context(self, ctx: Any) -> None:
        self.llama_cpp.llama_free(ctx)
        pools = self.threadpools.pop(ctx, None)
        if pools is not None:
            pools.free()  # after the context: it no longer computes with them

    # -- measurement ----------------------------------------------------------------------------

    def trial(self, request: dict[str, Any]) -> dict[str, Any]:
        lc = self.llama_cpp
        s = request["settings"]
        bench = request["bench"]
        _log(f"{LOG_MARK} trial {request.get('trial_id', '?')} begins\n")
        _reset_peak_rss()
        reused, error, load_s = self.load_model(s)
        if error:
            return {"status": "load_error", "message": error, "load_s": load_s}
        ctx = self.new_context(s, threadpools=True)
        if not ctx:
            return {"status": "context_error", "message": "llama.cpp failed to create the context", "load_s": load_s, "reused_model": reused}
        try:
            b = _bench_for(lc, self.model, ctx, bench)
            if b.too_small:
                return {"status": "bad_settings", "message": b.too_small}
            if bench.get("warmup", True):
                b.warm_up()
            # a repetition is one pp and one tg; the trial may stop early by the tuner's rule
            # (tuner.engine.base.StopRule: clearly behind the leader, or its rank settled)
            stop = StopRule.from_dict(request["stop"]) if request.get("stop") else None
            pp, tg = _samples(b, bench["repetitions"], stop)
            return {
                "status": "ok",
                "pp_samples": pp,
                "tg_samples": tg,
                "load_s": load_s,
                "reused_model": reused,
                "n_ctx": b.n_ctx,
                "peak_rss": _peak_rss(),
            }
        except DecodeError as exc:
            # llama_decode: 1 = no KV slot, 2 = aborted, -1 = invalid batch, < -1 = compute error
            # (an allocation failure during the graph compute lands here)
            return {"status": "context_error", "message": f"llama_decode returned {exc.code}", "load_s": load_s, "reused_model": reused}
        finally:
            self.free_context(ctx)
            _log(f"{LOG_MARK} trial {request.get('trial_id', '?')} ends\n")


class _Bench:
    """llama-bench's measurements on one context: random vocabulary tokens, BOS first, pp in
    n_batch chunks, tg one token at a time after ``depth`` tokens, the cache cleared each time.

    The generation loop is the only Python that runs per token, so it does the least it can: the
    tokens are drawn before the clock starts, and one batch (``llama_batch_get_one`` over a
    one-token array) is made once and refilled, instead of a new array and batch per token. That
    loop cost showed at high speeds (0.90 x llama-bench's tg at ~1,200 t/s);
    ``benchmarks/vs_llama_bench.py`` states what is left, per token.
    """

    def __init__(self, lc: Any, model: Any, ctx: Any, bench: dict[str, Any]) -> None:
        self.lc, self.ctx = lc, ctx
        vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = lc.llama_vocab_n_tokens(vocab)
        self.bos = lc.llama_vocab_bos(vocab) if lc.llama_vocab_get_add_bos(vocab) else -1
        self.rng = random.Random(bench.get("seed", 1234))
        self.n_ctx = lc.llama_n_ctx(ctx)
        self.n_batch = lc.llama_n_batch(ctx)
        self.P, self.G, self.D = bench["n_prompt"], bench["n_gen"], bench["depth"]
        need = self.D + max(self.P, self.G)
        self.too_small = f"depth {self.D} + {max(self.P, self.G)} tokens exceed n_ctx {self.n_ctx}" if need > self.n_ctx else None
        self.memory = lc.llama_get_memory(ctx)
        self.filled = False  # whether the cache holds the depth's tokens (at_depth)
        # one batch for generation, refilled per token; one buffer for prompt chunks
        self.one_token = (lc.llama_token * 1)()
        self.one = lc.llama_batch_get_one(self.one_token, 1)
        self.chunk = (lc.llama_token * max(1, self.n_batch))()

    def at_depth(self) -> None:
        """The cache holding ``depth`` tokens and nothing after. The depth is filled once per context;
        later regions drop only what the last one added (``llama_memory_seq_rm`` from position D on),
        which leaves the same cache as filling it again, without the untimed prefill each time
        (at a 4096-token depth on a partial offload, most of a repetition's time). A memory that
        cannot drop a tail (a recurrent model's) is cleared and filled again, as llama-bench does."""
        lc = self.lc
        if self.D and self.filled and lc.llama_memory_seq_rm(self.memory, -1, self.D, -1):
            return
        lc.llama_memory_clear(self.memory, False)
        self.filled = False
        if self.D:
            self.prompt(self.prompt_tokens(self.D))
            self.filled = True

    def prompt_tokens(self, n: int) -> list[int]:
        tokens = [self.rng.randrange(self.n_vocab) for _ in range(n)]
        if self.bos >= 0 and tokens:
            tokens[0] = self.bos
        return tokens

    def gen_tokens(self, n: int) -> list[int]:
        first = self.bos if self.bos >= 0 else self.rng.randrange(self.n_vocab)
        return [first] + [self.rng.randrange(self.n_vocab) for _ in range(n - 1)] if n else []

    def prompt(self, tokens: list[int]) -> None:
        lc, ctx, chunk = self.lc, self.ctx, self.chunk
        for i in range(0, len(tokens), self.n_batch):
            part = tokens[i : i + self.n_batch]
            chunk[: len(part)] = part
            rc = lc.llama_decode(ctx, lc.llama_batch_get_one(chunk, len(part)))
            if rc != 0:
                raise DecodeError(rc)
        lc.llama_synchronize(ctx)

    def gen(self, tokens: list[int]) -> None:
        # the per-token loop: locals only, one refilled batch, as llama-bench's test_gen does in C
        decode, synchronize, ctx, batch, slot = self.lc.llama_decode, self.lc.llama_synchronize, self.ctx, self.one, self.one_token
        for token in tokens:
            slot[0] = token
            rc = decode(ctx, batch)
            if rc != 0:
                raise DecodeError(rc)
            synchronize(ctx)

    def _timed(self, run: Any, tokens: list[int]) -> float:
        self.at_depth()
        start = time.perf_counter_ns()
        run(tokens)
        return len(tokens) / ((time.perf_counter_ns() - start) / 1e9)

    def timed_pp(self) -> float:
        return self._timed(self.prompt, self.prompt_tokens(self.P))

    def timed_tg(self) -> float:
        return self._timed(self.gen, self.gen_tokens(self.G))

    def warm_up(self) -> None:
        # A full-size warm-up: llama-bench's one-batch warm-up left our first timed pp 2x slow
        # (first touch of mapped weights and compute buffers at full width).
        if self.P:
            self.timed_pp()
        if self.G:
            self._timed(self.gen, self.gen_tokens(min(self.G, 8)))


class _Batched:
    """llama-batched-bench's measurement for ``users`` sequences (tools/batched-bench/batched-bench.cpp,
    one row of its -npp/-ntg/-npl table with is_pp_shared 0 and is_tg_separate 0), as llama-server's
    slots decode: one ``llama_batch`` holding every sequence's tokens, each with its own sequence id.

    Per repetition: the cache cleared; ``depth`` tokens of each sequence decoded untimed (the
    conversation so far); then, timed, the N prompts of P tokens together (the batch built before
    the clock, decoded in n_batch slices, one synchronize at the end: batched-bench's T_PP, the
    time to the first token when N requests arrive at once), and G steps of N tokens, one per
    sequence, each synchronized (T_TG). S_PP = N*P / T_PP and S_TG = N*G / T_TG are the samples,
    as batched-bench prints them; each user's own speed is S_TG / N.

    Tokens are random vocabulary ids (rand() % n_vocab there), drawn before the clock.
    """

    def __init__(self, lc: Any, model: Any, ctx: Any, bench: dict[str, Any]) -> None:
        self.lc, self.ctx = lc, ctx
        vocab = lc.llama_model_get_vocab(model)
        self.n_vocab = lc.llama_vocab_n_tokens(vocab)
        self.rng = random.Random(bench.get("seed", 1234))
        self.n_ctx = lc.llama_n_ctx(ctx)
        self.n_ctx_seq = lc.llama_n_ctx_seq(ctx)
        self.n_batch = lc.llama_n_batch(ctx)
        self.N = int(bench.get("users", 1))
        self.P, self.G, self.D = bench["n_prompt"], bench["n_gen"], bench["depth"]
        per_seq = self.D + self.P + self.G
        n_seq_max = lc.llama_n_seq_max(ctx)
        self.too_small = None
        if self.N > n_seq_max:
            self.too_small = f"{self.N} users need n_seq_max {self.N}, the context has {n_seq_max}"
        elif per_seq > self.n_ctx_seq or self.N * per_seq > self.n_ctx:
            self.too_small = (f"{self.N} user{'s' if self.N != 1 else ''} x (depth {self.D} + {self.P} prompt + {self.G} generated tokens) exceed "
                              f"n_ctx {self.n_ctx} ({self.n_ctx_seq} per sequence)")
        self.memory = lc.llama_get_memory(ctx)
        size = max(1, self.N * max(self.P, self.D, 1), self.N)
        self._arrays(size)

    def _arrays(self, size: int) -> None:
        lc = self.lc
        self.size = size
        self.token = (lc.llama_token * size)()
        self.pos = (lc.llama_pos * size)()
        self.n_seq_id = (ctypes.c_int32 * size)()
        self.seq = (lc.llama_seq_id * size)()
        self.seq_ptr = (ctypes.POINTER(lc.llama_seq_id) * size)()
        self.logits = (ctypes.c_int8 * size)()
        base = ctypes.addressof(self.seq)
        width = ctypes.sizeof(lc.llama_seq_id)
        for i in range(size):
            self.n_seq_id[i] = 1
            self.seq_ptr[i] = ctypes.cast(base + i * width, ctypes.POINTER(lc.llama_seq_id))

    def _fill(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """(token, position, sequence, output) per slot of the batch."""
        for i, (token, pos, seq, out) in enumerate(rows):
            self.token[i], self.pos[i], self.seq[i], self.logits[i] = token, pos, seq, out

    def _view(self, start: int, n: int) -> Any:
        """A batch over slots start..start+n-1 of the arrays (batched-bench's get_sub_batch)."""
        lc = self.lc
        at = lambda array, ptr: ctypes.cast(ctypes.addressof(array) + start * ctypes.sizeof(array._type_), ptr)  # noqa: E731
        return lc.llama_batch(n_tokens=n, token=at(self.token, ctypes.POINTER(lc.llama_token)), embd=None,
                              pos=at(self.pos, ctypes.POINTER(lc.llama_pos)),
                              n_seq_id=at(self.n_seq_id, ctypes.POINTER(ctypes.c_int32)),
                              seq_id=at(self.seq_ptr, ctypes.POINTER(ctypes.POINTER(lc.llama_seq_id))),
                              logits=at(self.logits, ctypes.POINTER(ctypes.c_int8)))

    def _decode(self, n: int, synchronize: bool) -> None:
        decode = self.lc.llama_decode
        for start in range(0, n, self.n_batch):
            rc = decode(self.ctx, self._view(start, min(self.n_batch, n - start)))
            if rc != 0:
                raise DecodeError(rc)
            if synchronize:
                self.lc.llama_synchronize(self.ctx)
        self.lc.llama_synchronize(self.ctx)

    def _rand(self) -> int:
        return self.rng.randrange(self.n_vocab)

    def _prompts(self, first: int, n: int) -> int:
        """Fill every sequence's tokens first..first+n-1 (sequence after sequence); returns the count."""
        rows = [(self._rand(), first + i, j, i == n - 1) for j in range(self.N) for i in range(n)]
        self._fill(rows)
        return len(rows)

    def run(self, generate: int | None = None) -> tuple[float, float]:
        """One repetition: (T_PP, T_TG) in seconds."""
        lc = self.lc
        G = self.G if generate is None else generate
        lc.llama_memory_clear(self.memory, False)
        if self.D:
            self._decode(self._prompts(0, self.D), synchronize=False)
        t_pp = 0.0
        if self.P:
            n = self._prompts(self.D, self.P)
            start = time.perf_counter_ns()
            self._decode(n, synchronize=False)
            t_pp = (time.perf_counter_ns() - start) / 1e9
        steps = [[(self._rand(), self.D + self.P + i, j, True) for j in range(self.N)] for i in range(G)]
        decode, synchronize, ctx = lc.llama_decode, lc.llama_synchronize, self.ctx
        batch = self._view(0, self.N)
        start = time.perf_counter_ns()
        for rows in steps:
            for k, (token, pos, seq, out) in enumerate(rows):
                self.token[k], self.pos[k], self.seq[k], self.logits[k] = token, pos, seq, out
            rc = decode(ctx, batch)
            if rc != 0:
                raise DecodeError(rc)
            synchronize(ctx)
        t_tg = (time.perf_counter_ns() - start) / 1e9
        return t_pp, t_tg

    def warm_up(self) -> None:
        # a full-width pass, as _Bench does (batched-bench decodes 16 tokens; that left our first
        # row slow for the same reasons as llama-bench's one-batch warm-up)
        self.run(generate=min(self.G, 8))

    def timed_both(self) -> tuple[float | None, float | None]:
        t_pp, t_tg = self.run()
        pp = self.N * self.P / t_pp if self.P and t_pp > 0 else None
        tg = self.N * self.G / t_tg if self.G and t_tg > 0 else None
        return pp, tg


def _bench_for(lc: Any, model: Any, ctx: Any, bench: dict[str, Any]) -> "_Bench | _Batched":
    """One user: llama-bench's method; several (or one asked ``batched``): llama-batched-bench's."""
    return _Batched(lc, model, ctx, bench) if BenchSpec(**bench).as_served else _Bench(lc, model, ctx, bench)


def _samples(b: "_Bench | _Batched", reps: int, stop: "StopRule | None" = None) -> tuple[list[float], list[float]]:
    """Up to ``reps`` repetitions of pp and tg samples (a repetition is one of each); fewer when
    ``stop`` says the ones so far settle the trial's rank."""
    pp: list[float] = []
    tg: list[float] = []
    for _ in range(reps):
        if isinstance(b, _Batched):
            p, g = b.timed_both()
            if p is not None:
                pp.append(p)
            if g is not None:
                tg.append(g)
        else:
            if b.P:
                pp.append(b.timed_pp())
            if b.G:
                tg.append(b.timed_tg())
        if stop is not None and stop.enough(pp, tg):
            break
    return pp, tg


def paired(worker: "Worker", request: dict[str, Any]) -> dict[str, Any]:
    """Measure several candidates side by side: every model loaded and every context created
    first, then rounds in which each candidate runs once, in rotating order.

    On a shared machine speed drifts over seconds; candidates measured within the same second
    see the same machine, so their ratio is far steadier than figures taken minutes apart."""
    lc = worker.llama_cpp
    bench, rounds = request["bench"], request["rounds"]
    worker.free_model()
    models: dict[str, Any] = {}
    keep: list[Any] = []
    contexts: list[Any] = []
    _log(f"{LOG_MARK} paired measurement of {len(request['candidates'])} candidates begins\n")
    try:
        benches = []
        for s in request["candidates"]:
            key = json.dumps([s[k] for k in MODEL_KEYS])
            if key not in models:
                model, kept, error, _ = worker._load(s)
                keep += kept
                if error:
                    return {"status": "load_error", "message": error}
                models[key] = model
            ctx = worker.new_context(s, models[key], threadpools=True)
            if not ctx:
                return {"status": "context_error", "message": "llama.cpp failed to create a context"}
            contexts.append(ctx)
            b = _bench_for(lc, models[key], ctx, bench)
            if b.too_small:
                return {"status": "bad_settings", "message": b.too_small}
            benches.append(b)
        for b in benches:
            b.warm_up()
        pp: list[list[float]] = [[] for _ in benches]
        tg: list[list[float]] = [[] for _ in benches]
        order = list(range(len(benches)))
        for r in range(rounds):
            for i in order[r % len(order):] + order[: r % len(order)]:
                more_pp, more_tg = _samples(benches[i], bench["repetitions"])
                pp[i] += more_pp
                tg[i] += more_tg
        return {"status": "ok", "pp_samples": pp, "tg_samples": tg, "peak_rss": _peak_rss()}
    except DecodeError as exc:
        return {"status": "context_error", "message": f"llama_decode returned {exc.code}"}
    finally:
        for ctx in contexts:
            worker.free_context(ctx)
        for model in models.values():
            lc.llama_model_free(model)
        _log(f"{LOG_MARK} paired measurement ends\n")


def _set_fields(params: Any, struct: str, settings: Settings) -> None:
    """Every llama_model_params / llama_context_params field the dimension table names; a value of
    None leaves llama.cpp's default (a thread count left to llama.cpp)."""
    for dim in DIMENSIONS:
        if dim.c_api is not None and dim.c_api.struct == struct:
            value = dim.c_api.value(settings)
            if value is not None:
                setattr(params, dim.c_api.field, value)


class DecodeError(Exception):
    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(f"llama_decode returned {code}")




_TRIALS = {"measured": 0, "reset": False}


def _reset_peak_rss() -> None:
    _TRIALS["measured"] += 1
    try:  # Linux: writing 5 resets VmHWM, so each trial reports its own peak
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        _TRIALS["reset"] = True
    except OSError:
        _TRIALS["reset"] = False


def _peak_rss() -> int | None:
    from .process import status_bytes

    peak = status_bytes("VmHWM")
    if peak is not None and (_TRIALS["reset"] or _TRIALS["measured"] <= 1):
        return peak
    if _TRIALS["measured"] > 1:
        # ru_maxrss (macOS) and an unreset VmHWM are the peak of the worker's whole life: in a reused
        # worker that is an earlier trial's; the parent's RSS sampler gives this trial's instead
        return None
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
    except Exception:
        return None


def main() -> None:
    # Keep the protocol on a private descriptor; point fd 1 at the log like fd 2.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    from .process import Watchdog

    watchdog = Watchdog.from_environment()
    watchdog.start()  # before llama.cpp loads: a tuner killed during the import is noticed too
    worker = Worker(reply_fd)
    worker.watchdog = watchdog
    limit = os.environ.get("OFFLOAD_TUNER_WORKER_MEMORY_LIMIT")
    if limit:
        # --memory-limit, and the tests of host out-of-memory: after llama.cpp's libraries are
        # mapped, the trial may map this much more (weights, KV cache, buffers, thread stacks).
        from .process import cap_address_space

        cap_address_space(int(limit))
    worker.serve()


if __name__ == "__main__":
    main()
