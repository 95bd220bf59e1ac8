"""Profiles in apps: selection, validation at load, degradation to fit free memory now, tuner.profile.apps.Llama.

Every machine here is injected (``make_machine``); no test reads the real hardware or loads llama.cpp.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from tests.test_profile import GiB, MiB, make_gguf, make_machine, profile_dict, write_profile
from tuner.profile.apps import Llama, check_profile, load_profile
from tuner.errors import NoMatchingProfileError, ProfileMismatchError
from tuner.model.gguf import model_fingerprint
from tuner.machine.probe import GPUProcess, LlamaBuild
from tuner.profile.document import (
    LlamaBuildWarning,
    Profile,
    ProfileAdjustedWarning,
    ProfileDegradedWarning,
    ProfileWarning,
)

TRAINER = GPUProcess(pid=4242, name="python train.py", used_memory=14 * GiB)
XORG = GPUProcess(pid=1312, name="/usr/lib/xorg/Xorg", used_memory=None)
HOLDERS = "GPU 0 memory is held by pid 4242 python train.py (14.00 GiB), pid 1312 /usr/lib/xorg/Xorg (size not reported)"


@pytest.fixture
def model(tmp_path) -> Path:
    return make_gguf(tmp_path / "models" / "Qwen3-8B-Q4_K_M.gguf")


@pytest.fixture
def folder(tmp_path) -> Path:
    path = tmp_path / "profiles"
    path.mkdir()
    return path


# -- selection ----------------------------------------------------------------------------------


def test_an_exact_machine_match_wins_over_a_newer_one_of_the_same_hardware_class(model, folder):
    here = make_machine()
    twin = make_machine(cpu_model="Intel Core i9-14900K", uuid_prefix="GPU-77aa")
    assert twin.hardware_class() == here.hardware_class() and twin.fingerprint() != here.fingerprint()
    fingerprint = model_fingerprint(model)
    exact = write_profile(folder, profile_dict(here, fingerprint), "exact.json")
    newer = profile_dict(twin, fingerprint)
    newer["created_at"] = "2026-06-01T00:00:00Z"
    write_profile(folder, newer, "twin.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile = load_profile(model, search_path=[folder], machine=here)
    assert profile.path == str(exact)
    assert profile.degradation == ()
    assert profile.settings.model_path == str(model)  # the app's path, never the recorded one
    assert profile.llama_kwargs()["model_path"] == str(model)


def test_the_same_hardware_class_is_used_when_no_exact_match_exists(model, folder):
    tuned_on = make_machine(cpu_model="Intel Core i9-14900K", uuid_prefix="GPU-77aa", physical_cores=24)
    here = make_machine(physical_cores=6, logical_cores=12)
    document = profile_dict(tuned_on, model_fingerprint(model), n_threads=16)
    path = write_profile(folder, document)
    with pytest.warns(ProfileAdjustedWarning) as caught:
        profile = load_profile(model, search_path=[folder], machine=here)
    assert profile.path == str(path)
    assert profile.settings.n_threads == 6 and profile.settings.n_threads_batch == 12
    assert profile.degradation == (
        "n_threads reduced from 16 to 6: this machine has 6 physical cores",
        "n_threads_batch reduced from 16 to 12: this machine has 12 logical cores",
    )
    assert str(caught[0].message) == (
        f"profile {path.stem} changed to fit this machine now:\n"
        "  - n_threads reduced from 16 to 6: this machine has 6 physical cores\n"
        "  - n_threads_batch reduced from 16 to 12: this machine has 12 logical cores\n"
        "Pass strict=True to raise instead."
    )


def test_no_match_lists_every_profile_found_and_why(model, folder, tmp_path):
    here = make_machine()
    fingerprint = model_fingerprint(model)
    other_model = write_profile(folder, profile_dict(here, {"file_name": "Llama-3.1-8B-Q8_0.gguf", "size": 8_540_000_000, "header_hash": "cd" * 32}), "a.json")
    bigger = write_profile(folder, profile_dict(here, {**fingerprint, "size": fingerprint["size"] + 1}), "b.json")
    rehashed = write_profile(folder, profile_dict(here, {**fingerprint, "header_hash": "ef" * 32}), "c.json")
    a100 = make_machine(cpu_model="AMD EPYC 7763", gpus=(("NVIDIA A100-SXM4-80GB", 80 * GiB),) * 2)
    elsewhere = write_profile(folder, profile_dict(a100, fingerprint), "d.json")
    broken = folder / "e.json"
    broken.write_text('{"schema_version": "1.0"}')
    with pytest.raises(NoMatchingProfileError) as info:
        load_profile(model, search_path=[folder], machine=here)
    size, short_hash = fingerprint["size"], fingerprint["header_hash"][:12]
    assert str(info.value) == (
        "no profile for Qwen3-8B-Q4_K_M.gguf on this machine (AMD Ryzen 9 7950X 16-Core Processor, "
        "NVIDIA GeForce RTX 4090 (24.0 GiB)); 5 profile(s) found, none matches:\n"
        f"  {other_model}: for another model (Llama-3.1-8B-Q8_0.gguf)\n"
        f"  {bigger}: made for a different file with the same name: Qwen3-8B-Q4_K_M.gguf was {size + 1} bytes "
        f"with header hash {short_hash} when tuned; this one is {size} bytes with header hash {short_hash}\n"
        f"  {rehashed}: made for a different file with the same name: Qwen3-8B-Q4_K_M.gguf was {size} bytes "
        f"with header hash efefefefefef when tuned; this one is {size} bytes with header hash {short_hash}\n"
        f"  {elsewhere}: for another machine (AMD EPYC 7763, 2x NVIDIA A100-SXM4-80GB (80.0 GiB)): neither its "
        f"fingerprint {a100.fingerprint()} nor its hardware class {a100.hardware_class()} is this machine's (CPU: AMD "
        "EPYC 7763 when tuned, AMD Ryzen 9 7950X 16-Core Processor here; devices llama.cpp uses: NVIDIA A100-SXM4-80GB "
        "(80 GiB), NVIDIA A100-SXM4-80GB (80 GiB) when tuned, NVIDIA GeForce RTX 4090 (24 GiB) here)\n"
        f"  {broken}: unreadable: tool_version: missing\n"
        f"Tune it here with `offload-tuner tune {model}`, or add a team's profile folder to OFFLOAD_TUNER_PROFILE_PATH."
    )


def test_no_profile_at_all(model, tmp_path):
    empty = tmp_path / "empty"
    with pytest.raises(NoMatchingProfileError) as info:
        load_profile(model, search_path=[empty], machine=make_machine(gpus=()))
    assert str(info.value) == (
        f"no profile for Qwen3-8B-Q4_K_M.gguf on this machine (AMD Ryzen 9 7950X 16-Core Processor, no GPU): "
        f"no profiles found in {empty}. Tune it here with `offload-tuner tune {model}`, or add a team's profile "
        "folder to OFFLOAD_TUNER_PROFILE_PATH."
    )


def test_a_renamed_copy_of_the_tuned_file_still_matches(model, folder, tmp_path):
    write_profile(folder, profile_dict(make_machine(), model_fingerprint(model)))
    copy_path = tmp_path / "elsewhere" / "qwen.gguf"
    copy_path.parent.mkdir()
    copy_path.write_bytes(model.read_bytes())
    assert load_profile(copy_path, search_path=[folder], machine=make_machine()).settings.model_path == str(copy_path)


# -- validation at load -------------------------------------------------------------------------


def test_a_given_profile_for_a_different_file_of_the_same_name_is_refused(model, tmp_path):
    fingerprint = model_fingerprint(model)
    other = make_gguf(tmp_path / "other" / "Qwen3-8B-Q4_K_M.gguf", rows=8)  # same name, larger file
    profile = Profile.from_dict(profile_dict(make_machine(), model_fingerprint(other)))
    with pytest.raises(ProfileMismatchError) as info:
        check_profile(profile, model, machine=make_machine())
    assert str(info.value) == (
        f"profile {profile.name} is made for a different file with the same name: Qwen3-8B-Q4_K_M.gguf was "
        f"{other.stat().st_size} bytes with header hash {model_fingerprint(other)['header_hash'][:12]} when tuned; "
        f"this one is {fingerprint['size']} bytes with header hash {fingerprint['header_hash'][:12]}; tune this "
        "file, or load the file that was tuned"
    )


def test_same_size_but_another_header_is_refused(model):
    fingerprint = model_fingerprint(model)
    profile = Profile.from_dict(profile_dict(make_machine(), {**fingerprint, "header_hash": "0" * 64}))
    with pytest.raises(ProfileMismatchError, match=r"was \d+ bytes with header hash 000000000000 when tuned; this one is"):
        check_profile(profile, model, machine=make_machine())


def test_another_llama_cpp_build_is_a_warning(model):
    here = make_machine(llama=LlamaBuild(llama_cpp_python="0.3.40", llama_cpp_build="b7600"))
    profile = Profile.from_dict(profile_dict(here, model_fingerprint(model)))
    with pytest.warns(LlamaBuildWarning) as caught:
        loaded = check_profile(profile, model, machine=here)
    assert str(caught[0].message) == (
        f"profile {profile.name} was measured with llama-cpp-python 0.3.36, this machine has 0.3.40; "
        "llama.cpp build b7400, this machine has b7600: speed and memory use may differ; tune again to be sure"
    )
    assert loaded.degradation == ()
    # An unknown build (not probed) is not a difference.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_profile(profile, model, machine=make_machine(llama=LlamaBuild()))


def test_a_profile_measured_with_the_users_binaries_warns_an_app_running_llama_cpp_python(model):
    here = make_machine(llama=LlamaBuild(llama_cpp_python="0.3.36"))
    document = profile_dict(here, model_fingerprint(model))
    document["engine"] = {"name": "llama-cpp", "build": "b6895 (4341dc8bc)", "path": "/opt/llama.cpp/bin"}
    profile = Profile.from_dict(document)
    with pytest.warns(LlamaBuildWarning) as caught:
        check_profile(profile, model, machine=here)
    assert str(caught[0].message) == (
        f"profile {profile.name} was measured with llama.cpp binaries (build b6895 (4341dc8bc), /opt/llama.cpp/bin); "
        "this app runs llama-cpp-python 0.3.36: speed and memory use may differ; tune with --engine python to measure "
        "the llama.cpp this app runs"
    )


def test_an_app_running_binaries_is_warned_only_when_their_build_differs(model, llama_bin):
    from tuner.engine.llamacpp import LlamaCppEngine

    with LlamaCppEngine(llama_bin) as engine:
        theirs = engine.build().describe()
    here = make_machine()
    document = profile_dict(here, model_fingerprint(model))
    document["engine"] = {"name": "llama-cpp", "build": theirs, "path": str(llama_bin)}
    same = Profile.from_dict(document)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_profile(same, model, machine=here, llama_bin=llama_bin)
    document["engine"]["build"] = "b6895 (4341dc8bc)"
    other = Profile.from_dict(document)
    with pytest.warns(LlamaBuildWarning) as caught:
        check_profile(other, model, machine=here, llama_bin=llama_bin)
    assert str(caught[0].message) == (
        f"profile {other.name} was measured with llama.cpp binaries, llama.cpp build b6895 (4341dc8bc); the binaries in "
        f"{llama_bin} are build {theirs}: speed and memory use may differ; tune again to be sure"
    )


def test_a_profile_that_still_fits_is_unchanged(model):
    here = make_machine(free=(10 * GiB,))  # 9.5 GiB needed + 256 MiB margin
    profile = Profile.from_dict(profile_dict(here, model_fingerprint(model)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = check_profile(profile, model, machine=here)
    assert loaded.degradation == ()
    assert loaded.settings == profile.settings.replace(model_path=str(model))


def test_less_free_vram_reduces_the_context_first(model):
    here = make_machine(free=(8 * GiB,), processes=((TRAINER, XORG),))
    profile = Profile.from_dict(profile_dict(here, model_fingerprint(model)))
    with pytest.warns(ProfileAdjustedWarning) as caught:
        loaded = check_profile(profile, model, machine=here)
    assert [w.category for w in caught] == [ProfileAdjustedWarning]
    # 1.75 GiB to free at 36 layers x 4096 bytes per token: 12743 tokens, in 256-token steps.
    assert loaded.settings.n_ctx == 19968
    assert loaded.settings.n_gpu_layers == -1
    assert loaded.degradation == (
        "context reduced from 32768 to 19968 tokens (not below the profile's min_ctx, 8192) because CUDA0 (NVIDIA "
        f"GeForce RTX 4090) has 8.00 GiB free now and would need 9.50 GiB + 256 MiB margin; {HOLDERS}",
    )
    assert loaded.llama_kwargs()["n_ctx"] == 19968


def test_then_fewer_gpu_layers_loudly_and_never_below_min_ctx(model):
    here = make_machine(free=(5 * GiB,), processes=((TRAINER, XORG),))
    profile = Profile.from_dict(profile_dict(here, model_fingerprint(model)))
    with pytest.warns(ProfileDegradedWarning) as caught:
        loaded = check_profile(profile, model, machine=here)
    # At min_ctx 8192 CUDA0 needs 6.125 GiB: 1.375 GiB more to shed than 4.75 GiB allow; the output layer
    # (432 MiB) goes first, then 7 layers of 116 MiB weights + 32 MiB KV each.
    assert (loaded.settings.n_ctx, loaded.settings.n_gpu_layers) == (8192, 29)
    changes = (
        "context reduced from 32768 to 8192 tokens (not below the profile's min_ctx, 8192) because CUDA0 (NVIDIA "
        f"GeForce RTX 4090) has 5.00 GiB free now and would need 9.50 GiB + 256 MiB margin; {HOLDERS}",
        "GPU layers reduced from all 37 to 29 of 37: a partial offload the profile did not choose, so generation "
        "will be slower than the 141.2 t/s it measured. Because even at the minimum context (8192 tokens), CUDA0 "
        f"(NVIDIA GeForce RTX 4090) has 5.00 GiB free now and would need 6.12 GiB + 256 MiB margin; {HOLDERS}",
    )
    assert loaded.degradation == changes
    assert str(caught[0].message) == (
        f"PARTIAL OFFLOAD: profile {profile.name} changed to fit this machine now:\n"
        + "".join(f"  - {c}\n" for c in changes)
        + "Pass strict=True to raise instead."
    )
    assert issubclass(ProfileDegradedWarning, ProfileAdjustedWarning)


@pytest.mark.parametrize("swa_full, expected_ctx", [(False, 24064), (True, 31232)])
def test_a_sliding_window_model_frees_only_what_its_caches_hold(model, swa_full, expected_ctx):
    """Gemma-style: 30 of 36 layers slide over 1024 tokens. Without swa_full their caches hold the
    window and a micro-batch (1536 cells) whatever the context, so shrinking the context frees only
    the 6 full layers' KV: 200 MiB take 8534 tokens (24064 in 256-token steps). With swa_full every
    layer's cache is context-sized: 200 MiB take 1423 tokens (31232)."""
    per_token_layer = 4096
    cells = {False: 6 * 32768 + 30 * 1536, True: 36 * 32768}[swa_full]
    kv = per_token_layer * cells
    need = 4608 * MiB + kv + 512 * MiB
    here = make_machine(free=(need + 256 * MiB - 200 * MiB,))
    document = profile_dict(here, model_fingerprint(model), swa_full=swa_full)
    document["sizing"].update(sliding_window=1024, swa_layers=30)
    document["memory"]["predicted"]["CUDA0"] = {"weights": 4608 * MiB, "kv": kv, "compute": 512 * MiB, "total": need}
    del document["memory"]["actual"]["CUDA0"]
    with pytest.warns(ProfileAdjustedWarning):
        loaded = check_profile(Profile.from_dict(document), model, machine=here)
    assert loaded.settings.n_ctx == expected_ctx and loaded.settings.n_gpu_layers == -1


