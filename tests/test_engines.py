"""One contract, every engine: the python engine (llama-cpp-python), the llama-cpp engine (real llama.cpp
binaries built from the same sources: ``llama_bin``) and the scripted fake, through one parametrized
fixture, the way optuna tests every storage with one suite (``optuna/testing/pytest_storages.py``).

What only one engine does is tested below the contract (the python worker in test_runner.py)."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest

from tuner.engine.base import BenchSpec, Engine
from tuner.engine.devices import DeviceInfo
from tuner.engine.outcome import Outcome
from tuner.engine.settings import Settings
from tuner.model.inspect import inspect
from tuner.testing import ModelShape, make_model

MiB = 1 << 20
QUICK = BenchSpec(n_prompt=32, n_gen=8, repetitions=2)
ENGINES = ["python", "llama-cpp", "fake"]
# Wider than the TINY model: its weights (about 40 MiB in F16) overflow a device capped at 24 MiB.
WIDE = ModelShape(n_layer=4, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=4096)


def settings(path: Any, **changes: Any) -> Settings:
    base = dict(model_path=str(path), n_ctx=512, n_batch=512, n_ubatch=256, n_threads=2, n_threads_batch=2)
    return Settings(**{**base, **changes})


class EngineKit:
    """Makes one kind of engine, and the devices it offloads to: RPC servers (real servers for real
    engines), or the build's own GPU where it has one (``gpu``: ``Vulkan0`` of llama.cpp's Vulkan
    build on Mesa's lavapipe, tests/test_vulkan.py)."""

    def __init__(self, kind: str, llama_bin: Path | None, start_servers: Callable[..., Any], models: dict[str, Path],
                 *, gpu: str | None = None) -> None:
        self.kind = kind
        self.llama_bin = llama_bin
        self.start_servers = start_servers
        self.gpu = gpu
        self.infos = {str(p): inspect(p) for k, p in models.items() if k != "split"}
        self.capacity: dict[str, int] = {}
        self.devices: tuple[str, ...] = ()
        self.made: list[Engine] = []

    @property
    def local_devices(self) -> list[tuple[str, str]]:
        """The devices the engine lists with no RPC server, as (name, type): the CPU, and the GPU if any."""
        return [("CPU", "cpu")] + ([(self.gpu, "gpu")] if self.gpu else [])

    def offload_target(self, memory_limit: int | None = None) -> tuple[str, dict[str, Any]]:
        """A device to offload to: the label llama.cpp puts on its buffers, and the settings that
        reach it. The build's GPU where it has one (``memory_limit`` is then for ``beyond_memory``),
        else an RPC server (capped like a small GPU when ``memory_limit``)."""
        if self.gpu:
            return self.gpu, {}
        endpoint = self.rpc_device(memory_limit)
        return f"RPC0[{endpoint}]", {"rpc_servers": (endpoint,)}

    def beyond_memory(self, engine: Engine, device: str, shape: ModelShape) -> dict[str, Any]:
        """Settings under which a full offload of a ``shape`` model needs more than ``device`` has.
        A capped RPC server runs out at the default context. A GPU cannot be capped, and lavapipe
        takes its buffers from the host's RAM well past the 2 GiB it reports: a context whose KV
        cache alone is bigger than the device's free memory is refused, before launch, by llama.cpp's
        own projection at that context (the engine's check: llama-bench allocates only the
        benchmark's context)."""
        if not self.gpu:
            return {}
        (free,) = [d.memory_free for d in engine.devices() if d.name == device]
        kv_per_token = 2 * shape.n_layer * shape.n_head_kv * (shape.n_embd // shape.n_head) * 2  # K and V, f16
        return {"n_ctx": -(-(free * 5 // 4) // kv_per_token // 256) * 256}

    def rpc_device(self, memory_limit: int | None = None) -> str:
        """An RPC endpoint to offload to (capped like a small GPU when ``memory_limit``)."""
        if self.kind == "fake":
            endpoint = f"127.0.0.1:{50100 + len(self.devices)}"
            label = f"RPC0[{endpoint}]"
            self.devices += (label,)
            if memory_limit:
                self.capacity[label] = memory_limit
            return endpoint
        (server,) = self.start_servers(1, memory_limits=[memory_limit])
        return server.endpoint

    def add_model(self, path: Path) -> None:
        self.infos[str(path)] = inspect(path)

    def engine(self, *, timeout_s: float = 120) -> Engine:
        if self.kind == "python":
            from tuner.engine.python import TrialRunner

            made: Engine = TrialRunner(timeout_s=timeout_s)
        elif self.kind == "llama-cpp":
            from tuner.engine.llamacpp import LlamaCppEngine

            made = LlamaCppEngine(self.llama_bin, timeout_s=timeout_s)
        else:
            from tuner.engine.fake import ScriptedRunner

            made = ScriptedRunner(self.infos, devices=self.devices, capacity=self.capacity)
        self.made.append(made)
        return made


@pytest.fixture(params=ENGINES)
def kit(request, models, rpc_servers) -> EngineKit:
    llama_bin = request.getfixturevalue("llama_bin") if request.param == "llama-cpp" else None
    made = EngineKit(request.param, llama_bin, rpc_servers, models)
    yield made
    for engine in made.made:
        engine.close()


# -- the contract ---------------------------------------------------------------------------------


def test_it_names_itself_and_its_build(kit):
    with kit.engine() as engine:
        build = engine.build()
    assert build.engine == engine.name == {"python": "python", "llama-cpp": "llama-cpp", "fake": "fake"}[kit.kind]
    assert build.describe() != "unknown build" and build.error is None
    assert "CPU" in [b.upper() for b in build.backends]
    if kit.kind != "fake":
        # both real engines run llama.cpp built from the same sources: the same commit and build number
        from tuner.engine.python import read_build

        python = read_build()
        assert (build.commit, build.build_number) == (python["commit"], python["build_number"])


def test_it_lists_its_devices_with_llama_cpps_names(kit):
    endpoint = kit.rpc_device()
    with kit.engine() as engine:
        alone = engine.devices()
        devices = engine.devices((endpoint,))
    assert [(d.name, d.type) for d in alone] == kit.local_devices  # the CPU (and the build's GPU, where it has one)
    rpc = [d for d in devices if d.rpc_endpoint == endpoint]
    assert len(rpc) == 1
    device = rpc[0]
    assert device.name == f"RPC0[{endpoint}]" and device.backend == "RPC" and device.type == "gpu"
    assert device.is_accelerator and device.memory_total and device.memory_free
    assert DeviceInfo.from_dict(json.loads(json.dumps(device.to_dict()))) == device


def test_a_trial_measures_pp_and_tg_and_reads_the_load_log(kit, models):
    with kit.engine() as engine:
        result = engine.run(settings(models["q8_0"]), QUICK)
    assert result.outcome is Outcome.OK, result.message
    assert len(result.pp.samples) == QUICK.repetitions and len(result.tg.samples) == QUICK.repetitions
    assert all(x > 0 for x in result.pp.samples + result.tg.samples)
    assert result.settings == settings(models["q8_0"]) and result.bench == QUICK
    assert result.load.layers_total == 5 and result.load.layers_offloaded == 0
    assert sum(result.load.model_buffers.values()) > 0


def test_offloading_to_a_device_shows_in_the_load_log(kit, models):
    device, reach = kit.offload_target()
    with kit.engine() as engine:
        result = engine.run(settings(models["q8_0"], n_gpu_layers=3, **reach), QUICK)
    assert result.ok, result.message
    assert result.load.layers_offloaded == 3 and result.load.layers_total == 5
    assert result.load.model_buffers.get(device, 0) > 0


def test_a_device_that_runs_out_of_memory_is_oom(kit, tmp_path):
    model = make_model(tmp_path / "wide.gguf", WIDE)
    kit.add_model(model)
    device, reach = kit.offload_target(memory_limit=24 * MiB)
    with kit.engine() as engine:
        result = engine.run(settings(model, n_gpu_layers=-1, **reach, **kit.beyond_memory(engine, device, WIDE)), QUICK)
        assert result.outcome is Outcome.OOM, result.message
        assert device in result.message
        # the engine is usable afterwards, and one layer fits
        small = engine.run(settings(model, n_gpu_layers=1, **reach), QUICK)
    assert small.ok, small.message


def test_bad_settings_are_rejected_before_launch(kit, models, tmp_path):
    with kit.engine() as engine:
        missing = engine.run(settings(tmp_path / "gone.gguf"), QUICK)
        too_small = engine.run(settings(models["q8_0"], n_ctx=16, n_batch=16, n_ubatch=16), QUICK)
    assert missing.outcome is Outcome.BAD_SETTINGS and "model file not found" in missing.message
    assert too_small.outcome is Outcome.BAD_SETTINGS and "n_ctx 16" in too_small.message


def test_candidates_are_measured_side_by_side(kit, models):
    candidates = [settings(models["q8_0"]), settings(models["q4_k_m"]), settings(models["q8_0"], type_k="q8_0", flash_attn="on")]
    with kit.engine() as engine:
        results = engine.run_paired(candidates, BenchSpec(n_prompt=16, n_gen=4, repetitions=2), rounds=2)
    assert [r.settings for r in results] == candidates
    for r in results:
        assert r.ok, r.message
        assert len(r.tg.samples) == 2 * 2 and len(r.pp.samples) == 2 * 2


def test_close_leaves_no_process_behind(kit, models):
    engine = kit.engine()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    assert engine.run(settings(models["q8_0"]), QUICK).ok
    engine.close()
    after = {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}
    assert after <= before


# -- the llama-cpp engine: the user's binaries ---------------------------------------------------


def _wrapper(folder: Path, body: str, real: Path | None = None) -> Path:
    """A llama-bench in ``folder``: a shell script (over the real one when ``real``)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "llama-bench"
    path.write_text("#!/bin/sh\n" + body.replace("REAL", str(real) if real else ""))
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_llama_bench_samples_and_build_are_read_from_its_json(llama_bin, models):
    from tuner.engine.llamacpp import LlamaCppEngine

    with LlamaCppEngine(llama_bin) as engine:
        result = engine.run(settings(models["q4_k_m"]), BenchSpec(n_prompt=32, n_gen=8, depth=16, repetitions=3))
        args = engine.bench_args(settings(models["q4_k_m"]), BenchSpec(n_prompt=32, n_gen=8, depth=16, repetitions=3))
    assert result.ok, result.message
    assert len(result.pp.samples) == 3 and len(result.tg.samples) == 3
    assert args[args.index("-d") + 1] == "16" and args[args.index("-p") + 1] == "32"
    # llama-bench sizes its context from -p/-n/-d: 32 + 8 + 16 tokens, padded by llama.cpp to 256
    assert result.load.n_ctx == 256
    assert "llama_model_loader" in result.log  # -v kept llama.cpp's own log


def test_a_folder_without_llama_bench_is_one_clear_error(tmp_path, models, tuner_home):
    from click.testing import CliRunner

    from tuner.cli.main import cli

    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "llama-server").write_text("#!/bin/sh\n")
    (folder / "llama-server").chmod(0o755)
    # nothing lost: a profile already there stays as it was
    keep = tuner_home / "profiles" / "kept.json"
    keep.parent.mkdir(parents=True)
    keep.write_text("{}")
    expected = (f"Error: --llama-bin {folder}: no executable llama-bench there (it has: llama-server); the llama-cpp "
                "engine measures with llama-bench: build it (cmake --build build --target llama-bench) or point "
                "--llama-bin at the folder that has it")
    for command in (["probe"], ["bench", str(models["q8_0"])], ["tune", str(models["q8_0"]), "--trials", "1"]):
        out = CliRunner().invoke(cli, [*command, "--llama-bin", str(folder)])
        assert out.exit_code == 2, out.output
        assert out.output.strip() == expected
    out = CliRunner().invoke(cli, ["probe", "--llama-bin", str(tmp_path / "nowhere")])
    assert out.exit_code == 2 and out.output.strip() == f"Error: --llama-bin {tmp_path / 'nowhere'}: no such folder"
    out = CliRunner().invoke(cli, ["bench", str(models["q8_0"]), "--engine", "python", "--llama-bin", str(folder)])
    assert out.exit_code == 2 and "only the llama-cpp engine runs" in out.output
    assert keep.read_text() == "{}"
    assert not (tuner_home / "studies").exists() or not list((tuner_home / "studies").iterdir())


def test_a_binary_that_crashes_at_start_is_one_clear_error(tmp_path, models):
    from click.testing import CliRunner

    from tuner.cli.main import cli

    _wrapper(tmp_path / "bin", "kill -SEGV $$\n")
    out = CliRunner().invoke(cli, ["bench", str(models["q8_0"]), "--llama-bin", str(tmp_path / "bin"), "-p", "8", "-n", "2"])
    assert out.exit_code == 2, out.output
    assert out.output.count("\n") == 1 and out.output.startswith("Error: ")
    assert "crashed: killed by SIGSEGV" in out.output


def test_llama_bench_killed_mid_trial_is_a_crash(llama_bin, models, tmp_path):
    from tuner.engine.llamacpp import LlamaCppEngine

    with LlamaCppEngine(llama_bin, timeout_s=120) as engine:
        def kill_when_measuring() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                for proc in psutil.Process().children(recursive=True):
                    try:
                        if proc.name() == "llama-bench" and "-o" in proc.cmdline():
                            time.sleep(0.3)
                            os.kill(proc.pid, signal.SIGSEGV)
                            return
                    except psutil.Error:
                        continue
                time.sleep(0.02)

        killer = threading.Thread(target=kill_when_measuring)
        killer.start()
        result = engine.run(settings(models["f16"], n_ctx=4096), BenchSpec(n_prompt=2000, n_gen=200, repetitions=20))
        killer.join()
        assert result.outcome is Outcome.CRASH, result.message
        assert result.signal == "SIGSEGV" and result.message.startswith("llama-bench killed by SIGSEGV")
        again = engine.run(settings(models["q8_0"]), QUICK)  # the engine goes on
    assert again.ok, again.message


def test_a_trial_past_its_time_is_killed(llama_bin, models):
    from tuner.engine.llamacpp import LlamaCppEngine

    with LlamaCppEngine(llama_bin, timeout_s=1.5) as engine:
        started = time.monotonic()
        result = engine.run(settings(models["f16"], n_ctx=4096), BenchSpec(n_prompt=3000, n_gen=500, repetitions=50))
    assert result.outcome is Outcome.TIMEOUT
    assert time.monotonic() - started < 30
    assert not [p for p in psutil.Process().children(recursive=True) if p.name() == "llama-bench"]


def test_a_binary_too_old_for_a_flag_is_bad_settings_naming_the_flag(llama_bin, models, tmp_path):
    from tuner.engine.llamacpp import LlamaCppEngine

    # llama-bench as a build from before -nopo (--no-op-offload) existed: its help lacks the flag and
    # its parser rejects it, as llama-bench's parse_cmd_params does for any flag it does not know.
    real = Path(llama_bin) / "llama-bench"
    _wrapper(tmp_path / "old", """case " $* " in
  *" -nopo "*) echo "error: invalid parameter for argument: -nopo" >&2; exit 1;;
  *" --help "*) REAL --help | grep -v -- '-nopo'; exit 0;;
esac
exec REAL "$@"
""", real)
    with LlamaCppEngine(tmp_path / "old") as engine:
        refused = engine.run(settings(models["q8_0"], op_offload=False), QUICK)
        fine = engine.run(settings(models["q8_0"]), QUICK)
    assert refused.outcome is Outcome.BAD_SETTINGS
    assert "does not know -nopo (op_offload): it is too old for it" in refused.message
    assert fine.ok, fine.message


def test_llama_cpps_fitter_answers_and_projects_memory(llama_bin, models, rpc_servers):
    from tuner.engine.llamacpp import LlamaCppEngine

    (server,) = rpc_servers(1)
    s = settings(models["q8_0"], n_gpu_layers=3, rpc_servers=(server.endpoint,))
    with LlamaCppEngine(llama_bin) as engine:
        answer = engine.fit(s, margin=256 * MiB, min_ctx=512)
        projected = engine.fit_memory(s)
    # the server reports this machine's RAM as free: fit offloads every layer
    assert answer is not None and answer.settings.n_gpu_layers == -1 and answer.args.startswith("-c 512 -ngl")
    assert answer.settings.rpc_servers == (server.endpoint,)
    device = f"RPC0[{server.endpoint}]"
    assert set(projected) == {"CPU", device}
    info = inspect(models["q8_0"])
    from tuner.model.estimate import estimate

    ours = estimate(info, s, devices=[device])
    # llama.cpp prints whole MiB: the weights agree to that
    assert abs(projected[device]["weights"] - ours.devices[device].weights) <= 1 * MiB


def test_exported_flags_are_checked_by_the_binaries_own_parser(llama_bin, models):
    from tuner.engine.llamacpp import check_exported_flags

    s = settings(models["q8_0"], n_gpu_layers=2, type_k="q8_0", type_v="q8_0", flash_attn="on",
                 tensor_overrides=(r"blk\.0\.ffn_.*",))
    parser, error = check_exported_flags("llama-server", s.cli_args("llama-server"), llama_bin)
    # llama-server itself where the folder has it (CI builds it), else the common parser it uses
    expected = "llama-server" if (Path(llama_bin) / "llama-server").is_file() else "llama-fit-params"
    assert Path(parser).name == expected and error is None
    parser, error = check_exported_flags("llama-bench", s.cli_args("llama-bench"), llama_bin)
    assert Path(parser).name == "llama-bench" and error is None
    parser, error = check_exported_flags("llama-server", [*s.cli_args("llama-server"), "--no-such-flag"], llama_bin)
    assert error == "error: invalid argument: --no-such-flag"


def test_profile_args_checks_the_flags_with_the_installed_tool(llama_bin, tmp_path):
    from click.testing import CliRunner

    from tests.test_exports import full_profile
    from tuner.cli.profile import profile_group

    path = full_profile().replace(path=None).write(tmp_path / "p.json")
    out = CliRunner().invoke(profile_group, ["args", str(path), "--for", "llama-server", "--llama-bin",
                                                              str(llama_bin)])
    assert out.exit_code == 0 and out.stderr == "" and out.stdout.startswith("llama-server -m ")
    # an older build: its parser does not know --no-op-offload
    old = tmp_path / "old"
    real = Path(llama_bin) / "llama-fit-params"
    old.mkdir()
    script = old / "llama-fit-params"
    script.write_text(f"""#!/bin/sh
case " $* " in
  *" --no-op-offload "*) echo "error: invalid argument: --no-op-offload" >&2; exit 1;;
esac
exec {real} "$@"
""")
    script.chmod(0o755)
    out = CliRunner().invoke(profile_group, ["args", str(path), "--llama-bin", str(old)])
    assert out.exit_code == 0 and out.stdout.startswith("llama-server -m ")  # the flags are still printed
    assert out.stderr == (f"warning: {script} does not accept these flags: error: invalid argument: --no-op-offload "
                          "(an older llama.cpp? upgrade it, or drop that setting)\n")


def test_estimate_compare_fit_prints_llama_cpps_projection_beside_ours(llama_bin, models, rpc_servers):
    from click.testing import CliRunner

    from tuner.cli.main import cli

    (server,) = rpc_servers(1)
    out = CliRunner().invoke(cli, ["estimate", str(models["q8_0"]), "-ngl", "3", "-c", "1024", "--compare-fit",
                                   "--llama-bin", str(llama_bin), "--rpc", server.endpoint, "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    rows = {r["device"]: r for r in data["devices"]}
    device = f"RPC0[{server.endpoint}]"
    assert set(rows) == {"CPU", device}
    ours, theirs = rows[device]["ours"], rows[device]["llama_cpp"]
    assert abs(ours["weights"] - theirs["weights"]) <= MiB  # llama.cpp prints whole MiB
    assert theirs["total"] == theirs["weights"] + theirs["context"] + theirs["compute"]
    text = CliRunner().invoke(cli, ["estimate", str(models["q8_0"]), "-ngl", "3", "-c", "1024", "--compare-fit",
                                    "--llama-bin", str(llama_bin), "--rpc", server.endpoint])
    assert text.exit_code == 0 and device in text.output and "llama.cpp's projection from llama-fit-params" in text.output
    missing = CliRunner().invoke(cli, ["estimate", str(models["q8_0"]), "-c", "1024", "--compare-fit", "--llama-bin", str(llama_bin)])
    assert missing.exit_code == 2 and "--compare-fit needs --n-gpu-layers" in missing.output


def test_the_settings_llama_bench_can_set_come_from_its_help_and_the_dimension_table(llama_bin, models, tmp_path):
    from tuner.engine.llamacpp import LlamaCppEngine
    from tuner.search.study import Tuner

    with LlamaCppEngine(llama_bin) as engine:
        supported = engine.supported_settings()
        # llama-bench has no option for these: it always runs them at llama.cpp's own value (kv_unified and
        # n_parallel come with llama-batched-bench, which measures several users, where the folder has it)
        assert "swa_full" not in supported
        batched = engine.binaries.get("llama-batched-bench") is not None
        assert ({"kv_unified", "n_parallel"} <= supported) == batched and ("kv_unified" in supported) == batched
        assert {"n_gpu_layers", "tensor_split", "type_k", "flash_attn", "op_offload", "use_mlock", "n_cpu_moe"} <= supported
        refused = engine.run(settings(models["q8_0"], swa_full=True), QUICK)
        assert refused.outcome is Outcome.BAD_SETTINGS
        assert refused.message == ("swa_full True cannot be measured with llama-bench: llama-bench always runs swa_full "
                                   "false (llama-bench.cpp, to_llama_cparams)")
        tuner = Tuner(str(models["q8_0"]), trials=1, engine=engine, min_ctx=512, n_prompt=32, n_gen=8)
        assert tuner.space.supported == supported  # the search asks only what the engine can set
    real = Path(llama_bin) / "llama-bench"
    _wrapper(tmp_path / "old", """case " $* " in
  *" --help "*) REAL --help | grep -v -- '-nopo'; exit 0;;
esac
exec REAL "$@"
""", real)
    with LlamaCppEngine(tmp_path / "old") as old:
        assert "op_offload" not in old.supported_settings()
