"""llama.cpp's own argument parser as a test harness: ``common_params_parse`` (what llama-server and
llama-cli call) built from llama.cpp's sources against the ``libllama-common`` llama-cpp-python
installs, and llama-bench itself. Shared by the export tests and the machine matrix (the fixture
``llama_parsers`` is in conftest.py); it skips when the sources or a C++ compiler are missing."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tuner.errors import TunerError
from tuner.testing import build_against_llama_cpp, llama_cpp_env, llama_cpp_source

HARNESS = r"""
// What llama.cpp's common_params_parse (llama-server, llama-cli) understood from argv and LLAMA_ARG_*.
#include "arg.h"
#include "common.h"
#include <cstdio>
#include <cstring>

int main(int argc, char ** argv) {
    llama_example ex = std::strcmp(argv[1], "llama-cli") == 0 ? LLAMA_EXAMPLE_CLI : LLAMA_EXAMPLE_SERVER;
    argv[1] = argv[0];
    common_params params;
    if (!common_params_parse(argc - 1, argv + 1, params, ex)) {
        return 3;
    }
    printf("model=%s\n", params.model.path.c_str());
    printf("n_gpu_layers=%d\n", params.n_gpu_layers);
    printf("split_mode=%d\n", (int) params.split_mode);
    printf("main_gpu=%d\n", params.main_gpu);
    printf("tensor_split=%g,%g\n", params.tensor_split[0], params.tensor_split[1]);
    printf("n_ctx=%d\n", params.n_ctx);
    printf("n_batch=%d\n", params.n_batch);
    printf("n_ubatch=%d\n", params.n_ubatch);
    printf("n_threads=%d\n", params.cpuparams.n_threads);
    printf("n_threads_batch=%d\n", params.cpuparams_batch.n_threads);
    printf("flash_attn=%d\n", (int) params.flash_attn_type);
    printf("type_k=%s\n", ggml_type_name(params.cache_type_k));
    printf("type_v=%s\n", ggml_type_name(params.cache_type_v));
    printf("no_kv_offload=%d\n", (int) params.no_kv_offload);
    printf("load_mode=%d\n", (int) params.load_mode);
    printf("no_op_offload=%d\n", (int) params.no_op_offload);
    printf("swa_full=%d\n", (int) params.swa_full);
    printf("kv_unified=%d\n", (int) params.kv_unified);
    for (auto * d : params.devices) {
        if (d) printf("device=%s\n", ggml_backend_dev_name(d));
    }
    for (const auto & o : params.tensor_buft_overrides) {
        if (o.pattern) printf("override=%s=%s\n", o.pattern, ggml_backend_buft_name(o.buft));
    }
    return 0;
}
"""


def build_parsers(tmp_path_factory):
    """(harness, llama-bench, environment) built from llama.cpp's sources, or a skip saying what is missing."""
    source = llama_cpp_source()
    if source is None:
        pytest.skip("llama.cpp sources not found: set LLAMA_CPP_SOURCE to an unpacked llama-cpp-python sdist's vendor/llama.cpp")
    out = tmp_path_factory.mktemp("llama-parsers")
    (out / "harness.cpp").write_text(HARNESS)
    bench_dir = source / "tools" / "llama-bench"
    try:
        harness = build_against_llama_cpp("harness", [out / "harness.cpp"], out, source=source, optimize="-O0")
        bench = build_against_llama_cpp("llama-bench", [bench_dir / "llama-bench.cpp", bench_dir / "main.cpp"], out,
                                        source=source, optimize="-O0")
    except TunerError as exc:
        pytest.skip(str(exc))
    return harness, bench, llama_cpp_env()


def parsed(harness: Path, tool: str, args: list[str], env: dict) -> dict[str, str]:
    proc = subprocess.run([str(harness), tool, *args], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        out[key] = f"{out[key]};{value}" if key in out else value
    return out