def test_strict_raises_with_the_same_explanation(model, folder):
    here = make_machine(free=(5 * GiB,), processes=((TRAINER, XORG),))
    write_profile(folder, profile_dict(here, model_fingerprint(model)))
    with pytest.raises(ProfileMismatchError) as info:
        load_profile(model, search_path=[folder], machine=here, strict=True)
    message = str(info.value)
    assert message.startswith(f"profile Qwen3-8B-Q4_K_M--{here.fingerprint()} does not fit this machine as recorded; loading it would need:\n  - context reduced from 32768 to 8192 tokens")
    assert "\n  - GPU layers reduced from all 37 to 29 of 37: a partial offload" in message
    assert message.endswith("\nFree the memory, or load with strict=False to accept these changes.")


def test_when_nothing_fits_it_is_an_error_even_without_strict(model):
    here = make_machine(free=(200 * MiB,), processes=((TRAINER,),))
    profile = Profile.from_dict(profile_dict(here, model_fingerprint(model)))
    with pytest.raises(ProfileMismatchError) as info:
        check_profile(profile, model, machine=here)
    assert str(info.value) == (
        f"profile {profile.name} does not fit this machine now, even with a context of 8192 tokens and no layer "
        "on the GPU: CUDA0 (NVIDIA GeForce RTX 4090) has 200 MiB free now and would need 512 MiB + 256 MiB "
        "margin; GPU 0 memory is held by pid 4242 python train.py (14.00 GiB). Free the memory, or tune again on "
        "this machine as it is"
    )


