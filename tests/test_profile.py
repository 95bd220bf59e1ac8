"""The profile format: parsing, validation messages, schema versions, files, search path, bundles.

The helpers at the top (``make_machine``, ``make_gguf``, ``profile_dict``, ``write_profile``) are
shared with ``test_apps.py`` and ``test_exports.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from tuner.cli.profile import profile_group
from tuner.engine.settings import Settings
from tuner.errors import ProfileError, ProfileValidationError, SchemaVersionError
from tuner.machine.probe import GPU, GPUProcess, LlamaBuild, Machine
from tuner.profile.document import SCHEMA_VERSION, Profile, SchemaVersionWarning
from tuner.profile.exports import export_args
from tuner.profile.store import (
    import_bundle,
    list_profiles,
    profile_search_path,
    read_bundle,
    read_profile,
    resolve_profile,
    write_bundle,
)

GiB = 1 << 30
MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]


# -- helpers shared by the profile test files --------------------------------------------------


def make_machine(
    *,
    cpu_model: str = "AMD Ryzen 9 7950X 16-Core Processor",
    physical_cores: int = 16,
    logical_cores: int = 32,
    ram_available: int = 48 * GiB,
    gpus: tuple[tuple[str, int], ...] = (("NVIDIA GeForce RTX 4090", 24 * GiB),),
    free: tuple[int, ...] | None = None,
    processes: tuple[tuple[GPUProcess, ...], ...] = (),
    uuid_prefix: str = "GPU-4f1c",
    llama: LlamaBuild | None = None,
) -> Machine:
    """A machine description; nothing here reads the real hardware."""
    free = free if free is not None else tuple(memory - 600 * MiB for _, memory in gpus)
    return Machine(
        cpu_model=cpu_model,
        physical_cores=physical_cores,
        logical_cores=logical_cores,
        ram_total=64 * GiB,
        ram_available=ram_available,
        gpus=tuple(
            GPU(
                index=i,
                name=name,
                uuid=f"{uuid_prefix}-{i}",
                memory_total=memory,
                memory_free=free[i],
                driver="575.57.08",
                processes=processes[i] if i < len(processes) else (),
            )
            for i, (name, memory) in enumerate(gpus)
        ),
        gpu_status=f"NVML 575.57.08: {len(gpus)} GPU(s)",
        system="Linux",
        arch="x86_64",
        llama=llama or LlamaBuild(llama_cpp_python="0.3.36", llama_cpp_build="b7400", gpu_offload=True, backends=("cuda",)),
    )


def make_gguf(path: Path, *, rows: int = 4, architecture: str = "qwen3") -> Path:
    """A tiny valid GGUF (two tensors): enough for a fingerprint, never loaded in llama.cpp."""
    import gguf
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(36)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((rows, 4), dtype=np.float32))
    writer.add_tensor("output.weight", np.ones((rows, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def stats(median: float) -> dict:
    return {
        "median": median,
        "mean": median - 0.1,
        "stddev": 0.4,
        "ci_low": median - 0.5,
        "ci_high": median + 0.5,
        "samples": [median - 0.3, median, median + 0.2],
    }


def profile_dict(machine: Machine | None = None, fingerprint: dict | None = None, **settings) -> dict:
    """A realistic profile document: Qwen3-8B Q4_K_M fully offloaded to one RTX 4090 at 32k context.

    Memory arithmetic (bytes): KV f16 = 2 (K, V) x 8 heads x 128 x 2 bytes = 4096 per token per layer;
    at 32768 tokens x 36 layers that is 4.5 GiB on CUDA0.
    """
    machine = machine or make_machine()
    fingerprint = fingerprint or {"file_name": "Qwen3-8B-Q4_K_M.gguf", "size": 5_027_783_488, "header_hash": "ab" * 32}
    winner = {
        "model_path": "/home/ana/models/Qwen3-8B-Q4_K_M.gguf",
        "n_gpu_layers": -1,
        "split_mode": "layer",
        "main_gpu": 0,
        "tensor_split": None,
        "n_ctx": 32768,
        "n_batch": 2048,
        "n_ubatch": 512,
        "n_threads": 8,
        "n_threads_batch": 16,
        "flash_attn": "on",
        "type_k": "f16",
        "type_v": "f16",
        "offload_kqv": True,
        "swa_full": False,
        "kv_unified": False,
        "n_parallel": 1,
        "use_mmap": True,
        "use_mlock": False,
        "op_offload": True,
        "tensor_overrides": [],
        "n_cpu_moe": 0,
        "repack": True,
        "rpc_servers": [],
        "devices": [],
        **settings,
    }
    return {
        "schema_version": SCHEMA_VERSION,
        "tool_version": "0.1.0",
        "created_at": "2026-03-01T12:00:00Z",
        "machine": {
            "fingerprint": machine.fingerprint(),
            "hardware_class": machine.hardware_class(),
            "cpu_model": machine.cpu_model,
            "physical_cores": machine.physical_cores,
            "logical_cores": machine.logical_cores,
            "ram_total": machine.ram_total,
            "gpus": [
                {"index": g.index, "name": g.name, "uuid": g.uuid, "memory_total": g.memory_total, "driver": g.driver}
                for g in machine.gpus
            ],
            "unified_memory": machine.unified_memory,
            "system": machine.system,
            "arch": machine.arch,
            "devices": [
                {"name": f"CUDA{g.index}", "description": g.name, "type": "gpu", "memory_total": g.memory_total,
                 "unified_memory": False}
                for g in machine.gpus
            ],
        },
        "engine": {"name": "python", "build": "b7400 (4341dc8bc)", "path": "/usr/lib/python3/site-packages/llama_cpp"},
        "llama_build": {
            "llama_cpp_python": "0.3.36",
            "llama_cpp_build": "b7400",
            "backends": ["cpu", "cuda"],
            "gpu_offload": True,
            "rpc": False,
        },
        "model": {**fingerprint, "architecture": "qwen3", "quantization": "Q4_K_M", "n_layer": 36},
        "settings": winner,
        "min_ctx": 8192,
        "objective": "tg",
        "measured": {"pp": stats(6120.5), "tg": stats(141.2), "n_prompt": 512, "n_gen": 128, "depth": 0},
        "memory": {
            "predicted": {
                "CUDA0": {"weights": 4608 * MiB, "kv": 4608 * MiB, "compute": 512 * MiB, "total": 9728 * MiB},
                "CPU": {"weights": 297 * MiB, "kv": 0, "compute": 40 * MiB, "total": 337 * MiB},
            },
            "actual": {
                "CUDA0": {"weights": 4600 * MiB, "kv": 4608 * MiB, "compute": 498 * MiB},
                "CPU": {"weights": 297 * MiB, "kv": 0, "compute": 38 * MiB},
            },
        },
        "sizing": {
            "n_layer": 36,
            "layer_weight_bytes": 116 * MiB,
            "output_weight_bytes": 432 * MiB,
            "kv_bytes_per_token_per_layer": 4096,
            "sliding_window": 0,
            "swa_layers": 0,
            "n_ctx_train": 40960,
        },
        "layers_offloaded": 37,
        "layers_total": 37,
        "runner_up": {"settings": {**winner, "flash_attn": "auto"}, "pp": stats(6050.0), "tg": stats(140.9)},
        "trials": {"run": 41, "pruned": 12, "oom": 3, "failed": 0},
        "study": {"name": "qwen3-8b--0123456789abcdef", "storage": "sqlite:///studies.db"},
        "quality": {
            "kl": {"mean": 0.0412, "median": 0.0125, "p99": 0.61},
            "top1_agreement": 0.912,
            "ppl": 9.87,
            "ppl_ratio": 1.021,
            "reference": {"file_name": "qwen3-8b-BF16.gguf", "sha256": "ab" * 32},
            "corpus_sha256": "cd" * 32,
            "n_ctx": 512,
            "chunks": 20,
        },
        "quality_budget": {"max_kl": 0.05, "max_ppl_increase": None, "min_tg": None, "min_pp": None, "target_met": None},
        "workload": {"users": 1, "n_prompt": 512, "n_gen": 128, "depth": 0, "objective": "tg", "min_user_tg": None,
                     "aggregate_tg": {"median": 141.2, "ci_low": 140.7, "ci_high": 141.7},
                     "per_user_tg": {"median": 141.2, "ci_low": 140.7, "ci_high": 141.7},
                     "ttft_s": {"p50": 0.08365, "p95": 0.08372, "ci_low": 0.08358, "ci_high": 0.08372,
                                "samples": [0.08358, 0.08365, 0.08372]}},
    }


def write_profile(folder: Path, document: dict, name: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (name or Profile.from_dict(document).default_filename())
    path.write_text(json.dumps(document, indent=2))
    return path


def validation_error(document: dict) -> str:
    with pytest.raises(ProfileValidationError) as info:
        Profile.from_dict(document)
    return str(info.value)


# -- the format ---------------------------------------------------------------------------------


def test_round_trip_keeps_every_key():
    document = profile_dict()
    profile = Profile.from_dict(document)
    assert profile.to_dict() == json.loads(json.dumps(document))
    assert profile.settings.tensor_split is None
    assert profile.memory.predicted["CUDA0"].need == 9728 * MiB
    assert profile.memory.actual["CUDA0"].total is None
    assert Profile.from_dict(profile.to_dict()) == profile
    profile.validate()


def test_a_1_3_profile_loads_with_repacking_on_and_stays_1_3_until_it_is_off():
    document = _before_1_4(profile_dict())
    document["schema_version"] = "1.3"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile = Profile.from_dict(document)
    assert profile.settings.repack is True  # llama.cpp's default, what a 1.3 profile was measured with
    assert profile.to_dict() == json.loads(json.dumps(document))  # a 1.3 reader still accepts it
    off = profile.replace(settings=profile.settings.replace(repack=False)).to_dict()
    assert off["schema_version"] == "1.4" and off["settings"]["repack"] is False
    assert Profile.from_dict(off).settings.repack is False


def test_a_1_2_profile_loads_without_engine_and_is_written_back_as_1_2():
    document = _before_1_3(profile_dict())
    document["schema_version"] = "1.2"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile = Profile.from_dict(document)
    assert profile.engine is None and profile.machine.devices == ()
    assert profile.to_dict() == json.loads(json.dumps(document))  # a 1.2 reader still accepts it
    # given an engine, it can only be said in 1.3
    from tuner.profile.document import EngineInfo

    measured = profile.replace(engine=EngineInfo("llama-cpp", "b6895 (4341dc8bc)", "/opt/llama.cpp/bin"))
    assert measured.to_dict()["schema_version"] == "1.3"


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["engine"].update(name="vllm"), "engine.name: expected one of python, llama-cpp, got 'vllm'"),
        (lambda d: d["engine"].pop("build"), "engine.build: missing"),
        (lambda d: d["machine"]["devices"][0].update(type="cpu"), "machine.devices[0].type: expected gpu or igpu, got 'cpu'"),
        (lambda d: d["machine"].update(devices={}), "machine.devices: expected a list, got an object"),
    ],
)
def test_engine_and_devices_are_validated(change, message):
    document = profile_dict()
    change(document)
    with pytest.raises(ProfileValidationError) as info:
        Profile.from_dict(document)
    assert str(info.value) == message


def test_keys_the_docstring_table_documents_are_the_keys_written():
    import tuner.profile.document as module

    for key in profile_dict():
        assert f"``{key}``" in module.__doc__


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["quality"].update(top1_agreement=1.5), "quality.top1_agreement: expected a share between 0 and 1, got 1.5"),
        (lambda d: d["quality"]["reference"].update(sha256="xyz"), "quality.reference.sha256: expected a lowercase hex sha256, got 'xyz'"),
        (lambda d: d["quality"]["kl"].pop("p99"), "quality.kl.p99: missing"),
        (lambda d: d["quality"].update(chunks=0), "quality.chunks: expected an integer >= 1, got 0"),
        (lambda d: d["quality_budget"].update(target_met="yes"), "quality_budget.target_met: expected true, false or null, got 'yes'"),
        (lambda d: d["quality_budget"].update(max_kl=-1), "quality_budget.max_kl: expected a number >= 0, got -1"),
        (lambda d: d["settings"].update(tensor_split=[1, -1]), "settings.tensor_split[1]: expected a proportion >= 0, got -1"),
        (lambda d: d["settings"].update(n_ctx="4096"), "settings.n_ctx: expected an integer, got '4096'"),
        (lambda d: d["settings"].update(n_gpu_layer=10), "settings.n_gpu_layer: unknown setting; known: " + ", ".join(sorted(f.name for f in dataclasses.fields(Settings)))),
        (lambda d: d["runner_up"]["settings"].update(type_k="q3"), "runner_up.settings.type_k: expected one of f32, f16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, bf16, got 'q3'"),
        (lambda d: d["model"].pop("size"), "model.size: missing"),
        (lambda d: d["model"].update(header_hash="not-hex"), "model.header_hash: expected a lowercase hex sha256, got 'not-hex'"),
        (lambda d: d["machine"]["gpus"][0].update(memory_total=-1), "machine.gpus[0].memory_total: expected an integer >= 0, got -1"),
        (lambda d: d["machine"].update(gpu=[]), "machine.gpu: unknown key; expected one of: fingerprint, hardware_class, cpu_model, physical_cores, logical_cores, ram_total, gpus, unified_memory, system, arch, devices"),
        (lambda d: d.update(min_ctx="8192"), "min_ctx: expected an integer, got '8192'"),
        (lambda d: d.update(min_ctx=65536), "min_ctx: expected at most settings.n_ctx (32768), got 65536"),
        (lambda d: d.update(objective="speed"), "objective: expected one of tg, pp, mixed, aggregate, per-user, ttft, got 'speed'"),
        (lambda d: d.update(created_at="2026-03-01 12:00"), "created_at: expected an ISO-8601 UTC time such as 2026-03-01T12:00:00Z (UTC, with its Z or +00:00), got '2026-03-01 12:00'"),
        (lambda d: d.update(created_at="yesterday"), "created_at: expected an ISO-8601 UTC time such as 2026-03-01T12:00:00Z, got 'yesterday'"),
        (lambda d: d["measured"]["tg"]["samples"].append(float("nan")), "measured.tg.samples[3]: expected a number, got nan"),
        (lambda d: d["measured"]["pp"].update(ci_low=7000), "measured.pp.ci_low: expected at most ci_high (6121.0), got 7000"),
        (lambda d: d["memory"]["predicted"]["CUDA0"].pop("total"), "memory.predicted.CUDA0.total: missing"),
        (lambda d: d["memory"]["actual"].update(CUDA0=[1, 2]), "memory.actual.CUDA0: expected an object, got a list"),
        (lambda d: d["sizing"].update(n_layer=40), "sizing.n_layer: expected model.n_layer (36), got 40"),
        (lambda d: d.update(layers_offloaded=38), "layers_offloaded: expected at most layers_total (37), got 38"),
        (lambda d: d["trials"].update(oom=None), "trials.oom: expected an integer, got null"),
        (lambda d: d.update(study={"name": ""}), "study.name: expected a non-empty string, got ''"),
        (lambda d: d.update(extra=1), "extra: unknown key; expected one of: schema_version, tool_version, created_at, machine, engine, llama_build, model, settings, min_ctx, objective, measured, memory, sizing, layers_offloaded, layers_total, runner_up, trials, study, quality, quality_budget, workload"),
        (lambda d: d.update(schema_version=1.0), f"schema_version: expected \"MAJOR.MINOR\" such as \"{SCHEMA_VERSION}\", got 1.0"),
    ],
)
def test_each_bad_field_is_named_by_its_dotted_path(change, message):
    document = profile_dict()
    change(document)
    assert validation_error(document) == message


def test_not_an_object():
    assert validation_error([1]) == "profile: expected a JSON object, got a list"


def test_unknown_major_schema_version_is_refused():
    document = profile_dict()
    document["schema_version"] = "2.0"
    with pytest.raises(SchemaVersionError) as info:
        Profile.from_dict(document)
    assert str(info.value) == "profile schema 2.0 is newer than this tool understands (1.x); upgrade offload-tuner"
    document["schema_version"] = "0.9"
    with pytest.raises(SchemaVersionError, match=r"^profile schema 0.9 is older than this tool understands \(1.x\); tune the model again$"):
        Profile.from_dict(document)


def test_newer_minor_schema_version_warns_and_ignores_what_it_does_not_know():
    document = profile_dict()
    document["schema_version"] = "1.9"
    document["energy"] = {"joules_per_token": 0.4}
    document["settings"]["numa"] = "distribute"
    document["measured"]["tg"]["p90"] = 150.0
    with pytest.warns(SchemaVersionWarning) as caught:
        profile = Profile.from_dict(document)
    assert [str(w.message) for w in caught] == [
        f"profile schema 1.9 is newer than this tool ({SCHEMA_VERSION}); loading it; ignoring what it does not know: "
        "energy, settings.numa, measured.tg.p90. Upgrade offload-tuner to use everything in it"
    ]
    assert profile.schema_version == "1.9"
    assert profile.settings.n_ctx == 32768


def test_newer_minor_without_unknown_keys_warns_too():
    document = profile_dict()
    document["schema_version"] = "1.5"
    with pytest.warns(SchemaVersionWarning, match=rf"^profile schema 1.5 is newer than this tool \({SCHEMA_VERSION}\); loading it. Upgrade"):
        Profile.from_dict(document)


def _before_1_4(document: dict) -> dict:
    """A document as 1.3 (and before) wrote it: without the repack setting, the device list, the workload and
    n_parallel 1.4 added."""
    document.pop("workload", None)
    for settings in (document["settings"], (document.get("runner_up") or {}).get("settings", {})):
        settings.pop("devices", None)
        settings.pop("repack", None)
        settings.pop("n_parallel", None)
    return document


def test_a_1_3_profile_without_a_device_list_still_loads_and_stays_1_3():
    document = _before_1_4(profile_dict())
    document["schema_version"] = "1.3"
    profile = Profile.from_dict(document)
    assert profile.settings.devices == () and profile.schema_version == "1.3"
    assert profile.to_dict() == json.loads(json.dumps(document))  # a 1.3 reader still accepts it
    assert "-dev" not in export_args(profile, "llama-server")
    # given a device list, it can only be said in 1.4
    listed = profile.replace(settings=profile.settings.replace(devices=("CUDA0",)))
    assert listed.to_dict()["schema_version"] == "1.4"
    assert " -dev CUDA0" in export_args(listed, "llama-server")
    assert "export LLAMA_ARG_DEVICE=CUDA0\n" in export_args(listed, "env")


def _before_1_3(document: dict) -> dict:
    """A document as 1.2 (and before) wrote it: without the engine and device list 1.3 added (nor 1.4's)."""
    _before_1_4(document)
    document.pop("engine", None)
    document["machine"].pop("devices", None)
    return document


def _before_1_2(document: dict) -> dict:
    """A document as 1.0 and 1.1 wrote it: without the settings and sizing keys 1.2 added (nor 1.3's)."""
    _before_1_3(document)
    for settings in (document["settings"], (document.get("runner_up") or {}).get("settings", {})):
        for key in ("swa_full", "n_cpu_moe", "kv_unified"):
            settings.pop(key, None)
    for key in ("sliding_window", "swa_layers", "n_ctx_train"):
        document["sizing"].pop(key, None)
    return document


def test_a_1_0_profile_without_quality_still_loads_and_stays_1_0():
    document = _before_1_2(profile_dict())
    document["schema_version"] = "1.0"
    del document["quality"], document["quality_budget"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile = Profile.from_dict(document)
    assert profile.quality is None and profile.quality_budget is None and profile.schema_version == "1.0"
    # written again, it is still a document a 1.0 reader accepts: no keys it does not know
    assert profile.to_dict() == json.loads(json.dumps(document))


def test_the_quality_a_profile_records():
    profile = Profile.from_dict(profile_dict())
    assert profile.quality.kl_mean == 0.0412 and profile.quality.reference_file == "qwen3-8b-BF16.gguf"
    assert (profile.quality.n_ctx, profile.quality.chunks) == (512, 20)
    assert profile.quality_budget.max_kl == 0.05 and profile.quality_budget.target_met is None
    document = profile_dict()
    document["quality"] = document["quality_budget"] = None  # a tune of one file, asked nothing
    assert Profile.from_dict(document).quality is None


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_an_older_profile_loads_with_the_full_size_window_cache_it_was_measured_with(version):
    """1.0 and 1.1 predate swa_full: their trials ran llama.cpp's C API default, a full-size
    sliding-window cache, so they load with swa_full true and their exports say so (llama-server's
    default is off). Written again, they stay what an older reader accepts."""
    from tuner.profile.exports import export_args

    document = _before_1_2(profile_dict())
    document["schema_version"] = version
    if version == "1.0":
        del document["quality"], document["quality_budget"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile = Profile.from_dict(document)
    assert profile.settings.swa_full is True and profile.runner_up.settings.swa_full is True
    assert profile.settings.llama_kwargs()["swa_full"] is True
    assert " --swa-full" in export_args(profile, "llama-server")
    assert "export LLAMA_ARG_SWA_FULL=1\n" in export_args(profile, "env")
    assert profile.to_dict() == json.loads(json.dumps(document))
    # a current profile without the key gets llama-server's default
    current = profile_dict()
    del current["settings"]["swa_full"]
    assert Profile.from_dict(current).settings.swa_full is False


def test_the_same_minor_version_loads_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Profile.from_dict(profile_dict())


# -- files --------------------------------------------------------------------------------------


def test_write_goes_to_the_user_folder_under_model_and_machine_names(tuner_home):
    profile = Profile.from_dict(profile_dict())
    path = profile.write()
    assert path == tuner_home / "profiles" / f"Qwen3-8B-Q4_K_M--{profile.machine.fingerprint}.json"
    assert read_profile(path) == profile
    assert read_profile(path).path == str(path)
    assert read_profile(path).name == path.stem
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind


def test_write_refuses_an_invalid_profile(tmp_path):
    profile = Profile.from_dict(profile_dict())
    broken = profile.replace(min_ctx=0)
    with pytest.raises(ProfileValidationError, match=r"^min_ctx: expected an integer >= 1, got 0$"):
        broken.write(tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_file_names_from_a_profile_cannot_leave_the_folder():
    document = profile_dict()
    document["model"]["file_name"] = "../../etc/pass wd.gguf"
    assert Profile.from_dict(document).default_filename().startswith("pass_wd--")


def test_read_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": "1.0",,}')
    with pytest.raises(ProfileError) as info:
        read_profile(bad)
    assert str(info.value) == f"{bad}: not valid JSON (line 1, column 26: Expecting property name enclosed in double quotes)"
    with pytest.raises(ProfileError) as info:
        read_profile(tmp_path / "missing.json")
    assert str(info.value) == f"{tmp_path / 'missing.json'}: no such file"
    bundle = write_bundle([Profile.from_dict(profile_dict())], tmp_path / "bundle.json")
    with pytest.raises(ProfileError) as info:
        read_profile(bundle)
    assert str(info.value) == f"{bundle} is a bundle of profiles, not a profile; import it with `offload-tuner profile import {bundle}`"


def test_search_path_is_the_user_folder_then_the_team_folders(tmp_path, monkeypatch, tuner_home):
    team_a, team_b = tmp_path / "team-a", tmp_path / "team-b"
    monkeypatch.setenv("OFFLOAD_TUNER_PROFILE_PATH", os.pathsep.join([str(team_a), "", str(team_b), str(team_a)]))
    assert profile_search_path() == [tuner_home / "profiles", team_a, team_b]
    assert profile_search_path([team_b]) == [team_b]
    assert profile_search_path(f"{team_b}{os.pathsep}{team_a}") == [team_b, team_a]


def test_list_profiles_says_where_each_came_from_and_keeps_errors(tmp_path, monkeypatch, tuner_home):
    team = tmp_path / "team"
    monkeypatch.setenv("OFFLOAD_TUNER_PROFILE_PATH", f"{team}{os.pathsep}{tmp_path / 'not-mounted'}")
    mine = Profile.from_dict(profile_dict()).write()
    theirs = write_profile(team, profile_dict(make_machine(cpu_model="Intel Xeon")))
    broken = team / "broken.json"
    broken.write_text("[]")
    entries = list_profiles()
    assert [(e.path, e.origin) for e in entries] == [
        (mine, tuner_home / "profiles"),
        (theirs, team),
        (broken, team),
    ]
    assert entries[0].profile is not None and entries[0].error is None
    assert str(entries[2].error) == "profile: expected a JSON object, got a list"


def test_resolve_by_path_or_name(tmp_path, tuner_home):
    path = Profile.from_dict(profile_dict()).write()
    assert resolve_profile(str(path)).path == str(path)
    assert resolve_profile(path.stem).path == str(path)
    with pytest.raises(ProfileError) as info:
        resolve_profile("nope")
    assert str(info.value) == (
        f"no profile named 'nope'; searched {tuner_home / 'profiles'}. "
        "`offload-tuner profile list --all` shows every profile found"
    )
    with pytest.raises(ProfileError, match=r"^nope.json: no such profile file$"):
        resolve_profile("nope.json")


# -- bundles ------------------------------------------------------------------------------------


def test_bundle_round_trip_duplicates_conflicts_and_force(tmp_path, monkeypatch):
    first = Profile.from_dict(profile_dict())
    second = Profile.from_dict(profile_dict(fingerprint={"file_name": "Llama-3.1-8B-Q8_0.gguf", "size": 8_540_000_000, "header_hash": "cd" * 32}))
    first.write()
    second.write()
    bundle = tmp_path / "team.json"
    runner = CliRunner()
    result = runner.invoke(profile_group, ["export", "-o", str(bundle)])
    assert result.exit_code == 0, result.output
    assert result.output == f"wrote 2 profile(s) to {bundle}\n"
    assert [item.result for item in read_bundle(bundle)] == [second, first]  # file-name order

    # A teammate with an empty profile folder imports it.
    monkeypatch.setenv("OFFLOAD_TUNER_HOME", str(tmp_path / "teammate"))
    result = runner.invoke(profile_group, ["import", str(bundle)])
    assert result.exit_code == 0, result.output
    dest = tmp_path / "teammate" / "profiles"
    assert sorted(p.name for p in dest.iterdir()) == sorted([first.default_filename(), second.default_filename()])
    assert read_profile(dest / first.default_filename()) == first

    # Importing again: both are duplicates, nothing is written.
    result = runner.invoke(profile_group, ["import", str(bundle)])
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [
        f"profiles[0] duplicate: already present as {dest / second.default_filename()}",
        f"profiles[1] duplicate: already present as {dest / first.default_filename()}",
        "2 duplicate",
    ]
    assert result.stderr == "nothing was overwritten; --force replaces existing profiles\n"

    # The teammate re-tuned the first model: same file name, other settings -> a conflict.
    retuned = first.replace(settings=first.settings.replace(n_ctx=16384))
    retuned.write()
    results = import_bundle(bundle)
    assert [(r.action, r.index) for r in results] == [("duplicate", 0), ("conflict", 1)]
    assert results[1].detail == (
        f"{dest / first.default_filename()} exists with other settings (tuned 2026-03-01T12:00:00Z); --force replaces it"
    )
    assert read_profile(dest / first.default_filename()) == retuned

    result = runner.invoke(profile_group, ["import", str(bundle), "--force"])
    assert result.exit_code == 0, result.output
    assert "profiles[1] replaced -> " in result.output
    assert read_profile(dest / first.default_filename()) == first


def test_a_bundle_reports_invalid_and_repeated_profiles(tmp_path):
    good = profile_dict()
    bad = copy.deepcopy(good)
    bad["settings"]["tensor_split"] = [1, -1]
    newer = copy.deepcopy(good)
    newer["schema_version"] = "2.0"
    bundle = tmp_path / "b.json"
    bundle.write_text(json.dumps({"bundle_version": "1.0", "created_at": "2026-03-01T12:00:00Z", "profiles": [good, bad, good, newer]}))
    results = import_bundle(bundle, dest=tmp_path / "dest")
    assert [(r.action, r.detail) for r in results] == [
        ("imported", "Qwen3-8B-Q4_K_M.gguf on AMD Ryzen 9 7950X 16-Core Processor, NVIDIA GeForce RTX 4090 (24.0 GiB)"),
        ("invalid", "profiles[1].settings.tensor_split[1]: expected a proportion >= 0, got -1"),
        ("duplicate", "same as profiles[0] in this bundle"),
        ("invalid", "profiles[3]: profile schema 2.0 is newer than this tool understands (1.x); upgrade offload-tuner"),
    ]
    result = CliRunner().invoke(profile_group, ["import", str(bundle), "--to", str(tmp_path / "dest2")])
    assert result.exit_code == 2
    assert result.output.endswith(f"Error: 2 profile(s) in {bundle} are invalid and were not imported\n")


def test_a_bundle_of_an_unknown_major_version_is_refused(tmp_path):
    bundle = tmp_path / "b.json"
    bundle.write_text(json.dumps({"bundle_version": "3.1", "profiles": []}))
    with pytest.raises(SchemaVersionError, match=r"^bundle schema 3.1 is newer than this tool understands \(1.x\); upgrade offload-tuner$"):
        read_bundle(bundle)


# -- the CLI ------------------------------------------------------------------------------------


def test_every_command_has_help_with_an_example():
    runner = CliRunner()
    assert "Example" in profile_group.help
    for name, _command in profile_group.commands.items():
        result = runner.invoke(profile_group, [name, "--help"])
        assert result.exit_code == 0
        assert "Example" in result.output, name


def test_list_and_show(tmp_path, monkeypatch):
    machine = make_machine()
    team = tmp_path / "team"
    monkeypatch.setenv("OFFLOAD_TUNER_PROFILE_PATH", str(team))
    mine = Profile.from_dict(profile_dict(machine)).write()
    other = write_profile(team, profile_dict(make_machine(gpus=(("NVIDIA A100-SXM4-80GB", 80 * GiB),))))
    (team / "broken.json").write_text("{")
    runner = CliRunner()

    result = runner.invoke(profile_group, ["list"], obj={"machine": machine})
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[:2] == [mine.stem, f"    from  {mine}  (your profiles: {mine.parent})"]
    assert other.stem not in result.output and "broken" not in result.output

    result = runner.invoke(profile_group, ["list", "--all"])
    assert result.exit_code == 0, result.output
    assert f"    from  {other}  (team folder: {team})" in result.output
    # the line above names the file: this one says what is wrong with it, without the path again
    assert "    cannot be used: not valid JSON (line 1, column 2: Expecting property name enclosed in double quotes)" in result.output

    result = runner.invoke(profile_group, ["list", "--all", "--json"])
    records = [json.loads(line) for line in result.output.splitlines()]
    assert [r["name"] for r in records] == [mine.stem, other.stem, "broken"]

    result = runner.invoke(profile_group, ["show", mine.stem])
    assert result.exit_code == 0, result.output
    assert "  measured  tg 141.2 t/s (95% CI 140.7-141.7), pp 6120.5 t/s (95% CI 6120-6121); 512 prompt / 128 generated tokens at depth 0" in result.output
    assert "    CUDA0: 9.50 GiB (weights 4.50 GiB, kv 4.50 GiB, compute 512 MiB); actual 9.48 GiB" in result.output
    result = runner.invoke(profile_group, ["show", str(mine), "--json"])
    assert json.loads(result.output) == json.loads(mine.read_text())

    result = runner.invoke(profile_group, ["show", "nope"])
    assert result.exit_code == 2
    assert "Error: no profile named 'nope'" in result.output


# -- staying light ------------------------------------------------------------------------------


def test_importing_the_profile_api_imports_nothing_heavy():
    code = (
        "import sys, tuner.profile.document, tuner.profile.store, tuner.profile.apps, tuner.profile.exports\n"
        "heavy = sorted(m for m in ('optuna', 'gguf', 'numpy', 'llama_cpp', 'torch') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
