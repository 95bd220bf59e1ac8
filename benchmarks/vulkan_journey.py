"""A real second GPU backend, and what it costs: llama.cpp's Vulkan build on Mesa's lavapipe.

lavapipe (Debian's ``mesa-vulkan-drivers``) is a Vulkan device made of the CPU; llama.cpp's Vulkan
backend runs on it as ``Vulkan0``, a GPU NVML cannot see. This script

1. builds llama-bench and llama-fit-params with ``-DGGML_VULKAN=ON`` from the sources of the
   installed llama-cpp-python (``benchmarks/vulkan_build.sh``), or reuses ``--bin DIR`` when it holds
   them; prints the build's wall time and the machine's load average around it;
2. prints ``Vulkan0`` as llama.cpp lists it, then llama-bench on a small made model (Q4_K_M) with every
   layer on the CPU and every layer on ``Vulkan0``, in one llama-bench run (``-ngl 0,99``: back to back,
   so drift falls on both alike), with the buffers the load log puts on ``Vulkan0``;
3. runs ``tests/test_vulkan.py`` on the build (the engines' contract on ``Vulkan0``, and one tune ->
   fresh-process app load -> every export), and prints its time and outcome.

Why a benchmark and not CI: the build alone takes about 15 minutes on 2 idle cores (the shaders), and
CI must stay under 30 minutes (it takes about 11). Nothing is cached across runs.

    python benchmarks/vulkan_journey.py [--bin DIR] [--skip-tests]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TOOLS = ("llama-bench", "llama-fit-params")
MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bin", type=Path, default=None,
                        help="Folder for the Vulkan tools: reused when it holds them, else built into it (default: a temporary folder).")
    parser.add_argument("--skip-tests", action="store_true", help="Only build (or reuse) and measure; do not run tests/test_vulkan.py.")
    parser.add_argument("--threads", type=int, default=2, help="llama-bench -t for the CPU part (default 2).")
    args = parser.parse_args()

    scratch = tempfile.TemporaryDirectory(prefix="vulkan-journey-")
    folder = args.bin or Path(scratch.name) / "vulkan-bin"
    env = {**os.environ, "GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")}

    # 1. the build
    if all((folder / t).is_file() for t in TOOLS):
        print(f"build: reusing {folder}")
    else:
        load_before = os.getloadavg()
        started = time.monotonic()
        proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "vulkan_build.sh"), str(folder)], capture_output=True, text=True)
        seconds = time.monotonic() - started
        if proc.returncode != 0:
            print(f"build failed after {seconds:.0f} s:\n{proc.stdout}{proc.stderr}", file=sys.stderr)
            return 1
        load_after = os.getloadavg()
        print(f"build: {seconds / 60:.1f} min wall on {os.cpu_count()} cores (load average {load_before[0]:.1f} before, "
              f"{load_after[0]:.1f} after, {load_after[2]:.1f} over 15 min)")

    # 2. Vulkan0, its speed against the CPU, and the buffers it holds
    listing = subprocess.run([str(folder / "llama-bench"), "--list-devices"], capture_output=True, text=True, env=env, timeout=120)
    lines = [line.strip() for line in listing.stdout.splitlines() if line.strip().startswith("Vulkan")]
    if listing.returncode != 0 or not lines:
        print(f"llama-bench --list-devices lists no Vulkan device:\n{listing.stdout}{listing.stderr}", file=sys.stderr)
        return 1
    print("device: " + "; ".join(lines))
    speeds(folder, Path(scratch.name), env, args.threads)

    # 3. the tests
    if args.skip_tests:
        return 0
    started = time.monotonic()
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_vulkan.py"], cwd=ROOT,
                           env={**env, "OFFLOAD_TUNER_VULKAN_BIN": str(folder.resolve())}, capture_output=True, text=True)
    seconds = time.monotonic() - started
    tail = [line for line in tests.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    print(f"tests/test_vulkan.py: {seconds:.0f} s, {tail[0]}")
    if tests.returncode != 0:
        failed = [line for line in tests.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        print("\n".join(failed))
    return tests.returncode


def speeds(folder: Path, scratch: Path, env: dict[str, str], threads: int) -> None:
    from tuner.engine.logparse import parse_log
    from tuner.testing import ModelShape, make_model, quantize

    # 4 layers of 256: the model of the journey test
    shape = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx_train=4096)
    model = quantize(make_model(scratch / "small-F16.gguf", shape), scratch / "small-Q4_K_M.gguf", "Q4_K_M")
    cmd = [str(folder / "llama-bench"), "-m", str(model), "-ngl", "0,99", "-p", "64", "-n", "16", "-r", "2", "-t", str(threads),
           "-o", "json", "-v"]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        print(f"llama-bench failed: {proc.stderr[-2000:]}", file=sys.stderr)
        return
    rows = json.loads(proc.stdout[proc.stdout.index("["):])
    table: dict[int, dict[str, float]] = {}
    for row in rows:
        test = "tg" if int(row.get("n_gen") or 0) > 0 else "pp"
        table.setdefault(int(row["n_gpu_layers"]), {})[test] = float(row["avg_ts"])
    print(f"llama-bench -ngl 0,99 -p 64 -n 16 -r 2 -t {threads} ({seconds:.0f} s, one run, back to back):")
    for ngl, row in sorted(table.items()):
        where = "every layer on Vulkan0" if ngl else "every layer on the CPU"
        print(f"  -ngl {ngl:>2} ({where}): pp64 {row.get('pp', 0):8.1f} t/s   tg16 {row.get('tg', 0):8.1f} t/s")
    if 0 in table and 99 in table and table[99].get("tg"):
        print(f"  CPU / Vulkan0: pp {table[0]['pp'] / table[99]['pp']:.1f}x, tg {table[0]['tg'] / table[99]['tg']:.1f}x")
    report = parse_log(proc.stderr)  # the last load: -ngl 99
    print(f"  load log (-ngl 99): offloaded {report.layers_offloaded}/{report.layers_total} layers; on Vulkan0: "
          f"weights {report.model_buffers.get('Vulkan0', 0) / MiB:.2f} MiB, KV {report.kv_buffers.get('Vulkan0', 0) / MiB:.2f} MiB, "
          f"compute {report.compute_buffers.get('Vulkan0', 0) / MiB:.2f} MiB")


if __name__ == "__main__":
    sys.exit(main())
