"""What a quantization costs: KL divergence, top-1 agreement and perplexity against a reference.

    report = quality("model-F16.gguf", variants=["model-Q8_0.gguf", "model-Q4_K_M.gguf"])
    report.variants["model-Q4_K_M.gguf"].kl_mean, report.to_dict()

The method is llama.cpp's ``llama-perplexity --kl-divergence`` (see ``tuner.engine.scoring``): the
text is tokenized with the model's own tokenizer and cut into chunks of ``n_ctx`` tokens, the second
half of each chunk is scored, and every number comes from llama.cpp's logits in the isolated worker.
The reference is the highest-precision file given (most bits per weight) unless one is named.

Measured per variant, over the scored tokens (``chunks * (n_ctx - 1 - n_ctx/2)`` of them):

- ``kl``: KL(P_reference || Q_variant) per token: mean, median, p99 (llama.cpp's percentile: linear
  between the sorted values) and a 95% confidence interval of the mean, taken over tokens as
  llama-perplexity's ``±`` is (tokens of one chunk share their context, so it is on the narrow side);
- ``top1_agreement``: the share of tokens where both models' most likely next token is the same;
- ``ppl``: exp(mean negative log-likelihood) with a 95% interval (from the interval of the mean NLL);
- ``ppl_ratio``: PPL(variant) / PPL(reference), from the per-token NLL differences, so the
  correlation between the two is accounted for (llama.cpp's ``Mean PPL(Q)/PPL(base)``), with its
  interval in ``ppl_ratio_ci``.

Caches, in ``<data>/quality/``: the reference's compact distributions (``reference-KEY.npz``, keyed by
the reference file's sha256, the corpus's sha256, n_ctx, chunks and the compact form's settings; its
size is in the report) and each variant's per-token figures (``variant-KEY.npz``, keyed by the
variant's sha256 and the reference key), so measuring again costs nothing.

The study's attributes (``tune`` with a quality budget or ``--quantize``; the HTML report reads them):

- study user attribute ``quality``: ``QualityReport.to_dict()`` (the issue's JSON, below);
- study user attribute ``quality_budget``: ``{"max_kl", "max_ppl_increase", "min_tg", "min_pp"}``
  (null where not asked);
- trial user attribute ``quality``: for the trial's variant, ``{"file_name", "kl_mean", "kl_p99",
  "top1_agreement", "ppl", "ppl_ratio", "bits_per_weight"}``.

The JSON (``QualityReport.to_dict()``)::

    {"reference": PATH, "reference_sha256": HEX, "corpus": {"path", "sha256", "tokens"}, "n_ctx", "chunks",
     "scored_tokens", "cache": {"path", "bytes", "reused", "n_vocab", "entries_per_token", "max_rest"},
     "variants": {FILE_NAME: {"path", "sha256", "quantization", "bits_per_weight",
                              "kl": {"mean", "median", "p99", "ci_low", "ci_high"}, "top1_agreement",
                              "ppl": {"value", "ci_low", "ci_high"}, "ppl_ratio",
                              "ppl_ratio_ci": {"ci_low", "ci_high"}, "reused", "seconds"}}}

The reference is in ``variants`` too (KL 0, agreement 1, ratio 1: by definition, not measured again).
Quality is measured with an f16 KV cache: it is the weights' quantization that is measured here.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ModelError, QualityError
from ..model.inspect import ModelInfo, inspect
from ..engine.scoring import MAX_TOP, TAIL_MASS, ScoringJob, ScoringResult, check_reference, corpus_bytes_needed, load
from ..engine.settings import Settings
from ..paths import data_dir

DEFAULT_CHUNKS = 20
DEFAULT_CTX = 512
Event = dict[str, Any]


def default_corpus() -> Path:
    """The corpus shipped with the package: Genesis, King James Version (public domain; see
    ``tuner/data/README.md``)."""
    return Path(__file__).resolve().parent.parent / "data" / "genesis-kjv.txt"


def quality_dir() -> Path:
    path = data_dir() / "quality"
    path.mkdir(parents=True, exist_ok=True)
    return path


def bits_per_weight(info: ModelInfo) -> float:
    """The file's bits per weight, from its tensor table (every tensor, at its own type)."""
    elements = sum(t.n_elements for t in info.tensors)
    return sum(t.n_bytes for t in info.tensors) * 8 / elements if elements else 0.0


