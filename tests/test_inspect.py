"""inspect: facts and sizes from the GGUF header, and clear errors for bad files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.errors import EmptyModelError, ModelNotFoundError, NotGGUFError, TruncatedGGUFError, UnsupportedArchitectureError
from tuner.model.inspect import inspect

from .conftest import MOE, TINY


def test_inspect_json_has_the_documented_keys(models):
    result = CliRunner().invoke(cli, ["inspect", str(models["q8_0"]), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    for key in ("architecture", "n_layer", "n_embd", "n_head", "n_head_kv", "head_sizes", "n_ctx_train",
                "expert_count", "expert_used_count", "file_type", "quantization", "n_params", "file_size",
                "bytes_per_repeating_layer", "nonrepeating_bytes", "kv_bytes_per_token", "swa_layers", "sliding_window"):
        assert key in data, key
    assert data["architecture"] == "llama"
    assert data["quantization"] == "Q8_0" and data["file_type"] == 7
    assert set(data["bytes_per_repeating_layer"]) >= {"attention", "ffn", "experts", "norms", "total"}
    assert set(data["nonrepeating_bytes"]) >= {"token_embd", "output", "output_norm"}


def test_bytes_add_up_to_the_tensor_data(models):
    info = inspect(models["f16"])
    layers = sum(l.total for l in info.layer_bytes)
    assert layers + sum(info.nonrepeating_bytes.values()) == sum(t.n_bytes for t in info.tensors)
    # F16 attention of one layer: q and o are n_embd x n_embd, k and v n_embd x kv_dim, 2 bytes each
    kv_dim = TINY.n_head_kv * TINY.head_dim
    assert info.layer_bytes[0].attention == 2 * (2 * TINY.n_embd * TINY.n_embd + 2 * TINY.n_embd * kv_dim)
    assert info.layer_bytes[0].ffn == 2 * 3 * TINY.n_embd * TINY.n_ff
    assert info.layer_bytes[0].norms == 4 * 2 * TINY.n_embd
    assert info.nonrepeating_bytes["token_embd"] == 2 * TINY.n_vocab * TINY.n_embd


def test_kv_bytes_per_token_per_type(models):
    info = inspect(models["f16"])
    kv_dim = TINY.n_head_kv * TINY.head_dim
    assert info.kv_bytes_per_token["f16"] == TINY.n_layer * 2 * kv_dim * 2
    assert info.kv_bytes_per_token["f32"] == 2 * info.kv_bytes_per_token["f16"]
    assert info.kv_bytes_per_token["q8_0"] == TINY.n_layer * 2 * (kv_dim // 32) * 34
    assert info.kv_bytes_per_token["q4_0"] == TINY.n_layer * 2 * (kv_dim // 32) * 18


def test_moe_experts_are_their_own_role(models):
    info = inspect(models["moe"])
    assert info.expert_count == MOE.n_expert and info.expert_used_count == MOE.n_expert_used
    layer = info.layer_bytes[0]
    assert layer.experts >= 3 * MOE.n_expert * MOE.n_embd * MOE.n_ff * 2
    assert layer.ffn == 0


def test_split_model_is_read_whole(models):
    info = inspect(models["split"])
    whole = inspect(models["f16"])
    assert info.split_count > 1
    assert info.n_params == whole.n_params
    assert sum(l.total for l in info.layer_bytes) == sum(l.total for l in whole.layer_bytes)


def _cli_error(args):
    result = CliRunner().invoke(cli, args)
    return result.exit_code, result.output.strip()


def test_missing_path(tmp_path):
    code, out = _cli_error(["inspect", str(tmp_path / "nope.gguf")])
    assert code == 2
    assert out == f"Error: {tmp_path / 'nope.gguf'}: no such file; check the path"


def test_directory(tmp_path):
    code, out = _cli_error(["inspect", str(tmp_path)])
    assert code == 2 and "is a directory, not a GGUF file" in out and str(tmp_path) in out
    assert "Traceback" not in out


def test_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>404 Not Found</html>" * 10)
    code, out = _cli_error(["inspect", str(path)])
    assert code == 2
    assert out == f"Error: {path}: not a GGUF file (starts with b'<htm', expected b'GGUF')"


def test_truncated_header(models, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(models["f16"].read_bytes()[:5000])
    with pytest.raises(TruncatedGGUFError, match="truncated GGUF"):
        inspect(path)


def test_truncated_tensor_data(models, tmp_path):
    data = models["f16"].read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: len(data) - 1000])
    code, out = _cli_error(["inspect", str(path)])
    assert code == 2
    assert "truncated GGUF: tensor output.weight ends at byte" in out and str(path) in out


def test_gguf_without_tensors(tmp_path):
    import gguf

    path = tmp_path / "vocab-only.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EmptyModelError, match="holds no tensors"):
        inspect(path)


def test_unsizable_architecture_names_the_missing_key(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "mystery")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitectureError) as info:
        inspect(path)
    assert str(info.value) == f"{path}: cannot size architecture 'mystery': the GGUF lacks mystery.embedding_length"


def test_debug_shows_the_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tuner", "--debug", "inspect", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "ModelNotFoundError" in proc.stderr


def test_error_goes_to_stderr_as_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tuner", "inspect", str(tmp_path / "x.gguf")],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "no such file" in proc.stderr


def test_error_classes():
    assert issubclass(ModelNotFoundError, Exception) and issubclass(NotGGUFError, Exception)


@pytest.mark.parametrize("period", [6, 3, 0])
def test_sliding_window_layers_are_the_ones_llama_cpp_slides(tmp_path, period):
    """inspect's window layers against llama.cpp's own load log ("layer %3d assigned to device %s,
    is_swa = %d", src/llama-model.cpp load_tensors, 2026): period 6 is Gemma 3's, 0 slides every layer."""
    import re

    from tuner.engine.base import BenchSpec
    from tuner.engine.python import run_trial
    from tuner.engine.settings import Settings
    from tuner.testing import ModelShape, make_model

    shape = ModelShape(architecture="gemma3", n_layer=7, n_embd=128, n_head=2, n_head_kv=1, n_ff=256, n_vocab=320,
                       n_ctx_train=2048, sliding_window=128, swa_period=period)
    path = make_model(tmp_path / "swa.gguf", shape)
    info = inspect(path)
    result = run_trial(Settings(model_path=str(path), n_ctx=512, n_batch=512, n_threads=1),
                       BenchSpec(n_prompt=0, n_gen=1, repetitions=1, warmup=False))
    assert result.ok, result.message
    sliding = tuple(int(m[1]) for m in re.finditer(r"layer\s+(\d+) assigned to device \S+, is_swa = 1", result.log))
    assert info.swa_layers == sliding and info.sliding_window == 128
    assert sliding == tuple(i for i in range(7) if period == 0 or i % period < period - 1)
