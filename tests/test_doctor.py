"""``offload-tuner doctor``: each check on this machine, and each problem injected at the lowest seam
(a recorded /sys/class/drm tree, NVML's GPUs, llama.cpp's device list as it prints it, the disk's free
bytes, a worker that crashes), through the real check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.machine.probe import GPU, GPUProcess
from tuner.report import doctor
from tuner.report.doctor import OK, PROBLEM, WARNING, Build, ProbeResult

ROOT = Path(__file__).resolve().parent.parent
DEVICES = Path(__file__).resolve().parent / "devices"
GiB = 1 << 30


@pytest.fixture(scope="module")
def build() -> Build:
    """llama-cpp-python's real build here: CPU only, with RPC (as .ci/run builds it)."""
    return doctor.read_python_build()


def drm_tree(root: Path, cards: dict[str, str]) -> Path:
    """A /sys/class/drm tree as Linux lays it out: cardN/device/{vendor,device}, connectors beside."""
    for card, vendor in cards.items():
        (root / card / "device").mkdir(parents=True)
        (root / card / "device" / "vendor").write_text(vendor + "\n")
        (root / card / "device" / "device").write_text("0x2684\n")
        (root / f"{card}-HDMI-A-1").mkdir()
    (root / "renderD128").mkdir(parents=True, exist_ok=True)
    return root


def nvml_gpu(index: int = 0, *, free: int = 23 * GiB, processes: tuple = ()) -> GPU:
    return GPU(index=index, name="NVIDIA GeForce RTX 4090", uuid=f"GPU-{index}", memory_total=24 * GiB,
               memory_free=free, driver="575.57.08", processes=processes)


def gpus_of(tmp_path: Path, cards: dict[str, str], nvml: tuple = ()) -> list:
    return doctor.os_gpus(nvml=nvml, drm_root=drm_tree(tmp_path / "drm", cards), rocm_smi=False, apple=False)


# -- gpus: the OS's GPUs against llama.cpp's devices -----------------------------------------------------


def test_a_cpu_only_build_on_a_machine_whose_drm_lists_an_nvidia_gpu_is_a_problem_with_the_pip_line(build, tmp_path):
    assert not build.gpu_backends and build.rpc  # this machine's real build
    check = doctor.check_gpus(gpus_of(tmp_path, {"card0": "0x10de"}), build, env={})
    assert check.status == PROBLEM
    assert "built for the CPU only" in check.found and "NVIDIA GPU (PCI 0x10de:0x2684)" in check.found
    assert check.fix == (f'CMAKE_ARGS="-DGGML_CUDA=on -DGGML_RPC=on" pip install --no-cache-dir --force-reinstall '
                         f"llama-cpp-python=={build.version}")


def test_a_cpu_only_build_where_nvml_lists_a_gpu_and_an_amd_card_get_their_backends(build, tmp_path):
    check = doctor.check_gpus(doctor.os_gpus(nvml=(nvml_gpu(),), drm_root=tmp_path / "none", rocm_smi=False, apple=False),
                              build, env={})
    assert check.status == PROBLEM and "NVIDIA GeForce RTX 4090 (NVML)" in check.found and "-DGGML_CUDA=on" in check.fix
    amd = doctor.check_gpus(gpus_of(tmp_path, {"card1": "0x1002"}), build, env={})
    assert amd.status == PROBLEM and amd.fix.startswith('CMAKE_ARGS="-DGGML_HIP=on')


def test_no_gpu_a_bmc_display_or_only_an_intel_igpu_is_not_a_problem(build, tmp_path):
    assert doctor.check_gpus([], build, env={}).status == OK
    # a server's ASPEED BMC display is a drm card, not a GPU to offload to
    assert doctor.check_gpus(gpus_of(tmp_path / "a", {"card0": "0x1a03"}), build, env={}).status == OK
    intel = doctor.check_gpus(gpus_of(tmp_path / "b", {"card0": "0x8086"}), build, env={})
    assert intel.status == WARNING and "-DGGML_VULKAN=on" in intel.fix


