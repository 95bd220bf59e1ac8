"""Read a llama.cpp load/run log and say what happened: ``parse_log(text) -> LoadReport``.

The text is either the trial worker's own log or any llama.cpp log a user pastes (llama-cli,
llama-server, llama-bench, llama-cpp-python, Ollama, LM Studio, ...), from the 2023 GGUF
``llm_load_tensors`` era to the 2026 ``load_tensors`` / ``llama_kv_cache`` / ``sched_reserve`` era.

What it pulls out (all sizes in bytes; llama.cpp prints MiB, and its 2023 "MB" is MiB too):

* layers offloaded / total (``offloaded X/Y layers to GPU``, or counted from the
  ``layer N assigned to device X`` debug lines when every layer is listed);
* weight buffers per buffer label, KV cache and compute buffers per device, KV total and types,
  context size, free device memory, prompt/eval tokens per second, build number;
* allocation failures (``oom``) and the failure lines themselves (``errors``).

How it reads:

1. Transport damage is undone first: CRLF, ANSI colours, and any stack of prefixes that whatever
   carried the log put in front of llama.cpp's lines (docker compose's ``service-1  | ``; ISO
   timestamps of every precision, bracketed or not, two in a row as Docker Model Runner writes
   them; Go, epoch, time-of-day and glog timestamps; journald and syslog in their BSD, RFC 5424,
   short-iso / monotonic / unix forms; CRI stream tags; Python logging; llama.cpp's own
   ``0.00.015.212 I`` prefix), ``[DEBUG]`` / ``INFO [  func]`` headers, JSON log lines and Ollama's
   ``time=... level=... msg=...`` lines (their ``msg`` is read as a log line), glued lines
   (progress dots or a ``)`` directly followed by the next message), collapsed whitespace, decimal
   commas. A carrier that says a line is an error (``level=ERROR``, ``E`` levels, syslog
   priorities 0-3) makes it one.
2. Each logical line is matched against regexes written from llama.cpp's format strings; every
   regex names, in a comment, the format string it matches and the era that printed it.
3. A log can hold more than one model load (``--fit`` dry runs load the model and create a context
   without allocating, then the real load repeats the same lines; a server switches models; a log
   ends in the middle of the next load). Every load is kept in ``LoadReport.loads``, in order, with
   the last context created on it; model-scoped values start afresh when a new load starts,
   context-scoped values when a new context starts. The top-level fields are those of the last load
   that got as far as a context (else of the last load), so a second load that was cut off, or
   failed, never hides the first one's context.

A log is text someone else wrote. Nothing here raises on garbage (an unparseable text gives an empty
``LoadReport``); numbers beyond what llama.cpp could print (a 400-digit count, ``1e400``, ``NaN``, a
negative size) are read as "not said"; and time is linear in the input: lines over 8 KiB are read
whole for JSON fields only, every regex is linear, and a cheap word test keeps most lines away from
the regexes (``benchmarks/logparse_speed.py`` measures it). Pure Python, parsing uses only ``re``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

MiB = 1048576

__all__ = ["LoadReport", "ModelLoad", "parse_log", "format_report", "accuracy_report", "truth_matches", "main"]


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------

# Buffer labels that live in host RAM, not on an accelerator. ggml names host buffers after the
# CPU backend ("CPU", "CPU_Mapped", "CPU_REPACK", "CPU_AARCH64"), after the accelerator's pinned
# host memory ("CUDA_Host", "Vulkan_Host", "ROCm_Host", "SYCL_Host"), or after a CPU extra buffer
# type ("AMX", "BLAS"); the 2023 summary lines are host figures by definition.
_HOST_LABEL = re.compile(r"^(?:CPU.*|.*_Host|AMX|BLAS|KLEIDIAI|HBM|mem required.*|system memory used.*)$",
                         re.IGNORECASE)


def _is_host_label(label: str) -> bool:
    return bool(_HOST_LABEL.match(label)) or "host" in label.lower()


def _normalise_device(label: str) -> str:
    """Weight-buffer label -> device: ``MTL0_Mapped`` -> ``MTL0``, ``VRAM used`` -> ``VRAM``.

    ``_Mapped`` only says the weights are mmap'd into that device's address space (Metal and
    CUDA on unified memory); the device is the same.
    """
    if label == "VRAM used":
        return "VRAM"
    if label.endswith("_Mapped"):
        return label[: -len("_Mapped")]
    return label


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return value


@dataclass(frozen=True)
class ModelLoad:
    """One model load in a log, with the last context created on it (``None``/empty where the log
    does not say: a load cut off or failed before its context has no ``n_ctx`` or KV)."""

    layers_offloaded: int | None = None
    layers_total: int | None = None
    model_buffers: dict[str, int] = field(default_factory=dict)   # label as printed -> bytes
    kv_buffers: dict[str, int] = field(default_factory=dict)      # device -> bytes
    compute_buffers: dict[str, int] = field(default_factory=dict)  # device -> bytes
    kv_size: int | None = None                                    # total KV bytes
    type_k: str | None = None
    type_v: str | None = None
    n_ctx: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class LoadReport:
    """What a llama.cpp log says: every model load (``loads``, in order), the run, the failures.

    The load fields (``layers_*``, ``model_buffers``, ``kv_*``, ``compute_buffers``, ``type_*``,
    ``n_ctx``) are those of the last load that got as far as a context (else of the last load);
    ``oom``, ``errors``, ``devices``, the speeds and ``build`` are the whole log's.
    """

    layers_offloaded: int | None = None
    layers_total: int | None = None
    oom: bool = False
    model_buffers: dict[str, int] = field(default_factory=dict)   # label as printed -> bytes
    kv_buffers: dict[str, int] = field(default_factory=dict)      # device -> bytes
    compute_buffers: dict[str, int] = field(default_factory=dict)  # device -> bytes
    kv_size: int | None = None                                    # total KV bytes
    type_k: str | None = None
    type_v: str | None = None
    n_ctx: int | None = None
    devices: dict[str, int] = field(default_factory=dict)         # device -> FREE bytes
    prompt_tps: float | None = None
    eval_tps: float | None = None
    build: str | None = None
    errors: tuple[str, ...] = ()
    loads: tuple[ModelLoad, ...] = ()
    # ``ollama ps``'s PROCESSOR column ("48%/52% CPU/GPU", "100% GPU"): the share of the loaded
    # model on each side, in percent, where the text is such a table
    processor_split: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()   # what a reader of the figures must know (Ollama rounds its sizes)

    @property
    def partial_offload(self) -> bool | None:
        """True when some but not all layers were offloaded (the slow middle ground); None when
        the log doesn't say. Nothing offloaded (a CPU run) is not partial offload."""
        if self.layers_offloaded is None or self.layers_total is None:
            if self.processor_split:
                return 0 < self.processor_split.get("GPU", 0) < 100
            return None
        return 0 < self.layers_offloaded < self.layers_total

    @property
    def cpu_only(self) -> bool | None:
        """Whether the run used no accelerator at all, from every fact the log gives, in one place:
        False when any layer really ran offloaded, any accelerator holds weights, KV or compute, or
        ``ollama ps`` shows a GPU share; True when layers were counted and none ran on an
        accelerator (nothing offloaded, or the silent CPU fallback); None when the log does not say."""
        if self.effective_layers_offloaded:
            return False
        for buffers in (self.device_weights, self.kv_buffers, self.compute_buffers):
            if any(size > 0 and not _is_host_label(label) and label != "compute buffer total"
                   for label, size in buffers.items()):
                return False
        if self.processor_split:
            return self.processor_split.get("GPU", 0) == 0
        if self.effective_layers_offloaded == 0:
            return True
        return None

    @property
    def device_weights(self) -> dict[str, int]:
        """Weight bytes per accelerator device, names normalised (``Metal_Mapped`` -> ``Metal``).

        The 2023 ``VRAM used`` line names no device, so it becomes the pseudo-device ``VRAM``;
        when a named accelerator buffer exists as well (llamafile printed ``VRAM used: 0.00 MB``
        next to its Metal ``data`` buffers), the pseudo-device says nothing more and is dropped.
        """
        out: dict[str, int] = {}
        for label, size in self.model_buffers.items():
            if _is_host_label(label):
                continue
            dev = _normalise_device(label)
            out[dev] = out.get(dev, 0) + size
        if "VRAM" in out and len(out) > 1:
            del out["VRAM"]
        return out

    @property
    def effective_layers_offloaded(self) -> int | None:
        """Layers that really run on an accelerator.

        A CUDA build on a machine where CUDA init failed still prints ``offloaded 9/9 layers to
        GPU`` and then puts every weight in ``CPU_Mapped``: when weight buffers were printed and
        none of them is on an accelerator (or all of those are empty), nothing was offloaded.
        """
        if self.layers_offloaded is None:
            return None
        if self.layers_offloaded > 0 and self.model_buffers:
            if not any(v > 0 for v in self.device_weights.values()):
                return 0
        return self.layers_offloaded

    @property
    def offload_fell_back(self) -> bool:
        """The log claims offloaded layers but no accelerator holds any weights."""
        return bool(self.layers_offloaded) and self.effective_layers_offloaded == 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of every field, by name (tuples become lists, dicts are copied, each
        load a dict)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


# ----------------------------------------------------------------------------------------------
# Numbers
# ----------------------------------------------------------------------------------------------

# A printed decimal, with a decimal comma allowed (locales that print "1024,00 MiB").
_NUM = r"\d+(?:[.,]\d+)?"
# Size units llama.cpp prints. 2023 builds printed "MB" but divided by 1024*1024.
_UNIT = r"(?:[KMG]i?B|B)\b"
_UNIT_FACTOR = {"B": 1, "KB": 1024, "KIB": 1024, "MB": MiB, "MIB": MiB, "GB": 1024 * MiB, "GIB": 1024 * MiB}


# A log is text someone else wrote: every number read from it is bounded before it is used, so a
# 400-digit figure (or 1e400) is "not said" instead of an OverflowError in whoever formats it.
# No llama.cpp count (layers, cells, tokens, build number) reaches 10^15, and no buffer 2^60 bytes.
_MAX_DIGITS = 15
_MAX_BYTES = 1 << 60
_MAX_RATE = 1e9  # tokens per second


def _int(s: str | None) -> int | None:
    """A count as printed, or None when it is absent or absurd."""
    if s is None or len(s) > _MAX_DIGITS:
        return None
    try:
        return int(s)
    except ValueError:
        return None