def test_layers_shed_from_two_gpus_in_proportion_and_host_ram_counts_without_mmap(model):
    gpus = (("NVIDIA GeForce RTX 3090", 24 * GiB),) * 2
    here = make_machine(gpus=gpus, free=(20 * GiB, 3 * GiB), ram_available=40 * GiB)
    document = profile_dict(here, model_fingerprint(model), tensor_split=[1, 1], use_mmap=False)
    document["memory"]["predicted"] = {
        "CUDA0": {"weights": 2304 * MiB, "kv": 2304 * MiB, "compute": 512 * MiB, "total": 5120 * MiB},
        "CUDA1": {"weights": 2304 * MiB, "kv": 2304 * MiB, "compute": 512 * MiB, "total": 5120 * MiB},
        "CPU": {"weights": 297 * MiB, "kv": 0, "compute": 40 * MiB, "total": 337 * MiB},
    }
    document["memory"]["actual"] = {}
    document["min_ctx"] = 32768  # the context may not shrink: only layers can move
    profile = Profile.from_dict(document)
    with pytest.warns(ProfileDegradedWarning):
        loaded = check_profile(profile, model, machine=here)
    # CUDA1 must shed 5 GiB + 256 MiB - 3 GiB = 2.25 GiB; it holds half of each layer moved
    # (58 MiB weights + 64 MiB KV at 32k): the output layer (216 MiB for CUDA1), then 18 layers.
    assert loaded.settings.n_gpu_layers == 18
    assert loaded.settings.n_ctx == 32768
    assert "CUDA1 (NVIDIA GeForce RTX 3090) has 3.00 GiB free now and would need 5.00 GiB + 256 MiB margin; NVML lists no process holding memory on GPU 1" in loaded.degradation[0]

    # Without mmap the weights moved count against RAM: too little RAM means no fit at all.
    poor = make_machine(gpus=gpus, free=(20 * GiB, 3 * GiB), ram_available=3 * GiB)
    with pytest.raises(ProfileMismatchError, match=r"CPU \(RAM\) has 3.00 GiB free now and would need"):
        check_profile(profile, model, machine=poor)


