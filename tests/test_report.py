"""The HTML report of a real tune (real llama.cpp, a capped RPC device, two quantizations), opened
in a real headless Chromium: no console error, every plot drawn, a screenshot saved."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.testing import ModelShape, make_model, quantize

from .browser import open_page, screenshot

MiB = 1 << 20
PLOTS = ("speed-vs-layers", "speed-vs-memory", "speed-vs-quality", "history", "importances")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A real tune: F16 and Q8_0 of one model on an RPC device capped at 40 MiB, so some
    placements run out of memory there. Its study lives in its own SQLite file."""
    from tuner.engine.rpc import start_servers
    from tuner.search.study import Tuner

    folder = tmp_path_factory.mktemp("tuned")
    old_home = os.environ.get("OFFLOAD_TUNER_HOME")
    os.environ["OFFLOAD_TUNER_HOME"] = str(folder / "home")
    shape = ModelShape(n_layer=6, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=4096)
    model = make_model(folder / "m-F16.gguf", shape)
    variant = quantize(model, folder / "m-Q8_0.gguf", "Q8_0")
    storage = f"sqlite:///{folder / 'studies.db'}"
    (server,) = start_servers(1, threads=1, memory_limits=[40 * MiB])
    try:
        # measure_quality=False: this study stands for one without quality (the plot's note is tested)
        result = Tuner(str(model), variants=[str(variant)], trials=8, min_ctx=512, n_prompt=64, n_gen=8, repetitions=1,
                       final_repetitions=4, final_rounds=2, vram_margin=0, rpc_servers=(server.endpoint,), storage=storage,
                       out=folder / "profile.json", measure_quality=False,
                       space_overrides={"kv_types": ("f16", "q8_0"), "flash_attn": ("on",), "threads": (2,),
                                        "n_ubatch": (512,), "placements": ("none",), "offload_kqv": (True,),
                                        "n_ctx": (512,)}).run()
    finally:
        server.stop()
        if old_home is None:
            os.environ.pop("OFFLOAD_TUNER_HOME", None)
        else:
            os.environ["OFFLOAD_TUNER_HOME"] = old_home
    return {"folder": folder, "model": model, "variant": variant, "storage": storage, "result": result,
            "profile": folder / "profile.json"}


def _with_quality(tuned, tmp_path) -> str:
    """A copy of the study with each variant's quality in the attribute ``tuner.search.quality``
    documents. The KL figures are stand-ins (this test is about drawing them, not measuring them)."""
    import optuna

    db = tmp_path / "with-quality.db"
    shutil.copy(tuned["folder"] / "studies.db", db)
    storage = f"sqlite:///{db}"
    study = optuna.load_study(study_name=tuned["result"].study_name, storage=storage)
    study.set_user_attr("quality", {"variants": {
        "m-F16.gguf": {"kl": {"mean": 0.0, "ci_low": 0.0, "ci_high": 0.0}, "ppl_ratio": 1.0},
        "m-Q8_0.gguf": {"kl": {"mean": 0.0021, "ci_low": 0.0018, "ci_high": 0.0024}, "ppl_ratio": 1.0012},
    }})
    return storage


def _cliffs(storage: str, name: str) -> dict[str, int]:
    """From the study itself: per variant, the fewest GPU layers that ran out of memory."""
    import optuna

    out: dict[str, int] = {}
    for t in optuna.load_study(study_name=name, storage=storage).get_trials():
        if t.user_attrs.get("outcome") == "oom" and "duplicate_of" not in t.user_attrs:
            variant = Path(t.user_attrs["settings"]["model_path"]).name
            out[variant] = min(out.get(variant, 99), t.user_attrs["settings"]["n_gpu_layers"])
    return out


def test_report_opens_offline_in_chromium_with_every_plot(tuned, tmp_path):
    storage = _with_quality(tuned, tmp_path)
    out, pngs = tmp_path / "report.html", tmp_path / "png"
    result = CliRunner().invoke(cli, ["report", str(tuned["model"]), "--storage", storage, "-o", str(out), "--png", str(pngs)])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(out)
    text = out.read_text(encoding="utf-8")
    # self-contained: no script, style sheet, image or frame from anywhere else
    assert not re.search(r"<(script|link|img|iframe)\b[^>]*\b(src|href)\s*=", text, re.IGNORECASE)

    page = open_page(out, tmp_path)
    assert page.console == [] and page.network == []
    for plot in PLOTS:
        div = re.search(rf'<div id="{plot}"[^>]*class="([^"]*)"', page.dom)
        assert div and "js-plotly-plot" in div.group(1), plot  # plotly drew it
        section = page.dom.split(f'id="{plot}"', 1)[1].split("</section>", 1)[0]
        assert "main-svg" in section, plot
    cliffs = _cliffs(storage, tuned["result"].study_name)
    assert cliffs, "the capped device should have run out of memory at least once"
    for variant, layers in cliffs.items():
        assert f"{variant}: out of memory from {layers} layers" in page.dom
    assert "Pareto front" in page.dom and "winner" in page.dom
    # given a model, not a profile: the winner is the study's best trial, as first measured
    import optuna

    best = optuna.load_study(study_name=tuned["result"].study_name, storage=storage).best_trial
    assert f"n_gpu_layers={best.user_attrs['settings']['n_gpu_layers']}" in page.dom and f"(trial #{best.number})" in page.dom

    shot = screenshot(out, tmp_path / "report.png", tmp_path)
    assert shot.read_bytes()[:8] == PNG_MAGIC and shot.stat().st_size > 50_000
    written = sorted(p.name for p in pngs.iterdir())
    assert written == sorted(f"{p}.png" for p in PLOTS), (written, result.stderr)
    assert all(p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5_000 for p in pngs.iterdir())


