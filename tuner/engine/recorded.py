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
``tuner.machine.probe.cpu_model``, cores    ``cpu.txt`` (lscpu, ``system_info:``, or macOS ``sysctl``)
CUDA_VISIBLE_DEVICES in the environment     ``cuda-visible-devices-<value>.txt`` (a run recorded with it)
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

    def env_variant(self) -> str | None:
        """The recorded run for this process's ``CUDA_VISIBLE_DEVICES`` (``cuda-visible-devices-1.txt`` for
        ``1``, ``-1-0.txt`` for ``1,0``), where the folder has one and the variable differs from ``env.json``'s."""
        value = os.environ.get("CUDA_VISIBLE_DEVICES")
        if value is None or value == self.env().get("env", {}).get("CUDA_VISIBLE_DEVICES"):
            return None
        return self._text(f"cuda-visible-devices-{'-'.join(v.strip() for v in value.split(','))}.txt")

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
        """llama.cpp's devices (``DeviceInfo``) as the recorded outputs print them, the CPU first as ggml
        lists it. From ``list-devices.txt`` and ``load.log``, first found first: the ``Available devices:``
        block; else the memory breakdown (``common_memory_breakdown_print: | - NAME (DESC) | total = free
        ...``, its descriptions completed by ``common_params_fit_impl``'s lines); else the ``using device``
        lines (free memory only: the total is taken as the free figure, the most the log says). The
        backends' start-up lines beside them (Vulkan's ``uma``, Metal's unified memory, a ROCm APU's gfx
        target) say which are integrated, through ``parse_list_devices``; PCI bus ids come from ``using
        device NAME (DESC) (PCI)`` lines where given."""
        import dataclasses

        from ..engine.devices import DeviceInfo, parse_list_devices

        variant = self.env_variant()
        if variant is not None:  # the run recorded with this CUDA_VISIBLE_DEVICES: its start-up lines only
            return [DeviceInfo("CPU", self.cpu().get("model") or "CPU", "cpu", None, None, "CPU"),
                    *[DeviceInfo(f"CUDA{m['i']}", m["desc"], "gpu", None, None, "CUDA") for m in _CUDA_INIT.finditer(variant)]]
        text = "\n".join(t for t in (self.list_devices_text(), self.load_log()) if t)
        block = [line for line in _available_block(text)]
        if not block:
            block = _breakdown_block(text) or _using_block(text)
        found = [d for d in parse_list_devices(text + "\nAvailable devices:\n" + "\n".join(block)) if d.type != "cpu"]
        seen: dict[str, Any] = {}
        for d in found:
            seen.setdefault(d.name, d)
        pci = {m["name"]: m["pci"] for m in _USING.finditer(text) if m["pci"] and m["pci"] != "unknown id"}
        out = [DeviceInfo("CPU", self.cpu().get("model") or "CPU", "cpu", None, None, "CPU")]
        for d in seen.values():
            key = d.ggml_name or d.name
            out.append(dataclasses.replace(d, pci_bus_id=pci[key]) if key in pci else d)
        return out
    def cpu(self) -> dict[str, Any]:
        """``model``, ``physical_cores``, ``logical_cores``, ``ram_total``, ``flags`` where ``cpu.txt`` says them."""
        return _cpu_facts(self._text("cpu.txt") or "")


_USING = re.compile(r"using device (?P<name>\S+) \((?P<desc>.*?)\)(?: \((?P<pci>[^)]*)\))? - (?P<free>\d+) MiB free")
# ggml-cuda ggml_cuda_init: "  Device %d: %s, compute capability %d.%d, VMM: %s"
_CUDA_INIT = re.compile(r"^\s+Device (?P<i>\d+): (?P<desc>[^,\n]+), compute capability", re.MULTILINE)
_LISTED = re.compile(r"^\s+[A-Za-z][\w.-]*(?:\[[^\]]*\])?: .* \(\d+ MiB, \d+ MiB free\)\s*$")
# common/common.cpp common_memory_breakdown_print (2025-2026): "|   - CUDA0 (RTX 4090) | 24080 = 23604 + (...".
_BREAKDOWN = re.compile(r"memory_breakdown_print: \|\s+- (?P<name>[A-Za-z][\w.-]*\d) \((?P<desc>[^)]*)\)\s*\|\s*(?P<total>\d+) = (?P<free>\d+) ")
# common_params_fit_impl: "  - CUDA0 (NVIDIA GeForce RTX 4090):  24080 total, ..." (the full description)
_FIT = re.compile(r"fit_impl:\s+- (?P<name>[A-Za-z][\w.-]*\d) \((?P<desc>.*)\)\s*:\s*\d+ total")


def _available_block(text: str) -> list[str]:
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "Available devices:":
            return [ln.strip() and "  " + ln.strip() for ln in lines[i + 1:] if _LISTED.match(ln)]
    return []


def _breakdown_block(text: str) -> list[str]:
    full = {m["name"]: m["desc"] for m in _FIT.finditer(text)}
    out: dict[str, str] = {}
    for m in _BREAKDOWN.finditer(text):
        desc = full.get(m["name"], m["desc"]).strip()
        out.setdefault(m["name"], f"  {m['name']}: {desc} ({m['total']} MiB, {m['free']} MiB free)")
    return list(out.values())


def _using_block(text: str) -> list[str]:
    out: dict[str, str] = {}
    for m in _USING.finditer(text):
        out.setdefault(m["name"], f"  {m['name']}: {m['desc']} ({m['free']} MiB, {m['free']} MiB free)")
    return list(out.values())


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
    # llama.cpp's "system_info: n_threads = 4 (n_threads_batch = 4) / 8 | CPU : AVX = 1 | ...": the default
    # thread count is the physical cores (cpu_get_num_math), the figure after '/' the hardware threads
    m = re.search(r"system_info: n_threads = (?P<n>\d+)(?: \(n_threads_batch = \d+\))? / (?P<hw>\d+)(?P<rest>.*)", text)
    if m:
        out.setdefault("physical_cores", int(m["n"]))
        out.setdefault("logical_cores", int(m["hw"]))
    if flags:
        out["flags"] = tuple(flags.split())
    elif m:
        cpu_part = m["rest"].split("CPU :", 1)[1] if "CPU :" in m["rest"] else ""
        out["flags"] = tuple(k.lower() for k, v in re.findall(r"(\w+) = (\d)", cpu_part) if v == "1")
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
