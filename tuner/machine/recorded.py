"""A TEST SEAM: a recorded machine read instead of the hardware, at the lowest seams only.

When ``OFFLOAD_TUNER_TEST_MACHINE`` names a folder (``tests/machines/<kind>/``), the few functions
that ask the hardware read that folder instead, and everything above them runs as it does on a real
machine, in every process that inherits the variable (the trial worker, an app's probe):

==========================================  ==========================================================
seam                                        reads
==========================================  ==========================================================
``tuner.engine.ggml.list_devices``          ``list-devices.txt`` (``--list-devices``: llama.cpp's own
(ggml's device registry)                    names, descriptions, memory, start-up lines), PCI bus ids
                                            from ``load.log``'s ``using device`` lines where given
``tuner.engine.llamacpp`` ``--list-devices``  ``list-devices.txt``, verbatim
``tuner.engine.rpc.query_devices``          the RPC devices of ``list-devices.txt``
``tuner.machine.probe.probe_gpus`` (NVML)   ``nvml.json`` (absent: no NVIDIA driver)
``tuner.machine.probe.cpu_facts``           ``cpu.txt`` (lscpu, ``system_info:``, or macOS ``sysctl``)
platform (``Machine.system``)               ``env.json`` ``platform``
==========================================  ==========================================================

Every file is optional. It is never set outside tests: an unset or empty variable changes nothing,
and a folder that does not exist is an error (a typo must not fall back to the real machine).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

ENV_TEST_MACHINE = "OFFLOAD_TUNER_TEST_MACHINE"
MAX_FILE = 1 << 20  # recorded outputs are small; anything larger is not one


@dataclass(frozen=True)
class RecordedMachine:
    folder: Path

    def _text(self, name: str) -> str | None:
        path = self.folder / name
        if not path.is_file():
            return None
        with open(path, "rb") as handle:
            return handle.read(MAX_FILE).decode("utf-8", errors="replace")

    @property
    def kind(self) -> str:
        return self.folder.name

    def list_devices_text(self) -> str | None:
        return self._text("list-devices.txt")

    def load_log(self) -> str | None:
        return self._text("load.log")

    def env(self) -> dict[str, Any]:
        text = self._text("env.json")
        data = json.loads(text) if text else {}
        return data if isinstance(data, dict) else {}

    def platform(self) -> str | None:
        value = self.env().get("platform")
        return {"linux": "Linux", "darwin": "Darwin", "windows": "Windows"}.get(str(value).lower()) if value else None

    def rpc(self) -> list[str]:
        return [str(e) for e in self.env().get("rpc", ()) or ()]

    def nvml(self) -> list[dict] | None:
        """NVML's GPUs as recorded, or None where the machine has no NVIDIA driver (no nvml.json)."""
        text = self._text("nvml.json")
        if text is None:
            return None
        data = json.loads(text)
        return [g for g in data if isinstance(g, dict)] if isinstance(data, list) else []

    def devices(self) -> list[Any]:
        """llama.cpp's devices (``DeviceInfo``), as ``--list-devices`` printed them, with the PCI bus ids
        the load log's ``using device NAME (DESC) (PCI)`` lines give; the CPU first, as ggml lists it."""
        import dataclasses

        from ..engine.devices import DeviceInfo, parse_list_devices

        text = self.list_devices_text() or ""
        found = [d for d in parse_list_devices(text) if d.type != "cpu"]
        pci = {m["name"]: m["pci"] for m in _USING.finditer(self.load_log() or "") if m["pci"] and m["pci"] != "unknown id"}
        out = [DeviceInfo("CPU", self.cpu().get("model") or "CPU", "cpu", None, None, "CPU")]
        for d in found:
            out.append(dataclasses.replace(d, pci_bus_id=pci.get(d.ggml_name or d.name)) if pci.get(d.ggml_name or d.name) else d)
        return out

    def cpu(self) -> dict[str, Any]:
        """``model``, ``physical_cores``, ``logical_cores``, ``ram_total``, ``flags`` where ``cpu.txt`` says them."""
        return _cpu_facts(self._text("cpu.txt") or "")


_USING = re.compile(r"using device (?P<name>\S+) \((?P<desc>.*)\) \((?P<pci>[^)]*)\) - \d+ MiB free")


def _cpu_facts(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("machdep.cpu.brand_string")
    if model:
        out["model"] = model
    if fields.get("hw.memsize", "").isdigit():
        out["ram_total"] = int(fields["hw.memsize"])
    for key, name in (("hw.physicalcpu", "physical_cores"), ("hw.logicalcpu", "logical_cores"), ("cpu(s)", "logical_cores")):
        if fields.get(key, "").isdigit():
            out.setdefault(name, int(fields[key]))
    cores, sockets = fields.get("core(s) per socket", ""), fields.get("socket(s)", "")
    if cores.isdigit() and sockets.isdigit():
        out["physical_cores"] = int(cores) * int(sockets)
    flags = fields.get("flags")
    m = re.search(r"system_info: (.*)", text)
    if flags:
        out["flags"] = tuple(flags.split())
    elif m:
        out["flags"] = tuple(k.lower() for k, v in re.findall(r"(\w+) = (\d)", m[1]) if v == "1")
    return out


def recorded_machine() -> RecordedMachine | None:
    """The recorded machine named by ``OFFLOAD_TUNER_TEST_MACHINE``, or None (the real machine)."""
    value = os.environ.get(ENV_TEST_MACHINE, "")
    return _load(value) if value else None


@lru_cache(maxsize=8)
def _load(value: str) -> RecordedMachine:
    folder = Path(value)
    if not folder.is_dir():
        raise RuntimeError(f"{ENV_TEST_MACHINE}={value}: no such folder (a test seam: unset it to probe this machine)")
    return RecordedMachine(folder)


__all__ = ["ENV_TEST_MACHINE", "RecordedMachine", "recorded_machine"]
