"""The trial runner on the real llama.cpp: measurement, model reuse, and every way a trial ends.

No fake engine here: each test launches real worker processes on real GGUF files.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.engine.outcome import Outcome, classify
from tuner.engine.base import BenchSpec
from tuner.engine.python import TrialRunner, run_trial
from tuner.engine.settings import Settings
from tuner.testing import ModelShape, make_model

QUICK = BenchSpec(n_prompt=64, n_gen=8, repetitions=2)
MiB = 1 << 20


def settings(path, **changes) -> Settings:
    base = dict(model_path=str(path), n_ctx=512, n_batch=512, n_ubatch=256, n_threads=2)
    return Settings(**{**base, **changes})


def _no_process_in_group(pgid: int) -> bool:
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.info["pid"]) == pgid:
                return False
        except (ProcessLookupError, PermissionError):
            continue
    return True


def test_bench_measures_pp_and_tg_with_repetitions(models):
    result = run_trial(settings(models["q8_0"]), BenchSpec(n_prompt=128, n_gen=16, repetitions=3))
    assert result.outcome is Outcome.OK, result.message
    assert len(result.pp.samples) == 3 and len(result.tg.samples) == 3
    assert all(x > 0 for x in result.pp.samples + result.tg.samples)
    assert min(result.pp.samples) <= result.pp.median <= max(result.pp.samples)
    assert min(result.pp.samples) <= result.pp.ci_low <= result.pp.median <= result.pp.ci_high <= max(result.pp.samples)
    # the parsed load log of this very run
    assert result.load.layers_total == 5 and result.load.layers_offloaded == 0
    assert result.load.kv_size == 512 * 4 * 2 * 128 * 2  # n_ctx * layers * (K+V) * kv_dim * f16
    assert sum(result.load.model_buffers.values()) > 0 and result.load.compute_buffers.get("CPU", 0) > 0
    assert result.peak_rss and result.peak_rss > 10 * MiB


def test_bench_cli_json(models):
    out = CliRunner().invoke(cli, ["bench", str(models["q8_0"]), "-c", "512", "-p", "64", "-n", "8", "-r", "2", "-t", "2", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert set(data) >= {"outcome", "settings", "pp", "tg", "load", "peak_rss", "peak_vram"}
    assert data["outcome"] == "ok"
    for key in ("median", "mean", "stddev", "samples"):
        assert key in data["pp"] and key in data["tg"]
    assert len(data["tg"]["samples"]) == 2
    for key in ("layers_offloaded", "layers_total", "oom", "model_buffers", "kv_buffers", "compute_buffers", "kv_size",
                "type_k", "type_v", "n_ctx", "devices", "prompt_tps", "eval_tps", "build", "errors"):
        assert key in data["load"]


def test_bench_cli_bad_model_is_a_clear_error(tmp_path):
    out = CliRunner().invoke(cli, ["bench", str(tmp_path / "missing.gguf")])
    assert out.exit_code == 2 and "no such file" in out.output


def test_bench_cli_out_of_memory_is_the_report_then_one_error_line_and_exit_2(models):
    # 512 MiB of KV cache under a 300 MiB cap on the worker: llama.cpp's allocation fails
    out = CliRunner().invoke(cli, ["bench", str(models["q8_0"]), "-c", "262144", "-p", "8", "-n", "4", "-r", "1",
                                   "--memory-limit", "300", "--json"])
    assert out.exit_code == 2, out.output
    assert json.loads(out.stdout)["outcome"] == "oom"
    assert out.stderr.startswith("Error: the trial did not run to the end: oom - out of memory: ")
    assert len(out.stderr.splitlines()) == 1


def test_context_only_changes_reuse_the_loaded_model(models):
    with TrialRunner() as runner:
        first = runner.run(settings(models["q8_0"]), QUICK)
        pid = runner.worker_pid
        second = runner.run(settings(models["q8_0"], n_ctx=1024, type_k="q8_0", flash_attn="on", n_threads=1), QUICK)
        assert runner.worker_pid == pid
        third = runner.run(settings(models["q4_k_m"]), QUICK)
        assert runner.worker_pid != pid
    assert first.ok and second.ok and third.ok
    assert not first.reused_model and second.reused_model and not third.reused_model
    # the reused trial still reports the model's buffers (from the load) and its own context
    assert second.load.model_buffers == first.load.model_buffers
    assert second.load.n_ctx == 1024 and second.load.type_k == "q8_0"


def test_tensor_overrides_keep_those_tensors_on_the_cpu(models):
    result = run_trial(settings(models["q8_0"], tensor_overrides=(r"blk\.0\.ffn_(up|down)",)), QUICK)
    assert result.ok, result.message
    assert "tensor blk.0.ffn_up.weight" in result.log and "buffer type overridden to CPU" in result.log
    assert "blk.0.ffn_down.weight" in result.log and "blk.1.ffn_up.weight (" not in result.log


def test_a_trial_that_runs_too_long_is_killed_at_its_limit(models):
    seen: list[int] = []
    with TrialRunner(timeout_s=1.5) as runner:
        def watch():
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:
                if runner.worker_pid:
                    seen.append(runner.worker_pid)
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        started = time.monotonic()
        result = runner.run(settings(models["f16"], n_ctx=4096), BenchSpec(n_prompt=4000, n_gen=1000, repetitions=50))
        elapsed = time.monotonic() - started
        watcher.join()
    assert result.outcome is Outcome.TIMEOUT
    assert result.message == "killed after 1.5 s without finishing (the whole process group)"
    assert elapsed < 15
    # the worker led its own process group, and nothing of that group is left
    assert seen and _no_process_in_group(seen[0])


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGABRT])
def test_a_worker_killed_by_a_signal_is_a_crash(models, sig):
    with TrialRunner(timeout_s=60) as runner:
        def kill_when_running():
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                pid = runner.worker_pid
                if pid and "trial" in (runner._read_log(0) if runner._log_path else ""):
                    os.kill(pid, sig)
                    return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_when_running)
        killer.start()
        result = runner.run(settings(models["f16"], n_ctx=4096), BenchSpec(n_prompt=4000, n_gen=500, repetitions=20))
        killer.join()
    assert result.outcome is Outcome.CRASH
    assert result.signal == sig.name and sig.name in result.message
    # the caller lives on, and the next trial gets a fresh worker
    again = run_trial(settings(models["q8_0"]), QUICK)
    assert again.ok


def test_host_out_of_memory_is_oom_with_llama_cpps_message(models, tmp_path):
    big = make_model(tmp_path / "big.gguf", ModelShape(n_layer=4, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=4096))
    assert big.stat().st_size > 40 * MiB
    result = run_trial(settings(big, use_mmap=False), QUICK, memory_limit=24 * MiB)
    assert result.outcome is Outcome.OOM
    assert "unable to allocate CPU buffer" in result.message or "failed to allocate" in result.message
    assert result.load.oom
    mapped = run_trial(settings(big), QUICK, memory_limit=24 * MiB)
    assert mapped.outcome is Outcome.OOM and "mmap failed" in mapped.message


def test_bad_settings_are_rejected_before_launch(models, tmp_path):
    missing = run_trial(settings(tmp_path / "gone.gguf"), QUICK)
    assert missing.outcome is Outcome.BAD_SETTINGS and "model file not found" in missing.message
    too_small = run_trial(settings(models["q8_0"], n_ctx=32, n_batch=32, n_ubatch=32), QUICK)
    assert too_small.outcome is Outcome.BAD_SETTINGS and "n_ctx 32" in too_small.message


def test_llama_cpp_refusing_the_model_is_a_load_error(models, tmp_path):
    # A GGUF whose tensors llama.cpp cannot use: the embedding has the wrong width.
    import gguf
    import numpy as np

    path = tmp_path / "wrong.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("attention.head_count", 2), ("attention.layer_norm_rms_epsilon", 1e-5)):
        getattr(writer, "add_uint32" if isinstance(value, int) else "add_float32")(f"llama.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(300)])
    writer.add_token_scores([0.0] * 300)
    writer.add_token_types([1] * 300)
    writer.add_tensor("token_embd.weight", np.zeros((300, 32), dtype=np.float32))
    writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); writer.close()
    result = run_trial(settings(path), QUICK)
    assert result.outcome is Outcome.LOAD_ERROR
    assert "token_embd.weight" in result.message or "failed to load" in result.message


def test_classification_is_decided_in_one_place():
    assert classify(rejected="no").outcome is Outcome.BAD_SETTINGS
    assert classify(timed_out=True, timeout_s=3).outcome is Outcome.TIMEOUT
    # an allocation failure that ends in an abort is an OOM, not a crash
    assert classify(returncode=-6, oom_in_log=True, error_lines=("cudaMalloc failed: out of memory",)).outcome is Outcome.OOM
    assert classify(returncode=-11).outcome is Outcome.CRASH
    assert classify(reply={"status": "ok"}).outcome is Outcome.OK
    assert classify(reply={"status": "load_error", "message": "x"}).outcome is Outcome.LOAD_ERROR
    assert classify(returncode=1).outcome is Outcome.CRASH


def test_paired_measurement_runs_candidates_side_by_side(models):
    candidates = [settings(models["q8_0"]), settings(models["q8_0"], n_ubatch=128, type_k="q8_0", flash_attn="on"),
                  settings(models["q4_k_m"])]
    with TrialRunner() as runner:
        results = runner.run_paired(candidates, BenchSpec(n_prompt=32, n_gen=8, repetitions=2), rounds=3)
        # the runner is usable for ordinary trials afterwards
        after = runner.run(settings(models["q8_0"]), QUICK)
    assert [r.settings for r in results] == candidates
    for r in results:
        assert r.ok, r.message
        assert len(r.tg.samples) == 3 * 2 and len(r.pp.samples) == 3 * 2
    assert "paired measurement of 3 candidates begins" in results[0].log
    assert results[0].log.count("context begins") == 3  # three contexts, created once
    assert after.ok and not after.reused_model


def test_paired_measurement_failure_is_classified(models, tmp_path):
    from tuner.testing import ModelShape, make_model

    big = make_model(tmp_path / "big.gguf", ModelShape(n_layer=4, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=4096))
    with TrialRunner(memory_limit=24 * MiB) as runner:
        results = runner.run_paired([settings(big, use_mmap=False), settings(models["q8_0"])], QUICK, rounds=1)
    assert all(r.outcome is Outcome.OOM for r in results)
