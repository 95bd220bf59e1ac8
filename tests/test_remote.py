"""inspect and estimate on a URL: only the header is fetched, with range requests, from a real
HTTP server on 127.0.0.1; the answer equals the local file's; bad servers get one clear line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.main import cli
from tuner.model import header_cache
from tuner.model.gguf import header_info

from .range_server import ModelServer


@pytest.fixture
def served(models, tmp_path):
    """A server over a folder holding the test models (whole, quantized and split)."""
    root = tmp_path / "www"
    (root / "split").mkdir(parents=True)
    for key in ("f16", "q4_k_m"):
        shutil.copy(models[key], root / models[key].name)
    for part in sorted(models["split"].parent.glob("*.gguf")):
        shutil.copy(part, root / "split" / part.name)
    server = ModelServer(root).start()
    yield server
    server.stop()


def run(*args: str, env: dict[str, str] | None = None):
    result = CliRunner().invoke(cli, list(args), env=env)
    return result


def _without_remote(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in ("path", "fetched")}


def test_url_answer_equals_the_local_answer(served, models):
    local = run("inspect", str(models["q4_k_m"]), "--json")
    remote = run("inspect", served.url(models["q4_k_m"].name), "--json")
    assert local.exit_code == 0 and remote.exit_code == 0, remote.output
    a, b = json.loads(local.stdout), json.loads(remote.stdout)
    assert b["path"] == served.url(models["q4_k_m"].name) and "fetched" not in a
    assert _without_remote(a) == _without_remote(b)
    assert b["file_size"] == models["q4_k_m"].stat().st_size
    # the text answer is the same too; what was fetched is said on stderr
    assert run("inspect", served.url(models["q4_k_m"].name)).stdout == run("inspect", str(models["q4_k_m"])).stdout
    assert "HTTP request" in remote.stderr and "of the file" in remote.stderr


def test_estimate_on_a_url_equals_the_local_estimate(served, models):
    args = ["--free", "3", "--margin", "0", "--ctx", "2048", "--json"]
    local = run("estimate", str(models["f16"]), *args)
    remote = run("estimate", served.url(models["f16"].name), *args)
    assert local.exit_code == 0 and remote.exit_code == 0, remote.output
    assert json.loads(local.stdout) == json.loads(remote.stdout)
    assert json.loads(remote.stdout)["max_gpu_layers"] >= 1


def test_split_model_reads_every_part(served, models):
    parts = sorted(models["split"].parent.glob("*.gguf"))
    assert len(parts) > 1
    second = served.url(f"split/{parts[1].name}")  # any part names the model
    remote = run("inspect", second, "--json")
    assert remote.exit_code == 0, remote.output
    local = json.loads(run("inspect", str(parts[1]), "--json").stdout)
    data = json.loads(remote.stdout)
    assert _without_remote(data) == _without_remote(local)
    assert data["split_count"] == len(parts)
    assert [p["url"] for p in data["fetched"]["parts"]] == [served.url(f"split/{p.name}") for p in parts]
    assert data["file_size"] == sum(p.stat().st_size for p in parts) == data["fetched"]["size"]
    assert "of 3 parts" in remote.stderr


def test_only_the_header_is_read(served, models):
    path = models["f16"]
    header_len = header_info(path)["header_len"]
    data = json.loads(run("inspect", served.url(path.name), "--json").stdout)
    fetched = data["fetched"]
    sent = sum(r.bytes_sent for r in served.requests)
    assert fetched["bytes_read"] == sent
    assert header_len <= fetched["bytes_read"] < 0.05 * path.stat().st_size
    assert fetched["parts"][0]["header_bytes"] == header_len
    # every request asked for a range, and none began past the header (no tensor data)
    for r in served.requests:
        assert r.headers["Range"].startswith("bytes=") and int(r.headers["Range"][6:].split("-")[0]) < header_len


def test_a_header_larger_than_the_first_range_is_fetched_in_growing_ranges(tmp_path):
    from tuner.testing import ModelShape, make_model

    # a 20000-token vocabulary makes a header of a few hundred KiB: several ranges
    path = make_model(tmp_path / "www" / "big-vocab.gguf",
                      ModelShape(n_layer=2, n_embd=64, n_head=2, n_head_kv=2, n_ff=128, n_vocab=20000))
    header_len = header_info(path)["header_len"]
    assert header_len > 4 * 65536
    server = ModelServer(path.parent).start()
    try:
        result = run("inspect", server.url(path.name), "--json")
        assert result.exit_code == 0, result.output
        assert _without_remote(json.loads(result.stdout)) == _without_remote(json.loads(run("inspect", str(path), "--json").stdout))
        ranges = [tuple(int(x) for x in r.headers["Range"][6:].split("-")) for r in server.requests]
        sizes = [end - start + 1 for start, end in ranges]
        assert len(ranges) >= 3 and sizes == sorted(sizes)  # growing
        assert all(start == prev_end + 1 for (start, _), (_, prev_end) in zip(ranges[1:], ranges))  # contiguous
        assert sum(sizes) < 2 * header_len + 65536
    finally:
        server.stop()


def test_hf_url_follows_the_redirect_to_another_host_with_the_range_kept(served, models, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", served.endpoint)
    name = models["q4_k_m"].name
    result = run("inspect", f"hf://someone/tiny-GGUF/{name}", "--json")
    assert result.exit_code == 0, result.output
    assert _without_remote(json.loads(result.stdout)) == _without_remote(json.loads(run("inspect", str(models["q4_k_m"]), "--json").stdout))
    resolve = [r for r in served.requests if "/resolve/" in r.path]
    files = [r for r in served.requests if r.path.startswith("/files/")]
    assert resolve[0].path == f"/someone/tiny-GGUF/resolve/main/{name}" and resolve[0].status == 302
    assert files and all(r.status == 206 and r.headers["Host"].startswith("localhost:") for r in files)
    assert resolve[0].headers["Range"] == files[0].headers["Range"]


def test_hf_revision(served, models, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", served.endpoint)
    name = models["q4_k_m"].name
    assert run("inspect", f"hf://someone/tiny-GGUF@v1.0/{name}").exit_code == 0
    assert served.requests[0].path == f"/someone/tiny-GGUF/resolve/v1.0/{name}"
    bad = run("inspect", "hf://only-an-owner")
    assert bad.exit_code == 2 and "expected hf://OWNER/REPO/FILE.gguf" in bad.stderr


def test_token_goes_to_the_hub_only_and_is_never_printed_or_stored(served, models, monkeypatch, tuner_home):
    monkeypatch.setenv("HF_ENDPOINT", served.endpoint)
    name = models["q4_k_m"].name
    monkeypatch.delenv("HF_TOKEN", raising=False)
    refused = run("inspect", f"hf://private/repo/{name}")
    assert refused.exit_code == 2
    assert refused.stderr.strip() == (f"Error: hf://private/repo/{name}: HTTP 401 Unauthorized: a private or gated repository? "
                                      "set HF_TOKEN to a token that can read it")
    served.requests.clear()
    monkeypatch.setenv("HF_TOKEN", served.token)
    ok = run("inspect", f"hf://private/repo/{name}", "--json")
    assert ok.exit_code == 0, ok.output
    resolve = [r for r in served.requests if "/resolve/" in r.path]
    files = [r for r in served.requests if r.path.startswith("/files/")]
    assert all(r.headers.get("Authorization") == f"Bearer {served.token}" for r in resolve)
    assert files and all("Authorization" not in r.headers for r in files)  # another host: dropped
    assert served.token not in ok.output
    for path in tuner_home.rglob("*"):
        if path.is_file():
            assert served.token.encode() not in path.read_bytes(), path
    # a URL on any other host than the Hub's never gets the token
    monkeypatch.setenv("HF_ENDPOINT", "https://hub.invalid")
    shutil.rmtree(tuner_home / "headers")
    served.requests.clear()
    assert run("inspect", served.url(name)).exit_code == 0
    assert served.requests and all("Authorization" not in r.headers for r in served.requests)


def test_the_cache_makes_the_second_question_free(served, models, monkeypatch):
    url = served.url(models["q4_k_m"].name)
    first = run("inspect", url, "--json")
    n = len(served.requests)
    assert n >= 1 and json.loads(first.stdout)["fetched"]["parts"][0]["cache"] == "miss"
    second = run("inspect", url, "--json")
    assert len(served.requests) == n  # no request at all
    data = json.loads(second.stdout)
    assert data["fetched"]["requests"] == 0 and data["fetched"]["parts"][0]["cache"] == "hit"
    assert _without_remote(data) == _without_remote(json.loads(first.stdout))
    assert "from the cache, no request" in second.stderr
    # estimate shares the cache
    assert run("estimate", url, "-ngl", "2").exit_code == 0 and len(served.requests) == n


def test_an_old_cache_entry_costs_one_conditional_request(served, models, monkeypatch):
    url = served.url(models["q4_k_m"].name)
    run("inspect", url)
    monkeypatch.setattr(header_cache, "FRESH_SECONDS", 0)
    served.requests.clear()
    again = run("inspect", url, "--json")
    assert again.exit_code == 0, again.output
    assert len(served.requests) == 1
    r = served.requests[0]
    assert r.headers["Range"] == "bytes=0-0" and r.headers["If-None-Match"] and r.status == 304
    assert json.loads(again.stdout)["fetched"]["parts"][0]["cache"] == "revalidated"


def test_a_changed_file_is_fetched_again(served, models, monkeypatch):
    target = served.root / "model.gguf"
    shutil.copy(models["q4_k_m"], target)
    url = served.url("model.gguf")
    assert json.loads(run("inspect", url, "--json").stdout)["quantization"] == "Q4_K_M"
    shutil.copy(models["f16"], target)  # a new file at the same URL: a new ETag
    os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))
    monkeypatch.setattr(header_cache, "FRESH_SECONDS", 0)
    data = json.loads(run("inspect", url, "--json").stdout)
    assert data["quantization"] == "F16" and data["fetched"]["parts"][0]["cache"] == "miss"


def test_an_hf_url_pinned_to_a_commit_is_never_checked_again(served, models, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", served.endpoint)
    url = f"hf://someone/tiny-GGUF@{'a' * 40}/{models['q4_k_m'].name}"
    assert run("inspect", url).exit_code == 0
    monkeypatch.setattr(header_cache, "FRESH_SECONDS", 0)
    served.requests.clear()
    assert run("inspect", url).exit_code == 0 and served.requests == []


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_server_that_ignores_ranges_is_refused_without_downloading(served, models):
    served.ranges = False
    started = time.monotonic()
    line = _one_line_error(run("inspect", served.url(models["f16"].name)))
    assert "ignored the range request" in line and "refusing to download it all" in line
    assert time.monotonic() - started < 60
    time.sleep(0.5)  # let the server notice the hang-up
    sent = served.requests[0].bytes_sent
    assert served.requests[0].aborted and sent < 64 << 20  # of 256 MiB + the file: the client hung up
    assert len(served.requests) == 1  # not retried


def test_404(served):
    url = served.url("nope.gguf")
    assert _one_line_error(run("inspect", url)) == f"Error: {url}: HTTP 404 Not Found: check the URL"


def test_truncated_header(served, models):
    data = models["f16"].read_bytes()
    (served.root / "cut.gguf").write_bytes(data[:5000])
    url = served.url("cut.gguf")
    line = _one_line_error(run("inspect", url))
    assert line.startswith(f"Error: {url}: truncated GGUF")


def test_truncated_tensor_data_uses_the_servers_size(served, models):
    data = models["f16"].read_bytes()
    (served.root / "cut.gguf").write_bytes(data[: len(data) - 1000])
    line = _one_line_error(run("estimate", served.url("cut.gguf"), "-ngl", "1"))
    assert "truncated GGUF: tensor output.weight ends at byte" in line


def test_a_slow_server_times_out(served, models):
    served.delay = 3.0
    started = time.monotonic()
    line = _one_line_error(run("inspect", served.url(models["f16"].name), env={"OFFLOAD_TUNER_HTTP_TIMEOUT": "0.5"}))
    elapsed = time.monotonic() - started
    assert "no answer within 0.5 s (3 tries)" in line and "OFFLOAD_TUNER_HTTP_TIMEOUT" in line
    assert len(served.requests) == 3 and elapsed < 30


def test_a_refused_connection_is_one_line(served):
    port = served.port
    served.stop()
    line = _one_line_error(run("inspect", f"http://127.0.0.1:{port}/files/x.gguf", env={"OFFLOAD_TUNER_HTTP_TIMEOUT": "2"}))
    assert "cannot connect to 127.0.0.1" in line and "3 tries" in line
    served.start()  # for the fixture's stop


def test_commands_that_run_the_model_refuse_a_url(served, models):
    line = _one_line_error(run("bench", served.url(models["f16"].name)))
    assert "needs the file on disk; download it first" in line


def test_error_is_one_line_from_a_real_process(served):
    url = served.url("missing.gguf")
    proc = subprocess.run([sys.executable, "-m", "tuner", "inspect", url], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OFFLOAD_TUNER_HOME": str(Path(served.root).parent / "home")})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"Error: {url}: HTTP 404 Not Found: check the URL"
