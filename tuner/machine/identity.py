"""A machine's identity: its fingerprint and hardware class, computed here and nowhere else.

The tuner (``Profile.from_tuning``), an app loading a profile (``load_profile``, ``tuner.Llama``,
``profile list/check``) and a registry pull all call ``fingerprint`` / ``hardware_class`` on the
``Machine`` they probed, so a profile is found by the machine that wrote it whichever engine probed and
whether NVML is there. The facts are the stable ones:

- the CPU's model and core counts, and the RAM rounded to GiB;
- each local device llama.cpp will use (``tuner.machine.devices.used_devices``: an iGPU beside a
  discrete GPU is not one; RPC servers are other machines), by its model: the description llama.cpp
  gives, without the driver's suffix in parentheses (``(RADV NAVI31)``, ``(LLVM 15.0.6, 256 bits)``),
  so a CUDA and a Vulkan build of the same card agree; and its total memory in GiB for a discrete GPU;
- whether those devices share the host's RAM (``unified``): all of them do (Apple silicon, an APU alone).

Never a limit a user tunes: a unified device's "total memory" is Metal's ``recommendedMaxWorkingSetSize``
(``iogpu.wired_limit_mb`` raises it) or an APU's GTT/VRAM carve-out (a kernel parameter, a BIOS
setting), so for those the RAM stands for the memory. Not the PCI bus id either: ``--list-devices``
does not print it, so a binaries probe and a ctypes probe would disagree, and a card moved to another
slot is the same card. Not NVML: NVIDIA machines are identified by llama.cpp's devices like the others
(NVML's names only stand in when no llama.cpp could be asked).

``legacy_identities`` recomputes what offload-tuner wrote before (profiles up to schema 1.3), so those
profiles still load; ``differences`` says what changed between a recorded machine and this one, in words.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

from .devices import device_model, used_devices

Machine = Any  # tuner.machine.probe.Machine (which calls this module: not imported here)

GiB = 1 << 30
def local_devices(machine: "Machine") -> list[dict[str, Any]]:
    """The machine's own devices llama.cpp will use, as identity facts: ``model``, ``type``, ``memory_gib``
    (``None`` for one sharing the RAM), in llama.cpp's order. Without llama.cpp's devices, NVML's GPUs."""
    if machine.devices:
        used = [d for d in used_devices(machine.devices) if not d.rpc_endpoint and d.backend != "RPC"]
        return [{"model": device_model(d.description or d.name), "type": d.type, "shares_ram": bool(d.unified_memory),
                 "memory_gib": None if d.unified_memory or d.memory_total is None else round(d.memory_total / GiB)}
                for d in used]
    return [{"model": device_model(g.name), "type": "gpu", "shares_ram": False, "memory_gib": round(g.memory_total / GiB)}
            for g in machine.gpus]


def unified(machine: "Machine") -> bool:
    """One memory pool: every local device llama.cpp will use shares the host's RAM (Apple silicon, an APU
    alone). An iGPU beside a discrete GPU does not make the machine unified; neither does a Metal device
    that llama.cpp says has its own memory (an Intel Mac's discrete GPU)."""
    local = [d for d in used_devices(machine.devices) if not d.rpc_endpoint and d.backend != "RPC"]
    return bool(local) and all(d.unified_memory for d in local)


def facts(machine: "Machine") -> dict[str, Any]:
    devices = local_devices(machine)
    return {
        "cpu_model": machine.cpu_model,
        "physical_cores": machine.physical_cores,
        "logical_cores": machine.logical_cores,
        "ram_gib": round(machine.ram_total / GiB),
        "devices": devices,
        "unified": bool(devices) and all(d["shares_ram"] for d in devices),
    }


