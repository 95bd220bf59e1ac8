"""The profile: the winning way to run one model on one machine, as a versioned JSON document.

A profile is data. It is parsed and validated field by field, errors name the dotted path of the bad
field (``settings.tensor_split[1]: expected a proportion >= 0, got -1``), and nothing in it is ever
executed or imported. The model path it records is the path on the machine that tuned: apps replace
it with their own (see ``tuner.profile.apps``).

This module is light on purpose (apps import it): the standard library, ``tuner.engine.settings`` and
``tuner.paths`` only; no optuna, gguf, numpy or llama_cpp.

Schema versions are ``MAJOR.MINOR``. An unknown major version is refused (``SchemaVersionError``). A
newer minor version of the same major loads with a ``SchemaVersionWarning``; the keys this tool does not
know are ignored, at any depth, and the warning names them. In the current or an older minor version an
unknown key is an error, so a typo (``n_gpu_layer``) never passes silently.

The document (schema 1.4); sizes are bytes, speeds tokens per second. 1.1 added ``quality`` and
``quality_budget``; a 1.0 document (without them) loads as it always did:

=============================  ===============================================================================
key                            meaning
=============================  ===============================================================================
``schema_version``             ``"1.4"``
``tool_version``               the offload-tuner version that wrote it
``created_at``                 ISO-8601 UTC time, e.g. ``"2026-03-01T12:00:00Z"``
``machine``                    ``fingerprint`` (exact machine), ``hardware_class`` (same GPU models and
                               memory), ``cpu_model``, ``physical_cores``, ``logical_cores``, ``ram_total``,
                               ``gpus`` (``[{index, name, uuid, memory_total, driver}]``),
                               ``unified_memory``, ``system``, ``arch``, ``devices`` (1.3: the accelerators as
                               llama.cpp listed them: ``[{name, description, type, memory_total,
                               unified_memory}]``, ``type`` ``gpu`` or ``igpu``)
``engine``                     (1.3) what measured it: ``name`` (``"python"``: llama-cpp-python; ``"llama-cpp"``:
                               the user's llama.cpp binaries), ``build`` (llama.cpp's build, e.g.
                               ``"b6895 (4341dc8bc)"``), ``path`` (the binaries' folder or the package's);
                               ``null`` before 1.3 (the python engine)
``llama_build``                ``llama_cpp_python`` (version), ``llama_cpp_build`` (build number or commit),
                               ``backends`` (list), ``gpu_offload``, ``rpc``
``model``                      ``file_name``, ``size``, ``header_hash`` (sha256 of the GGUF header and tensor
                               table), ``architecture``, ``quantization``, ``n_layer``
``settings``                   every ``tuner.engine.settings.Settings`` field (``model_path`` is the tuning machine's
                               path: not trusted elsewhere; apps substitute their own)
``min_ctx``                    the smallest context the user needs; degradation at load never goes below it
``objective``                  ``"tg"``, ``"pp"``, ``"mixed"``, ``"aggregate"``, ``"per-user"`` or ``"ttft"``
                               (``tuner.search.objective``)
``workload``                   (1.4) what it was tuned for: ``users`` (sequences decoded together;
                               ``settings.n_parallel`` is the same number), ``n_prompt``, ``n_gen``,
                               ``depth``, ``objective``, ``min_user_tg`` (``null``: no floor), and its
                               figures at that load: ``aggregate_tg`` and ``per_user_tg``
                               ``{median, ci_low, ci_high}`` (t/s), ``ttft_s`` ``{p50, p95, ci_low,
                               ci_high, samples}`` (seconds to the first token of every user's prompt
                               arriving at once); ``null`` before 1.4 (one user, as ``measured``)
``measured``                   ``pp`` and ``tg``: ``{median, mean, stddev, ci_low, ci_high, samples}`` (``ci_low``..``ci_high``:
                               a 95% interval of the median, within the samples' range);
                               ``n_prompt``, ``n_gen``, ``depth`` (the benchmark's shape)
``memory``                     ``predicted``: ``{device: {weights, kv, compute, total}}``; ``actual``:
                               ``{device: {weights, kv, compute}}``; devices as llama.cpp names them:
                               ``CPU``, ``CUDA0``, ``Metal``, ``Vulkan0``, ``RPC0[127.0.0.1:50052]``...
``sizing``                     ``n_layer``, ``layer_weight_bytes`` and ``output_weight_bytes`` (per repeating
                               layer and output layer), ``kv_bytes_per_token_per_layer``,
                               ``sliding_window`` (tokens; 0: none) and ``swa_layers`` (how many layers
                               slide), ``n_ctx_train``: lets an app re-plan memory at load without
                               reading the GGUF
``layers_offloaded``           layers llama.cpp reported on the GPU (``null`` if not reported)
``layers_total``               layers llama.cpp counts (the repeating layers + the output layer)
``runner_up``                  ``null``, or ``{settings, pp, tg}`` when the second best was within noise
``trials``                     ``{run, pruned, oom, failed}``
``study``                      ``null``, or ``{name, storage}`` of the Optuna study it came from (the storage URL
                               without credentials: removed on reading and writing)
``quality``                    ``null``, or the chosen variant's quality against the reference (as
                               ``offload-tuner quality`` measures it): ``kl`` ``{mean, median, p99}``,
                               ``top1_agreement``, ``ppl``, ``ppl_ratio``, ``reference`` ``{file_name, sha256}``,
                               ``corpus_sha256``, ``n_ctx``, ``chunks``
``quality_budget``             ``null``, or what the tune was asked: ``max_kl``, ``max_ppl_increase`` (percent),
                               ``min_tg``, ``min_pp`` (each ``null`` when not asked) and ``target_met``
                               (``null`` without a target)
=============================  ===============================================================================

Versions: 1.2 added settings from newer llama.cpp (``swa_full``, ``n_cpu_moe``, ``kv_unified``) and the
model's sliding window and training context to ``sizing``. A 1.0 or 1.1 profile still loads, with the
values it was measured with: ``swa_full`` true, the C API default the python engine ran then (its
memory arithmetic is then the same with or without a window, so the sizing it lacks is not needed);
``n_cpu_moe`` 0 and ``kv_unified`` false. 1.3 added ``engine`` and ``machine.devices`` (an older profile
reads with ``engine`` null: it was measured by the python engine, and no device list). 1.4 added
``settings.repack`` (llama.cpp's weight repacking, ``use_extra_bufts``; an older profile reads with it
true, llama.cpp's default), ``workload`` and ``settings.n_parallel`` (an older profile reads with
one user: what it measured) and
``settings.devices``: the devices llama.cpp offloads to, by the names ``-dev`` takes (``CUDA0``,
``Vulkan1``, ``RPC0``), in its order; a profile without it reads with ``[]`` (llama.cpp's own choice).
The machine's ``fingerprint`` and ``hardware_class`` are identity v2 (``tuner.machine.identity``) in
profiles written now; one written before still matches this machine through ``legacy_identities``.

Where profile files live and how bundles carry them: ``tuner.profile.store``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from .. import limits
from ..errors import ProfileValidationError, SchemaVersionError, SettingsError
from ..paths import atomic_write_text, profiles_dir
from ..engine.settings import Settings
from .dburl import redact_url

if TYPE_CHECKING:
    from ..machine.probe import LlamaBuild, Machine

SCHEMA_VERSION = "1.4"
ENGINES = ("python", "llama-cpp")
BUNDLE_VERSION = "1.0"
OBJECTIVES = ("tg", "pp", "mixed", "aggregate", "per-user", "ttft")  # tuner.search.objective
# A profile is a few KiB; refuse to parse anything absurd (a wrong file on the search path).
MAX_PROFILE_BYTES = 16 << 20
MAX_BUNDLE_BYTES = 256 << 20

# (matched with fullmatch: "$" also matches before a trailing newline)
_VERSION_RE = re.compile(r"(\d{1,6})\.(\d{1,6})")
_HEX_RE = re.compile(r"[0-9a-f]{8,128}")
_UNSAFE_NAME_RE = re.compile(r"[^A-Za-z0-9._-]+")


# -- warnings ----------------------------------------------------------------------------------------


class ProfileWarning(UserWarning):
    """Root of the warnings about profiles (filter this one to silence them all)."""


class SchemaVersionWarning(ProfileWarning):
    """The profile was written by a newer minor schema version; unknown keys were ignored."""


class LlamaBuildWarning(ProfileWarning):
    """The profile was measured with another llama.cpp build; its speed may differ here."""


class ProfileAdjustedWarning(ProfileWarning):
    """The profile was adjusted to fit this machine now (e.g. a smaller context)."""


class ProfileDegradedWarning(ProfileAdjustedWarning):
    """Fewer layers on the GPU than the profile chose: a partial offload, slower than measured."""


# -- the document ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPUInfo:
    index: int
    name: str
    uuid: str
    memory_total: int
    driver: str


@dataclass(frozen=True)
class DeviceRecord:
    """An accelerator as llama.cpp listed it on the tuning machine."""

    name: str  # CUDA0, ROCm0, Vulkan0, MTL0, RPC0[host:port] ...
    description: str
    type: str  # gpu or igpu
    memory_total: int | None
    unified_memory: bool


@dataclass(frozen=True)
class EngineInfo:
    """What measured the profile: the engine and the llama.cpp build it ran."""

    name: str  # "python" (llama-cpp-python) or "llama-cpp" (the user's binaries)
    build: str  # e.g. "b6895 (4341dc8bc)"
    path: str | None  # the binaries' folder, or llama-cpp-python's package folder


@dataclass(frozen=True)
class MachineInfo:
    """The tuning machine, as recorded. ``fingerprint`` and ``hardware_class`` come from ``Machine``."""

    fingerprint: str
    hardware_class: str
    cpu_model: str
    physical_cores: int
    logical_cores: int
    ram_total: int
    gpus: tuple[GPUInfo, ...]
    unified_memory: bool
    system: str
    arch: str
    devices: tuple[DeviceRecord, ...] = ()

    @classmethod
    def from_machine(cls, machine: "Machine") -> "MachineInfo":
        return cls(
            fingerprint=machine.fingerprint(),
            hardware_class=machine.hardware_class(),
            cpu_model=machine.cpu_model,
            physical_cores=machine.physical_cores,
            logical_cores=machine.logical_cores,
            ram_total=machine.ram_total,
            gpus=tuple(GPUInfo(g.index, g.name, g.uuid, g.memory_total, g.driver) for g in machine.gpus),
            unified_memory=machine.unified_memory,
            system=machine.system,
            arch=machine.arch,
            devices=tuple(DeviceRecord(d["name"], d.get("description", ""), d.get("type", "gpu"), d.get("memory_total"),
                                       bool(d.get("unified_memory"))) for d in machine.accelerators()),
        )

    def describe(self) -> str:
        """``'AMD Ryzen 9 7950X, 2x NVIDIA GeForce RTX 4090 (24.0 GiB)'`` for messages (the GPUs llama.cpp
        listed where NVML saw none: ``'Apple M2 Pro, Apple M2 Pro (21.3 GiB)'``)."""
        gpus = [(g.name, g.memory_total) for g in self.gpus] or [
            (d.description or d.name, d.memory_total or 0) for d in self.devices if not d.name.startswith("RPC")]
        return f"{self.cpu_model}, {describe_gpus(gpus)}"


@dataclass(frozen=True)
class LlamaBuildInfo:
    llama_cpp_python: str | None
    llama_cpp_build: str | None
    backends: tuple[str, ...]
    gpu_offload: bool
    rpc: bool

    @classmethod
    def from_build(cls, build: "LlamaBuild") -> "LlamaBuildInfo":
        return cls(build.llama_cpp_python, build.llama_cpp_build, tuple(build.backends), build.gpu_offload, build.rpc)


@dataclass(frozen=True)
class ModelInfo:
    """The model's identity (``tuner.model.gguf.model_fingerprint``) and the facts apps show."""

    file_name: str
    size: int
    header_hash: str
    architecture: str
    quantization: str | None
    n_layer: int