def test_rpc_devices_are_matched_by_endpoint(model):
    here = make_machine(gpus=())
    here = type(here)(**{**here.__dict__, "rpc_devices": ({"endpoint": "10.0.0.2:50052", "name": "RPC0", "memory_total": 8 * GiB, "memory_free": 1 * GiB},)})
    document = profile_dict(here, model_fingerprint(model), rpc_servers=["10.0.0.2:50052"], n_ctx=8192)
    document["memory"]["predicted"] = {
        "RPC0[10.0.0.2:50052]": {"weights": 4608 * MiB, "kv": 1152 * MiB, "compute": 300 * MiB, "total": 6060 * MiB},
        "CPU": {"weights": 297 * MiB, "kv": 0, "compute": 40 * MiB, "total": 337 * MiB},
    }
    document["memory"]["actual"] = {}
    profile = Profile.from_dict(document)
    with pytest.warns(ProfileDegradedWarning):
        loaded = check_profile(profile, model, machine=here)
    assert "RPC0[10.0.0.2:50052] (RPC0) has 1.00 GiB free now" in loaded.degradation[-1]


def test_a_device_this_machine_cannot_report_is_named(model):
    here = make_machine()
    document = profile_dict(here, model_fingerprint(model))
    document["memory"]["predicted"]["CUDA1"] = {"weights": 0, "kv": 0, "compute": 100 * MiB, "total": 100 * MiB}
    with pytest.warns(ProfileWarning) as caught:
        check_profile(Profile.from_dict(document), model, machine=here)
    assert [str(w.message) for w in caught] == [
        f"profile {Profile.from_dict(document).name}: cannot check free memory on CUDA1 (this machine lists 1 GPU(s): NVML 575.57.08: 1 GPU(s))"
    ]


