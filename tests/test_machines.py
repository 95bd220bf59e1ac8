"""The machine matrix: the whole journey on every kind of machine in ``tests/machines/``.

Each folder holds what llama.cpp and the OS really printed on one kind of machine (sources in its
README). ``OFFLOAD_TUNER_TEST_MACHINE`` (``tuner.engine.recorded``) makes the lowest seams read it:
ggml's device list in the python engine's child process, NVML, the CPU, the platform. Everything above
runs for real, twice, in two processes:

  probe (the python engine's child lists the devices) -> tune (the scripted engine: trials are the
  only thing not run, there is no such GPU here) -> profile -> ``load_profile`` / ``tuner.Llama``'s
  settings in a FRESH process that probes the same machine (cold: through a llama.cpp child; warm:
  from the per-boot device cache, no llama.cpp) -> ``offload-tuner profile check`` (in-process, from the
  cache) -> every export,
  the llama-server/llama-cli flags and the env export through llama.cpp's own parser.

What the parser cannot take here is checked against the recorded device list instead: ``-dev CUDA0``
names a device this CI machine does not have, and ``--rpc`` connects while parsing. A profile written
before identity v2 (``legacy_identities``) is loaded too.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parsers import parsed
from tuner.engine.fake import ScriptedRunner
from tuner.engine.python import TrialRunner
from tuner.machine.devices import used_devices
from tuner.machine.probe import probe
from tuner.engine.recorded import ENV_TEST_MACHINE, RecordedMachine
from tuner.model.inspect import inspect
from tuner.profile.exports import export_args, tool_args
from tuner.search.study import Tuner

ROOT = Path(__file__).resolve().parent.parent
MACHINES = ROOT / "tests" / "machines"
KINDS = sorted(p.name for p in MACHINES.iterdir() if p.is_dir()) if MACHINES.is_dir() else []

# The child: an app loading the profile, as an app would, on the same recorded machine.
APP = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
import tuner
from tuner.machine.devices import app_devices
from tuner.profile.apps import this_machine
model, legacy = sys.argv[1], sys.argv[2]
cached = app_devices()["cached"]
out = {"cached_before": cached}
try:
    p = tuner.load_profile(model)
    out.update(name=p.name, kwargs={k: v for k, v in p.llama_kwargs().items() if k != "model_path"},
               devices=list(p.settings.devices), degradation=list(p.degradation))
except tuner.TunerError as exc:
    out["error"] = str(exc)
machine = this_machine()
out.update(fingerprint=machine.fingerprint(), hardware_class=machine.hardware_class(),
           used=[d["name"] for d in machine.used_accelerators()], unified=machine.unified_memory)
if legacy != "-":
    try:
        out["legacy"] = tuner.load_profile(model, search_path=[legacy]).name
    except tuner.TunerError as exc:
        out["legacy_error"] = str(exc)
out["llama_cpp_imported"] = "llama_cpp" in sys.modules
if sys.argv[3] == "llama" and "error" not in out:
    # tuner.Llama itself: llama-cpp-python (a CPU build here) loads the tiny model as the profile says,
    # after checking llama.cpp here would pick the profile's devices
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = tuner.Llama(model)
    out["llama_n_ctx"] = llm.n_ctx()
    out["llama_warnings"] = [str(w.message) for w in caught if "devices" in str(w.message)]
    llm.close()
print(json.dumps(out))
"""


