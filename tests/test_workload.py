"""Several users at once (issue 21): the workload, its objectives, the batched measurement on the real
llama.cpp (python engine and llama-batched-bench), the profile's workload and exports, and the warning
an app gets when it serves another number of users than the profile was tuned for."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.engine.base import BenchSpec, Stats, percentile
from tuner.engine.settings import Settings
from tuner.errors import SettingsError
from tuner.model.inspect import inspect
from tuner.profile.document import Profile, ProfileWarning
from tuner.search.objective import score, workload_figures

from .test_profile import profile_dict
from .test_study import machine


# -- the objectives ------------------------------------------------------------------------------------


def test_objectives_read_the_workload():
    bench = BenchSpec(n_prompt=100, n_gen=10, users=4, min_user_tg=20.0)
    fast_but_unfair = Stats.of([70.0, 72.0, 74.0])  # 18 t/s per user: below the floor
    fair = Stats.of([81.0, 82.0, 83.0])  # 20.5 t/s per user
    pp = Stats.of([400.0, 800.0, 1000.0])
    # aggregate: a candidate below the per-user floor ranks below every one that reaches it
    assert score("aggregate", pp, fair, bench) == 82.0
    assert score("aggregate", pp, fast_but_unfair, bench) == pytest.approx(18.0)
    assert score("per-user", pp, fair, bench) == pytest.approx(20.5)
    assert score("tg", pp, fair, bench) == 82.0
    # ttft: 4 prompts of 100 tokens processed together: 1.0, 0.5, 0.4 s; p95 interpolates the two slowest
    ttft = bench.ttft(pp)
    assert sorted(ttft.samples) == pytest.approx([0.4, 0.5, 1.0])
    assert percentile(ttft.samples, 95) == pytest.approx(0.95)
    assert score("ttft", pp, fair, bench) == pytest.approx(400 / 0.95)
    figures = workload_figures(pp, fair, bench)
    assert figures["per_user_tg"]["median"] == pytest.approx(20.5) and figures["aggregate_tg"]["median"] == 82.0
    assert figures["ttft_s"]["p50"] == pytest.approx(0.5)
    # one user with no floor writes the spec it always did (a study keeps its name)
    assert BenchSpec().to_dict() == {"n_prompt": 512, "n_gen": 128, "depth": 0, "repetitions": 3, "warmup": True, "seed": 1234}


def test_a_floor_needs_the_aggregate_objective_and_users_are_bounded(models):
    from tuner.engine.fake import ScriptedRunner
    from tuner.search.study import Tuner

    engine = ScriptedRunner({str(models["q8_0"]): inspect(models["q8_0"])})
    with pytest.raises(SettingsError, match="^min_user_tg: a per-user floor applies to the aggregate objective"):
        Tuner(str(models["q8_0"]), objective="tg", min_user_tg=5.0, machine=machine(), engine=engine, min_ctx=512, n_prompt=64, n_gen=16)
    with pytest.raises(SettingsError, match=r"^users: expected a count of users from 1 to 256, got 0"):
        Tuner(str(models["q8_0"]), users=0, machine=machine(), engine=engine, min_ctx=512, n_prompt=64, n_gen=16)
    result = CliRunner().invoke(cli, ["tune", str(models["q8_0"]), "--users", "4,x"])
    assert result.exit_code == 2 and "--users" in result.output


# -- measured as llama.cpp serves ---------------------------------------------------------------------------


def test_the_python_engine_decodes_several_sequences_in_one_batch(models):
    from tuner.engine.python import TrialRunner

    s = Settings(model_path=str(models["q8_0"]), n_ctx=1024, n_threads=2, n_parallel=4)
    with TrialRunner() as runner:
        result = runner.run(s, BenchSpec(n_prompt=32, n_gen=8, depth=16, repetitions=2, users=4))
        assert result.ok, result.message
        assert "n_seq_max             = 4" in result.log and "n_ctx_seq             = 256" in result.log
        assert len(result.pp.samples) == 2 and len(result.tg.samples) == 2 and min(result.tg.samples) > 0
        # each user's share of the context (1024 / 4 = 256) must hold depth + prompt + generated tokens
        small = runner.run(s, BenchSpec(n_prompt=200, n_gen=60, depth=16, repetitions=1, users=4))
        assert small.outcome.value == "bad_settings"
        assert "4 users x (depth 16 + 200 prompt + 60 generated tokens) exceed n_ctx 1024 (256 per sequence)" in small.message


def test_one_user_among_several_counts_is_measured_as_batched_bench_measures_it(models):
    """A users table or curve measures its one-user point as llama-batched-bench's -npl 1 row
    (generation after the prompt), not as llama-bench (generation at depth 0): one method along it."""
    from tuner.engine.python import TrialRunner

    s = Settings(model_path=str(models["q8_0"]), n_ctx=256, n_threads=2, n_parallel=1)
    with TrialRunner() as runner:
        # llama-bench's method runs the prompt and the generation each from an empty cache: both fit 256
        alone = runner.run(s, BenchSpec(n_prompt=200, n_gen=100, repetitions=1))
        assert alone.ok, alone.message
        served = runner.run(s, BenchSpec(n_prompt=200, n_gen=100, repetitions=1, batched=True))
        assert served.outcome.value == "bad_settings"
        assert "1 user x (depth 0 + 200 prompt + 100 generated tokens) exceed n_ctx 256" in served.message
    assert BenchSpec(batched=True).as_served and BenchSpec(users=2).as_served and not BenchSpec().as_served
    assert "batched" not in BenchSpec(users=2).to_dict()  # a study's name stays what it was
    # the table's one-user row goes the batched way (the same context error), the two-user row too
    result = CliRunner().invoke(cli, ["bench", str(models["q8_0"]), "-c", "256", "-t", "2", "--users", "1,2",
                                      "-p", "200", "-n", "100", "-r", "1", "--json"])
    rows = json.loads(result.output)["rows"]
    assert result.exit_code == 2 and rows[0]["outcome"] == "bad_settings", rows
    assert "1 user x (depth 0 + 200 prompt + 100 generated tokens) exceed n_ctx 256" in rows[0]["message"]


def test_the_llama_cpp_engine_measures_several_users_with_llama_batched_bench(models, llama_bin):
    from tuner.engine.llamacpp import LlamaCppEngine

    s = Settings(model_path=str(models["swa"]), n_ctx=2048, n_threads=2, n_parallel=2, kv_unified=True)
    with LlamaCppEngine(llama_bin) as engine:
        result = engine.run(s, BenchSpec(n_prompt=32, n_gen=8, repetitions=2, users=2))
        if engine.binaries.get("llama-batched-bench") is None:
            # said plainly, not measured some other way
            assert result.outcome.value == "bad_settings"
            assert "2 users are measured with llama-batched-bench" in result.message and "--engine python" in result.message
            pytest.skip(f"{llama_bin} has no llama-batched-bench (tuner.testing.build_llama_cpp_tools builds it)")
        assert result.ok, result.message
        assert len(result.pp.samples) == 2 and len(result.tg.samples) == 2  # the warm-up row dropped
        assert "kv_unified            = true" in result.log and "n_seq_max             = 2" in result.log
        at_depth = engine.run(s, BenchSpec(n_prompt=32, n_gen=8, depth=64, repetitions=1, users=2))
        assert at_depth.outcome.value == "bad_settings" and "no depth" in at_depth.message


def test_a_tune_for_several_users_without_llama_batched_bench_stops_before_any_trial(models, llama_bin, tmp_path, tuner_home):
    import shutil

    from tuner.engine.llamacpp import LlamaCppEngine
    from tuner.errors import StudyError
    from tuner.search.study import Tuner

    only_bench = tmp_path / "bin"
    only_bench.mkdir()
    shutil.copy2(Path(llama_bin) / "llama-bench", only_bench / "llama-bench")
    with LlamaCppEngine(only_bench) as engine:
        with pytest.raises(StudyError, match="^--users 2: the llama-cpp engine measures several users with llama-batched-bench"):
            Tuner(str(models["q8_0"]), users=2, machine=machine(), engine=engine, min_ctx=512, n_prompt=64, n_gen=16)


def test_bench_compares_counts_of_users(models):
    result = CliRunner().invoke(cli, ["bench", str(models["q8_0"]), "-c", "1024", "-t", "2", "--users", "1,2",
                                      "-p", "16", "-n", "4", "-r", "1", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["rows"]
    assert [r["users"] for r in rows] == [1, 2] and all(r["outcome"] == "ok" for r in rows)
    assert rows[1]["per_user_tg"]["median"] == pytest.approx(rows[1]["s_tg"] / 2)
    assert rows[1]["ttft_s"]["p50"] > 0


def test_estimate_takes_users(models):
    def kv(*extra):
        result = CliRunner().invoke(cli, ["estimate", str(models["swa"]), "-ngl", "0", "--ctx", "4096", "--json", *extra])
        assert result.exit_code == 0, result.output
        return json.loads(result.output)["devices"]["CPU"]["kv"]

    one, four, four_unified = kv(), kv("--users", "4"), kv("--users", "4", "--kv-unified")
    # the full-attention layer holds 4096 cells either way; each of the 7 window layers 4 windows
    # (256 + 512 padded: 768 cells each, 3072 for 4) instead of one, or 4 x 256 + 512 in one stream
    assert four > one and four_unified > one and four != four_unified


# -- the profile and its exports ----------------------------------------------------------------------------


def test_a_four_user_tune_writes_its_workload_and_exports_it(models, tuner_home):
    from tuner.engine.fake import ScriptedRunner
    from tuner.profile.exports import export_args
    from tuner.search.study import Tuner

    info = inspect(models["q8_0"])
    engine = ScriptedRunner({str(models["q8_0"]): info})
    tuner = Tuner(str(models["q8_0"]), trials=6, machine=machine(), engine=engine, users=4, objective="aggregate",
                  min_user_tg=1.0, min_ctx=512, n_prompt=64, n_gen=16, repetitions=2, final_repetitions=3, vram_margin=0)
    assert tuner.space.n_ctx[0] == 4 * 512 and "kv_unified" in tuner.space.dimensions()
    result = tuner.run()
    # the study's trials decode 4 sequences; only the knee's measurements at the end decode fewer
    curve_from = next(i for i, s in enumerate(engine.launched) if s.n_parallel != 4)
    assert {s.n_parallel for s in engine.launched[:curve_from]} == {4}
    assert all(s.n_ctx >= 4 * 512 for s in engine.launched[:curve_from])
    assert {s.n_parallel for s in engine.launched[curve_from:]} == {1, 2}
    profile = result.profile
    w = profile.workload
    assert (w.users, w.n_prompt, w.n_gen, w.depth, w.objective, w.min_user_tg) == (4, 64, 16, 0, "aggregate", 1.0)
    assert w.per_user_tg.median == pytest.approx(w.aggregate_tg.median / 4)
    assert w.ttft_s.p50 > 0 and profile.schema_version == "1.4"
    assert result.profile_path.name.endswith("--4users.json")
    line = export_args(profile, "llama-server")
    assert f"-np 4" in line and ("-kvu" in line) == profile.settings.kv_unified
    assert "OLLAMA_NUM_PARALLEL=4" in export_args(profile, "ollama")
    again = Profile.from_dict(json.loads(result.profile_path.read_text()))
    assert again.workload == w
    shown = CliRunner().invoke(cli, ["profile", "show", str(result.profile_path)])
    assert shown.exit_code == 0, shown.output
    assert "workload  4 user(s) at once, 64 prompt / 16 generated tokens at depth 0, objective aggregate" in shown.output
    assert f"aggregate tg {w.aggregate_tg.median:.1f} t/s" in shown.output and "at 2 user(s): aggregate" in shown.output
    # the knee: the winner (and the next contender) at 1, 2 and 4 users, 4 being the profile's own figures
    winner = sorted(p.users for p in w.curve if p.candidate == "winner")
    assert winner == [1, 2, 4]
    four = next(p for p in w.curve if p.candidate == "winner" and p.users == 4)
    assert four.aggregate_tg == w.aggregate_tg
    launched_at = {(s.n_parallel, s.n_ctx // s.n_parallel) for s in engine.launched}
    assert (1, profile.settings.n_ctx // 4) in launched_at and (2, profile.settings.n_ctx // 4) in launched_at
    import optuna

    from tuner.report.data import read_report_data
    from tuner.report.plots import users_curve

    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    plot = users_curve(read_report_data(study, profile))
    assert plot.figure is not None
    drawn = {(t.name, t.xaxis) for t in plot.figure.data}
    assert ("winner", "x") in drawn and ("winner", "x3") in drawn  # aggregate tg and time to first token


def test_an_older_profile_reads_as_one_user_and_is_written_back_unchanged():
    document = profile_dict()
    del document["workload"]
    for settings in (document["settings"], document["runner_up"]["settings"]):
        del settings["n_parallel"]
        for key in ("repack", "devices"):  # 1.4's other settings (the repack setting, the device list)
            settings.pop(key, None)
    document["schema_version"] = "1.3"
    profile = Profile.from_dict(document)
    assert profile.users == 1 and profile.workload is None and profile.settings.n_parallel == 1
    assert profile.to_dict() == json.loads(json.dumps(document))
    bad = profile_dict()
    bad["workload"]["users"] = 2
    with pytest.raises(Exception, match=r"^workload.users: expected settings.n_parallel \(1\), got 2"):
        Profile.from_dict(bad)


def test_an_app_serving_four_with_a_one_user_profile_is_told_the_memory(models):
    from tuner.profile.apps import serving_note

    document = profile_dict(n_ctx=8192)
    document["sizing"].update(sliding_window=1024, swa_layers=30)  # gemma-3-like: 30 of 36 layers slide
    profile = Profile.from_dict(document)
    note = serving_note(profile, 4)
    # KV per cell per layer 4096 bytes: one user holds 6 x 8192 + 30 x 1536 cells (192 MiB + 180 MiB);
    # four at -c 8192 hold the same 8192 full-attention cells and four windows (4 x 30 x 1536: +540 MiB)
    assert "tuned for 1 user(s)" in note and "-np 4" in note
    assert "with its -c 8192 each gets 2048 tokens and the KV cache changes by +540 MiB" in note
    # four at -c 32768: 6 x 32768 cells (+576 MiB over 8192) and the four windows (+540 MiB)
    assert "with -c 32768 (each user the 8192 tokens it was tuned with) by +1.09 GiB" in note
    assert serving_note(profile, 1) is None
    from tuner.profile.apps import _warn_users

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_users(profile, 4)
    assert [w.category for w in caught] == [ProfileWarning]
