"""The dimension table drives every reader: each dimension appears in each place it declares, and
nowhere else spells a setting by hand.

``FAR`` moves every setting away from its default, so every spelling has something to say.
"""

from __future__ import annotations

import dataclasses
import inspect
import shlex

import pytest
from click.testing import CliRunner

from tests.test_profile import profile_dict
from tuner.cli.main import cli, settings_from_options, settings_options
from tuner.engine.dimensions import (
    CLI_TOOLS,
    DIMENSIONS,
    Export,
    flash_attn_forms,
    gpu_layers_arg,
    offloaded_layers,
)
from tuner.engine.settings import MODEL_KEYS, Settings
from tuner.profile.document import Profile
from tuner.profile.exports import llama_server_env, ollama_modelfile

FAR = Settings(
    model_path="/m/model.gguf", n_gpu_layers=7, split_mode="row", main_gpu=1, tensor_split=(3.0, 1.0), n_ctx=8192,
    n_batch=1024, n_ubatch=256, n_threads=6, n_threads_batch=12, flash_attn="on", type_k="q8_0", type_v="q4_0",
    offload_kqv=False, swa_full=True, kv_unified=True, n_parallel=4, use_mmap=False, use_mlock=True, op_offload=False,
    tensor_overrides=(r"blk\.0\.ffn_up\.weight",),
    n_cpu_moe=2, repack=False,
    rpc_servers=("10.0.0.2:50052",),
    devices=("RPC0", "CUDA0"),
)


def far_profile() -> Profile:
    document = profile_dict(**{k: v for k, v in FAR.to_dict().items()})
    document["workload"]["users"] = FAR.n_parallel
    return Profile.from_dict(document)


def test_settings_fields_are_the_table():
    fields = dataclasses.fields(Settings)
    assert [f.name for f in fields] == [d.name for d in DIMENSIONS]
    for f, dim in zip(fields, DIMENSIONS):
        default = None if f.default is dataclasses.MISSING else f.default
        assert default == dim.default, dim.name
    assert MODEL_KEYS == tuple(d.name for d in DIMENSIONS if d.model_level)


def test_far_moves_every_setting():
    default = Settings(model_path="/other.gguf")
    assert [d.name for d in DIMENSIONS if getattr(FAR, d.name) == getattr(default, d.name)] == []


@pytest.mark.parametrize("tool", CLI_TOOLS)
def test_every_flag_a_dimension_declares_is_written(tool):
    args = FAR.cli_args(tool)
    export = Export(tool=tool)
    written = []
    for dim in DIMENSIONS:
        writer = dim.flags.get(tool)
        if writer is None:
            continue
        words = writer(FAR, export)
        assert words, f"{dim.name} says nothing to {tool} although it is away from its default"
        written += words
    assert args == written  # in table order, nothing else


def test_a_default_writes_no_optional_flag():
    # what llama.cpp takes by default is left out, except the values every profile states
    plain = Settings(model_path="m.gguf")
    assert plain.cli_args("llama-server") == ["-m", "m.gguf", "-ngl", "0", "-c", "4096", "-b", "2048", "-ub", "512",
                                             "-fa", "auto", "-ctk", "f16", "-ctv", "f16", "-np", "1"]


def test_every_dimension_is_spelled_for_each_tool_or_says_why():
    for dim in DIMENSIONS:
        for tool in CLI_TOOLS:
            # a dimension another one spells (use_mlock in -lm) needs no writer of its own
            assert (tool in dim.flags) != bool(dim.no_flag.get(tool) or dim.spelled_by), (dim.name, tool)
        if dim.spelled_by:
            assert dim.spelled_by in {d.name for d in DIMENSIONS}


def test_env_export_uses_each_declared_variable():
    text = llama_server_env(far_profile())
    for dim in DIMENSIONS:
        if "llama-server" not in dim.flags:
            continue
        if dim.env is not None:
            assert f"export {dim.env.name}=" in text, dim.name
        else:
            words = dim.flags["llama-server"](FAR, Export())
            assert shlex.join(words) in text.splitlines()[-1], dim.name


