"""Exports: every format against a reviewed golden file, and through llama.cpp's own argument parsers.

The golden files in ``tests/golden/`` were written once and read line by line against llama.cpp's
``common/arg.cpp``, ``tools/llama-bench/llama-bench.cpp`` and ollama's ``api/types.go``; a change in
an export must change its golden file in the same commit, by hand.

The parser tests build a small harness around ``common_params_parse`` (what llama-server and
llama-cli call) and llama-bench itself, from llama.cpp's sources against the ``libllama-common`` that
llama-cpp-python installs. They skip when the sources (``LLAMA_CPP_SOURCE``, or an unpacked
llama-cpp-python sdist in the temp folder) or a C++ compiler are missing.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.test_profile import GiB, MiB, make_machine, profile_dict
from tuner.cli.profile import profile_group
from tuner.errors import ProfileError
from tuner.profile.exports import FORMATS, export_args, llama_server_env, tool_args
from tuner.profile.document import Profile
from tests.parsers import parsed

GOLDEN = Path(__file__).parent / "golden"


def simple_profile() -> Profile:
    """llama.cpp's usual shape: everything on one GPU, f16 KV cache, mmap."""
    return Profile.from_dict(profile_dict()).replace(path="/team/profiles/qwen3-8b--4090.json")


def full_profile() -> Profile:
    """Every setting away from its default, so every mapping and every 'not expressible' note shows."""
    machine = make_machine(gpus=(("NVIDIA GeForce RTX 3090", 24 * GiB),) * 2)
    document = profile_dict(
        machine,
        model_path="/srv/models/team models/Qwen3-8B-Q4_K_M.gguf",
        n_gpu_layers=30,
        split_mode="row",
        main_gpu=1,
        tensor_split=[3, 1],
        n_ctx=16384,
        n_batch=1024,
        n_ubatch=256,
        n_threads=12,
        n_threads_batch=None,
        flash_attn="on",
        type_k="q8_0",
        type_v="q4_0",
        offload_kqv=False,
        use_mmap=False,
        use_mlock=True,
        op_offload=False,
        tensor_overrides=[r"blk\.(0|1)\.ffn_.*", "exps"],
        rpc_servers=["10.0.0.2:50052"],
    )
    document["measured"]["depth"] = 4096
    document["memory"]["predicted"] = {
        "CUDA0": {"weights": 2900 * MiB, "kv": 0, "compute": 400 * MiB, "total": 3300 * MiB},
        "CUDA1": {"weights": 1000 * MiB, "kv": 0, "compute": 400 * MiB, "total": 1400 * MiB},
        "RPC0[10.0.0.2:50052]": {"weights": 300 * MiB, "kv": 0, "compute": 100 * MiB, "total": 400 * MiB},
        "CPU": {"weights": 900 * MiB, "kv": 2304 * MiB, "compute": 200 * MiB, "total": 3404 * MiB},
    }
    return Profile.from_dict(document).replace(path="/team/profiles/qwen3-8b--2x3090.json")


def newer_profile() -> Profile:
    """The settings llama.cpp gained after wave 1, away from their defaults (each exported only when set)."""
    fingerprint = {"file_name": "Qwen3-30B-A3B-Q4_K_M.gguf", "size": 18_556_686_336, "header_hash": "cd" * 32}
    document = profile_dict(fingerprint=fingerprint, model_path="/home/ana/models/Qwen3-30B-A3B-Q4_K_M.gguf",
                            swa_full=True, n_cpu_moe=12, kv_unified=True, n_parallel=4)
    document["workload"]["users"] = 4  # tuned for four users: -np 4, OLLAMA_NUM_PARALLEL=4
    return Profile.from_dict(document).replace(path="/team/profiles/qwen3-30b-a3b--4090.json")