def test_unified_memory_accelerators_share_the_ram(model):
    mac = make_machine(cpu_model="Apple M2 Pro", gpus=(), ram_available=8 * GiB)
    mac = type(mac)(**{**mac.__dict__, "unified_memory": True})
    document = profile_dict(mac, model_fingerprint(model))
    document["memory"]["predicted"] = {
        "Metal": {"weights": 4608 * MiB, "kv": 4608 * MiB, "compute": 512 * MiB, "total": 9728 * MiB},
        "CPU": {"weights": 297 * MiB, "kv": 0, "compute": 40 * MiB, "total": 337 * MiB},
    }
    document["memory"]["actual"] = {}
    with pytest.warns(ProfileAdjustedWarning):
        loaded = check_profile(Profile.from_dict(document), model, machine=mac)
    assert loaded.settings.n_ctx == 19712
    assert loaded.settings.n_gpu_layers == -1
    assert "CPU (RAM) has 8.00 GiB free now and would need 9.54 GiB" in loaded.degradation[0]


# -- tuner.profile.apps.Llama ---------------------------------------------------------------------------


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    """A stand-in for llama_cpp that records what Llama() passes; the real one is never loaded here."""
    module = types.ModuleType("llama_cpp")
    module.calls = []
    module.gpu_offload = True

    class FakeLlama:
        def __init__(self, **kwargs):
            module.calls.append(kwargs)

    module.Llama = FakeLlama
    module.llama_supports_gpu_offload = lambda: module.gpu_offload
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    return module


