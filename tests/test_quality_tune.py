"""Tuning with quality on the real llama.cpp: a budget that leaves a variant out, a speed target won by
quality, a target nobody reaches, the trade printed at the end, and what the profile and the study keep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.profile.document import SCHEMA_VERSION, Profile
from tuner.search.quality import quality
from tuner.search.study import Tuner
from tuner.testing import ModelShape, make_model, quantize

SHAPE = ModelShape(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512, n_ctx_train=2048)
QUALITY = dict(chunks=4, quality_ctx=64)
# a small study: one thread count, one KV type... so a handful of trials covers what matters here
FAST = dict(min_ctx=256, n_prompt=64, n_gen=16, repetitions=1, final_repetitions=6, final_rounds=1,
            space_overrides={"kv_types": ("f16",), "flash_attn": ("on",), "threads": (1,), "n_ubatch": (256,),
                             "placements": ("none",), "n_ctx": (256,)})


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tune-family")
    f32 = make_model(folder / "tf-F32.gguf", SHAPE, dtype="F32", output_std=0.4)
    return {"F32": f32, "Q8_0": quantize(f32, folder / "tf-Q8_0.gguf", "Q8_0"),
            "Q4_K_M": quantize(f32, folder / "tf-Q4_K_M.gguf", "Q4_K_M")}


def test_a_budget_that_excludes_q4_k_m_makes_q8_0_win(family, tuner_home, tmp_path):
    import optuna

    measured = quality(family["F32"], variants=[family["Q8_0"], family["Q4_K_M"]], n_ctx=64, chunks=4)
    kl8, kl4 = measured.variants["tf-Q8_0.gguf"].kl_mean, measured.variants["tf-Q4_K_M.gguf"].kl_mean
    budget = (kl8 * kl4) ** 0.5  # between the two
    events: list[dict] = []
    tuner = Tuner(str(family["Q4_K_M"]), variants=[str(family["Q8_0"])], reference=str(family["F32"]), max_kl=budget,
                  trials=2, on_event=events.append, **QUALITY, **FAST)
    # quality came first, from the cache the quality() call above filled: nothing scored again
    assert not [e for e in events if e["kind"] == "quality_pass"]
    assert {e["kind"] for e in events} >= {"quality_reference", "quality_variant", "quality_excluded"}
    assert list(tuner.excluded) == [str(family["Q4_K_M"])]
    assert "--max-kl" in tuner.excluded[str(family["Q4_K_M"])] and f"{kl4:.6f}" in tuner.excluded[str(family["Q4_K_M"])]
    result = tuner.run()
    launched = [e["settings"]["model_path"] for e in events if e["kind"] == "launch"]
    assert launched and set(launched) == {str(family["Q8_0"])}  # Q4_K_M was never launched for speed
    profile = Profile.from_dict(json.loads(result.profile_path.read_text()))
    assert Path(profile.settings.model_path).name == "tf-Q8_0.gguf"
    assert profile.schema_version == SCHEMA_VERSION
    assert profile.quality is not None and profile.quality.kl_mean == pytest.approx(kl8)
    assert profile.quality.reference_file == "tf-F32.gguf" and profile.quality.reference_sha256 == measured.reference_sha256
    assert (profile.quality.n_ctx, profile.quality.chunks, profile.quality.corpus_sha256) == (64, 4, measured.corpus_sha256)
    assert profile.quality_budget is not None and profile.quality_budget.max_kl == budget
    assert profile.quality_budget.target_met is None
    # the study keeps each variant's quality (the HTML report reads these)
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    assert study.user_attrs["quality"]["variants"]["tf-Q4_K_M.gguf"]["kl"]["mean"] == pytest.approx(kl4)
    assert study.user_attrs["quality_budget"]["max_kl"] == budget
    trial_quality = [t.user_attrs["quality"] for t in study.trials if "quality" in t.user_attrs]
    assert trial_quality and all(q["file_name"] == "tf-Q8_0.gguf" and q["kl_mean"] == pytest.approx(kl8) for q in trial_quality)
    # the output says which variant was left out and why
    assert result.to_dict()["over_budget"] == tuner.excluded
    assert [r["variant"] for r in result.trade] == ["tf-Q8_0.gguf", "tf-Q4_K_M.gguf"]
    assert result.trade[1]["excluded"] and result.trade[1]["best"] is None
    # the HTML report draws speed against quality from these attributes
    from tuner.report.html import write_report

    html = write_report(result.study_name, out=tmp_path / "r.html", storage=result.storage).path.read_text()
    assert 'id="speed-vs-quality"' in html and 'id="speed-vs-quality-note"' not in html


def test_a_speed_target_is_won_by_the_highest_quality_variant(family, tuner_home):
    # every configuration reaches 0.01 t/s: then quality decides, not speed
    result = Tuner(str(family["Q4_K_M"]), variants=[str(family["Q8_0"])], min_tg=0.01, trials=4, **QUALITY, **FAST).run()
    assert Path(result.profile.settings.model_path).name == "tf-Q8_0.gguf"  # the reference here: KL 0
    assert result.target["met"] is True and result.target["min_tg"] == 0.01
    assert result.profile.quality_budget.min_tg == 0.01 and result.profile.quality_budget.target_met is True


def test_cli_min_tg_above_anything_reachable_says_so(family, tuner_home, tmp_path):
    out = CliRunner().invoke(cli, ["tune", str(family["Q4_K_M"]), "--variant", str(family["Q8_0"]), "--min-tg", "1000000",
                                   "--trials", "2", "--min-ctx", "256", "--n-prompt", "32", "--n-gen", "8", "-r", "1",
                                   "--chunks", "4", "--ctx", "64", "--out", str(tmp_path / "p.json")])
    assert out.exit_code == 0, out.output
    assert "no configuration reaches the target" in out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("target"))
    assert "--min-tg 1e+06 t/s: NOT reached" in line and "best speed found: tg" in line
    profile = Profile.from_dict(json.loads((tmp_path / "p.json").read_text()))
    assert profile.quality_budget.min_tg == 1e6 and profile.quality_budget.target_met is False


def test_cli_tune_with_no_budget_ends_with_the_trade(tmp_path, tuner_home):
    source = make_model(tmp_path / "trade-F16.gguf", SHAPE, output_std=0.4)
    args = ["tune", str(source), "--quantize", "Q8_0,Q4_K_M", "--trials", "4", "--min-ctx", "256", "--n-prompt", "32",
            "--n-gen", "8", "-r", "1", "--chunks", "4", "--ctx", "64"]
    out = CliRunner().invoke(cli, args)
    assert out.exit_code == 0, out.output
    assert "quantizing to Q8_0 (1/2)" in out.stderr and "quantizing to Q4_K_M (2/2)" in out.stderr
    table = out.stdout[out.stdout.index("the trade"):]
    assert "quality against trade-F16.gguf" in table
    assert all(name in table for name in ("trade-F16.gguf", "trade-Q8_0.gguf", "trade-Q4_K_M.gguf"))
    # again, as JSON: the variants are reused, and each row has its best speed and its quality
    data = json.loads(CliRunner().invoke(cli, args + ["--json"]).stdout)
    rows = {r["variant"]: r for r in data["trade"]}
    assert set(rows) == {"trade-F16.gguf", "trade-Q8_0.gguf", "trade-Q4_K_M.gguf"}
    assert rows["trade-F16.gguf"]["quality"]["kl_mean"] == 0.0
    assert rows["trade-Q8_0.gguf"]["quality"]["kl_mean"] < rows["trade-Q4_K_M.gguf"]["quality"]["kl_mean"]
    assert any(r["best"] and r["best"]["tg"] > 0 for r in rows.values())
    # the winner's variant shows re-measured figures, not a luckier first measurement of another candidate
    winner = next(r for r in data["trade"] if r["path"] == data["best"]["settings"]["model_path"])
    if data["best"]["remeasured"]:
        assert winner["best"]["remeasured"] is True
    else:
        # the leader was clear of the others by more than the noise, so it was not measured again
        # (issue 24): its variant's row is the winner's own trial, not another candidate's
        assert winner["best"]["number"] == data["best"]["number"]
    assert data["quality"]["cache"]["reused"] is True and data["over_budget"] == {}
    assert data["profile"]["quality"]["reference"]["file_name"] == "trade-F16.gguf"