def _env(kind: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES",)}
    env.update(RecordedMachine(MACHINES / kind).env().get("env", {}))
    env.update({ENV_TEST_MACHINE: str(MACHINES / kind), "PYTHONPATH": str(ROOT), **extra})
    return env


def _app(model: Path, env: dict[str, str], legacy: Path | None = None, llama: bool = False) -> dict:
    proc = subprocess.run([sys.executable, "-c", APP, str(model), str(legacy or "-"), "llama" if llama else "-"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tuner.testing import ModelShape, make_model

    shape = ModelShape(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128, n_vocab=320, n_ctx_train=512)
    return make_model(tmp_path_factory.mktemp("matrix") / "tiny.gguf", shape)


def test_every_kind_the_issue_names_has_a_folder():
    named = {"apple-m-series", "amd-discrete-rocm", "amd-apu-gfx1151", "laptop-igpu-dgpu-vulkan",
             "two-nvidia-cuda-visible-devices", "cuda-plus-two-rpc", "intel-arc-sycl", "cpu-only"}
    assert named <= set(KINDS), named - set(KINDS)
    for kind in KINDS:
        assert (MACHINES / kind / "README.md").is_file(), f"{kind}: every recorded output needs its source"


# What each kind's recorded outputs say llama.cpp will use, and why (read from its README).
EXPECTED_USED = {
    "apple-m-series": ["Metal"],  # a 2025-03 build: the device was named Metal before MTL0
    "amd-discrete-rocm": ["ROCm0"],
    "amd-apu-gfx1151": ["ROCm0"],  # the APU alone: its iGPU is used
    "laptop-igpu-dgpu-vulkan": ["Vulkan1"],  # the Intel iGPU (uma: 1) is not used beside the RTX 3050
    "two-nvidia-cuda-visible-devices": ["CUDA0", "CUDA1"],
    "cuda-plus-two-rpc": ["RPC0[mlbox.local:50052]", "CUDA0", "CUDA1"],  # RPC servers first
    "intel-arc-sycl": ["SYCL0"],  # the UHD 770 iGPU is not used beside the A770
    "cpu-only": [],
    "cpu-amx-xeon": [],
}
UNIFIED = {"apple-m-series", "amd-apu-gfx1151"}


@pytest.mark.parametrize("kind", KINDS)
def test_the_whole_journey(kind, model, tmp_path, monkeypatch, llama_parsers):
    recorded = RecordedMachine(MACHINES / kind)
    env = _env(kind)
    for key in ("CUDA_VISIBLE_DEVICES",):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    rpc = tuple(recorded.rpc())

    # 1. probe: the python engine's child process lists the devices (ggml's registry, here recorded)
    engine = TrialRunner()
    try:
        machine = probe(engine=engine, rpc_servers=rpc)
    finally:
        engine.close()
    used = [d["name"] for d in machine.used_accelerators()]
    if kind in EXPECTED_USED:
        assert used == EXPECTED_USED[kind]
    assert used == [d.name for d in used_devices(recorded.devices())]
    assert machine.unified_memory == (kind in UNIFIED)
    assert machine.system == (recorded.platform() or machine.system)

    # 2. tune: the search over the devices llama.cpp will use, trials answered by the scripted engine
    info = inspect(model)
    capacity = {d["name"]: int(d.get("memory_free") or d.get("memory_total") or 0) for d in machine.used_accelerators()}
    fake = ScriptedRunner({str(model): info}, devices=tuple(used), capacity=capacity)
    tuner = Tuner(str(model), trials=3, machine=machine, engine=fake, rpc_servers=rpc, min_ctx=256, n_prompt=32,
                  n_gen=8, repetitions=1, final_repetitions=1, final_candidates=1, final_rounds=1, vram_margin=0,
                  measure_quality=False)
    result = tuner.run()
    profile = result.profile
    assert profile is not None and result.profile_path is not None, result.profile_error
    names = list(tuner.space.device_names)
    assert list(profile.settings.devices) == names
    assert [d.name for d in profile.machine.devices] == [d["name"] for d in machine.accelerators()]
    assert profile.machine.fingerprint == machine.fingerprint()

    # 3. an app, in a fresh process, on the same machine: cold (llama.cpp's devices through a child), then
    # warm (this boot's cache: no llama.cpp start-up)
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    from tuner.machine.identity import legacy_identities

    old_fp, old_class = legacy_identities(machine)
    document = profile.to_dict()
    document["machine"].update(fingerprint=old_fp, hardware_class=old_class)
    (legacy / "old.json").write_text(json.dumps(document))
    cold = _app(model, env, legacy)
    warm = _app(model, env, llama=not rpc)  # (tuner.Llama would connect to the recorded RPC server: not here)
    for app in (cold, warm):
        assert "error" not in app, app["error"]
        assert app["name"] == profile.name
        assert app["fingerprint"] == machine.fingerprint() and app["hardware_class"] == machine.hardware_class()
        # (an app lists this machine's devices; RPC servers are asked when a profile names them)
        assert app["used"] == [u for u in used if not u.startswith("RPC")] and app["unified"] == machine.unified_memory
        assert app["devices"] == names
        assert app["kwargs"]["n_gpu_layers"] == profile.settings.n_gpu_layers or app["degradation"]
        assert app["llama_cpp_imported"] is False
    assert cold.get("legacy") == "old", cold.get("legacy_error")  # a profile from before identity v2 still loads
    assert warm["cached_before"] is True  # the second app paid no llama.cpp start-up
    if not rpc:
        assert warm["llama_n_ctx"] == profile.settings.n_ctx and warm["llama_warnings"] == []

    # 4. profile check (in this process: the device list comes from this boot's cache, as for any app)
    from click.testing import CliRunner

    from tuner.cli.main import cli

    check = CliRunner().invoke(cli, ["profile", "check", str(model)])
    assert check.exit_code == 0, check.output[-2000:]
    assert profile.name in check.output

    # 5. every export: the device list travels with the split
    harness, _bench, parse_env = llama_parsers
    for tool in ("llama-server", "llama-cli", "llama-bench"):
        words = tool_args(profile, tool, model_path=str(model))
        if names:
            sep = "/" if tool == "llama-bench" else ","
            i = words.index("-dev")
            assert words[i + 1] == sep.join(names)
            if rpc:
                assert words.index("--rpc") < i  # RPC devices exist once --rpc has registered them
        else:
            assert "-dev" not in words
    env_text = export_args(profile, "env")
    assert (f"export LLAMA_ARG_DEVICE={','.join(names)}\n" in env_text) == bool(names)
    modelfile = export_args(profile, "ollama")
    assert ("ollama cannot be told which devices to use" in modelfile) == bool(names)
    # llama.cpp's own parser: everything but the devices (not on this machine) and --rpc (it connects)
    here = profile.replace(settings=profile.settings.replace(devices=(), rpc_servers=()))
    for tool in ("llama-server", "llama-cli"):
        out = parsed(harness, tool, tool_args(here, tool, model_path=str(model)), parse_env)
        assert out["model"] == str(model)
        assert out["n_gpu_layers"] == str(profile.layers_total if here.settings.n_gpu_layers < 0 else here.settings.n_gpu_layers)
        assert "device" not in out
    assert shlex.split(export_args(here, "llama-server"))


def test_an_app_started_with_other_visible_cuda_devices_is_told_what_changed(model, monkeypatch):
    """Tuned with both cards; an app started with CUDA_VISIBLE_DEVICES=1 sees only the RTX 5090 (as its
    CUDA0, recorded on that machine): not this profile's machine, and the message says why in words."""
    kind = "two-nvidia-cuda-visible-devices"
    if not (MACHINES / kind / "cuda-visible-devices-1.txt").is_file():
        pytest.skip(f"{kind} has no run recorded with CUDA_VISIBLE_DEVICES=1")
    env = _env(kind)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    engine = TrialRunner()
    try:
        machine = probe(engine=engine)
    finally:
        engine.close()
    info = inspect(model)
    fake = ScriptedRunner({str(model): info}, devices=("CUDA0", "CUDA1"))
    Tuner(str(model), trials=2, machine=machine, engine=fake, min_ctx=256, n_prompt=32, n_gen=8, repetitions=1,
          final_repetitions=1, final_candidates=1, final_rounds=1, vram_margin=0, measure_quality=False).run()
    app = _app(model, {**env, "CUDA_VISIBLE_DEVICES": "1"})
    assert app["used"] == ["CUDA0"]
    assert "for another machine" in app["error"]
    assert ("devices llama.cpp uses: NVIDIA GeForce RTX 4090 (10 GiB), NVIDIA GeForce RTX 5090 (31 GiB) when tuned, "
            "NVIDIA GeForce RTX 5090 (memory unknown) here") in app["error"]