def test_a_gpu_build_that_lists_no_device_because_cuda_visible_devices_hides_it(tmp_path):
    # a CUDA build on a machine whose devices CUDA_VISIBLE_DEVICES hides: llama.cpp registers the
    # backend and lists only the CPU
    hidden = Build({"llama_cpp_python": "0.3.36", "gpu_offload": True, "rpc": False, "backends": ["cpu", "cuda"],
                    "devices": [{"name": "CPU", "description": "AMD EPYC", "type": "cpu", "memory_free": None,
                                 "memory_total": None, "backend": "CPU"}]})
    check = doctor.check_gpus(gpus_of(tmp_path, {"card0": "0x10de"}), hidden, env={"CUDA_VISIBLE_DEVICES": ""})
    assert check.status == PROBLEM and "CUDA_VISIBLE_DEVICES=''" in check.found
    assert check.fix == "unset CUDA_VISIBLE_DEVICES"


def test_a_vulkan_build_that_lists_the_gpu_as_it_printed_is_ok_and_a_second_card_it_misses_is_a_warning(tmp_path):
    from tuner.engine.devices import parse_list_devices

    listed = parse_list_devices((DEVICES / "vulkan-rtx2060-llama-server.txt").read_text())
    vulkan = Build({"llama_cpp_python": "0.3.36", "gpu_offload": True, "rpc": False, "backends": ["cpu", "vulkan"],
                    "devices": [d.to_dict() for d in listed]})
    assert doctor.check_gpus(gpus_of(tmp_path / "one", {"card0": "0x10de"}), vulkan, env={}).status == OK
    two = doctor.check_gpus(doctor.os_gpus(nvml=(nvml_gpu(0), nvml_gpu(1)), drm_root=tmp_path / "none",
                                           rocm_smi=False, apple=False), vulkan, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert two.status == WARNING and "2 NVIDIA GPU(s) but llama.cpp uses 1" in two.found
    assert "unset CUDA_VISIBLE_DEVICES" in two.fix


# -- build, cuda --------------------------------------------------------------------------------------


def test_the_build_check_reads_gpu_offload_and_rpc(build):
    check = doctor.check_build(build)
    assert check.status == OK and "GPU backend none (CPU only), RPC yes" in check.found
    no_rpc = doctor.check_build(Build({**build.data, "rpc": False}))
    assert no_rpc.status == WARNING and '"-DGGML_RPC=on"' in no_rpc.fix and "--no-cache-dir --force-reinstall" in no_rpc.fix


def test_a_cuda_runtime_newer_than_the_driver_is_a_problem(build, tmp_path):
    assert doctor.check_cuda(build, None, None).status == OK  # no CUDA here
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libcudart.so.12.4.127").write_bytes(b"")
    assert doctor.cuda_runtime_version(lib) == (12, 4)
    cuda = Build({**build.data, "gpu_offload": True, "backends": ["cpu", "cuda"]})
    check = doctor.check_cuda(cuda, (12, 2), doctor.cuda_runtime_version(lib))
    assert check.status == PROBLEM and "CUDA runtime 12.4, newer than the driver supports (12.2)" in check.found
    assert "CUDA 12.4 or newer" in check.fix
    assert doctor.check_cuda(cuda, (12, 8), (12, 4)).status == OK
    assert doctor.check_cuda(cuda, None, (12, 4)).status == PROBLEM


# -- repack ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_repack_probe_decodes_in_a_child_and_a_crash_there_is_a_problem(build, tmp_path):
    features = doctor.cpu_features(build.system_info)
    assert features and ("AVX2" in features or "NEON" in features)  # llama.cpp's own report of this CPU
    real = doctor.repack_probe()
    assert real.outcome == "ok", real.message
    check = doctor.check_repack(features, real)
    assert check.status == OK and "ran" in check.found
    # the same probe in a worker that dies of a segmentation fault, as llama.cpp's AMX repack does
    crashing = tmp_path / "python"
    crashing.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crashing.chmod(0o755)
    crashed = doctor.repack_probe(python=str(crashing))
    assert crashed.outcome == "crash"
    check = doctor.check_repack({"AMX_INT8", "AVX512"}, crashed)
    assert check.status == PROBLEM and "AMX_INT8" in check.found and "segmentation fault" in check.found
    assert "--no-repack" in check.fix and "--repack 0" in check.fix


def test_repack_without_a_probe_on_an_amx_cpu_is_a_warning():
    assert doctor.check_repack({"AMX_INT8"}, None).status == WARNING
    assert doctor.check_repack({"AVX2"}, None).status == OK
    assert doctor.check_repack({"AVX2"}, ProbeResult("timeout", "killed after 60 s")).status == WARNING


# -- gpu memory, data folder -----------------------------------------------------------------------------------


def test_vram_held_by_another_process_is_a_warning_naming_it():
    held = nvml_gpu(free=14 * GiB, processes=(GPUProcess(4242, "ollama serve", 9 * GiB),))
    check = doctor.check_gpu_memory((held,), "NVML 575.57.08: 1 GPU(s)", me=1)
    assert check.status == WARNING and "pid 4242 (ollama serve) holds 9216 MiB" in check.found
    assert "kill 4242" in check.fix
    unnamed = doctor.check_gpu_memory((nvml_gpu(free=4 * GiB),), "NVML", me=1)
    assert unnamed.status == WARNING and "cannot name" in unnamed.found
    assert doctor.check_gpu_memory((nvml_gpu(),), "NVML", me=1).status == OK
    assert doctor.check_gpu_memory((), "NVML unavailable").status == OK


def test_the_data_folder_unwritable_or_on_a_full_disk_is_a_problem(tmp_path):
    assert doctor.check_data_folder().status == OK
    blocked = tmp_path / "a-file"
    blocked.write_text("in the way")
    check = doctor.check_data_folder(blocked)
    assert check.status == PROBLEM and str(blocked) in check.found and "OFFLOAD_TUNER_HOME=" in check.fix

    class Usage:
        free = 300 << 20

    full = doctor.check_data_folder(tmp_path, disk_usage=lambda path: Usage())
    assert full.status == PROBLEM and "0.3 GiB free" in full.found and "free space" in full.fix
    Usage.free = 5 * GiB
    assert doctor.check_data_folder(tmp_path, disk_usage=lambda path: Usage()).status == WARNING


# -- storage, registry --------------------------------------------------------------------------------------


def test_storage_opens_and_a_damaged_or_unreachable_one_is_a_problem_without_its_password(tmp_path):
    assert doctor.check_storage().status == OK
    damaged = tmp_path / "studies.db"
    damaged.write_bytes(b"not a database" * 100)
    check = doctor.check_storage(f"sqlite:///{damaged}")
    assert check.status == PROBLEM and "damaged" in check.found
    pytest.importorskip("psycopg")
    gone = doctor.check_storage("postgresql://tuner:hunter2secret@127.0.0.1:9/tuning")
    assert gone.status == PROBLEM and "cannot reach" in gone.found and "hunter2secret" not in gone.found
    assert "tuner:***@127.0.0.1:9" in gone.found


def test_the_registry_unset_reachable_and_unreachable(tmp_path, monkeypatch):
    assert doctor.check_registry().status == OK
    registry = f"sqlite:///{tmp_path / 'registry.db'}"
    check = doctor.check_registry(registry)
    assert check.status == OK and "no profile published yet" in check.found
    from tests.test_profile import profile_dict
    from tuner.profile.document import Profile
    from tuner.profile.registry import publish

    publish([Profile.from_dict(profile_dict())], registry)
    assert "1 profile(s) in offload_tuner_profiles" in doctor.check_registry(registry).found
    pytest.importorskip("psycopg")
    monkeypatch.setenv("OFFLOAD_TUNER_REGISTRY", "postgresql://tuner:hunter2secret@127.0.0.1:9/tuning")
    gone = doctor.check_registry()
    assert gone.status == PROBLEM and "hunter2secret" not in gone.found + gone.fix and "***" in gone.found
    assert "cannot reach the profile registry" in gone.found


# -- llama.cpp binaries, profiles ----------------------------------------------------------------------------


def test_llama_bin_missing_folder_is_a_problem(tmp_path):
    check, found = doctor.check_llama_bin(tmp_path / "nowhere", [])
    assert check.status == PROBLEM and "no such folder" in check.found and found is None


def test_the_users_binaries_build_and_devices_and_a_cpu_only_build_on_a_gpu_machine(tmp_path):
    folder = os.environ.get("OFFLOAD_TUNER_LLAMA_BIN")
    if not folder or not (Path(folder) / "llama-bench").exists():
        pytest.skip("OFFLOAD_TUNER_LLAMA_BIN has no llama-bench (.ci/run builds it)")
    check, build = doctor.check_llama_bin(folder, [])
    assert check.status == OK and build is not None and build.describe() in check.found
    assert "no device besides the CPU" in check.found
    gpu, _ = doctor.check_llama_bin(folder, gpus_of(tmp_path, {"card0": "0x10de"}))
    assert gpu.status == PROBLEM and gpu.fix.endswith("cmake -B build -DGGML_CUDA=on && cmake --build build --config Release -j")


def test_a_profile_made_with_another_llama_cpp_build_is_a_warning(build, tmp_path):
    from tests.test_profile import profile_dict
    from tuner.paths import profiles_dir

    machine = doctor.this_machine(build)
    assert doctor.check_profiles(machine).found == "0 profile(s) of this machine"
    same = profile_dict(machine)
    same["llama_build"].update(llama_cpp_python=machine.llama.llama_cpp_python, llama_cpp_build=machine.llama.llama_cpp_build,
                               backends=list(machine.llama.backends), gpu_offload=machine.llama.gpu_offload, rpc=machine.llama.rpc)
    same["engine"] = None
    (profiles_dir() / "same.json").write_text(json.dumps(same))
    assert doctor.check_profiles(machine).status == OK
    old = profile_dict(machine, {"file_name": "Old-Q4_K_M.gguf", "size": 5_027_783_488, "header_hash": "cd" * 32})
    old["llama_build"]["llama_cpp_python"] = "0.3.2"
    old["engine"] = None
    (profiles_dir() / "old.json").write_text(json.dumps(old))
    elsewhere = profile_dict()  # another machine's profile (a teammate's): not this build's business
    (profiles_dir() / "theirs.json").write_text(json.dumps(elsewhere))
    check = doctor.check_profiles(machine)
    assert check.status == WARNING
    assert "2 profile(s) of this machine, 1 of other machines (not checked)" in check.found
    assert f"llama-cpp-python 0.3.2, this machine has {build.version}" in check.found
    assert "offload-tuner tune Old-Q4_K_M.gguf" in check.fix


# -- the command ----------------------------------------------------------------------------------------------


def test_format_checks_prints_each_status_and_fix():
    text = doctor.format_checks([doctor.Check("gpus", PROBLEM, "a CPU build", "pip ..."), doctor.Check("build", OK, "fine")])
    assert text.splitlines() == ["[problem] gpus: a CPU build", "    fix: pip ...", "[ok] build: fine",
                                 "2 checks: 1 problem(s), 0 warning(s)"]


@pytest.mark.slow
def test_doctor_json_finds_the_injected_gpu_and_exits_1(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), doctor.ENV_DRM_DIR: str(drm_tree(tmp_path / "drm", {"card0": "0x10de"}))}
    env.pop("OFFLOAD_TUNER_LLAMA_BIN", None)
    proc = subprocess.run([sys.executable, "-m", "tuner", "doctor", "--json"], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert list(data) == ["checks"]
    assert all(list(c) == ["name", "status", "found", "fix"] for c in data["checks"])
    by_name = {c["name"]: c for c in data["checks"]}
    assert list(by_name) == ["gpus", "build", "cuda", "repack", "gpu_memory", "data_folder", "storage", "registry",
                             "llama_bin", "profiles"]
    assert by_name["gpus"]["status"] == "problem" and "-DGGML_CUDA=on" in by_name["gpus"]["fix"]
    assert by_name["repack"]["status"] == "ok" and by_name["data_folder"]["status"] == "ok"
    # without the injected GPU nothing here is a problem: exit 0
    env.pop(doctor.ENV_DRM_DIR)
    env[doctor.ENV_DRM_DIR] = str(tmp_path / "no-drm")
    clean = subprocess.run([sys.executable, "-m", "tuner", "doctor"], capture_output=True, text=True, cwd=tmp_path,
                           env=env, timeout=300)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "[ok] gpus:" in clean.stdout and "10 checks: 0 problem(s)" in clean.stdout


def test_a_profile_of_the_users_binaries_against_the_binaries_found_now(build, tmp_path):
    from tests.test_profile import profile_dict
    from tuner.paths import profiles_dir

    machine = doctor.this_machine(build)
    mine = profile_dict(machine)
    mine["engine"] = {"name": "llama-cpp", "build": "b1234 (deadbee)", "path": "/opt/llama.cpp/build/bin"}
    (profiles_dir() / "bins.json").write_text(json.dumps(mine))
    gone = doctor.check_profiles(machine, None)
    assert gone.status == WARNING and "which are not found now" in gone.found
    assert "offload-tuner tune Qwen3-8B-Q4_K_M.gguf --engine llama-cpp --llama-bin /opt/llama.cpp/build/bin" in gone.fix
    folder = os.environ.get("OFFLOAD_TUNER_LLAMA_BIN")
    if not folder or not (Path(folder) / "llama-bench").exists():
        pytest.skip("OFFLOAD_TUNER_LLAMA_BIN has no llama-bench (.ci/run builds it)")
    _, binaries = doctor.check_llama_bin(folder, [])
    other = doctor.check_profiles(machine, binaries)
    assert other.status == WARNING and f"are build {binaries.describe()}" in other.found
    mine["engine"]["build"] = binaries.describe()
    (profiles_dir() / "bins.json").write_text(json.dumps(mine))
    assert doctor.check_profiles(machine, binaries).status == OK


@pytest.mark.parametrize("recorded, vendor, backends", [
    ("metal-m4max-llama-bench.txt", "apple", ["cpu", "metal", "blas"]),
    ("rocm-gfx1151-llama-cli.txt", "amd", ["cpu", "hip"]),
    ("vulkan-rtx4060-laptop-llama-server.txt", "nvidia", ["cpu", "vulkan"]),
])
def test_gpu_builds_that_list_their_device_as_recorded_are_ok(recorded, vendor, backends):
    from tuner.engine.devices import parse_list_devices

    listed = parse_list_devices((DEVICES / recorded).read_text())
    gpu_build = Build({"llama_cpp_python": "0.3.36", "rpc": False, "backends": backends,
                       "devices": [d.to_dict() for d in listed]})
    check = doctor.check_gpus([doctor.OSGPU(vendor, f"{vendor} GPU", "test")], gpu_build, env={})
    assert check.status == OK, check.found
    # the same machine with a CPU-only build is the problem, with that vendor's backend
    cpu_only = Build({"llama_cpp_python": "0.3.36", "rpc": False, "backends": ["cpu"],
                      "devices": [d.to_dict() for d in listed if d.type == "cpu"]})
    problem = doctor.check_gpus([doctor.OSGPU(vendor, f"{vendor} GPU", "test")], cpu_only, env={})
    assert problem.status == PROBLEM and doctor.CMAKE_FLAG[vendor] in problem.fix