@dataclass(frozen=True)
class Stats:
    """Repeated measurements of one speed, in tokens per second."""

    median: float
    mean: float
    stddev: float
    ci_low: float
    ci_high: float
    samples: tuple[float, ...] = ()


@dataclass(frozen=True)
class Measured:
    pp: Stats
    tg: Stats
    n_prompt: int
    n_gen: int
    depth: int


@dataclass(frozen=True)
class Interval:
    """A median with its 95% interval (t/s)."""

    median: float
    ci_low: float
    ci_high: float


@dataclass(frozen=True)
class TimeToFirstToken:
    """Seconds to the first token over the repetitions: p50, p95, the median's 95% interval, the samples."""

    p50: float
    p95: float
    ci_low: float
    ci_high: float
    samples: tuple[float, ...] = ()


@dataclass(frozen=True)
class CurvePoint:
    """A candidate's figures at ``users`` sequences (the knee of ``Workload.curve``)."""

    users: int
    candidate: str  # "winner" or "second"
    aggregate_tg: Interval | None = None
    per_user_tg: Interval | None = None
    ttft_s: TimeToFirstToken | None = None


@dataclass(frozen=True)
class Workload:
    """What a profile was tuned for (1.4), and its figures at that load."""

    users: int
    n_prompt: int
    n_gen: int
    depth: int
    objective: str
    min_user_tg: float | None = None
    aggregate_tg: Interval | None = None
    per_user_tg: Interval | None = None
    ttft_s: TimeToFirstToken | None = None
    curve: tuple[CurvePoint, ...] = ()  # the winner and the next contender at 1, 2, 4... users


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device holds. ``total`` is recorded for predictions (it may include padding)."""

    weights: int
    kv: int
    compute: int
    total: int | None = None

    @property
    def need(self) -> int:
        return self.total if self.total is not None else self.weights + self.kv + self.compute


@dataclass(frozen=True)
class Memory:
    """Per device, keyed by llama.cpp's device name, in the order llama.cpp lists them."""

    predicted: dict[str, DeviceMemory]
    actual: dict[str, DeviceMemory]


