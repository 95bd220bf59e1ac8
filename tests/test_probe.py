"""probe: the machine as it is, and a Machine that tests can inject instead."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.machine.probe import GPU, GPUProcess, Machine, probe


def test_probe_reads_this_machine():
    m = probe()
    assert m.logical_cores >= m.physical_cores >= 1
    assert m.ram_total >= m.ram_available > 0
    assert m.cpu_model
    # With no NVML the probe says so and why, instead of failing.
    if not m.gpus:
        assert "GPU" in m.gpu_status
    assert m.llama.error is None, m.llama.error
    assert m.llama.llama_cpp_python == "0.3.36"
    assert "cpu" in m.llama.backends


def test_probe_cli_json():
    result = CliRunner().invoke(cli, ["probe", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    for key in ("cpu_model", "physical_cores", "logical_cores", "ram_total", "ram_available", "gpus", "gpu_status",
                "unified_memory", "llama", "fingerprint", "hardware_class"):
        assert key in data
    for key in ("llama_cpp_python", "llama_cpp_build", "gpu_offload", "rpc", "backends"):
        assert key in data["llama"]


def test_probe_cli_text_says_why_there_is_no_gpu():
    result = CliRunner().invoke(cli, ["probe"])
    assert result.exit_code == 0
    assert "GPUs:" in result.output and "llama.cpp: llama-cpp-python 0.3.36" in result.output


def _machine(**changes) -> Machine:
    base = dict(cpu_model="Test CPU", physical_cores=8, logical_cores=16, ram_total=64 << 30, ram_available=60 << 30,
                gpus=(GPU(0, "NVIDIA GeForce RTX 4090", "GPU-1", 24 << 30, 20 << 30, "550.1",
                          (GPUProcess(4242, "python train.py", 4 << 30),)),),
                gpu_status="NVML 550.1: 1 GPU(s)")
    base.update(changes)
    return Machine(**base)


def test_fingerprint_tracks_hardware_not_load():
    a = _machine()
    assert a.fingerprint() == _machine(ram_available=1 << 30).fingerprint()
    assert a.fingerprint() != _machine(physical_cores=4).fingerprint()
    # another box with the same GPU model and memory: same hardware class, other fingerprint
    other = _machine(cpu_model="Other CPU", gpus=(GPU(0, "NVIDIA GeForce RTX 4090", "GPU-2", 24 << 30, 24 << 30, "550.1"),))
    assert other.hardware_class() == a.hardware_class() and other.fingerprint() != a.fingerprint()


def test_machine_round_trip():
    a = _machine()
    b = Machine.from_dict(a.to_dict())
    assert b == a
    assert b.gpus[0].processes[0].name == "python train.py"