def test_the_console_check_catches_errors_and_network_use(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text('<html><head><script src="https://cdn.example.org/plotly.min.js"></script></head><body>'
                   '<script>console.error("boom"); notDefined();</script></body></html>')
    page = open_page(bad, tmp_path)
    assert any("boom" in m for m in page.console)
    assert any("notDefined" in m for m in page.console)
    assert any("cdn.example.org" in line for line in page.network)


def test_report_by_profile_and_by_study_name(tuned, tmp_path):
    by_profile = CliRunner().invoke(cli, ["report", str(tuned["profile"]), "--storage", tuned["storage"], "-o",
                                          str(tmp_path / "a.html")])
    assert by_profile.exit_code == 0, by_profile.output
    by_name = CliRunner().invoke(cli, ["report", tuned["result"].study_name, "--storage", tuned["storage"], "-o",
                                       str(tmp_path / "b.html")])
    assert by_name.exit_code == 0, by_name.output
    a, b = (tmp_path / "a.html").read_text(), (tmp_path / "b.html").read_text()
    for plot in ("speed-vs-layers", "speed-vs-memory", "history", "importances"):
        assert f'id="{plot}"' in a and f'id="{plot}"' in b
    # without quality in the study, that plot says why it is missing
    assert 'id="speed-vs-quality-note"' in a and "quality was not measured" in a
    assert "speed-vs-quality: not drawn: quality was not measured" in by_profile.stderr
    # the profile's winner, with the confidence interval it was chosen on
    tg = json.loads(tuned["profile"].read_text())["measured"]["tg"]
    assert f"{tg['median']:.1f} t/s (95% CI {tg['ci_low']:.1f}-{tg['ci_high']:.1f}" in a


def test_tune_report_writes_it_at_the_end(models, tuner_home):
    out = CliRunner().invoke(cli, ["tune", str(models["q8_0"]), "--trials", "2", "--min-ctx", "512", "--n-prompt", "32",
                                   "--n-gen", "8", "-r", "1", "--report"])
    assert out.exit_code == 0, out.output
    line = next(l for l in out.stdout.splitlines() if l.startswith("report: "))
    path = Path(line[len("report: "):])
    assert path.parent == tuner_home / "reports" and path.exists()
    assert 'id="history"' in path.read_text()
    # where the time went: printed at the end, and in the report's summary
    spent = next(l for l in out.stdout.splitlines() if l.startswith("time: "))
    assert "loading" in spent and "measuring" in spent and "re-measuring" in spent
    assert "<td>time</td>" in path.read_text() and "loading" in path.read_text()


def _one_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_study_that_does_not_exist(tuned, tmp_path):
    line = _one_line(CliRunner().invoke(cli, ["report", "no-such-study", "--storage", tuned["storage"], "-o",
                                              str(tmp_path / "r.html")]))
    assert line.startswith("Error: no study or profile named 'no-such-study'")
    assert tuned["result"].study_name in line  # it lists what is there
    assert not (tmp_path / "r.html").exists()


def test_no_study_at_all(tuner_home, tmp_path):
    line = _one_line(CliRunner().invoke(cli, ["report", "-o", str(tmp_path / "r.html")]))
    assert "no study in sqlite:///" in line and "run `offload-tuner tune` first" in line
    assert not (tuner_home / "studies" / "studies.db").exists()  # looking did not create one


def test_a_model_without_a_study(models, tuner_home, tmp_path):
    line = _one_line(CliRunner().invoke(cli, ["report", str(models["q4_k_m"]), "-o", str(tmp_path / "r.html")]))
    assert line.startswith(f"Error: no study of {models['q4_k_m'].name} in ")


def test_png_into_a_file_is_refused(tuned, tmp_path):
    (tmp_path / "x").write_text("")
    line = _one_line(CliRunner().invoke(cli, ["report", tuned["result"].study_name, "--storage", tuned["storage"], "-o",
                                              str(tmp_path / "r.html"), "--png", str(tmp_path / "x")]))
    assert line == f"Error: {tmp_path / 'x'}: not a folder (--png takes a folder for the PNG files)"
    assert not (tmp_path / "r.html").exists()  # refused before anything was written