@dataclass(frozen=True)
class Sizing:
    """Per-layer averages for the chosen quantization and KV types, to re-plan memory at load."""

    n_layer: int
    layer_weight_bytes: int
    output_weight_bytes: int
    kv_bytes_per_token_per_layer: float
    sliding_window: int = 0  # tokens a sliding-window layer attends to; 0: the model has none
    swa_layers: int = 0  # how many of the n_layer layers slide
    n_ctx_train: int | None = None  # the model's training context (what n_ctx 0 means); None: not recorded


@dataclass(frozen=True)
class RunnerUp:
    settings: Settings
    pp: Stats
    tg: Stats


@dataclass(frozen=True)
class Trials:
    run: int
    pruned: int
    oom: int
    failed: int


@dataclass(frozen=True)
class StudyRef:
    """Where the study lives (informational: a profile never opens it)."""

    name: str
    storage: str | None


@dataclass(frozen=True)
class QualityInfo:
    """The chosen variant's quality against the reference (``tuner.search.quality``)."""

    kl_mean: float
    kl_median: float
    kl_p99: float
    top1_agreement: float
    ppl: float
    ppl_ratio: float
    reference_file: str
    reference_sha256: str
    corpus_sha256: str
    n_ctx: int
    chunks: int


@dataclass(frozen=True)
class QualityBudgetInfo:
    """What the tune was asked: a quality budget, a speed target, or both (``None``: not asked)."""

    max_kl: float | None = None
    max_ppl_increase: float | None = None
    min_tg: float | None = None
    min_pp: float | None = None
    target_met: bool | None = None


