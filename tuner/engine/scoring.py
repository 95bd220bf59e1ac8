"""Scoring a text with llama.cpp's logits, as ``llama-perplexity --kl-divergence`` does.

The method (tools/perplexity/perplexity.cpp, llama.cpp as vendored by llama-cpp-python 0.3.36):
the whole corpus is tokenized with the model's own tokenizer (``add_special`` on, so BOS first where
the vocabulary adds one; special tokens not parsed; one trailing newline dropped, as ``-f`` reads a
file), cut into chunks of ``n_ctx`` tokens; each chunk is decoded from an empty cache with its first
token replaced by BOS (where the vocabulary adds one), and only the second half is scored: the
logits at positions ``n_ctx/2 .. n_ctx-2`` predict tokens ``n_ctx/2+1 .. n_ctx-1``, so every scored
token has at least ``n_ctx/2`` tokens of context.

Two passes, each in the isolated worker (``score_corpus``, request op ``"score"``):

- the **reference pass** keeps the reference's distribution at each scored position in a compact
  form: the fewest most-likely tokens holding ``1 - tail_mass`` of the probability (at most
  ``max_top`` of them), their log-probabilities (float32) and the mass of all the others as one
  number. A 262k-token vocabulary costs kilobytes per token instead of llama.cpp's 512 KiB.
  ``exact=True`` also keeps every log-probability (small vocabularies: tests and benchmarks).
- the **compare pass** decodes the same tokens with another model and, per scored token, computes
  the KL divergence from the reference (``KL(P_ref || Q)``), both negative log-likelihoods and
  whether the most likely tokens agree.

The KL from the compact form is the KL between the two distributions with the tail merged into one
outcome. By the log-sum inequality that never exceeds the exact KL, and for logit noise spread
evenly over the vocabulary (quantization error) it falls short by about the tail's share of the
mass: ``tail_mass = 1e-4`` keeps it well inside 1% (tests/test_quality.py measures it).

Both passes write a ``.npz`` file (``FORMAT``); the worker replies with counts, never with arrays.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

FORMAT = "offload-tuner scored text 1"
TAIL_MASS = 1e-4
MAX_TOP = 2048
_BLOCK = 16  # rows of logits turned into log-probabilities at once (bounded memory for big vocabularies)


@dataclass(frozen=True)
class ScoringJob:
    """One pass over a text. ``reference`` names a reference pass's file: then this is a compare pass."""

    corpus: str
    out: str
    n_ctx: int = 512
    chunks: int = 20
    reference: str | None = None
    exact: bool = False
    tail_mass: float = TAIL_MASS
    max_top: int = MAX_TOP
    meta: dict[str, Any] | None = None  # written into the file as is (the caller's cache key)
    # the corpus's bytes this pass reads, from its start (corpus_bytes_needed: what the chunks need)
    corpus_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    @property
    def rows_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.first

    @property
    def tokens_needed(self) -> int:
        return self.n_ctx * self.chunks


# A token of a llama.cpp vocabulary is a few bytes of text; the longest (runs of spaces, code
# indentation) are a few dozen. So the chunks' tokens lie in the first 64 bytes per token of the
# corpus, and no more is read: a 1 GB corpus took 13 GB of memory to tokenize whole.
MAX_BYTES_PER_TOKEN = 64
# ... and never more than this, whatever n_ctx x chunks asks (a tokenized GiB is ~2 GiB of ints)
MAX_CORPUS_BYTES = 1 << 30


def corpus_bytes_needed(n_ctx: int, chunks: int) -> int:
    """How much of a corpus a pass of ``chunks`` chunks of ``n_ctx`` tokens reads, from its start."""
    return min(MAX_CORPUS_BYTES, n_ctx * chunks * MAX_BYTES_PER_TOKEN)


@dataclass
class ScoringResult:
    """How a pass ended. ``outcome`` is a trial outcome (ok, oom, crash, timeout, load_error,
    bad_settings); ``corpus_tokens``/``tokens_needed`` are set when the corpus was too short."""

    outcome: Any  # tuner.engine.outcome.Outcome
    message: str
    job: ScoringJob
    corpus_tokens: int | None = None
    tokens_needed: int | None = None
    rows: int = 0
    n_vocab: int | None = None
    bytes: int = 0
    seconds: float = 0.0
    mean_entries: float | None = None
    log: str = ""

    @property
    def ok(self) -> bool:
        return getattr(self.outcome, "value", self.outcome) == "ok"


