"""Start llama-server with a model's profile: the settings offload-tuner found fastest here.

    python examples/serve_from_profile.py ~/models/Qwen3-8B-Q4_K_M.gguf --port 8080
    python examples/serve_from_profile.py ~/models/Qwen3-8B-Q4_K_M.gguf --server-bin ~/llama.cpp/build/bin/llama-server
    python examples/serve_from_profile.py ~/models/Qwen3-8B-Q4_K_M.gguf --parallel 4   # 4 slots (-np 4)

The profile is checked against the memory free right now (and adjusted, loudly, if it no longer
fits) before llama-server starts; `--print` shows the command instead of running it. The server
gets the profile's `-np` (the users it was tuned for); `--parallel N` serves N at once, and a
profile tuned for another number says what memory that needs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import warnings

from tuner.profile.apps import load_profile
from tuner.errors import TunerError
from tuner.profile.exports import tool_args
from tuner.profile.document import LlamaBuildWarning, ProfileWarning


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the GGUF file to serve")
    parser.add_argument("--server-bin", help="the llama-server executable (default: llama-server on PATH)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--strict", action="store_true", help="refuse to start if the profile no longer fits as recorded")
    parser.add_argument("--parallel", "-np", type=int, default=None,
                        help="requests served at once (llama-server's slots; default: the users the profile was tuned for)")
    parser.add_argument("--print", dest="print_only", action="store_true", help="print the command, do not run it")
    parser.epilog = "Flags after -- go to llama-server as they are, e.g. -- --parallel 2"
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)

    server = args.server_bin or shutil.which("llama-server")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ProfileWarning)  # printed below, one line each
        try:
            # llama_bin: this app runs llama.cpp's binaries, so a profile measured on another build says so
            folder = os.path.dirname(os.path.abspath(server)) if server and os.path.isfile(server) else None
            # users: a profile tuned for another number of users says what serving this many needs
            profile = load_profile(args.model, strict=args.strict, llama_bin=folder, users=args.parallel)
        except TunerError as exc:
            print(f"cannot use a profile: {exc}", file=sys.stderr)
            return 1
    for warning in caught:
        if issubclass(warning.category, LlamaBuildWarning) or "user(s) at once" in str(warning.message):
            print(f"note: {warning.message}", file=sys.stderr)
    for change in profile.degradation:
        print(f"changed to fit now: {change}", file=sys.stderr)

    flags = tool_args(profile, "llama-server", model_path=os.fspath(args.model))
    if args.parallel is not None:
        flags[flags.index("-np") + 1] = str(args.parallel)  # the profile's -np: the users it was tuned for
    command = [
        server or "llama-server",
        *flags,
        "--host", args.host,
        "--port", str(args.port),
        *extra,
    ]  # fmt: skip
    if args.print_only:
        print(shlex.join(command))
        return 0
    if server is None or not (os.path.isfile(server) and os.access(server, os.X_OK)):
        where = f"{args.server_bin} is not an executable file" if args.server_bin else "no llama-server on PATH"
        print(
            f"cannot start llama-server: {where}. Build it from llama.cpp (cmake --build build --target llama-server) "
            "or install a release, then pass --server-bin PATH. The command would be:\n  " + shlex.join(command),
            file=sys.stderr,
        )
        return 2
    print(f"profile {profile.name}: {shlex.join(command)}", file=sys.stderr)
    os.execv(server, command)  # llama-server takes over this process (and its Ctrl-C)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