def choose_reference(models: Sequence[ModelInfo]) -> ModelInfo:
    """The highest-precision model: most bits per weight (the first given wins a tie)."""
    return max(models, key=bits_per_weight)


# -- the report -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VariantQuality:
    path: str
    sha256: str
    quantization: str
    bits_per_weight: float
    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_ci_low: float
    kl_ci_high: float
    top1_agreement: float
    ppl: float
    ppl_ci_low: float
    ppl_ci_high: float
    ppl_ratio: float
    ppl_ratio_ci_low: float
    ppl_ratio_ci_high: float
    scored_tokens: int
    reused: bool = False
    seconds: float = 0.0
    kl_exact: float | None = None  # the mean KL from every log-probability (``exact=True`` only)

    @property
    def file_name(self) -> str:
        return Path(self.path).name

    @property
    def ppl_increase(self) -> float:
        """Perplexity's rise over the reference, in percent."""
        return (self.ppl_ratio - 1.0) * 100.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "quantization": self.quantization,
            "bits_per_weight": self.bits_per_weight,
            "kl": {"mean": self.kl_mean, "median": self.kl_median, "p99": self.kl_p99,
                   "ci_low": self.kl_ci_low, "ci_high": self.kl_ci_high},
            "top1_agreement": self.top1_agreement,
            "ppl": {"value": self.ppl, "ci_low": self.ppl_ci_low, "ci_high": self.ppl_ci_high},
            "ppl_ratio": self.ppl_ratio,
            "ppl_ratio_ci": {"ci_low": self.ppl_ratio_ci_low, "ci_high": self.ppl_ratio_ci_high},
            "reused": self.reused,
            "seconds": self.seconds,
            **({"kl_exact": self.kl_exact} if self.kl_exact is not None else {}),
        }

    def summary(self) -> dict[str, Any]:
        """What a trial of this variant carries (trial attribute ``quality``)."""
        return {"file_name": self.file_name, "kl_mean": self.kl_mean, "kl_p99": self.kl_p99,
                "top1_agreement": self.top1_agreement, "ppl": self.ppl, "ppl_ratio": self.ppl_ratio,
                "bits_per_weight": self.bits_per_weight}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VariantQuality":
        return cls(path=data["path"], sha256=data["sha256"], quantization=data["quantization"],
                   bits_per_weight=data["bits_per_weight"], kl_mean=data["kl"]["mean"], kl_median=data["kl"]["median"],
                   kl_p99=data["kl"]["p99"], kl_ci_low=data["kl"]["ci_low"], kl_ci_high=data["kl"]["ci_high"],
                   top1_agreement=data["top1_agreement"], ppl=data["ppl"]["value"], ppl_ci_low=data["ppl"]["ci_low"],
                   ppl_ci_high=data["ppl"]["ci_high"], ppl_ratio=data["ppl_ratio"],
                   ppl_ratio_ci_low=data["ppl_ratio_ci"]["ci_low"], ppl_ratio_ci_high=data["ppl_ratio_ci"]["ci_high"],
                   scored_tokens=data.get("scored_tokens", 0), reused=data.get("reused", False),
                   seconds=data.get("seconds", 0.0), kl_exact=data.get("kl_exact"))


@dataclass
class QualityReport:
    reference: str
    reference_sha256: str
    corpus_path: str
    corpus_sha256: str
    corpus_tokens: int
    n_ctx: int
    chunks: int
    scored_tokens: int
    cache_path: str
    cache_bytes: int
    cache_reused: bool
    variants: dict[str, VariantQuality] = field(default_factory=dict)
    n_vocab: int = 0
    entries_per_token: float = 0.0  # tokens the compact form keeps per scored position, on average
    max_rest: float = 0.0  # the most probability it merged into "the rest" at one position

    def by_path(self, path: str | Path) -> VariantQuality | None:
        wanted = str(Path(path).resolve())
        for v in self.variants.values():
            if str(Path(v.path).resolve()) == wanted:
                return v
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "reference_sha256": self.reference_sha256,
            "corpus": {"path": self.corpus_path, "sha256": self.corpus_sha256, "tokens": self.corpus_tokens},
            "n_ctx": self.n_ctx,
            "chunks": self.chunks,
            "scored_tokens": self.scored_tokens,
            "cache": {"path": self.cache_path, "bytes": self.cache_bytes, "reused": self.cache_reused,
                      "n_vocab": self.n_vocab, "entries_per_token": self.entries_per_token, "max_rest": self.max_rest},
            "variants": {name: v.to_dict() for name, v in self.variants.items()},
        }