def test_ollama_export_says_each_dimension():
    text = ollama_modelfile(far_profile())
    for dim in DIMENSIONS:
        if dim.ollama is None:
            continue
        export = Export(tool="ollama", layers_total=37)
        for part in (dim.ollama.line, dim.ollama.note):
            said = part(FAR, export) if part else None
            if said:
                assert said in text, dim.name


def test_every_option_round_trips_through_the_command_line():
    """bench's options, built from the table, read FAR back from FAR's own spelling."""
    argv = []
    for dim in DIMENSIONS:
        option = dim.option
        if option is None:
            continue
        value = getattr(FAR, dim.name)
        name = option.names[0]
        if option.switch is not None:
            assert value == option.switch, dim.name
            argv.append(name)
        elif option.multiple:
            for item in value:
                argv += [name, item]
        elif isinstance(value, tuple):
            argv += [name, ",".join(str(v) for v in value)]
        else:
            argv += [name, str(value)]
    got = {}

    @settings_options
    def command(**opts):
        got["settings"] = settings_from_options("/m/model.gguf", opts)

    import click

    result = CliRunner().invoke(click.command()(command), argv)
    assert result.exit_code == 0, result.output
    assert got["settings"] == FAR


@pytest.mark.parametrize("command", ["bench", "estimate"])
def test_help_lists_every_option(command):
    text = CliRunner().invoke(cli, [command, "--help"], terminal_width=200).output
    for dim in DIMENSIONS:
        if dim.option is not None and not (command == "estimate" and dim.name in ("rpc_servers", "devices")):
            for name in dim.option.names:
                assert name in text, name


def test_c_api_fields_exist_and_the_worker_sets_them():
    llama_cpp = pytest.importorskip("llama_cpp")
    from tuner.engine.worker import _set_fields

    structs = {"model": llama_cpp.llama_model_default_params(), "context": llama_cpp.llama_context_default_params()}
    for struct, params in structs.items():
        _set_fields(params, struct, FAR)
    for dim in DIMENSIONS:
        if dim.c_api is None:
            assert dim.c_api_by_worker, f"{dim.name}: say who sets it"
            continue
        params = structs[dim.c_api.struct]
        assert dim.c_api.field in {f[0] for f in type(params)._fields_}, dim.name
        expected = dim.c_api.value(FAR)
        assert getattr(params, dim.c_api.field) == expected, dim.name


def test_llama_kwargs_are_keywords_of_llama():
    llama_cpp = pytest.importorskip("llama_cpp")
    keywords = set(inspect.signature(llama_cpp.Llama.__init__).parameters)
    kwargs = FAR.llama_kwargs()
    for dim in DIMENSIONS:
        if dim.llama_kwarg:
            assert dim.llama_kwarg in keywords, dim.name
            assert dim.llama_kwarg in kwargs, dim.name
        else:
            assert dim.no_kwarg, f"{dim.name}: say why there is no keyword and who applies it"
    assert set(kwargs) <= keywords


# -- the special values, one helper each ----------------------------------------------------------------


def test_every_layer_has_one_meaning():
    assert offloaded_layers(-1, 32) == 33 and offloaded_layers(40, 32) == 33 and offloaded_layers(5, 32) == 5
    assert gpu_layers_arg("llama-server", -1) == "all" and gpu_layers_arg("llama-cli", -1) == "all"
    assert gpu_layers_arg("llama-bench", -1) == "-1"
    assert gpu_layers_arg("llama-server", -1, layers_total=37) == "37" == gpu_layers_arg("llama-bench", -1, 37)
    assert gpu_layers_arg("llama-server", 5, layers_total=37) == "5"


def test_flash_attention_forms():
    on, off, auto = (flash_attn_forms(v) for v in ("on", "off", "auto"))
    assert (on.c_api, on.bench, on.high_level, on.enabled) == (1, "1", True, True)
    assert (off.c_api, off.bench, off.high_level, off.enabled) == (0, "0", False, False)
    assert (auto.c_api, auto.bench, auto.high_level, auto.enabled) == (-1, None, False, True)
    assert flash_attn_forms(True) == on and flash_attn_forms(0) == off and flash_attn_forms(-1) == auto
    with pytest.raises(ValueError, match="expected one of auto, off, on, got 'yes'"):
        flash_attn_forms("yes")