def _float(s: str | None, limit: float = 1e18) -> float | None:
    if s is None or len(s) > 40:
        return None
    try:
        v = float(s.replace(",", "."))
    except ValueError:
        return None
    return v if math.isfinite(v) and abs(v) <= limit else None


def _bytes(num: str, unit: str = "MiB") -> int | None:
    v = _float(num)
    if v is None or v < 0:
        return None
    size = int(round(v * _UNIT_FACTOR.get(unit.upper(), MiB)))
    return size if size <= _MAX_BYTES else None


def _ollama_bytes(text: str | None) -> int | None:
    """A size as Ollama's format.HumanBytes2 prints it ("11.9 GiB", "457.0 MiB", "512 B")."""
    m = _OLLAMA_SIZE.match(text) if text else None
    return _bytes(m.group(1), m.group(2)) if m else None


def _rate(s: str | None) -> float | None:
    v = _float(s, _MAX_RATE)
    return v if v is None or v >= 0 else None


# ----------------------------------------------------------------------------------------------
# Undoing transport damage
# ----------------------------------------------------------------------------------------------

# ANSI colour / cursor sequences (llama.cpp colours its log prefix when stderr is a tty).
_ANSI = re.compile(r"\x1b\[[0-9;?]{0,32}[ -/]{0,8}[@-~]")

# Transport prefixes: added by whatever carried the log, not by llama.cpp. They stack (docker
# compose around `docker --timestamps` around llama.cpp's own timestamp; Docker Model Runner's
# "2026-06-09 08:10:09.538 | [2026-04-26T00:20:42.763232000Z] "), so the one regex below is
# matched again and again at the start of the line (at most _MAX_PREFIXES times) and each match
# may end in a "|" or " - " separator. Every alternative is anchored and linear. Removed before a
# line is stored in ``errors`` too.
_TS_DATE = r"\d{4}[-/]\d{2}[-/]\d{2}"
_TS_TIME = r"\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?"
_TS_ZONE = r"(?:Z|[+-]\d{2}:?\d{2}|\s(?:UTC|GMT))?"
_PROC = r"[^\s:\[]{1,64}(?:\[\d{1,10}\])?:(?=\s|$)"   # "ollama[1234]:", "kernel:"
_PREFIX = re.compile(
    "(?:"
    # llama.cpp common log with timestamps: "%d.%02d.%03d.%03d " then "I "/"W "/"E "/"D "
    # (common/log.cpp, 2024+; --log-timestamps, llama-server's default since 2025)
    r"\d{1,10}\.\d{2}\.\d{3}\.\d{3}\s+(?:(?P<lvl>[IWEDT])\s)?"
    # ISO 8601 / RFC 3339 (or Go's 2006/01/02), bracketed or not, fraction to the nanosecond, zone;
    # then a CRI stream tag (kubectl logs, containerd) or "host proc[pid]:" (journalctl -o
    # short-iso, rsyslog's ISO format). docker --timestamps, LM Studio, GitHub Actions, Docker
    # Model Runner, Python logging ("2026-06-09 08:10:09,538").
    r"|\[?" + _TS_DATE + r"[T ]" + _TS_TIME + _TS_ZONE + r"\]?"
    r"(?:\s+(?:stdout|stderr)\s+[FP](?=\s|$))?(?:\s+\S{1,255}\s+[\w.@/-]{1,64}\[\d{1,10}\]:(?=\s|$))?"
    # BSD syslog / journalctl (short, short-precise): "<3>Jun 01 12:00:00[.123456] host proc[pid]:"
    r"|(?:<(?P<bsd_pri>\d{1,3})>)?[A-Z][a-z]{2}\s{1,2}\d{1,2}\s" + _TS_TIME + r"\s+\S{1,255}\s+" + _PROC +
    # RFC 5424 syslog: "<PRI>1 TIMESTAMP HOST APP PROCID MSGID [SD]|- "
    r"|<(?P<pri>\d{1,3})>\d{1,2}\s+\S{1,64}\s+\S{1,255}\s+\S{1,48}\s+\S{1,128}\s+\S{1,32}\s+(?:-|(?:\[[^\]]{0,1024}\]){1,8})(?=\s|$)"
    # a bare syslog priority, as programs write to stderr for journald (sd-daemon.h): "<3>"
    r"|<(?P<sd_pri>[0-7])>"
    # journalctl -o short-monotonic "[ 1234.567890] host proc[pid]:", -o short-unix
    # "1717243200.123456 host proc[pid]:"; epoch seconds or milliseconds alone
    r"|\[\s{0,12}\d{1,12}\.\d{1,9}\]\s+\S{1,255}\s+" + _PROC +
    r"|\[?\d{10}(?:\d{3})?(?:\.\d{1,9})?\]?(?:\s+\S{1,255}\s+[\w.@/-]{1,64}\[\d{1,10}\]:)?(?=\s)"
    # a time of day alone: "12:00:00.123 ", "[12:00:00]"
    r"|\[?" + _TS_TIME + r"\]?(?=\s)"
    # glog (Abseil / TensorFlow / many C++ services): "E0609 08:10:09.538123 12345 file.cc:123] "
    r"|(?P<glog>[IWEF])\d{4}\s" + _TS_TIME + r"\s+\d{1,10}\s+[\w./-]{1,128}:\d{1,7}\]"
    # Python logging: the default format "ERROR:llama_cpp:", and the cookbook's
    # "%(asctime)s - %(name)s - %(levelname)s - " after its timestamp (a carrier's logger)
    r"|(?P<pylvl>DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]{1,128}:"
    r"|[\w.-]{1,64}\s-\s(?P<pylvl2>DEBUG|INFO|WARNING|ERROR|CRITICAL)\s-(?=\s)"
    # docker compose: "ollama  | ", "ollama-1  | ", "service-1  | " (service name, padding, bar)
    r"|[A-Za-z0-9][\w.-]{0,127}\s+\|(?=\s|$)"
    r")(?:\s*\|(?=\s|$)|\s+-(?=\s))?\s*"
)
_MAX_PREFIXES = 8
# llama.cpp common log with --log-prefix but no timestamps: "I llama_context: ..." (only when a
# "func:" follows, so prose starting with "I " is left alone)
_BARE_LEVEL = re.compile(r"^([IWED])\s(?=[\w.]{1,128}:)")

# Decorations: level words and bracket tags some tools put before the message
# ("[DEBUG]" LM Studio headers, "[info] [WASI-NN] GGML backend: " WasmEdge,
#  "INFO [          print_timings] " 2024 llama-server text log format, whose messages end in
#  " | tid=\"...\" timestamp=... key=value": the fields llama.cpp logged with the message).
_DECOR = [
    re.compile(r"^(?:\[[^\]\n]{0,60}\]\s*)+"),
    re.compile(r"^(?:INFO|WARN(?:ING)?|ERROR|ERR|DEBUG|TRACE|FATAL|VERB)\b:?\s*(?=\[|$)"),
]
_DECOR_START = frozenset("[IWEDTVFef")
# A level word in front of the message ("ERROR: ...", "[ERROR] ...", "ERR [ load_model] ...",
# 2024 llama-server text log): the carrier marked the line as an error.
_ERROR_WORD_PREFIX = re.compile(r"^\[?(?:ERROR|ERR|FATAL|error|fatal)\b")

# Glued lines. Progress dots (llama_model_load's progress callback prints "." without a newline)
# directly followed by the next message: ".....llama_init_from_model: ..." (2026),
# "....srv    load_model: ..." (2026 server).
_GLUED_DOTS = re.compile(r"^(\.{3,})(?=[^.\s])")
# A message that ends without "\n" followed by the next one: "( 2056.30 /  1536.00)ggml_backend_..."
# (2024 Metal). Split before a known llama.cpp function prefix when the char before it cannot end
# an identifier, or (for long, unmistakable prefixes) when it is not part of a longer identifier.
# Names are bounded (no llama.cpp function name is 64 characters long) so a line of one long word
# costs linear time.
_W = r"\w{0,64}"
_KNOWN_FUNC = (r"(?:llama_" + _W + r"|llm_" + _W + r"|ggml_" + _W + r"|gguf_" + _W + r"|load_tensors|print_info|load|"
               r"alloc_tensor_range|sched_reserve|common_" + _W + r"|done_getting_tensors|main|system_info|"
               r"srv\s{1,16}\w{1,64}|slot\s{1,16}\w{1,64}|build)")
_LONG_FUNC = (r"(?:llm_load_tensors|load_tensors|llama_kv_cache" + _W + r"|llama_context|llama_new_context_with_model|"
              r"llama_perf_" + _W + r"|llama_print_timings|ggml_backend_" + _W + r"|ggml_metal_" + _W + r"|llama_model_load" + _W + r"|"
              r"alloc_tensor_range|print_info|llama_init_from_model)")
_GLUE_SPLIT = re.compile(r"(?<=[)\]}>'\"])(?=" + _KNOWN_FUNC + r":\s)"
                         r"|(?<=[^\s_/\\.\w])(?=" + _LONG_FUNC + r":\s)"
                         r"|(?<=[A-Za-z0-9])(?=(?:llm_load_tensors|llama_kv_cache" + _W + r"|llama_new_context_with_model"
                         r"|llama_perf_context_print|llama_print_timings|ggml_backend_" + _W + r"):\s)")
# (what the split looks for, as plain strings: _may_be_glued)
_SRV_SLOT_AT = re.compile(r"(?:srv|slot)\s{1,16}\w{1,64}:\s")

# JSON log lines: llama-server 2024 ({"function":..,"level":"INFO","msg":"..."}) and
# --log-jsonl 2026 ({"type":"log","level":"INFO","msg":"..."}); Ollama slog text lines
# (time=.. level=ERROR source=.. msg="..." or msg=word). The key is found with str.find and the
# value matched where it starts, so an unclosed string costs linear time.
_JSON_STRING_AT = re.compile(r"\s*:\s*\"((?:[^\"\\]|\\.)*)\"")
_JSON_LEVEL = re.compile(r"\"level\"\s*:\s*\"(\w{1,16})\"")
_SLOG_LEVEL = re.compile(r"time=\S{1,64}\s+level=(\w{1,16})\b")
_SLOG_VALUE_AT = re.compile(r"\"((?:[^\"\\]|\\.)*)\"|(\S+)")
_JSON_ESC = re.compile(r"\\(u[0-9a-fA-F]{4}|.)")
_ESC_MAP = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "/": "/", "\\": "\\", '"': '"'}
_ERROR_LEVELS = ("ERROR", "ERR", "FATAL")


