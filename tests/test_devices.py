"""Devices as llama.cpp sees them: recorded ``--list-devices`` runs from Metal, ROCm and Vulkan machines
(``tests/devices/``) and load logs (``tests/logs/``) become llama.cpp's device names, types and memory,
and the search space and the estimate are built on those names. RPC devices come through the same
path, live: real servers listed by the real binaries and by the python engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.engine.devices import DeviceInfo, devices_from_log, parse_list_devices
from tuner.engine.fake import ScriptedRunner
from tuner.machine.probe import GPU, Machine, probe, with_devices
from tuner.model.estimate import estimate
from tuner.model.inspect import inspect
from tuner.search.study import Tuner

MiB = 1 << 20
HERE = Path(__file__).parent
RECORDED = HERE / "devices"
LOGS = HERE / "logs"


def recorded(name: str) -> list[DeviceInfo]:
    return parse_list_devices((RECORDED / name).read_text())


def machine_with(devices: list[DeviceInfo], **changes) -> Machine:
    base = Machine(cpu_model="Test CPU", physical_cores=8, logical_cores=16, ram_total=64 << 30, ram_available=60 << 30,
                   gpu_status="NVML unavailable")
    return with_devices(Machine(**{**base.__dict__, **changes}), devices)


def tuner_on(machine: Machine, models, **kwargs) -> Tuner:
    infos = {str(models["q8_0"]): inspect(models["q8_0"])}
    return Tuner(str(models["q8_0"]), trials=1, machine=machine, engine=ScriptedRunner(infos), min_ctx=512, n_prompt=64,
                 n_gen=16, **kwargs)


# -- recorded device lists -------------------------------------------------------------------------


def test_metal_is_a_unified_memory_gpu_and_blas_is_no_offload_target():
    metal, blas = recorded("metal-m4max-llama-bench.txt")
    assert (metal.name, metal.description, metal.backend, metal.type) == ("Metal", "Apple M4 Max", "Metal", "gpu")
    assert metal.unified_memory and metal.is_accelerator
    assert (metal.memory_total, metal.memory_free) == (98304 * MiB, 98303 * MiB)
    assert (blas.name, blas.backend, blas.type, blas.is_accelerator) == ("BLAS", "BLAS", "accel", False)


def test_vulkan_on_nvidia_keeps_llama_cpps_vulkan_name():
    for name, total, free in (("vulkan-rtx4060-laptop-llama-server.txt", 7957, 7189), ("vulkan-rtx2060-llama-server.txt", 6144, 5136)):
        (device,) = recorded(name)
        assert device.name == "Vulkan0" and device.backend == "Vulkan" and device.type == "gpu"
        assert not device.unified_memory  # "uma: 0" on its start-up line
        assert (device.memory_total, device.memory_free) == (total * MiB, free * MiB)
        assert device.description.startswith("NVIDIA GeForce RTX")


def test_a_rocm_apu_is_an_integrated_gpu_sharing_the_ram():
    (device,) = recorded("rocm-gfx1151-llama-cli.txt")
    assert (device.name, device.backend, device.type, device.unified_memory) == ("ROCm0", "ROCm", "igpu", True)
    assert device.description == "AMD Radeon(TM) Graphics" and device.memory_total == 110511 * MiB


def test_the_space_is_built_on_each_machines_own_devices(models):
    for name, expected, unified in (("metal-m4max-llama-bench.txt", ["Metal"], True),
                                    ("vulkan-rtx2060-llama-server.txt", ["Vulkan0"], False),
                                    ("rocm-gfx1151-llama-cli.txt", ["ROCm0"], True)):
        machine = machine_with(recorded(name))
        assert machine.unified_memory is unified, name
        tuner = tuner_on(machine, models)
        assert [d.name for d in tuner.space.devices] == expected, name
        dims = tuner.space.dimensions()
        assert dims["n_gpu_layers"] == (0, 5) and "placement" in dims  # offload is searched
        assert ("unified memory" in tuner.space.excluded.get("note", "")) is unified
        # the estimate and the pre-launch check speak the same names
        s = tuner.space.settings(variant=str(models["q8_0"]), n_gpu_layers=5, n_ctx=512, kv="f16", flash_attn="on",
                                 threads=8, n_ubatch=512, n_batch=512)
        est = tuner.candidates.estimate(s)
        assert set(est.devices) == {"CPU", *expected}
        assert est.devices[expected[0]].weights > 0


def test_a_vulkan_build_on_an_nvidia_machine_is_planned_under_vulkan_names_with_nvml_holders(models):
    gpu = GPU(0, "NVIDIA GeForce RTX 2060", "GPU-1", 6144 * MiB, 5000 * MiB, "550.1")
    machine = machine_with(recorded("vulkan-rtx2060-llama-server.txt"), gpus=(gpu,))
    (device,) = machine.devices
    assert device["name"] == "Vulkan0" and device["nvml_index"] == 0  # NVML enriches it: holders, peak memory
    tuner = tuner_on(machine, models)
    assert [d.name for d in tuner.space.devices] == ["Vulkan0"]  # not "CUDA0", which llama.cpp never prints here


def test_devices_from_load_logs():
    two = devices_from_log((LOGS / "02_mainline-2xcuda-ot-exps-cpu-cli-perf.log").read_text())
    assert [(d.name, d.description, d.memory_free) for d in two] == [
        ("CUDA0", "NVIDIA GeForce RTX 4090", 9862 * MiB), ("CUDA1", "NVIDIA GeForce RTX 5090", 31518 * MiB)]
    (vulkan,) = devices_from_log((LOGS / "04_mainline-vulkan-rtx4080-full.log").read_text())
    assert (vulkan.name, vulkan.type, vulkan.unified_memory, vulkan.memory_free) == ("Vulkan0", "gpu", False, 16376 * MiB)


def test_two_devices_from_a_log_make_a_split_dimension(models):
    machine = machine_with(devices_from_log((LOGS / "02_mainline-2xcuda-ot-exps-cpu-cli-perf.log").read_text()))
    tuner = tuner_on(machine, models)
    dims = tuner.space.dimensions()
    assert [d.name for d in tuner.space.devices] == ["CUDA0", "CUDA1"]
    assert "layers_on[CUDA0]" in dims and "layers_on[CUDA1]" not in dims  # the last device takes the rest
    assert [d.free for d in tuner.space.devices] == [9862 * MiB, 31518 * MiB]


def test_without_nvml_the_machine_is_identified_by_llama_cpps_gpus():
    metal = machine_with(recorded("metal-m4max-llama-bench.txt"))
    rocm = machine_with(recorded("rocm-gfx1151-llama-cli.txt"))
    cpu_only = machine_with([])
    # three machines with the same CPU and RAM: their GPUs tell them apart
    assert len({metal.hardware_class(), rocm.hardware_class(), cpu_only.hardware_class()}) == 3
    assert len({metal.fingerprint(), rocm.fingerprint(), cpu_only.fingerprint()}) == 3
    # with NVML the identity stays NVML's, whichever engine listed the devices
    gpu = GPU(0, "NVIDIA GeForce RTX 2060", "GPU-1", 6144 * MiB, 5000 * MiB, "550.1")
    assert (machine_with(recorded("vulkan-rtx2060-llama-server.txt"), gpus=(gpu,)).fingerprint()
            == machine_with([], gpus=(gpu,)).fingerprint())
    assert Machine.from_dict(metal.to_dict()) == metal


def test_the_profile_records_the_devices_and_describes_the_machine_by_them():
    from tuner.profile.document import MachineInfo

    info = MachineInfo.from_machine(machine_with(recorded("metal-m4max-llama-bench.txt")))
    assert [(d.name, d.type, d.unified_memory) for d in info.devices] == [("Metal", "gpu", True)]  # no BLAS
    assert info.describe() == "Test CPU, Apple M4 Max (96.0 GiB)"


# -- RPC devices, live, through the same path ---------------------------------------------------------


@pytest.mark.parametrize("engine_name", ["python", "llama-cpp"])
def test_rpc_devices_come_through_the_same_path(engine_name, request, rpc_servers, models):
    from tuner.engine.select import open_engine

    llama_bin = request.getfixturevalue("llama_bin") if engine_name == "llama-cpp" else None
    (server,) = rpc_servers(1)
    with open_engine(engine_name, llama_bin=llama_bin) as engine:
        machine = probe(rpc_servers=(server.endpoint,), engine=engine)
    label = f"RPC0[{server.endpoint}]"
    assert [d["name"] for d in machine.accelerators()] == [label]
    assert machine.rpc_devices[0]["endpoint"] == server.endpoint and machine.engine["engine"] == engine_name
    tuner = tuner_on(machine, models, rpc_servers=(server.endpoint,))
    assert [d.name for d in tuner.space.devices] == [label]
    s = tuner.space.settings(variant=str(models["q8_0"]), n_gpu_layers=2, n_ctx=512, kv="f16", flash_attn="on",
                             threads=2, n_ubatch=512, n_batch=512)
    assert label in estimate(inspect(models["q8_0"]), s, devices=[label]).devices