def test_llama_loads_with_the_profile_and_overrides_win(model, folder, fake_llama_cpp):
    here = make_machine()
    write_profile(folder, profile_dict(here, model_fingerprint(model)))
    Llama(model, search_path=[folder], machine=here, n_ctx=4096, seed=7)
    (kwargs,) = fake_llama_cpp.calls
    assert kwargs == {
        "model_path": str(model),
        "n_gpu_layers": -1,
        "split_mode": 1,
        "main_gpu": 0,
        "n_ctx": 4096,
        "n_batch": 2048,
        "n_ubatch": 512,
        "flash_attn": True,
        "type_k": 1,
        "type_v": 1,
        "offload_kqv": True,
        "swa_full": False,
        "use_mmap": True,
        "use_mlock": False,
        "op_offload": True,
        "n_threads": 8,
        "n_threads_batch": 16,
        "seed": 7,
        "verbose": False,
    }


def test_llama_takes_a_profile_object_or_path(model, folder, fake_llama_cpp):
    here = make_machine()
    path = write_profile(folder, profile_dict(here, model_fingerprint(model)))
    Llama(model, profile=str(path), machine=here)
    Llama(model, profile=load_profile(model, search_path=[folder], machine=here))
    assert [c["model_path"] for c in fake_llama_cpp.calls] == [str(model), str(model)]


def test_llama_without_gpu_offload_in_the_build_is_loud(model, folder, fake_llama_cpp):
    here = make_machine()
    write_profile(folder, profile_dict(here, model_fingerprint(model)))
    fake_llama_cpp.gpu_offload = False
    with pytest.warns(ProfileDegradedWarning, match=r"^PARTIAL OFFLOAD: profile .* puts -1 layer\(s\) on the GPU, but this llama-cpp-python is built without GPU offload"):
        Llama(model, search_path=[folder], machine=here)
    with pytest.raises(ProfileMismatchError, match=r"built without GPU offload"):
        Llama(model, search_path=[folder], machine=here, strict=True)
    assert len(fake_llama_cpp.calls) == 1


