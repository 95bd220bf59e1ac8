"""Real offload without a GPU: llama.cpp RPC servers on 127.0.0.1 act as GPUs.

These tests run the real llama.cpp (built with -DGGML_RPC=on) against real servers; they assert
mechanics (placement, memory, failure handling), not speed: a simulated device is the same CPU
behind a socket.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.model.estimate import estimate
from tuner.machine.probe import probe
from tuner.model.inspect import inspect
from tuner.engine.outcome import Outcome
from tuner.engine.rpc import free_port
from tuner.engine.base import BenchSpec
from tuner.engine.python import run_trial
from tuner.engine.settings import Settings

QUICK = BenchSpec(n_prompt=64, n_gen=4, repetitions=1)
MiB = 1 << 20
PRINTED = 0.006 * MiB  # llama.cpp prints buffer sizes in MiB with two decimals


def settings(path, servers, **changes) -> Settings:
    base = dict(model_path=str(path), n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=2, flash_attn="on",
                rpc_servers=tuple(s.endpoint for s in servers))
    return Settings(**{**base, **changes})


def test_partial_offload_is_detected_and_reported_as_partial(models, rpc_servers):
    servers = rpc_servers(1)
    result = run_trial(settings(models["q8_0"], servers, n_gpu_layers=3), QUICK)
    assert result.ok, result.message
    assert (result.load.layers_offloaded, result.load.layers_total) == (3, 5)
    assert result.load.partial_offload is True
    device = f"RPC0[{servers[0].endpoint}]"
    assert result.load.model_buffers[device] > 0 and device in result.load.kv_buffers
    full = run_trial(settings(models["q8_0"], servers, n_gpu_layers=-1), QUICK)
    assert full.ok and full.load.layers_offloaded == full.load.layers_total == 5
    assert full.load.partial_offload is False


def test_two_device_split_matches_the_memory_arithmetic(models, rpc_servers):
    servers = rpc_servers(2)
    info = inspect(models["q8_0"])
    for ngl, split in ((5, (1, 2)), (3, (1, 1))):
        s = settings(models["q8_0"], servers, n_gpu_layers=ngl, tensor_split=split, use_mmap=False)
        result = run_trial(s, QUICK)
        assert result.ok, result.message
        devices = [f"RPC0[{x.endpoint}]" for x in servers]
        est = estimate(info, s, devices=devices)
        for device in devices:
            real_weights = result.load.model_buffers.get(device, 0)
            assert real_weights == pytest.approx(est.devices[device].weights, rel=0.01, abs=PRINTED), device
            assert result.load.kv_buffers.get(device, 0) == pytest.approx(est.devices[device].kv, rel=0.01, abs=PRINTED)
            assert result.load.compute_buffers[device] == pytest.approx(est.devices[device].compute, rel=0.25)
        host = sum(v for k, v in result.load.model_buffers.items() if k.startswith("CPU"))
        assert host == pytest.approx(est.devices["CPU"].weights, rel=0.01, abs=PRINTED)


def test_a_capped_device_runs_out_of_memory_for_real(tmp_path, rpc_servers):
    from tuner.testing import ModelShape, make_model

    model = make_model(tmp_path / "m.gguf", ModelShape(n_layer=4, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=4096))
    servers = rpc_servers(1, memory_limits=[24 * MiB])
    result = run_trial(settings(model, servers, n_gpu_layers=-1), QUICK)
    assert result.outcome is Outcome.OOM, result.message
    assert f"failed to allocate RPC0[{servers[0].endpoint}] buffer" in result.message
    assert result.load.oom
    # the same server still serves a placement that fits
    small = run_trial(settings(model, servers, n_gpu_layers=1), QUICK)
    assert small.ok, small.message


def test_probe_lists_rpc_devices_with_their_memory(rpc_servers):
    servers = rpc_servers(1)
    machine = probe(llama=False, rpc_servers=(servers[0].endpoint,))
    (device,) = machine.rpc_devices
    assert device["endpoint"] == servers[0].endpoint and device["memory_total"] > 0
    dead = probe(llama=False, rpc_servers=(f"127.0.0.1:{free_port()}",)).rpc_devices[0]
    assert "error" in dead


def test_rpc_serve_command_and_bench_flag(models):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tuner", "rpc-serve", "--port", str(port), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        import socket

        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        out = CliRunner().invoke(cli, ["bench", str(models["q8_0"]), "--rpc", f"127.0.0.1:{port}", "-ngl", "99",
                                       "-c", "512", "-p", "32", "-n", "4", "-r", "1", "--json"])
        assert out.exit_code == 0, out.output
        data = json.loads(out.output)
        assert data["settings"]["rpc_servers"] == [f"127.0.0.1:{port}"]
        assert data["load"]["layers_offloaded"] == 5
        assert f"RPC0[127.0.0.1:{port}]" in data["load"]["model_buffers"]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