def _json_unescape(s: str) -> str:
    if "\\" not in s:
        return s

    def rep(m: re.Match[str]) -> str:
        g = m.group(1)
        if g.startswith("u") and len(g) == 5:
            try:
                return chr(int(g[1:], 16))
            except ValueError:
                return g
        return _ESC_MAP.get(g, g)
    return _JSON_ESC.sub(rep, s)


def _json_msg(line: str) -> tuple[str, bool] | None:
    """``("message", is_error)`` of a JSON log line, or None."""
    at = line.find('"msg"')
    if at < 0:
        return None
    m = _JSON_STRING_AT.match(line, at + 5)
    if not m:
        return None
    lv = _JSON_LEVEL.search(line)
    return _json_unescape(m.group(1)), bool(lv and lv.group(1).upper() in _ERROR_LEVELS)


def _slog_msg(line: str) -> tuple[str, bool] | None:
    """``("message", is_error)`` of an Ollama (Go slog) text line, or None."""
    lv = _SLOG_LEVEL.match(line)
    if not lv:
        return None
    at = line.find(" msg=", lv.end() - 1)
    if at < 0:
        return None
    m = _SLOG_VALUE_AT.match(line, at + 5)
    if not m:
        return None
    text = _json_unescape(m.group(1)) if m.group(1) is not None else m.group(2)
    return text, lv.group(1).upper() in _ERROR_LEVELS


def _strip_transport(line: str) -> tuple[str, bool]:
    """The line without the prefixes its carriers added, and whether one of them said "error"."""
    line = line.lstrip()
    bar = "|" in line
    err = False
    pos = 0
    for _ in range(_MAX_PREFIXES):
        # The common case, a bare llama.cpp line ("load_tensors: ...", "slot update_slots: id  0 |
        # ..."): of the prefixes, only docker compose's ("ollama  | ") starts with a lower-case
        # letter, and it is one word before the bar.
        if (line[pos:pos + 1].islower() and (not bar or len(line[pos:line.find("|", pos)].split()) != 1)
                and " - " not in line):  # (Python logging's "name - LEVEL - ")
            break
        m = _PREFIX.match(line, pos)
        if m is None or m.end() == pos:
            break
        pos = m.end()
        group = m.lastgroup  # each alternative has at most one named group
        if group is not None:
            value = m.group(group)
            if group in ("bsd_pri", "pri", "sd_pri"):
                err = err or int(value) % 8 <= 3  # emerg, alert, crit, err
            else:
                err = err or value in ("E", "F", "ERROR", "CRITICAL")
    return line[pos:], err


def _strip_decor(line: str) -> tuple[str, bool]:
    if not line or line[0] not in _DECOR_START:
        return line, False
    err = bool(_ERROR_WORD_PREFIX.match(line))
    for _ in range(4):
        before = line
        m = _BARE_LEVEL.match(line)
        if m:
            err = err or m.group(1) == "E"
            line = line[2:]
        for rx in _DECOR:
            line = rx.sub("", line, count=1).lstrip()
        if line == before:
            break
        # a tag can sit in front of a timestamp: "[pod/llama-0/server] 2024-06-01T12:00:00Z stdout F"
        line, err_t = _strip_transport(line)
        err = err or err_t
    return line, err


def _may_be_glued(line: str) -> bool:
    """Whether ``_GLUE_SPLIT`` could split this line (it is slow; most lines cannot be split).

    A split point is a known function name (with its colon) or prefix that starts after the
    line's first character; ``str.find`` looks for each far faster than a regex could. (The
    split itself also needs the right character before it: this only rules lines out.)
    """
    rest = line[1:]
    if ("llama_" in rest or "llm_" in rest or "ggml_" in rest or "gguf_" in rest or "common_" in rest
            or "load_tensors:" in rest or "print_info:" in rest or "load:" in rest or "alloc_tensor_range:" in rest
            or "sched_reserve:" in rest or "done_getting_tensors:" in rest or "main:" in rest
            or "system_info:" in rest or "build:" in rest):
        return True
    if "srv" not in rest and "slot" not in rest:
        return False
    for word in ("srv", "slot"):  # "srv    load_model: "
        at = line.find(word, 1)
        while at >= 0:
            if _SRV_SLOT_AT.match(line, at):
                return True
            at = line.find(word, at + 1)
    return False


def _unglue(line: str) -> list[str]:
    if line[:1] == ".":
        m = _GLUED_DOTS.match(line)
        if m:
            line = line[m.end():]
    if not line:
        return []
    if not _may_be_glued(line):
        return [line]
    return [p for p in _GLUE_SPLIT.split(line) if p.strip()]


# llama.cpp's own lines are short; anything longer is a metadata array, a chat template or a JSON
# response body. Such a line is read whole for JSON fields only, and cut for everything else, so a
# pathological paste cannot make the regexes slow.
_MAX_LINE = 8192


def _lines(text: str) -> list[str]:
    """Physical lines, any line ending, with the bytes no log line means removed."""
    if "\x00" in text:
        text = text.replace("\x00", "")
    text = text.replace("\ufeff", "").replace("\u00a0", " ")
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.split("\n")


# ----------------------------------------------------------------------------------------------
# Format-string regexes. Each comment: the llama.cpp format string, and the era that printed it.
# Regexes see a message with prefixes removed; whitespace may have been collapsed by a paste, so
# padding is always \s* / \s+.
# ----------------------------------------------------------------------------------------------

# "%s: loaded meta data with %d key-value pairs and %d tensors from %s (version %s)"
#   llama_model_loader, every GGUF era (Aug 2023 -> 2026): first line of a model load pass.
_RX_LOAD_START = re.compile(r"^llama_model_loader:\s*loaded meta data with\b")

# "%s: offloaded %d/%d layers to GPU"
#   llama_model_load_internal (2023 GGML), llm_load_tensors (2023-2024), load_tensors (2025-2026)
_RX_OFFLOADED = re.compile(r"\boffloaded\s+(\d+)\s*/\s*(\d+)\s+layers\s+to\s+GPU")

# "load_tensors: layer %3d assigned to device %s, is_swa = %d"  (LLAMA_LOG_DEBUG, 2025-2026)
# "llm_load_tensors: layer %3d assigned to device %s"            (LLAMA_LOG_DEBUG, late 2024)
_RX_LAYER_ASSIGN = re.compile(r"^(?:llm_)?load_tensors:\s*layer\s+(\d+)\s+assigned\s+to\s+device\s+([^\s,]+)")

# any line of the tensor loading step: "load_tensors: ..." (2025-2026), "llm_load_tensors: ..." (2023-2024)
_RX_LOAD_TENSORS_ANY = re.compile(r"^(?:llm_)?load_tensors:")

# "%s: n_layer = %u"  print_info (2025-2026), llm_load_print_meta (2023-2024)
_RX_N_LAYER = re.compile(r"^(?:print_info|llm_load_print_meta):\s*n_layer\s*=\s*(\d+)\s*$")