PROFILES = {"simple": simple_profile, "full": full_profile, "newer": newer_profile}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("variant", sorted(PROFILES))
def test_export_matches_its_golden_file(fmt, variant):
    expected = (GOLDEN / f"{fmt}-{variant}.txt").read_text()
    assert export_args(PROFILES[variant](), fmt) == expected


def test_every_golden_file_is_used():
    assert sorted(p.name for p in GOLDEN.glob("*.txt")) == sorted(f"{f}-{v}.txt" for f in FORMATS for v in PROFILES)


def test_the_app_model_path_replaces_the_recorded_one():
    profile = simple_profile()
    assert tool_args(profile, "llama-server", model_path="/data/q.gguf")[:2] == ["-m", "/data/q.gguf"]
    assert "FROM /data/q.gguf\n" in export_args(profile, "ollama", model_path=Path("/data/q.gguf"))
    assert "export LLAMA_ARG_MODEL=/data/q.gguf\n" in export_args(profile, "env", model_path="/data/q.gguf")


def test_an_unknown_format_is_refused():
    with pytest.raises(ProfileError, match=r"^unknown export format 'vllm'; expected one of llama-server, llama-cli, llama-bench, ollama, env, "
                                           r"llama-swap, lmstudio, kcpps$"):
        export_args(simple_profile(), "vllm")


def test_profile_args_command(tmp_path):
    path = full_profile().replace(path=None).write(tmp_path / "team.json")
    runner = CliRunner()
    result = runner.invoke(profile_group, ["args", str(path), "--for", "ollama"])
    assert result.exit_code == 0, result.output
    assert result.output == export_args(Profile.from_dict(json.loads(path.read_text())).replace(path=str(path)), "ollama")
    result = runner.invoke(profile_group, ["args", str(path), "--model", "/data/q.gguf"])
    assert result.output.startswith("llama-server -m /data/q.gguf -ngl 30 ")
    result = runner.invoke(profile_group, ["args", str(path), "--for", "vllm"])
    assert result.exit_code == 2
    assert "Invalid value for '--for'" in result.output


# -- through llama.cpp's own parsers ------------------------------------------------------------

# The harness around llama.cpp's own parser, and its fixture (``llama_parsers``), are shared with the
# machine matrix: tests/parsers.py, registered in conftest.py.
_parsed = parsed


def _expected(profile: Profile, model_path: str, tool: str = "llama-server") -> dict[str, str]:
    s = profile.settings
    split = (list(s.tensor_split) + [0, 0])[:2] if s.tensor_split else [0, 0]
    expected = {
        "model": model_path,
        "n_gpu_layers": str(profile.layers_total if s.n_gpu_layers < 0 else s.n_gpu_layers),
        "split_mode": str({"none": 0, "layer": 1, "row": 2}[s.split_mode]),
        "main_gpu": str(s.main_gpu),
        "tensor_split": ",".join(f"{p:g}" for p in split),
        "n_ctx": str(s.n_ctx),
        "n_batch": str(s.n_batch),
        "n_ubatch": str(s.n_ubatch),
        "flash_attn": str({"auto": -1, "off": 0, "on": 1}[s.flash_attn]),
        "type_k": s.type_k,
        "type_v": s.type_v,
        "no_kv_offload": str(int(not s.offload_kqv)),
        # enum llama_load_mode (include/llama.h): AUTO -1 is the default, left as is for plain mmap
        "load_mode": str({(True, False): -1, (False, False): 0, (False, True): 2, (True, True): 3}[(s.use_mmap, s.use_mlock)]),
        "no_op_offload": str(int(not s.op_offload)),
        "swa_full": str(int(s.swa_full)),
    }
    if tool == "llama-server":  # llama-cli takes no -kvu
        expected["kv_unified"] = str(int(s.kv_unified))
    if s.n_threads is not None:
        expected["n_threads"] = str(s.n_threads)
    if s.n_threads_batch is not None:
        expected["n_threads_batch"] = str(s.n_threads_batch)
    if s.host_overrides:  # -ot's patterns, then --n-cpu-moe's (common.h llm_add_n_cpu_ffn_overrides)
        expected["override"] = ";".join(f"{p}=CPU" for p in s.host_overrides)
    return expected