def _hash(parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(machine: "Machine") -> str:
    """This machine: changes when its hardware changes, not with its load, its drivers' limits or the engine."""
    return _hash(["v2", facts(machine)])


def hardware_class(machine: "Machine") -> str:
    """The kind of machine: the same device models and memory (for a unified one, the same RAM), wherever."""
    f = facts(machine)
    devices = sorted(json.dumps(d, sort_keys=True) for d in f["devices"])
    return _hash(["v2", devices, f["unified"], f["ram_gib"] if f["unified"] else None])


def legacy_identities(machine: "Machine") -> tuple[str, str]:
    """(fingerprint, hardware class) as offload-tuner computed them before this module (schema <= 1.3):
    NVML's GPUs with their UUIDs, else every local accelerator llama.cpp listed with its total memory,
    and "unified" when any accelerator shared the RAM (or on Apple silicon)."""
    from ..engine.devices import DeviceInfo

    accelerators = [d for d in machine.devices if DeviceInfo.from_dict(d).is_accelerator and not d.get("rpc_endpoint")]
    local = [[d.get("description", ""), d.get("memory_total")] for d in accelerators]
    was_unified = any(d.get("unified_memory") for d in accelerators) or (machine.system == "Darwin" and machine.arch == "arm64")
    fp = {
        "cpu_model": machine.cpu_model,
        "physical_cores": machine.physical_cores,
        "logical_cores": machine.logical_cores,
        "ram_gib": round(machine.ram_total / GiB),
        "gpus": [[g.name, g.uuid, g.memory_total] for g in machine.gpus] or local,
        "unified_memory": was_unified,
    }
    cls = {"gpus": sorted([g.name, g.memory_total] for g in machine.gpus) or sorted(local), "unified_memory": was_unified}
    return (hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16],
            hashlib.sha256(json.dumps(cls, sort_keys=True).encode()).hexdigest()[:16])


def match(recorded: Any, machine: "Machine") -> str | None:
    """How a profile's recorded machine (``MachineInfo``) is this one: ``"fingerprint"``, ``"class"``,
    ``"legacy fingerprint"``, ``"legacy class"`` (a profile written before identity v2), or None."""
    if recorded.fingerprint == fingerprint(machine):
        return "fingerprint"
    if recorded.hardware_class == hardware_class(machine):
        return "class"
    old_fp, old_cls = legacy_identities(machine)
    if recorded.fingerprint == old_fp:
        return "legacy fingerprint"
    if recorded.hardware_class == old_cls:
        return "legacy class"
    return None


def differences(recorded: Any, machine: "Machine") -> list[str]:
    """What differs between a profile's recorded machine (``MachineInfo``) and this one, in words."""
    out = []
    if recorded.cpu_model != machine.cpu_model:
        out.append(f"CPU: {recorded.cpu_model} when tuned, {machine.cpu_model} here")
    if (recorded.physical_cores, recorded.logical_cores) != (machine.physical_cores, machine.logical_cores):
        out.append(f"cores: {recorded.physical_cores} physical / {recorded.logical_cores} logical when tuned, "
                   f"{machine.physical_cores} / {machine.logical_cores} here")
    if round(recorded.ram_total / GiB) != round(machine.ram_total / GiB):
        out.append(f"RAM: {recorded.ram_total / GiB:.0f} GiB when tuned, {machine.ram_total / GiB:.0f} GiB here")
    then = _recorded_devices(recorded)
    now = [_describe(d) for d in local_devices(machine)]
    if then is not None and then != now:
        out.append(f"devices llama.cpp uses: {', '.join(then) or 'none (CPU only)'} when tuned, "
                   f"{', '.join(now) or 'none (CPU only)'} here")
    if bool(recorded.unified_memory) != unified(machine) and then is not None:
        out.append(f"unified memory: {'yes' if recorded.unified_memory else 'no'} when tuned, "
                   f"{'yes' if unified(machine) else 'no'} here")
    return out


def _describe(d: Mapping[str, Any]) -> str:
    memory = ("shares the RAM" if d.get("shares_ram") else "memory unknown") if d["memory_gib"] is None else f"{d['memory_gib']} GiB"
    return f"{d['model']} ({memory})"


def _recorded_devices(recorded: Any) -> list[str] | None:
    devices = getattr(recorded, "devices", ())
    if devices:
        from ..engine.devices import backend_of

        dicts = [{"name": d.name, "description": d.description, "type": d.type, "memory_total": d.memory_total,
                  "memory_free": None, "unified_memory": d.unified_memory, "backend": backend_of(d.name)} for d in devices]
        used = [d for d in used_devices(dicts) if not d.rpc_endpoint and not d.name.startswith("RPC")]
        return [_describe({"model": device_model(d.description or d.name), "shares_ram": d.unified_memory,
                           "memory_gib": None if d.unified_memory or d.memory_total is None else round(d.memory_total / GiB)})
                for d in used]
    gpus = getattr(recorded, "gpus", ())
    if gpus:
        return [_describe({"model": device_model(g.name), "memory_gib": round(g.memory_total / GiB)}) for g in gpus]
    return None


__all__ = ["fingerprint", "hardware_class", "legacy_identities", "match", "differences", "facts", "unified",
           "local_devices", "device_model"]