def summarize(path: str, sha256: str, info: ModelInfo, arrays: dict[str, Any], *, reused: bool, seconds: float) -> VariantQuality:
    """A variant's figures from its per-token arrays (``kl``, ``nll``, ``nll_base``, ``same_top``)."""
    import numpy as np

    kl, nll, base = arrays["kl"], arrays["nll"], arrays["nll_base"]
    if len(kl) == 0:
        raise QualityError(f"{path}: no token was scored")
    kl_stats = _mean_ci(kl)
    nll_stats = _mean_ci(nll)
    diff = _mean_ci(nll - base)
    return VariantQuality(
        path=path, sha256=sha256, quantization=info.quantization, bits_per_weight=bits_per_weight(info),
        kl_mean=kl_stats[0], kl_median=float(np.median(kl)), kl_p99=float(np.percentile(kl, 99)),
        kl_ci_low=kl_stats[1], kl_ci_high=kl_stats[2], top1_agreement=float(np.mean(arrays["same_top"])),
        ppl=math.exp(nll_stats[0]), ppl_ci_low=math.exp(nll_stats[1]), ppl_ci_high=math.exp(nll_stats[2]),
        ppl_ratio=math.exp(diff[0]), ppl_ratio_ci_low=math.exp(diff[1]), ppl_ratio_ci_high=math.exp(diff[2]),
        scored_tokens=int(len(kl)), reused=reused, seconds=seconds,
        kl_exact=float(np.mean(arrays["kl_exact"])) if "kl_exact" in arrays else None,
    )


