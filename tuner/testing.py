"""Public helpers for tests, demos and benchmarks (``tuner.model.make``): make real GGUF models of
any shape, quantize them with llama.cpp's own quantizer, and build llama.cpp's tools from the
sources that match the installed llama-cpp-python.

    from tuner.testing import ModelShape, make_model, quantize
"""

from __future__ import annotations

from .model.make import (
    DEMO_SHAPE,
    FTYPES,
    ModelShape,
    build_against_llama_cpp,
    demo_models,
    llama_cpp_env,
    llama_cpp_source,
    make_model,
    quantize,
)

__all__ = [
    "DEMO_SHAPE",
    "FTYPES",
    "ModelShape",
    "build_against_llama_cpp",
    "demo_models",
    "llama_cpp_env",
    "llama_cpp_source",
    "make_model",
    "quantize",
]
