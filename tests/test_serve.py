"""A profile tuned for four users, served for real (issue 21): its exported llama-server command and its
``LLAMA_ARG_*`` environment start llama-server (built from the same llama.cpp sources, linked to the
same libraries as llama-cpp-python) with four slots, as tuned; four requests sent at once are all
processed; the buffers llama-server allocates are the ones the profile predicted (weights and KV within
1%, compute within 15%, as the estimate's own tests hold them). Speed is compared in
``benchmarks/serve_parity.py`` (a speed target is a benchmark's job, not a test's)."""

from __future__ import annotations

import os
import shlex

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.engine.logparse import parse_log
from tuner.testing import LlamaServer, llama_cpp_env

from .conftest import SWA, TINY


@pytest.mark.parametrize("name", ["swa", "q8_0"])  # a sliding-window and a dense model
def test_a_four_user_profile_runs_in_llama_server_as_tuned(name, models, llama_server, tuner_home, tmp_path):
    from tuner.search.study import tune

    n, P, G = 4, 32, 8
    out = tmp_path / f"{name}-4users.json"
    result = tune(str(models[name]), users=n, objective="aggregate", trials=3, min_ctx=256, n_prompt=P, n_gen=G,
                  repetitions=1, final_repetitions=1, final_candidates=1, final_rounds=1, out=out, measure_quality=False)
    profile = result.profile
    assert profile is not None and profile.settings.n_parallel == n
    exported = CliRunner().invoke(cli, ["profile", "args", str(out), "--for", "llama-server"])
    assert exported.exit_code == 0, exported.output
    words = shlex.split(exported.output.strip().splitlines()[-1])
    assert words[0] == "llama-server" and "-np" in words and words[words.index("-np") + 1] == str(n)
    n_vocab = (SWA if name == "swa" else TINY).n_vocab
    unified = "true" if profile.settings.kv_unified else "false"

    # the command line, as a user pastes it (-lv 4: llama-server prints the load log from there on)
    server = LlamaServer(llama_server, [*words[1:], "-lv", "4"], env=llama_cpp_env())
    try:
        served = server.complete_together(n, P, G, n_vocab=n_vocab)
        log = server.log
    finally:
        server.close()
    assert served.prompt_n == [P] * n and served.predicted_n == [G] * n
    assert min(served.per_user_tg) > 0 and min(served.ttft_s) > 0
    assert f"n_slots = {n}," in log and f"kv_unified = '{unified}'" in log
    load = parse_log(log)
    predicted = profile.memory.predicted["CPU"]
    assert load.kv_buffers["CPU"] == pytest.approx(predicted.kv, rel=0.01)
    assert load.compute_buffers["CPU"] == pytest.approx(predicted.compute, rel=0.15)
    assert sum(load.model_buffers.values()) == pytest.approx(predicted.weights, rel=0.01)

    # the environment export (LLAMA_ARG_N_PARALLEL and the rest): the same server, no flags but the model
    env_text = CliRunner().invoke(cli, ["profile", "args", str(out), "--for", "env"])
    assert env_text.exit_code == 0, env_text.output
    env = llama_cpp_env()
    flags_only: list[str] = []
    for line in env_text.output.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            env[key] = shlex.split(value)[0] if value else ""
        elif "pass them as flags:" in line:  # settings llama-server takes as flags only (-tb)
            flags_only = shlex.split(line.split("pass them as flags:", 1)[1])
    assert env.get("LLAMA_ARG_N_PARALLEL") == str(n)
    args = ([] if "LLAMA_ARG_MODEL" in env else ["-m", str(models[name])]) + flags_only
    server = LlamaServer(llama_server, [*args, "-lv", "4"], env=env)
    try:
        served = server.complete_together(n, P, G, n_vocab=n_vocab)
        log = server.log
    finally:
        server.close()
    assert served.predicted_n == [G] * n
    assert f"n_slots = {n}," in log and f"kv_unified = '{unified}'" in log
    assert parse_log(log).kv_buffers["CPU"] == pytest.approx(predicted.kv, rel=0.01)


def test_llama_server_is_built_from_the_sources_of_the_installed_llama_cpp(llama_server):
    """The binary runs and is linked to llama-cpp-python's own libraries (the same llama.cpp)."""
    import subprocess
    import sysconfig
    from pathlib import Path

    proc = subprocess.run([str(llama_server), "--version"], capture_output=True, text=True, env=llama_cpp_env(), timeout=60)
    assert proc.returncode == 0 and "version:" in (proc.stdout + proc.stderr)
    if os.path.exists("/usr/bin/ldd"):
        libs = subprocess.run(["ldd", str(llama_server)], capture_output=True, text=True, env=llama_cpp_env()).stdout
        libdir = Path(sysconfig.get_paths()["purelib"]) / "lib"
        line = next(x for x in libs.splitlines() if "libllama.so" in x)
        assert str(libdir) in line, line
