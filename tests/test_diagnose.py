"""``diagnose``: real logs read as their truth says; levers checked against the memory arithmetic and,
for every lever that claims full offload, by applying it on a capped RPC device (real llama.cpp)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.engine.base import BenchSpec
from tuner.engine.python import run_trial
from tuner.engine.settings import Settings
from tuner.machine.probe import GPUProcess
from tuner.machine.whatif import MachineSpec
from tuner.model.estimate import estimate
from tuner.model.inspect import inspect
from tuner.report.diagnose import diagnose
from tuner.report.summary import offload_summary
from tuner.testing import ModelShape, make_model, quantize

from .test_profile import make_machine

MiB = 1 << 20
GiB = 1 << 30
LOGS = Path(__file__).resolve().parent / "logs"
TRUTH = json.loads((LOGS / "truth.json").read_text(encoding="utf-8"))
QUICK = BenchSpec(n_prompt=16, n_gen=2, repetitions=1, warmup=False)
# What a capped RPC server spends besides the buffers llama.cpp asks for (its compute thread's
# stack, allocator slack): the margin the levers are judged with on such a device.
RPC_MARGIN = 12 * MiB


def run(args, **kwargs):
    return CliRunner().invoke(cli, args, obj={"gpus": []}, **kwargs)


# -- the shared real logs ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TRUTH))
def test_what_happened_is_what_truth_says(name):
    truth = TRUTH[name]
    result = run(["diagnose", str(LOGS / name), "--json"])
    if truth["layers_offloaded"] is None and not truth["model_buffers"] and not truth["oom"] and not truth["kv_by_device"] \
            and not truth["compute_by_device"]:
        if truth.get("prompt_tps") is not None or truth.get("eval_tps") is not None:
            # timings only: diagnose reports the speeds (and says the load is not in the log)
            assert result.exit_code == 0, result.output
            text = run(["diagnose", str(LOGS / name)]).output
            assert text.startswith("speed: ") and "not in this log" in text
            return
        # nothing of the load in this excerpt: one clear line, exit 2
        assert result.exit_code == 2, result.output
        assert result.output.count("\n") == 1 and "no llama.cpp load lines" in result.output
        return
    assert result.exit_code == 0, result.output
    what = json.loads(result.output)["what_happened"]
    for key in ("layers_offloaded", "layers_total", "oom", "oom_device", "partial_offload", "cpu_fallback", "n_ctx"):
        assert what[key] == truth[key], (name, key, what[key], truth[key])


def test_json_is_exactly_the_issues_shape():
    data = json.loads(run(["diagnose", str(LOGS / "11_early2024-cuda-partial-10of33-mixtral-imatrix.log"), "--json"]).output)
    assert set(data) == {"what_happened", "memory", "levers"}
    assert set(data["what_happened"]) == {"layers_offloaded", "layers_total", "partial_offload", "oom", "oom_device",
                                          "cpu_fallback", "n_ctx", "type_k", "type_v"}
    assert set(data["memory"]) == {"CPU", "CUDA0"}
    assert data["memory"]["CUDA0"] == {"weights": round(14705.94 * MiB), "kv": 20 * MiB, "compute": round(108.03 * MiB),
                                       "free": None}
    assert data["levers"] and all(set(lv) == {"lever", "change", "frees_bytes", "reaches_full_offload", "explanation"}
                                  for lv in data["levers"])
    # the log says nothing of CUDA0's size: bytes are given, reaching full offload is unknown
    assert all(lv["reaches_full_offload"] is None and lv["frees_bytes"] >= 0 for lv in data["levers"])


def test_free_memory_the_log_printed_is_reported_per_device():
    data = json.loads(run(["diagnose", str(LOGS / "02_mainline-2xcuda-ot-exps-cpu-cli-perf.log"), "--json"]).output)
    assert data["memory"]["CUDA0"]["free"] == 9862 * MiB and data["memory"]["CUDA1"]["free"] == 31518 * MiB
    text = run(["diagnose", str(LOGS / "02_mainline-2xcuda-ot-exps-cpu-cli-perf.log")]).output
    assert text.splitlines()[0] == "full offload, 49/49 layers; 8.1 GiB free on CUDA0, 28.0 GiB free on CUDA1"


def test_a_cpu_only_build_asked_to_offload_is_a_silent_cpu_fallback(models, tmp_path):
    # This llama.cpp has no GPU backend: asked for 99 layers it prints "offloaded 5/5 layers to GPU"
    # and puts every buffer on the CPU. A real log of the case the issue names.
    result = run_trial(Settings(model_path=str(models["q8_0"]), n_gpu_layers=99, n_ctx=512, n_threads=2), QUICK)
    assert result.ok and (result.load.layers_offloaded, result.load.layers_total) == (5, 5)
    (tmp_path / "fallback.log").write_text(result.log)
    out = run(["diagnose", str(tmp_path / "fallback.log"), "--json"])
    data = json.loads(out.output)
    assert data["what_happened"]["cpu_fallback"] is True and data["what_happened"]["partial_offload"] is False
    assert [lv["lever"] for lv in data["levers"]] == ["a working GPU backend"]
    text = run(["diagnose", str(tmp_path / "fallback.log")]).output
    assert text.startswith("CPU fallback: 5/5 layers reported offloaded, but every buffer is on the CPU")


def test_the_log_can_come_on_stdin():
    text = (LOGS / "11_early2024-cuda-partial-10of33-mixtral-imatrix.log").read_bytes()
    out = run(["diagnose", "-"], input=text)
    assert out.exit_code == 0 and out.output.startswith("partial offload, 10/33 layers")


@pytest.mark.parametrize("content, message", [
    (b"", "the log is empty"),
    (b"   \n\n", "the log is empty"),
    (bytes(range(256)) * 40, "binary data, not a text log"),
    (b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 300, "binary data, not a text log"),
    (b"hello\nthis is not a llama.cpp log\n", "no llama.cpp load lines in this log"),
])
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, content, message):
    path = tmp_path / "bad.log"
    path.write_bytes(content)
    for args, kwargs in ((["diagnose", str(path)], {}), (["diagnose", "-"], {"input": content})):
        out = run(args, **kwargs)
        assert out.exit_code == 2, out.output
        assert out.output.startswith("Error: ") and out.output.count("\n") == 1 and message in out.output
        assert "Traceback" not in out.output


def test_missing_file_directory_and_bad_device_are_one_line(tmp_path):
    for args, message in ((["diagnose", str(tmp_path / "nope.log")], "no such file"),
                          (["diagnose", str(tmp_path)], "is a directory"),
                          (["diagnose", str(LOGS / "11_early2024-cuda-partial-10of33-mixtral-imatrix.log"), "--device", "CUDA0"],
                           "expected NAME=SIZE"),
                          (["diagnose", str(LOGS / "11_early2024-cuda-partial-10of33-mixtral-imatrix.log"), "--device", "CPU=8GiB"],
                           "--ram")):
        out = run(args)
        assert out.exit_code == 2 and out.output.count("\n") == 1 and message in out.output, out.output


def test_a_model_that_is_not_the_logs_is_refused(models):
    out = run(["diagnose", str(LOGS / "11_early2024-cuda-partial-10of33-mixtral-imatrix.log"), "--model", str(models["q8_0"])])
    assert out.exit_code == 2 and "has 4 layers but the log loaded a model with 32" in out.output


def test_with_device_sizes_the_levers_say_which_reach_full_offload():
    # Mixtral-8x7B, 10 of 33 layers on a GPU; say the GPU had 24 GiB: with the log's own numbers
    # (no shape in this excerpt) the KV levers are far too small, nothing else is sized without a model.
    log = LOGS / "11_early2024-cuda-partial-10of33-mixtral-imatrix.log"
    data = json.loads(run(["diagnose", str(log), "--device", "CUDA0=24GiB", "--json"]).output)
    assert {lv["lever"] for lv in data["levers"]} >= {"KV cache on the host", "q8_0 KV cache"}
    assert all(lv["reaches_full_offload"] is False for lv in data["levers"])
    bigger = json.loads(run(["diagnose", str(log), "--device", "CUDA0=80GiB", "--json"]).output)
    assert bigger["levers"][0]["lever"] == "every layer" and bigger["levers"][0]["reaches_full_offload"] is True


def test_processes_holding_gpu_memory_here_are_a_lever():
    # log 05 ran on two RTX 3090s; on "this machine" (injected) CUDA0 is an RTX 3090 too, and two
    # processes hold 6 GiB on it
    log = LOGS / "05_mainline-2xcuda-zero-offload-split-gguf.log"
    machine = make_machine(gpus=(("NVIDIA GeForce RTX 3090", 24 * GiB), ("NVIDIA GeForce RTX 3090", 24 * GiB)),
                           processes=((GPUProcess(4242, "python train.py", 5 * GiB), GPUProcess(77, "Xorg", GiB)), ()))
    result = diagnose(log.read_bytes(), local_gpus=machine.gpus)
    held = [lv for lv in result.levers if lv.lever == "free GPU memory"]
    assert len(held) == 1 and held[0].frees_bytes == 6 * GiB
    assert "pid 4242 (python train.py) 5.0 GiB" in held[0].explanation and "RTX 3090" in held[0].change
    # a machine whose GPUs are not the log's: no such lever
    other = make_machine(gpus=(("NVIDIA GeForce RTX 4090", 24 * GiB),), processes=((GPUProcess(1, "x", GiB),),))
    assert not [lv for lv in diagnose(log.read_bytes(), local_gpus=other.gpus).levers if lv.lever == "free GPU memory"]


def test_summary_words():
    assert offload_summary(33, 33, {"CUDA0": int(1.2 * GiB)}) == "full offload, 33/33 layers; 1.2 GiB free on CUDA0"
    assert offload_summary(10, 33, {"CUDA0": 300 * MiB}) == "partial offload, 10/33 layers; 300 MiB free on CUDA0"
    assert offload_summary(0, 33) == "no offload, 0/33 layers (CPU only)"
    assert offload_summary(None, None, oom=True, oom_device="CUDA0", oom_what="weights") == "out of memory on CUDA0 (the weights)"
    assert offload_summary(33, 33, cpu_fallback=True).startswith("CPU fallback: 33/33")


# -- levers on real llama.cpp: a capped RPC device -----------------------------------------------------

# 6 layers of 8 MiB (F16) and a 4 MiB output head; at n_ctx 4096 the F16 KV cache is 8 MiB a layer.
SHAPE = ModelShape(n_layer=6, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=4096, n_ctx_train=8192)
CAP = 100 * MiB


def _settings(model, server, **changes) -> Settings:
    base = dict(model_path=str(model), n_gpu_layers=-1, n_ctx=4096, n_batch=512, n_ubatch=512, n_threads=2,
                flash_attn="on", rpc_servers=(server.endpoint,))
    return Settings(**{**base, **changes})


@pytest.fixture(scope="module")
def capped_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("diag") / "m-F16.gguf", SHAPE)


def test_levers_match_the_arithmetic_and_those_that_claim_full_offload_reach_it(capped_model, rpc_servers, tmp_path):
    (server,) = rpc_servers(1, memory_limits=[CAP])
    device = f"RPC0[{server.endpoint}]"
    failed = run_trial(_settings(capped_model, server), QUICK)
    assert failed.load.oom, failed.message  # full offload at 4096 does not fit in 100 MiB
    info = inspect(capped_model)
    result = diagnose(failed.log, model=info, machine=MachineSpec({"RPC0": CAP}), local_gpus=False, margin=RPC_MARGIN)
    assert result.what_happened.oom and result.what_happened.oom_device == device
    assert result.sizing == "model"
    by = {lv.lever: lv for lv in result.levers}
    assert {"smaller quantization", "smaller context", "q8_0 KV cache", "q4_0 KV cache", "FFN on the CPU",
            "KV cache on the host"} <= set(by)

    # the numbers are the memory arithmetic's: full offload at the log's settings, less the change
    def full(info_, **kw):
        planned = Settings(model_path=info_.path, n_gpu_layers=-1, n_ctx=4096, type_k="f16", type_v="f16", flash_attn="on",
                           n_ubatch=512)
        return estimate(info_, planned.replace(**kw), devices=[device]).devices[device].total

    base = full(info)
    assert by["q8_0 KV cache"].frees_bytes == base - full(info, type_k="q8_0", type_v="q8_0")
    assert by["KV cache on the host"].frees_bytes == base - full(info, offload_kqv=False)
    ctx = by["smaller context"].settings["n_ctx"]
    assert full(info, n_ctx=ctx) <= CAP - RPC_MARGIN < full(info, n_ctx=ctx + 256)
    assert by["smaller context"].frees_bytes == base - full(info, n_ctx=ctx)

    # every lever that claims full offload really reaches it on the capped device
    claimed = [lv for lv in result.levers if lv.reaches_full_offload]
    assert len(claimed) >= 4, [(lv.lever, lv.reaches_full_offload) for lv in result.levers]
    for lever in claimed:
        model = capped_model
        if lever.quantization:
            model = quantize(capped_model, tmp_path / f"m-{lever.quantization}.gguf", lever.quantization)
        changes = {k: v for k, v in lever.settings.items()}
        applied = run_trial(_settings(model, server, **changes), QUICK)
        assert applied.ok, (lever.lever, applied.message)
        assert applied.load.layers_offloaded == applied.load.layers_total == SHAPE.n_layer + 1, lever.lever
        assert device in applied.load.model_buffers, lever.lever
    # and a lever that says it does not reach full offload does not fit either (the largest such)
    refused = [lv for lv in result.levers if lv.reaches_full_offload is False and lv.settings and not lv.quantization]
    for lever in refused[:1]:
        assert not run_trial(_settings(capped_model, server, **lever.settings), QUICK).ok, lever.lever


def test_partial_offload_log_without_model_uses_the_logs_shape(capped_model, rpc_servers):
    (server,) = rpc_servers(1, memory_limits=[CAP])
    partial = run_trial(_settings(capped_model, server, n_gpu_layers=3), QUICK)
    assert partial.ok and partial.load.partial_offload
    with_model = diagnose(partial.log, model=inspect(capped_model), machine=MachineSpec({"RPC0": CAP}), local_gpus=False,
                          margin=RPC_MARGIN)
    from_log = diagnose(partial.log, machine=MachineSpec({"RPC0": CAP}), local_gpus=False, margin=RPC_MARGIN)
    assert from_log.sizing == "log shape" and with_model.sizing == "model"
    assert with_model.summary.startswith("partial offload, 3/7 layers")
    # the log's print_info states this model's whole shape: the rebuilt model gives the same levers
    assert [(lv.lever, lv.change, lv.reaches_full_offload) for lv in from_log.levers] == \
        [(lv.lever, lv.change, lv.reaches_full_offload) for lv in with_model.levers]
    for a, b in zip(from_log.levers, with_model.levers):
        assert a.frees_bytes == pytest.approx(b.frees_bytes, rel=0.02, abs=MiB), a.lever


# -- the same one line in profile show and tune ------------------------------------------------------


def test_profile_show_and_tune_print_the_same_summary_line(tmp_path, monkeypatch):
    from tuner.profile.document import Profile
    from tuner.search import study

    from .test_profile import profile_dict, write_profile

    document = profile_dict()  # Qwen3-8B fully offloaded on a 24 GiB RTX 4090; CUDA0 holds 9706 MiB
    path = write_profile(tmp_path, document)
    line = "full offload, 37/37 layers; 14.5 GiB free on CUDA0"
    shown = run(["profile", "show", str(path)])
    assert shown.exit_code == 0, shown.output
    assert f"  offload   {line}" in shown.output.splitlines()

    profile = Profile.from_dict(document)
    result = study.TuneResult(profile=profile, profile_path=path, best={"settings": document["settings"], "tg": document["measured"]["tg"],
                                                                       "pp": document["measured"]["pp"]},
                              runner_up=None, counts={"run": 3, "pruned": 0, "oom": 0, "failed": 0}, space=None,
                              study_name="s", storage="sqlite://")
    monkeypatch.setattr(study, "tune", lambda *a, **k: result)
    tuned = run(["tune", str(path)])
    assert tuned.exit_code == 0, tuned.output
    assert f"  {line}" in tuned.output.splitlines()


def test_log_facts_read_the_shape_and_the_failed_allocation():
    from tuner.engine.logfacts import log_facts

    facts = log_facts((LOGS / "02_mainline-2xcuda-ot-exps-cpu-cli-perf.log").read_bytes())
    assert facts.shape() == {"n_layer": 48, "n_embd": 2048, "n_head": 32, "n_head_kv": 4, "n_ff": 6144, "n_vocab": 151936,
                             "n_expert": 128, "n_expert_used": 8, "n_embd_head_k": 128, "n_ctx_train": 40960, "n_ff_exp": 768}
    assert facts.quantization == "Q4_K_M" and facts.device_names == {"CUDA0": "NVIDIA GeForce RTX 4090",
                                                                     "CUDA1": "NVIDIA GeForce RTX 5090"}
    oom = log_facts((LOGS / "42_2026-cuda-weights-oom-alloc-tensor-range.log").read_bytes())
    assert (oom.oom_device, oom.oom_what, oom.oom_request) == ("CUDA0", "weights", 151851674624)
    compute = log_facts((LOGS / "07_ikfork-2xcuda-compute-oom-collapsed-whitespace.log").read_bytes())
    assert (compute.oom_device, compute.oom_what) == ("CUDA0", "compute") and len(compute.overridden_to_cpu) == 20
    assert log_facts(bytes(range(256)) * 100) == log_facts("")


# -- logs as people paste them: Ollama's own engine, `ollama ps`, timings only (tests/logs/written) ----

WRITTEN = LOGS / "written"


def test_a_two_gpu_ollama_log_is_a_full_offload_and_never_cpu_only():
    result = run(["diagnose", str(WRITTEN / "ollama-2025-ggml-buffer-2xcuda-journald.log")])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("full offload, 41/41 layers") and "CPU-only" not in result.output
    assert "CUDA1" in result.output and "rounded figures" in result.output
    data = json.loads(run(["diagnose", str(WRITTEN / "ollama-2025-ggml-buffer-2xcuda-journald.log"), "--json"]).output)
    assert data["memory"]["CUDA1"]["weights"] == round(11.9 * 1024 * MiB) and data["memory"]["CUDA0"]["free"] == round(23.1 * 1024 * MiB)


def test_an_ollama_partial_offload_gets_levers():
    data = json.loads(run(["diagnose", str(WRITTEN / "ollama-2026-device-cuda-partial-docker.log"), "--json"]).output)
    assert data["what_happened"]["partial_offload"] is True and data["memory"]["CUDA0"]["kv"] == 608 * MiB
    assert data["levers"] and data["memory"]["CUDA0"]["free"] == round(4.3 * 1024 * MiB)


@pytest.mark.parametrize("text", [
    "load_tensors: offloaded 20/41 layers to GPU\n",  # an excerpt: layers offloaded, no memory lines
    'time=2025-06-12T09:14:02.301+02:00 level=INFO source=ggml.go:362 msg="offloaded 41/41 layers to GPU"\n',
])
def test_a_log_that_offloaded_layers_is_never_called_cpu_only(text):
    result = run(["diagnose", "-"], input=text)
    assert result.exit_code == 0, result.output
    assert "CPU-only" not in result.output and "CPU only" not in result.output


def test_every_log_that_offloaded_layers_is_never_called_cpu_only():
    from tuner.engine.logparse import parse_log

    for path in [*sorted(LOGS.glob("*.log")), *sorted(WRITTEN.glob("*.log"))]:
        report = parse_log(path.read_bytes().decode("utf-8", errors="replace"))
        if not report.effective_layers_offloaded:
            continue
        result = run(["diagnose", str(path)])
        assert "CPU-only" not in result.output and "CPU only" not in result.output, path.name


def test_ollama_ps_pasted_is_a_partial_offload():
    result = run(["diagnose", str(WRITTEN / "ollama-ps.txt"), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["what_happened"]["partial_offload"] is True
    text = run(["diagnose", str(WRITTEN / "ollama-ps.txt")]).output
    assert text.startswith("partial offload: Ollama runs 52% of the model on the GPU and 48% on the CPU (ollama ps)")


def test_a_json_log_of_timings_only_reports_its_speeds():
    result = run(["diagnose", str(WRITTEN / "llama-server-2024-json-timings-only.log")])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("speed: prompt 126.04 tokens/s, generation 31.83 tokens/s; where the layers went is not in this log")


def test_diagnose_is_linear_in_device_lines_and_says_what_is_wrong_with_thousands():
    import time

    # 10^5 "using device" lines took minutes (each device compared with every other); now linear
    lines = "".join(f"llama_model_load_from_file_impl: using device CUDA{i} (NVIDIA RTX 4090) - 20000 MiB free\n"
                    for i in range(100_000))
    started = time.monotonic()
    result = run(["diagnose", "-"], input=lines + "load_tensors: offloaded 20/41 layers to GPU\n"
                 "load_tensors:        CUDA0 model buffer size =  2000.00 MiB\n")
    assert time.monotonic() - started < 30  # quadratic took ~15 minutes (10,000 lines: 10.6 s)
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output[-500:]
    assert "this log names 100000 devices, and llama.cpp uses at most 256" in result.output
    few = "".join(f"llama_model_load_from_file_impl: using device CUDA{i} (NVIDIA RTX 4090) - 20000 MiB free\n" for i in range(2000))
    result = run(["diagnose", "-"], input=few + "load_tensors: offloaded 20/41 layers to GPU\n")
    assert result.exit_code == 2 and "this log names 2000 devices" in result.output and "tensor_split" not in result.output


def test_no_offload_is_called_cpu_only_only_when_no_accelerator_held_anything():
    # 0/95 layers, but CUDA0 held compute buffers: not a CPU-only run (LoadReport.cpu_only is the one fact)
    text = run(["diagnose", str(LOGS / "05_mainline-2xcuda-zero-offload-split-gguf.log")]).output
    assert text.startswith("no offload, 0/95 layers (weights on the CPU; an accelerator holds compute or KV buffers)")
    assert "CPU-only" not in text
    text = run(["diagnose", str(LOGS / "01_mainline-cpu-only-server-windows-qwen3moe.log")]).output
    assert text.startswith("no offload, 0/49 layers (CPU only)") and "a CPU-only run" in text
