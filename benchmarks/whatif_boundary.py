"""The most layers ``estimate --device RPC0=SIZE`` predicts, against where llama.cpp really runs out.

For a made model and several device sizes and contexts, start an RPC server capped at SIZE (a
simulated GPU), load the model with 0, 1, 2... layers offloaded until llama.cpp fails to allocate,
and print the real boundary next to the prediction (``--margin 0``) and the difference in layers.

    python benchmarks/whatif_boundary.py [--caps 40,60,90,120] [--contexts 1024,4096]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tuner.engine.base import BenchSpec
from tuner.engine.python import run_trial
from tuner.engine.rpc import start_servers
from tuner.engine.settings import Settings
from tuner.machine.whatif import MachineSpec
from tuner.model.inspect import inspect
from tuner.report.fit import most_layers
from tuner.testing import ModelShape, make_model

MiB = 1 << 20
SHAPE = ModelShape(n_layer=6, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=4096, n_ctx_train=8192)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caps", default="40,60,90,120", help="device sizes in MiB")
    parser.add_argument("--contexts", default="1024,4096")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="whatif-"))
    model = make_model(folder / "m-F16.gguf", SHAPE)
    info = inspect(model)
    quick = BenchSpec(n_prompt=16, n_gen=2, repetitions=1, warmup=False)
    print(f"model: {SHAPE.n_layer} layers + output, F16, {info.file_size / MiB:.1f} MiB")
    print(f"{'cap MiB':>8} {'n_ctx':>6} {'predicted':>9} {'real':>5} {'diff':>5} {'seconds':>8}")
    diffs = []
    for cap in (int(x) for x in args.caps.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            (server,) = start_servers(1, memory_limits=[cap * MiB], threads=1)
            start = time.monotonic()
            try:
                planned = Settings(model_path=str(model), n_ctx=ctx, flash_attn="on")
                predicted = most_layers(info, MachineSpec({"RPC0": cap * MiB}), planned, margin=0)
                real = -1
                for ngl in range(0, info.n_layer + 2):
                    s = Settings(model_path=str(model), n_gpu_layers=ngl, n_ctx=ctx, n_threads=2, flash_attn="on",
                                 rpc_servers=(server.endpoint,))
                    if not run_trial(s, quick).ok:
                        break
                    real = ngl
            finally:
                server.stop()
            diffs.append(predicted - real)
            print(f"{cap:>8} {ctx:>6} {predicted:>9} {real:>5} {predicted - real:>+5} {time.monotonic() - start:>8.1f}")
    print(f"within one layer: {sum(abs(d) <= 1 for d in diffs)}/{len(diffs)}; exact: {sum(d == 0 for d in diffs)}/{len(diffs)}; "
          f"over-predicted: {sum(d > 0 for d in diffs)}")


if __name__ == "__main__":
    main()
