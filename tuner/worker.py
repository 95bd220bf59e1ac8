"""The trial worker: the only process that imports llama_cpp. Run as ``python -m tuner.worker``.

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

LOG_MARK = "offload-tuner:"


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

    def serve(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            request = json.loads(line)
            if request.get("op") == "exit":
                break
            try:
                self.send(self.trial(request))
            except Exception as exc:  # a Python-side failure is a reply, not a silent death
                _log(traceback.format_exc())
                self.send({"status": "error", "message": f"{type(exc).__name__}: {exc}"})
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
        lc = self.llama_cpp
        key = json.dumps([s[k] for k in MODEL_KEYS])
        if self.model is not None and key == self.model_key:
            return True, None, 0.0
        self.free_model()
        if s.get("rpc_servers"):
            from .rpc import register_servers

            new = [e for e in s["rpc_servers"] if e not in self.registered_rpc]
            if new:
                register_servers(new)
                self.registered_rpc.update(new)
        params = lc.llama_model_default_params()
        params.n_gpu_layers = s["n_gpu_layers"]
        params.split_mode = {"none": 0, "layer": 1, "row": 2}[s["split_mode"]]
        params.main_gpu = s["main_gpu"]
        use_mmap, use_mlock = s["use_mmap"], s["use_mlock"]
        params.load_mode = (
            lc.LLAMA_LOAD_MODE_MMAP_MLOCK if use_mmap and use_mlock
            else lc.LLAMA_LOAD_MODE_MLOCK if use_mlock
            else lc.LLAMA_LOAD_MODE_MMAP if use_mmap
            else lc.LLAMA_LOAD_MODE_NONE
        )
        keep: list[Any] = []
        if s.get("tensor_split"):
            n = lc.llama_max_devices()
            split = (ctypes.c_float * n)(*([float(x) for x in s["tensor_split"]] + [0.0] * n)[:n])
            params.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
            keep.append(split)
        if s.get("tensor_overrides"):
            from .ggml import OverrideArray

            overrides = OverrideArray(tuple(s["tensor_overrides"]))
            params.tensor_buft_overrides = overrides.address
            keep.append(overrides)
        started = time.perf_counter()
        model = lc.llama_model_load_from_file(s["model_path"].encode(), params)
        seconds = time.perf_counter() - started
        if not model:
            return False, "llama.cpp failed to load the model", seconds
        self.model, self.model_key, self.keepalive = model, key, keep
        return False, None, seconds

    def new_context(self, s: dict[str, Any]):
        lc = self.llama_cpp
        params = lc.llama_context_default_params()
        params.n_ctx = s["n_ctx"]
        params.n_batch = s["n_batch"]
        params.n_ubatch = s["n_ubatch"]
        params.n_seq_max = 1
        if s.get("n_threads"):
            params.n_threads = s["n_threads"]
        if s.get("n_threads_batch") or s.get("n_threads"):
            params.n_threads_batch = s.get("n_threads_batch") or s["n_threads"]
        params.flash_attn_type = {"auto": -1, "off": 0, "on": 1}[s["flash_attn"]]
        params.type_k = s["type_k_id"]
        params.type_v = s["type_v_id"]
        params.offload_kqv = s["offload_kqv"]
        params.op_offload = s["op_offload"]
        params.no_perf = False
        _log(f"{LOG_MARK} context begins\n")
        return lc.llama_init_from_model(self.model, params)

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
        ctx = self.new_context(s)
        if not ctx:
            return {"status": "context_error", "message": "llama.cpp failed to create the context", "load_s": load_s, "reused_model": reused}
        try:
            vocab = lc.llama_model_get_vocab(self.model)
            n_vocab = lc.llama_vocab_n_tokens(vocab)
            bos = lc.llama_vocab_bos(vocab) if lc.llama_vocab_get_add_bos(vocab) else -1
            rng = random.Random(bench.get("seed", 1234))
            n_ctx = lc.llama_n_ctx(ctx)
            n_batch = lc.llama_n_batch(ctx)
            P, G, D = bench["n_prompt"], bench["n_gen"], bench["depth"]
            reps, warmup = bench["repetitions"], bench.get("warmup", True)
            if D + max(P, G) > n_ctx:
                return {"status": "bad_settings", "message": f"depth {D} + {max(P, G)} tokens exceed n_ctx {n_ctx}"}
            memory = lc.llama_get_memory(ctx)

            def decode(tokens: list[int]) -> None:
                arr = (lc.llama_token * len(tokens))(*tokens)
                rc = lc.llama_decode(ctx, lc.llama_batch_get_one(arr, len(tokens)))
                if rc != 0:
                    raise DecodeError(rc)

            def prompt(n: int) -> None:
                tokens = [rng.randrange(n_vocab) for _ in range(n)]
                if bos >= 0 and tokens:
                    tokens[0] = bos
                for i in range(0, n, n_batch):
                    decode(tokens[i : i + n_batch])
                lc.llama_synchronize(ctx)

            def gen(n: int) -> None:
                token = bos if bos >= 0 else rng.randrange(n_vocab)
                for _ in range(n):
                    decode([token])
                    lc.llama_synchronize(ctx)
                    token = rng.randrange(n_vocab)

            def timed(fn, n: int) -> float:
                lc.llama_memory_clear(memory, False)
                if D:
                    prompt(D)
                start = time.perf_counter_ns()
                fn(n)
                elapsed = time.perf_counter_ns() - start
                return n / (elapsed / 1e9)

            if warmup:
                # A full-size warm-up: llama-bench's one-batch warm-up left our first timed pp
                # 2x slow (first touch of mapped weights and compute buffers at full width).
                if P:
                    timed(prompt, P)
                if G:
                    timed(gen, min(G, 8))
            pp = [timed(prompt, P) for _ in range(reps)] if P else []
            tg = [timed(gen, G) for _ in range(reps)] if G else []
            return {
                "status": "ok",
                "pp_samples": pp,
                "tg_samples": tg,
                "load_s": load_s,
                "reused_model": reused,
                "n_ctx": n_ctx,
                "peak_rss": _peak_rss(),
            }
        except DecodeError as exc:
            # llama_decode: 1 = no KV slot, 2 = aborted, -1 = invalid batch, < -1 = compute error
            # (an allocation failure during the graph compute lands here)
            return {"status": "context_error", "message": f"llama_decode returned {exc.code}", "load_s": load_s, "reused_model": reused}
        finally:
            lc.llama_free(ctx)
            _log(f"{LOG_MARK} trial {request.get('trial_id', '?')} ends\n")


class DecodeError(Exception):
    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(f"llama_decode returned {code}")


MODEL_KEYS = ("model_path", "n_gpu_layers", "split_mode", "main_gpu", "tensor_split", "use_mmap", "use_mlock", "tensor_overrides", "rpc_servers")


def _reset_peak_rss() -> None:
    try:  # Linux: writing 5 resets VmHWM, so each trial reports its own peak
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
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
    worker = Worker(reply_fd)
    limit = os.environ.get("OFFLOAD_TUNER_WORKER_MEMORY_LIMIT")
    if limit:
        # --memory-limit, and the tests of host out-of-memory: after llama.cpp's libraries are
        # mapped, the trial may map this much more (weights, KV cache, buffers, thread stacks).
        from .process import cap_address_space

        cap_address_space(int(limit))
    worker.serve()


if __name__ == "__main__":
    main()
