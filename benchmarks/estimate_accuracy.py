"""How close is the memory arithmetic to what llama.cpp really allocates?

Loads made models in the real llama.cpp (CPU build; with --rpc, also offloaded to local RPC
servers acting as GPUs) over a grid of settings, and compares the weight, KV and compute buffer
sizes llama.cpp prints with ``tuner.estimate``. Prints every row and the worst relative error per
kind. Targets: weights and KV within 1%, compute within 25%.

Models load with ``use_mmap=False``: with mmap, llama.cpp's host "model buffer" is the mapped span
of the file, and tensors it repacks for the CPU (Q4_0, Q4_K... into ``CPU_REPACK``) are counted
again in that span. That span is address space backed by the page cache, not memory the model
needs; without mmap the host buffers are real allocations and comparable.

    python benchmarks/estimate_accuracy.py            # CPU only
    python benchmarks/estimate_accuracy.py --rpc      # plus 1 and 2 simulated devices
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tuner.model.estimate import estimate  # noqa: E402
from tuner.model.inspect import inspect  # noqa: E402
from tuner.engine.base import BenchSpec  # noqa: E402
from tuner.engine.python import TrialRunner  # noqa: E402
from tuner.engine.settings import Settings  # noqa: E402
from tuner.testing import DEMO_SHAPE, ModelShape, make_model, quantize  # noqa: E402

MiB = 1 << 20
SHAPES = {
    "demo-Q8_0": (DEMO_SHAPE, "Q8_0"),
    "wide-Q4_K_M": (ModelShape(n_layer=4, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, n_vocab=8192), "Q4_K_M"),
    "moe-F16": (ModelShape(n_layer=4, n_embd=512, n_head=8, n_head_kv=8, n_ff=512, n_vocab=2048, n_expert=8, n_expert_used=2), None),
    # Gemma-3-style: 10 of 12 layers slide over a 512-token window, output tied to the embedding
    "swa-Q8_0": (ModelShape(architecture="gemma3", n_layer=12, n_embd=512, n_head=8, n_head_kv=4, n_ff=1024, n_vocab=2048,
                            n_ctx_train=8192, sliding_window=512), "Q8_0"),
}


def measured(report, device: str) -> tuple[int, int, int]:
    if device == "CPU":
        weights = sum(v for k, v in report.model_buffers.items() if k.startswith("CPU"))
    else:
        weights = report.model_buffers.get(device, 0)
    return weights, report.kv_buffers.get(device, 0), report.compute_buffers.get(device, 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rpc", action="store_true", help="also offload to 1 and 2 local RPC servers")
    args = parser.parse_args()
    worst = {"weights": 0.0, "kv": 0.0, "compute": 0.0}
    compute_errors: dict[str, list[float]] = {"cpu-only": [], "offloaded": []}
    rows = 0
    servers = []
    if args.rpc:
        from tuner.engine.rpc import start_servers

        servers = start_servers(2, threads=1)
    endpoints = [s.endpoint for s in servers]
    try:
        with tempfile.TemporaryDirectory() as tmp, TrialRunner() as runner:
            for name, (shape, quant) in SHAPES.items():
                path = make_model(Path(tmp) / f"{name}-F16.gguf", shape)
                if quant:
                    path = quantize(path, Path(tmp) / f"{name}.gguf", quant)
                info = inspect(path)
                placements = [(0, None, ())]
                if endpoints:
                    n = info.n_layer + 1
                    placements += [(2, None, endpoints[:1]), (n, None, endpoints[:1]), (2, (1, 2), endpoints), (n, (1, 2), endpoints)]
                windows = (False, True) if info.sliding_window else (False,)
                for (ngl, split, eps), ctx, ub, fa, swa_full in itertools.product(placements, (1024, 4096), (128, 512),
                                                                                 ("on", "off"), windows):
                    settings = Settings(model_path=str(path), n_gpu_layers=ngl, tensor_split=split, n_ctx=ctx, n_batch=512,
                                        n_ubatch=ub, flash_attn=fa, n_threads=2, rpc_servers=tuple(eps),
                                        use_mmap=False, swa_full=swa_full)
                    result = runner.run(settings, BenchSpec(n_prompt=0, n_gen=1, repetitions=1, warmup=False))
                    if not result.ok:
                        print(f"{name} ngl={ngl}: {result.outcome.value} {result.message}")
                        continue
                    devices = [f"RPC0[{e}]" for e in eps]
                    est = estimate(info, settings, devices=devices)
                    cells = []
                    for device in ["CPU", *devices]:
                        real = measured(result.load, device)
                        guess = est.devices[device]
                        for kind, r, g in zip(("weights", "kv", "compute"), real, (guess.weights, guess.kv, guess.compute)):
                            if r == 0 and g == 0:
                                continue
                            err = abs(g - r) / max(r, 1)
                            worst[kind] = max(worst[kind], err)
                            if kind == "compute":
                                compute_errors["cpu-only" if ngl == 0 else "offloaded"].append(err)
                            cells.append(f"{kind[0]}{r / MiB:.2f}/{g / MiB:.2f}")
                        cells.append("|")
                    rows += 1
                    swa = f" swa_full={int(swa_full)}" if info.sliding_window else ""
                    print(f"{name:12} ngl={ngl:2} ts={split or '-'} ctx={ctx} ub={ub} fa={fa:3}{swa} " + " ".join(cells[:-1]))
    finally:
        for server in servers:
            server.stop()
    print(f"\n{rows} configurations (measured/estimated MiB per device)")
    for kind, err in worst.items():
        print(f"worst {kind:8} error: {err * 100:6.2f}%")
    for group, errs in compute_errors.items():
        if errs:
            errs.sort()
            print(f"compute, {group:9}: {len(errs)} buffers, median error {errs[len(errs) // 2] * 100:.1f}%, "
                  f"worst {errs[-1] * 100:.1f}%, {sum(e > 0.25 for e in errs)} over 25%")
    ok = worst["weights"] <= 0.01 and worst["kv"] <= 0.01 and worst["compute"] <= 0.25
    print("targets (weights, KV <= 1%, compute <= 25%):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
