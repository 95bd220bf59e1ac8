"""A real second GPU backend: llama.cpp's Vulkan build on Mesa's lavapipe.

lavapipe (Debian's ``mesa-vulkan-drivers``) is a Vulkan device made of the CPU. llama.cpp's Vulkan
backend runs on it as a GPU: it lists it as ``Vulkan0`` with its own memory (2 GiB), allocates model,
KV and compute buffers on it and offloads layers to it; NVML cannot see it. So the journey of a machine
whose GPU NVML does not see (every Mac, AMD and Intel GPU machine) runs here for real:

- the engines' contract (every test of tests/test_engines.py that takes the ``kit`` fixture), collected
  again here with a kit whose device is ``Vulkan0`` instead of an RPC server;
- one tune on ``Vulkan0`` -> a fresh process that probes the machine itself finds the profile
  (``tuner.load_profile``, ``tuner.Llama``, ``profile list``/``check``) -> every export, read back by the
  Vulkan build's own tools, which put the layers on ``Vulkan0``.

Opt-in (marker ``vulkan``): ``OFFLOAD_TUNER_VULKAN_BIN`` names a folder of llama.cpp tools built with
``-DGGML_VULKAN=ON`` from the sources of the installed llama-cpp-python (``benchmarks/vulkan_build.sh``);
``python benchmarks/vulkan_journey.py`` builds one and runs these tests. ggml-vulkan skips CPU-type
devices unless they are named, so ``GGML_VK_VISIBLE_DEVICES=0`` is set for every process here (unless
set already). lavapipe is slow (a few tokens per second): trials here are a few dozen tokens.
"""

from __future__ import annotations

import inspect as _inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import test_engines as _contract
from tests.test_engines import EngineKit
from tuner.testing import ModelShape, make_model, quantize

MiB = 1 << 20
ENV_VULKAN_BIN = "OFFLOAD_TUNER_VULKAN_BIN"
GPU = "Vulkan0"

pytestmark = pytest.mark.vulkan

# The contract, written once in tests/test_engines.py: every test there that takes the ``kit``
# fixture, collected here again; pytest resolves ``kit`` in this module, to the Vulkan kit below.
CONTRACT = sorted(name for name, test in vars(_contract).items()
                  if name.startswith("test_") and callable(test) and "kit" in _inspect.signature(test).parameters)
globals().update({name: getattr(_contract, name) for name in CONTRACT})


