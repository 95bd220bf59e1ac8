"""What does `inspect URL` read, and how long does it take, against the local file?

Makes a model with a real-sized vocabulary (151936 tokens, as Qwen's: the bulk of a real
header), serves it over HTTP on 127.0.0.1 (the tests' range server), and measures in interleaved
rounds: inspect of the local file, inspect of the URL with an empty header cache (cold), and
inspect of the URL again (from the cache). Prints the bytes read against the header and the file,
the requests, and the median time of each.

    python benchmarks/remote_header.py [--rounds 5] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=151936)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["OFFLOAD_TUNER_HOME"] = str(Path(tmp) / "home")
        from range_server import ModelServer

        from tuner.model.gguf import header_info
        from tuner.model.inspect import inspect
        from tuner.paths import headers_dir
        from tuner.testing import ModelShape, make_model

        path = make_model(Path(tmp) / "www" / "big-vocab.gguf",
                          ModelShape(n_layer=4, n_embd=512, n_head=8, n_head_kv=8, n_ff=1024, n_vocab=args.vocab))
        size, header = path.stat().st_size, header_info(path)["header_len"]
        server = ModelServer(path.parent).start()
        url = server.url(path.name)
        times: dict[str, list[float]] = {"local": [], "url, cold": [], "url, cached": []}
        fetched = cached = None
        try:
            for _ in range(args.rounds):
                started = time.perf_counter()
                local = inspect(path)
                times["local"].append(time.perf_counter() - started)
                shutil.rmtree(headers_dir())
                started = time.perf_counter()
                remote = inspect(url)
                times["url, cold"].append(time.perf_counter() - started)
                fetched = remote.fetched
                started = time.perf_counter()
                again = inspect(url)
                times["url, cached"].append(time.perf_counter() - started)
                cached = again.fetched
                assert {**remote.to_dict(), "path": None, "fetched": None} == {**local.to_dict(), "path": None, "fetched": None}
        finally:
            server.stop()
    assert fetched is not None and cached is not None
    print(f"file {size / 2**20:.1f} MiB, header and tensor table {header / 2**20:.2f} MiB ({header / size:.2%} of the file)")
    print(f"cold: read {fetched['bytes_read'] / 2**20:.2f} MiB in {fetched['requests']} requests "
          f"({fetched['bytes_read'] / header:.2f}x the header, {fetched['bytes_read'] / size:.2%} of the file)")
    print(f"cached: {cached['requests']} requests, {cached['bytes_read']} bytes")
    base = statistics.median(times["local"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:12s} median {median * 1000:8.1f} ms over {len(values)} interleaved rounds ({median / base:.2f}x local)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
