"""Weight repacking (issue 20): the setting, llama.cpp's extra CPU buffers in the memory arithmetic, the
crash search, and the recognition of a repack crash in a log.

The arithmetic is checked against llama.cpp's own ``... model buffer size = ...`` lines for a made Q4_0
model, loaded for real with and without mmap (Q4_0 repacks on any AVX2 or ARM dotprod CPU; the CPU's
features come from llama.cpp). The AMX crash itself cannot be made on a CPU without AMX: the crash
search runs on the scripted engine, which crashes when a chosen feature is on, and the outcome
classifier is checked on a process really killed by SIGSEGV.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tuner.engine.base import BenchSpec
from tuner.engine.fake import ScriptedRunner
from tuner.engine.logparse import parse_log
from tuner.engine.outcome import Outcome, classify
from tuner.engine.settings import Settings
from tuner.machine.probe import LlamaBuild, Machine
from tuner.model.estimate import CPU, estimate
from tuner.model.inspect import inspect
from tuner.model.make import quantize
from tuner.model.repack import AMX, CPU_REPACK, CpuFeatures, extra_buffer, extra_size, repackable
from tuner.search.crashes import FEATURES, investigate
from tuner.search.space import Device, build_space

MiB = 1 << 20
LOGS = Path(__file__).parent / "crash_logs"
# llama_print_system_info on an AMX Xeon (Sapphire Rapids), in ggml-cpu.cpp's feature order
AMX_SYSTEM_INFO = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
                   "AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | "
                   "OPENMP = 1 | REPACK = 1 | ")
AMX_CPU = CpuFeatures.parse(AMX_SYSTEM_INFO)
AVX2_CPU = CpuFeatures.of(["AVX", "AVX2", "FMA", "REPACK"])


def _this_cpu() -> CpuFeatures | None:
    import llama_cpp

    return CpuFeatures.parse(llama_cpp.llama_print_system_info().decode())


@pytest.fixture(scope="module")
def q4_0(models, tmp_path_factory) -> Path:
    return quantize(models["f16"], tmp_path_factory.mktemp("q4_0") / "tiny-Q4_0.gguf", "Q4_0")


# -- which weights, which buffer -----------------------------------------------------------------------


def test_features_are_read_from_llama_cpps_system_info():
    assert AMX_CPU is not None and AMX_CPU.amx and AMX_CPU.repack and AMX_CPU.has("AVX512")
    # a later backend's section is not the CPU's
    text = "CPU : AVX2 = 1 | REPACK = 1 | CUDA : ARCHS = 890 | FORCE_MMQ = 1 | "
    assert CpuFeatures.parse(text).flags == frozenset({"AVX2", "REPACK"})
    assert CpuFeatures.parse("") is None and CpuFeatures.parse("no cpu section here") is None


def test_repack_rules_follow_llama_cpp_by_type_shape_and_cpu():
    # Q4_0: AVX2 and rows in multiples of 8
    assert extra_buffer("blk.0.attn_q.weight", "Q4_0", (256, 256), AVX2_CPU) == CPU_REPACK
    assert extra_buffer("blk.0.attn_q.weight", "Q4_0", (256, 260), AVX2_CPU) is None
    # Q8_0 has no x86 repack path; AMX takes it when the rows are multiples of 32
    assert extra_buffer("blk.0.ffn_up.weight", "Q8_0", (256, 512), AVX2_CPU) is None
    assert extra_buffer("blk.0.ffn_up.weight", "Q8_0", (256, 512), AMX_CPU) == AMX
    # AMX before CPU_REPACK; where AMX's alignment fails, CPU_REPACK takes a Q4_0
    assert extra_buffer("blk.0.ffn_up.weight", "Q4_0", (256, 512), AMX_CPU) == AMX
    assert extra_buffer("blk.0.ffn_up.weight", "Q4_0", (256, 40), AMX_CPU) == CPU_REPACK
    # embeddings (GET_ROWS) and norms are never repacked; the output matrix is
    assert extra_buffer("token_embd.weight", "Q4_0", (256, 512), AMX_CPU) is None
    assert extra_buffer("blk.0.attn_norm.weight", "F32", (256,), AMX_CPU) is None
    assert extra_buffer("output.weight", "Q4_0", (256, 512), AVX2_CPU) == CPU_REPACK
    # experts: 3-D stacks for CPU_REPACK (MUL_MAT_ID), never AMX (MUL_MAT only)
    assert extra_buffer("blk.0.ffn_up_exps.weight", "Q4_0", (256, 512, 8), AMX_CPU) == CPU_REPACK
    assert extra_buffer("blk.0.ffn_up.weight", "Q4_0", (256, 512), None) is None
    # AMX's size: per row, the blocks plus an int32 per block of Q8_0 (amx/mmq.cpp get_row_size)
    assert extra_size(AMX, "Q8_0", (256, 512), 256 * 512 // 32 * 34) == 512 * (256 // 32) * (34 + 4)
    assert extra_size(CPU_REPACK, "Q4_0", (256, 512), 73728) == 73728


def test_a_gpu_with_a_pinned_host_buffer_takes_the_cpus_weights_first(q4_0):
    info = inspect(q4_0)
    partial = Settings(model_path=str(q4_0), n_gpu_layers=2)
    assert CPU_REPACK in estimate(info, partial, devices=["Metal"], cpu=AVX2_CPU).buffers[CPU]
    assert CPU_REPACK not in estimate(info, partial, devices=["CUDA0"], cpu=AVX2_CPU).buffers[CPU]


_LOAD = r"""
import sys, llama_cpp
from tuner.engine.overrides import tensor_overrides_applied
with tensor_overrides_applied((), repack=sys.argv[3] == "1"):
    llama_cpp.Llama(sys.argv[1], n_ctx=256, n_batch=64, n_ubatch=64, use_mmap=sys.argv[2] == "1", verbose=True)