_REAL_APP = r"""
import json, sys, warnings
from tuner.profile.apps import Llama
from tuner.machine.probe import probe
warnings.simplefilter("ignore")
llm = Llama(sys.argv[1], profile=sys.argv[2], machine=probe(llama=False, rpc_servers=tuple(json.loads(sys.argv[3]))), verbose=True)
out = llm("hello", max_tokens=4, temperature=0.0)
print(json.dumps({"tokens": out["usage"]["completion_tokens"]}))
"""


def _real_profile(folder: Path, model: Path, **settings) -> Path:
    from tuner.machine.probe import probe

    here = probe(llama=False)
    document = profile_dict(here, model_fingerprint(model), **settings)
    document["settings"].update(n_gpu_layers=settings.get("n_gpu_layers", 0), n_ctx=512, n_batch=512, n_ubatch=512,
                                n_threads=2, n_threads_batch=2, flash_attn="on", tensor_split=None)
    document["min_ctx"] = 512
    document["memory"] = {"predicted": {"CPU": {"weights": 1, "kv": 1, "compute": 1, "total": 3}}, "actual": {}}
    return write_profile(folder, document)


def _run_app(model: Path, profile: Path, servers: list[str] = ()) -> subprocess.CompletedProcess:
    import json as _json

    return subprocess.run([sys.executable, "-c", _REAL_APP, str(model), str(profile), _json.dumps(list(servers))],
                          capture_output=True, text=True, timeout=120)


def test_llama_applies_tensor_overrides_in_the_real_llama_cpp(models, tmp_path):
    profile = _real_profile(tmp_path / "profiles", models["q8_0"], tensor_overrides=[r"blk\.(0|1)\.ffn_up"])
    proc = _run_app(models["q8_0"], profile)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensor blk.0.ffn_up.weight" in proc.stderr and "buffer type overridden to CPU" in proc.stderr
    assert "blk.2.ffn_up.weight (" not in proc.stderr
    assert '"tokens": ' in proc.stdout


def test_llama_applies_n_cpu_moe_as_llama_cpp_does(models, tmp_path):
    """--n-cpu-moe 2 keeps the experts of layers 0 and 1 on the CPU: tuner.Llama applies the same patterns."""
    profile = _real_profile(tmp_path / "profiles", models["moe"], n_cpu_moe=2)
    proc = _run_app(models["moe"], profile)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for layer in (0, 1):
        assert f"tensor blk.{layer}.ffn_up_exps.weight (" in proc.stderr
    assert "blk.2.ffn_up_exps.weight (" not in proc.stderr and "buffer type overridden to CPU" in proc.stderr


def test_llama_registers_rpc_servers_and_offloads_to_them(models, tmp_path, rpc_servers):
    (server,) = rpc_servers(1)
    profile = _real_profile(tmp_path / "profiles", models["q8_0"], rpc_servers=[server.endpoint], n_gpu_layers=99)
    proc = _run_app(models["q8_0"], profile, [server.endpoint])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"RPC0[{server.endpoint}] model buffer size" in proc.stderr
    assert "offloaded 5/5 layers to GPU" in proc.stderr


def test_the_recorded_model_path_is_never_used(model, folder):
    here = make_machine()
    document = profile_dict(here, model_fingerprint(model))
    document["settings"]["model_path"] = "/etc/passwd"
    write_profile(folder, copy.deepcopy(document))
    loaded = load_profile(model, search_path=[folder], machine=here)
    assert loaded.settings.model_path == str(model)
    assert "/etc/passwd" not in str(loaded.llama_kwargs())