# -- the math (numpy; no llama.cpp) -----------------------------------------------------------------


def log_softmax(logits: Any) -> Any:
    """Rows of logits (float32) -> log-probabilities (float64)."""
    import numpy as np

    x = np.asarray(logits, dtype=np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


class ReferenceBuilder:
    """Collects the reference's compact distributions, row by row."""

    def __init__(self, n_vocab: int, tail_mass: float, max_top: int, exact: bool) -> None:
        self.n_vocab, self.tail_mass, self.max_top, self.exact = n_vocab, tail_mass, min(max_top, n_vocab), exact
        self.ids: list[Any] = []
        self.logp: list[Any] = []
        self.counts: list[int] = []
        self.rest: list[float] = []
        self.top1: list[int] = []
        self.nll: list[float] = []
        self.dense: list[Any] = []

    def add(self, logits: Any, next_tokens: Any) -> None:
        import numpy as np

        for start in range(0, len(next_tokens), _BLOCK):
            block = log_softmax(logits[start : start + _BLOCK])
            for lp, token, row in zip(block, next_tokens[start : start + _BLOCK], logits[start : start + _BLOCK]):
                k = self.max_top
                if k < self.n_vocab:
                    candidates = np.argpartition(-lp, k - 1)[:k]
                else:
                    candidates = np.arange(self.n_vocab)
                order = candidates[np.argsort(-lp[candidates], kind="stable")]
                mass = np.cumsum(np.exp(lp[order]))
                keep = min(int(np.searchsorted(mass, 1.0 - self.tail_mass)) + 1, len(order))
                self.ids.append(order[:keep].astype(np.int32))
                self.logp.append(lp[order[:keep]].astype(np.float32))
                self.counts.append(keep)
                # every token kept: no tail (1 - the sum would be rounding noise)
                self.rest.append(0.0 if keep == self.n_vocab else max(0.0, 1.0 - float(mass[keep - 1])))
                self.top1.append(int(np.argmax(row)))  # llama.cpp's: the first of equal maxima
                self.nll.append(-float(lp[int(token)]))
                if self.exact:
                    self.dense.append(lp.astype(np.float32))

    def arrays(self) -> dict[str, Any]:
        import numpy as np

        offsets = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=offsets[1:])
        out = {
            "offsets": offsets,
            "ids": np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32),
            "logp": np.concatenate(self.logp) if self.logp else np.zeros(0, np.float32),
            "rest": np.asarray(self.rest, dtype=np.float64),
            "top1": np.asarray(self.top1, dtype=np.int32),
            "nll": np.asarray(self.nll, dtype=np.float64),
        }
        if self.exact:
            out["dense"] = np.stack(self.dense) if self.dense else np.zeros((0, self.n_vocab), np.float32)
        return out


class Comparer:
    """Per scored token of another model: KL from the reference, NLLs, top-1 agreement."""

    def __init__(self, reference: dict[str, Any]) -> None:
        self.ref = reference
        self.row = 0
        self.kl: list[float] = []
        self.kl_exact: list[float] = []
        self.nll: list[float] = []
        self.same_top: list[bool] = []

    def add(self, logits: Any, next_tokens: Any) -> None:
        import numpy as np

        ref = self.ref
        offsets, ids, logp, rest = ref["offsets"], ref["ids"], ref["logp"], ref["rest"]
        dense = ref.get("dense")
        for start in range(0, len(next_tokens), _BLOCK):
            block = log_softmax(logits[start : start + _BLOCK])
            for lq64, token, row in zip(block, next_tokens[start : start + _BLOCK], logits[start : start + _BLOCK]):
                r = self.row
                self.row += 1
                # The reference's log-probabilities were stored as float32: compare like with like,
                # so a model against itself gives exactly 0.
                lq = lq64.astype(np.float32).astype(np.float64)
                keep = ids[offsets[r] : offsets[r + 1]]
                lp = logp[offsets[r] : offsets[r + 1]].astype(np.float64)
                p = np.exp(lp)
                kl = float(np.dot(p, lp - lq[keep]))
                rest_p = float(rest[r])
                if rest_p > 0.0:
                    rest_q = max(1.0 - float(np.exp(lq64[keep]).sum()), 1e-300)
                    kl += rest_p * (math.log(rest_p) - math.log(rest_q))
                self.kl.append(kl)
                self.nll.append(-float(lq64[int(token)]))
                self.same_top.append(int(np.argmax(row)) == int(ref["top1"][r]))
                if dense is not None:
                    full = dense[r].astype(np.float64)
                    self.kl_exact.append(float(np.dot(np.exp(full), full - lq)))

    def arrays(self) -> dict[str, Any]:
        import numpy as np

        out = {
            "kl": np.asarray(self.kl, dtype=np.float64),
            "nll": np.asarray(self.nll, dtype=np.float64),
            "nll_base": np.asarray(self.ref["nll"][: self.row], dtype=np.float64),
            "same_top": np.asarray(self.same_top, dtype=bool),
        }
        if self.kl_exact:
            out["kl_exact"] = np.asarray(self.kl_exact, dtype=np.float64)
        return out


