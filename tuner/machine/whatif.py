"""A machine described rather than probed: "a 24 GiB card and 64 GiB of RAM", or a colleague's.

Sizing questions are often about a machine you do not have ("would a 24 GB card run it fully
offloaded at 32k?"). ``MachineSpec`` is what the memory arithmetic needs of a machine: each
accelerator's name (as llama.cpp names it: ``CUDA0``, ``Vulkan0``, ``MTL0``, ``RPC0[host:port]``) with
the bytes it can give, and the host's RAM. It comes from

- ``--device NAME=SIZE`` (repeatable) and ``--ram SIZE``: ``parse_device`` / ``parse_size``;
- the old ``--devices A,B --free MiB,MiB`` pair: ``from_free_list``;
- another machine's ``offload-tuner probe --json``: ``from_probe_json`` (its GPUs' free memory at the
  time it was probed, and its RPC devices);
- this machine: ``from_machine(probe())``.

Sizes are bytes here; ``24GiB``, ``12000MiB``, ``24GB`` (decimal), ``1.5T`` are read at the edge.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..errors import MachineSpecError

_UNITS = {
    "": 1, "B": 1,
    "K": 1 << 10, "KI": 1 << 10, "KIB": 1 << 10, "KB": 1000,
    "M": 1 << 20, "MI": 1 << 20, "MIB": 1 << 20, "MB": 1000 ** 2,
    "G": 1 << 30, "GI": 1 << 30, "GIB": 1 << 30, "GB": 1000 ** 3,
    "T": 1 << 40, "TI": 1 << 40, "TIB": 1 << 40, "TB": 1000 ** 4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
# A device name as llama.cpp prints it: letters, digits, and for RPC devices the endpoint in brackets.
_NAME = re.compile(r"[A-Za-z][\w.-]{0,63}(?:\[[\w.:\-\[\]]{1,200}\])?")  # fullmatch: "$" takes a trailing newline
MAX_BYTES = 1 << 60  # an exbibyte: anything larger is a typo


def parse_size(text: str, *, what: str = "size", default_unit: str = "") -> int:
    """``'24GiB'`` -> bytes. Binary units for K/M/G/T, GiB/MiB...; KB/MB/GB/TB are decimal, as disk
    and card makers print them. A bare number takes ``default_unit`` (bytes unless told)."""
    m = _SIZE.match(str(text))
    if not m:
        raise MachineSpecError(f"{what}: expected a size such as 24GiB, 12000MiB or 24GB, got {text!r}")
    unit = (m.group(2) or default_unit).upper()
    if unit not in _UNITS:
        raise MachineSpecError(f"{what}: unknown unit {m.group(2)!r} in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    value = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0 or value > MAX_BYTES:
        raise MachineSpecError(f"{what}: {text!r} is not a size a machine can have")
    return int(value)


def parse_device(text: str) -> tuple[str, int]:
    """``'CUDA0=24GiB'`` -> ``('CUDA0', 25769803776)``."""
    name, sep, size = str(text).partition("=")
    name = name.strip()
    if not sep or not name:
        raise MachineSpecError(f"--device: expected NAME=SIZE such as CUDA0=24GiB, got {text!r}")
    if not _NAME.fullmatch(name) or name.upper() == "CPU":
        raise MachineSpecError(f"--device: {name!r} is not an accelerator name as llama.cpp prints them "
                               "(CUDA0, ROCm0, Vulkan0, MTL0, SYCL0, RPC0...); the host's memory is --ram")
    return name, parse_size(size, what=f"--device {name}")


@dataclass(frozen=True)
class MachineSpec:
    """Accelerators (llama.cpp's names, in llama.cpp's order) with the bytes each can give, and RAM."""

    devices: dict[str, int] = field(default_factory=dict)
    ram: int | None = None
    source: str = "given"          # where it came from, for people: "this machine", "probe file x.json"
    names: dict[str, str] = field(default_factory=dict)  # device -> its model name, where known

    @property
    def has_accelerators(self) -> bool:
        return bool(self.devices)

    def describe(self) -> str:
        parts = [f"{name} {gib(size)}" + (f" ({self.names[name]})" if name in self.names else "")
                 for name, size in self.devices.items()]
        if self.ram is not None:
            parts.append(f"RAM {gib(self.ram)}")
        return ", ".join(parts) if parts else "no accelerator"

    def to_dict(self) -> dict[str, Any]:
        return {"devices": dict(self.devices), "ram": self.ram, "source": self.source}


def gib(n_bytes: float) -> str:
    """``'24.0 GiB'``, or ``'200 MiB'`` below a GiB: sizes for people."""
    return f"{n_bytes / (1 << 30):.1f} GiB" if abs(n_bytes) >= 1 << 30 else f"{n_bytes / (1 << 20):.0f} MiB"


def from_options(devices: Iterable[str] = (), ram: str | None = None) -> MachineSpec:
    """``--device NAME=SIZE`` (repeatable) and ``--ram SIZE``."""
    out: dict[str, int] = {}
    for text in devices:
        name, size = parse_device(text)
        if name in out:
            raise MachineSpecError(f"--device: {name} given twice")
        out[name] = size
    return MachineSpec(devices=out, ram=parse_size(ram, what="--ram") if ram else None)


def from_free_list(free_mib: Sequence[float], names: Sequence[str] | None = None) -> MachineSpec:
    """The old ``--free MiB,MiB [--devices A,B]`` form (devices ``GPU0..`` unless named)."""
    names = list(names) if names else [f"GPU{i}" for i in range(len(free_mib))]
    if len(names) != len(free_mib):
        raise MachineSpecError(f"{len(free_mib)} --free values for {len(names)} devices")
    return MachineSpec(devices={n: parse_size(str(v), what=f"--free for {n}", default_unit="MiB")
                                for n, v in zip(names, free_mib)})


def from_machine(machine: Any, *, source: str = "this machine") -> MachineSpec:
    """A probed ``Machine`` (``tuner.machine.probe``): free memory of its GPUs now, its RPC devices."""
    devices: dict[str, int] = {}
    names: dict[str, str] = {}
    used = machine.used_accelerators() if getattr(machine, "devices", ()) else []
    if used:  # llama.cpp's devices, as it will use them; NVML's free memory now where it pairs with one
        gpus = {g.index: g for g in machine.gpus}
        for d in used:
            gpu = gpus.get(d.get("nvml_index"))
            free = gpu.memory_free if gpu is not None else d.get("memory_free") or d.get("memory_total") or 0
            devices[d["name"]] = int(free)
            names[d["name"]] = d.get("description") or d["name"]
        ram = getattr(machine, "ram_available", None) or getattr(machine, "ram_total", None)
        return MachineSpec(devices=devices, ram=int(ram) if ram else None, source=source, names=names)
    for gpu in machine.gpus:
        devices[f"CUDA{gpu.index}"] = int(gpu.memory_free)
        names[f"CUDA{gpu.index}"] = gpu.name
    for i, rpc in enumerate(machine.rpc_devices):
        if rpc.get("error") or not rpc.get("memory_free"):
            continue
        name = f"RPC{i}[{rpc['endpoint']}]"
        devices[name] = int(rpc["memory_free"])
        names[name] = rpc.get("description") or rpc["endpoint"]
    ram = getattr(machine, "ram_available", None) or getattr(machine, "ram_total", None)
    return MachineSpec(devices=devices, ram=int(ram) if ram else None, source=source, names=names)


def from_probe_json(path: str | Path) -> MachineSpec:
    """Another machine's ``offload-tuner probe --json`` output.

    Read as data, field by field (a file from someone else is hostile input): GPUs give
    ``CUDA<index>`` with their free memory when probed (total if free is missing); a ``devices``
    list (``[{name, memory_free, memory_total}]``, as llama.cpp names them) is used when present;
    RPC devices come as ``RPC<i>[endpoint]``; RAM is ``ram_total``.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MachineSpecError(f"--machine {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise MachineSpecError(f"--machine {p}: cannot read it ({exc.__class__.__name__})") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise MachineSpecError(f"--machine {p}: not JSON ({exc.__class__.__name__}: {str(exc)[:80]}); "
                               "give the output of `offload-tuner probe --json`") from None
    if not isinstance(data, Mapping):
        raise MachineSpecError(f"--machine {p}: expected the JSON object `offload-tuner probe --json` prints")
    devices: dict[str, int] = {}
    names: dict[str, str] = {}

    def size(entry: Mapping[str, Any], where: str) -> int:
        for key in ("memory_free", "memory_total"):
            value = entry.get(key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_BYTES:
                raise MachineSpecError(f"--machine {p}: {where}.{key}: expected a byte count, got {value!r}")
            return int(value)
        raise MachineSpecError(f"--machine {p}: {where}: no memory_free or memory_total")

    listed = data.get("devices")
    if isinstance(listed, list) and listed:
        for i, entry in enumerate(listed[:64]):
            where = f"devices[{i}]"
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or not _NAME.fullmatch(entry["name"]):
                raise MachineSpecError(f"--machine {p}: {where}.name: expected a device name such as CUDA0")
            if entry["name"].upper().startswith("CPU") or entry.get("type") in ("cpu", "CPU"):
                continue
            devices[entry["name"]] = size(entry, where)
            if isinstance(entry.get("description"), str):
                names[entry["name"]] = entry["description"][:100]
    else:
        gpus = data.get("gpus", [])
        if not isinstance(gpus, list):
            raise MachineSpecError(f"--machine {p}: gpus: expected a list")
        for i, gpu in enumerate(gpus[:64]):
            where = f"gpus[{i}]"
            if not isinstance(gpu, Mapping):
                raise MachineSpecError(f"--machine {p}: {where}: expected an object")
            index = gpu.get("index", i)
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1024:
                raise MachineSpecError(f"--machine {p}: {where}.index: expected a small integer, got {index!r}")
            devices[f"CUDA{index}"] = size(gpu, where)
            if isinstance(gpu.get("name"), str):
                names[f"CUDA{index}"] = gpu["name"][:100]
    rpc = data.get("rpc_devices", [])
    if isinstance(rpc, list):
        for i, entry in enumerate(rpc[:64]):
            if isinstance(entry, Mapping) and not entry.get("error") and isinstance(entry.get("endpoint"), str):
                name = f"RPC{i}[{entry['endpoint']}]"
                if _NAME.fullmatch(name):
                    devices[name] = size(entry, f"rpc_devices[{i}]")
    ram = data.get("ram_total")
    if ram is not None and (isinstance(ram, bool) or not isinstance(ram, (int, float)) or not 0 < ram <= MAX_BYTES):
        raise MachineSpecError(f"--machine {p}: ram_total: expected a byte count, got {ram!r}")
    return MachineSpec(devices=devices, ram=int(ram) if ram else None, source=f"probe file {p.name}", names=names)


def device_matches(spec_name: str, log_name: str) -> bool:
    """``RPC0`` names ``RPC0[127.0.0.1:50052]`` too (logs print both forms), and names compare
    without case (``Metal`` / ``MTL0`` are different devices and stay different)."""
    a, b = spec_name.lower(), log_name.lower()
    return a == b or a.split("[", 1)[0] == b or b.split("[", 1)[0] == a