def _mean_ci(values: Any) -> tuple[float, float, float]:
    """Mean and its 95% confidence interval over the tokens (Student t). The values may be signed
    (NLL differences), so nothing is clamped."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    mean = float(x.mean())
    if len(x) < 2:
        return mean, mean, mean
    half = _t975(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return mean, mean - half, mean + half


def _t975(df: int) -> float:
    """Student t's 97.5% quantile: the normal's, corrected in powers of 1/df (Cornish-Fisher):
    within 1% of the exact value from 3 degrees of freedom up and 0.1% from 6 (a pass scores at
    least 7 tokens), exact in the limit."""
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


# -- measuring --------------------------------------------------------------------------------------


class QualityMeter:
    """Measures models against one reference on one text, through an engine that can score text
    (``engine.score_corpus``: the python engine does). Caches everything in the data folder."""

    def __init__(
        self,
        reference: ModelInfo,
        *,
        corpus: str | Path | None = None,
        n_ctx: int = DEFAULT_CTX,
        chunks: int = DEFAULT_CHUNKS,
        engine: Any = None,
        settings: dict[str, Any] | None = None,
        exact: bool = False,
        tail_mass: float = TAIL_MASS,
        max_top: int = MAX_TOP,
        on_event: Callable[[Event], None] | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        if not isinstance(n_ctx, int) or n_ctx < 16:
            raise QualityError(f"--ctx must be at least 16 tokens, got {n_ctx}")
        if n_ctx % 2:
            raise QualityError(f"--ctx must be even (half of each chunk is context, half is scored), got {n_ctx}")
        if not isinstance(chunks, int) or chunks < 1:
            raise QualityError(f"--chunks must be at least 1, got {chunks}")
        self.reference = reference
        self.n_ctx, self.chunks = n_ctx, chunks
        self.exact, self.tail_mass, self.max_top = exact, tail_mass, max_top
        self.emit = on_event or (lambda event: None)
        self.settings = dict(settings or {})
        self.timeout_s = timeout_s
        self.corpus_bytes = corpus_bytes_needed(n_ctx, chunks)
        self.corpus_path, self.corpus_sha256, self.corpus_bytes = _read_corpus(Path(corpus) if corpus else default_corpus(),
                                                                               self.corpus_bytes)
        self._engine = engine
        self._own_engine = None
        self.hashes: dict[str, str] = {}
        self.report: QualityReport | None = None

    # -- plumbing --

    @property
    def engine(self) -> Any:
        if self._engine is None:
            from ..engine.python import TrialRunner

            self._engine = self._own_engine = TrialRunner(timeout_s=self.timeout_s)
        if not hasattr(self._engine, "score_corpus"):
            raise QualityError(f"this engine ({type(self._engine).__name__}) cannot score text for quality; "
                               "quality is measured with the python engine (llama-cpp-python)")
        return self._engine

    def close(self) -> None:
        if self._own_engine is not None:
            self._own_engine.close()
            self._own_engine = self._engine = None

    def __enter__(self) -> "QualityMeter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def sha256(self, info: ModelInfo) -> str:
        from ..model.filehash import file_sha256

        if info.path not in self.hashes:
            size = info.file_size
            self.hashes[info.path] = file_sha256(
                info.path, on_progress=lambda done, total: self.emit(
                    {"kind": "quality_hash", "path": info.path, "done": done, "total": total}) if size > (1 << 30) else None)
        return self.hashes[info.path]

    def _settings(self, info: ModelInfo, n_gpu_layers: int | None = None) -> Settings:
        base = {"n_gpu_layers": -1, **self.settings}
        if n_gpu_layers is not None:
            base["n_gpu_layers"] = n_gpu_layers
        return Settings(model_path=info.path, n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=min(512, self.n_ctx),
                        **{k: v for k, v in base.items() if k not in ("model_path", "n_ctx", "n_batch", "n_ubatch")})

    def _run(self, info: ModelInfo, job: ScoringJob, role: str) -> ScoringResult:
        def progress(p: dict[str, Any]) -> None:
            self.emit({"kind": "quality_pass", "role": role, "path": info.path, "chunk": p.get("chunk"), "of": p.get("of")})

        result = self.engine.score_corpus(self._settings(info), job, on_progress=progress)
        if getattr(result.outcome, "value", None) == "oom" and self._settings(info).n_gpu_layers != 0:
            # Quality does not depend on where the layers run: a model that does not fit on the
            # GPUs whole is scored on the CPU instead (slower, same figures within float noise).
            self.emit({"kind": "quality_fallback", "path": info.path, "reason": result.message})
            self.settings["n_gpu_layers"] = 0
            result = self.engine.score_corpus(self._settings(info), job, on_progress=progress)
        if result.corpus_tokens is not None and result.tokens_needed is not None and result.corpus_tokens < result.tokens_needed:
            raise QualityError(
                f"the corpus {self.corpus_path} is too short: {self.chunks} chunks of {self.n_ctx} tokens need "
                f"{result.tokens_needed} tokens, it has {result.corpus_tokens} (with {Path(info.path).name}'s tokenizer); "
                "give a longer --corpus, or fewer --chunks, or a smaller --ctx")
        if not result.ok:
            raise QualityError(f"llama.cpp could not score {Path(info.path).name} ({result.outcome}): {result.message}")
        return result

    # -- the passes --

    def reference_key(self) -> str:
        key = [self.sha256(self.reference), self.corpus_sha256, self.n_ctx, self.chunks, self.tail_mass, self.max_top, self.exact]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()

    def ensure_reference(self) -> tuple[Path, dict[str, Any], bool]:
        """The reference's distributions: from the cache, or computed now. (path, metadata, reused)"""
        key = self.reference_key()
        path = quality_dir() / f"reference-{key[:32]}.npz"
        if path.exists():
            try:
                arrays, meta = load(str(path))
                check_reference(arrays, meta)
                if meta.get("key") == key:
                    self.emit({"kind": "quality_reference", "path": self.reference.path, "cache": str(path),
                               "bytes": path.stat().st_size, "reused": True})
                    return path, meta, True
            except ValueError as exc:
                self.emit({"kind": "quality_cache_bad", "cache": str(path), "reason": str(exc)})
        job = ScoringJob(corpus=self.corpus_path, corpus_bytes=self.corpus_bytes, out=str(path), n_ctx=self.n_ctx, chunks=self.chunks, exact=self.exact,
                         tail_mass=self.tail_mass, max_top=self.max_top,
                         meta={"key": key, "model_sha256": self.sha256(self.reference), "corpus_sha256": self.corpus_sha256})
        self._run(self.reference, job, "reference")
        _, meta = load(str(path))
        self.emit({"kind": "quality_reference", "path": self.reference.path, "cache": str(path),
                   "bytes": path.stat().st_size, "reused": False})
        return path, meta, False

    def measure(self, models: Sequence[ModelInfo]) -> QualityReport:
        """Measure every model in ``models`` (the reference may be among them) against the reference."""
        ref_path, ref_meta, reused = self.ensure_reference()
        ref_key = self.reference_key()
        rows = int(ref_meta["rows"])
        report = QualityReport(
            reference=self.reference.path, reference_sha256=self.sha256(self.reference), corpus_path=self.corpus_path,
            corpus_sha256=self.corpus_sha256, corpus_tokens=int(ref_meta["corpus_tokens"]), n_ctx=self.n_ctx,
            chunks=self.chunks, scored_tokens=rows, cache_path=str(ref_path), cache_bytes=ref_path.stat().st_size,
            cache_reused=reused, n_vocab=int(ref_meta["n_vocab"]), entries_per_token=float(ref_meta.get("mean_entries") or 0.0),
            max_rest=float(ref_meta.get("max_rest") or 0.0),
        )
        ref_arrays, _ = load(str(ref_path))
        own = {"kl": _zeros(rows), "nll": ref_arrays["nll"], "nll_base": ref_arrays["nll"], "same_top": _ones(rows)}
        ordered = [self.reference] + [m for m in models if Path(m.path).resolve() != Path(self.reference.path).resolve()]
        for info in ordered:
            if info is self.reference:
                figures = summarize(info.path, self.sha256(info), info, own, reused=reused, seconds=0.0)
            else:
                figures = self.measure_variant(info, ref_path, ref_key)
            name = Path(info.path).name if Path(info.path).name not in report.variants else info.path
            report.variants[name] = figures
        self.report = report
        return report

    def measure_variant(self, info: ModelInfo, ref_path: Path, ref_key: str) -> VariantQuality:
        """One model against the reference's cached distributions (its own result cached too)."""
        sha = self.sha256(info)
        key = hashlib.sha256(json.dumps([sha, ref_key]).encode()).hexdigest()
        path = quality_dir() / f"variant-{key[:32]}.npz"
        if path.exists():
            try:
                arrays, meta = load(str(path))
                if meta.get("key") == key and len(arrays.get("kl", ())) == int(meta.get("rows", -1)):
                    self.emit({"kind": "quality_variant", "path": info.path, "reused": True})
                    return summarize(info.path, sha, info, arrays, reused=True, seconds=float(meta.get("seconds", 0.0)))
            except ValueError as exc:
                self.emit({"kind": "quality_cache_bad", "cache": str(path), "reason": str(exc)})
        job = ScoringJob(corpus=self.corpus_path, corpus_bytes=self.corpus_bytes, out=str(path), n_ctx=self.n_ctx, chunks=self.chunks,
                         reference=str(ref_path), meta={"key": key, "model_sha256": sha, "reference_key": ref_key})
        result = self._run(info, job, "variant")
        arrays, _ = load(str(path))
        self.emit({"kind": "quality_variant", "path": info.path, "reused": False, "seconds": result.seconds})
        return summarize(info.path, sha, info, arrays, reused=False, seconds=result.seconds)