# "%s: %12s model buffer size = %8.2f MiB"  llm_load_tensors (late 2024), load_tensors (2025-2026)
# "%s: %10s buffer size = %8.2f MiB"        llm_load_tensors (early-mid 2024, ik_llama.cpp)
_RX_MODEL_BUF = re.compile(r"^(?:llm_)?load_tensors:\s*(\S+)\s+(?:model\s+)?buffer\s+size\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: VRAM used: %.2f MB"           llm_load_tensors / llama_model_load_internal (Jul-Nov 2023, CUDA/CLBlast)
# "%s: VRAM used           = %7.2f MiB"  llm_load_tensors (Dec 2023)
# (the "total VRAM used: ..." summary line is model + context and is deliberately not matched)
_RX_VRAM_USED = re.compile(r"^\w+:\s*VRAM used\s*[:=]\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: mem required  = %7.2f MB (+ %7.2f MB per state)"  llama_model_load_internal (mid 2023 GGML)
# "%s: mem required  = %7.2f MB"                         llm_load_tensors (Aug-Nov 2023 GGUF)
_RX_MEM_REQUIRED = re.compile(r"^\w+:\s*mem required\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: system memory used  = %7.2f MiB"  llm_load_tensors (Dec 2023)
_RX_SYS_MEM = re.compile(r"^\w+:\s*system memory used\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: allocated '%-16s' buffer, size = %8.2f MB"  ggml_metal_add_buffer (2023 Metal; the model
#   weights are the 'data' buffers, 'kv' the KV cache, 'eval'/'alloc'/'scr0'/'scr1' compute)
_RX_METAL_ADD = re.compile(r"^ggml_metal_add_buffer:\s*allocated\s+'\s*(\w+)\s*'\s+buffer,\s*size\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: %10s KV buffer size = %8.2f MiB"  llama_kv_cache_init (2024), llama_kv_cache_unified
#   (2025), llama_kv_cache (2026)
_RX_KV_BUF = re.compile(r"^[\w.]+:\s*(\S+)\s+KV\s+buffer\s+size\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: %10s RS buffer size = %8.2f MiB"  llama_memory_recurrent (2025-2026): the recurrent state of
#   Mamba-style layers; it is context memory on that device, so it is counted with the KV buffers
_RX_RS_BUF = re.compile(r"^[\w.]+:\s*(\S+)\s+RS\s+buffer\s+size\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: VRAM kv self = %.2f MB"  llama_kv_cache_init (2023 CUDA, KV offloaded)
_RX_VRAM_KV = re.compile(r"^\w+:\s*VRAM kv self\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: kv self size  = %7.2f MB"                                       (2023)
# "%s: KV self size  = %7.2f MiB, K (%s): %7.2f MiB, V (%s): %7.2f MiB"  llama_new_context_with_model
#   (Dec 2023-2024), llama_kv_cache_unified (early-mid 2025)
_RX_KV_SELF = re.compile(r"^\w+:\s*KV self size\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")"
                         r"(?:\s*,\s*K\s*\((\w+)\)\s*:\s*" + _NUM + r"\s*" + _UNIT + r"\s*,\s*V\s*\((\w+)\))?",
                         re.IGNORECASE)

# "%s: size = %7.2f MiB (%6u cells, %3d layers, %2u/%u seqs), K (%s): %7.2f MiB, V (%s): %7.2f MiB"
#   llama_kv_cache_unified (mid 2025, "%2u seqs"), llama_kv_cache (late 2025-2026, "%2u/%u seqs").
#   A SWA model prints it twice (non-SWA and SWA cache): the sizes add up. The cells are per
#   stream; "n_seq_max/n_stream seqs" (2026) says how many streams (non-unified KV: one per sequence).
_RX_KV_SIZE = re.compile(r"^llama_kv_cache\w*:\s*size\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")"
                         r"(?:\s*\(\s*(\d+)\s*cells\b(?:\s*,\s*\d+\s*layers)?"
                         r"(?:\s*,\s*\d+\s*(?:/\s*(\d+)\s*)?seqs)?[^)]*\))?"
                         r"(?:\s*,\s*K\s*\((\w+)\)\s*:\s*" + _NUM + r"\s*" + _UNIT + r"\s*,\s*V\s*\((\w+)\))?")

# "%s: kv_size = %u, type_k = '%s', type_v = '%s', n_layer = %d, ..."  llama_kv_cache_init (2024),
#   llama_kv_cache_unified (early-mid 2025)
# "%s: kv_size = %u, offload = %d, type_k = '%s', type_v = '%s', n_layer = %d, can_shift = %d"
#   llama_kv_cache_unified::init (early 2025: __func__ is a bare "init")
_RX_KV_INIT = re.compile(r"^\w+:\s*kv_size\s*=\s*(\d+)\s*,(?:\s*offload\s*=\s*\d+\s*,)?"
                         r"\s*type_k\s*=\s*'(\w+)'\s*,\s*type_v\s*=\s*'(\w+)'")

# "%s: %10s compute buffer size = %8.2f MiB"  llama_new_context_with_model (2024), llama_context /
#   sched_reserve (2025-2026)
_RX_COMPUTE = re.compile(r"^[\w.]+:\s*(\S+)\s+compute\s+buffer\s+size\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: %10s input buffer size   = %8.2f MiB"  llama_new_context_with_model (early 2024)
_RX_INPUT = re.compile(r"^[\w.]+:\s*(\S+)\s+input\s+buffer\s+size\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: compute buffer total size = %7.2f MB"  llama_new_context_with_model (2023, no device named)
_RX_COMPUTE_TOTAL = re.compile(r"^\w+:\s*compute buffer total size\s*=\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: VRAM scratch buffer: %.2f MB"  llama_new_context_with_model (2023 CUDA)
_RX_VRAM_SCRATCH = re.compile(r"^\w+:\s*VRAM scratch buffer\s*[:=]\s*(" + _NUM + r")\s*(" + _UNIT + r")")

# "%s: constructing llama_context"  llama_context (2025-2026): first line of a context
_RX_CTX_START = re.compile(r"^llama_context:\s*constructing llama_context\b")

# "%s: n_ctx      = %u"  llama_new_context_with_model (2023-2024), llama_context (2025-2026),
#   llama_model_load_internal (2023 GGML)
_RX_N_CTX = re.compile(r"^(llama_new_context_with_model|llama_context|llama_init_from_model|"
                       r"llama_model_load_internal):\s*n_ctx\s*=\s*(\d+)")
# "generate: n_ctx = %d, n_batch = %d, ..." (llama-cli) and any other "func: n_ctx = N": fallback only
_RX_N_CTX_ANY = re.compile(r"^[\w.]+:\s*n_ctx\s*=\s*(\d+)")
# "%s: n_ctx_per_seq = %u" (late 2024-2025), "%s: n_ctx_seq = %u" (2026), and the warning
# "%s: n_ctx_per_seq (%u) < n_ctx_train (%u) -- ..." / "n_ctx_seq (%u) < ..."
_RX_N_CTX_SEQ = re.compile(r"\bn_ctx_(?:per_)?seq\s*(?:=\s*(\d+)|\(\s*(\d+)\s*\))")
# "%s: n_seq_max     = %u"  (late 2024-2026)
_RX_N_SEQ_MAX = re.compile(r"^\w+:\s*n_seq_max\s*=\s*(\d+)")
# "%s: setting dry_penalty_last_n to ctx_size = %d"  common_init_from_params (2024-2025)
_RX_CTX_SIZE = re.compile(r"\bctx_size\s*=\s*(\d+)")
# "new slot n_ctx_slot = %d" (llama-server 2024-2025)
_RX_N_CTX_SLOT = re.compile(r"\bn_ctx_slot\s*=\s*(\d+)")

# "%s: using device %s (%s) - %zu MiB free"       llama_load_model_from_file (late 2024),
#   llama_model_load_from_file_impl (2025)
# "%s: using device %s (%s) (%s) - %zu MiB free"  llama_model_load_from_file_impl (2026, + device id)
_RX_USING_DEVICE = re.compile(r"\busing device\s+(\S+)\s+\([^\n]{0,256}\)\s*-\s*(\d+)\s*MiB free")

# "%s: | %s | %s = %s + (%s = %s + %s + %s) + %s |"  llama_memory_breakdown_print (late 2025) /
#   common_memory_breakdown_print (2026): "|   - CUDA0 (RTX 4090)   | total = free + (self = ...)"
_RX_BREAKDOWN = re.compile(r"memory_breakdown_print:\s*\|\s*-\s*(\S+)\s+\([^\n]{0,256}?\)\s*\|\s*(\d+)\s*=\s*(\d+)\s*\+\s*\(")

# "%s: prompt eval time = %10.2f ms / %5d tokens (%8.2f ms per token, %8.2f tokens per second)"
# "%s:        eval time = %10.2f ms / %5d runs   (%8.2f ms per token, %8.2f tokens per second)"
#   llama_print_timings (2023-2024), llama_perf_context_print (2024-2026), llama-server
#   print_timings (2024 text log "prompt eval time     =" / "generation eval time ="), llama-server
#   "slot print_timing: id %2d | task %d | prompt eval time = ..." (2025-2026, same line or next).
#   "sample time" / "sampling time" (llama_perf_sampler_print) is sampling speed, never eval speed,
#   and the progress lines "n_decoded = %d, tg = %.2f t/s" are not final figures: neither matches.
_RX_TIMING = re.compile(r"(?:^|[:|\]]\s*)(prompt eval|generation eval|eval)\s+time\s*=\s*(" + _NUM + r")\s*ms\s*/\s*(\d+)\s*"
                        r"(?:tokens|runs)\s*\(\s*(?:" + _NUM + r"|[-+]?(?:inf|nan))\s*ms per token\s*,\s*"
                        r"(" + _NUM + r"|[-+]?(?:inf|nan))\s*tokens per second", re.IGNORECASE)
# llama-server response JSON: "timings": {..., "prompt_per_second": %f, ..., "predicted_per_second": %f}
_JSON_NUM = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_RX_JSON_PP = re.compile(r"\"prompt_per_second\"\s*:\s*(" + _JSON_NUM + r")")
_RX_JSON_TG = re.compile(r"\"predicted_per_second\"\s*:\s*(" + _JSON_NUM + r")")

# "build: %d (%s) with %s for %s"      common (2024-2025), and llama-cli/server first lines
# "%s: build = %d (%s)"                main / server (2023-early 2024)
# "%s: build %d (%s) with %s for %s%s" common_params_print_info (2026)
# "llama.cpp build %d" (tools quoting the build number)
_RX_BUILD = re.compile(r"(?<![\w.])build\s*(?:[:=]\s*)?(\d+)\s*\(\s*([0-9a-fA-F]{4,40})\s*\)")
# "\nbuild: %s (%d)\n"  llama-bench footer (commit first, then number)
_RX_BUILD_BENCH = re.compile(r"^build:\s*([0-9a-f]{6,40})\s*\(\s*(\d+)\s*\)\s*$")
# "version: %d (%s)" (--version, 2024-2025); "version: %s (build %d, commit %s)" (2026)
_RX_VERSION = re.compile(r"^version:\s*(\d+)\s*\(\s*([0-9a-f]{4,40})\s*\)")
_RX_VERSION_2026 = re.compile(r"\(build\s+(\d+),\s*commit\s+([0-9a-f]{4,40})\)")
_RX_BUILD_LOOSE = re.compile(r"\bllama\.cpp\s+build\s*(?:[:#=]\s*)?(\d+)\b", re.IGNORECASE)
# llama-server 2024 JSON "build info" line: {"build":2750,"commit":"abc1234",...}
_RX_JSON_BUILD = re.compile(r"\"build\"\s*:\s*(\d+)")
_RX_JSON_COMMIT = re.compile(r"\"commit\"\s*:\s*\"([0-9a-fA-F]{4,40})\"")
# 2024 llama-server text log: "INFO [  main] build info | tid=\"1\" timestamp=1717243200 build=3046 commit=\"5921b8f0\""
_RX_KV_BUILD = re.compile(r"\bbuild=(\d+)\s+commit=\"?([0-9a-fA-F]{4,40})\b")

# ---- Ollama's own engine (Go, 2025-2026): slog key=value lines, sizes from format.HumanBytes2 ----
# HumanBytes2 (format/bytes.go) prints "%.1f GiB" / "%.1f MiB" / "%.1f KiB" (binary units, one
# decimal) or "%d B": a figure is Ollama's rounding, up to 0.05 GiB off. The lines, as slog's text
# handler writes them (a value with a space is quoted), after "time=... level=INFO source=...":
#   ml/backend/ggml/ggml.go (May-Oct 2025; a Trace line since):
#     slog.Info("model weights", "buffer", ggml_backend_buffer_name(bs), "size", HumanBytes2(...))
#       -> msg="model weights" buffer=CUDA1 size="11.9 GiB"
#     slog.Info("compute graph", "backend", ggml_backend_name(..), "buffer_type", ggml_backend_buft_name(..), "size", ...)
#       -> msg="compute graph" backend=CPU buffer_type=CPU size="2.2 MiB"
#   ml/device.go BackendMemory.Log (Aug 2025-2026): one line per device and kind, then the total:
#     slog.Log(ctx, level, "model weights" | "kv cache" | "compute graph", "device", gpu.Name, "size", ...)
#       -> msg="kv cache" device=CUDA0 size="1.1 GiB";   msg="total memory" size="4.7 GiB"
#   llm/server.go (Aug-Sep 2025) / server/sched.go (Oct 2025-2026): the scheduler, before a load:
#     slog.Info("gpu memory", "id", gpu.ID, ["library", gpu.Library,] "available", .., "free", HumanBytes2(gpu.FreeMemory), ..)
#       -> msg="gpu memory" id=GPU-5c0d... library=CUDA available="3.3 GiB" free="4.3 GiB" minimum="457.0 MiB"
# ("offloaded %d/%d layers to GPU" is llama.cpp's text, printed by ggml.go as a msg: read as a message.)
_OLLAMA_MSG = re.compile(r'\smsg="(model weights|kv cache|compute graph|gpu memory)"')
_SLOG_ATTR = re.compile(r'(?<!\S)(\w{1,32})=(?:"((?:[^"\\]|\\.){0,256})"|([^\s"]{1,256}))')
_OLLAMA_SIZE = re.compile(r"^(\d{1,15}(?:\.\d{1,6})?)\s?([KMG]iB|B)$")
_OLLAMA_NOTE = ("sizes from Ollama's own engine are its rounded figures (one decimal of GiB or MiB, "
                "format.HumanBytes2): up to 0.05 GiB off each")
# Ollama's GPU libraries (gpu.Library) -> the prefix of llama.cpp's device names
_OLLAMA_LIBRARY = {"cuda": "CUDA", "rocm": "ROCm", "vulkan": "Vulkan", "metal": "Metal", "oneapi": "SYCL", "sycl": "SYCL"}

# `ollama ps` (cmd/cmd.go ListRunningHandler): the PROCESSOR column, "%d%%/%d%% CPU/GPU" for a model
# split between them, "100%% GPU" / "100%% CPU" otherwise (2024-2026)
_RX_OLLAMA_PS_SPLIT = re.compile(r"(?<![\d.])(\d{1,3})%/(\d{1,3})%\s+CPU/GPU\b")
_RX_OLLAMA_PS_ONE = re.compile(r"(?<![\d.])100%\s+(CPU|GPU)\b")

# ---- allocation failures (oom) -----------------------------------------------------------------
_OOM = re.compile("|".join([
    # "%s: allocating %.2f MiB on device %d: cudaMalloc failed: %s"  ggml-cuda (2024-2026; the ROCm
    #   and MUSA builds print the same text through the cuda* aliases)
    r"(?:cuda|hip|musa)Malloc failed:\s*out of memory",
    r"hipMalloc failed",
    # GGML_CUDA_NAME " error: %s" (2024-2026: "CUDA error: out of memory", "ROCm error: ...");
    # "CUDA error %d at %s:%d: %s" (2023)
    r"\b(?:CUDA|ROCm|HIP|MUSA|SYCL|CANN)\s+error(?:\s+\d+)?(?:\s+at\s+\S+)?\s*:\s*out of memory",
    # Vulkan: vk::Device::allocateMemory: ErrorOutOfDeviceMemory (2024-2026) / host / pool
    r"ErrorOutOf(?:Device|Host|Pool)Memory",
    # "ggml_vulkan: Device memory allocation of size %zu failed." (2024-2026)
    r"Device memory allocation of size \d+ failed",
    # Metal: "error: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"
    r"Insufficient Memory",
    r"kIOGPUCommandBufferCallbackErrorOutOfMemory",
    # "%s: failed to allocate %s buffer of size %zu"  alloc_tensor_range / ggml_gallocr_reserve_n
    #   (2024-2026, also "RPC0[host:port]" buffers); "%s: error: failed to allocate buffer, size =
    #   %8.2f MiB" (Metal 2024-2026); "failed to allocate '%-16s' buffer" (Metal 2023);
    #   "failed to allocate compute buffers" / "failed to allocate buffer for kv cache" (llama)
    r"failed to allocate\b.{0,160}?\bbuffers?\b",
    # "%s: failed to allocate Metal buffer of %zu bytes (out of memory)" (2026)
    r"failed to allocate Metal buffer",
    # "unable to allocate %s buffer" (llama-model.cpp, error loading model, 2024-2026),
    # "unable to allocate backend buffer"
    r"unable to allocate\b",
    # "%s: can't allocate %zu Bytes of memory on device" (SYCL)
    r"can't allocate \d+ Bytes of memory",
    # "%s: failed to allocate %6.2f MB" (ggml.c aligned malloc), "failed to allocate memory"
    r"failed to allocate\s+(?:" + _NUM + r"\s*(?:[KMG]i?B|bytes)|memory)",
    # host RAM: C++ allocation failure, mmap failure (ENOMEM)
    r"std::bad_alloc",
    r"\bmmap failed\b",
    r"Cannot allocate memory",
    # "ggml_new_object: not enough space in the context's memory pool" (2023)
    r"not enough space in the context's memory pool",
    # OpenCL (2023 CLBlast, 2025 Adreno backend)
    r"CL_MEM_OBJECT_ALLOCATION_FAILURE|CL_OUT_OF_(?:HOST_MEMORY|RESOURCES)",
]), re.IGNORECASE)
# "out of memory" alone: only on a log-shaped line ("func: ..." or "... error ..."), so model
# output that happens to say it is not an OOM.
_OOM_GENERIC = re.compile(r"\bout of memory\b", re.IGNORECASE)
_LOGLIKE = re.compile(r"^[\w.:/\[\]-]+:\s|\berror\b", re.IGNORECASE)
# Allocation failures llama.cpp recovers from by design. Not OOM, not errors:
# "%s: failed to allocate %.2f MiB of pinned memory: %s" (ggml-cuda, falls back to pageable memory),
# "WARNING: failed to allocate %.2f MB of pinned memory" (SYCL/Vulkan), "%s: failed to allocate
# %zu bytes for reorder temp buffer, skipping reorder" (SYCL), "%s: failed to allocate host buffer
# for async uploads for device %s" (llama-model-loader 2025+, loads synchronously instead),
# "warning: failed to mlock %zu-byte buffer ...: Cannot allocate memory" (llama-mmap).
_NON_FATAL = re.compile(r"pinned memory|falling back|skipping|async uploads|\bwarning\b", re.IGNORECASE)

# ---- failure lines (errors) --------------------------------------------------------------------
_ERROR_LINE = re.compile("|".join([
    # "%s:%d: GGML_ASSERT(%s) failed" / GGML_ABORT / ggml_abort (ggml.c, 2024-2026)
    r"GGML_ASSERT\b", r"GGML_ABORT\b", r"\bggml_abort\b",
    # (and "func: ... error ..." / "func: ... failed ...": _FUNC_THEN / _FAILURE_WORD below)
    # bare "error: ..." lines (Metal "error: Caused GPU Timeout Error ...", common "error: ...")
    r"^(?:error|fatal error|FATAL)\b",
    # "ERR [ load_model] unable to load model | ..." (2024 server text log, ik_llama.cpp)
    r"^ERR\b",
    # process death as printed by the C++ runtime, glibc, the shell, Go (Ollama)
    r"^terminate called\b", r"^\s*what\(\):", r"^panic:", r"^Segmentation fault\b", r"^Aborted\b",
    r"^(?:free|malloc|realloc|munmap_chunk|double free|corrupted)\b.*\(\)", r"^Illegal instruction\b",
    r"^Bus error\b", r"^Floating point exception\b",
    # "CUDA error: %s" / "ROCm error" / "Vulkan error" (device errors other than OOM)
    r"\b(?:CUDA|ROCm|HIP|MUSA|SYCL|Vulkan|Metal)\s+error\b",
]))
# "func: ... error ..." / "func: ... failed ..." (LLAMA_LOG_ERROR messages: "error loading model: %s",
# "failed to load model", "failed to initialize the context: %s", ...): a "func: " prefix, then one of
# the words anywhere after it. Two regexes, so a long line is scanned once, not once per colon.
_FUNC_THEN = re.compile(r"[\w.\[\]<>~:/ -]{1,80}?:\s")
_FAILURE_WORD = re.compile(r"\b(?:error|failed|failure|fatal)\b", re.IGNORECASE)
# Metadata dumps can contain any word (token texts, chat templates): never failure lines.
_METADATA = re.compile(r"^(?:print_info|llm_load_print_meta|llama_model_loader:\s*-\s*(?:kv|type)\b|"
                       r"load:\s|llm_load_vocab|init_tokenizer)")
_METADATA_PREFIXES = ("print_info", "llm_load_print_meta", "llama_model_loader:", "load:", "llm_load_vocab", "init_tokenizer")


# ----------------------------------------------------------------------------------------------
# The parser
# ----------------------------------------------------------------------------------------------

class _Ctx:
    """Context-scoped state of one context creation."""

    def __init__(self) -> None:
        self.constructing = False   # "constructing llama_context" was printed
        self.kv_buffers: dict[str, int] = {}
        self.compute_buffers: dict[str, int] = {}
        self.kv_sizes: list[int] = []
        self.type_k: str | None = None
        self.type_v: str | None = None
        self.n_ctx: int | None = None
        self.cells: int | None = None
        self.n_ctx_seq: int | None = None
        self.n_seq_max: int | None = None
        self.ctx_size: int | None = None
        self.n_ctx_any: int | None = None
        self.n_ctx_slot: int | None = None

    def has_data(self) -> bool:
        return bool(self.kv_buffers or self.compute_buffers or self.kv_sizes)

    def reached(self) -> bool:
        """The load got as far as creating a context (whatever that context then did)."""
        return self.constructing or self.has_data() or self.n_ctx_best() is not None

    def n_ctx_best(self) -> int | None:
        # the context line itself, else what the KV cache was sized to, else per-seq size (one
        # sequence unless the log said otherwise), else the ctx_size common printed
        if self.n_ctx is not None:
            return self.n_ctx
        if self.cells is not None:
            return self.cells
        if self.n_ctx_seq is not None:
            return self.n_ctx_seq * (self.n_seq_max or 1)
        for v in (self.ctx_size, self.n_ctx_any, self.n_ctx_slot):
            if v is not None:
                return v
        return None


class _Pass:
    """Model-scoped state of one load pass, and the last context created on it."""

    def __init__(self) -> None:
        self.started = False         # the loader's first line was printed
        self.layers_offloaded: int | None = None
        self.layers_total: int | None = None
        self.model_buffers: dict[str, int] = {}
        self.assignments: dict[int, str] = {}
        self.assign_closed = False   # a load line followed the assignment block (it is complete)
        self.n_layer: int | None = None
        self.ctx = _Ctx()

    def has_data(self) -> bool:
        return bool(self.model_buffers or self.layers_offloaded is not None or self.assignments)

    def is_load(self) -> bool:
        return self.started or self.has_data() or self.ctx.reached()

    def layers(self) -> tuple[int | None, int | None]:
        offloaded, total = self.layers_offloaded, self.layers_total
        if offloaded is None and self.assignments:
            # every "layer N assigned to device X" line of the pass (0..n_layer, the last one being
            # the output layer) -> count; only when the block is complete, else a cut log would
            # undercount
            idx = sorted(self.assignments)
            # (an MTP/nextn model lists more than n_layer + 1; fewer means the listing was cut)
            complete = (idx == list(range(len(idx)))
                        and (self.assign_closed or (self.n_layer is not None and len(idx) == self.n_layer + 1))
                        and (self.n_layer is None or len(idx) >= self.n_layer + 1))
            if complete:
                total = len(idx)
                offloaded = sum(1 for d in self.assignments.values() if not d.upper().startswith("CPU"))
        return offloaded, total

    def to_load(self) -> "ModelLoad":
        c = self.ctx
        offloaded, total = self.layers()
        kv_size = sum(c.kv_sizes) if c.kv_sizes else (sum(c.kv_buffers.values()) if c.kv_buffers else None)
        return ModelLoad(
            layers_offloaded=offloaded,
            layers_total=total,
            model_buffers=dict(self.model_buffers),
            kv_buffers=dict(c.kv_buffers),
            compute_buffers=dict(c.compute_buffers),
            kv_size=kv_size,
            type_k=c.type_k,
            type_v=c.type_v,
            n_ctx=c.n_ctx_best(),
        )


# A runaway log can repeat failures without end: keep the first and the last ones (the cause and
# the way the process died), up to this many lines in all.
_MAX_ERRORS = 200
# ... and a runaway log of model loads (a server reloading on every request) keeps its first and last.
_MAX_LOADS = 1000


def _add(d: dict[str, int], key: str, value: int | None) -> None:
    if value is not None:
        d[key] = d.get(key, 0) + value
        if d[key] > _MAX_BYTES:  # a thousand absurd lines do not add up to an absurd figure either
            del d[key]


def _maybe_oom(low: str) -> bool:
    """Whether _OOM / _OOM_GENERIC could match: each of their patterns holds one of these words
    (an "allocating ..." line is not worth the costly search)."""
    return ("fail" in low or "out of memory" in low or "erroroutof" in low or "insufficient memory" in low
            or "unable to allocate" in low or "can't allocate" in low or "bad_alloc" in low
            or "cannot allocate memory" in low or "not enough space" in low or "cl_out_of" in low)


_ERROR_LINE_STARTS = ("err", "fatal", "terminate called", "panic:", "segmentation fault", "aborted", "illegal instruction",
                      "bus error", "floating point exception")


def _maybe_error_line(t: str, low: str) -> bool:
    """Whether _ERROR_LINE could match (each of its patterns holds one of these)."""
    return ("ggml_a" in low or "error" in t or "()" in t or low.lstrip().startswith(_ERROR_LINE_STARTS))


def _maybe_failure(low: str) -> bool:
    """Whether a (lower-cased) message could be an out-of-memory or failure line: every pattern in
    _OOM, _OOM_GENERIC, _ERROR_LINE and _FAILURE_WORD contains one of these words. A cheap test
    (``in`` is far faster than a regex search) that keeps the regexes off most lines."""
    return ("err" in low or "fail" in low or "fatal" in low or "abort" in low or "assert" in low or "alloc" in low
            or "out of memory" in low or "insufficient memory" in low or "memory pool" in low or "terminate" in low
            or "what()" in low or "panic" in low or "segmentation" in low or "illegal" in low or "floating point" in low
            or "()" in low or "corrupt" in low or "cl_out" in low)


class _LineReader:
    """Physical lines in, messages out: carrier prefixes stripped, JSON and slog lines opened, glued
    lines split. Subclasses take each message in ``feed`` and each structured line in ``_structured``."""

    def feed_text(self, text: str) -> None:
        for raw in _lines(text):
            if not raw or raw.isspace():
                continue
            try:
                self.feed_line(raw)
            except Exception:  # noqa: BLE001 - one odd line must not cost the rest of the log
                continue

    def feed_line(self, raw: str) -> None:
        truncated = len(raw) > _MAX_LINE
        if truncated:
            self._structured(raw)
            raw = raw[:_MAX_LINE]
        if raw[:1].islower() and "|" not in raw and " - " not in raw:
            line, err_t = raw, False  # a bare llama.cpp line: _strip_transport's first test, inlined
        else:
            line, err_t = _strip_transport(raw)
        c0 = line[:1]
        found = None
        if c0 == "{" and '"msg"' in line:
            found = _json_msg(line)
        elif c0 == "t" and line.startswith("time="):
            found = _slog_msg(line)
        if found is not None:
            # the JSON line itself is still read (for "timings" / "build" fields)
            if not truncated:
                self._structured(line)
            text, err_j = found
            for piece in text.split("\n"):
                piece, err_p = _strip_transport(piece)
                self._pieces(piece, err_j or err_p, truncated)
        elif c0 != "." and not _may_be_glued(line):
            # one message, nothing to split: the common case, kept free of calls (this loop is
            # most of the time spent on a long log)
            shown = line.rstrip()
            if c0 in _DECOR_START:
                msg, err_d = _strip_decor(shown)
                msg = msg.strip()
            else:
                msg, err_d = shown, False
            if msg:
                self.feed(msg, shown, err_t or err_d, truncated)
        else:
            self._pieces(line, err_t, truncated)

    def _pieces(self, line: str, err: bool, truncated: bool) -> None:
        if not line:
            return
        for part in _unglue(line):
            shown = part.strip()
            msg, err_d = _strip_decor(shown)
            msg = msg.strip()
            if msg:
                self.feed(msg, shown, err or err_d, truncated)

    def feed(self, t: str, shown: str, error_level: bool = False, truncated: bool = False) -> None:
        raise NotImplementedError

    def _structured(self, t: str) -> None:
        raise NotImplementedError

class _Parser(_LineReader):
    def __init__(self) -> None:
        self.p = _Pass()
        self.c = self.p.ctx
        self.passes: list[_Pass] = [self.p]
        self.oom = False
        self.errors: list[str] = []
        self.devices: dict[str, int] = {}
        self.breakdown_free: dict[str, int] = {}
        self.prompt_tps: float | None = None
        self.eval_tps: float | None = None
        self.build: str | None = None
        self.processor_split: dict[str, int] = {}
        self.ollama_gpus: dict[str, str] = {}   # Ollama GPU id -> the device name it is given here
        self.ollama_sizes = False

    # -- pass bookkeeping --
    def _new_pass(self) -> None:
        self.p = _Pass()
        self.c = self.p.ctx
        self.passes.append(self.p)
        if len(self.passes) > _MAX_LOADS:
            del self.passes[_MAX_LOADS // 2]

    def _new_ctx(self) -> None:
        self.c = self.p.ctx = _Ctx()

    # -- one logical line --
    def _structured(self, t: str) -> None:
        """A JSON log line as a whole (or an over-long line): read for fields only, not as a message."""
        low = t.lower()
        if self.build is None and ("build" in low or "version" in low):
            self._build(t)
        if "eval" in low or "per_second" in t:
            self._timings(t)
        if t.startswith("time=") and ("size=" in t or "free=" in t):
            self._ollama(t)

    def feed(self, t: str, shown: str, error_level: bool = False, truncated: bool = False) -> None:
        """One message: ``t`` with every prefix removed, ``shown`` as ``errors`` stores it.

        Each group of regexes runs only when its words are in the line (see the gates below):
        most lines of a long log are none of these, and ``in`` costs a fraction of a search.
        """
        if t.startswith(_METADATA_PREFIXES) and _METADATA.match(t):
            # a metadata dump line (a third of a dense log): never a failure line (_failures skips
            # them too), and of its keys only n_layer (and a context size) are read here
            if "n_layer" not in t and "n_ctx" not in t:
                return
        low = t.lower()
        if error_level or _maybe_failure(low):
            self._failures(t, low, shown, error_level)
        if not truncated:  # numbers at the cut could be cut too; the whole line was read already
            if self.build is None and ("build" in low or "version" in low) and self._build(t):
                return
            if ("eval" in low or "per_second" in t) and self._timings(t):
                return
        if ("meta" in t or "offloaded" in t or "assigned" in t or "n_layer" in t or "buffer" in t or "VRAM" in t
                or "required" in t or "system memory" in t or "load_tensors" in t) and self._model(t):
            return
        if ("n_ctx" in t or "buffer" in t or "VRAM" in t or "self" in low or "kv_cache" in t or "kv_size" in t
                or "constructing" in t or "n_seq_max" in t or "ctx_size" in t):
            self._context(t)
        if "free" in t or "breakdown" in t:
            self._memory(t)
        if "% " in t and ("CPU" in t or "GPU" in t):
            self._ollama_ps(t)

    def _ollama_ps(self, t: str) -> None:
        m = _RX_OLLAMA_PS_SPLIT.search(t)
        if m:
            cpu, gpu = int(m.group(1)), int(m.group(2))
            if cpu + gpu == 100:
                self.processor_split = {"CPU": cpu, "GPU": gpu}
            return
        m = _RX_OLLAMA_PS_ONE.search(t)
        if m:
            self.processor_split = {"CPU": 100 if m.group(1) == "CPU" else 0, "GPU": 100 if m.group(1) == "GPU" else 0}

    def _ollama(self, t: str) -> None:
        """One of Ollama's memory lines (see _OLLAMA_MSG): weights, KV and compute per device, and
        the scheduler's free memory per GPU. Each states a device's whole figure (set, not added)."""
        m = _OLLAMA_MSG.search(t)
        if not m:
            return
        kind = m.group(1)
        attrs = {a.group(1): (a.group(2) if a.group(2) is not None else a.group(3)) for a in _SLOG_ATTR.finditer(t)}
        if kind == "gpu memory":
            free = _ollama_bytes(attrs.get("free"))
            gpu_id = (attrs.get("id") or "")[:128]
            if free is None or not gpu_id:
                return
            prefix = _OLLAMA_LIBRARY.get((attrs.get("library") or "").lower(), "GPU")
            name = self.ollama_gpus.get(gpu_id)
            if name is None:
                if len(self.ollama_gpus) >= 1024:
                    return
                index = sum(1 for n in self.ollama_gpus.values() if n.rstrip("0123456789") == prefix)
                name = self.ollama_gpus[gpu_id] = f"{prefix}{index}"
            self.devices[name] = free
            return
        size = _ollama_bytes(attrs.get("size"))
        device = attrs.get("device") or (attrs.get("backend") if kind == "compute graph" else attrs.get("buffer"))
        if size is None or not device:
            return
        device = device[:128]
        self.ollama_sizes = True
        if kind == "model weights":
            if self.c.has_data():
                self._new_pass()
            if len(self.p.model_buffers) < 1024 or device in self.p.model_buffers:
                self.p.model_buffers[device] = size
        elif len(self.c.kv_buffers) < 1024 and len(self.c.compute_buffers) < 1024:
            (self.c.kv_buffers if kind == "kv cache" else self.c.compute_buffers)[device] = size

    def _failures(self, t: str, low: str, shown: str, error_level: bool) -> None:
        if _METADATA.match(t):
            return
        # (every _OOM / _OOM_GENERIC pattern holds one of these words: the searches are costly)
        is_oom = (("alloc" in low or "memory" in low or "mmap failed" in low or "cl_out" in low)
                  and _maybe_oom(low)
                  and (bool(_OOM.search(t)) or (bool(_OOM_GENERIC.search(t)) and bool(_LOGLIKE.search(t)))))
        if not (is_oom or error_level or (_maybe_error_line(t, low) and _ERROR_LINE.search(t))
                or (("err" in low or "fail" in low or "fatal" in low) and self._func_failure(t))):
            return
        if _NON_FATAL.search(t):
            return
        if is_oom:
            self.oom = True
        # a failure repeated line after line (a decode loop) is one failure
        if not self.errors or self.errors[-1] != shown:
            self.errors.append(shown)
            if len(self.errors) > 2 * _MAX_ERRORS:
                # keep the first and the latest (the cause and how it ended), in bounded memory
                del self.errors[_MAX_ERRORS // 2 : len(self.errors) - _MAX_ERRORS // 2]

    @staticmethod
    def _func_failure(t: str) -> bool:
        m = _FUNC_THEN.match(t)
        return bool(m and _FAILURE_WORD.search(t, m.end()))

    def _build(self, t: str) -> bool:
        if self.build is not None:
            return False
        m = _RX_BUILD_BENCH.match(t)
        if m and _int(m.group(2)) is not None:
            self.build = f"{m.group(2)} ({m.group(1)})"
            return True
        m = _RX_VERSION.match(t) or _RX_VERSION_2026.search(t) or _RX_BUILD.search(t) or _RX_KV_BUILD.search(t)
        if m and _int(m.group(1)) is not None:
            self.build = f"{m.group(1)} ({m.group(2)})"
            return True
        m = _RX_BUILD_LOOSE.search(t)
        if m and _int(m.group(1)) is not None:
            self.build = m.group(1)
            return True
        if t.startswith("{"):
            m = _RX_JSON_BUILD.search(t)
            if m and _int(m.group(1)) is not None:
                c = _RX_JSON_COMMIT.search(t)
                self.build = f"{m.group(1)} ({c.group(1)})" if c else m.group(1)
        return False

    def _timings(self, t: str) -> bool:
        m = _RX_TIMING.search(t)
        if m:
            kind = m.group(1).lower()
            tps = _rate(m.group(4))
            if tps is None:
                # "inf"/"nan" printed for a zero-time run: derive from ms and count when possible
                ms, n = _float(m.group(2)), _int(m.group(3))
                tps = _rate(str(1e3 * n / ms)) if ms and n is not None else None
            if kind == "prompt eval":
                self.prompt_tps = tps
            else:
                self.eval_tps = tps
            return True
        found = False
        m = _RX_JSON_PP.search(t)
        if m:
            self.prompt_tps = _rate(m.group(1))
            found = True
        m = _RX_JSON_TG.search(t)
        if m:
            self.eval_tps = _rate(m.group(1))
            found = True
        return found

    def _model(self, t: str) -> bool:
        p = self.p
        if t.startswith("llama_model_loader") and _RX_LOAD_START.match(t):
            if p.started or p.has_data() or self.c.reached():
                self._new_pass()
            self.p.started = True
            return True
        m = _RX_OFFLOADED.search(t) if "offloaded" in t else None
        if m:
            offloaded, total = _int(m.group(1)), _int(m.group(2))
            if offloaded is None or total is None:
                return True
            # a second offload summary in the same pass, or one after a context was built,
            # means a new load pass (fit dry run, then the real load) that printed no loader line
            if p.layers_offloaded is not None or self.c.has_data():
                self._new_pass()
                p = self.p
            p.layers_offloaded, p.layers_total = offloaded, total
            p.assign_closed = p.assign_closed or bool(p.assignments)
            return True
        m = _RX_LAYER_ASSIGN.match(t) if "assigned" in t else None
        if m:
            il = _int(m.group(1))
            if il is None or il > 1 << 20:
                return True
            if il in p.assignments or self.c.has_data():
                self._new_pass()
                p = self.p
            p.assignments[il] = m.group(2)
            return True
        m = _RX_N_LAYER.match(t) if "n_layer" in t else None
        if m:
            p.n_layer = _int(m.group(1))
            return True
        for rx, label, word in ((_RX_MODEL_BUF, None, "buffer"), (_RX_VRAM_USED, "VRAM used", "VRAM"),
                                (_RX_MEM_REQUIRED, "mem required (host)", "required"),
                                (_RX_SYS_MEM, "system memory used", "system memory")):
            m = rx.match(t) if word in t else None
            if m:
                if self.c.has_data():
                    self._new_pass()
                    p = self.p
                if label is None:
                    _add(p.model_buffers, m.group(1), _bytes(m.group(2), m.group(3)))
                else:
                    _add(p.model_buffers, label, _bytes(m.group(1), m.group(2)))
                p.assign_closed = p.assign_closed or bool(p.assignments)
                return True
        m = _RX_METAL_ADD.match(t) if t.startswith("ggml_metal_add_buffer") else None
        if m:
            # 2023 Metal maps buffers after the context exists, so no pass logic here
            kind, size = m.group(1).lower(), _bytes(m.group(2), m.group(3))
            if kind == "data":
                _add(p.model_buffers, "Metal", size)
            elif kind == "kv":
                _add(self.c.kv_buffers, "Metal", size)
            else:
                _add(self.c.compute_buffers, "Metal", size)
            return True
        # any other "load_tensors: ..." / "llm_load_tensors: ..." line after the assignment block
        # (e.g. "%s: offloading %d repeating layers to GPU") means the block is complete
        if p.assignments and _RX_LOAD_TENSORS_ANY.match(t):
            p.assign_closed = True
        return False

    def _context(self, t: str) -> None:
        c = self.c
        if "constructing" in t and _RX_CTX_START.match(t):
            self._new_ctx()
            self.c.constructing = True
            return
        n_ctx_in = "n_ctx" in t
        m = _RX_N_CTX.match(t) if n_ctx_in else None
        if m:
            if c.has_data():
                self._new_ctx()
                c = self.c
            c.n_ctx = _int(m.group(2))
            return
        buffer = "buffer" in t
        m = _RX_KV_BUF.match(t) if buffer and "KV" in t else None
        if m:
            _add(c.kv_buffers, m.group(1), _bytes(m.group(2), m.group(3)))
            return
        m = _RX_RS_BUF.match(t) if buffer and "RS" in t else None
        if m:
            _add(c.kv_buffers, m.group(1), _bytes(m.group(2), m.group(3)))
            return
        m = _RX_VRAM_KV.match(t) if "VRAM" in t else None
        if m:
            _add(c.kv_buffers, "VRAM", _bytes(m.group(1), m.group(2)))
            return
        m = _RX_KV_SELF.match(t) if "self" in t.lower() else None
        if m:
            size = _bytes(m.group(1), m.group(2))
            if size is not None:
                c.kv_sizes.append(size)
            c.type_k = m.group(3) or c.type_k
            c.type_v = m.group(4) or c.type_v
            return
        m = _RX_KV_SIZE.match(t) if t.startswith("llama_kv_cache") else None
        if m:
            size = _bytes(m.group(1), m.group(2))
            if size is not None:
                c.kv_sizes.append(size)
            cells, streams = _int(m.group(3)), _int(m.group(4) or "1")
            if cells is not None and streams is not None:
                c.cells = max(c.cells or 0, cells * streams)
            c.type_k = m.group(5) or c.type_k
            c.type_v = m.group(6) or c.type_v
            return
        m = _RX_KV_INIT.match(t) if "kv_size" in t else None
        if m:
            cells = _int(m.group(1))
            if cells is not None:
                c.cells = max(c.cells or 0, cells)
            c.type_k, c.type_v = m.group(2), m.group(3)
            return
        compute = buffer and "compute" in t
        m = _RX_COMPUTE.match(t) if compute else None
        if m:
            _add(c.compute_buffers, m.group(1), _bytes(m.group(2), m.group(3)))
            return
        m = _RX_INPUT.match(t) if buffer and "input" in t else None
        if m:
            _add(c.compute_buffers, f"{m.group(1)} input", _bytes(m.group(2), m.group(3)))
            return
        m = _RX_COMPUTE_TOTAL.match(t) if compute else None
        if m:
            _add(c.compute_buffers, "compute buffer total", _bytes(m.group(1), m.group(2)))
            return
        m = _RX_VRAM_SCRATCH.match(t) if buffer and "VRAM" in t else None
        if m:
            _add(c.compute_buffers, "VRAM scratch", _bytes(m.group(1), m.group(2)))
            return
        m = _RX_N_SEQ_MAX.match(t) if "n_seq_max" in t else None
        if m:
            c.n_seq_max = _int(m.group(1))
            return
        m = _RX_N_CTX_SEQ.search(t) if "seq" in t else None
        if m:
            c.n_ctx_seq = _int(m.group(1) or m.group(2))
            return
        m = _RX_N_CTX_ANY.match(t) if n_ctx_in else None
        if m:
            c.n_ctx_any = _int(m.group(1))
            return
        m = _RX_CTX_SIZE.search(t) if "ctx_size" in t else None
        if m:
            c.ctx_size = _int(m.group(1))
            return
        m = _RX_N_CTX_SLOT.search(t) if "n_ctx_slot" in t else None
        if m:
            c.n_ctx_slot = _int(m.group(1))

    def _memory(self, t: str) -> None:
        m = _RX_USING_DEVICE.search(t)
        if m:
            # free memory right before the load: the figure a tuner wants
            free = _int(m.group(2))
            if free is not None:
                self.devices[m.group(1)] = free * MiB
            return
        m = _RX_BREAKDOWN.search(t)
        if m:
            # the exit-time table: used only for devices the load lines did not report
            free = _int(m.group(3))
            if free is not None:
                self.breakdown_free[m.group(1)] = free * MiB

    # -- result --
    def report(self) -> LoadReport:
        loads = [p for p in self.passes if p.is_load()]
        # the top-level fields: the last load that got as far as a context (a second model whose
        # load was cut off, or failed, does not hide the first one's context), else the last load
        chosen = next((p for p in reversed(loads) if p.ctx.reached()), loads[-1] if loads else self.p)
        top = chosen.to_load()
        devices = dict(self.devices)
        for k, v in self.breakdown_free.items():
            devices.setdefault(k, v)
        # Ollama's 2025 "gpu memory" line names no library: its GPUs take the one backend the load's
        # buffers name (GPU1 -> CUDA1), where there is exactly one
        if any(name.startswith("GPU") for name in self.ollama_gpus.values()):
            kinds = {re.sub(r"\d+$", "", label) for label in top.model_buffers if not _is_host_label(label)}
            if len(kinds) == 1:
                kind = kinds.pop()
                devices = {(kind + k[3:] if k in self.ollama_gpus.values() and k.startswith("GPU") else k): v
                           for k, v in devices.items()}
        errors = self.errors
        if len(errors) > _MAX_ERRORS:
            errors = errors[: _MAX_ERRORS // 2] + errors[-_MAX_ERRORS // 2:]
        return LoadReport(
            layers_offloaded=top.layers_offloaded,
            layers_total=top.layers_total,
            oom=self.oom,
            model_buffers=top.model_buffers,
            kv_buffers=top.kv_buffers,
            compute_buffers=top.compute_buffers,
            kv_size=top.kv_size,
            type_k=top.type_k,
            type_v=top.type_v,
            n_ctx=top.n_ctx,
            devices=devices,
            prompt_tps=self.prompt_tps,
            eval_tps=self.eval_tps,
            build=self.build,
            errors=tuple(errors),
            loads=tuple(p.to_load() for p in loads),
            processor_split=dict(self.processor_split),
            notes=(_OLLAMA_NOTE,) if self.ollama_sizes else (),
        )


@dataclass
class _Line:
    text: str          # message with every prefix and decoration removed (what regexes see)
    shown: str         # message with transport prefixes removed (what ``errors`` stores)
    error_level: bool  # the carrier said this line is an error (llama.cpp "E", JSON level, ...)
    structured: bool = False  # a JSON log line (or an over-long line) as a whole: fields only
    truncated: bool = False   # cut from an over-long line whose fields were already read whole


class _Collector(_LineReader):
    def __init__(self) -> None:
        self.out: list[_Line] = []

    def feed(self, t: str, shown: str, error_level: bool = False, truncated: bool = False) -> None:
        self.out.append(_Line(t, shown, error_level, truncated=truncated))

    def _structured(self, t: str) -> None:
        self.out.append(_Line(t, t, False, structured=True))


def _logical_lines(text: str) -> Iterator[_Line]:
    """The messages of a log as ``parse_log`` reads them, for other readers of the same log
    (``tuner.engine.logfacts``): every carrier prefix stripped, JSON and slog lines opened, glued
    lines split; structured (whole JSON or over-long) lines flagged."""
    reader = _Collector()
    for raw in _lines(text):
        if not raw or raw.isspace():
            continue
        try:
            reader.feed_line(raw)
        except Exception:  # noqa: BLE001 - as parse_log: one odd line costs nothing else
            pass
        yield from reader.out
        reader.out.clear()


def parse_log(text: str) -> LoadReport:
    """Parse a llama.cpp log (any era, any carrier). Never raises; garbage gives an empty report."""
    if text is None:
        return LoadReport()
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        return LoadReport()
    parser = _Parser()
    try:
        parser.feed_text(text)
        return parser.report()
    except Exception:  # noqa: BLE001 - the promise is "never raises"
        return LoadReport()


# ----------------------------------------------------------------------------------------------
# Human-readable summary
# ----------------------------------------------------------------------------------------------

def _mib(b: int | None) -> str:
    return "?" if b is None else f"{b / MiB:.2f} MiB"


def _per_device(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {_mib(v)}" for k, v in d.items()) if d else "-"


def format_report(report: LoadReport) -> str:
    """A few lines for a terminal: layers, buffers per device, KV, compute, n_ctx, speed, errors."""
    r = report
    lines: list[str] = []
    if r.layers_offloaded is None:
        layers = "layers: not in log"
    else:
        layers = f"layers: {r.layers_offloaded}/{r.layers_total if r.layers_total is not None else '?'} offloaded"
        if r.layers_offloaded == 0:
            layers += " (nothing offloaded)"
        elif r.partial_offload:
            layers += " (partial offload!)"
        if r.offload_fell_back:
            layers += " (but no accelerator holds weights: offload did not happen)"
    lines.append(layers + (f"   build {r.build}" if r.build else ""))
    lines.append(f"weights: {_per_device(r.model_buffers)}")
    kv = f"KV: {_mib(r.kv_size) if r.kv_size is not None else '-'}"
    if r.type_k or r.type_v:
        kv += f" (K {r.type_k or '?'}, V {r.type_v or '?'})"
    if r.kv_buffers:
        kv += f" on {_per_device(r.kv_buffers)}"
    lines.append(kv + (f"   n_ctx {r.n_ctx}" if r.n_ctx is not None else ""))
    lines.append(f"compute: {_per_device(r.compute_buffers)}")
    if r.devices:
        lines.append(f"free before load: {_per_device(r.devices)}")
    pp = f"{r.prompt_tps:.2f}" if r.prompt_tps is not None else "-"
    tg = f"{r.eval_tps:.2f}" if r.eval_tps is not None else "-"
    lines.append(f"speed: prompt {pp} t/s, eval {tg} t/s")
    if r.processor_split:
        lines.append(f"ollama ps: {r.processor_split.get('CPU', 0)}% CPU / {r.processor_split.get('GPU', 0)}% GPU"
                     + (" (partial offload!)" if r.partial_offload else ""))
    if r.oom:
        lines.append("OUT OF MEMORY")
    if r.errors:
        lines.append(f"errors ({len(r.errors)}):")
        lines.extend(f"  {e}" for e in r.errors[:10])
        if len(r.errors) > 10:
            lines.append(f"  ... {len(r.errors) - 10} more")
    lines.extend(f"note: {n}" for n in r.notes)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Accuracy against a truth file (tests/logs/truth.json) and a small CLI
# ----------------------------------------------------------------------------------------------

# truth field -> how to read the same thing from a LoadReport (sizes in MiB)
def _mib_dict(d: dict[str, int]) -> dict[str, float]:
    return {k: v / MiB for k, v in d.items()}


_TRUTH_FIELDS: dict[str, Any] = {
    "layers_offloaded": lambda r: r.layers_offloaded,
    "layers_total": lambda r: r.layers_total,
    "oom": lambda r: r.oom,
    "model_buffers": lambda r: _mib_dict(r.model_buffers),
    "devices": lambda r: _mib_dict(r.device_weights),
    "kv_mib": lambda r: None if r.kv_size is None else r.kv_size / MiB,
    "kv_by_device": lambda r: _mib_dict(r.kv_buffers),
    "compute_by_device": lambda r: _mib_dict(r.compute_buffers),
    "n_ctx": lambda r: r.n_ctx,
    "prompt_tps": lambda r: r.prompt_tps,
    "eval_tps": lambda r: r.eval_tps,
}


def truth_matches(expected: Any, got: Any, tol: float = 0.01) -> bool:
    """Compare one truth value with a parsed one: numbers within ``tol``; dicts by key set and
    value (a truth list of values means "these lines, summed")."""
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            return False
        return all(truth_matches(v, got[k], tol) for k, v in expected.items())
    if isinstance(expected, list):
        return truth_matches(sum(expected), got, tol)
    if isinstance(expected, bool) or expected is None:
        return got is expected or got == expected
    if isinstance(expected, (int, float)):
        return isinstance(got, (int, float)) and not isinstance(got, bool) and abs(got - expected) <= tol + 1e-9
    return expected == got


def accuracy_report(logs_dir: Any, *, out: Any = None) -> dict[str, tuple[int, int]]:
    """Per-field accuracy of ``parse_log`` over ``logs_dir/truth.json``: fields correct / fields
    with a (non-null) truth value. Prints a table to ``out`` (stdout by default) and returns
    ``{field: (correct, with_truth)}`` with the total under ``"ALL"``. Mismatches are listed."""
    import json
    import sys
    from pathlib import Path

    out = out or sys.stdout
    base = Path(logs_dir)
    truth = json.loads((base / "truth.json").read_text(encoding="utf-8"))
    counts = {k: [0, 0] for k in _TRUTH_FIELDS}
    misses: list[str] = []
    for name, t in sorted(truth.items()):
        path = base / name
        if not path.exists():
            continue
        report = parse_log(path.read_bytes().decode("utf-8", errors="replace"))
        for fname, getter in _TRUTH_FIELDS.items():
            if t.get(fname) is None:
                continue
            counts[fname][1] += 1
            got = getter(report)
            if truth_matches(t[fname], got):
                counts[fname][0] += 1
            else:
                misses.append(f"{name}: {fname}: truth {t[fname]!r}, parsed {got!r}")
    total_ok = sum(c[0] for c in counts.values())
    total_n = sum(c[1] for c in counts.values())
    print(f"{'field':<20} {'correct':>7} / {'truth':<5}", file=out)
    for fname, (ok, n) in counts.items():
        pct = f"{100 * ok / n:6.1f}%" if n else "    -  "
        print(f"{fname:<20} {ok:>7} / {n:<5} {pct}", file=out)
    print(f"{'ALL':<20} {total_ok:>7} / {total_n:<5} {100 * total_ok / max(total_n, 1):6.1f}%", file=out)
    for miss in misses:
        print(f"  mismatch {miss}", file=out)
    result = {k: (v[0], v[1]) for k, v in counts.items()}
    result["ALL"] = (total_ok, total_n)
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m tuner.engine.logparse [--json] FILE...`` or ``python -m tuner.engine.logparse --accuracy DIR``."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m tuner.engine.logparse", description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="log files ('-' for stdin)")
    ap.add_argument("--json", action="store_true", help="print LoadReport.to_dict() as JSON")
    ap.add_argument("--accuracy", metavar="DIR", help="per-field accuracy over DIR/truth.json")
    args = ap.parse_args(argv)
    if args.accuracy:
        accuracy_report(args.accuracy)
        return 0
    for name in args.files or ["-"]:
        data = sys.stdin.buffer.read() if name == "-" else open(name, "rb").read()
        report = parse_log(data.decode("utf-8", errors="replace"))
        if args.json:
            print(json.dumps(report.to_dict(), indent=2))
        else:
            if len(args.files) > 1:
                print(f"== {name}")
            print(format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