"""
# "load_tensors: %12s model buffer size = %8.2f MiB" (src/llama-model.cpp)
_BUFFER_RE = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")


def _real_buffers(model: Path, mmap: bool, repack: bool) -> dict[str, float]:
    run = subprocess.run([sys.executable, "-c", _LOAD, str(model), "1" if mmap else "0", "1" if repack else "0"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return {m.group(1): float(m.group(2)) * MiB for m in _BUFFER_RE.finditer(run.stderr)}


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "no-mmap"])
def test_the_repack_buffer_is_predicted_within_1_percent_of_llama_cpps(q4_0, mmap):
    pytest.importorskip("llama_cpp")
    cpu = _this_cpu()
    info = inspect(q4_0)
    if not repackable(info.tensors, cpu):
        pytest.skip(f"this CPU repacks no Q4_0 weight (llama.cpp reports {cpu.describe() if cpu else 'no features'})")
    settings = Settings(model_path=str(q4_0), n_ctx=256, use_mmap=mmap)
    for repack in (True, False):
        real = _real_buffers(q4_0, mmap, repack)
        predicted = estimate(info, settings.replace(repack=repack), devices=[], cpu=cpu).buffers[CPU]
        assert set(predicted) == set(real), (predicted, real)
        for name, size in real.items():
            assert abs(predicted[name] - size) <= 0.01 * size + 0.01 * MiB, (name, predicted[name] / MiB, size / MiB)
        if repack:
            host = "CPU_Mapped" if mmap else "CPU"
            assert real[CPU_REPACK] > 0.5 * real[host] or not mmap  # with mmap the file AND the copy
    on = estimate(info, settings, devices=[], cpu=cpu).devices[CPU].weights
    off = estimate(info, settings.replace(repack=False), devices=[], cpu=cpu).devices[CPU].weights
    assert on > off if mmap else on >= off


# -- the setting ----------------------------------------------------------------------------------------


def test_repack_is_spelled_for_every_tool_and_the_c_api():
    off = Settings(model_path="m.gguf", repack=False)
    assert "--no-repack" in off.cli_args("llama-server") and "--no-repack" in off.cli_args("llama-cli")
    args = off.cli_args("llama-bench")
    assert args[args.index("--repack") + 1] == "0"
    assert "--no-repack" not in Settings(model_path="m.gguf").cli_args("llama-server")
    llama_cpp = pytest.importorskip("llama_cpp")
    from tuner.engine.worker import _set_fields

    params = llama_cpp.llama_model_default_params()
    assert params.use_extra_bufts is True  # llama.cpp's default
    _set_fields(params, "model", off)
    assert params.use_extra_bufts is False


def test_repack_is_searched_only_where_the_cpu_repacks_the_models_weights(models, q4_0):
    q8 = inspect(models["q8_0"])
    assert "repack" in build_space([q8], cpu=AVX2_CPU).excluded  # AVX2 repacks no Q8_0
    # with a variant that has none, asked for the variant that has some only
    both = build_space([q8, inspect(q4_0)], cpu=AVX2_CPU)
    assert {s.repack for s in both.grid() if s.model_path == str(q4_0)} == {True, False}
    assert {s.repack for s in both.grid() if s.model_path == q8.path} == {True}
    assert build_space([q8], cpu=AMX_CPU).domains["repack"] == (True, False)  # AMX does
    space = build_space([inspect(q4_0)], cpu=AVX2_CPU)
    assert space.domains["repack"] == (True, False) and "repack" in space.dimensions()
    assert "repack" in build_space([inspect(q4_0)], cpu=None).excluded  # features unknown: nothing assumed
    cuda = build_space([inspect(q4_0)], devices=[Device("CUDA0", 8 << 30, 8 << 30)], cpu=AVX2_CPU)
    assert "pinned host buffer" in cuda.excluded["repack"]
    # with a device without a host buffer, asked only when the CPU still holds weights
    rpc = build_space([inspect(q4_0)], devices=[Device("RPC0[h:1]", 8 << 30, 8 << 30)], cpu=AVX2_CPU)
    every = rpc.n_layer + 1
    full = [s for s in rpc.grid() if s.n_gpu_layers == every and not s.tensor_overrides]
    assert full and all(s.repack for s in full)  # nothing on the CPU to repack: not asked
    assert {s.repack for s in rpc.grid() if s.n_gpu_layers == every and s.tensor_overrides} == {True, False}
    assert {s.repack for s in rpc.grid() if s.n_gpu_layers < every} == {True, False}


def test_the_app_loads_with_repacking_off_from_the_profile(q4_0, tmp_path):
    """tuner.Llama passes the profile's repack to llama.cpp (use_extra_bufts), in a real load."""
    pytest.importorskip("llama_cpp")
    from tests.test_apps import _real_profile, _run_app

    if not repackable(inspect(q4_0).tensors, _this_cpu()):
        pytest.skip("this CPU repacks no Q4_0 weight")
    seen = {}
    for repack in (True, False):
        folder = tmp_path / str(repack)
        folder.mkdir()
        run = _run_app(q4_0, _real_profile(folder, q4_0, repack=repack))
        assert run.returncode == 0, run.stderr[-2000:]
        seen[repack] = set(m.group(1) for m in _BUFFER_RE.finditer(run.stderr))
    assert CPU_REPACK in seen[True] and CPU_REPACK not in seen[False]