@dataclass(frozen=True)
class Profile:
    """One profile. Build it in code, then ``validate()``; or read one with ``read_profile``.

    ``path`` (where it was read from) and ``degradation`` (what ``tuner.profile.apps`` changed to make it fit
    this machine now, in words; empty when nothing changed) are not part of the document.
    """

    tool_version: str
    created_at: str
    machine: MachineInfo
    llama_build: LlamaBuildInfo
    model: ModelInfo
    settings: Settings
    min_ctx: int
    objective: str
    measured: Measured
    memory: Memory
    sizing: Sizing
    layers_total: int
    trials: Trials
    layers_offloaded: int | None = None
    runner_up: RunnerUp | None = None
    study: StudyRef | None = None
    quality: QualityInfo | None = None
    quality_budget: QualityBudgetInfo | None = None
    engine: EngineInfo | None = None  # None: a profile from before 1.3, measured by the python engine
    workload: Workload | None = None  # None: a profile from before 1.4, tuned for one user
    schema_version: str = SCHEMA_VERSION
    path: str | None = field(default=None, compare=False)
    degradation: tuple[str, ...] = field(default=(), compare=False)

    # -- conversions ---------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Profile":
        """Parse and validate a profile document. Raises ``ProfileValidationError`` (dotted path) or
        ``SchemaVersionError``; warns ``SchemaVersionWarning`` for a newer minor version."""
        if not isinstance(data, Mapping):
            raise ProfileValidationError("profile", f"expected a JSON object, got {_kind(data)}")
        version = _schema_version(data, "schema_version", "profile")
        ctx = _Context(lenient=version[1] > _major_minor(SCHEMA_VERSION)[1], version=version)
        profile = _parse_profile(data, ctx)
        if ctx.lenient:
            ignored = f"; ignoring what it does not know: {', '.join(ctx.ignored)}" if ctx.ignored else ""
            warnings.warn(
                f"profile schema {data['schema_version']} is newer than this tool ({SCHEMA_VERSION}); "
                f"loading it{ignored}. Upgrade offload-tuner to use everything in it",
                SchemaVersionWarning,
                stacklevel=2,
            )
        return profile

    @classmethod
    def from_tuning(
        cls,
        *,
        machine: "Machine",
        model: Mapping[str, Any],
        settings: Settings,
        min_ctx: int,
        objective: str,
        measured: Mapping[str, Any],
        memory: Mapping[str, Any],
        sizing: Mapping[str, Any],
        layers_offloaded: int | None,
        layers_total: int,
        trials: Mapping[str, int],
        runner_up: Mapping[str, Any] | None = None,
        study: Mapping[str, Any] | None = None,
        quality: Mapping[str, Any] | None = None,
        quality_budget: Mapping[str, Any] | None = None,
        engine: Mapping[str, Any] | None = None,
        workload: Mapping[str, Any] | None = None,
    ) -> "Profile":
        """The profile of a finished tune, validated as a reader will read it. The schema version,
        the tool version and the time are this module's to set.

        ``model`` is ``ModelInfo.fingerprint()``; ``measured`` is ``{pp, tg, n_prompt, n_gen, depth}``
        with ``Stats`` dicts; ``memory`` is ``{predicted, actual}`` per device; ``sizing`` as the
        document's ``sizing``; ``study`` is ``{name, storage}`` with any password already removed;
        ``quality`` and ``quality_budget`` are the document's (``None`` when the tune measured none /
        was asked none); ``engine`` is ``{name, build, path}`` of the engine that measured it.
        """
        machine_info = MachineInfo.from_machine(machine)
        build = LlamaBuildInfo.from_build(machine.llama)
        data = {
            "schema_version": SCHEMA_VERSION,
            "tool_version": tool_version(),
            "created_at": utc_now(),
            "machine": {**_asdict(machine_info), "gpus": [_asdict(g) for g in machine_info.gpus],
                        "devices": [_asdict(d) for d in machine_info.devices]},
            "engine": dict(engine) if engine is not None else None,
            "llama_build": {**_asdict(build), "backends": list(build.backends)},
            "model": dict(model),
            "settings": settings.to_dict(),
            "min_ctx": min_ctx,
            "objective": objective,
            "measured": dict(measured),
            "memory": {"predicted": dict(memory.get("predicted", {})), "actual": dict(memory.get("actual", {}))},
            "sizing": dict(sizing),
            "layers_offloaded": layers_offloaded,
            "layers_total": layers_total,
            "runner_up": dict(runner_up) if runner_up is not None else None,
            "trials": dict(trials),
            "study": dict(study) if study is not None else None,
            "quality": dict(quality) if quality is not None else None,
            "quality_budget": dict(quality_budget) if quality_budget is not None else None,
            "workload": dict(workload) if workload is not None else None,
        }
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "schema_version": self.schema_version,
            "tool_version": self.tool_version,
            "created_at": self.created_at,
            "machine": {**_asdict(self.machine), "gpus": [_asdict(g) for g in self.machine.gpus],
                        "devices": [_asdict(d) for d in self.machine.devices]},
            "engine": None if self.engine is None else _asdict(self.engine),
            "llama_build": {**_asdict(self.llama_build), "backends": list(self.llama_build.backends)},
            "model": _asdict(self.model),
            "settings": self.settings.to_dict(),
            "min_ctx": self.min_ctx,
            "objective": self.objective,
            "measured": {
                "pp": _stats_dict(self.measured.pp),
                "tg": _stats_dict(self.measured.tg),
                "n_prompt": self.measured.n_prompt,
                "n_gen": self.measured.n_gen,
                "depth": self.measured.depth,
            },
            "memory": {
                "predicted": {name: _memory_dict(m) for name, m in self.memory.predicted.items()},
                "actual": {name: _memory_dict(m) for name, m in self.memory.actual.items()},
            },
            "sizing": _asdict(self.sizing),
            "layers_offloaded": self.layers_offloaded,
            "layers_total": self.layers_total,
            "runner_up": None
            if self.runner_up is None
            else {
                "settings": self.runner_up.settings.to_dict(),
                "pp": _stats_dict(self.runner_up.pp),
                "tg": _stats_dict(self.runner_up.tg),
            },
            "trials": _asdict(self.trials),
            "study": None if self.study is None else {
                "name": self.study.name,
                "storage": None if self.study.storage is None else redact_url(self.study.storage),
            },
        }
        # 1.2's settings only in a 1.2 (or later) document, and 1.1's keys only in a 1.1 one: an older
        # profile written again stays one an older reader accepts (it refuses keys it does not know in
        # its own version). Left out, a setting reads back as the value that version implies.
        # 1.4 added repack, the device list, n_parallel and the workload: an older document reads as
        # llama.cpp's defaults (repacking on, its own choice of devices) and one user, so a profile that
        # differs from them can only be said in 1.4 (then with every key of the versions before it);
        # one that does not stays at its own version, without those keys.
        out["workload"] = None if self.workload is None else _workload_dict(self.workload)
        blocks = [out["settings"]] + ([out["runner_up"]["settings"]] if out.get("runner_up") else [])
        if _major_minor(out["schema_version"]) < (1, 4):
            if (self.workload is None and all(block.get("repack", True) is True for block in blocks)
                    and not any(block.get("devices") for block in blocks)
                    and all(block.get("n_parallel", 1) == 1 for block in blocks)):
                del out["workload"]
                for block in blocks:
                    for key in ("repack", "devices", "n_parallel"):
                        block.pop(key, None)
            else:
                out["schema_version"] = "1.4"
        if _major_minor(out["schema_version"]) < (1, 2):
            _older_settings(out)
        if _major_minor(out["schema_version"]) >= (1, 1):
            out["quality"] = None if self.quality is None else _quality_dict(self.quality)
            out["quality_budget"] = None if self.quality_budget is None else _asdict(self.quality_budget)
        # 1.3's engine and device list likewise: left out of an older document that has none (it reads
        # back the same), and a document that has them is a 1.3 one.
        if _major_minor(out["schema_version"]) < (1, 3):
            if self.engine is None and not self.machine.devices:
                del out["engine"]
                del out["machine"]["devices"]
            else:
                out["schema_version"] = "1.3"
        return out

    @property
    def users(self) -> int:
        """The concurrent users the profile was tuned for (1 before 1.4)."""
        return self.workload.users if self.workload is not None else self.settings.n_parallel

    def validate(self) -> None:
        """Check a profile built in code against the schema, as a reader will."""
        type(self).from_dict(self.to_dict())

    def replace(self, **changes: Any) -> "Profile":
        return dataclasses.replace(self, **changes)

    # -- identity and files --------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The name ``offload-tuner profile`` commands accept: the file's stem."""
        return Path(self.path).stem if self.path else Path(self.default_filename()).stem

    def default_filename(self) -> str:
        # (the stem is cut at 100 characters: a file name has at most 255 bytes)
        stem = _UNSAFE_NAME_RE.sub("_", Path(self.model.file_name).stem).strip("._")[:100] or "model"
        # a profile for several users is another profile of the same model on the same machine
        users = f"--{self.users}users" if self.users > 1 else ""
        return f"{stem}--{self.machine.fingerprint[:64]}{users}.json"

    def identity(self) -> str:
        """What makes two profiles the same: model header, machine, settings (not the model's path)."""
        settings = self.settings.to_dict()
        settings.pop("model_path")
        key = {"header_hash": self.model.header_hash, "machine": self.machine.fingerprint, "settings": settings}
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n"

    def write(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Validate, then write atomically (``target_path`` says where). Returns the path; a file
        that cannot be written raises ``FileWriteError``."""
        self.validate()
        return atomic_write_text(self.target_path(path), self.to_json())

    def target_path(self, path: str | os.PathLike[str] | None = None) -> Path:
        """Where ``write(path)`` writes: ``path``; inside it, under ``default_filename()``, when it is
        a folder (or ends with a separator); by default the user's profile folder."""
        if path is None or Path(path).is_dir() or os.fspath(path).endswith((os.sep, "/")):
            return output_folder(path) / self.default_filename()
        return Path(path)

    # -- for apps ------------------------------------------------------------------------------

    def llama_kwargs(self, model_path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Keyword arguments for ``llama_cpp.Llama``. ``model_path`` replaces the recorded path.

        ``tensor_overrides`` and ``rpc_servers`` have no ``Llama`` keyword; ``tuner.profile.apps.Llama``
        applies them.
        """
        kwargs = self.settings.llama_kwargs()
        if model_path is not None:
            kwargs["model_path"] = os.fspath(model_path)
        return kwargs

    def cli_args(self, tool: str = "llama-server", model_path: str | os.PathLike[str] | None = None) -> list[str]:
        """Flags for ``llama-server``, ``llama-cli`` or ``llama-bench``, as an argv list."""
        return self.settings.cli_args(tool, model_path=None if model_path is None else os.fspath(model_path))


def output_folder(path: str | os.PathLike[str] | None) -> Path:
    """The folder a profile written to ``path`` lands in (``Profile.target_path``): the user's
    profile folder by default; ``path`` itself when it is a folder or ends with a separator; else
    the folder ``path`` names a file in."""
    if path is None:
        return profiles_dir()
    text = os.fspath(path)
    if Path(text).is_dir() or text.endswith((os.sep, "/")):
        return Path(text)
    return Path(text).parent


def utc_now() -> str:
    """Now, as ``created_at`` records it: ``2026-03-01T12:00:00Z``."""
    return datetime.now(timezone.utc).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe_gpus(gpus: Sequence[tuple[str, int]]) -> str:
    """``[(name, memory_total)]`` -> ``'2x NVIDIA GeForce RTX 4090 (24.0 GiB)'``, or ``'no GPU'``."""
    if not gpus:
        return "no GPU"
    counts: dict[tuple[str, int], int] = {}
    for gpu in gpus:
        counts[gpu] = counts.get(gpu, 0) + 1
    return " + ".join(
        f"{n}x {name} ({gib(memory)})" if n > 1 else f"{name} ({gib(memory)})" for (name, memory), n in counts.items()
    )


def gib(n_bytes: float) -> str:
    return f"{n_bytes / (1 << 30):.1f} GiB"


def format_bytes(n_bytes: float) -> str:
    """``'9.50 GiB'``, or ``'512 MiB'`` below a GiB: sizes for people (bytes everywhere else)."""
    return f"{n_bytes / (1 << 30):.2f} GiB" if abs(n_bytes) >= 1 << 30 else f"{n_bytes / (1 << 20):.0f} MiB"


def tool_version() -> str:
    from .. import __version__

    return __version__


# -- parsing, field by field -------------------------------------------------------------------

_MISSING: Any = object()


@dataclass
class _Context:
    lenient: bool  # a newer minor version: unknown keys are ignored (and listed) instead of refused
    version: tuple[int, int] = (1, 2)  # the document's schema version
    ignored: list[str] = field(default_factory=list)


def _major_minor(version: str) -> tuple[int, int]:
    match = _VERSION_RE.fullmatch(version)
    assert match, version
    return int(match[1]), int(match[2])


def _schema_version(data: Mapping[str, Any], key: str, what: str, expected: str = SCHEMA_VERSION) -> tuple[int, int]:
    if key not in data:
        raise ProfileValidationError(key, "missing")
    value = data[key]
    match = _VERSION_RE.fullmatch(value) if isinstance(value, str) else None
    if not match:
        raise ProfileValidationError(key, f'expected "MAJOR.MINOR" such as "{expected}", got {value!r}')
    major, minor = int(match[1]), int(match[2])
    ours = _major_minor(expected)[0]
    if major > ours:
        raise SchemaVersionError(f"{what} schema {value} is newer than this tool understands ({ours}.x); upgrade offload-tuner")
    if major < ours:
        raise SchemaVersionError(f"{what} schema {value} is older than this tool understands ({ours}.x); tune the model again")
    return major, minor


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    if value is None:
        return "null"
    text = limits.shown(value)
    return f"{text} ({len(value)} characters)" if isinstance(value, str) and len(value) > 80 else text


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _message(exc: SettingsError | ProfileValidationError) -> str:
    # Both put "<field>: <message>" in args[0]; keep the message, the caller re-homes the field.
    return str(exc)[len(exc.field) + 2 :]


def _obj(value: Any, path: str, known: Sequence[str], ctx: _Context) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ProfileValidationError(path, f"expected an object, got {_kind(value)}")
    unknown = [k for k in value if k not in known]
    if unknown:
        if not ctx.lenient:
            raise ProfileValidationError(_join(path, str(unknown[0])), f"unknown key; expected one of: {', '.join(known)}")
        ctx.ignored += [_join(path, str(k)) for k in unknown]
    return value


def _get(data: Mapping[str, Any], key: str, path: str, default: Any = _MISSING) -> Any:
    if key in data:
        return data[key]
    if default is _MISSING:
        raise ProfileValidationError(_join(path, key), "missing")
    return default


def _int(data: Mapping[str, Any], key: str, path: str, *, minimum: int | None = 0, maximum: int = limits.MAX_DOCUMENT_INT,
         nullable: bool = False, default: Any = _MISSING) -> Any:
    value = _get(data, key, path, default)
    if value is None and nullable:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        expected = "an integer" + (" or null" if nullable else "")
        raise ProfileValidationError(_join(path, key), f"expected {expected}, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise ProfileValidationError(_join(path, key), f"expected an integer >= {minimum}, got {_kind(value)}")
    if value > maximum:
        raise ProfileValidationError(_join(path, key), f"expected an integer <= {maximum}, got {_kind(value)}")
    return value


def _number(value: Any, path: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ProfileValidationError(path, f"expected a number, got {_kind(value)}")
    if value < 0:
        raise ProfileValidationError(path, f"expected a number >= 0, got {value}")
    if value > limits.MAX_DOCUMENT_FLOAT:
        raise ProfileValidationError(path, f"expected a number <= {limits.MAX_DOCUMENT_FLOAT:g}, got {_kind(value)}")
    return value


def _str(data: Mapping[str, Any], key: str, path: str, *, nullable: bool = False, pattern: re.Pattern[str] | None = None, hint: str = "", default: Any = _MISSING) -> Any:
    value = _get(data, key, path, default)
    if value is None and nullable:
        return None
    if not isinstance(value, str) or (pattern is None and not value):
        expected = "a non-empty string" + (" or null" if nullable else "")
        raise ProfileValidationError(_join(path, key), f"expected {expected}, got {_kind(value)}")
    if pattern is not None and not pattern.fullmatch(value):
        raise ProfileValidationError(_join(path, key), f"expected {hint}, got {_kind(value)}")
    return _plain_text(value, _join(path, key))


def _text(data: Mapping[str, Any], key: str, path: str) -> str:
    """A string that may be empty (e.g. a GPU's uuid where the driver gave none)."""
    value = _get(data, key, path)
    if not isinstance(value, str):
        raise ProfileValidationError(_join(path, key), f"expected a string, got {_kind(value)}")
    return _plain_text(value, _join(path, key))


def _plain_text(value: str, path: str, limit: int = limits.MAX_PATH) -> str:
    """Every string of a profile ends up in a terminal, a shell line or a Modelfile: no control
    characters (a newline in a file name became a command when an export was sourced), and a length
    no name or path reaches."""
    if len(value) > limit:
        raise ProfileValidationError(path, f"expected at most {limit} characters, got {len(value)}")
    bad = limits.control_character(value)
    if bad is not None:
        raise ProfileValidationError(path, f"holds a control character ({bad}); a name in a profile must be printable")
    return value


def _bool(data: Mapping[str, Any], key: str, path: str) -> bool:
    value = _get(data, key, path)
    if not isinstance(value, bool):
        raise ProfileValidationError(_join(path, key), f"expected true or false, got {_kind(value)}")
    return value


def _list(data: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = _get(data, key, path)
    if not isinstance(value, list):
        raise ProfileValidationError(_join(path, key), f"expected a list, got {_kind(value)}")
    return value


def _created_at(data: Mapping[str, Any]) -> str:
    value = _get(data, "created_at", "")
    hint = "an ISO-8601 UTC time such as 2026-03-01T12:00:00Z"
    if not isinstance(value, str):
        raise ProfileValidationError("created_at", f"expected {hint}, got {_kind(value)}")
    try:
        # Python 3.10's fromisoformat does not take the "Z" suffix.
        parsed = datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith("Z") else value)
    except ValueError:
        raise ProfileValidationError("created_at", f"expected {hint}, got {value!r}") from None
    if parsed.utcoffset() != timezone.utc.utcoffset(None):
        raise ProfileValidationError("created_at", f"expected {hint} (UTC, with its Z or +00:00), got {value!r}")
    return value


# Settings added in 1.2, with the value a profile that predates them was measured with. A 1.0 or 1.1
# profile came from the python engine, which ran llama.cpp's C API default: a full-size
# sliding-window cache (llama_context_default_params().swa_full is true).
_BEFORE_1_2 = {"swa_full": True, "n_cpu_moe": 0, "kv_unified": False}


# The sizing 1.2 added, as a pre-1.2 document reads (nothing recorded).
_SIZING_BEFORE_1_2 = {"sliding_window": 0, "swa_layers": 0, "n_ctx_train": None}


def _older_settings(out: dict[str, Any]) -> None:
    """Drop from a pre-1.2 document the settings and sizing keys 1.2 added, when they hold the value
    that version implies (a pre-1.2 profile changed in one of them is written as 1.2, the first
    version that can say it)."""
    blocks = [out["settings"]] + ([out["runner_up"]["settings"]] if out.get("runner_up") else [])
    if (any(block.get(key) != value for block in blocks for key, value in _BEFORE_1_2.items())
            or any(out["sizing"].get(key) != value for key, value in _SIZING_BEFORE_1_2.items())):
        out["schema_version"] = "1.2"
        return
    for block in blocks:
        for key in _BEFORE_1_2:
            block.pop(key, None)
    for key in _SIZING_BEFORE_1_2:
        out["sizing"].pop(key, None)


def _settings(value: Any, path: str, ctx: _Context) -> Settings:
    if isinstance(value, Mapping) and ctx.version < (1, 2):
        value = {**_BEFORE_1_2, **value}
    if ctx.lenient and isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(Settings)}
        ctx.ignored += [_join(path, str(k)) for k in value if k not in known]
        value = {k: v for k, v in value.items() if k in known}
    try:
        return Settings.from_dict(value, prefix=path)
    except SettingsError as exc:
        raise ProfileValidationError(exc.field, _message(exc)) from None


def _stats(value: Any, path: str, ctx: _Context) -> Stats:
    data = _obj(value, path, ("median", "mean", "stddev", "ci_low", "ci_high", "samples"), ctx)
    numbers = {k: _number(_get(data, k, path), _join(path, k)) for k in ("median", "mean", "stddev", "ci_low", "ci_high")}
    if numbers["ci_low"] > numbers["ci_high"]:
        raise ProfileValidationError(_join(path, "ci_low"), f"expected at most ci_high ({numbers['ci_high']}), got {numbers['ci_low']}")
    samples = _list(data, "samples", path)
    return Stats(**numbers, samples=tuple(_number(s, f"{path}.samples[{i}]") for i, s in enumerate(samples)))


def _device_memory(value: Any, path: str, ctx: _Context, with_total: bool) -> DeviceMemory:
    keys = ("weights", "kv", "compute", "total")
    data = _obj(value, path, keys, ctx)
    total = _int(data, "total", path, nullable=not with_total, default=None if not with_total else _MISSING)
    return DeviceMemory(_int(data, "weights", path), _int(data, "kv", path), _int(data, "compute", path), total)


def _devices(value: Any, path: str, ctx: _Context, with_total: bool) -> dict[str, DeviceMemory]:
    if not isinstance(value, Mapping):
        raise ProfileValidationError(path, f"expected an object of devices, got {_kind(value)}")
    out = {}
    for name, memory in value.items():
        if not isinstance(name, str) or not name.strip():
            raise ProfileValidationError(path, f"expected device names such as CUDA0, got {_kind(name)}")
        _plain_text(name, path, limit=limits.MAX_NAME)
        out[name] = _device_memory(memory, f"{path}.{name}", ctx, with_total)
    return out


def _interval(value: Any, path: str, ctx: _Context) -> Interval | None:
    if value is None:
        return None
    data = _obj(value, path, ("median", "ci_low", "ci_high"), ctx)
    numbers = {k: _number(_get(data, k, path), _join(path, k)) for k in ("median", "ci_low", "ci_high")}
    if numbers["ci_low"] > numbers["ci_high"]:
        raise ProfileValidationError(_join(path, "ci_low"), f"expected at most ci_high ({numbers['ci_high']}), got {numbers['ci_low']}")
    return Interval(**numbers)


def _ttft(value: Any, path: str, ctx: _Context) -> TimeToFirstToken | None:
    if value is None:
        return None
    t = _obj(value, path, ("p50", "p95", "ci_low", "ci_high", "samples"), ctx)
    numbers = {k: _number(_get(t, k, path), _join(path, k)) for k in ("p50", "p95", "ci_low", "ci_high")}
    samples = _list(t, "samples", path)
    return TimeToFirstToken(**numbers, samples=tuple(_number(x, f"{path}.samples[{i}]") for i, x in enumerate(samples)))


def _workload(value: Any, ctx: _Context) -> Workload | None:
    if value is None:
        return None
    path = "workload"
    w = _obj(value, path, ("users", "n_prompt", "n_gen", "depth", "objective", "min_user_tg", "aggregate_tg",
                           "per_user_tg", "ttft_s", "curve"), ctx)
    objective = _get(w, "objective", path)
    if objective not in OBJECTIVES:
        raise ProfileValidationError("workload.objective", f"expected one of {', '.join(OBJECTIVES)}, got {_kind(objective)}")
    floor = _get(w, "min_user_tg", path, None)
    curve = []
    raw = _get(w, "curve", path, [])
    if not isinstance(raw, list):
        raise ProfileValidationError("workload.curve", f"expected a list, got {_kind(raw)}")
    if len(raw) > 64:
        raise ProfileValidationError("workload.curve", f"expected at most 64 points, got {len(raw)}")
    for i, point in enumerate(raw):
        pp_ = f"workload.curve[{i}]"
        point = _obj(point, pp_, ("users", "candidate", "aggregate_tg", "per_user_tg", "ttft_s"), ctx)
        who = _get(point, "candidate", pp_)
        if who not in ("winner", "second"):
            raise ProfileValidationError(f"{pp_}.candidate", f"expected winner or second, got {_kind(who)}")
        curve.append(CurvePoint(users=_int(point, "users", pp_, minimum=1, maximum=limits.MAX_PARALLEL), candidate=who,
                                aggregate_tg=_interval(_get(point, "aggregate_tg", pp_, None), f"{pp_}.aggregate_tg", ctx),
                                per_user_tg=_interval(_get(point, "per_user_tg", pp_, None), f"{pp_}.per_user_tg", ctx),
                                ttft_s=_ttft(_get(point, "ttft_s", pp_, None), f"{pp_}.ttft_s", ctx)))
    return Workload(
        users=_int(w, "users", path, minimum=1, maximum=limits.MAX_PARALLEL),
        n_prompt=_int(w, "n_prompt", path), n_gen=_int(w, "n_gen", path), depth=_int(w, "depth", path),
        objective=objective,
        min_user_tg=None if floor is None else _number(floor, "workload.min_user_tg"),
        aggregate_tg=_interval(_get(w, "aggregate_tg", path, None), "workload.aggregate_tg", ctx),
        per_user_tg=_interval(_get(w, "per_user_tg", path, None), "workload.per_user_tg", ctx),
        ttft_s=_ttft(_get(w, "ttft_s", path, None), "workload.ttft_s", ctx),
        curve=tuple(curve),
    )


def _workload_dict(w: Workload) -> dict[str, Any]:
    def plain(item: Any) -> dict[str, Any]:
        d = dataclasses.asdict(item)
        if d.get("ttft_s") is not None:
            d["ttft_s"]["samples"] = list(d["ttft_s"]["samples"])  # JSON's lists, as a reader parses them
        return d

    out = plain(w)
    out["curve"] = [plain(p) for p in w.curve]
    if not out["curve"]:
        del out["curve"]  # a one-user profile has no curve
    return out


def _parse_profile(data: Mapping[str, Any], ctx: _Context) -> Profile:
    top = _obj(
        data,
        "",
        (
            "schema_version", "tool_version", "created_at", "machine", "engine", "llama_build", "model", "settings",
            "min_ctx", "objective", "measured", "memory", "sizing", "layers_offloaded", "layers_total",
            "runner_up", "trials", "study", "quality", "quality_budget", "workload",
        ),
        ctx,
    )  # fmt: skip
    tool_version = _str(top, "tool_version", "")
    created_at = _created_at(top)

    m = _obj(
        _get(top, "machine", ""),
        "machine",
        ("fingerprint", "hardware_class", "cpu_model", "physical_cores", "logical_cores", "ram_total", "gpus", "unified_memory",
         "system", "arch", "devices"),
        ctx,
    )
    devices = []
    if not isinstance(_get(m, "devices", "machine", []), list):
        raise ProfileValidationError("machine.devices", f"expected a list, got {_kind(m['devices'])}")
    for i, d in enumerate(_get(m, "devices", "machine", [])):
        dp = f"machine.devices[{i}]"
        d = _obj(d, dp, ("name", "description", "type", "memory_total", "unified_memory"), ctx)
        kind = _get(d, "type", dp)
        if kind not in ("gpu", "igpu"):
            raise ProfileValidationError(f"{dp}.type", f"expected gpu or igpu, got {_kind(kind)}")
        devices.append(DeviceRecord(_str(d, "name", dp), _text(d, "description", dp), kind,
                                    _int(d, "memory_total", dp, nullable=True), _bool(d, "unified_memory", dp)))
    gpus = []
    for i, g in enumerate(_list(m, "gpus", "machine")):
        gp = f"machine.gpus[{i}]"
        g = _obj(g, gp, ("index", "name", "uuid", "memory_total", "driver"), ctx)
        gpus.append(GPUInfo(_int(g, "index", gp), _str(g, "name", gp), _text(g, "uuid", gp), _int(g, "memory_total", gp), _text(g, "driver", gp)))
    machine = MachineInfo(
        fingerprint=_str(m, "fingerprint", "machine", pattern=_HEX_RE, hint="a lowercase hex fingerprint"),
        hardware_class=_str(m, "hardware_class", "machine", pattern=_HEX_RE, hint="a lowercase hex fingerprint"),
        cpu_model=_text(m, "cpu_model", "machine"),
        physical_cores=_int(m, "physical_cores", "machine", minimum=1),
        logical_cores=_int(m, "logical_cores", "machine", minimum=1),
        ram_total=_int(m, "ram_total", "machine"),
        gpus=tuple(gpus),
        unified_memory=_bool(m, "unified_memory", "machine"),
        system=_text(m, "system", "machine"),
        arch=_text(m, "arch", "machine"),
        devices=tuple(devices),
    )

    engine = None
    en = _get(top, "engine", "", None)
    if en is not None:
        en = _obj(en, "engine", ("name", "build", "path"), ctx)
        name = _get(en, "name", "engine")
        if name not in ENGINES:
            raise ProfileValidationError("engine.name", f"expected one of {', '.join(ENGINES)}, got {_kind(name)}")
        engine = EngineInfo(name=name, build=_str(en, "build", "engine"), path=_str(en, "path", "engine", nullable=True, default=None))

    b = _obj(_get(top, "llama_build", ""), "llama_build", ("llama_cpp_python", "llama_cpp_build", "backends", "gpu_offload", "rpc"), ctx)
    backends = _list(b, "backends", "llama_build")
    for i, name in enumerate(backends):
        if not isinstance(name, str) or not name:
            raise ProfileValidationError(f"llama_build.backends[{i}]", f"expected a backend name such as cuda, got {_kind(name)}")
        _plain_text(name, f"llama_build.backends[{i}]", limit=limits.MAX_NAME)
    llama_build = LlamaBuildInfo(
        llama_cpp_python=_str(b, "llama_cpp_python", "llama_build", nullable=True),
        llama_cpp_build=_str(b, "llama_cpp_build", "llama_build", nullable=True),
        backends=tuple(backends),
        gpu_offload=_bool(b, "gpu_offload", "llama_build"),
        rpc=_bool(b, "rpc", "llama_build"),
    )

    md = _obj(_get(top, "model", ""), "model", ("file_name", "size", "header_hash", "architecture", "quantization", "n_layer"), ctx)
    model = ModelInfo(
        file_name=_str(md, "file_name", "model"),
        size=_int(md, "size", "model", minimum=1),
        header_hash=_str(md, "header_hash", "model", pattern=_HEX_RE, hint="a lowercase hex sha256"),
        architecture=_str(md, "architecture", "model"),
        quantization=_str(md, "quantization", "model", nullable=True),
        n_layer=_int(md, "n_layer", "model", minimum=1),
    )

    settings = _settings(_get(top, "settings", ""), "settings", ctx)
    min_ctx = _int(top, "min_ctx", "", minimum=1, maximum=limits.MAX_CTX)
    if settings.n_ctx and min_ctx > settings.n_ctx:
        raise ProfileValidationError("min_ctx", f"expected at most settings.n_ctx ({settings.n_ctx}), got {min_ctx}")
    objective = _get(top, "objective", "")
    if objective not in OBJECTIVES:
        raise ProfileValidationError("objective", f"expected one of {', '.join(OBJECTIVES)}, got {_kind(objective)}")

    me = _obj(_get(top, "measured", ""), "measured", ("pp", "tg", "n_prompt", "n_gen", "depth"), ctx)
    measured = Measured(
        pp=_stats(_get(me, "pp", "measured"), "measured.pp", ctx),
        tg=_stats(_get(me, "tg", "measured"), "measured.tg", ctx),
        n_prompt=_int(me, "n_prompt", "measured"),
        n_gen=_int(me, "n_gen", "measured"),
        depth=_int(me, "depth", "measured"),
    )

    mem = _obj(_get(top, "memory", ""), "memory", ("predicted", "actual"), ctx)
    memory = Memory(
        predicted=_devices(_get(mem, "predicted", "memory"), "memory.predicted", ctx, with_total=True),
        actual=_devices(_get(mem, "actual", "memory", {}), "memory.actual", ctx, with_total=False),
    )

    sz = _obj(_get(top, "sizing", ""), "sizing", ("n_layer", "layer_weight_bytes", "output_weight_bytes", "kv_bytes_per_token_per_layer",
                                                     "sliding_window", "swa_layers", "n_ctx_train"), ctx)
    sizing = Sizing(
        n_layer=_int(sz, "n_layer", "sizing", minimum=1),
        layer_weight_bytes=_int(sz, "layer_weight_bytes", "sizing"),
        output_weight_bytes=_int(sz, "output_weight_bytes", "sizing"),
        kv_bytes_per_token_per_layer=_number(_get(sz, "kv_bytes_per_token_per_layer", "sizing"), "sizing.kv_bytes_per_token_per_layer"),
        sliding_window=_int(sz, "sliding_window", "sizing", default=0),
        swa_layers=_int(sz, "swa_layers", "sizing", default=0),
        n_ctx_train=_int(sz, "n_ctx_train", "sizing", minimum=1, nullable=True, default=None),
    )
    if sizing.swa_layers > sizing.n_layer:
        raise ProfileValidationError("sizing.swa_layers", f"expected at most sizing.n_layer ({sizing.n_layer}), got {sizing.swa_layers}")
    if sizing.n_layer != model.n_layer:
        raise ProfileValidationError("sizing.n_layer", f"expected model.n_layer ({model.n_layer}), got {sizing.n_layer}")

    layers_total = _int(top, "layers_total", "")
    layers_offloaded = _int(top, "layers_offloaded", "", nullable=True, default=None)
    if layers_offloaded is not None and layers_offloaded > layers_total:
        raise ProfileValidationError("layers_offloaded", f"expected at most layers_total ({layers_total}), got {layers_offloaded}")

    runner_up = None
    ru = _get(top, "runner_up", "", None)
    if ru is not None:
        ru = _obj(ru, "runner_up", ("settings", "pp", "tg"), ctx)
        runner_up = RunnerUp(
            settings=_settings(_get(ru, "settings", "runner_up"), "runner_up.settings", ctx),
            pp=_stats(_get(ru, "pp", "runner_up"), "runner_up.pp", ctx),
            tg=_stats(_get(ru, "tg", "runner_up"), "runner_up.tg", ctx),
        )

    t = _obj(_get(top, "trials", ""), "trials", ("run", "pruned", "oom", "failed"), ctx)
    trials = Trials(*(_int(t, k, "trials") for k in ("run", "pruned", "oom", "failed")))

    study = None
    st = _get(top, "study", "", None)
    if st is not None:
        st = _obj(st, "study", ("name", "storage"), ctx)
        storage = _str(st, "storage", "study", nullable=True, default=None)
        # a password in the URL never travels further than the file that had it
        study = StudyRef(_str(st, "name", "study"), redact_url(storage) if storage is not None else None)

    quality = _quality(_get(top, "quality", "", None), ctx)
    quality_budget = _quality_budget(_get(top, "quality_budget", "", None), ctx)
    workload = _workload(_get(top, "workload", "", None), ctx)
    if workload is not None and workload.users != settings.n_parallel:
        raise ProfileValidationError("workload.users", f"expected settings.n_parallel ({settings.n_parallel}), got {workload.users}")

    return Profile(
        schema_version=top["schema_version"],
        tool_version=tool_version,
        created_at=created_at,
        machine=machine,
        llama_build=llama_build,
        model=model,
        settings=settings,
        min_ctx=min_ctx,
        objective=objective,
        measured=measured,
        memory=memory,
        sizing=sizing,
        layers_total=layers_total,
        trials=trials,
        layers_offloaded=layers_offloaded,
        runner_up=runner_up,
        study=study,
        quality=quality,
        quality_budget=quality_budget,
        workload=workload,
        engine=engine,
    )


def _optional_number(data: Mapping[str, Any], key: str, path: str) -> float | None:
    value = _get(data, key, path, None)
    return None if value is None else _number(value, _join(path, key))


def _quality(value: Any, ctx: _Context) -> QualityInfo | None:
    if value is None:
        return None
    q = _obj(value, "quality", ("kl", "top1_agreement", "ppl", "ppl_ratio", "reference", "corpus_sha256", "n_ctx", "chunks"), ctx)
    kl = _obj(_get(q, "kl", "quality"), "quality.kl", ("mean", "median", "p99"), ctx)
    ref = _obj(_get(q, "reference", "quality"), "quality.reference", ("file_name", "sha256"), ctx)
    top1 = _number(_get(q, "top1_agreement", "quality"), "quality.top1_agreement")
    if top1 > 1:
        raise ProfileValidationError("quality.top1_agreement", f"expected a share between 0 and 1, got {top1}")
    return QualityInfo(
        kl_mean=_number(_get(kl, "mean", "quality.kl"), "quality.kl.mean"),
        kl_median=_number(_get(kl, "median", "quality.kl"), "quality.kl.median"),
        kl_p99=_number(_get(kl, "p99", "quality.kl"), "quality.kl.p99"),
        top1_agreement=top1,
        ppl=_number(_get(q, "ppl", "quality"), "quality.ppl"),
        ppl_ratio=_number(_get(q, "ppl_ratio", "quality"), "quality.ppl_ratio"),
        reference_file=_str(ref, "file_name", "quality.reference"),
        reference_sha256=_str(ref, "sha256", "quality.reference", pattern=_HEX_RE, hint="a lowercase hex sha256"),
        corpus_sha256=_str(q, "corpus_sha256", "quality", pattern=_HEX_RE, hint="a lowercase hex sha256"),
        n_ctx=_int(q, "n_ctx", "quality", minimum=1),
        chunks=_int(q, "chunks", "quality", minimum=1),
    )


def _quality_budget(value: Any, ctx: _Context) -> QualityBudgetInfo | None:
    if value is None:
        return None
    path = "quality_budget"
    b = _obj(value, path, ("max_kl", "max_ppl_increase", "min_tg", "min_pp", "target_met"), ctx)
    met = _get(b, "target_met", path, None)
    if met is not None and not isinstance(met, bool):
        raise ProfileValidationError(f"{path}.target_met", f"expected true, false or null, got {_kind(met)}")
    return QualityBudgetInfo(*(_optional_number(b, k, path) for k in ("max_kl", "max_ppl_increase", "min_tg", "min_pp")), met)


# -- serializing -------------------------------------------------------------------------------


def _quality_dict(q: QualityInfo) -> dict[str, Any]:
    return {"kl": {"mean": q.kl_mean, "median": q.kl_median, "p99": q.kl_p99}, "top1_agreement": q.top1_agreement,
            "ppl": q.ppl, "ppl_ratio": q.ppl_ratio, "reference": {"file_name": q.reference_file, "sha256": q.reference_sha256},
            "corpus_sha256": q.corpus_sha256, "n_ctx": q.n_ctx, "chunks": q.chunks}


def _asdict(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _stats_dict(stats: Stats) -> dict[str, Any]:
    return {**_asdict(stats), "samples": list(stats.samples)}


def _memory_dict(memory: DeviceMemory) -> dict[str, Any]:
    out = _asdict(memory)
    if out["total"] is None:
        del out["total"]
    return out


__all__ = [
    "SCHEMA_VERSION",
    "BUNDLE_VERSION",
    "OBJECTIVES",
    "Profile",
    "MachineInfo",
    "GPUInfo",
    "DeviceRecord",
    "EngineInfo",
    "ENGINES",
    "LlamaBuildInfo",
    "ModelInfo",
    "Stats",
    "Measured",
    "DeviceMemory",
    "Memory",
    "Sizing",
    "RunnerUp",
    "Trials",
    "StudyRef",
    "QualityInfo",
    "QualityBudgetInfo",
    "Workload",
    "CurvePoint",
    "Interval",
    "TimeToFirstToken",
    "ProfileWarning",
    "SchemaVersionWarning",
    "LlamaBuildWarning",
    "ProfileAdjustedWarning",
    "ProfileDegradedWarning",
    "utc_now",
    "output_folder",
    "tool_version",
    "describe_gpus",
    "format_bytes",
]
