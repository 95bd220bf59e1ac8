"""``offload-tuner mcp``: every tool answered through the official SDK's own client, over stdio, with
the server a real subprocess; a path outside the allowed folders refused."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("mcp.server.mcpserver")

ROOT = Path(__file__).resolve().parent.parent
LOGS = Path(__file__).resolve().parent / "logs"


def _text(result) -> str:
    return "".join(getattr(block, "text", "") for block in result.content)


def _data(result) -> dict:
    assert not result.is_error, _text(result)
    if result.structured_content:
        content = result.structured_content
        return content.get("result", content) if set(content) == {"result"} else content
    return json.loads(_text(result))


async def _session_run(allow: list[Path], steps):
    from mcp import ClientSession
    from mcp.client.stdio import StdioServerParameters, stdio_client

    env = {k: v for k, v in os.environ.items()}
    env["PYTHONPATH"] = str(ROOT)
    args = ["-m", "tuner", "mcp"] + [x for folder in allow for x in ("--allow", str(folder))]
    params = StdioServerParameters(command=sys.executable, args=args, env=env, cwd=str(ROOT))
    with open(os.devnull, "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                return await steps(session)


def run(allow, steps):
    import anyio

    return anyio.run(_session_run, allow, steps)


@pytest.mark.slow
def test_every_tool_answers_through_the_sdk_client_over_stdio(models, tmp_path):
    model = models["q8_0"]
    log = (LOGS / "11_early2024-cuda-partial-10of33-mixtral-imatrix.log").read_text(encoding="utf-8", errors="replace")
    progress: list[tuple[float, float | None, str | None]] = []

    async def steps(session):
        tools = {t.name: t for t in (await session.list_tools()).tools}
        out = {"tools": tools}
        out["estimate"] = await session.call_tool("estimate", {"model": str(model), "devices": ["CUDA0=8GiB"], "ctx": 2048})
        out["estimate_here"] = await session.call_tool("estimate", {"model": str(model), "n_gpu_layers": 0, "ctx": 1024})
        out["outside"] = await session.call_tool("estimate", {"model": str(tmp_path / "elsewhere.gguf")})
        out["escape"] = await session.call_tool("best_settings", {"model": str(model.parent / ".." / "x.gguf")})
        out["bad_kv"] = await session.call_tool("estimate", {"model": str(model), "devices": ["CUDA0=8GiB"], "kv_type": "q9_9"})
        out["diagnose"] = await session.call_tool("diagnose", {"log": log})
        out["empty_log"] = await session.call_tool("diagnose", {"log": "   "})
        out["doctor"] = await session.call_tool("doctor", {"repack_probe": False})
        out["no_profile"] = await session.call_tool("best_settings", {"model": str(model)})
        out["too_many"] = await session.call_tool("tune", {"model": str(model), "trials": 500})

        async def on_progress(value, total, message):
            progress.append((value, total, message))

        out["tune"] = await session.call_tool("tune", {"model": str(model), "trials": 2, "min_ctx": 512, "n_prompt": 32,
                                                              "n_gen": 8, "repetitions": 1},
                                              progress_callback=on_progress)
        out["best"] = await session.call_tool("best_settings", {"model": str(model)})
        return out

    out = run([model.parent], steps)
    tools = out["tools"]
    assert set(tools) == {"estimate", "best_settings", "diagnose", "doctor", "tune"}
    assert tools["tune"].input_schema["required"] == ["model"]
    assert tools["tune"].input_schema["properties"]["objective"]["enum"] == ["tg", "pp", "mixed"]

    estimate = _data(out["estimate"])
    assert estimate["machine"]["devices"] == {"CUDA0": 8 << 30} and estimate["fits"] is True
    assert estimate["max_gpu_layers"] == 5  # the tiny model's 4 layers + output, all in 8 GiB
    here = _data(out["estimate_here"])
    assert here["n_ctx"] == 1024 and "CPU" in here["devices"]

    for refused in ("outside", "escape"):
        assert out[refused].is_error and "outside the folders this server may read" in _text(out[refused])
        assert str(model.parent) in _text(out[refused])
    # the command line's own message (offload-tuner estimate MODEL --kv-type q9_9 says the same)
    assert out["bad_kv"].is_error and "settings.type_k: expected one of f32, f16" in _text(out["bad_kv"])

    diagnosis = _data(out["diagnose"])
    assert diagnosis["what_happened"]["layers_offloaded"] == 10 and diagnosis["what_happened"]["layers_total"] == 33
    assert out["empty_log"].is_error and "the log is empty" in _text(out["empty_log"])

    checks = _data(out["doctor"])["checks"]
    assert [c["name"] for c in checks][:2] == ["gpus", "build"]
    assert next(c for c in checks if c["name"] == "repack")["found"].endswith("the decode probe did not run")

    assert out["no_profile"].is_error and "tune" in _text(out["no_profile"])
    assert out["too_many"].is_error and "trials: expected 1 to 50" in _text(out["too_many"])

    tuned = _data(out["tune"])
    assert tuned["profile_path"] and Path(tuned["profile_path"]).is_file() and tuned["tg"] > 0
    assert len(progress) >= 2 and progress[-1][1] == 2 and progress[0][2].startswith("trial 1: ")
    best = _data(out["best"])
    assert best["model"] == model.name and best["measured"]["tg"] > 0
    commands = best["commands"]
    assert commands["llama-server"].startswith("llama-server -m ") and str(model) in commands["llama-server"]
    assert commands["llama-cli"].startswith("llama-cli ")
    assert f"FROM {model}" in commands["ollama"]
    assert "tuner.Llama(" in commands["llama-cpp-python"] and best["llama_kwargs"]["model_path"] == str(model)


def test_mcp_refuses_a_missing_allowed_folder(tmp_path):
    from click.testing import CliRunner

    from tuner.cli.main import cli

    result = CliRunner().invoke(cli, ["mcp", "--allow", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "not a folder" in result.output


def test_allowed_paths_follow_links(tmp_path):
    from tuner.cli.mcp_server import Allowed, PathNotAllowed

    inside = tmp_path / "models"
    inside.mkdir()
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(b"GGUF")
    (inside / "link.gguf").symlink_to(secret)
    allowed = Allowed([inside])
    with pytest.raises(PathNotAllowed):
        allowed.check(str(inside / "link.gguf"), "model")
    assert allowed.check(str(inside / "a.gguf"), "model") == str((inside / "a.gguf").resolve())
    assert allowed.model("hf://owner/repo/x.gguf") == "hf://owner/repo/x.gguf"
    with pytest.raises(PathNotAllowed):
        Allowed([]).check(str(inside / "a.gguf"), "model")