def _without_rpc(profile: Profile) -> Profile:
    # --rpc connects to its servers while parsing: no server runs here.
    return profile.replace(settings=profile.settings.replace(rpc_servers=()))


@pytest.mark.parametrize("tool", ["llama-server", "llama-cli"])
@pytest.mark.parametrize("variant", sorted(PROFILES))
def test_llama_cpp_parses_the_flags_as_the_profile_means(llama_parsers, tool, variant, tmp_path):
    harness, _bench, env = llama_parsers
    profile = _without_rpc(PROFILES[variant]())
    model = str(tmp_path / "model.gguf")
    parsed = _parsed(harness, tool, tool_args(profile, tool, model_path=model), env)
    expected = _expected(profile, model, tool)
    assert {k: parsed.get(k) for k in expected} == expected


@pytest.mark.parametrize("variant", sorted(PROFILES))
def test_llama_server_reads_the_env_export_as_the_same_settings(llama_parsers, variant, tmp_path):
    harness, _bench, env = llama_parsers
    profile = _without_rpc(PROFILES[variant]())
    model = str(tmp_path / "model.gguf")
    exported = dict(env)
    flags: list[str] = []
    for line in llama_server_env(profile, model_path=model).splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export ") :].partition("=")
            exported[name] = shlex.split(value)[0]
        elif "pass them as flags: " in line:
            flags = shlex.split(line.split("pass them as flags: ", 1)[1])
    assert _parsed(harness, "llama-server", flags, exported) == _parsed(
        harness, "llama-server", tool_args(profile, "llama-server", model_path=model), env
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from tuner.testing import ModelShape, make_model

    shape = ModelShape(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128, n_vocab=320, n_ctx_train=512)
    return make_model(tmp_path_factory.mktemp("bench") / "tiny.gguf", shape)


@pytest.mark.parametrize("variant", sorted(PROFILES))
def test_llama_bench_runs_the_exported_flags(llama_parsers, tiny_model, variant):
    _harness, bench, env = llama_parsers
    profile = _without_rpc(PROFILES[variant]())
    args = tool_args(profile, "llama-bench", model_path=str(tiny_model))
    # A tiny benchmark: the exported prompt/generation/depth sizes are replaced by small ones.
    for flag, value in (("-p", "8"), ("-n", "4"), ("-d", "0")):
        if flag in args:
            args[args.index(flag) + 1] = value
    proc = subprocess.run([str(bench), *args, "-r", "1", "-o", "json"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run, *_rest) = json.loads(proc.stdout)
    s = profile.settings
    assert run["n_gpu_layers"] == (profile.layers_total if s.n_gpu_layers < 0 else s.n_gpu_layers)
    assert (run["n_batch"], run["n_ubatch"], run["type_k"], run["type_v"]) == (s.n_batch, s.n_ubatch, s.type_k, s.type_v)
    assert run["split_mode"] == s.split_mode and run["main_gpu"] == s.main_gpu
    assert run["no_kv_offload"] == (not s.offload_kqv)
    assert bool(run["no_op_offload"]) == (not s.op_offload)
    assert run["flash_attn"] == {"auto": -1, "off": 0, "on": 1}[s.flash_attn]
    if s.tensor_split:
        assert run["tensor_split"] == "/".join(f"{p:.2f}" for p in s.tensor_split)
    if s.tensor_overrides:
        # the model file is at hand: llama-bench gets the names the patterns match, as literals
        from tuner.engine.tensor_match import resolved_patterns, tensor_names

        resolved = resolved_patterns(s.tensor_overrides, tensor_names(tiny_model))
        assert resolved and all(p.startswith("^(") for p in resolved)
        assert run["tensor_buft_overrides"] == ";".join(f"{p}=CPU" for p in resolved)
    assert run["n_cpu_moe"] == s.n_cpu_moe
    if s.n_threads is not None:
        assert run["n_threads"] == s.n_threads


# -- hostile strings ------------------------------------------------------------------------------

# Shell syntax that runs something when a line is eval'ed or sourced carelessly: command
# substitution, backticks, separators, redirections, quotes that close early, a variable.
def _payload(tag: str, marks: Path) -> str:
    m = f"{marks}/{tag}"
    return (f"x$(touch {m}-subst)`touch {m}-tick`;touch {m}-semi |touch {m}-pipe &touch {m}-amp "
            f">{m}-redirect '\"'$(touch {m}-quote)\"' ${{HOME}}$PATH")


def _hostile_profile(tmp_path: Path, marks: Path) -> Path:
    """A profile whose every free-text field is shell syntax, in a file whose own name holds a
    newline and a command (profile.name, written into comments)."""
    document = profile_dict(
        make_machine(gpus=((_payload("gpu", marks), 24 * GiB),)),
        model_path=f"/models/{_payload('path', marks)}.gguf",
        tensor_overrides=[rf"blk\.0\.ffn_$(touch {marks}/override)`touch {marks}/override2`;x"],
    )
    document["model"]["file_name"] = _payload("file", marks) + ".gguf"
    document["machine"]["cpu_model"] = _payload("cpu", marks)
    document["machine"]["system"] = _payload("system", marks)
    folder = tmp_path / "profiles"
    folder.mkdir()
    # (a file name holds no "/": these commands would touch ran-name... in the shell's folder)
    path = folder / "team\n$(touch ran-name);touch ran-name2 `touch ran-name3`.json"
    path.write_text(json.dumps(document))
    return path


def _source(text: str, tmp_path: Path, how: str) -> subprocess.CompletedProcess:
    """``text`` sourced (or eval'ed) by bash, with the tools it names as functions that record
    their arguments, one per line, in args.txt."""
    script = tmp_path / "export.txt"
    script.write_text(text)
    record = 'printf "%s\\n" "$@" >> "$ARGS"'
    prelude = "".join(f'{name}() {{ {record}; }}; ' for name in ("llama-server", "llama-cli", "llama-bench", "FROM", "PARAMETER"))
    command = prelude + (f'source "{script}"' if how == "source" else f'eval "$(cat "{script}")"') + '; printf "%s\\0" "$LLAMA_ARG_MODEL" "$LLAMA_ARG_OVERRIDE_TENSOR" > "$ENVS"'
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "ARGS": str(tmp_path / "args.txt"), "ENVS": str(tmp_path / "envs.txt")})