@pytest.fixture(scope="session")
def vulkan_build() -> Path:
    """The folder of Vulkan tools (``OFFLOAD_TUNER_VULKAN_BIN``), checked once: its llama-bench must
    list ``Vulkan0``. Unset: every test here is skipped, saying how to run them."""
    given = os.environ.get(ENV_VULKAN_BIN)
    if not given:
        pytest.skip(f"{ENV_VULKAN_BIN} is not set: build llama.cpp's Vulkan tools (bash benchmarks/vulkan_build.sh DIR, "
                    f"after apt-get install mesa-vulkan-drivers libvulkan-dev glslc) and set {ENV_VULKAN_BIN}=DIR, or "
                    "run python benchmarks/vulkan_journey.py")
    folder = Path(given)
    env = {**os.environ, "GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0")}
    proc = subprocess.run([str(folder / "llama-bench"), "--list-devices"], capture_output=True, text=True, env=env,
                          timeout=120)
    # set on purpose: a folder that does not show Vulkan0 is a failure, not a skip
    assert proc.returncode == 0 and f"  {GPU}: " in proc.stdout, (
        f"{folder}/llama-bench --list-devices does not list {GPU} (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return folder


@pytest.fixture
def vulkan_bin(vulkan_build: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The Vulkan tools, with lavapipe named for every process this test starts (the engine's
    binaries, and the fresh processes of the journey)."""
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", os.environ.get("GGML_VK_VISIBLE_DEVICES", "0"))
    return vulkan_build


@pytest.fixture
def kit(vulkan_bin, models, rpc_servers) -> EngineKit:
    made = EngineKit("llama-cpp", vulkan_bin, rpc_servers, models, gpu=GPU)
    yield made
    for engine in made.made:
        engine.close()


def test_the_contract_is_collected_here():
    # a rename in tests/test_engines.py must not silently drop the contract from this backend
    assert len(CONTRACT) >= 8 and "test_offloading_to_a_device_shows_in_the_load_log" in CONTRACT


def test_vulkan0_is_a_gpu_with_its_own_memory_that_nvml_does_not_see(vulkan_bin):
    from tuner.engine.llamacpp import LlamaCppEngine
    from tuner.machine.probe import probe

    with LlamaCppEngine(vulkan_bin) as engine:
        devices = {d.name: d for d in engine.devices()}
        machine = probe(engine=engine)
        build = engine.build()
    gpu = devices[GPU]
    assert gpu.backend == "Vulkan" and gpu.type == "gpu" and not gpu.unified_memory  # lavapipe says uma: 0
    assert gpu.memory_total and gpu.memory_free and gpu.memory_free <= gpu.memory_total
    assert "llvmpipe" in gpu.description
    assert "Vulkan" in build.backends
    assert not machine.gpus  # NVML sees no GPU here
    assert [d["name"] for d in machine.accelerators()] == [GPU]


# -- the journey: tune on Vulkan0, an app in a fresh process, every export --------------------------

# One offloading candidate against another (the KV cache on Vulkan0 or on the host), nothing else
# searched: the first seeds of a GPU machine put every layer on it. The CPU alone is much faster than
# lavapipe; a longer tune would find that and leave Vulkan0 out.
SPACE = {"type_k": ("f16",), "flash_attn": ("on",), "n_threads": (2,), "n_ubatch": (512,), "n_ctx": (512,),
         "tensor_overrides": ("none",)}
JOURNEY = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx_train=4096)

# The app: a fresh process that probes this machine itself (nothing injected), as an app does.
_APP = r"""
import json, sys, warnings
import tuner

model, llama_bin = sys.argv[1], sys.argv[2]
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    profile = tuner.load_profile(model)
out["load"] = {"path": str(profile.path), "settings": profile.settings.to_dict(), "degradation": list(profile.degradation),
               "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}
out["kwargs"] = {k: v for k, v in profile.llama_kwargs(model).items() if k in ("n_gpu_layers", "n_ctx", "main_gpu")}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with_bin = tuner.load_profile(model, llama_bin=llama_bin)
out["with_bin"] = {"path": str(with_bin.path), "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}
from tuner.engine.ggml import list_devices
out["python_devices"] = [d["name"] for d in list_devices()]  # llama-cpp-python's llama.cpp
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    llm = tuner.Llama(model, profile=profile)
    reply = llm("hello", max_tokens=4, temperature=0.0)
out["llama"] = {"tokens": reply["usage"]["completion_tokens"],
                "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}
print(json.dumps(out))
"""


def _fresh(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A new Python process with this test's environment (data folder, GGML_VK_VISIBLE_DEVICES)."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=dict(os.environ), timeout=timeout)


def _bench_json_and_log(proc: subprocess.CompletedProcess) -> tuple[list, object]:
    from tuner.engine.logparse import parse_log

    return json.loads(proc.stdout[proc.stdout.index("["):]), parse_log(proc.stderr)


def test_a_tune_on_vulkan0_is_found_by_an_app_in_a_fresh_process_and_every_export_offloads_there(
        vulkan_bin, tmp_path, tuner_home):
    from tuner.engine.llamacpp import LlamaCppEngine, clean_env
    from tuner.profile.exports import FORMATS
    from tuner.search.study import Tuner

    model = quantize(make_model(tmp_path / "journey-F16.gguf", JOURNEY), tmp_path / "journey-Q4_K_M.gguf", "Q4_K_M")
    events: list[dict] = []
    with LlamaCppEngine(vulkan_bin, timeout_s=300) as engine:
        tuner = Tuner(str(model), trials=2, min_ctx=512, n_prompt=64, n_gen=16, repetitions=2, final_repetitions=2,
                      final_rounds=1, final_candidates=2, engine=engine, on_event=events.append, space_overrides=SPACE)
        assert [d.name for d in tuner.space.devices] == [GPU]
        result = tuner.run()
    profile = result.profile
    # the tune offloaded to Vulkan0 and recorded it
    assert [e["outcome"] for e in events if e["kind"] == "result"] == ["ok", "ok"]
    assert profile.settings.n_gpu_layers != 0, profile.settings
    assert profile.memory.actual[GPU].weights > 0, profile.memory.actual
    assert [d.name for d in profile.machine.devices] == [GPU] and not profile.machine.gpus
    assert profile.engine is not None and profile.engine.name == "llama-cpp" and profile.engine.path == str(vulkan_bin)

    # an app in a fresh process, on the same machine, probing it itself
    app = _fresh("-c", _APP, str(model), str(vulkan_bin))
    assert app.returncode == 0, app.stderr[-3000:]
    seen = json.loads(app.stdout.strip().splitlines()[-1])
    assert seen["load"]["path"] == str(result.profile_path)
    assert seen["load"]["settings"] == profile.settings.to_dict() and seen["load"]["degradation"] == []
    assert seen["kwargs"]["n_gpu_layers"] == profile.settings.n_gpu_layers
    # an app that runs these binaries (as one that starts llama-server from that folder): the same
    # build measured it, and Vulkan0's free memory, read from them, holds it: nothing to warn about
    assert seen["with_bin"] == {"path": str(result.profile_path), "warnings": []}
    # tuner.Llama runs llama-cpp-python; one without a Vulkan backend (the one here: CPU and RPC) cannot
    # put the layers on Vulkan0: it runs them on the CPU, and says so loudly
    assert seen["llama"]["tokens"] > 0
    if GPU not in seen["python_devices"]:
        loud = [w for w in seen["llama"]["warnings"] + seen["load"]["warnings"] if w.startswith("ProfileDegradedWarning: ")]
        assert any(GPU in w or "PARTIAL OFFLOAD" in w for w in loud), seen

    # the command line, each command a fresh process
    listed = _fresh("-m", "tuner", "profile", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
    assert [(r["path"], r.get("match")) for r in rows] == [(str(result.profile_path), "this machine")], rows
    checked = _fresh("-m", "tuner", "profile", "check", str(model))
    assert checked.returncode == 0 and str(result.profile_path) in checked.stdout, checked.stdout + checked.stderr

    # every export, read back by the Vulkan build's own tools
    exports = {}
    for fmt in FORMATS:
        out = _fresh("-m", "tuner", "profile", "args", str(result.profile_path), "--for", fmt, "--model", str(model),
                     "--llama-bin", str(vulkan_bin))
        assert out.returncode == 0 and out.stdout.strip(), (fmt, out.stdout, out.stderr)
        assert out.stderr == "", (fmt, out.stderr)  # the binaries' own parser accepted every flag
        exports[fmt] = out.stdout
    env = clean_env()
    # llama-bench with the exported flags (a short benchmark): the layers are on Vulkan0
    words = exports["llama-bench"].split()
    assert words[0] == "llama-bench"
    bench = subprocess.run([str(vulkan_bin / "llama-bench"), *words[1:], "-p", "16", "-n", "4", "-r", "1", "-o", "json",
                            "-v"], capture_output=True, text=True, env=env, timeout=300)
    assert bench.returncode == 0, bench.stderr[-3000:]
    rows, log = _bench_json_and_log(bench)
    assert rows and all(r["n_gpu_layers"] == profile.settings.n_gpu_layers or profile.settings.n_gpu_layers < 0 for r in rows)
    assert log.layers_offloaded == log.layers_total and log.model_buffers.get(GPU, 0) > 0, log
    # llama-server's flags and the LLAMA_ARG_* variables, each parsed by common/arg.cpp (llama-fit-params
    # shares llama-server's parser): llama.cpp's own projection puts the weights on Vulkan0
    server = exports["llama-server"].split()
    assert server[0] == "llama-server"
    for argv, extra in ((server[1:], {}), ([], _env_assignments(exports["env"]))):
        fit = subprocess.run([str(vulkan_bin / "llama-fit-params"), *argv, "--fit-print", "on"], capture_output=True,
                             text=True, env={**env, **extra}, timeout=120)
        assert fit.returncode == 0, fit.stderr[-3000:]
        rows = {line.split()[0]: line.split()[1:] for line in fit.stdout.splitlines() if line.startswith(f"{GPU} ")}
        assert int(rows[GPU][0]) > 0, fit.stdout  # model MiB on Vulkan0
    assert "num_gpu" in exports["ollama"]


def _env_assignments(text: str) -> dict[str, str]:
    """``export LLAMA_ARG_X=value`` lines -> variables, read by a real shell (the export is shell-quoted)."""
    proc = subprocess.run(["bash", "-c", text + "\nenv -0"], capture_output=True, text=True, env={}, timeout=30)
    assert proc.returncode == 0, proc.stderr
    pairs = (item.split("=", 1) for item in proc.stdout.split("\0") if item.startswith("LLAMA_ARG_"))
    return dict(pairs)
