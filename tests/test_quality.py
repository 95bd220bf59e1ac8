"""Quality on the real llama.cpp: KL divergence, top-1 agreement and perplexity of made models against
their highest-precision file, the reference cache, the compact form against the exact KL, the
variants made by llama.cpp's quantizer, and bad input.

The made models have random weights; with the output head's weights spread wide (``output_std``)
their next-token distributions are peaked, as a trained model's are, so the compact form keeps a
small part of the vocabulary and the KL follows the quantization error: Q8_0 far below Q4_K_M.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.errors import QualityError, QuantizeError
from tuner.model.inspect import inspect
from tuner.search.quality import QualityMeter, quality
from tuner.testing import ModelShape, make_model, quantize

SHAPE = ModelShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx_train=2048)
FAST = dict(n_ctx=64, chunks=4)  # 4 * 31 = 124 scored tokens: a second or two per pass


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("family")
    f32 = make_model(folder / "fam-F32.gguf", SHAPE, dtype="F32", output_std=0.4)
    return {"F32": f32, "Q8_0": quantize(f32, folder / "fam-Q8_0.gguf", "Q8_0"),
            "Q4_K_M": quantize(f32, folder / "fam-Q4_K_M.gguf", "Q4_K_M")}


class CountingEngine:
    """The real python engine, counting the passes it runs (by model file and kind)."""

    def __init__(self) -> None:
        from tuner.engine.python import TrialRunner

        self.runner = TrialRunner(timeout_s=300)
        self.passes: list[tuple[str, str]] = []

    def score_corpus(self, settings, job, **kwargs):
        self.passes.append((Path(settings.model_path).name, "compare" if job.reference else "reference"))
        return self.runner.score_corpus(settings, job, **kwargs)

    def close(self) -> None:
        self.runner.close()


@pytest.fixture
def engine():
    e = CountingEngine()
    yield e
    e.close()


def test_the_reference_against_itself_is_zero(family, engine):
    ref = inspect(family["F32"])
    with QualityMeter(ref, engine=engine, **FAST) as meter:
        path, meta, _ = meter.ensure_reference()
        again = meter.measure_variant(ref, path, meter.reference_key())  # a real second pass of the same model
    assert engine.passes == [("fam-F32.gguf", "reference"), ("fam-F32.gguf", "compare")]
    assert abs(again.kl_mean) < 1e-6 and again.kl_p99 < 1e-6
    assert again.top1_agreement == 1.0
    assert again.ppl_ratio == pytest.approx(1.0, abs=1e-9)
    assert again.scored_tokens == 4 * 31 == meta["rows"]


def test_kl_and_agreement_follow_the_quantization(family, engine):
    # the first file is not the reference: the one with the most bits per weight is
    report = quality(family["Q8_0"], variants=[family["Q4_K_M"], family["F32"]], engine=engine, **FAST)
    assert Path(report.reference).name == "fam-F32.gguf"
    q8, q4, ref = (report.variants[f"fam-{q}.gguf"] for q in ("Q8_0", "Q4_K_M", "F32"))
    assert 0 < q8.kl_mean < q4.kl_mean
    assert q8.kl_ci_high < q4.kl_ci_low  # apart beyond noise, not just in order
    assert 1.0 >= q8.top1_agreement > q4.top1_agreement
    assert (ref.kl_mean, ref.top1_agreement, ref.ppl_ratio) == (0.0, 1.0, 1.0)
    assert ref.bits_per_weight == 32.0 and q8.bits_per_weight > q4.bits_per_weight
    # the perplexity ratio comes from the per-token differences: its interval holds the point
    assert q4.ppl_ratio_ci_low <= q4.ppl_ratio <= q4.ppl_ratio_ci_high
    assert q4.ppl == pytest.approx(ref.ppl * q4.ppl_ratio, rel=1e-9)


def test_json_is_the_issues_shape(family, engine):
    data = quality(family["F32"], variants=[family["Q8_0"]], engine=engine, **FAST).to_dict()
    assert {"reference", "corpus", "n_ctx", "chunks", "variants"} <= set(data)
    assert set(data["corpus"]) == {"path", "sha256", "tokens"}
    assert (data["n_ctx"], data["chunks"]) == (64, 4)
    assert set(data["variants"]) == {"fam-F32.gguf", "fam-Q8_0.gguf"}  # the reference is in variants too
    v = data["variants"]["fam-Q8_0.gguf"]
    assert set(v["kl"]) == {"mean", "median", "p99", "ci_low", "ci_high"}
    assert set(v["ppl"]) == {"value", "ci_low", "ci_high"}
    assert isinstance(v["top1_agreement"], float) and isinstance(v["ppl_ratio"], float)
    assert data["corpus"]["tokens"] > 64 * 4 and len(data["corpus"]["sha256"]) == 64
    assert data["cache"]["bytes"] == os.path.getsize(data["cache"]["path"])


def test_the_second_run_reuses_the_cached_reference(family, engine):
    first = quality(family["F32"], variants=[family["Q4_K_M"]], engine=engine, **FAST)
    cache = Path(first.cache_path)
    stamp = cache.stat().st_mtime_ns
    assert engine.passes == [("fam-F32.gguf", "reference"), ("fam-Q4_K_M.gguf", "compare")]
    assert not first.cache_reused
    # a new variant: only its own pass runs; the reference is read from the cache
    second = quality(family["F32"], variants=[family["Q4_K_M"], family["Q8_0"]], engine=engine, **FAST)
    assert engine.passes[2:] == [("fam-Q8_0.gguf", "compare")]
    assert second.cache_reused and second.variants["fam-Q4_K_M.gguf"].reused
    assert cache.stat().st_mtime_ns == stamp
    assert second.variants["fam-Q4_K_M.gguf"].kl_mean == first.variants["fam-Q4_K_M.gguf"].kl_mean
    # another n_ctx is another reference
    quality(family["F32"], variants=[family["Q4_K_M"]], engine=engine, n_ctx=32, chunks=4)
    assert engine.passes[3:] == [("fam-F32.gguf", "reference"), ("fam-Q4_K_M.gguf", "compare")]


def test_the_compact_form_is_within_one_percent_of_the_exact_kl(family, engine):
    from tuner.engine.scoring import load

    ref = inspect(family["F32"])
    with QualityMeter(ref, engine=engine, exact=True, **FAST) as meter:
        path, meta, _ = meter.ensure_reference()
        ref_arrays, _ = load(str(path))
        assert meta["mean_entries"] < SHAPE.n_vocab / 4  # compact for real: most of the vocabulary is the "rest"
        assert (ref_arrays["rest"] > 0).mean() > 0.9
        for q in ("Q8_0", "Q4_K_M"):
            info = inspect(family[q])
            meter.measure_variant(info, path, meter.reference_key())
            arrays, _ = load(str(sorted(path.parent.glob("variant-*.npz"), key=os.path.getmtime)[-1]))
            compact, exact = arrays["kl"].mean(), arrays["kl_exact"].mean()
            assert exact > 0
            assert abs(compact - exact) / exact < 0.01, (q, compact, exact)
            assert compact <= exact * (1 + 1e-9)  # merging the tail never adds divergence (log-sum inequality)


def test_quantize_makes_the_variants_once_and_reuses_them(tmp_path, tuner_home):
    from tuner.model.quantize import make_variants

    source = make_model(tmp_path / "src-F16.gguf", SHAPE, output_std=0.4)
    events = []
    made = make_variants(source, "Q8_0,q4_k_m", on_event=events.append)
    assert [p.name for p in made] == ["src-Q8_0.gguf", "src-Q4_K_M.gguf"]
    assert [inspect(p).quantization for p in made] == ["Q8_0", "Q4_K_M"]
    assert all(tuner_home in p.parents for p in made)
    assert [e["type"] for e in events if e["kind"] == "quantize"] == ["Q8_0", "Q4_K_M"]
    progress = [e for e in events if e["kind"] == "quantize_progress"]
    assert progress and progress[-1]["tensor"] == progress[-1]["tensors"] == len(inspect(source).tensors)
    stamps = [p.stat().st_mtime_ns for p in made]
    events.clear()
    again = make_variants(source, ["Q8_0", "Q4_K_M"], on_event=events.append)
    assert again == made and [p.stat().st_mtime_ns for p in again] == stamps
    assert [e["kind"] for e in events] == ["quantize_reused", "quantize_reused"]
    # an already-quantized source is refused, unless asked for
    with pytest.raises(QuantizeError, match=r"already quantized \(Q8_0\).*--allow-requantize"):
        make_variants(made[0], ["Q4_K_M"])
    (requantized,) = make_variants(made[0], ["Q4_K_M"], allow_requantize=True)
    assert inspect(requantized).quantization == "Q4_K_M"
    with pytest.raises(QuantizeError, match="unknown quantization type 'Q9_X'"):
        make_variants(source, "Q9_X")


def test_quantize_checks_free_disk_before_each(tmp_path, tuner_home, monkeypatch):
    import shutil
    from collections import namedtuple

    from tuner.model import quantize as quantize_module

    source = make_model(tmp_path / "src-F16.gguf", SHAPE)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(quantize_module.shutil, "disk_usage", lambda path: usage(1 << 40, 1 << 40, 10 << 20))
    with pytest.raises(QuantizeError, match=r"not enough free disk to make src-Q8_0.gguf: about \d+ MiB needed, 10 MiB free"):
        quantize_module.make_variants(source, ["Q8_0"])
    assert not list((tuner_home / "models" / "quantized").rglob("*.gguf"))
    assert shutil.disk_usage is not None


def _imatrix_gguf(path: Path, info, scale: float = 1.0) -> Path:
    """An importance matrix in llama-imatrix's GGUF format (common/imatrix-loader.cpp): per weight
    matrix NAME.in_sum2 (sum of squared activations per input column) and NAME.counts."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(path), "imatrix")
    writer.add_array("imatrix.datasets", ["made.txt"])
    writer.add_uint32("imatrix.chunk_count", 10)
    writer.add_uint32("imatrix.chunk_size", 512)
    for t in info.tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            writer.add_tensor(f"{t.name}.in_sum2", (rng.random(t.shape[0], dtype=np.float32) * 100 * scale))
            writer.add_tensor(f"{t.name}.counts", np.array([100.0], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensor_bytes(path: Path) -> dict[str, bytes]:
    import gguf

    return {t.name: bytes(t.data.tobytes()) for t in gguf.GGUFReader(str(path)).tensors}


def test_quantize_with_an_imatrix(tmp_path, tuner_home):
    import gguf

    from tuner.model.quantize import make_variants

    source = make_model(tmp_path / "src-F16.gguf", SHAPE)
    matrix = _imatrix_gguf(tmp_path / "imatrix.gguf", inspect(source))
    (plain,) = make_variants(source, ["Q4_K_M"])
    (weighted,) = make_variants(source, ["Q4_K_M"], imatrix=matrix)
    assert weighted.parent != plain.parent and "imatrix" in weighted.parent.name
    fields = gguf.GGUFReader(str(weighted)).fields
    assert fields["quantize.imatrix.file"].contents() == "imatrix.gguf"
    assert fields["quantize.imatrix.entries_count"].contents() == 2 * 7 + 1  # 7 matrices per layer, and output
    a, b = _tensor_bytes(plain), _tensor_bytes(weighted)
    assert a["blk.0.ffn_down.weight"] != b["blk.0.ffn_down.weight"]  # the importance weights changed the rounding
    garbage = tmp_path / "garbage.dat"
    garbage.write_bytes(b"\x00" * 8)
    with pytest.raises(QuantizeError, match="garbage.dat: not an importance matrix"):
        make_variants(source, ["Q4_K_M"], imatrix=garbage)


# -- the command and bad input ------------------------------------------------------------------------


def _run(*args: str):
    return CliRunner().invoke(cli, ["quality", *args])


def test_cli_quality_prints_the_table_and_json(family, tuner_home):
    out = _run(str(family["F32"]), "--variant", str(family["Q4_K_M"]), "--ctx", "64", "--chunks", "4")
    assert out.exit_code == 0, out.output
    assert "fam-Q4_K_M.gguf" in out.output and "reference distributions:" in out.output and "MiB" in out.output
    data = json.loads(_run(str(family["F32"]), "--variant", str(family["Q4_K_M"]), "--ctx", "64", "--chunks", "4",
                           "--json").stdout)
    assert data["cache"]["reused"] is True and data["variants"]["fam-Q4_K_M.gguf"]["kl"]["mean"] > 0


def test_cli_quality_quantize_makes_and_measures(tmp_path, tuner_home):
    source = make_model(tmp_path / "q-F16.gguf", SHAPE, output_std=0.4)
    out = _run(str(source), "--quantize", "Q8_0,Q4_K_M", "--ctx", "64", "--chunks", "2", "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert set(data["variants"]) == {"q-F16.gguf", "q-Q8_0.gguf", "q-Q4_K_M.gguf"}
    assert Path(data["reference"]).name == "q-F16.gguf"
    assert data["variants"]["q-Q8_0.gguf"]["kl"]["mean"] < data["variants"]["q-Q4_K_M.gguf"]["kl"]["mean"]


def _one_line_error(out, *needles: str) -> None:
    assert out.exit_code == 2, out.output
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_bad_input_gets_one_line_and_exit_2(family, tmp_path, models):
    base = [str(family["F32"]), "--variant", str(family["Q8_0"]), "--ctx", "64", "--chunks", "4"]
    _one_line_error(_run(*base, "--corpus", str(tmp_path / "nothing.txt")), "nothing.txt: no such corpus file")
    short = tmp_path / "short.txt"
    short.write_text("In the beginning God created the heaven and the earth.\n")
    _one_line_error(_run(*base, "--corpus", str(short)), "too short", "need 256 tokens, it has 43 (with fam-F32.gguf's tokenizer)")
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\xe9 ".encode("latin-1") * 400)
    _one_line_error(_run(*base, "--corpus", str(binary)), "not UTF-8")
    # a variant of another model (the tiny test model has another shape)
    _one_line_error(_run(*base, "--variant", str(models["q8_0"])), "tiny-Q8_0.gguf", "not the same model")
    not_gguf = tmp_path / "ref.gguf"
    not_gguf.write_text("hello")
    _one_line_error(_run(*base, "--reference", str(not_gguf)), "ref.gguf", "not a GGUF file")
    _one_line_error(_run(*base[:3], "--ctx", "63"), "--ctx must be even")
    _one_line_error(_run("https://example.invalid/m.gguf"), "a URL", "needs the file on disk")
    _one_line_error(_run(*base[:3], "--quantize", "Q9_X"), "unknown quantization type 'Q9_X'")
    _one_line_error(_run(str(family["Q8_0"]), "--quantize", "Q4_K_M"), "already quantized (Q8_0)", "--allow-requantize")


def test_corpus_too_short_says_needed_and_found(family, engine):
    with pytest.raises(QualityError, match=r"need 640000 tokens, it has \d+"):
        quality(family["F32"], variants=[family["Q8_0"]], engine=engine, n_ctx=64, chunks=10_000)