SHELL_FORMATS = [f for f in FORMATS if f not in ("llama-swap", "lmstudio", "kcpps")]


@pytest.mark.parametrize("how", ["source", "eval"])
@pytest.mark.parametrize("fmt", SHELL_FORMATS)
def test_every_export_of_a_hostile_profile_is_safe_to_source(tmp_path, fmt, how):
    marks = tmp_path / "ran"
    marks.mkdir()
    path = _hostile_profile(tmp_path, marks)
    # the model path on this machine: hostile too, and with a newline, for the formats that can carry
    # it; a Modelfile cannot (see the next test), so it gets a plain one
    here = f"/data/{_payload('here', marks)}\n$(touch {marks}/here-newline).gguf" if fmt != "ollama" else "/data/my models/q.gguf"
    args = ["args", str(path), "--for", fmt, "--model", here]
    result = CliRunner().invoke(profile_group, args)
    assert result.exit_code == 0, result.output
    proc = _source(result.stdout, tmp_path, how)
    assert sorted(p.name for p in marks.iterdir()) == [] and not list(tmp_path.glob("ran-*")), (result.stdout, proc.stderr)
    # and the values arrived whole: the model path and the override, as one argument each
    recorded = (tmp_path / "args.txt").read_text() if (tmp_path / "args.txt").exists() else ""
    envs = (tmp_path / "envs.txt").read_text()
    profile = Profile.from_dict(json.loads(path.read_text()))
    if fmt == "env":
        assert envs.split("\0")[:2] == [here, f"{profile.settings.tensor_overrides[0]}=CPU"]
    elif fmt == "ollama":
        assert recorded.startswith("/data/my\nmodels/q.gguf\n")  # FROM, then the PARAMETER lines
    else:
        assert f"\n{here}\n" in recorded and recorded.startswith("-m\n")
        assert f"{profile.settings.tensor_overrides[0]}=CPU" in recorded


