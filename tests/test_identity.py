"""One identity whoever asks; devices as llama.cpp will use them; NVML paired by PCI bus id; the device cache.

Device lists come from recorded outputs (``tests/devices``, ``tests/machines``) where a machine is
described; the pure selection and pairing rules are also checked on minimal device lists, built here
only to pin one rule each (named in the test).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tuner.engine.devices import DeviceInfo, parse_list_devices
from tuner.machine.devices import app_devices, cache_key, dropped_devices, match_nvml, normalize_pci, used_devices
from tuner.machine.identity import device_model, differences, fingerprint, hardware_class, legacy_identities, match
from tuner.machine.probe import GPU, Machine, with_devices
from tuner.engine.recorded import RecordedMachine
from tuner.profile.document import MachineInfo

MiB, GiB = 1 << 20, 1 << 30
HERE = Path(__file__).parent
MACHINES = HERE / "machines"


def host(**kw) -> Machine:
    base = dict(cpu_model="AMD Ryzen 9 7950X", physical_cores=16, logical_cores=32, ram_total=64 * GiB,
                ram_available=48 * GiB, gpu_status="test")
    return Machine(**{**base, **kw})


def recorded(kind: str) -> list[DeviceInfo]:
    folder = MACHINES / kind
    if not folder.is_dir():
        pytest.skip(f"tests/machines/{kind} is not here")
    return RecordedMachine(folder).devices()


# -- selection -------------------------------------------------------------------------------------


def test_an_integrated_gpu_beside_a_discrete_one_is_not_used_nor_makes_the_machine_unified():
    devices = recorded("laptop-igpu-dgpu-vulkan")
    assert [d.name for d in used_devices(devices)] == ["Vulkan1"]
    (dropped, why), = dropped_devices(devices)
    assert dropped.name == "Vulkan0" and "only when there is no other GPU" in why
    machine = with_devices(host(), devices)
    assert machine.unified_memory is False
    assert [d["name"] for d in machine.used_accelerators()] == ["Vulkan1"]


def test_an_apu_alone_is_used_and_is_one_pool():
    machine = with_devices(host(), recorded("amd-apu-gfx1151"))
    assert [d["name"] for d in machine.used_accelerators()] == ["ROCm0"] and machine.unified_memory is True


def test_rpc_servers_go_first():
    devices = recorded("cuda-plus-two-rpc")
    assert [d.name for d in used_devices(devices)] == ["RPC0[mlbox.local:50052]", "CUDA0", "CUDA1"]


def test_one_card_listed_by_two_backends_is_used_once():
    # the rule of src/llama.cpp: a GPU whose device_id (PCI bus id) an earlier GPU has is skipped
    cuda = DeviceInfo("CUDA0", "NVIDIA GeForce RTX 3090", "gpu", 20 * GiB, 24 * GiB, "CUDA", pci_bus_id="0000:01:00.0")
    vulkan = DeviceInfo("Vulkan0", "NVIDIA GeForce RTX 3090", "gpu", 20 * GiB, 24 * GiB, "Vulkan", pci_bus_id="0000:01:00.0")
    other = dataclasses.replace(vulkan, name="Vulkan1", description="NVIDIA GeForce RTX 3060", pci_bus_id="0000:02:00.0")
    assert [d.name for d in used_devices([cuda, vulkan, other])] == ["CUDA0", "Vulkan1"]


def test_an_intel_mac_discrete_metal_gpu_is_not_unified():
    text = ("ggml_metal_device_init: has unified memory    = false\n"
            "Available devices:\n  MTL0: AMD Radeon Pro 5500M (8176 MiB, 8176 MiB free)\n")
    (device,) = parse_list_devices(text)
    assert device.unified_memory is False
    assert with_devices(host(), [device]).unified_memory is False


# -- identity -------------------------------------------------------------------------------------


def test_the_same_card_under_cuda_and_vulkan_is_the_same_machine():
    vulkan = [d for d in parse_list_devices((HERE / "devices" / "vulkan-rtx2060-llama-server.txt").read_text()) if d.type != "cpu"]
    (v,) = vulkan
    cuda = DeviceInfo("CUDA0", device_model(v.description), "gpu", v.memory_free, v.memory_total - 12 * MiB, "CUDA")
    a, b = with_devices(host(), vulkan), with_devices(host(), [cuda])
    assert a.fingerprint() == b.fingerprint() and a.hardware_class() == b.hardware_class()


def test_a_driver_suffix_is_not_part_of_the_model():
    assert device_model("AMD Radeon RX 7900 XTX (RADV NAVI31)") == "AMD Radeon RX 7900 XTX"
    assert device_model("llvmpipe (LLVM 15.0.6, 256 bits)") == "llvmpipe"
    assert device_model("Intel(R) Arc(TM) A770 Graphics") == "Intel(R) Arc(TM) A770 Graphics"


@pytest.mark.parametrize("kind", ["apple-m-series", "amd-apu-gfx1151"])
def test_a_unified_devices_tunable_limit_is_not_part_of_the_identity(kind):
    """Metal's working-set size (iogpu.wired_limit_mb) and an APU's GTT size are limits users raise."""
    devices = recorded(kind)
    raised = [dataclasses.replace(d, memory_total=(d.memory_total or 0) * 2, memory_free=(d.memory_free or 0) * 2)
              if d.type != "cpu" else d for d in devices]
    a, b = with_devices(host(), devices), with_devices(host(), raised)
    assert a.fingerprint() == b.fingerprint() and a.hardware_class() == b.hardware_class()
    bigger = dataclasses.replace(host(), ram_total=128 * GiB)  # more RAM is another machine, and another class
    assert with_devices(bigger, devices).hardware_class() != a.hardware_class()


def test_nvml_does_not_change_the_identity():
    devices = recorded("two-nvidia-cuda-visible-devices")
    nvml = (GPU(0, "NVIDIA GeForce RTX 4090", "GPU-a", 24 * GiB, 9 * GiB, "575"), GPU(1, "NVIDIA GeForce RTX 5090", "GPU-b", 32 * GiB, 30 * GiB, "575"))
    assert with_devices(host(), devices).fingerprint() == with_devices(host(gpus=nvml), devices).fingerprint()


def test_what_changed_is_said_in_words_and_old_profiles_match_by_their_old_identity():
    machine = with_devices(host(), recorded("laptop-igpu-dgpu-vulkan"))
    old_fp, old_class = legacy_identities(machine)
    info = dataclasses.replace(MachineInfo.from_machine(machine), fingerprint=old_fp, hardware_class=old_class)
    assert match(info, machine) == "legacy fingerprint"
    assert match(MachineInfo.from_machine(machine), machine) == "fingerprint"
    other = with_devices(dataclasses.replace(host(), cpu_model="Intel Core i7-13700H"), recorded("intel-arc-sycl"))
    said = differences(MachineInfo.from_machine(machine), other)
    assert said == [
        "CPU: AMD Ryzen 9 7950X when tuned, Intel Core i7-13700H here",
        "devices llama.cpp uses: NVIDIA GeForce RTX 3050 6GB Laptop GPU (6 GiB) when tuned, "
        "Intel(R) Arc(TM) A770 Graphics (15 GiB) here",
    ]
    assert fingerprint(machine) != fingerprint(other) and hardware_class(machine) != hardware_class(other)


# -- NVML --------------------------------------------------------------------------------------------


def test_nvml_is_paired_by_pci_bus_id_not_by_order():
    # the rule: ggml's device_id "0000:41:00.0" is NVML's busId "00000000:41:00.0"
    devices = [DeviceInfo("CUDA0", "NVIDIA GeForce RTX 5090", "gpu", 1, 1, "CUDA", pci_bus_id="0000:41:00.0"),
               DeviceInfo("CUDA1", "NVIDIA GeForce RTX 4090", "gpu", 1, 1, "CUDA", pci_bus_id="0000:01:00.0")]
    gpus = [GPU(0, "NVIDIA GeForce RTX 4090", "", 1, 1, "", pci_bus_id=normalize_pci("00000000:01:00.0")),
            GPU(1, "NVIDIA GeForce RTX 5090", "", 1, 1, "", pci_bus_id=normalize_pci("00000000:41:00.0"))]
    assert match_nvml(devices, gpus, env={}) == {"CUDA0": 1, "CUDA1": 0}


def test_without_pci_ids_cuda_order_and_exact_names_decide():
    devices = [d for d in recorded("two-nvidia-cuda-visible-devices") if d.type != "cpu"]  # CUDA0 4090, CUDA1 5090
    gpus = [GPU(0, "NVIDIA GeForce RTX 4090", "", 1, 1, "", pci_bus_id="0000:01:00.0"),
            GPU(1, "NVIDIA GeForce RTX 5090", "", 1, 1, "", pci_bus_id="0000:41:00.0")]
    # CUDA_DEVICE_ORDER=PCI_BUS_ID with CUDA_VISIBLE_DEVICES=1,0: CUDA0 is NVML's GPU 1
    assert match_nvml(devices, gpus, env={"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1,0"}) == {"CUDA0": 1, "CUDA1": 0}
    # fastest first (CUDA's default): by exact, unique name
    assert match_nvml(devices, gpus, env={}) == {"CUDA0": 0, "CUDA1": 1}
    # a name is not a substring match: an RTX 3060 is not the RTX 3060 Ti NVML lists
    ti = [GPU(0, "NVIDIA GeForce RTX 3060 Ti", "", 1, 1, "")]
    plain = [DeviceInfo("CUDA0", "NVIDIA GeForce RTX 3060", "gpu", 1, 1, "CUDA")]
    assert match_nvml(plain, ti, env={}) == {}


# -- the per-boot device cache -------------------------------------------------------------------------


def test_an_app_pays_llama_cpps_start_up_once_per_boot_build_and_device_environment(monkeypatch):
    monkeypatch.setenv("OFFLOAD_TUNER_TEST_MACHINE", str(MACHINES / "laptop-igpu-dgpu-vulkan"))
    first = app_devices()
    assert first["cached"] is False and [d["name"] for d in first["devices"]] == ["CPU", "Vulkan0", "Vulkan1"]
    assert app_devices()["cached"] is True
    key = cache_key()
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "1")
    assert cache_key() != key and app_devices()["cached"] is False


def test_a_unified_device_and_the_host_are_one_pool_when_tuning(models):
    """On Apple silicon what MTL0 holds is RAM too: a candidate that fits the device and the host apart
    but not together is not launched (as the fit check at load counts it: tuner.profile.apps)."""
    from tuner.engine.settings import Settings
    from tuner.model.inspect import inspect
    from tuner.search.candidates import Candidates
    from tuner.search.space import devices_from

    machine = with_devices(host(), recorded("apple-m-series"))
    devices = devices_from(machine.devices)
    info = inspect(models["q8_0"])
    s = Settings(model_path=info.path, n_gpu_layers=2, n_ctx=512, use_mmap=False)
    apart = Candidates({info.path: info}, devices, 1 << 40, 0)
    est = apart.estimate(s)
    device, host_need = est.devices["Metal"].total, est.devices["CPU"].total
    ram = max(device, host_need) + min(device, host_need) // 2  # each alone fits, both together do not
    assert Candidates({info.path: info}, devices, ram, 0).check(s, est) is None
    why = Candidates({info.path: info}, devices, ram, 0, shared_ram=["Metal"]).check(s, est)
    assert why is not None and "which shares it" in why
