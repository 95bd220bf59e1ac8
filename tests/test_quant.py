"""The quantization size table against what llama.cpp's own quantizer writes.

Two witnesses: files quantized here by llama.cpp (``tuner.testing.quantize``) from made models of
shapes that exercise the rules (grouped-query attention, 8 experts, rows that do not divide into
256-blocks), and llama.cpp's own snapshot of its type choices for real models
(``tests/snapshots/*.schema`` in the llama.cpp sources), which cover shapes too big to make here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tuner.engine.settings import Settings
from tuner.errors import TunerError
from tuner.model.estimate import estimate
from tuner.model.inspect import inspect
from tuner.model.quant import (
    FILE_TYPES,
    STANDARD,
    allows_quantization,
    file_type,
    quantized_size,
    requantized,
    size_table,
    tensor_types,
)
from tuner.model.synthetic import llama_like
from tuner.testing import ModelShape, llama_cpp_source, make_model, quantize

# shape -> the file types llama.cpp makes of it here (none needs an importance matrix)
CASES = {
    # 8 layers: use_more_bits picks layers 0, 2, 5, 6, 7; n_head/n_head_kv = 4 takes the GQA>=4 branches
    "gqa4": (ModelShape(n_layer=8, n_embd=256, n_head=4, n_head_kv=1, n_ff=512, n_vocab=512),
             ("Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q4_K_M", "Q4_K_S", "IQ4_NL", "IQ4_XS", "Q3_K_L", "Q3_K_M", "IQ3_M",
              "Q2_K")),
    # GQA 2 takes the other branches of the attn_v rules
    "gqa2": (ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512),
             ("Q2_K", "IQ4_XS", "IQ3_S")),
    # 8 experts: attn_v/attn_k to Q8_0, attn_output to Q5_K; experts numbered by name
    "moe8": (ModelShape(n_layer=3, n_embd=256, n_head=4, n_head_kv=4, n_ff=256, n_vocab=512, n_expert=8, n_expert_used=2),
             ("Q4_K_M", "Q3_K_M")),
    # rows of 320 do not divide into 256-blocks: Q4_K -> Q5_0, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL
    "odd": (ModelShape(n_layer=2, n_embd=320, n_head=5, n_head_kv=5, n_ff=640, n_vocab=512),
            ("Q4_K_M", "Q6_K", "IQ4_XS")),
}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """{case: (F16 path, {quantization: path})}, quantized by llama.cpp."""
    folder = tmp_path_factory.mktemp("quant")
    out = {}
    for case, (shape, quants) in CASES.items():
        f16 = make_model(folder / f"{case}-F16.gguf", shape)
        out[case] = (f16, {q: quantize(f16, folder / f"{case}-{q}.gguf", q) for q in quants})
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_types_and_sizes_equal_what_llama_cpp_writes(quantized, case):
    f16, files = quantized[case]
    source = inspect(f16)
    for quant, path in files.items():
        real = inspect(path)
        predicted = quantized_size(source, quant)
        got = {t.name: t.type for t in real.tensors}
        assert predicted.tensor_types == got, (case, quant, {n: (predicted.tensor_types[n], got[n]) for n in got
                                                            if predicted.tensor_types[n] != got[n]})
        assert predicted.n_bytes == sum(t.n_bytes for t in real.tensors), (case, quant)
        # the whole file (header and alignment padding included) within 1%
        as_file = requantized(source, quant)
        assert as_file.file_size == pytest.approx(real.file_size, rel=0.01), (case, quant)
        # and the per-layer bytes the memory arithmetic stands on are the real file's
        assert as_file.layer_bytes == real.layer_bytes and as_file.nonrepeating_bytes == real.nonrepeating_bytes


def test_a_quantized_file_predicts_its_siblings(quantized):
    # the table works from any quantization of the model, not only from F16
    f16, files = quantized["gqa4"]
    q8 = inspect(files["Q8_0"])
    for quant in ("Q4_K_M", "Q2_K", "Q6_K"):
        assert quantized_size(q8, quant).n_bytes == sum(t.n_bytes for t in inspect(files[quant]).tensors), quant


def test_estimate_of_a_requantized_model_equals_the_estimate_of_the_real_file(quantized):
    f16, files = quantized["gqa4"]
    settings = Settings(model_path=str(files["Q4_K_M"]), n_gpu_layers=5, n_ctx=1024)
    predicted = estimate(requantized(inspect(f16), "Q4_K_M"), settings, devices=["GPU0"])
    real = estimate(inspect(files["Q4_K_M"]), settings, devices=["GPU0"])
    assert predicted.devices == real.devices


# Bits per weight of Llama-3.1-8B in each quantization, as llama.cpp's tools/quantize/README.md
# lists them (IQ3_XXS was made with an importance matrix there).
README_BPW = {"IQ3_XXS": 3.2548, "IQ3_XS": 3.4977, "IQ3_S": 3.6606, "IQ3_M": 3.7628, "IQ4_XS": 4.4597, "IQ4_NL": 4.6818,
              "Q2_K_S": 2.9697, "Q2_K": 3.1593, "Q3_K_S": 3.6429, "Q3_K_M": 3.9960, "Q3_K_L": 4.2979, "Q4_K_S": 4.6672,
              "Q4_K_M": 4.8944, "Q5_K_S": 5.5704, "Q5_K_M": 5.7036, "Q6_K": 6.5633, "Q8_0": 8.5008, "F16": 16.0005}


def test_bits_per_weight_equal_llama_cpps_published_figures():
    info = llama_like(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256)
    for quant, bpw in README_BPW.items():
        got = quantized_size(info, quant, imatrix=quant == "IQ3_XXS").bits_per_weight
        assert got == pytest.approx(bpw, abs=0.0001), quant
    table = size_table(info)
    assert [row.n_bytes for row in table] == sorted((row.n_bytes for row in table), reverse=True)
    assert {row.quantization for row in table} == set(STANDARD)
    by = {row.quantization: row for row in table}
    assert by["IQ2_XXS"].approximations and not by["Q4_K_M"].approximations


def test_unknown_quantization_is_one_clear_error():
    with pytest.raises(TunerError, match="unknown quantization 'Q9_X'; known: F32"):
        file_type("Q9_X")
    assert file_type("q4_k_m") is FILE_TYPES["Q4_K_M"]


def _snapshot(path: Path) -> dict[str, tuple[str, dict[str, str]]]:
    sections: dict[str, tuple[str, dict[str, str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"\[(\w+)\]\s+(\w+)$", line)
        if m:
            current = sections.setdefault(m.group(1), (m.group(2).upper(), {}))
            continue
        name, kind = line.rsplit(" ", 1)
        current[1][name] = kind.upper()
    return sections


# llama.cpp's snapshot models whose tensor layout is the llama family's (the others have MLA,
# SSM or MXFP4 experts, which a shape-only rebuild does not reproduce). Shapes from the
# snapshot headers; head sizes and tied embeddings from the models' configs.
SNAPSHOTS = {
    "meta-llama-3.1-70b-instruct": dict(n_layer=80, n_embd=8192, n_head=64, n_head_kv=8, n_ff=28672, n_vocab=128256),
    "qwen3-14b": dict(architecture="qwen3", n_layer=40, n_embd=5120, n_head=40, n_head_kv=8, n_ff=17408, n_vocab=151936,
                      head_dim=128),
    "qwen3-0.6b": dict(architecture="qwen3", n_layer=28, n_embd=1024, n_head=16, n_head_kv=8, n_ff=3072, n_vocab=151936,
                       head_dim=128),
    "gemma-3-4b-it": dict(architecture="gemma3", n_layer=34, n_embd=2560, n_head=8, n_head_kv=4, n_ff=10240,
                          n_vocab=262144, head_dim=256, tied_embeddings=True),
}


@pytest.mark.parametrize("model", sorted(SNAPSHOTS))
def test_types_equal_llama_cpps_snapshots_of_real_models(model):
    source = llama_cpp_source()
    if source is None:
        pytest.skip("LLAMA_CPP_SOURCE is not set: llama.cpp's quantization snapshots are not available")
    path = source / "tests" / "snapshots" / f"{model}.schema"
    info = llama_like(**SNAPSHOTS[model])
    shapes = {t.name: t.shape for t in info.tensors}
    checked = 0
    for quant, (default, overrides) in _snapshot(path).items():
        if quant not in FILE_TYPES:
            continue  # TQ1_0, TQ2_0, MXFP4_MOE, NVFP4: not offered here
        types = tensor_types(info, quant)
        expected = {n: overrides.get(n, default) for n in shapes if allows_quantization(n, shapes[n])}
        assert {n: types[n] for n in expected} == expected, (model, quant)
        assert set(overrides) <= set(expected), (model, quant)
        checked += 1
    assert checked >= 28
