"""Profiles in apps: pick this model's profile for this machine, check it still fits, load it.

    profile = load_profile("model.gguf")        # or strict=True to refuse any change
    llm = Llama("model.gguf")                   # the same, then llama_cpp.Llama(**profile.llama_kwargs())

Selection (``load_profile``): profiles on the search path whose model fingerprint (size and header
hash) is this file's; among them an exact machine match first, then the same hardware class (same
GPU models and memory); earlier search-path folders first, then the newest.

Validation at load (``check_profile``): a different llama.cpp build is a warning: the app runs
llama-cpp-python (``tuner.Llama``) unless it says it runs llama.cpp's binaries (``llama_bin=DIR``, as
an app that starts llama-server does), and a profile measured by the other engine, or by another build,
was measured on another llama.cpp. Free memory now,
per device, is compared with what the profile needs plus a margin. If it no longer fits, the profile
is degraded in the order the levers rank: the context first (never below the profile's ``min_ctx``),
then fewer GPU layers. Fewer GPU layers is a partial offload the profile did not choose: it is
reported loudly (``ProfileDegradedWarning``), with the processes holding the GPU's memory. Every
change is listed in ``Profile.degradation``. ``strict=True`` raises ``ProfileMismatchError`` instead.

The memory model (bytes, per device; devices are llama.cpp's names in ``memory.predicted``):

- what the profile needs on a device is its recorded ``total`` (or the measured ``actual`` sum if larger);
- ``CUDA1``, ``Vulkan0``, ``ROCm0``, ``MTL0``... are llama.cpp's devices of that name here
  (``machine.devices``): a device sharing the host's RAM (Apple silicon, an APU) is the RAM's pool (one
  pool, as the tuner planned it); a device NVML pairs with (by PCI bus id) has NVML's free memory now;
  any other has llama.cpp's own figure (``ggml_backend_dev_memory``). A device name without a number
  (``Metal``, before ``MTL0``) takes its place among the accelerators llama.cpp will use;
  ``RPC0[host:port]`` maps to the ``machine.rpc_devices`` entry of that endpoint; ``CPU`` to
  ``machine.ram_available``. A machine without llama.cpp's devices (injected by a test) maps
  ``CUDA1`` to ``machine.gpus[1]``;
- on the host, weights read with mmap are file-backed pages and are not counted against free RAM;
- a context smaller by ``d`` tokens frees ``kv_bytes_per_token_per_layer * layers_on_device * d``
  on each device holding KV (``layers_on_device`` is read from the recorded KV size), in llama.cpp's
  256-cell padding; a sliding-window layer's cache holds its window and a micro-batch unless
  ``swa_full`` (``tuner.model.estimate.cache_cells``, the estimate's own arithmetic), so it frees
  nothing until the context drops below that;
- one GPU layer fewer moves ``layer_weight_bytes`` and its KV from the GPUs (in proportion to their
  share of the layers) to the CPU; the first layer removed from a full offload is the output layer
  (``output_weight_bytes``, no KV).

Imports stay light: ``llama_cpp`` only inside ``Llama()``; no optuna, gguf or numpy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..engine.dimensions import context_tokens, offloaded_layers
from ..errors import NoMatchingProfileError, ProfileMismatchError, SettingsError
from ..model.estimate import cache_cells
from ..model.gguf import model_fingerprint
from ..paths import ENV_REGISTRY
from .document import (
    LlamaBuildWarning,
    Profile,
    ProfileAdjustedWarning,
    ProfileDegradedWarning,
    ProfileWarning,
    describe_gpus,
    format_bytes,
)
from .store import SearchPath, list_profiles, profile_search_path, read_profile

if TYPE_CHECKING:
    from ..engine.base import EngineBuild
    from ..machine.probe import GPU, Machine

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_MARGIN_BYTES = 256 * MiB
# llama.cpp pads the context to a multiple of 256 tokens; degrade in the same steps.
CTX_STEP = 256

_RPC_DEVICE_RE = re.compile(r"^RPC\d*\[(?P<endpoint>[^\]]+)\]$")
_NUMBERED_DEVICE_RE = re.compile(r"^[A-Za-z_]+?(?P<index>\d+)$")


# -- selection ---------------------------------------------------------------------------------


def load_profile(
    model_path: str | os.PathLike[str],
    *,
    search_path: SearchPath = None,
    machine: "Machine | None" = None,
    strict: bool = False,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    registry: str | None = None,
    llama_bin: str | os.PathLike[str] | None = None,
    users: int | None = None,
) -> Profile:
    """The best profile for this model file on this machine, checked (and if needed degraded) to fit now.

    ``machine`` defaults to this machine as llama.cpp sees it (``this_machine``: its devices probed once per
    boot and cached); tests inject one. A profile measured with llama.cpp binaries that are still where
    it says is also matched against the machine as those binaries see it.
    When no local folder has one, the team's registry is asked (``registry``, by default
    ``OFFLOAD_TUNER_REGISTRY``; see ``tuner.profile.registry``), and its answer cached locally.
    ``llama_bin``: the folder of the llama.cpp binaries this app runs the profile with (llama-server...);
    by default the app runs llama-cpp-python. A profile measured on another build is a warning.
    ``users``: the requests the app serves at once (llama-server's -np, OLLAMA_NUM_PARALLEL); a profile
    tuned for another number is a warning that says the memory it will need (``serving_note``).
    Raises ``NoMatchingProfileError`` listing each profile found and why it did not match.
    """
    fingerprint = model_fingerprint(model_path)
    probed = machine is None
    machine = machine if machine is not None else this_machine(llama_bin)
    folders = profile_search_path(search_path)
    candidates, rejected = _match(list_profiles(search_path), folders, fingerprint, machine)
    url = registry if registry is not None else os.environ.get(ENV_REGISTRY, "")
    if not candidates and url:
        from .registry import refresh_for_model

        cache = refresh_for_model(url, fingerprint, machine)
        folders = folders + [cache]
        more, why = _match(list_profiles([cache]), folders, fingerprint, machine)
        candidates += more
        rejected += why
    if not candidates and probed and llama_bin is None:
        # A profile measured with the user's llama.cpp binaries (a Vulkan or ROCm build beside a CPU-only
        # llama-cpp-python): this machine as those binaries see it, then the build warning says the rest.
        for folder in _binaries_of(list_profiles(search_path), fingerprint):
            there = this_machine(folder)
            more, _ = _match(list_profiles(search_path), folders, fingerprint, there)
            if more:
                candidates, machine = more, dataclasses.replace(there, llama=machine.llama)
                break
    if not candidates:
        raise NoMatchingProfileError(_no_match_message(model_path, fingerprint, machine, rejected, folders))
    best = min(candidates, key=lambda c: c[:4])[-1]
    checked = _check(best, model_path, fingerprint, machine, probed, strict, margin_bytes, _app_build(llama_bin))
    _warn_users(checked, users)
    return checked


def _match(entries: list, folders: list, fingerprint: dict, machine: "Machine") -> tuple[list, list[str]]:
    """Profiles of ``entries`` for this model on this machine, ranked; and why the others are not."""
    from ..machine.identity import differences, match

    candidates = []
    rejected = []
    for order, entry in enumerate(entries):
        profile = entry.profile
        if profile is None:
            rejected.append(f"  {entry.path}: unreadable: {entry.problem}")
            continue
        reason = model_mismatch(profile, fingerprint)
        how = match(profile.machine, machine) if reason is None else None
        if reason is None and how is None:
            changed = differences(profile.machine, machine)
            reason = (
                f"for another machine ({profile.machine.describe()}): neither its fingerprint {profile.machine.fingerprint} "
                f"nor its hardware class {profile.machine.hardware_class} is this machine's"
                + (f" ({'; '.join(changed)})" if changed else "")
            )
        if reason is not None:
            rejected.append(f"  {entry.path}: {reason}")
            continue
        rank = 0 if how in ("fingerprint", "legacy fingerprint") else 1
        folder = folders.index(entry.origin) if entry.origin in folders else len(folders)
        candidates.append((rank, folder, -_timestamp(profile.created_at), order, profile))
    return candidates, rejected


def _binaries_of(entries: list, fingerprint: dict) -> list[str]:
    """The binaries' folders (still on this machine) that measured this model's profiles."""
    out: list[str] = []
    for entry in entries:
        profile = entry.profile
        engine = profile.engine if profile is not None else None
        if (engine is not None and engine.name == "llama-cpp" and engine.path and os.path.isdir(engine.path)
                and model_mismatch(profile, fingerprint) is None and engine.path not in out):
            out.append(engine.path)
    return out[:4]


def this_machine(llama_bin: str | os.PathLike[str] | None = None) -> "Machine":
    """This machine as the llama.cpp an app runs sees it (``llama_bin``: the binaries' folder; by default
    llama-cpp-python), without paying llama.cpp's start-up more than once per boot
    (``tuner.machine.probe.app_machine``: its devices cached per boot, build and device environment)."""
    from ..machine.probe import app_machine

    return app_machine(llama_bin)


def model_mismatch(profile: Profile, fingerprint: dict) -> str | None:
    """Why ``profile`` is not for the model with this fingerprint, or None when it is.

    Size and header hash decide; the file name does not (a renamed file is the same model).
    """
    recorded = profile.model
    if recorded.size == fingerprint["size"] and recorded.header_hash == fingerprint["header_hash"]:
        return None
    if recorded.file_name == fingerprint["file_name"]:
        return (
            f"made for a different file with the same name: {recorded.file_name} was {recorded.size} bytes "
            f"with header hash {recorded.header_hash[:12]} when tuned; this one is {fingerprint['size']} bytes "
            f"with header hash {fingerprint['header_hash'][:12]}"
        )
    return f"for another model ({recorded.file_name})"


def _no_match_message(model_path: Any, fingerprint: dict, machine: "Machine", rejected: list[str], folders: list) -> str:
    here = f"{machine.cpu_model}, {_describe_devices(machine)}"
    head = f"no profile for {fingerprint['file_name']} on this machine ({here})"
    advice = (
        f"Tune it here with `offload-tuner tune {os.fspath(model_path)}`, or add a team's profile folder "
        f"to OFFLOAD_TUNER_PROFILE_PATH."
    )
    if not rejected:
        where = ", ".join(str(f) for f in folders) or "(an empty search path)"
        return f"{head}: no profiles found in {where}. {advice}"
    return f"{head}; {len(rejected)} profile(s) found, none matches:\n" + "\n".join(rejected) + f"\n{advice}"


def _describe_devices(machine: "Machine") -> str:
    """The GPUs llama.cpp will use here (NVML's where llama.cpp's devices are unknown), or ``no GPU``."""
    from ..machine.identity import device_model

    if not machine.devices:
        return describe_gpus([(g.name, g.memory_total) for g in machine.gpus])
    local = [d for d in machine.used_accelerators() if not d.get("rpc_endpoint")]
    shared = [f"{device_model(d.get('description') or d['name'])} (shares the RAM)" for d in local if d.get("unified_memory")]
    own = describe_gpus([(device_model(d.get("description") or d["name"]), int(d.get("memory_total") or 0))
                         for d in local if not d.get("unified_memory")])
    return ", ".join(shared + ([own] if own != "no GPU" or not shared else []))


def _timestamp(created_at: str) -> float:
    return datetime.fromisoformat(created_at[:-1] + "+00:00" if created_at.endswith("Z") else created_at).timestamp()


# -- validation at load ------------------------------------------------------------------------


def check_profile(
    profile: Profile,
    model_path: str | os.PathLike[str],
    *,
    machine: "Machine | None" = None,
    strict: bool = False,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    llama_bin: str | os.PathLike[str] | None = None,
    users: int | None = None,
) -> Profile:
    """Check one profile against this model file and this machine now; return it ready to load.

    The returned profile has the app's ``model_path`` and, where it no longer fits, the degraded
    settings with ``degradation`` saying what changed and why. ``strict=True`` raises
    ``ProfileMismatchError`` instead of changing anything. ``llama_bin``, ``users``: as for ``load_profile``.
    """
    probed = machine is None
    machine = machine if machine is not None else this_machine(llama_bin)
    checked = _check(profile, model_path, model_fingerprint(model_path), machine, probed, strict, margin_bytes,
                     _app_build(llama_bin))
    _warn_users(checked, users)
    return checked


def kv_bytes(profile: Profile, *, n_ctx: int, users: int, unified: bool | None = None) -> int:
    """The KV cache of the profile's model at ``n_ctx`` cells for ``users`` sequences (the estimate's
    arithmetic, ``kv_layout``, from the profile's ``sizing``: no GGUF read)."""
    s, sizing = profile.settings, profile.sizing
    unified = s.kv_unified if unified is None else unified
    cells, swa_cells = cache_cells(n_ctx, s.n_ubatch, sizing.sliding_window or None, s.swa_full, n_seq=users, unified=unified)
    swa = sizing.swa_layers if sizing.sliding_window else 0
    return int(sizing.kv_bytes_per_token_per_layer * ((sizing.n_layer - swa) * cells + swa * swa_cells))


def serving_note(profile: Profile, users: int) -> str | None:
    """What serving ``users`` requests at once with a profile tuned for another number costs: the KV
    cache at the profile's -c (each user then gets a share of it; a sliding-window cache is one window
    per user) and at -c x users (each user the context it was tuned with). None when they agree."""
    tuned = profile.users
    if users == tuned:
        return None
    n_ctx = context_tokens(profile.settings.n_ctx, profile.sizing.n_ctx_train or 0)
    now = kv_bytes(profile, n_ctx=n_ctx, users=tuned)
    per_user = max(1, n_ctx // tuned)  # each user's share when tuned
    same_ctx = kv_bytes(profile, n_ctx=n_ctx, users=users) - now
    full_ctx = kv_bytes(profile, n_ctx=per_user * users, users=users) - now
    total = sum(m.need for m in profile.memory.predicted.values())
    sign = lambda b: ("+" if b >= 0 else "-") + format_bytes(abs(b))  # noqa: E731
    return (f"profile {profile.name} was tuned for {tuned} user(s) at once and measured that way; serving {users} "
            f"(-np {users}): with its -c {n_ctx} each gets {n_ctx // users} tokens and the KV cache changes by "
            f"{sign(same_ctx)}; with -c {per_user * users} (each user the {per_user} tokens it was tuned with) "
            f"by {sign(full_ctx)}, {format_bytes(total + max(0, full_ctx))} in all. Its speeds are one load's: "
            f"tune with --users {users} to measure this one")


def _warn_users(profile: Profile, users: int | None) -> None:
    if users is None:
        return
    note = serving_note(profile, users)
    if note:
        warnings.warn(note, ProfileWarning, stacklevel=3)


def _app_build(llama_bin: str | os.PathLike[str] | None) -> "EngineBuild | None":
    """The build of the binaries an app runs (their --version); None: the app runs llama-cpp-python."""
    if llama_bin is None:
        return None
    from ..engine.base import EngineBuild
    from ..engine.llamacpp import binaries_build
    from ..errors import EngineError

    try:
        return binaries_build(llama_bin)
    except EngineError as exc:  # binaries that do not say their build: compared as unknown
        return EngineBuild(engine="llama-cpp", path=os.fspath(llama_bin), error=str(exc))


def _check(
    profile: Profile,
    model_path: str | os.PathLike[str],
    fingerprint: dict,
    machine: "Machine",
    probed: bool,
    strict: bool,
    margin_bytes: int,
    runs: "EngineBuild | None" = None,
) -> Profile:
    reason = model_mismatch(profile, fingerprint)
    if reason is not None:
        raise ProfileMismatchError(f"profile {profile.name} is {reason}; tune this file, or load the file that was tuned")
    if probed and profile.settings.rpc_servers and not machine.rpc_devices:
        machine = _with_rpc_devices(machine, profile.settings.rpc_servers)
    from ..machine.identity import differences, match

    if match(profile.machine, machine) is None:
        changed = differences(profile.machine, machine)
        warnings.warn(
            f"profile {profile.name} was tuned on another kind of machine ({profile.machine.describe()}); "
            "its speeds were measured there" + (f" ({'; '.join(changed)})" if changed else ""),
            ProfileWarning,
            stacklevel=3,
        )
    _check_build(profile, machine, runs)

    plan = _Plan(profile, machine, margin_bytes)
    changes = plan.threads_changes() + plan.fit()
    settings = profile.settings.replace(model_path=os.fspath(model_path), **plan.changed_settings)
    if plan.unknown:
        warnings.warn(
            f"profile {profile.name}: cannot check free memory on {'; '.join(plan.unknown)}",
            ProfileWarning,
            stacklevel=3,
        )
    if changes and strict:
        raise ProfileMismatchError(
            f"profile {profile.name} does not fit this machine as recorded; loading it would need:\n"
            + "\n".join(f"  - {c}" for c in changes)
            + "\nFree the memory, or load with strict=False to accept these changes."
        )
    if changes:
        category = ProfileDegradedWarning if plan.layers_reduced else ProfileAdjustedWarning
        lead = "PARTIAL OFFLOAD: " if plan.layers_reduced else ""
        warnings.warn(
            f"{lead}profile {profile.name} changed to fit this machine now:\n"
            + "\n".join(f"  - {c}" for c in changes)
            + "\nPass strict=True to raise instead.",
            category,
            stacklevel=3,
        )
    return profile.replace(settings=settings, degradation=tuple(changes))


def _with_rpc_devices(machine: "Machine", servers: tuple[str, ...]) -> "Machine":
    from ..engine.rpc import query_devices

    try:
        return dataclasses.replace(machine, rpc_devices=tuple(query_devices(servers)))
    except Exception as exc:  # an unreachable server is reported by the fit check as "cannot check"
        warnings.warn(f"could not query the RPC servers {', '.join(servers)}: {exc}", ProfileWarning, stacklevel=4)
        return machine


def _check_build(profile: Profile, machine: "Machine", runs: "EngineBuild | None" = None) -> None:
    """Warn when the app runs another llama.cpp than the one that measured the profile: the other
    engine (llama-cpp-python vs the user's binaries), or another build of it."""
    recorded, here = profile.llama_build, machine.llama
    engine = profile.engine
    measured_by = engine.name if engine is not None else "python"
    recorded_build = engine.build if engine is not None else recorded.llama_cpp_build
    differences = []
    if runs is None:  # the app runs llama-cpp-python
        if measured_by == "llama-cpp":
            version = f" {here.llama_cpp_python}" if here.llama_cpp_python else ""
            warnings.warn(
                f"profile {profile.name} was measured with llama.cpp binaries (build {recorded_build}"
                f"{f', {engine.path}' if engine and engine.path else ''}); this app runs llama-cpp-python{version}: speed "
                "and memory use may differ; tune with --engine python to measure the llama.cpp this app runs",
                LlamaBuildWarning,
                stacklevel=4,
            )
            return
        if recorded.llama_cpp_python and here.llama_cpp_python and recorded.llama_cpp_python != here.llama_cpp_python:
            differences.append(f"llama-cpp-python {recorded.llama_cpp_python}, this machine has {here.llama_cpp_python}")
        if recorded.llama_cpp_build and here.llama_cpp_build and recorded.llama_cpp_build != here.llama_cpp_build:
            differences.append(f"llama.cpp build {recorded.llama_cpp_build}, this machine has {here.llama_cpp_build}")
    else:  # the app runs llama.cpp's binaries
        theirs = runs.describe()
        same = _same_build(recorded_build, theirs)
        if same is False or (same is None and measured_by != "llama-cpp"):
            what = "llama.cpp binaries" if measured_by == "llama-cpp" else "llama-cpp-python"
            differences.append(f"{what}, llama.cpp build {recorded_build or 'unknown'}; the binaries in {runs.path} are "
                               f"build {theirs}")
    if differences:
        warnings.warn(
            f"profile {profile.name} was measured with {'; '.join(differences)}: speed and memory use may differ; "
            "tune again to be sure",
            LlamaBuildWarning,
            stacklevel=4,
        )


def _same_build(a: str | None, b: str | None) -> bool | None:
    """Whether two build strings name the same llama.cpp: by commit where both have one, else by build
    number; None when they cannot be compared."""
    def parts(text: str | None) -> tuple[str | None, str | None]:
        if not text:
            return None, None
        commit = re.search(r"(?:commit |\()([0-9a-f]{7,40})\b", text)
        number = re.search(r"\bb(?:uild )?(\d+)\b", text)
        return (commit[1] if commit else None), (number[1] if number else None)

    (ca, na), (cb, nb) = parts(a), parts(b)
    if ca and cb:
        return ca.startswith(cb) or cb.startswith(ca)
    if na and nb:
        return na == nb
    return None


@dataclass
class _Pool:
    """Memory that one free-memory figure covers: a GPU, an RPC server, or the host RAM."""

    label: str
    free: int
    need: float = 0.0  # bytes the profile needs here at the recorded settings
    kv: float = 0.0  # bytes of KV cache here at the recorded context
    weights: float = 0.0
    gpu: "GPU | None" = None
    is_host: bool = False
    devices: list[str] = field(default_factory=list)


class _Plan:
    """The degradation arithmetic of one profile on one machine state."""

    def __init__(self, profile: Profile, machine: "Machine", margin_bytes: int) -> None:
        self.profile, self.machine, self.margin = profile, machine, margin_bytes
        self.settings = profile.settings
        self.sizing = profile.sizing
        self.changed_settings: dict[str, Any] = {}
        self.layers_reduced = False
        self.unknown: list[str] = []
        self.host = _Pool("CPU (RAM)", machine.ram_available, is_host=True)
        self.pools: list[_Pool] = [self.host]
        self._map_devices()

    # -- devices -> pools

    def _map_devices(self) -> None:
        profile, machine = self.profile, self.machine
        accelerator = 0
        by_key: dict[str, _Pool] = {}
        for name, predicted in profile.memory.predicted.items():
            actual = profile.memory.actual.get(name)
            need = max(predicted.need, actual.need if actual else 0)
            weights = predicted.weights
            pool: _Pool | None
            if name.startswith("CPU") or name == "Host":
                pool = self.host
                if self.settings.use_mmap:
                    need -= weights  # file-backed pages: the kernel can drop and re-read them
                    weights = 0
            elif rpc := _RPC_DEVICE_RE.match(name):
                endpoint = rpc["endpoint"]
                info = next((d for d in machine.rpc_devices if d.get("endpoint") == endpoint), None)
                if info is None or info.get("memory_free") is None:
                    problem = info.get("error", "no memory reported") if info else "not queried"
                    self.unknown.append(f"{name} (the RPC server {endpoint}: {problem})")
                    pool = None
                else:
                    pool = by_key.setdefault(f"rpc:{endpoint}", _Pool(f"{name} ({info.get('name') or 'RPC'})", int(info["memory_free"])))
            elif machine.devices:
                pool = self._device_pool(name, accelerator, by_key)
                accelerator += 1
            else:  # a machine without llama.cpp's devices (injected by a test): NVML's GPUs by index
                numbered = _NUMBERED_DEVICE_RE.match(name)
                index = int(numbered["index"]) if numbered else accelerator
                accelerator += 1
                if index < len(machine.gpus):
                    gpu = machine.gpus[index]
                    pool = by_key.setdefault(f"gpu:{index}", _Pool(f"{name} ({gpu.name})", gpu.memory_free, gpu=gpu))
                elif machine.unified_memory:
                    pool = self.host  # Apple silicon, an APU: the accelerator's memory is the RAM
                else:
                    self.unknown.append(f"{name} (this machine lists {len(machine.gpus)} GPU(s): {machine.gpu_status})")
                    pool = None
            if pool is None:
                continue
            if pool not in self.pools:
                self.pools.append(pool)
            pool.need += need
            pool.kv += predicted.kv
            pool.weights += weights
            pool.devices.append(name)

    def _device_pool(self, name: str, position: int, by_key: dict[str, _Pool]) -> "_Pool | None":
        """The pool of llama.cpp's device ``name`` here: the RAM for a device sharing it (one pool, as the
        tuner planned), NVML's free memory now where NVML pairs with the device (by PCI bus id), else
        llama.cpp's own figure (``ggml_backend_dev_memory``, as of the device probe)."""
        machine = self.machine
        listed = {d.get("name"): d for d in machine.devices}
        entry = listed.get(name)
        if entry is None and not _NUMBERED_DEVICE_RE.match(name):
            used = machine.used_accelerators()  # "Metal" (a build before MTL0): its place among the accelerators
            entry = used[position] if position < len(used) else None
        if entry is None:
            names = ", ".join(d["name"] for d in machine.used_accelerators()) or "none"
            self.unknown.append(f"{name} (llama.cpp lists no such device here; it uses: {names})")
            return None
        label = f"{name} ({entry.get('description') or entry.get('name')})"
        if entry.get("unified_memory"):
            return self.host  # Apple silicon, an APU: the device's memory is the RAM, one pool
        gpu = next((g for g in machine.gpus if g.index == entry.get("nvml_index")), None)
        if gpu is not None:
            return by_key.setdefault(f"gpu:{gpu.index}", _Pool(label, gpu.memory_free, gpu=gpu))
        if entry.get("memory_free") is None:
            self.unknown.append(f"{name} (llama.cpp gives no free memory for it)")
            return None
        return by_key.setdefault(f"dev:{name}", _Pool(label, int(entry["memory_free"])))

    @property
    def gpu_pools(self) -> list[_Pool]:
        return [p for p in self.pools if not p.is_host]

    # -- the levers

    def threads_changes(self) -> list[str]:
        changes = []
        cores = {"n_threads": self.machine.physical_cores, "n_threads_batch": self.machine.logical_cores}
        for name, limit in cores.items():
            value = getattr(self.settings, name)
            if value is not None and limit >= 1 and value > limit:
                kind = "physical cores" if name == "n_threads" else "logical cores"
                self.changed_settings[name] = limit
                changes.append(f"{name} reduced from {value} to {limit}: this machine has {limit} {kind}")
        return changes

    def fit(self) -> list[str]:
        """Degrade until every pool fits; returns the changes in words (empty when it fits as is)."""
        ctx0 = self._recorded_ctx()
        kv_per_token_layer = self.sizing.kv_bytes_per_token_per_layer
        # KV layers per pool, read from the recorded KV size (kv = per_token_layer * layers * cells).
        kv_layers = {id(p): (p.kv / (kv_per_token_layer * self._cells(ctx0)) if kv_per_token_layer and ctx0 else 0.0)
                     for p in self.pools}
        short = [p for p in self.pools if not self._fits(p, p.need)]
        if not short:
            return []
        changes = []

        def need_at(pool: _Pool, ctx: int, moved_layers: float = 0.0, moved_output: bool = False) -> float:
            kv_freed = kv_per_token_layer * kv_layers[id(pool)] * (self._cells(ctx0) - self._cells(ctx))
            return pool.need - kv_freed + self._moved(pool, ctx, moved_layers, moved_output)

        # Lever 1: the context, down to min_ctx, in llama.cpp's 256-token steps.
        min_ctx = min(self.profile.min_ctx, ctx0)
        why = self._why({id(p): p.need for p in short})
        for ctx in self._contexts(ctx0, min_ctx):
            if all(self._fits(p, need_at(p, ctx)) for p in self.pools):
                self.changed_settings["n_ctx"] = ctx
                return [self._ctx_change(ctx0, ctx, why)]
        ctx = min_ctx if any(kv_layers[id(p)] for p in short) else ctx0
        if ctx != ctx0:
            changes.append(self._ctx_change(ctx0, ctx, why))
            self.changed_settings["n_ctx"] = ctx

        # Lever 2: fewer GPU layers, one at a time; the output layer goes first.
        n_layer, total = self.sizing.n_layer, self.profile.layers_total
        layers0 = self._offloaded_layers()
        still_short = {id(p): need_at(p, ctx) for p in self.pools if not self._fits(p, need_at(p, ctx))}
        at_min = f"even at the minimum context ({ctx} tokens), " if ctx != ctx0 else ""
        for layers in range(layers0 - 1, -1, -1):
            moved_output = layers0 > n_layer and layers <= n_layer
            moved_layers = float(min(layers0, n_layer) - min(layers, n_layer))
            if all(self._fits(p, need_at(p, ctx, moved_layers, moved_output)) for p in self.pools):
                self.changed_settings["n_gpu_layers"] = layers
                self.layers_reduced = True
                was = f"all {total}" if layers0 >= total else str(layers0)
                changes.append(
                    f"GPU layers reduced from {was} to {layers} of {total}: a partial offload the profile did not "
                    f"choose, so generation will be slower than the {self.profile.measured.tg.median:g} t/s it "
                    f"measured. Because {at_min}{self._why(still_short)}"
                )
                return changes
        final = {id(p): need_at(p, ctx, float(min(layers0, n_layer)), layers0 > n_layer) for p in self.pools}
        raise ProfileMismatchError(
            f"profile {self.profile.name} does not fit this machine now, even with a context of {ctx} tokens and no "
            f"layer on the GPU: {self._why({k: v for k, v in final.items() if not self._fits(self._pool(k), v)})}. "
            "Free the memory, or tune again on this machine as it is"
        )

    # -- arithmetic

    def _cells(self, ctx: int) -> float:
        """KV cells per layer at ``ctx``, averaged over the layers: the estimate's arithmetic
        (``cache_cells``), with the model's sliding-window layers holding their window unless
        ``swa_full``."""
        sizing = self.sizing
        cells, swa_cells = cache_cells(ctx, self.settings.n_ubatch, sizing.sliding_window, self.settings.swa_full,
                                       n_seq=self.settings.n_parallel, unified=self.settings.kv_unified)
        if not sizing.swa_layers:
            return float(cells)
        return ((sizing.n_layer - sizing.swa_layers) * cells + sizing.swa_layers * swa_cells) / sizing.n_layer

    def _recorded_ctx(self) -> int:
        if self.settings.n_ctx or self.sizing.n_ctx_train:
            return context_tokens(self.settings.n_ctx, self.sizing.n_ctx_train or 0)
        # n_ctx 0 means the model's training context; a 1.0 profile did not record it: recover it
        # from the recorded KV size (1.0 profiles ran full-size window caches: KV is linear in n_ctx).
        kv_total = sum(p.kv for p in self.pools)
        per_token = self.sizing.kv_bytes_per_token_per_layer * self.sizing.n_layer
        return int(kv_total / per_token) if per_token else 0

    def _offloaded_layers(self) -> int:
        if not self.gpu_pools:
            return 0
        total = self.profile.layers_total or self.sizing.n_layer + 1
        return offloaded_layers(self.settings.n_gpu_layers, total - 1)

    def _contexts(self, ctx0: int, min_ctx: int) -> list[int]:
        steps = []
        ctx = (ctx0 - 1) // CTX_STEP * CTX_STEP
        while ctx > min_ctx:
            steps.append(ctx)
            ctx -= CTX_STEP
        if min_ctx < ctx0:
            steps.append(min_ctx)
        return steps

    def _layer_weight_on_gpu(self) -> float:
        # With tensor overrides part of each offloaded layer stays on the CPU: use what the GPUs
        # were predicted to hold per layer instead of the whole layer.
        if not self.settings.tensor_overrides:
            return float(self.sizing.layer_weight_bytes)
        layers = self._offloaded_layers()
        output_on_gpu = layers > self.sizing.n_layer
        repeating = min(layers, self.sizing.n_layer)
        gpu_weights = sum(p.weights for p in self.gpu_pools) - (self.sizing.output_weight_bytes if output_on_gpu else 0)
        if repeating <= 0:
            return 0.0
        return max(0.0, min(float(self.sizing.layer_weight_bytes), gpu_weights / repeating))

    def _moved(self, pool: _Pool, ctx: int, moved_layers: float, moved_output: bool) -> float:
        """Bytes this pool gains (host) or loses (GPU) when layers move to the CPU."""
        if not moved_layers and not moved_output:
            return 0.0
        kv_per_layer = self.sizing.kv_bytes_per_token_per_layer * self._cells(ctx) if self.settings.offload_kqv else 0.0
        weight = self._layer_weight_on_gpu()
        output = float(self.sizing.output_weight_bytes) if moved_output else 0.0
        if pool.is_host:
            gained_weights = 0.0 if self.settings.use_mmap else weight * moved_layers + output
            return gained_weights + kv_per_layer * moved_layers
        gpus = self.gpu_pools
        total_share = sum(self._share(p) for p in gpus)
        share = self._share(pool) / total_share if total_share else 1.0 / len(gpus)
        return -share * ((weight + kv_per_layer) * moved_layers + output)

    def _share(self, pool: _Pool) -> float:
        """A GPU pool's share of the offloaded layers (tensor split as llama.cpp applied it)."""
        return pool.kv if any(p.kv for p in self.gpu_pools) else pool.weights

    def _fits(self, pool: _Pool, need: float) -> bool:
        return need + self.margin <= pool.free

    # -- words

    def _pool(self, key: int) -> _Pool:
        return next(p for p in self.pools if id(p) == key)

    def _why(self, needs: dict[int, float]) -> str:
        """``{id(pool): bytes needed}`` of the pools that do not fit, in words, with who holds the GPU."""
        reasons = []
        for key, need in needs.items():
            pool = self._pool(key)
            text = (
                f"{pool.label} has {format_bytes(pool.free)} free now and would need {format_bytes(need)} "
                f"+ {format_bytes(self.margin)} margin"
            )
            if pool.gpu is not None:
                text += f"; {_holders(pool.gpu)}"
            reasons.append(text)
        return "; ".join(reasons)

    def _ctx_change(self, ctx0: int, ctx: int, why: str) -> str:
        recorded = f"{ctx0}" if self.settings.n_ctx else f"{ctx0} (the model's training context)"
        return f"context reduced from {recorded} to {ctx} tokens (not below the profile's min_ctx, {self.profile.min_ctx}) because {why}"


def _holders(gpu: "GPU") -> str:
    if not gpu.processes:
        return f"NVML lists no process holding memory on GPU {gpu.index}"
    held = ", ".join(
        f"pid {p.pid} {p.name} ({format_bytes(p.used_memory) if p.used_memory is not None else 'size not reported'})" for p in gpu.processes
    )
    return f"GPU {gpu.index} memory is held by {held}"


# -- loading -----------------------------------------------------------------------------------


def Llama(
    model_path: str | os.PathLike[str],
    *,
    profile: Profile | str | os.PathLike[str] | None = None,
    search_path: SearchPath = None,
    strict: bool = False,
    machine: "Machine | None" = None,
    verbose: bool = False,
    **overrides: Any,
) -> Any:
    """``llama_cpp.Llama`` for ``model_path``, run as its profile says; ``overrides`` win over the profile.

    ``profile``: None (``load_profile`` finds and checks it), a path (read, then checked), or a
    ``Profile`` (used as given: pass one from ``load_profile``).
    """
    if profile is None:
        profile = load_profile(model_path, search_path=search_path, machine=machine, strict=strict)
    elif not isinstance(profile, Profile):
        profile = check_profile(read_profile(profile), model_path, machine=machine, strict=strict)
    settings = profile.settings
    _check_overrides(settings, overrides)
    applied: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    repack = overrides.pop("repack", settings.repack)
    if settings.host_overrides or not repack:  # tensor_overrides, n_cpu_moe's per-layer patterns, repack off
        from ..engine.overrides import tensor_overrides_applied

        applied = tensor_overrides_applied(settings.host_overrides, repack=bool(repack))
    if settings.rpc_servers:
        from ..engine.rpc import register_servers

        register_servers(settings.rpc_servers)

    import llama_cpp

    try:
        os.fspath(model_path).encode("utf-8")
    except UnicodeEncodeError:
        # llama-cpp-python's Llama opens model_path.encode("utf-8"), which a name that is not UTF-8
        # (kept by Python as surrogate escapes) cannot be
        raise ProfileMismatchError(
            f"{os.fspath(model_path)!r}: llama-cpp-python's Llama cannot open a file whose name is not UTF-8; "
            "rename the file, or link to it under a UTF-8 name"
        ) from None
    if repack:
        message = repack_warning(profile, _llama_system_info(llama_cpp), machine)
        if message:
            warnings.warn(message, ProfileWarning, stacklevel=2)
    _check_devices(profile)
    kwargs = {**profile.llama_kwargs(model_path), **overrides, "verbose": verbose}
    if kwargs.get("n_gpu_layers") and not llama_cpp.llama_supports_gpu_offload():
        message = (
            f"profile {profile.name} puts {settings.n_gpu_layers} layer(s) on the GPU, but this llama-cpp-python is "
            "built without GPU offload: every layer would run on the CPU. Reinstall llama-cpp-python with "
            "CUDA, Metal or Vulkan"
        )
        if strict:
            raise ProfileMismatchError(message)
        warnings.warn("PARTIAL OFFLOAD: " + message, ProfileDegradedWarning, stacklevel=2)
    with applied:
        return llama_cpp.Llama(**kwargs)


def _llama_system_info(llama_cpp: Any) -> str | None:
    """llama.cpp's ``llama_print_system_info`` (the CPU features its CPU backend was built for)."""
    read = getattr(llama_cpp, "llama_print_system_info", None)
    if read is None:
        return None
    info = read()
    return info.decode(errors="replace") if isinstance(info, bytes) else str(info)


def repack_warning(profile: Profile, system_info: str | None, machine: "Machine | None" = None) -> str | None:
    """A warning for a profile that leaves weight repacking on where llama.cpp repacks into AMX (this
    CPU's features as llama.cpp reports them, ``system_info``) and was not measured on this machine:
    llama.cpp is known to crash at the first decode there (ggml-org/llama.cpp#20824). None otherwise."""
    from ..model.repack import CpuFeatures

    cpu = CpuFeatures.parse(system_info)
    if cpu is None or not cpu.amx or not profile.settings.repack:
        return None
    from ..machine.identity import match

    here = machine if machine is not None else this_machine()
    if match(profile.machine, here) in ("fingerprint", "legacy fingerprint"):
        return None  # measured here with repacking on: it ran
    return (f"profile {profile.name} loads with weight repacking on, and this CPU has AMX (llama.cpp: AMX_INT8 = 1): "
            "llama.cpp repacks the CPU's weights into an AMX buffer and is known to crash at the first decode on some "
            "of these machines (ggml-org/llama.cpp#20824). If it does, load with repack=False "
            "(tuner.Llama(model, repack=False); llama-server --no-repack), or tune here: `offload-tuner tune` finds it")


def _check_devices(profile: Profile) -> None:
    """llama-cpp-python's Llama takes no device list: llama.cpp picks its devices itself. Warn when the
    devices it will pick here (this process's ggml registry, llama_cpp being loaded already) are not the
    profile's, so its tensor split would land on other devices than the ones tuned."""
    from ..engine.ggml import list_devices
    from ..machine.devices import used_devices

    wanted = [n for n in profile.settings.devices if not n.startswith("RPC")]
    if not wanted:
        # llama.cpp's own choice when tuning: the devices it would have used among those it listed
        recorded = [{"memory_free": None, **dataclasses.asdict(d)} for d in profile.machine.devices]
        wanted = [d.name for d in used_devices(recorded) if not d.name.startswith("RPC")]
    if not wanted or profile.settings.n_gpu_layers == 0:
        return

    try:
        here = [d.ggml_name or d.name for d in used_devices(list_devices()) if not d.rpc_endpoint]
    except (OSError, AttributeError):  # ggml's library not found beside this llama_cpp: nothing to compare
        return
    if not here:
        # nothing to offload to: every layer the profile puts on its devices runs on the CPU
        warnings.warn(
            f"PARTIAL OFFLOAD: profile {profile.name} was tuned on the devices {', '.join(wanted)}, and this "
            "llama-cpp-python's llama.cpp has no GPU device (its backends here: CPU only): its layers would run on "
            "the CPU. Run it with the llama.cpp binaries that measured it (offload-tuner profile args NAME --for "
            "llama-server), or reinstall llama-cpp-python for that GPU (offload-tuner doctor prints the line)",
            ProfileDegradedWarning,
            stacklevel=3,
        )
    elif here != wanted:
        warnings.warn(
            f"profile {profile.name} was tuned on the devices {', '.join(wanted)}; llama.cpp here would use "
            f"{', '.join(here)} (llama-cpp-python cannot be told which): its layers and tensor split may "
            "land elsewhere; limit the visible devices (CUDA_VISIBLE_DEVICES, GGML_VK_VISIBLE_DEVICES...) or tune here",
            ProfileWarning,
            stacklevel=3,
        )


# Llama keywords that are Settings fields of the same name and type: checked as the profile's own
# values are (tuner.limits), so Llama(model, n_ctx=2**62) is one clear error, not a crash in ctypes.
_SAME_AS_SETTINGS = ("n_gpu_layers", "main_gpu", "n_ctx", "n_batch", "n_ubatch", "n_threads", "n_threads_batch",
                     "tensor_split", "offload_kqv", "use_mmap", "use_mlock", "op_offload", "repack")


def _check_overrides(settings: Any, overrides: dict[str, Any]) -> None:
    checked = {k: v for k, v in overrides.items() if k in _SAME_AS_SETTINGS}
    if not checked:
        return
    try:
        settings.replace(**checked)
    except SettingsError as exc:
        name = exc.field.split(".", 1)[-1]
        raise SettingsError(name, f"{str(exc)[len(exc.field) + 2:]} (tuner.Llama's keyword {name.split('[')[0]})") from None


__all__ = ["load_profile", "check_profile", "this_machine", "model_mismatch", "Llama", "DEFAULT_MARGIN_BYTES",
           "repack_warning"]
