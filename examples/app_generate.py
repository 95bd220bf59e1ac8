"""An app that runs a model the way offload-tuner found fastest on this machine.

    python examples/app_generate.py ~/models/Qwen3-8B-Q4_K_M.gguf "Write a haiku about VRAM."

It loads the model's profile (tuned on this machine, or on one with the same GPUs), checks that it
still fits in the memory free right now, and says what it had to change if it did not. Make a
profile first with `offload-tuner tune MODEL`; teammates' profiles are found through
OFFLOAD_TUNER_PROFILE_PATH.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from tuner.profile.apps import Llama, load_profile
from tuner.errors import TunerError
from tuner.profile.document import ProfileWarning


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the GGUF file to run")
    parser.add_argument("prompt", nargs="?", default="Explain in two sentences why GPU offload speeds up generation.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--strict", action="store_true", help="refuse to run if the profile no longer fits as recorded")
    args = parser.parse_args()

    # Profile warnings (another llama.cpp build, a smaller context, fewer GPU layers) are shown once
    # here, in the app's words, rather than as Python warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileWarning)
        try:
            profile = load_profile(args.model, strict=args.strict)
        except TunerError as exc:
            print(f"cannot use a profile: {exc}", file=sys.stderr)
            return 1
    print(f"profile {profile.name}: {profile.measured.tg.median:g} t/s generation measured on {profile.machine.describe()}", file=sys.stderr)
    for change in profile.degradation:
        print(f"  changed to fit now: {change}", file=sys.stderr)

    try:
        llm = Llama(args.model, profile=profile)
    except TunerError as exc:
        print(f"cannot load the model: {exc}", file=sys.stderr)
        return 1
    result = llm.create_completion(args.prompt, max_tokens=args.max_tokens)
    print(result["choices"][0]["text"].strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
