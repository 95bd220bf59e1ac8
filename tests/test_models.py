"""Made models are real: llama.cpp loads them, generates from them, and quantizes them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tuner.model.inspect import inspect
from tuner.testing import ModelShape, make_model

GENERATE = r"""
import json, sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=256, n_threads=2, verbose=False, seed=1)
out = llm("hello world", max_tokens=8, temperature=0.0)
print(json.dumps({"n": out["usage"]["completion_tokens"], "text": out["choices"][0]["text"]}))
"""


def generate(path) -> dict:
    proc = subprocess.run([sys.executable, "-c", GENERATE, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["f16", "q8_0", "q4_k_m", "moe", "split"])
def test_llama_cpp_loads_and_generates(models, name):
    out = generate(models[name])
    assert out["n"] >= 1  # it produced tokens (random weights: the text is noise, the work is real)


def test_quantized_variants_are_smaller_and_named(models):
    f16, q8, q4 = (inspect(models[k]) for k in ("f16", "q8_0", "q4_k_m"))
    assert (f16.quantization, q8.quantization, q4.quantization) == ("F16", "Q8_0", "Q4_K_M")
    assert f16.file_size > q8.file_size > q4.file_size
    # same model, other quantization
    assert q8.same_model_as(f16) is None and q4.same_model_as(f16) is None
    assert "Q8_0" in q8.tensor_types and "Q4_K" in q4.tensor_types


def test_shape_is_what_was_asked(tmp_path):
    shape = ModelShape(n_layer=3, n_embd=384, n_head=6, n_head_kv=2, n_ff=1024, n_vocab=777, n_ctx_train=2048)
    info = inspect(make_model(tmp_path / "m.gguf", shape))
    assert (info.n_layer, info.n_embd, info.n_head, info.n_head_kv, info.n_ff, info.n_vocab, info.n_ctx_train) == (
        3, 384, 6, 2, 1024, 777, 2048)
    assert info.head_size_k == info.head_size_v == 64


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of n_head"):
        ModelShape(n_embd=250, n_head=4)
    with pytest.raises(ValueError, match="n_expert_used"):
        ModelShape(n_expert=4, n_expert_used=0)