# -- the examples, end to end -------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def profile_for_this_machine(tmp_path, tuner_home):
    """A tiny real model and a CPU-only profile for whatever machine runs the test."""
    from tuner.profile.apps import this_machine
    from tuner.testing import ModelShape, make_model

    model = make_model(tmp_path / "tiny.gguf", ModelShape(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128, n_vocab=320, n_ctx_train=512))
    document = profile_dict(
        this_machine(), model_fingerprint(model),
        n_gpu_layers=0, n_ctx=512, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1, flash_attn="auto",
    )  # fmt: skip
    document.update(min_ctx=256, layers_total=3, layers_offloaded=0, runner_up=None)
    document["model"]["n_layer"] = document["sizing"]["n_layer"] = 2
    document["memory"] = {"predicted": {"CPU": {"weights": 5 * MiB, "kv": MiB, "compute": 2 * MiB, "total": 8 * MiB}}, "actual": {}}
    Profile.from_dict(document).write()
    return model


def _run_example(name: str, *args: str, tuner_home: Path) -> "subprocess.CompletedProcess[str]":
    env = {**os.environ, "OFFLOAD_TUNER_HOME": str(tuner_home), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], capture_output=True, text=True, env=env, timeout=300)


def test_serve_from_profile_starts_the_server_with_the_profile_flags(profile_for_this_machine, tuner_home, tmp_path):
    model = profile_for_this_machine
    fake_server = tmp_path / "llama-server"
    fake_server.write_text('#!/bin/sh\necho "llama-server got: $*"\n')
    fake_server.chmod(0o755)
    proc = _run_example("serve_from_profile.py", str(model), "--server-bin", str(fake_server), "--port", "9000", "--", "--metrics",
                        tuner_home=tuner_home)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        f"llama-server got: -m {model} -ngl 0 -c 512 -b 64 -ub 64 -t 1 -tb 1 -fa auto -ctk f16 -ctv f16 -np 1 "
        "--host 127.0.0.1 --port 9000 --metrics\n"
    )
    # serving two at once with a profile tuned for one: -np 2, and the memory that needs, said
    two = _run_example("serve_from_profile.py", str(model), "--server-bin", str(fake_server), "--parallel", "2", tuner_home=tuner_home)
    assert two.returncode == 0, two.stderr
    assert " -np 2 --host" in two.stdout
    assert "was tuned for 1 user(s) at once" in two.stderr and "serving 2 (-np 2)" in two.stderr
    missing = _run_example("serve_from_profile.py", str(model), "--server-bin", str(tmp_path / "nope"), tuner_home=tuner_home)
    assert missing.returncode == 2
    assert missing.stderr.startswith(f"cannot start llama-server: {tmp_path / 'nope'} is not an executable file.")


@pytest.mark.slow
def test_app_generate_loads_the_profile_in_llama_cpp_and_generates(profile_for_this_machine, tuner_home):
    proc = _run_example("app_generate.py", str(profile_for_this_machine), "Hello", "--max-tokens", "4", tuner_home=tuner_home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "profile tiny--" in proc.stderr


def test_profile_check_command_says_what_an_app_would_load(model, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from tuner.cli.profile import profile_group

    here = make_machine(free=(8 * GiB,), processes=((TRAINER,),))
    team = tmp_path / "team"
    monkeypatch.setenv("OFFLOAD_TUNER_PROFILE_PATH", str(team))
    path = write_profile(team, profile_dict(here, model_fingerprint(model)))
    result = CliRunner().invoke(profile_group, ["check", str(model)], obj={"machine": here})
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"{path.stem}  ({path})",
        "changed to fit this machine now:",
        "  - context reduced from 32768 to 19968 tokens (not below the profile's min_ctx, 8192) because CUDA0 "
        "(NVIDIA GeForce RTX 4090) has 8.00 GiB free now and would need 9.50 GiB + 256 MiB margin; GPU 0 memory "
        "is held by pid 4242 python train.py (14.00 GiB)",
        f"llama-server -m {model} -ngl 37 -c 19968 -b 2048 -ub 512 -t 8 -tb 16 -fa on -ctk f16 -ctv f16 -np 1",
    ]
    assert result.stderr.startswith(f"warning: profile {path.stem} changed to fit this machine now:")

    result = CliRunner().invoke(profile_group, ["check", str(model), "--strict"], obj={"machine": here})
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == "Free the memory, or load with strict=False to accept these changes."
    assert f"Error: profile {path.stem} does not fit this machine as recorded; loading it would need:" in result.stderr