def test_a_modelfile_cannot_carry_a_path_with_shell_or_quote_characters(tmp_path):
    marks = tmp_path / "ran"
    marks.mkdir()
    path = _hostile_profile(tmp_path, marks)
    # the recorded path and any path given with --model go through the same check
    for extra in ([], ["--model", "/data/model \"2\".gguf"], ["--model", "/data/a\nADAPTER /evil.gguf"]):
        result = CliRunner().invoke(profile_group, ["args", str(path), "--for", "ollama", *extra])
        assert result.exit_code == 2 and result.stdout == ""
        assert result.output.startswith("Error: cannot write the Modelfile's FROM line: ")
        assert "Give the model's path on this machine with --model PATH" in result.output
        if "\n" in "".join(extra):  # a newline is shown as Python writes it, once: '\n', never '\\n'
            assert result.output.count("\n") == 1 and "'/data/a\\nADAPTER /evil.gguf' cannot be written" in result.output
            assert "no way to quote '\\n'" in result.output and "\\\\n" not in result.output
    plain = CliRunner().invoke(profile_group, ["args", str(path), "--for", "ollama", "--model", "/data/my models/q-4,k+m@2.gguf"])
    assert plain.exit_code == 0 and "\nFROM /data/my models/q-4,k+m@2.gguf\n" in plain.stdout
    # the profile's hostile names are in the comments, escaped, each comment one line
    comments = [line for line in plain.stdout.splitlines() if line.startswith("#")]
    assert any("$(touch" in line for line in comments) and any("\\n$(touch" in line for line in comments)
    assert all(line.startswith(("#", "FROM ", "PARAMETER ")) for line in plain.stdout.splitlines())


def test_llama_cpp_takes_the_exported_device_list_after_the_rpc_servers(llama_parsers, rpc_servers, tmp_path):
    """A profile over two RPC servers names its devices (-dev RPC0,RPC1 after --rpc, which registers
    them while parsing; LLAMA_ARG_DEVICE after LLAMA_ARG_RPC): llama.cpp's own parser resolves both, in
    the flags and in the env export, to the devices of those servers."""
    harness, _bench, env = llama_parsers
    servers = rpc_servers(2)
    endpoints = tuple(s.endpoint for s in servers)
    base = PROFILES["simple"]()
    profile = base.replace(settings=base.settings.replace(rpc_servers=endpoints, devices=("RPC0", "RPC1"),
                                                          tensor_split=(1.0, 3.0), n_gpu_layers=-1))
    model = str(tmp_path / "model.gguf")
    args = tool_args(profile, "llama-server", model_path=model)
    assert args.index("--rpc") < args.index("-dev")
    out = parsed(harness, "llama-server", args, env)
    assert out["device"] == "RPC0;RPC1" and out["tensor_split"] == "1,3"
    exported = dict(env)
    flags: list[str] = []
    for line in llama_server_env(profile, model_path=model).splitlines():
        if line.startswith("export "):
            name, _, value = line[len("export "):].partition("=")
            exported[name] = shlex.split(value)[0]
        elif "pass them as flags: " in line:
            flags = shlex.split(line.split("pass them as flags: ", 1)[1])
    assert exported["LLAMA_ARG_DEVICE"] == "RPC0,RPC1"
    assert parsed(harness, "llama-server", flags, exported)["device"] == "RPC0;RPC1"


