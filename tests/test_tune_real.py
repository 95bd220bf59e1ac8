"""The tune loop on the real llama.cpp: a CPU tune end to end, Ctrl-C and resume, and a tune against
a capped RPC device that finds where the memory runs out and launches nothing beyond it once it knows."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.model.estimate import CPU
from tuner.profile.document import Profile
from tuner.search.study import Tuner
from tuner.testing import ModelShape, make_model

MiB = 1 << 20


def test_cli_tune_on_the_cpu_writes_a_profile(models, tuner_home):
    out = CliRunner().invoke(cli, ["tune", str(models["q8_0"]), "--variant", str(models["q4_k_m"]), "--trials", "3",
                                   "--min-ctx", "512", "--n-prompt", "64", "--n-gen", "16", "-r", "2", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["trials"]["run"] == 3
    assert "n_gpu_layers" in data["excluded_dimensions"]  # no GPU here, and it says so
    profile = Profile.from_dict(json.loads(open(data["profile_path"]).read()))
    # the winner's two repetitions, or more when it was measured again beside a contender within noise
    # (none is when the leader is clear: issue 24)
    assert profile.measured.tg.median > 0 and len(profile.measured.tg.samples) >= 2
    assert profile.layers_total == 5 and profile.layers_offloaded == 0
    assert "CPU" in profile.memory.actual
    # profile list and show read it
    listing = CliRunner().invoke(cli, ["profile", "list"])
    assert listing.exit_code == 0 and profile.name in listing.output
    shown = CliRunner().invoke(cli, ["profile", "show", data["profile_path"], "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["settings"] == data["profile"]["settings"]


def test_tune_finds_where_a_capped_device_runs_out_and_stays_below(tmp_path, rpc_servers, tuner_home):
    model = make_model(tmp_path / "m.gguf", ModelShape(n_layer=6, n_embd=512, n_head=8, n_head_kv=8, n_ff=2048, n_vocab=4096))
    (server,) = rpc_servers(1, memory_limits=[40 * MiB])
    events = []
    tuner = Tuner(str(model), trials=8, min_ctx=512, n_prompt=64, n_gen=8, repetitions=1, final_repetitions=1,
                  vram_margin=0, rpc_servers=(server.endpoint,), on_event=events.append,
                  space_overrides={"kv_types": ("f16",), "flash_attn": ("on",), "threads": (2,), "n_ubatch": (512,),
                                   "placements": ("none",), "offload_kqv": (True,), "n_ctx": (512,)})
    assert tuner.space.dimensions() == {"n_gpu_layers": (0, 7)}
    result = tuner.run()
    device = f"RPC0[{server.endpoint}]"
    launched = [e for e in events if e["kind"] == "launch"]
    outcomes = {e["number"]: e for e in events if e["kind"] == "result"}
    ok = sorted(l["settings"]["n_gpu_layers"] for l in launched if outcomes[l["number"]]["outcome"] == "ok")
    oom = sorted(l["settings"]["n_gpu_layers"] for l in launched if outcomes[l["number"]]["outcome"] == "oom")
    assert ok and oom, (ok, oom)
    boundary = max(ok)
    assert boundary < min(oom)  # everything that fit lies below everything that did not
    # once an OOM is known, nothing needing as much on that device is launched
    first = next(i for i, l in enumerate(launched) if outcomes[l["number"]]["outcome"] == "oom")
    need = lambda l: tuner.candidates.estimate(tuner.space.settings(  # noqa: E731
        variant=l["settings"]["model_path"], n_gpu_layers=l["settings"]["n_gpu_layers"], n_ctx=512, kv="f16",
        flash_attn="on", threads=2, n_ubatch=512, n_batch=512)).devices[device].total
    threshold = need(launched[first])
    assert all(need(l) < threshold for l in launched[first + 1:])
    # every value between 0 and the boundary was measured or answered; the one above it failed or was skipped
    pruned = [e for e in events if e["kind"] == "pruned"]
    assert all(e["reason"].startswith("learned") for e in pruned)
    assert set(range(boundary + 1)) <= set(ok) | {0}
    assert boundary + 1 in set(oom) | {e["settings"]["n_gpu_layers"] for e in pruned}
    assert result.counts["oom"] == len(oom)
    # the profile's own trial fit on the device
    assert result.profile.settings.n_gpu_layers <= boundary
    assert result.profile.memory.predicted[CPU].total > 0


def test_ctrl_c_stops_the_trial_writes_the_best_so_far_and_the_rerun_resumes(models, tuner_home, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    cmd = [sys.executable, "-m", "tuner", "tune", str(models["q8_0"]), "--trials", "40", "--min-ctx", "512",
           "--n-prompt", "64", "--n-gen", "64", "-r", "3", "--out", str(tmp_path / "p.json")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        lines.append(line)
        if line.startswith("[3/40]"):  # two trials done, the third running
            break
    workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(lines) + err  # interrupted, as a shell reports Ctrl-C
    assert "interrupted" in err and "Traceback" not in err
    assert (tmp_path / "p.json").exists()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in workers)
    first = Profile.from_dict(json.loads((tmp_path / "p.json").read_text()))
    assert 2 <= first.trials.run <= 3
    # the same command again resumes the study
    again = subprocess.run(cmd[:6] + ["4"] + cmd[7:], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resumed" in again.stderr
    second = Profile.from_dict(json.loads((tmp_path / "p.json").read_text()))
    assert second.trials.run == 4