def _zeros(n: int) -> Any:
    import numpy as np

    return np.zeros(n, dtype=np.float64)


def _ones(n: int) -> Any:
    import numpy as np

    return np.ones(n, dtype=bool)


def _read_corpus(path: Path, limit: int) -> tuple[str, str, int]:
    """(path, sha256, bytes) of the part of a corpus the chunks use: its first ``limit`` bytes (cut
    back to a whole character), which must be UTF-8 text. Anything else is a ``QualityError``. The
    rest of the file is never read (a corpus of 1 GB is read as far as the chunks need)."""
    if not path.exists():
        raise QualityError(f"{path}: no such corpus file")
    if not path.is_file():
        raise QualityError(f"{path}: the corpus must be a text file, not a directory")
    try:
        with open(path, "rb") as handle:
            data = handle.read(limit)
    except OSError as exc:
        raise QualityError(f"{path}: cannot read the corpus: {exc.strerror}") from None
    if not data.strip():
        raise QualityError(f"{path}: the corpus is empty")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if not (exc.reason == "unexpected end of data" and len(data) == limit):
            raise QualityError(f"{path}: the corpus is not UTF-8 text (byte {exc.start} is not valid UTF-8)") from None
        data = data[: exc.start]  # the read ended inside a character
    nul = data.find(b"\x00")
    if nul >= 0:  # valid UTF-8, but no text holds NUL bytes: a binary file (or a disk image) named as a corpus
        raise QualityError(f"{path}: the corpus is not text (byte {nul} is a NUL byte); give a plain text file")
    return str(path), hashlib.sha256(data).hexdigest(), len(data)


# -- the function most callers want -----------------------------------------------------------------


