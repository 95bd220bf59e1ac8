"""Settings: validation with dotted paths, and the converters to llama.cpp's interfaces."""

from __future__ import annotations

import pytest

from tuner.errors import SettingsError
from tuner.engine.settings import Settings


def test_defaults_are_valid():
    s = Settings(model_path="m.gguf")
    assert s.n_gpu_layers == 0 and s.flash_attn == "auto" and s.type_k == "f16"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"n_gpu_layers": -2}, "settings.n_gpu_layers: expected -1 (all) or a count >= 0, got -2"),
        ({"tensor_split": [1, -1]}, "settings.tensor_split[1]: expected a proportion >= 0, got -1"),
        ({"tensor_split": [0, 0]}, "settings.tensor_split: the proportions add up to 0; at least one device needs a share"),
        ({"type_k": "q3_k"}, "settings.type_k: expected one of f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, bf16, got 'q3_k'"),
        ({"type_v": "q8_0", "flash_attn": "off"}, "settings.type_v: a quantized V cache (q8_0) needs flash attention; set flash_attn to on or auto"),
        ({"n_ubatch": 1024, "n_batch": 512}, "settings.n_ubatch: must not exceed n_batch (512), got 1024"),
        ({"flash_attn": "yes"}, "settings.flash_attn: expected one of auto, off, on, got 'yes'"),
        ({"tensor_overrides": ["blk.(0"]}, "settings.tensor_overrides[0]: not a valid regular expression: missing ), unterminated subpattern at position 4"),
        ({"rpc_servers": ["localhost"]}, "settings.rpc_servers[0]: expected host:port (port 1-65535), got 'localhost'"),
        ({"n_threads": 0}, "settings.n_threads: expected null (llama.cpp's default) or a count from 1 to 16384, got 0"),
        # hostile values (tuner.limits): absurd sizes, names that break a shell line, slow regexes
        ({"n_ctx": 2 ** 62}, "settings.n_ctx: expected at most 16777216, got 4611686018427387904"),
        ({"n_gpu_layers": 10 ** 400}, "settings.n_gpu_layers: expected at most 65536, got a number of 401 digits"),
        ({"n_batch": 2 ** 40}, "settings.n_batch: expected at most 16777216, got 1099511627776"),
        ({"n_threads": 10 ** 6}, "settings.n_threads: expected null (llama.cpp's default) or a count from 1 to 16384, got 1000000"),
        ({"tensor_split": [1, float("nan")]}, "settings.tensor_split[1]: expected a proportion >= 0, got nan"),
        ({"tensor_split": [1, float("inf")]}, "settings.tensor_split[1]: expected a proportion >= 0, got inf"),
        ({"rpc_servers": ["127.0.0.1:99999"]}, "settings.rpc_servers[0]: expected host:port (port 1-65535), got '127.0.0.1:99999'"),
        ({"rpc_servers": ["127.0.0.1:50052\n"]}, "settings.rpc_servers[0]: expected host:port (port 1-65535), got '127.0.0.1:50052\\n'"),
        ({"model_path": "m.gguf\ntouch /tmp/x"}, "settings.model_path: the path holds a control character (\\n); rename it"),
        ({"tensor_overrides": [r"(a)\1"]}, "settings.tensor_overrides[0]: RE2, which matches tensor overrides in linear "
                                           "time, cannot express it (invalid escape sequence: \\1); a backreference or a "
                                           "lookaround is never needed to name tensors: write e.g. blk\\.(1[0-9]|2[0-4])\\.ffn_.*_exps\\."),
        ({"tensor_overrides": ["x" * 5000]}, "settings.tensor_overrides[0]: a pattern of 5000 characters (at most 4096)"),
        ({"n_cpu_moe": -1}, "settings.n_cpu_moe: expected a count of layers >= 0, got -1"),
        ({"n_cpu_moe": 10**400}, "settings.n_cpu_moe: expected at most 1024, got a number of 401 digits"),
    ],
)
def test_invalid_settings_name_the_field(changes, message):
    with pytest.raises(SettingsError) as info:
        Settings(**{"model_path": "m.gguf", **changes})
    assert str(info.value) == message


def test_from_dict_round_trip_and_unknown_key():
    s = Settings(model_path="m.gguf", n_gpu_layers=10, tensor_split=(3, 1), tensor_overrides=(r"blk\.0\.ffn_.*",))
    assert Settings.from_dict(s.to_dict()) == s
    with pytest.raises(SettingsError, match=r"^settings.n_gpu_layer: unknown setting"):
        Settings.from_dict({"model_path": "m.gguf", "n_gpu_layer": 3})


def test_llama_kwargs():
    s = Settings(model_path="m.gguf", n_gpu_layers=20, tensor_split=(1, 1), n_ctx=8192, flash_attn="on",
                 type_k="q8_0", type_v="q8_0", n_threads=6, use_mmap=False)
    kw = s.llama_kwargs()
    assert kw["n_gpu_layers"] == 20 and kw["tensor_split"] == [1, 1] and kw["n_ctx"] == 8192
    assert kw["flash_attn"] is True and kw["type_k"] == 8 and kw["type_v"] == 8
    assert kw["n_threads"] == 6 and kw["use_mmap"] is False and kw["split_mode"] == 1


def test_server_and_bench_flags():
    s = Settings(model_path="m.gguf", n_gpu_layers=20, tensor_split=(3, 1), n_ctx=8192, flash_attn="on",
                 type_k="q8_0", type_v="q8_0", n_threads=6, offload_kqv=False, use_mmap=False,
                 tensor_overrides=(r"blk\.[0-3]\.ffn_.*",), rpc_servers=("127.0.0.1:50052",))
    assert s.cli_args("llama-server") == [
        "-m", "m.gguf", "-ngl", "20", "-ts", "3,1", "-c", "8192", "-b", "2048", "-ub", "512", "-t", "6",
        "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", "-nkvo", "-np", "1", "-lm", "none",
        "-ot", r"blk\.[0-3]\.ffn_.*=CPU", "--rpc", "127.0.0.1:50052"]
    assert s.cli_args("llama-bench") == [
        "-m", "m.gguf", "-ngl", "20", "-ts", "3/1", "-b", "2048", "-ub", "512", "-t", "6",
        "-fa", "1", "-ctk", "q8_0", "-ctv", "q8_0", "-nkvo", "1", "-lm", "none",
        "-ot", r"blk\.[0-3]\.ffn_.*=CPU", "--rpc", "127.0.0.1:50052"]
    assert s.command_line("llama-server").startswith("llama-server -m m.gguf -ngl 20")


def test_model_key_ignores_context_settings():
    a = Settings(model_path="m.gguf", n_gpu_layers=5, n_ctx=1024, n_threads=2)
    b = a.replace(n_ctx=4096, n_threads=1, type_k="q8_0", flash_attn="on")
    c = a.replace(n_gpu_layers=6)
    assert a.model_key == b.model_key != c.model_key


def test_all_layers_is_spelled_for_each_tool():
    s = Settings(model_path="m.gguf", n_gpu_layers=-1, tensor_overrides=("a", "b"))
    server = s.cli_args("llama-server")
    assert server[server.index("-ngl") + 1] == "all"  # -1 would mean "auto" to llama-server
    assert server[server.index("-ot") + 1] == "a=CPU,b=CPU"
    bench = s.cli_args("llama-bench")
    assert bench[bench.index("-ngl") + 1] == "-1"
    assert bench[bench.index("-ot") + 1] == "a=CPU;b=CPU"  # ',' would start a second llama-bench run
