"""Real tunes on the llama-cpp engine: llama.cpp's own binaries (``llama_bin``: llama-bench and
llama-fit-params built from the same sources as llama-cpp-python) measure every trial, on the CPU and
on a capped RPC device acting as a small GPU."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.engine.llamacpp import LlamaCppEngine
from tuner.profile.document import Profile
from tuner.search.study import Tuner
from tuner.testing import DEMO_SHAPE, ModelShape, make_model, quantize

MiB = 1 << 20
# One thread: on a shared 2-core machine a second compute thread waits on the first whenever it is
# preempted, and speeds scatter several-fold (benchmarks/engines.py); one thread measures steadily.
ONLY_THE_VARIANT = {"kv_types": ("f16",), "flash_attn": ("on",), "threads": (1,), "n_ubatch": (512,), "n_ctx": (1024,)}


def test_a_tune_of_an_f32_q8_0_q4_k_m_family_picks_q4_k_m_and_names_the_engine(tmp_path, llama_bin, tuner_home):
    # The demo model's shape: big enough that generation is bound by memory traffic on this CPU,
    # where the smallest quantization reads the fewest bytes per token.
    f32 = make_model(tmp_path / "fam-F32.gguf", DEMO_SHAPE, dtype="F32")
    q8 = quantize(f32, tmp_path / "fam-Q8_0.gguf", "Q8_0")
    q4 = quantize(f32, tmp_path / "fam-Q4_K_M.gguf", "Q4_K_M")
    events = []
    with LlamaCppEngine(llama_bin, timeout_s=600) as engine:
        tuner = Tuner(str(f32), variants=[str(q8), str(q4)], trials=3, min_ctx=1024, n_prompt=32, n_gen=16, repetitions=2,
                      final_repetitions=6, final_rounds=6, final_candidates=2, vram_margin=0, engine=engine,
                      on_event=events.append, space_overrides=ONLY_THE_VARIANT, chunks=2, quality_ctx=128)
        assert tuner.space.dimensions() == {"variant": ["fam-F32.gguf", "fam-Q8_0.gguf", "fam-Q4_K_M.gguf"]}
        result = tuner.run()
        build = engine.build()
    launched = {e["settings"]["model_path"] for e in events if e["kind"] == "launch"}
    assert launched == {str(f32), str(q8), str(q4)}
    outcomes = [e["outcome"] for e in events if e["kind"] == "result"]
    assert outcomes == ["ok"] * 3
    # the leaders measured again side by side, in rotating rounds; or, when the leader is clear of the
    # others by more than the noise, not measured again and said so (issue 24)
    remeasured = [e for e in events if e["kind"] == "remeasure"]
    skipped = [e for e in events if e["kind"] == "remeasure_skipped"]
    assert len(remeasured) + len(skipped) == 1, [e["kind"] for e in events]
    if remeasured:
        assert remeasured[0]["paired"] and remeasured[0]["repetitions"] == 6
    profile = Profile.from_dict(json.loads(result.profile_path.read_text()))
    assert profile.settings.model_path == str(q4), [(c["settings"]["model_path"], c["value"]) for c in [result.best]]
    assert profile.engine is not None and profile.engine.name == "llama-cpp"
    assert profile.engine.build == build.describe() and build.commit and profile.engine.path == str(llama_bin)
    assert profile.llama_build.llama_cpp_python is None and profile.llama_build.llama_cpp_build == build.describe()
    assert len(profile.measured.tg.samples) == (6 if remeasured else 2)
    # llama-bench gives no logits: quality came from llama-cpp-python's llama.cpp, against the F32 reference
    assert any(e["kind"] == "quality_engine" for e in events)
    report = result.quality
    assert report is not None and report.reference == str(f32)
    assert profile.quality is not None and profile.quality.reference_file == "fam-F32.gguf"
    # the exported flags went through the binaries' own parser
    assert result.flags_check == {"tool": "llama-server", "parser": str(llama_bin / "llama-fit-params"), "accepted": True,
                                  "error": None}


def test_a_tune_against_a_capped_rpc_device_learns_where_it_runs_out_and_measures_fits_answer(tmp_path, llama_bin,
                                                                                             rpc_servers, tuner_home):
    model = make_model(tmp_path / "m.gguf", ModelShape(n_layer=6, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=4096))
    (server,) = rpc_servers(1, memory_limits=[40 * MiB])
    device = f"RPC0[{server.endpoint}]"
    events = []
    with LlamaCppEngine(llama_bin, timeout_s=300) as engine:
        tuner = Tuner(str(model), trials=8, min_ctx=512, n_prompt=32, n_gen=8, repetitions=1, final_repetitions=1,
                      vram_margin=0, rpc_servers=(server.endpoint,), engine=engine, on_event=events.append,
                      space_overrides={**ONLY_THE_VARIANT, "n_ctx": (512,), "placements": ("none",), "offload_kqv": (True,)})
        assert [d.name for d in tuner.space.devices] == [device]  # the binaries listed it
        assert tuner.space.dimensions() == {"n_gpu_layers": (0, 7)}
        result = tuner.run()
    fit = [e for e in events if e["kind"] == "fit_seed"]
    # llama.cpp's fitter sees the server's whole RAM as free (the cap is an address-space limit it
    # cannot see): it offloads every layer; that candidate is measured like any other, and runs out
    assert len(fit) == 1 and fit[0]["settings"]["n_gpu_layers"] == 7 and "-ngl -1" in fit[0]["message"]
    launched = [e for e in events if e["kind"] == "launch"]
    outcomes = {e["number"]: e for e in events if e["kind"] == "result"}
    assert any(e["settings"]["n_gpu_layers"] == 7 for e in launched)
    ok = sorted(e["settings"]["n_gpu_layers"] for e in launched if outcomes[e["number"]]["outcome"] == "ok")
    oom = sorted(e["settings"]["n_gpu_layers"] for e in launched if outcomes[e["number"]]["outcome"] == "oom")
    assert ok and oom and max(ok) < min(oom), (ok, oom)
    assert all(device in outcomes[e["number"]]["message"] for e in launched if outcomes[e["number"]]["outcome"] == "oom")
    # once a placement ran out, nothing needing as much there was launched
    first = next(i for i, e in enumerate(launched) if outcomes[e["number"]]["outcome"] == "oom")
    assert all(e["settings"]["n_gpu_layers"] < launched[first]["settings"]["n_gpu_layers"] for e in launched[first + 1:])
    assert result.profile.settings.n_gpu_layers == max(ok) or result.profile.settings.n_gpu_layers in ok
    assert result.profile.engine.name == "llama-cpp"
    # the memory each trial used was read from llama-bench's own log
    import optuna

    trials = optuna.load_study(study_name=result.study_name, storage=result.storage).trials
    assert any(device in t.user_attrs.get("actual", {}) for t in trials if t.user_attrs.get("outcome") == "ok")


def test_cli_tune_and_probe_with_llama_bin(models, llama_bin, tuner_home):
    out = CliRunner().invoke(cli, ["probe", "--llama-bin", str(llama_bin), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["engine"]["engine"] == "llama-cpp" and data["engine"]["path"] == str(llama_bin)
    engines = {e["name"]: e for e in data["engines"]}
    assert set(engines) == {"python", "llama-cpp"}
    assert engines["llama-cpp"]["build"] == engines["python"]["build"]  # the same sources
    assert set(engines["llama-cpp"]["tools"]) == {"llama-bench", "llama-fit-params", "llama-batched-bench"}
    out = CliRunner().invoke(cli, ["tune", str(models["q8_0"]), "--llama-bin", str(llama_bin), "--trials", "2",
                                   "--min-ctx", "512", "--n-prompt", "32", "--n-gen", "8", "-r", "1"])
    assert out.exit_code == 0, out.output
    assert "measured with: llama-cpp engine, llama.cpp " in out.output
    assert "(accepted by your binaries' own parser: llama-fit-params)" in out.output
    path = next(line.split(": ", 1)[1] for line in out.output.splitlines() if line.startswith("profile: "))
    shown = CliRunner().invoke(cli, ["profile", "show", path])
    assert shown.exit_code == 0 and f"llama.cpp your binaries ({llama_bin}), build " in shown.output