def test_an_app_on_an_amx_cpu_is_warned_about_a_profile_with_repacking_on(models):
    from tests.test_profile import make_machine, profile_dict
    from tuner.model.gguf import model_fingerprint
    from tuner.profile.apps import repack_warning
    from tuner.profile.document import Profile

    here, elsewhere = make_machine(), make_machine(cpu_model="Intel Xeon Platinum 8480+")
    profile = Profile.from_dict(profile_dict(elsewhere, model_fingerprint(models["q8_0"])))
    message = repack_warning(profile, AMX_SYSTEM_INFO, here)
    assert message and "AMX" in message and "repack=False" in message and "ggml-org/llama.cpp#20824" in message
    assert repack_warning(profile, "CPU : AVX2 = 1 | REPACK = 1 |", here) is None
    assert repack_warning(profile.replace(settings=profile.settings.replace(repack=False)), AMX_SYSTEM_INFO, here) is None
    assert repack_warning(profile, AMX_SYSTEM_INFO, elsewhere) is None  # measured on this machine: it ran


# -- a crash is a clue ------------------------------------------------------------------------------------


def test_a_sigsegv_in_a_backend_kernel_is_a_crash_not_an_oom():
    """A process really killed by SIGSEGV, after a log whose last buffer is a repack buffer."""
    run = subprocess.run([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"],
                         capture_output=True, timeout=30)
    assert run.returncode == -signal.SIGSEGV
    report = parse_log((LOGS / "amx-repack-crash-llama-cli.log").read_text())
    assert not report.oom and report.model_buffers["AMX"] == round(213.91 * MiB)
    c = classify(returncode=run.returncode, oom_in_log=report.oom,
                 error_lines=("ggml_compute_forward_mul_mat: in ggml_backend_amx_mul_mat",))
    assert c.outcome is Outcome.CRASH and c.signal_name == "SIGSEGV"
    assert "segmentation fault" in c.message


def _amx_machine() -> Machine:
    return Machine(cpu_model="Intel Xeon Platinum 8480+", physical_cores=2, logical_cores=2, ram_total=16 << 30,
                   ram_available=12 << 30, llama=LlamaBuild(llama_cpp_python="0.3.36", system_info=AMX_SYSTEM_INFO))


def _tune(models, tmp_path, engine, trials=6, **kwargs):
    from tuner.search.study import Tuner

    info = inspect(models["q8_0"])
    events = []
    tuner = Tuner(models["q8_0"], trials=trials, machine=_amx_machine(), engine=engine, infos={info.path: info},
                  storage=f"sqlite:///{tmp_path / 'study.db'}", out=tmp_path / "profiles", measure_quality=False,
                  repetitions=1, final_repetitions=1, final_rounds=1, on_event=events.append, **kwargs)
    return tuner.run(), events


def test_the_search_finds_that_repacking_crashes_and_tunes_without_it(models, tmp_path):
    info = inspect(models["q8_0"])
    engine = ScriptedRunner({info.path: info}, crash_when=lambda s: s.repack, cpu=AMX_CPU)
    result, events = _tune(models, tmp_path, engine)
    assert result.profile is not None and result.profile.settings.repack is False
    assert result.profile.to_dict()["settings"]["repack"] is False
    learned = [e for e in events if e["kind"] == "crash_learned"]
    assert len(learned) == 1 and learned[0]["off"] == ["repack"] and learned[0]["runs"] == 1
    assert learned[0]["message"].startswith("llama.cpp crashes on this CPU when it repacks weights for AMX "
                                            "(a known llama.cpp fault: ggml-org/llama.cpp#20824); tuned with repacking off")
    # crashing values are not launched again: one crash, then only repacking off
    crashed = [s for s in engine.launched if s.repack]
    assert len(crashed) == 1 and engine.launched[0].repack
    assert result.counts["run"] >= 2
    # and a resumed study knows it without crashing again
    engine2 = ScriptedRunner({info.path: info}, crash_when=lambda s: s.repack, cpu=AMX_CPU)
    _, events2 = _tune(models, tmp_path, engine2, trials=8)
    assert not any(s.repack for s in engine2.launched)
    assert not [e for e in events2 if e["kind"] == "crash_search"]


def test_the_search_finds_a_flash_attention_crash_after_trying_repacking(models, tmp_path):
    info = inspect(models["q8_0"])
    engine = ScriptedRunner({info.path: info}, crash_when=lambda s: s.flash_attn == "on", cpu=AMX_CPU)
    result, events = _tune(models, tmp_path, engine, space_overrides={"flash_attn": ("on",), "type_k": ("f16",)})
    learned = [e for e in events if e["kind"] == "crash_learned"]
    assert learned[0]["off"] == ["flash_attn"]
    assert [t["off"] for t in learned[0]["tried"]] == [["repack"], ["flash_attn"]]  # the order, and its cost
    assert "with flash attention on; tuned with flash attention off (-fa off)" in learned[0]["message"]
    assert result.profile.settings.flash_attn == "off"


def test_a_crash_no_feature_avoids_is_said_and_costs_a_bounded_number_of_runs():
    s = Settings(model_path="m.gguf", flash_attn="on", type_k="q8_0", type_v="q8_0", n_gpu_layers=3, op_offload=True,
                 tensor_overrides=(r"blk\.0\.ffn_up\.weight",))
    runs = []

    def run(c):
        from tuner.engine.base import TrialResult

        runs.append(c)
        return TrialResult(Outcome.CRASH, "worker killed by SIGSEGV", c, BenchSpec())

    finding = investigate(s, run)
    applicable = [f.name for f in FEATURES if f.off(s) is not None]
    assert not finding.found and finding.runs == len(applicable) + 1 == len(runs)
    assert "not a crash these settings avoid" in finding.message


def test_the_smallest_set_is_found_when_two_features_crash_only_together():
    s = Settings(model_path="m.gguf", flash_attn="on", use_mmap=True)
    from tuner.engine.base import TrialResult

    def run(c):  # crashes unless both repacking and mmap are off
        ok = not c.repack and not c.use_mmap
        return TrialResult(Outcome.OK if ok else Outcome.CRASH, "", c, BenchSpec())

    finding = investigate(s, run)
    assert finding.off == ("repack", "use_mmap")
    # singles (repack, flash_attn, mmap), all off, then each turned back on once
    assert finding.runs == 3 + 1 + 3


# -- diagnose and probe -----------------------------------------------------------------------------------


def test_diagnose_recognises_a_crash_after_repacking_and_gives_no_repack():
    from tuner.report.diagnose import diagnose

    d = diagnose((LOGS / "amx-repack-crash-llama-cli.log").read_text(), local_gpus=False)
    (lever,) = d.levers
    assert lever.lever == "weight repacking off" and lever.change.startswith("--no-repack")
    assert "AMX" in lever.explanation and "ggml-org/llama.cpp#20824" in lever.explanation
    assert "at the first decode" in lever.explanation and "Segmentation fault" in lever.explanation
    assert json.loads(json.dumps(d.to_dict()))["levers"][0]["lever"] == "weight repacking off"
    ran = diagnose((LOGS / "cpu-repack-ran.log").read_text(), local_gpus=False)
    assert not any(lever.lever == "weight repacking off" for lever in ran.levers)


def test_probe_says_what_llama_cpp_reports_and_the_repack_risk():
    from tuner.cli.main import format_machine

    text = format_machine(_amx_machine())
    assert "CPU features (llama.cpp): " in text and "AMX_INT8" in text
    assert "Weight repacking: " in text and "ggml-org/llama.cpp#20824" in text


def test_bench_ends_with_a_measured_result_when_the_crash_is_avoidable(models, monkeypatch):
    from click.testing import CliRunner

    import tuner.engine.select as select
    from tuner.cli.main import cli

    info = inspect(models["q8_0"])
    engine = ScriptedRunner({info.path: info}, crash_when=lambda s: s.repack)
    monkeypatch.setattr(select, "open_engine", lambda *a, **k: engine)
    result = CliRunner().invoke(cli, ["bench", str(models["q8_0"]), "-p", "16", "-n", "8", "-r", "1", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["outcome"] == "ok" and data["tg"]["median"] > 0
    assert data["settings"]["repack"] is False
    assert data["crash_avoided"]["off"] == ["repack"] and data["crash_avoided"]["runs"] == 1
    assert "when it repacks weights" in data["context_note"]
    # nothing avoids it: the crash is the answer, exit 2
    engine.crash_when = lambda s: True
    failed = CliRunner().invoke(cli, ["bench", str(models["q8_0"]), "-p", "16", "-n", "8", "-r", "1", "--json"])
    assert failed.exit_code == 2 and "crash" in failed.output