# -- llama-swap, LM Studio, koboldcpp ---------------------------------------------------------------------
#
# What each file is checked against, and what is not run here:
# - llama-swap (Go; not installable from a package registry here): its config.yaml loader's rules,
#   read from config/config.go (ModelConfig's yaml keys, ${PORT} in cmd when proxy uses it, cmd split
#   POSIX-shell style), on the YAML as PyYAML reads it; the cmd's flags then go through llama.cpp's
#   own llama-server parser (llama_parsers) where it can be built.
# - LM Studio (a desktop app): the llm.load.* keys and value types of lmstudio-js's lms-kv-config
#   schema (packages/lms-kv-config/src/schema.ts); LM Studio itself is not run.
# - koboldcpp (not on PyPI: `pip download koboldcpp` finds nothing): the dest names and types of
#   koboldcpp.py's argparse options (2026), which --config FILE.kcpps sets; koboldcpp is not run.

# ModelConfig's yaml keys (llama-swap config/config.go)
LLAMA_SWAP_MODEL_KEYS = {"cmd", "cmdStop", "proxy", "aliases", "env", "checkEndpoint", "ttl", "unlisted", "useModelName",
                         "name", "description", "concurrencyLimit", "filters"}
# llm.load.* keys LM Studio's schema declares for llama.cpp models, and the type of each value
LMSTUDIO_KEYS = {
    "llm.load.contextLength": int, "llm.load.offloadKVCacheToGpu": bool, "llm.load.numCpuExpertLayersRatio": (float, int, str),
    "llm.load.llama.acceleration.offloadRatio": (float, int, str), "llm.load.llama.cpuThreadPoolSize": int,
    "llm.load.llama.evalBatchSize": int, "llm.load.llama.flashAttention": bool, "llm.load.llama.keepModelInMemory": bool,
    "llm.load.llama.tryMmap": bool, "llm.load.llama.kCacheQuantizationType": dict, "llm.load.llama.vCacheQuantizationType": dict,
}
# koboldcpp.py's argparse dests (2026) a .kcpps from this tool may set, with their types
KCPPS_KEYS = {
    "model": list, "model_param": str, "gpulayers": int, "maingpu": int, "tensor_split": list, "contextsize": int,
    "batchsize": int, "threads": int, "blasthreads": int, "flashattention": bool, "noflashattention": bool, "quantkv": str,
    "lowvram": bool, "useswa": bool, "usemmap": bool, "nommap": bool, "usemlock": bool, "overridetensors": str, "moecpu": int,
    "usecuda": list, "usevulkan": list, "usecpu": bool,
}


@pytest.mark.parametrize("variant", sorted(PROFILES))
def test_the_llama_swap_entry_loads_as_llama_swap_reads_it(variant):
    import shlex

    import yaml

    profile = PROFILES[variant]()
    config = yaml.safe_load(export_args(profile, "llama-swap"))
    (model_id, entry), = config["models"].items()
    assert model_id == profile.name and set(entry) <= LLAMA_SWAP_MODEL_KEYS
    # the default proxy is http://localhost:${PORT}: llama-swap refuses a cmd without ${PORT}
    assert "${PORT}" in entry["cmd"]
    argv = shlex.split(entry["cmd"].replace("${PORT}", "5800"))
    assert argv == ["llama-server", "--port", "5800", *tool_args(profile, "llama-server")]


@pytest.mark.parametrize("variant", sorted(PROFILES))
def test_llama_server_parses_the_llama_swap_cmd_as_the_profile_means(llama_parsers, variant, tmp_path):
    import shlex

    import yaml

    harness, _bench, env = llama_parsers
    profile = _without_rpc(PROFILES[variant]())
    model = str(tmp_path / "model.gguf")
    (entry,) = yaml.safe_load(export_args(profile, "llama-swap", model_path=model))["models"].values()
    argv = shlex.split(entry["cmd"].replace("${PORT}", "5800"))
    parsed = _parsed(harness, "llama-server", argv[1:], env)
    expected = _expected(profile, model)
    assert {k: parsed.get(k) for k in expected} == expected and parsed.get("port") in (None, "5800")


