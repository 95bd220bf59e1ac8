"""Simulated machines: GPU-sized hardware and models the tuner can be measured on without either.

Each ``SimulatedMachine`` is a ``Machine`` (what ``probe()`` would report there), a roofline engine
that answers trials the way that hardware would (``tuner.engine.roofline``), and a family of models
(one model in several quantizations) described by real shapes but built without a file
(``tuner.model.synthetic``, sizes per tensor from ``tuner.model.quant``).

For benchmarks of the search (``benchmarks/search_at_scale.py``) and search tests only.

    sim = SIMULATED["24gb-70b"]
    tuner = Tuner(sim.main, variants=sim.variants, machine=sim.machine(), engine=sim.engine(seed=1),
                  infos=sim.models, min_ctx=sim.min_ctx, depth=sim.depth)
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..engine.roofline import DEVICES, DRIVER_RESERVED, DeviceSpec, RooflineEngine
from ..model.inspect import ModelInfo, TensorInfo
from ..model.quant import requantized, tensor_bytes, with_tensors
from ..model.synthetic import llama_like
from .probe import GPU, LlamaBuild, Machine

GiB = 1 << 30
# What the operating system and desktop keep of the host's RAM (assumption).
OS_RESERVED = 4 * GiB


# -- the models -----------------------------------------------------------------------------------

# Shapes from each model's published config.json (Hugging Face model cards): layers, widths, heads,
# FFN and expert sizes, vocabulary, and the training context its GGUF states.
SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.1-70B: 80 layers, hidden 8192, 64 heads (8 KV), FFN 28672, vocab 128256, 128k context
    "Llama-3.1-70B": dict(n_layer=80, n_embd=8192, n_head=64, n_head_kv=8, n_ff=28672, n_vocab=128256, n_ctx_train=131072),
    # Qwen/Qwen2.5-32B: 64 layers, hidden 5120, 40 heads (8 KV), FFN 27648, vocab 152064, 32k context
    "Qwen2.5-32B": dict(n_layer=64, n_embd=5120, n_head=40, n_head_kv=8, n_ff=27648, n_vocab=152064, n_ctx_train=32768,
                        architecture="qwen2"),
    # zai-org/GLM-4.5-Air: 46 layers, hidden 4096, 96 heads of 128 (8 KV), 128 routed experts of 1408 with 8
    # used per token plus 1 shared expert, the first layer dense (FFN 10944, the GGUF's feed_forward_length),
    # vocab 151552, 128k context.
    # (Its one multi-token-prediction layer is left out: llama.cpp does not run it when generating.)
    "GLM-4.5-Air": dict(n_layer=46, n_embd=4096, n_head=96, n_head_kv=8, head_dim=128, n_ff=10944, n_ff_exp=1408,
                        n_expert=128, n_expert_used=8, n_expert_shared=1, n_vocab=151552, n_ctx_train=131072,
                        architecture="glm4moe", dense_first=1),
}


@lru_cache(maxsize=None)
def _base(shape_name: str) -> ModelInfo:
    shape = dict(SHAPES[shape_name])
    dense_first = shape.pop("dense_first", 0)
    info = llama_like(name=shape_name, **shape)
    if not dense_first:
        return info
    # GLM-style MoE: the first layers are dense (an FFN of n_ff instead of the experts)
    tensors: list[TensorInfo] = [t for t in info.tensors
                                 if not (t.name.startswith("blk.") and int(t.name.split(".")[1]) < dense_first
                                         and ("_exps." in t.name or "_shexp." in t.name or "ffn_gate_inp" in t.name))]
    for layer in range(dense_first):
        for name, dims in (("ffn_gate", (info.n_embd, info.n_ff)), ("ffn_up", (info.n_embd, info.n_ff)),
                           ("ffn_down", (info.n_ff, info.n_embd))):
            tensors.append(TensorInfo(f"blk.{layer}.{name}.weight", "F16", dims, tensor_bytes("F16", dims), dims[0] * dims[1]))
    info = with_tensors(info, tensors, info.quantization, file_size=sum(t.n_bytes for t in tensors))
    return dataclasses.replace(info, n_params=sum(t.n_elements for t in tensors), n_tensors=len(tensors))


@lru_cache(maxsize=None)
def model(shape_name: str, quantization: str) -> ModelInfo:
    """``shape_name`` quantized as llama.cpp would, at a path of its own (``Llama-3.1-70B-Q4_K_M.gguf``)."""
    info = requantized(_base(shape_name), quantization)
    name = f"{shape_name}-{quantization}.gguf"
    # a stable identity in the header hash's form (profiles check it is a sha256)
    return dataclasses.replace(info, path=name, name=shape_name, header_hash=hashlib.sha256(f"simulated {name}".encode()).hexdigest())


# -- the machines ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimulatedMachine:
    """Hardware (a host CPU with ``ram`` bytes, GPUs in llama.cpp's order) and a model family."""

    name: str
    description: str
    host: DeviceSpec
    ram: int
    gpus: tuple[DeviceSpec, ...]
    shape: str
    quantizations: tuple[str, ...]
    min_ctx: int = 8192
    depth: int = 4096
    storage: str = "nvme"  # where the model files live (tuner.engine.roofline.STORAGE)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def models(self) -> dict[str, ModelInfo]:
        """The variants by path, the main model (the first quantization) first."""
        return {m.path: m for m in (model(self.shape, q) for q in self.quantizations)}

    @property
    def main(self) -> str:
        return next(iter(self.models))

    @property
    def variants(self) -> list[str]:
        return list(self.models)[1:]

    def device_names(self) -> list[str]:
        return [f"CUDA{i}" for i in range(len(self.gpus))]

    def free(self) -> dict[str, int]:
        """What each GPU has free when the tuner probes: its memory less what the driver keeps."""
        return {name: spec.memory - DRIVER_RESERVED for name, spec in zip(self.device_names(), self.gpus)}

    def machine(self) -> Machine:
        """What ``probe()`` would report on this machine, with the roofline engine as its engine: the
        devices as llama.cpp lists them, NVML's view of the GPUs."""
        free = self.free()
        gpus = tuple(
            GPU(index=i, name=spec.model, uuid=f"GPU-simulated-{self.name}-{i}", memory_total=spec.memory,
                memory_free=free[f"CUDA{i}"], driver="simulated")
            for i, spec in enumerate(self.gpus)
        )
        return Machine(
            cpu_model=self.host.model, physical_cores=self.host.cores, logical_cores=self.host.threads,
            ram_total=self.ram, ram_available=self.ram - OS_RESERVED, gpus=gpus, gpu_status="simulated",
            system="Linux", arch="x86_64",
            llama=LlamaBuild(llama_cpp_python="0.3.36", gpu_offload=True, backends=("cpu", "cuda")),
            devices=tuple(d.to_dict() for d in self.engine(noise=0.0).devices()),
        )

    def engine(self, *, noise: float = 0.2, seed: int = 0, reuse_model: bool = True) -> RooflineEngine:
        """The roofline engine for this machine; ``reuse_model``: the python engine's way of keeping a
        loaded model (False: llama-bench's, a load per trial)."""
        return RooflineEngine(
            self.models, host=self.host, ram=self.ram - OS_RESERVED,
            accelerators=list(zip(self.device_names(), self.gpus)), free=self.free(), noise=noise, seed=seed,
            storage=self.storage, reuse_model=reuse_model,
        )


SIMULATED: dict[str, SimulatedMachine] = {
    m.name: m
    for m in (
        SimulatedMachine(
            "24gb-70b", "one RTX 3090 (24 GB) + 64 GB DDR5, Llama-3.1-70B", DEVICES["ryzen9-7950x"], 64 * GiB,
            (DEVICES["rtx3090"],), "Llama-3.1-70B", ("Q4_K_M", "Q3_K_M", "Q2_K"),
        ),
        SimulatedMachine(
            "2gpu-32b", "RTX 3090 (24 GB) + RTX 4060 Ti (16 GB) + 64 GB DDR5, Qwen2.5-32B", DEVICES["ryzen9-7950x"],
            64 * GiB, (DEVICES["rtx3090"], DEVICES["rtx4060ti16"]), "Qwen2.5-32B", ("Q8_0", "Q6_K", "Q4_K_M"),
        ),
        SimulatedMachine(
            "16gb-moe", "one RTX 4060 Ti (16 GB) + 96 GB DDR5, GLM-4.5-Air (106B MoE)", DEVICES["ryzen9-7950x"],
            96 * GiB, (DEVICES["rtx4060ti16"],), "GLM-4.5-Air", ("Q4_K_M", "Q3_K_M", "Q2_K"),
        ),
    )
}

__all__ = ["SHAPES", "SIMULATED", "SimulatedMachine", "model"]