# -- files ------------------------------------------------------------------------------------------


def save(path: str, arrays: dict[str, Any], meta: dict[str, Any]) -> int:
    """Write arrays and metadata as one ``.npz``, atomically. Returns its size in bytes."""
    import numpy as np

    tmp = f"{path}.part"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "wb") as handle:
        np.savez(handle, meta=np.asarray(json.dumps({"format": FORMAT, **meta})), **arrays)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return os.path.getsize(path)


def load(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a file written by ``save``: (arrays, metadata). ``ValueError`` if it is not one."""
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{path}: not a scored-text file ({exc})") from None
    try:
        meta = json.loads(str(arrays.pop("meta")))
    except (KeyError, ValueError):
        raise ValueError(f"{path}: no metadata") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: written by another version ({meta.get('format') if isinstance(meta, dict) else meta!r})")
    return arrays, meta


def check_reference(arrays: dict[str, Any], meta: dict[str, Any]) -> None:
    """A reference file must be whole and self-consistent before a compare pass indexes into it."""
    rows = int(meta.get("rows", -1))
    offsets = arrays.get("offsets")
    for name in ("offsets", "ids", "logp", "rest", "top1", "nll", "tokens"):
        if name not in arrays:
            raise ValueError(f"missing {name}")
    if rows < 0 or len(offsets) != rows + 1 or len(arrays["rest"]) != rows or len(arrays["nll"]) != rows:
        raise ValueError("row counts disagree")
    if int(offsets[-1]) != len(arrays["ids"]) or len(arrays["ids"]) != len(arrays["logp"]) or (offsets[1:] < offsets[:-1]).any():
        raise ValueError("offsets disagree with the stored entries")
    n_vocab = int(meta.get("n_vocab", 0))
    if len(arrays["ids"]) and (int(arrays["ids"].min()) < 0 or int(arrays["ids"].max()) >= n_vocab):
        raise ValueError("token ids out of the vocabulary")


# -- the worker side (runs inside tuner.engine.worker; handed the worker, never imports llama_cpp) --


def tokenize(lc: Any, vocab: Any, text: bytes) -> list[int]:
    """common_tokenize(ctx, text, add_special=true, parse_special=false), as llama-perplexity does."""
    n = len(text) + 2
    buf = (lc.llama_token * n)()
    got = lc.llama_tokenize(vocab, text, len(text), buf, n, True, False)
    if got < 0:
        n = -got
        buf = (lc.llama_token * n)()
        got = lc.llama_tokenize(vocab, text, len(text), buf, n, True, False)
    return list(buf[: max(got, 0)])


def score_corpus(worker: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The worker's ``score`` op: one reference or compare pass. Sends progress lines, then returns
    the reply (``status`` ok, or bad_settings / load_error / context_error with a message)."""
    import numpy as np

    lc = worker.llama_cpp
    job = ScoringJob(**request["job"])
    s = dict(request["settings"])
    started = time.perf_counter()
    reused, error, load_s = worker.load_model(s)
    if error:
        return {"status": "load_error", "message": error, "load_s": load_s}
    vocab = lc.llama_model_get_vocab(worker.model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab))
    bos = lc.llama_vocab_bos(vocab)
    reference: dict[str, Any] | None = None
    if job.reference:
        try:
            reference, ref_meta = load(job.reference)
            check_reference(reference, ref_meta)
        except ValueError as exc:
            return {"status": "bad_settings", "message": f"the reference distributions cannot be used: {exc}"}
        if int(ref_meta["n_vocab"]) != n_vocab:
            return {"status": "bad_settings", "message": f"vocabularies differ: {n_vocab} tokens here, {ref_meta['n_vocab']} in the reference"}
        if int(ref_meta["n_ctx"]) != job.n_ctx or int(ref_meta["chunks"]) != job.chunks:
            return {"status": "bad_settings", "message": "the reference was scored with another n_ctx or chunk count"}
        tokens = [int(t) for t in reference["tokens"]]
        n_corpus = int(ref_meta["corpus_tokens"])
    else:
        with open(job.corpus, "rb") as handle:
            text = handle.read(job.corpus_bytes if job.corpus_bytes is not None else -1)
        if text.endswith(b"\n"):  # common/arg.cpp -f: "if (params.prompt.back() == '\n') pop_back()"
            text = text[:-1]
        tokens = tokenize(lc, vocab, text)
        n_corpus = len(tokens)
        if n_corpus < job.tokens_needed:
            return {"status": "bad_settings", "corpus_tokens": n_corpus, "tokens_needed": job.tokens_needed,
                    "message": f"the corpus tokenizes to {n_corpus} tokens; {job.chunks} chunks of {job.n_ctx} need {job.tokens_needed}"}
        tokens = tokens[: job.tokens_needed]

    worker.send({"progress": {"chunk": 0, "of": job.chunks, "corpus_tokens": n_corpus}})  # the text is usable
    ctx_settings = {**s, "n_ctx": job.n_ctx, "n_batch": job.n_ctx, "n_ubatch": min(s.get("n_ubatch") or 512, job.n_ctx)}
    ctx = worker.new_context(ctx_settings)
    if not ctx:
        return {"status": "context_error", "message": "llama.cpp failed to create the context", "load_s": load_s}
    batch = lc.llama_batch_init(job.n_ctx, 0, 1)
    builder = ReferenceBuilder(n_vocab, job.tail_mass, job.max_top, job.exact) if reference is None else None
    comparer = Comparer(reference) if reference is not None else None
    first, rows = job.first, job.rows_per_chunk
    try:
        memory = lc.llama_get_memory(ctx)
        for chunk in range(job.chunks):
            start = chunk * job.n_ctx
            piece = tokens[start : start + job.n_ctx]
            if add_bos:
                piece = [bos] + piece[1:]
            lc.llama_memory_clear(memory, True)
            for i, token in enumerate(piece):
                batch.token[i] = token
                batch.pos[i] = i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if i >= first else 0
            batch.n_tokens = len(piece)
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                return {"status": "context_error", "message": f"llama_decode returned {rc} on chunk {chunk + 1}", "load_s": load_s}
            n_out = job.n_ctx - first
            pointer = lc.llama_get_logits(ctx)
            logits = np.ctypeslib.as_array(pointer, shape=(n_out * n_vocab,)).reshape(n_out, n_vocab)[:rows].copy()
            next_tokens = np.asarray(tokens[start + first + 1 : start + job.n_ctx], dtype=np.int64)
            (builder or comparer).add(logits, next_tokens)  # type: ignore[union-attr]
            worker.send({"progress": {"chunk": chunk + 1, "of": job.chunks}})
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
    meta = {**(job.meta or {}), "n_ctx": job.n_ctx, "chunks": job.chunks, "n_vocab": n_vocab, "rows": rows * job.chunks,
            "corpus_tokens": n_corpus, "tail_mass": job.tail_mass, "max_top": job.max_top, "exact": job.exact}
    if builder is not None:
        arrays = builder.arrays()
        arrays["tokens"] = np.asarray(tokens, dtype=np.int32)
        entries = int(arrays["offsets"][-1])
        meta["mean_entries"] = entries / max(1, len(builder.counts))
        meta["compact_bytes"] = sum(int(a.nbytes) for name, a in arrays.items() if name != "dense")
        # how much of the probability the compact form merged: more than tail_mass only where
        # max_top tokens were not enough (a flat distribution over a large vocabulary)
        meta["max_rest"] = float(arrays["rest"].max()) if len(arrays["rest"]) else 0.0
    else:
        arrays = comparer.arrays()  # type: ignore[union-attr]
    size = save(job.out, arrays, meta)
    return {"status": "ok", "corpus_tokens": n_corpus, "rows": rows * job.chunks, "n_vocab": n_vocab, "bytes": size,
            "seconds": time.perf_counter() - started, "load_s": load_s, "reused_model": reused,
            "mean_entries": meta.get("mean_entries")}


__all__ = ["FORMAT", "MAX_TOP", "TAIL_MASS", "MAX_BYTES_PER_TOKEN", "MAX_CORPUS_BYTES", "corpus_bytes_needed", "ScoringJob", "ScoringResult", "check_reference", "load", "log_softmax", "save", "score_corpus"]