def quality(
    model: str | Path,
    *,
    variants: Sequence[str | Path] = (),
    reference: str | Path | None = None,
    corpus: str | Path | None = None,
    chunks: int = DEFAULT_CHUNKS,
    n_ctx: int = DEFAULT_CTX,
    quantize: Sequence[str] | str = (),
    imatrix: str | Path | None = None,
    allow_requantize: bool = False,
    n_gpu_layers: int = -1,
    n_threads: int | None = None,
    engine: Any = None,
    on_event: Callable[[Event], None] | None = None,
    exact: bool = False,
) -> QualityReport:
    """Measure what each variant of ``model`` costs in quality against the reference.

    ``variants``: the same model in other quantizations (files or folders of GGUF files).
    ``quantize``: types to make from ``model`` first (``"Q4_K_M,Q8_0"``; made once, cached in the
    data folder; ``imatrix`` and ``allow_requantize`` as ``llama-quantize``). ``reference``: the
    file to compare against (default: the most bits per weight). Raises ``QualityError``,
    ``QuantizeError`` or a ``ModelError`` on bad input, each with one line saying what to change.
    """
    from ..model.gguf import check_path
    from .variants import expand_variants

    emit = on_event or (lambda event: None)
    for path in [model, *([reference] if reference else []), *expand_variants(variants)]:
        check_path(path)  # a URL: scoring runs the model, so it must be on disk
    main = inspect(model)
    files: list[ModelInfo] = [main]
    if quantize:
        from ..model.quantize import make_variants

        for path in make_variants(main.path, quantize, imatrix=imatrix, allow_requantize=allow_requantize, on_event=emit):
            files.append(inspect(path))
    for path in expand_variants(variants):
        files.append(inspect(path))
    ref = inspect(reference) if reference else None
    unique: dict[str, ModelInfo] = {}
    for info in ([ref] if ref else []) + files:
        unique.setdefault(str(Path(info.path).resolve()), info)
    for info in unique.values():
        why = main.same_model_as(info)
        if why:
            raise ModelError(info.path, f"not the same model as {Path(main.path).name}: {why}")
    infos = list(unique.values())
    ref = ref or choose_reference(infos)
    settings: dict[str, Any] = {"n_gpu_layers": n_gpu_layers}
    if n_threads:
        settings.update(n_threads=n_threads, n_threads_batch=n_threads)
    with QualityMeter(ref, corpus=corpus, n_ctx=n_ctx, chunks=chunks, engine=engine, settings=settings, exact=exact,
                      on_event=emit) as meter:
        return meter.measure(infos)


def format_quality(report: QualityReport) -> str:
    """A table a person reads."""
    lines = [
        f"reference: {Path(report.reference).name}; corpus {Path(report.corpus_path).name} ({report.corpus_tokens} tokens), "
        f"{report.chunks} chunks of {report.n_ctx}, {report.scored_tokens} tokens scored",
        f"{'variant':<34} {'bpw':>5} {'KL mean (95% CI)':>28} {'median':>9} {'p99':>9} {'top-1':>7} {'PPL':>12} {'PPL ratio (95% CI)':>26}",
    ]
    for name, v in report.variants.items():
        kl = f"{v.kl_mean:.6f} ({v.kl_ci_low:.6f}-{v.kl_ci_high:.6f})"
        ratio = f"{v.ppl_ratio:.4f} ({v.ppl_ratio_ci_low:.4f}-{v.ppl_ratio_ci_high:.4f})"
        lines.append(f"{name[:34]:<34} {v.bits_per_weight:5.2f} {kl:>28} {v.kl_median:9.6f} {v.kl_p99:9.6f} "
                     f"{v.top1_agreement * 100:6.2f}% {v.ppl:12.4f} {ratio:>26}")
    lines.append(f"reference distributions: {report.cache_bytes / (1 << 20):.1f} MiB in {report.cache_path}"
                 + (" (reused)" if report.cache_reused else "")
                 + f"; {report.entries_per_token:.0f} of {report.n_vocab} tokens kept per position, "
                 f"at most {report.max_rest * 100:.3g}% of the probability merged")
    return "\n".join(lines)


__all__ = ["DEFAULT_CHUNKS", "DEFAULT_CTX", "QualityMeter", "QualityReport", "VariantQuality", "bits_per_weight",
           "choose_reference", "default_corpus", "format_quality", "quality", "quality_dir"]