@pytest.mark.parametrize("variant", sorted(PROFILES))
def test_the_lmstudio_config_uses_lm_studios_keys_and_types(variant):
    profile = PROFILES[variant]()
    config = json.loads(export_args(profile, "lmstudio"))
    assert set(config) == {"preset", "operation", "load"} and config["operation"] == {"fields": []}
    fields = {f["key"]: f["value"] for f in config["load"]["fields"]}
    assert len(fields) == len(config["load"]["fields"])  # each key once
    for key, value in fields.items():
        assert isinstance(value, LMSTUDIO_KEYS[key]), (key, value)
    s = profile.settings
    assert fields["llm.load.contextLength"] == s.n_ctx
    ratio = fields["llm.load.llama.acceleration.offloadRatio"]
    assert ratio == "max" if s.n_gpu_layers < 0 else round(ratio * profile.layers_total) == s.n_gpu_layers
    for name in ("kCacheQuantizationType", "vCacheQuantizationType"):
        kv = s.type_k if name[0] == "k" else s.type_v
        assert fields.get(f"llm.load.llama.{name}", {"checked": True, "value": "f16"})["value"] == kv


@pytest.mark.parametrize("variant", sorted(PROFILES))
def test_the_kcpps_uses_koboldcpps_option_names_and_types(variant):
    import argparse

    profile = PROFILES[variant]()
    config = json.loads(export_args(profile, "kcpps"))
    for key, value in config.items():
        assert isinstance(value, KCPPS_KEYS[key]), (key, value)
    # --config sets each key on the parsed arguments, as koboldcpp does with a .kcpps
    args = argparse.Namespace(**config)
    s = profile.settings
    assert args.model_param == s.model_path
    assert args.gpulayers == (profile.layers_total if s.n_gpu_layers < 0 else s.n_gpu_layers)
    assert args.contextsize == s.n_ctx and args.usemmap == s.use_mmap
    assert getattr(args, "lowvram", False) == (not s.offload_kqv)
    assert getattr(args, "moecpu", 0) == s.n_cpu_moe


def test_what_lmstudio_and_koboldcpp_cannot_say_is_noted_on_stderr(tmp_path):
    path = full_profile().replace(path=None).write(tmp_path / "team.json")
    result = CliRunner().invoke(profile_group, ["args", str(path), "--for", "kcpps"])
    assert result.exit_code == 0
    json.loads(result.stdout)  # the file stays valid JSON
    assert "note: not in the kcpps file: type_k q8_0, type_v q4_0: koboldcpp has one KV cache type" in result.stderr
    assert "note: not in the kcpps file: n_ubatch 256: koboldcpp has no setting for it" in result.stderr
    lms = CliRunner().invoke(profile_group, ["args", str(path), "--for", "lmstudio"])
    assert "tensor_overrides blk\\.(0|1)\\.ffn_.*, exps (kept on the CPU): LM Studio has no setting for it" in lms.stderr


def test_the_new_formats_carry_a_hostile_path_whole_or_refuse_it(tmp_path):
    import shlex

    import yaml

    from tuner.profile.quoting import UnsafeValueError

    profile = full_profile()
    here = "/data/it's: #1 \"model\" $(touch x).gguf"
    (entry,) = yaml.safe_load(export_args(profile, "llama-swap", model_path=here))["models"].values()
    assert shlex.split(entry["cmd"])[4] == here
    assert json.loads(export_args(profile, "kcpps", model_path=here))["model_param"] == here
    with pytest.raises(UnsafeValueError, match="line break"):
        export_args(profile, "llama-swap", model_path="/data/a\n# b.gguf")
