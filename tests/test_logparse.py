"""Tests for tuner.engine.logparse: the 25 real logs against tests/logs/truth.json, plus one targeted test
per kind of damage a pasted log carries. Synthetic lines are written from llama.cpp's format
strings; expected values are worked out by hand from those lines, never copied from the parser.
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest

from tuner.engine.logparse import LoadReport, ModelLoad, accuracy_report, format_report, parse_log, truth_matches

MiB = 1048576
LOGS = Path(__file__).parent / "logs"
TRUTH: dict = json.loads((LOGS / "truth.json").read_text(encoding="utf-8"))


def _read(name: str) -> str:
    return (LOGS / name).read_bytes().decode("utf-8", errors="replace")


def _mib(d: dict[str, int]) -> dict[str, float]:
    return {k: v / MiB for k, v in d.items()}


# truth field -> the same thing read from a LoadReport (sizes in MiB, as truth.json has them).
# Note: truth "devices" is accelerator WEIGHTS (compare with device_weights), not free memory.
GETTERS = {
    "layers_offloaded": lambda r: r.layers_offloaded,
    "layers_total": lambda r: r.layers_total,
    "oom": lambda r: r.oom,
    "model_buffers": lambda r: _mib(r.model_buffers),
    "devices": lambda r: _mib(r.device_weights),
    "kv_mib": lambda r: None if r.kv_size is None else r.kv_size / MiB,
    "kv_by_device": lambda r: _mib(r.kv_buffers),
    "compute_by_device": lambda r: _mib(r.compute_buffers),
    "n_ctx": lambda r: r.n_ctx,
    "prompt_tps": lambda r: r.prompt_tps,
    "eval_tps": lambda r: r.eval_tps,
}

# Truth fields the parser deliberately disagrees with: (file, field) -> (what the parser must give
# instead, why). The test asserts the parser's value, so a deviation still fails if it changes.
DEVIATIONS: dict[tuple[str, str], tuple[object, str]] = {
    ("34_2023-metal-m1-llamafile-vram-used-zero-add-buffer.log", "model_buffers"): (
        {"VRAM used": 0.0, "Metal": 4096.0},
        "truth keys the 2023 Metal weights 'Metal data buffer (partial list)', an annotator's "
        "description, not a label llama.cpp printed (it printed ggml_metal_add_buffer: allocated "
        "'data' buffer). The parser keys 2023 Metal 'data' buffers as 'Metal' (the device name the "
        "2024+ logs print for the same buffer); the size, 4096.00, is the same.",
    ),
}

CASES = [(name, fld) for name, t in sorted(TRUTH.items()) for fld in GETTERS if t.get(fld) is not None]


def test_every_truth_file_is_here() -> None:
    assert len(TRUTH) == 25
    for name in TRUTH:
        assert (LOGS / name).is_file(), name


@pytest.mark.parametrize("name,fld", CASES, ids=[f"{n[:2]}-{f}" for n, f in CASES])
def test_truth(name: str, fld: str) -> None:
    report = parse_log(_read(name))
    got = GETTERS[fld](report)
    expected = TRUTH[name][fld]
    if (name, fld) in DEVIATIONS:
        mine, why = DEVIATIONS[(name, fld)]
        assert not truth_matches(expected, mine), "deviation no longer needed: " + why
        assert truth_matches(mine, got), f"{name} {fld}: parsed {got!r}, expected (deviation) {mine!r}"
        return
    assert truth_matches(expected, got), f"{name} {fld}: parsed {got!r}, truth {expected!r}"


def test_truth_matches_compares_within_a_hundredth() -> None:
    assert truth_matches(1.0, 1.009)
    assert not truth_matches(1.0, 1.02)
    assert truth_matches({"A": 1.0}, {"A": 1.0})
    assert not truth_matches({"A": 1.0}, {"A": 1.0, "B": 2.0})
    assert truth_matches({"CPU_Mapped": [1.0, 2.0]}, {"CPU_Mapped": 3.0})  # split GGUF: summed
    assert not truth_matches(False, None)
    assert not truth_matches(0, None)


def test_accuracy_report_prints_per_field_figures() -> None:
    buf = io.StringIO()
    res = accuracy_report(LOGS, out=buf)
    text = buf.getvalue()
    assert "layers_offloaded" in text and "ALL" in text
    ok, n = res["ALL"]
    assert n == len(CASES)
    # everything but the documented deviations agrees with truth
    assert ok == n - len(DEVIATIONS)


# ---------------------------------------------------------------------------------------------
# A clean modern load, the basis for the damage tests (values are what these lines print)
# ---------------------------------------------------------------------------------------------

MODERN = """\
build: 5622 (97340b4c) with cc (Ubuntu 13.3.0) 13.3.0 for x86_64-linux-gnu
llama_model_load_from_file_impl: using device CUDA0 (NVIDIA GeForce RTX 4090) - 23000 MiB free
llama_model_loader: loaded meta data with 35 key-value pairs and 579 tensors from /m/x.gguf (version GGUF V3 (latest))
print_info: n_layer          = 32
load_tensors: loading model tensors, this can take a while... (mmap = true)
load_tensors: offloading 20 repeating layers to GPU
load_tensors: offloaded 20/33 layers to GPU
load_tensors:   CPU_Mapped model buffer size =  1500.50 MiB
load_tensors:        CUDA0 model buffer size =  2500.25 MiB
..........................................................................................
llama_context: constructing llama_context
llama_context: n_seq_max     = 1
llama_context: n_ctx         = 8192
llama_context:  CUDA_Host  output buffer size =     0.49 MiB
llama_kv_cache:      CUDA0 KV buffer size =   640.00 MiB
llama_kv_cache:        CPU KV buffer size =   384.00 MiB
llama_kv_cache: size = 1024.00 MiB (  8192 cells,  32 layers,  1/1 seqs), K (q8_0):  512.00 MiB, V (f16):  512.00 MiB
llama_context:      CUDA0 compute buffer size =   300.00 MiB
llama_context:  CUDA_Host compute buffer size =    24.01 MiB
llama_perf_sampler_print:    sampling time =      22.49 ms /   204 runs   (    0.11 ms per token,  9069.49 tokens per second)
llama_perf_context_print: prompt eval time =     149.75 ms /    14 tokens (   10.70 ms per token,    93.49 tokens per second)
llama_perf_context_print:        eval time =    4173.56 ms /   189 runs   (   22.08 ms per token,    45.29 tokens per second)
"""


def _check_modern(r: LoadReport) -> None:
    assert (r.layers_offloaded, r.layers_total) == (20, 33)
    assert r.partial_offload is True
    assert r.model_buffers == {"CPU_Mapped": round(1500.50 * MiB), "CUDA0": round(2500.25 * MiB)}
    assert r.device_weights == {"CUDA0": round(2500.25 * MiB)}
    assert r.kv_buffers == {"CUDA0": 640 * MiB, "CPU": 384 * MiB}
    assert r.kv_size == 1024 * MiB
    assert (r.type_k, r.type_v) == ("q8_0", "f16")
    assert r.compute_buffers == {"CUDA0": 300 * MiB, "CUDA_Host": round(24.01 * MiB)}
    assert r.n_ctx == 8192
    assert r.devices == {"CUDA0": 23000 * MiB}
    assert r.prompt_tps == pytest.approx(93.49)
    assert r.eval_tps == pytest.approx(45.29)
    assert r.build == "5622 (97340b4c)"
    assert r.oom is False and r.errors == ()


def test_modern_clean() -> None:
    _check_modern(parse_log(MODERN))


def _prefixed(prefix_for) -> str:
    return "\n".join(prefix_for(i) + line for i, line in enumerate(MODERN.splitlines())) + "\n"


# One entry per kind of prefix a carrier puts in front of llama.cpp's lines (the line number goes
# into the timestamp where the format has one, so no two lines carry the same prefix).
PREFIXES = {
    "llama-ts": lambda i: f"0.{i:02d}.015.212 I ",                               # llama.cpp --log-timestamps
    "ansi": lambda i: "\x1b[34m0.00.015.212\x1b[0m \x1b[32mI \x1b[0m",           # coloured llama.cpp prefix
    "journald": lambda i: f"Jun 01 12:00:{i:02d} gpubox ollama[1234]: ",          # journalctl (short)
    "journald-precise": lambda i: f"Jun  1 12:00:{i:02d}.123456 gpubox ollama[1234]: ",  # -o short-precise
    "journald-iso": lambda i: f"2026-06-09T08:10:{i:02d}+0000 gpubox ollama[1234]: ",   # -o short-iso
    "journald-monotonic": lambda i: f"[ 1234.{i:06d}] gpubox ollama[1234]: ",     # -o short-monotonic
    "journald-unix": lambda i: f"1717243200.{i:06d} gpubox ollama[1234]: ",       # -o short-unix
    "syslog-pri": lambda i: f"<30>Jun  1 12:00:{i:02d} gpubox ollama[1234]: ",    # RFC 3164 with priority
    "syslog-5424": lambda i: f"<14>1 2026-06-09T08:10:{i:02d}.538Z gpubox ollama 1234 - - ",  # RFC 5424
    "sd-daemon": lambda i: "<6>",                                                 # stderr level prefix for journald
    "docker": lambda i: "ollama  | ",                                             # docker compose
    "docker-ts": lambda i: "ollama-1  | 2024-06-01T12:00:00.123456789Z ",        # compose + docker --timestamps
    "model-runner": lambda i: f"2026-06-09 08:10:{i:02d}.538 | [2026-04-26T00:20:42.763232000Z] ",  # Docker Model Runner
    "compose-model-runner": lambda i: f"model-runner-1  | 2026-06-09 08:10:{i:02d}.538 | [2026-04-26T00:20:42.763232000Z] ",
    "kubectl": lambda i: f"[pod/llama-0/server] 2024-06-01T12:00:{i:02d}.123456789Z stdout F ",  # kubectl logs --prefix, CRI
    "iso-zone": lambda i: f"2025-01-30T22:09:{i:02d}.123+01:00 ",                 # ISO with zone
    "iso-bracket": lambda i: f"[2023-11-11 00:02:{i:02d}.402] ",                  # bracketed ISO
    "iso-utc": lambda i: f"2026-06-09 08:10:{i:02d} UTC ",
    "go-log": lambda i: f"2024/06/01 12:00:{i:02d} ",                             # Go's log package
    "time-only": lambda i: f"12:00:{i:02d}.123 ",
    "time-bracket": lambda i: f"[12:00:{i:02d}] ",
    "epoch": lambda i: f"{1717243200 + i} ",
    "epoch-bracket": lambda i: f"[{1717243200 + i}.123] ",
    "glog": lambda i: f"I0609 08:10:{i:02d}.538123 12345 runner.cc:42] ",         # glog / Abseil
    "python-logging": lambda i: "INFO:llama_cpp:",                                # logging's default format
    "python-logging-time": lambda i: f"2026-06-09 08:10:{i:02d},538 - llama_cpp - INFO - ",  # the cookbook's
    "lmstudio": lambda i: f"2026-01-30 22:09:{i:02d} [DEBUG] ",                   # LM Studio
}


@pytest.mark.parametrize("prefix_for", list(PREFIXES.values()), ids=list(PREFIXES))
def test_prefixes_are_stripped(prefix_for) -> None:
    _check_modern(parse_log(_prefixed(prefix_for)))


@pytest.mark.parametrize("line", [
    "<3>llama_model_load: boom",                                                 # sd-daemon "err"
    "<11>1 2026-06-09T08:10:09.538Z gpubox ollama 1234 - - llama_model_load: boom",  # RFC 5424 user.err
    "<27>Jun  1 12:00:00 gpubox ollama[1234]: llama_model_load: boom",           # daemon.err
    "E0609 08:10:09.538123 12345 runner.cc:42] llama_model_load: boom",          # glog E
    "ERROR:llama_cpp:llama_model_load: boom",                                    # Python logging
    "2026-06-09 08:10:09,538 - llama_cpp - ERROR - llama_model_load: boom",
    "time=2025-01-30T10:00:00.000+01:00 level=ERROR source=server.go:1 msg=\"llama_model_load: boom\"",
    "ollama  | 0.00.100.000 E llama_model_load: boom",
])
def test_a_carrier_that_says_error_makes_an_error_line(line: str) -> None:
    # "llama_model_load: boom" says nothing of an error by itself; only its carrier's level does
    assert parse_log("llama_model_load: boom\n").errors == ()
    assert parse_log(line + "\n").errors[0].endswith("llama_model_load: boom"), line
    assert parse_log(line.replace("ERROR", "INFO").replace("E0609", "I0609").replace(" E ", " I ")
                     .replace("<3>", "<6>").replace("<11>", "<14>").replace("<27>", "<30>") + "\n").errors == ()


def test_2024_server_text_log_format() -> None:
    # tools/server/utils.hpp (2024): "%4s [%24s] %s" then " | key=value" for the extra fields
    text = (' INFO [                    main] build info | tid="139949045108736" timestamp=1717243200 build=3046 commit="5921b8f0"\n'
            ' INFO [           print_timings] prompt eval time     =     123.45 ms /    10 tokens (   12.35 ms per token,'
            '    81.00 tokens per second) | tid="1" timestamp=1 id_slot=0 id_task=0\n'
            ' INFO [           print_timings] generation eval time =    1000.00 ms /    25 runs   (   40.00 ms per token,'
            '    25.00 tokens per second) | tid="1" timestamp=1 id_slot=0 id_task=0\n'
            '  ERR [              load_model] unable to load model | tid="1" timestamp=1 model="/m/x.gguf"\n')
    r = parse_log(text)
    assert r.build == "3046 (5921b8f0)"
    assert (r.prompt_tps, r.eval_tps) == (pytest.approx(81.0), pytest.approx(25.0))
    assert r.errors == ('ERR [              load_model] unable to load model | tid="1" timestamp=1 model="/m/x.gguf"',)


def test_ollama_slog_lines() -> None:
    # Go's log/slog text handler quotes a value only when it must: msg="two words", msg=word
    text = ('time=2025-01-30T10:00:00.000+01:00 level=INFO source=server.go:1 msg="load_tensors: offloaded 20/33 layers to GPU"\n'
            'time=2025-01-30T10:00:00.001+01:00 level=INFO source=server.go:2 msg="llama_context: n_ctx = 8192"\n'
            'time=2025-01-30T10:00:00.002+01:00 level=INFO source=server.go:3 msg=starting\n'
            'time=2025-01-30T10:00:00.003+01:00 level=ERROR source=server.go:4 msg="llama runner terminated" error="exit status 2"\n')
    r = parse_log(text)
    assert (r.layers_offloaded, r.layers_total, r.n_ctx) == (20, 33, 8192)
    assert r.errors == ("llama runner terminated",)


def test_lm_studio_header_lines_and_leading_space() -> None:
    # LM Studio prints "DATE [DEBUG]" on its own line, then the message indented by one space
    text = "".join(f"2026-01-30 22:09:40 [DEBUG]\n {line}\n" for line in MODERN.splitlines())
    _check_modern(parse_log(text))


def test_crlf_and_bare_cr() -> None:
    _check_modern(parse_log(MODERN.replace("\n", "\r\n")))
    _check_modern(parse_log(MODERN.replace("\n", "\r")))


def test_collapsed_whitespace() -> None:
    import re
    _check_modern(parse_log(re.sub(r"[ \t]+", " ", MODERN)))


def test_decimal_commas() -> None:
    text = (MODERN.replace("1500.50 MiB", "1500,50 MiB").replace("2500.25", "2500,25")
            .replace("93.49 tokens", "93,49 tokens").replace("45.29 tokens", "45,29 tokens")
            .replace("1024.00 MiB (", "1024,00 MiB (").replace("24.01 MiB", "24,01 MiB"))
    _check_modern(parse_log(text))
    r = parse_log("load_tensors:        CUDA0 model buffer size = 1024,00 MiB\n")
    assert r.model_buffers == {"CUDA0": 1024 * MiB}


def test_glued_progress_dots() -> None:
    # 2026: the progress dots end without a newline and the next message follows directly
    text = MODERN.replace("..........................................................................................\n"
                          "llama_context: constructing llama_context",
                          "....................llama_context: constructing llama_context")
    assert "....llama_context" in text
    _check_modern(parse_log(text))
    r = parse_log("load_tensors: offloaded 66/66 layers to GPU\n"
                  "....srv    load_model: initializing slots, n_slots = 1\n"
                  ".....llama_context: n_ctx         = 131072\n")
    assert r.n_ctx == 131072 and r.layers_offloaded == 66
    # the glued message keeps its own identity: anchored regexes match it, errors store it clean
    r = parse_log("load_tensors: offloaded 42/42 layers to GPU\n"
                  "....load_tensors:        CUDA0 model buffer size =   555.21 MiB\n"
                  ".....llama_init_from_model: failed to initialize the context: boom\n")
    assert r.model_buffers == {"CUDA0": round(555.21 * MiB)}
    assert r.errors == ("llama_init_from_model: failed to initialize the context: boom",)


def test_glued_after_closing_paren_and_after_a_word() -> None:
    # 2024 Metal: two messages on one line, glued after ")"
    r = parse_log("ggml_backend_metal_log_allocated_size: allocated buffer, size =  2048.00 MiB, ( 2056.30 /  1536.00)"
                  "llm_load_tensors: offloaded 33/33 layers to GPU\n"
                  "llm_load_tensors:      Metal buffer size =  4988.00 MiB"
                  "llama_kv_cache_init:      Metal KV buffer size =   256.00 MiB\n")
    assert (r.layers_offloaded, r.layers_total) == (33, 33)
    assert r.model_buffers == {"Metal": 4988 * MiB}
    assert r.kv_buffers == {"Metal": 256 * MiB}


def test_mojibake_does_not_break_parsing() -> None:
    moji = "print_info: LF token         = 198 '\u00c4\u0160'\nprint_info: BOS token = 1 '\u00e2\u20ac\u201d\ufffd'\n"
    _check_modern(parse_log(moji + MODERN))
    # the whole log read with the wrong codec (UTF-8 bytes decoded as cp1252/latin-1)
    _check_modern(parse_log((moji + MODERN).encode("utf-8").decode("latin-1")))


def test_garbage_gives_an_empty_report() -> None:
    empty = LoadReport()
    assert parse_log("") == empty
    assert parse_log(None) == empty  # type: ignore[arg-type]
    assert parse_log(12345) == empty  # type: ignore[arg-type]
    rnd = random.Random(7)
    noise = "".join(chr(rnd.randrange(0, 0x3000)) for _ in range(20000))
    r = parse_log(noise)
    assert isinstance(r, LoadReport)
    assert r.layers_offloaded is None and r.model_buffers == {}
    assert parse_log(b"\xff\xfe\x00garbage\x80") == empty  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Load passes: a fit dry run repeats the load; the last pass wins
# ---------------------------------------------------------------------------------------------

FIT_PASS = """\
llama_params_fit_impl: projected to use 61807 MiB of device memory vs. 24077 MiB of free device memory
llama_model_loader: loaded meta data with 35 key-value pairs and 579 tensors from /m/x.gguf (version GGUF V3 (latest))
load_tensors: offloaded 49/49 layers to GPU
load_tensors:   CPU_Mapped model buffer size =   100.00 MiB
load_tensors:        CUDA0 model buffer size = 60000.00 MiB
llama_context: constructing llama_context
llama_context: n_ctx         = 40960
llama_kv_cache:      CUDA0 KV buffer size =  3840.00 MiB
llama_kv_cache: size = 3840.00 MiB ( 40960 cells,  48 layers,  1/1 seqs), K (f16): 1920.00 MiB, V (f16): 1920.00 MiB
llama_context:      CUDA0 compute buffer size =  2000.00 MiB
llama_params_fit_impl: context size reduced from 40960 to 4096 -> need 3456 MiB less memory in total
llama_params_fit: successfully fit params to free device memory
"""


def test_fit_dry_run_then_real_load_last_pass_wins() -> None:
    r = parse_log(FIT_PASS + MODERN)
    _check_modern(r)  # nothing from the dry run leaks in, and nothing is summed across passes


def test_repeated_load_without_loader_line_still_resets() -> None:
    # a second offload summary after a context exists starts a new pass even with no loader line
    one = "\n".join(line for line in FIT_PASS.splitlines() if "loaded meta data" not in line) + "\n"
    two = "\n".join(line for line in MODERN.splitlines() if "loaded meta data" not in line) + "\n"
    _check_modern(parse_log(one + two))


def test_2023_order_buffers_before_offload_line_repeated_pass() -> None:
    # Dec 2023 prints the buffers BEFORE the offload summary; a second load (no loader line in
    # the excerpt) after a context must replace, not add to, the first one
    one = ("llm_load_tensors: system memory used  = 5506.41 MiB\n"
           "llm_load_tensors: VRAM used           = 1701.95 MiB\n"
           "llm_load_tensors: offloaded 10/41 layers to GPU\n"
           "llama_new_context_with_model: n_ctx      = 2048\n"
           "llama_new_context_with_model: KV self size  = 1600.00 MiB, K (f16):  800.00 MiB, V (f16):  800.00 MiB\n"
           "llama_new_context_with_model: compute buffer total size = 197.19 MiB\n")
    two = ("llm_load_tensors: system memory used  =  195.40 MiB\n"
           "llm_load_tensors: VRAM used           = 6340.49 MiB\n"
           "llm_load_tensors: offloaded 41/41 layers to GPU\n")
    r = parse_log(one + two)
    first, second = r.loads  # two loads, neither adds to the other
    assert second.model_buffers == {"system memory used": round(195.40 * MiB), "VRAM used": round(6340.49 * MiB)}
    assert (second.layers_offloaded, second.layers_total) == (41, 41)
    assert second.kv_size is None and second.compute_buffers == {} and second.n_ctx is None  # no context yet
    assert first.model_buffers == {"system memory used": round(5506.41 * MiB), "VRAM used": round(1701.95 * MiB)}
    # the top level is the last load that got as far as a context: the first one, whole
    assert r.model_buffers == first.model_buffers
    assert (r.layers_offloaded, r.layers_total) == (10, 41)
    assert (r.n_ctx, r.kv_size, r.compute_buffers) == (2048, 1600 * MiB, {"compute buffer total": round(197.19 * MiB)})


def test_repeated_assignment_blocks_last_wins() -> None:
    # a verbose fit dry run lists the layer assignment twice: count the last listing only
    first = "".join(f"load_tensors: layer {i:3d} assigned to device CUDA0, is_swa = 0\n" for i in range(5))
    second = "".join(f"load_tensors: layer {i:3d} assigned to device {'CPU' if i < 3 else 'CUDA0'}, is_swa = 0\n"
                     for i in range(5))
    r = parse_log(first + "load_tensors: CUDA0 model buffer size = 1.00 MiB\n"
                  + second + "load_tensors: CUDA0 model buffer size = 2.00 MiB\n")
    assert (r.layers_offloaded, r.layers_total) == (2, 5)
    assert r.model_buffers == {"CUDA0": 2 * MiB}


def test_every_load_is_kept_and_a_cut_second_load_does_not_hide_the_first() -> None:
    # one model's complete load and context, then the start of a second model's load (a server
    # switching models, a log cut short): the first context is kept, and both loads are listed
    second = ("llama_model_loader: loaded meta data with 30 key-value pairs and 291 tensors from /m/y.gguf (version GGUF V3 (latest))\n"
              "print_info: n_layer          = 16\n"
              "load_tensors: offloaded 17/17 layers to GPU\n"
              "load_tensors:        CUDA0 model buffer size =   700.00 MiB\n")
    r = parse_log(MODERN + second)
    _check_modern(r)  # the top level is the first load: the last one that got as far as a context
    assert len(r.loads) == 2
    first, cut = r.loads
    assert (first.layers_offloaded, first.n_ctx, first.kv_size) == (20, 8192, 1024 * MiB)
    assert first.compute_buffers == {"CUDA0": 300 * MiB, "CUDA_Host": round(24.01 * MiB)}
    assert (cut.layers_offloaded, cut.layers_total, cut.model_buffers) == (17, 17, {"CUDA0": 700 * MiB})
    assert (cut.n_ctx, cut.kv_size, cut.kv_buffers, cut.compute_buffers) == (None, None, {}, {})
    # once the second load has its context, it is the top level
    later = parse_log(MODERN + second + "llama_context: constructing llama_context\nllama_context: n_ctx = 2048\n"
                      "llama_kv_cache:      CUDA0 KV buffer size =    32.00 MiB\n")
    assert (later.layers_offloaded, later.n_ctx, later.kv_buffers) == (17, 2048, {"CUDA0": 32 * MiB})
    assert [load.n_ctx for load in later.loads] == [8192, 2048]


def test_loads_of_a_fit_dry_run_and_of_a_failed_load() -> None:
    r = parse_log(FIT_PASS + MODERN)
    assert [(load.layers_offloaded, load.n_ctx) for load in r.loads] == [(49, 40960), (20, 8192)]
    # a load that failed before its context: it is listed, and it is the top level (the only one)
    failed = parse_log("llama_model_loader: loaded meta data with 35 key-value pairs and 579 tensors from /m/x.gguf\n"
                       "load_tensors: offloaded 33/33 layers to GPU\n"
                       "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9000.00 MiB on device 0: cudaMalloc failed: out of memory\n"
                       "llama_model_load: error loading model: unable to allocate CUDA0 buffer\n")
    assert len(failed.loads) == 1 and failed.oom
    assert (failed.layers_offloaded, failed.n_ctx) == (33, None)
    assert parse_log("").loads == () and parse_log("llama_perf_context_print: eval time = 1.00 ms / 1 runs "
                                                   "(1.00 ms per token, 1000.00 tokens per second)\n").loads == ()


def test_split_gguf_buffers_of_one_pass_are_summed() -> None:
    text = ("load_tensors: offloaded 0/95 layers to GPU\n"
            + "load_tensors:   CPU_Mapped model buffer size = 47091.25 MiB\n"
            + "load_tensors:   CPU_Mapped model buffer size = 42166.10 MiB\n")
    assert parse_log(text).model_buffers == {"CPU_Mapped": round(47091.25 * MiB) + round(42166.10 * MiB)}


def test_swa_model_two_kv_caches_add_up() -> None:
    text = """\
llama_context: n_ctx         = 8192
llama_kv_cache_iswa: creating non-SWA KV cache, size = 8192 cells
llama_kv_cache:      CUDA0 KV buffer size =   256.00 MiB
llama_kv_cache: size =  256.00 MiB (  8192 cells,   8 layers,  1/1 seqs), K (f16):  128.00 MiB, V (f16):  128.00 MiB
llama_kv_cache_iswa: creating     SWA KV cache, size = 1536 cells
llama_kv_cache:      CUDA0 KV buffer size =   120.00 MiB
llama_kv_cache: size =  120.00 MiB (  1536 cells,  40 layers,  1/1 seqs), K (f16):   60.00 MiB, V (f16):   60.00 MiB
"""
    r = parse_log(text)
    assert r.kv_buffers == {"CUDA0": 376 * MiB}
    assert r.kv_size == 376 * MiB
    assert r.n_ctx == 8192


# ---------------------------------------------------------------------------------------------
# Speed
# ---------------------------------------------------------------------------------------------

def test_sampler_tps_is_never_eval_tps() -> None:
    r = parse_log("llama_perf_sampler_print:    sampling time =      22.49 ms /   204 runs   "
                  "(    0.11 ms per token,  9069.49 tokens per second)\n"
                  "llama_print_timings:      sample time =      14.92 ms /    40 runs   "
                  "(    0.37 ms per token,  2681.14 tokens per second)\n")
    assert r.eval_tps is None and r.prompt_tps is None


def test_print_timings_2023() -> None:
    r = parse_log("llama_print_timings:        load time =    1234.93 ms\n"
                  "llama_print_timings:      sample time =      14.92 ms /    40 runs   (    0.37 ms per token,  2681.14 tokens per second)\n"
                  "llama_print_timings: prompt eval time =    1234.81 ms /    15 tokens (   82.32 ms per token,    12.15 tokens per second)\n"
                  "llama_print_timings:        eval time =    3000.00 ms /    39 runs   (   76.92 ms per token,    13.00 tokens per second)\n")
    assert (r.prompt_tps, r.eval_tps) == (pytest.approx(12.15), pytest.approx(13.00))


def test_server_timings_next_line_and_same_line() -> None:
    nxt = ("slot print_timing: id  0 | task 0 |\n"
           "prompt eval time =     713.89 ms /    20 tokens (   35.69 ms per token,    28.02 tokens per second)\n"
           "       eval time =    3163.91 ms /    48 tokens (   65.91 ms per token,    15.17 tokens per second)\n"
           "      total time =    3877.80 ms /    68 tokens\n")
    r = parse_log(nxt)
    assert (r.prompt_tps, r.eval_tps) == (pytest.approx(28.02), pytest.approx(15.17))
    same = ("318.00.524.330 I slot print_timing: id  0 | task 409 | n_decoded =    701, tg =  32.83 t/s, tg_3s =  32.64 t/s\n"
            "318.00.524.338 I slot print_timing: id  0 | task 409 | prompt eval time =    6265.20 ms /  4113 tokens (    1.52 ms per token,   656.48 tokens per second)\n"
            "318.00.524.341 I slot print_timing: id  0 | task 409 |        eval time =   24270.43 ms /   784 tokens (   30.96 ms per token,    32.30 tokens per second)\n")
    r = parse_log(same)
    assert (r.prompt_tps, r.eval_tps) == (pytest.approx(656.48), pytest.approx(32.30))


def test_progress_tg_is_not_a_final_rate() -> None:
    r = parse_log("slot print_timing: id  0 | task 409 | n_decoded =    501, tg =  32.79 t/s, tg_3s =  33.19 t/s\n"
                  "slot update_slots: id  0 | task 1 | prompt processing, n_tokens =   512, progress = 0.50, t =   1.00 s / 512.00 tokens per second\n")
    assert r.eval_tps is None and r.prompt_tps is None


def test_server_json_timings() -> None:
    compact = ('{"choices":[{"text":"hi"}],"timings":{"prompt_n":14,"prompt_ms":149.75,"prompt_per_token_ms":10.7,'
               '"prompt_per_second":93.49,"predicted_n":189,"predicted_ms":4173.56,"predicted_per_token_ms":22.08,'
               '"predicted_per_second":45.29}}\n')
    r = parse_log(compact)
    assert (r.prompt_tps, r.eval_tps) == (pytest.approx(93.49), pytest.approx(45.29))
    pretty = json.dumps({"timings": {"prompt_per_second": 1.5e2, "predicted_per_second": 33.25}}, indent=2)
    r = parse_log(pretty)
    assert (r.prompt_tps, r.eval_tps) == (pytest.approx(150.0), pytest.approx(33.25))


def test_server_json_timings_after_a_long_body() -> None:
    # a response body far longer than any log line: the timings at its end are still read
    body = '{"content":"' + "word " * 20000 + '","timings":{"prompt_per_second":12.5,"predicted_per_second":3.25}}'
    r = parse_log(body + "\n")
    assert (r.prompt_tps, r.eval_tps) == (12.5, 3.25)
    # wherever an over-long line is cut for message parsing, a number cut in half is not read
    for pad in range(8140, 8200):
        r = parse_log('{"content":"' + "x" * pad + '","timings":{"prompt_per_second":12.5,"predicted_per_second":3.25}}')
        assert (r.prompt_tps, r.eval_tps) == (12.5, 3.25), pad


def test_2024_server_json_log_lines() -> None:
    text = ('{"tid":"1","timestamp":1,"level":"INFO","function":"print_timings","line":1,'
            '"msg":"prompt eval time     =     100.00 ms /    10 tokens (   10.00 ms per token,   100.00 tokens per second)","id_slot":0}\n'
            '{"tid":"1","timestamp":1,"level":"INFO","function":"print_timings","line":2,'
            '"msg":"generation eval time =    1000.00 ms /    25 runs   (   40.00 ms per token,    25.00 tokens per second)","id_slot":0}\n'
            '{"build":2750,"commit":"0d56246f","function":"main","level":"INFO","line":1,"msg":"build info","tid":"1","timestamp":1}\n'
            '{"type":"log","time":1,"level":"ERROR","msg":"llama_model_load: error loading model: unable to allocate CUDA0 buffer\\n"}\n')
    r = parse_log(text)
    assert (r.prompt_tps, r.eval_tps) == (pytest.approx(100.0), pytest.approx(25.0))
    assert r.build == "2750 (0d56246f)"
    assert r.oom is True
    assert r.errors == ("llama_model_load: error loading model: unable to allocate CUDA0 buffer",)


# ---------------------------------------------------------------------------------------------
# Out of memory and failure lines
# ---------------------------------------------------------------------------------------------

def test_rpc_oom_lines() -> None:
    text = """\
load_tensors: loading model tensors, this can take a while... (mmap = true)
alloc_tensor_range: failed to allocate RPC0[127.0.0.1:50052] buffer of size 8589934592
llama_model_load: error loading model: unable to allocate RPC0[127.0.0.1:50052] buffer
llama_model_load_from_file_impl: failed to load model
"""
    r = parse_log(text)
    assert r.oom is True
    assert r.errors == (
        "alloc_tensor_range: failed to allocate RPC0[127.0.0.1:50052] buffer of size 8589934592",
        "llama_model_load: error loading model: unable to allocate RPC0[127.0.0.1:50052] buffer",
        "llama_model_load_from_file_impl: failed to load model",
    )


def test_rpc_weights_are_accelerator_weights() -> None:
    r = parse_log("load_tensors: offloaded 33/33 layers to GPU\n"
                  "load_tensors: RPC0[127.0.0.1:50052] model buffer size =  3000.00 MiB\n"
                  "load_tensors:        CUDA0 model buffer size =  1000.00 MiB\n"
                  "load_tensors:   CPU_Mapped model buffer size =   281.81 MiB\n")
    assert r.device_weights == {"RPC0[127.0.0.1:50052]": 3000 * MiB, "CUDA0": 1000 * MiB}


@pytest.mark.parametrize("line", [
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1024.00 MiB on device 0: cudaMalloc failed: out of memory",
    "CUDA error: out of memory",
    "CUDA error 2 at /llama.cpp/ggml-cuda.cu:7046: out of memory",
    "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1024.00 MiB on device 0: hipMalloc failed: out of memory",
    "ggml_vulkan: Device memory allocation of size 4294967296 failed.",
    "vk::Device::allocateMemory: ErrorOutOfDeviceMemory",
    "ggml_metal_buffer_init: error: failed to allocate buffer, size =  4096.00 MiB",
    "error: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)",
    "ggml_backend_sycl_buffer_type_alloc_buffer: can't allocate 4294967296 Bytes of memory on device",
    "alloc_tensor_range: failed to allocate CPU buffer of size 68719476736",
    "ggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 378281271296",
    "llama_model_load: error loading model: unable to allocate CUDA0 buffer",
    "llama_new_context_with_model: failed to allocate compute buffers",
    "terminate called after throwing an instance of 'std::bad_alloc'",
    "llama_model_load: error loading model: mmap failed: Cannot allocate memory",
    "ggml_new_object: not enough space in the context's memory pool (needed 1234, available 1000)",
])
def test_oom_wordings(line: str) -> None:
    r = parse_log("load_tensors: offloaded 10/33 layers to GPU\n" + line + "\n")
    assert r.oom is True, line
    assert line in r.errors


@pytest.mark.parametrize("line", [
    "ggml_cuda_host_malloc: failed to allocate 512.00 MiB of pinned memory: out of memory",
    "ggml_vulkan: Failed to allocate pinned memory (vk::Device::allocateMemory: ErrorOutOfDeviceMemory)",
    "warning: failed to mlock 4096-byte buffer (after previously locking 0 bytes): Cannot allocate memory",
    "load_all_data: failed to allocate host buffer for async uploads for device CUDA0",
    "The model answered: my old laptop always ran out of memory when compiling.",
    "ggml_backend_metal_log_allocated_size: warning: current allocated size is greater than the recommended max working set size",
    "error: Caused GPU Timeout Error (00000002:kIOAccelCommandBufferCallbackErrorTimeout)",
])
def test_not_oom(line: str) -> None:
    assert parse_log(line + "\n").oom is False, line


def test_failure_lines_in_order_and_not_metadata() -> None:
    text = """\
print_info: EOS token        = 2 'error failed fatal'
llama_model_loader: - kv  28:  tokenizer.chat_template str = {% if error %}failed{% endif %}
/src/ggml/src/ggml.c:1234: GGML_ASSERT(ctx->mem_buffer != NULL) failed
llama_init_from_model: failed to initialize the context: unsupported
0.00.100.000 E common_init_from_params: failed to create context with model 'x.gguf'
0.00.100.001 E llama_decode: n_tokens == 0
0.00.100.002 I llama_decode: n_tokens == 0
Segmentation fault (core dumped)
"""
    r = parse_log(text)
    assert r.errors == (
        "/src/ggml/src/ggml.c:1234: GGML_ASSERT(ctx->mem_buffer != NULL) failed",
        "llama_init_from_model: failed to initialize the context: unsupported",
        "common_init_from_params: failed to create context with model 'x.gguf'",
        "llama_decode: n_tokens == 0",  # only the "E" level says so; the "I" copy is not an error
        "Segmentation fault (core dumped)",
    )
    assert r.oom is False


def test_repeated_failures_are_collapsed_and_capped() -> None:
    same = parse_log("update_slots: failed to find free space in the KV cache\n" * 500)
    assert same.errors == ("update_slots: failed to find free space in the KV cache",)
    many = parse_log("".join(f"decode: failed to decode batch {i}\n" for i in range(5000)) + "Aborted\n")
    assert len(many.errors) < 5000
    assert many.errors[0] == "decode: failed to decode batch 0"  # the cause
    assert many.errors[-1] == "Aborted"                        # and how it ended


def test_docker_prefixed_oom_keeps_message_verbatim() -> None:
    r = parse_log("ollama  | ggml_backend_cuda_buffer_type_alloc_buffer: allocating 35533.34 MiB on device 0: cudaMalloc failed: out of memory\n"
                  "ollama  | llama_model_load: error loading model: unable to allocate CUDA0 buffer\n"
                  "ollama  | \n")
    assert r.oom
    assert r.errors[0].startswith("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 35533.34 MiB")
    assert len(r.errors) == 2


# ---------------------------------------------------------------------------------------------
# Layers: counted from assignment lines; offload that did not really happen
# ---------------------------------------------------------------------------------------------

def _assignments(devs: list[str]) -> str:
    return "".join(f"load_tensors: layer {i:3d} assigned to device {d}, is_swa = 0\n" for i, d in enumerate(devs))


def test_cpu_only_build_counts_assignment_lines() -> None:
    # a CPU-only build prints no "offloaded" line; every layer (0..n_layer, the last being the
    # output layer) is assigned to CPU
    text = ("print_info: n_layer          = 8\n" + _assignments(["CPU"] * 9)
            + "load_tensors:          CPU model buffer size =   500.00 MiB\n")
    r = parse_log(text)
    assert (r.layers_offloaded, r.layers_total) == (0, 9)
    assert r.partial_offload is False  # nothing offloaded is a CPU run, not partial offload


def test_assignment_lines_count_accelerator_layers() -> None:
    text = _assignments(["CPU"] * 5 + ["CUDA0"] * 3 + ["CUDA1"] * 2) + "load_tensors: offloading output layer to GPU\n"
    r = parse_log(text)
    assert (r.layers_offloaded, r.layers_total) == (5, 10)


def test_assignment_lines_incomplete_are_not_counted() -> None:
    # a gap (layer 3 missing): not every layer is listed, so no count
    devs = ["CPU"] * 6
    text = "".join(f"load_tensors: layer {i:3d} assigned to device {d}, is_swa = 0\n"
                   for i, d in enumerate(devs) if i != 3) + "load_tensors: CPU model buffer size = 1.00 MiB\n"
    assert parse_log(text).layers_offloaded is None
    # cut off at the end (nothing follows the block, n_layer unknown): could be missing layers
    assert parse_log(_assignments(["CPU"] * 6)).layers_offloaded is None
    # n_layer says 8 layers (9 with output) but only 6 are listed
    assert parse_log("print_info: n_layer = 8\n" + _assignments(["CPU"] * 6)).layers_offloaded is None


def test_offload_line_wins_over_assignment_count() -> None:
    text = _assignments(["CPU"] * 2 + ["CUDA0"] * 2) + "load_tensors: offloaded 2/4 layers to GPU\n"
    assert parse_log(text).layers_offloaded == 2


def test_offload_claimed_but_everything_on_cpu() -> None:
    # CUDA build, CUDA init failed: still "offloaded 9/9", but only CPU_Mapped weights
    text = ("ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected\n"
            "load_tensors: offloading 8 repeating layers to GPU\n"
            "load_tensors: offloaded 9/9 layers to GPU\n"
            "load_tensors:   CPU_Mapped model buffer size =   400.00 MiB\n")
    r = parse_log(text)
    assert r.layers_offloaded == 9
    assert r.effective_layers_offloaded == 0
    assert r.offload_fell_back is True
    assert r.errors == ("ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected",)


def test_real_offload_is_effective() -> None:
    r = parse_log(MODERN)
    assert r.effective_layers_offloaded == 20 and r.offload_fell_back is False
    assert parse_log("load_tensors: offloaded 9/9 layers to GPU\n").effective_layers_offloaded == 9  # no buffers: can't tell


# ---------------------------------------------------------------------------------------------
# Older eras, device names, free memory, build
# ---------------------------------------------------------------------------------------------

def test_2023_vram_used_and_metal_add_buffer() -> None:
    cuda = ("llm_load_tensors: mem required  =  86.04 MB\n"
            "llm_load_tensors: offloaded 35/35 layers to GPU\n"
            "llm_load_tensors: VRAM used: 4474.93 MB\n"
            "llama_new_context_with_model: total VRAM used: 6122.95 MB (model: 4474.93 MB, context: 1648.02 MB)\n")
    r = parse_log(cuda)
    assert r.model_buffers == {"mem required (host)": round(86.04 * MiB), "VRAM used": round(4474.93 * MiB)}
    assert r.device_weights == {"VRAM": round(4474.93 * MiB)}
    dec2023 = ("llm_load_tensors: system memory used  = 5506.41 MiB\n"
               "llm_load_tensors: VRAM used           = 1701.95 MiB\n"
               "llm_load_tensors: offloaded 10/41 layers to GPU\n")
    r = parse_log(dec2023)
    assert r.model_buffers["VRAM used"] == round(1701.95 * MiB)
    assert r.layers_offloaded == 10
    metal = ("llm_load_tensors: VRAM used: 0.00 MB\n"
             "ggml_metal_add_buffer: allocated 'data            ' buffer, size =  4096.00 MB, offs =            0\n"
             "ggml_metal_add_buffer: allocated 'data            ' buffer, size =  3533.78 MB, offs = 4150263808, ( 7630.41 / 10922.67)\n"
             "ggml_metal_add_buffer: allocated 'kv              ' buffer, size =   400.02 MB, ( 8030.43 / 10922.67)\n"
             "ggml_metal_add_buffer: allocated 'alloc           ' buffer, size =    80.02 MB, ( 8110.45 / 10922.67)\n")
    r = parse_log(metal)
    assert r.model_buffers["Metal"] == round(4096 * MiB) + round(3533.78 * MiB)
    assert r.device_weights == {"Metal": r.model_buffers["Metal"]}  # VRAM 0.00 superseded by Metal
    assert r.kv_buffers == {"Metal": round(400.02 * MiB)}
    assert r.compute_buffers == {"Metal": round(80.02 * MiB)}


def test_device_name_normalisation() -> None:
    r = parse_log("load_tensors:  MTL0_Mapped model buffer size = 14803.73 MiB\n"
                  "load_tensors: Metal_Mapped model buffer size =   372.45 MiB\n"
                  "load_tensors:   CPU_REPACK model buffer size =   100.00 MiB\n"
                  "load_tensors:          AMX model buffer size =    50.00 MiB\n"
                  "load_tensors:    CUDA_Host model buffer size =    10.00 MiB\n"
                  "load_tensors:      ROCm0 model buffer size =    20.00 MiB\n")
    assert r.device_weights == {"MTL0": round(14803.73 * MiB), "Metal": round(372.45 * MiB), "ROCm0": 20 * MiB}
    assert "MTL0_Mapped" in r.model_buffers  # labels stay as printed in model_buffers


def test_free_memory_from_device_lines_and_breakdown_table() -> None:
    text = ("llama_model_load_from_file_impl: using device CUDA0 (NVIDIA GeForce RTX 4090) (0000:01:00.0) - 23000 MiB free\n"
            "llama_memory_breakdown_print: | memory breakdown [MiB] | total   free     self   model   context   compute    unaccounted |\n"
            "llama_memory_breakdown_print: |   - CUDA0 (RTX 4090)   | 24077 =  945 + (19187 = 17904 +     384 +     898) +        3945 |\n"
            "llama_memory_breakdown_print: |   - CUDA1 (RTX 3090)   | 24000 = 1000 + (20000 = 19000 +     500 +     500) +        3000 |\n"
            "llama_memory_breakdown_print: |   - Host               |                 58271 = 58259 +       0 +      12                |\n")
    r = parse_log(text)
    # the pre-load figure wins for CUDA0; the table fills in CUDA1; Host is not a device
    assert r.devices == {"CUDA0": 23000 * MiB, "CUDA1": 1000 * MiB}


@pytest.mark.parametrize("line,build", [
    ("build: 5622 (abc1234) with cc (GCC) 13.3.0 for x86_64-linux-gnu", "5622 (abc1234)"),
    ("main: build = 1971 (1182cf4d)", "1971 (1182cf4d)"),
    ("common_params_print_info: build 7000 (4341dc8bc) with cc for x86_64", "7000 (4341dc8bc)"),
    ("build: 97340b4c (5622)", "5622 (97340b4c)"),        # llama-bench footer: commit first
    ("version: b7000 (build 7000, commit 4341dc8bc)", "7000 (4341dc8bc)"),
    ("llama.cpp build 1234", "1234"),
])
def test_build(line: str, build: str) -> None:
    assert parse_log(line + "\n").build == build


def test_n_ctx_fallbacks() -> None:
    # no "n_ctx =" line: the KV cache size in cells says it
    assert parse_log("llama_kv_cache: size = 78080.00 MiB ( 16384 cells,  61 layers,  1/1 seqs), "
                     "K (f16): 46848.00 MiB, V (f16): 31232.00 MiB\n").n_ctx == 16384
    # non-unified KV (2026): the cells are per stream, "4/4 seqs" = 4 sequences in 4 streams
    assert parse_log("llama_kv_cache: size = 2048.00 MiB (  4096 cells,  32 layers,  4/4 seqs), "
                     "K (f16): 1024.00 MiB, V (f16): 1024.00 MiB\n").n_ctx == 16384
    assert parse_log("llama_kv_cache_unified: size = 2048.00 MiB ( 16384 cells,  32 layers,  4 seqs), "
                     "K (f16): 1024.00 MiB, V (f16): 1024.00 MiB\n").n_ctx == 16384
    assert parse_log("llama_context: n_ctx_seq (4096) < n_ctx_train (32768) -- the full capacity\n").n_ctx == 4096
    assert parse_log("common_init_from_params: setting dry_penalty_last_n to ctx_size = 2048\n").n_ctx == 2048
    # llama-cli's "generate: n_ctx" must not start a new context or override the context line
    r = parse_log("llama_context: n_ctx = 8192\nllama_context: CPU compute buffer size = 1.00 MiB\n"
                  "generate: n_ctx = 4096, n_batch = 2048, n_predict = -1, n_keep = 0\n")
    assert r.n_ctx == 8192 and r.compute_buffers == {"CPU": MiB}


# ---------------------------------------------------------------------------------------------
# Output helpers
# ---------------------------------------------------------------------------------------------

def test_to_dict_is_json_ready_and_complete() -> None:
    r = parse_log(MODERN + "llama_init_from_model: failed to initialize the context: boom\n")
    d = r.to_dict()
    json.dumps(d)
    assert set(d) == {"layers_offloaded", "layers_total", "oom", "model_buffers", "kv_buffers", "compute_buffers",
                      "kv_size", "type_k", "type_v", "n_ctx", "devices", "prompt_tps", "eval_tps", "build", "errors", "processor_split", "notes",
                      "loads"}
    assert d["errors"] == ["llama_init_from_model: failed to initialize the context: boom"]
    assert len(d["loads"]) == 1 and d["loads"][0]["n_ctx"] == 8192 and d["loads"][0]["kv_size"] == 1024 * MiB
    loads = tuple(ModelLoad(**load) for load in d["loads"])
    assert LoadReport(**{**d, "errors": tuple(d["errors"]), "notes": tuple(d["notes"]), "loads": loads}) == r


def test_format_report() -> None:
    r = parse_log(MODERN + "llama_init_from_model: failed to initialize the context: boom\n")
    text = format_report(r)
    assert "20/33" in text and "partial offload" in text
    assert "CUDA0 2500.25 MiB" in text
    assert "n_ctx 8192" in text
    assert "45.29" in text and "93.49" in text
    assert "failed to initialize the context" in text
    assert "not in log" in format_report(LoadReport())
    oom = format_report(parse_log("CUDA error: out of memory\n"))
    assert "OUT OF MEMORY" in oom


def test_partial_offload_property() -> None:
    assert LoadReport(layers_offloaded=33, layers_total=33).partial_offload is False
    assert LoadReport(layers_offloaded=10, layers_total=33).partial_offload is True
    assert LoadReport(layers_offloaded=0, layers_total=33).partial_offload is False
    assert LoadReport().partial_offload is None


def test_parse_log_command_reads_a_file_and_stdin() -> None:
    import json as _json

    from click.testing import CliRunner

    from tuner.cli.main import cli

    path = LOGS / "11_early2024-cuda-partial-10of33-mixtral-imatrix.log"
    result = CliRunner().invoke(cli, ["parse-log", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = _json.loads(result.output)
    assert (data["layers_offloaded"], data["layers_total"]) == (10, 33)
    text = CliRunner().invoke(cli, ["parse-log", "-"], input=path.read_text(encoding="utf-8", errors="replace"))
    assert text.exit_code == 0 and "10/33 offloaded (partial offload!)" in text.output


# ---------------------------------------------------------------------------------------------
# Hostile input: fuzzing, absurd numbers, and time linear in the input
# ---------------------------------------------------------------------------------------------

# Numbers a parser must not trust: 400 digits, overflow to inf, not a number, negative, huge floats.
HOSTILE_NUMBERS = ["9" * 400, "1" + "0" * 400 + ".5", "1e400", "NaN", "nan", "inf", "-inf", "-1", "-0.0",
                   "9" * 30, "18446744073709551616", "1" * 4400, "0.000", "1,2,3", "9" * 308 + ".9"]
_NUMBER = __import__("re").compile(r"\d+(?:[.,]\d+)?")
_MAX_BYTES = 1 << 60


@__import__("functools").lru_cache(maxsize=1)
def _real_lines() -> tuple[str, ...]:
    lines = [line for path in sorted(LOGS.glob("*.log")) for line in _read(path.name).splitlines() if line.strip()]
    return tuple(lines + MODERN.splitlines() + FIT_PASS.splitlines())


def _mutate(line: str, rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 0:  # every number hostile
        return _NUMBER.sub(lambda m: rng.choice(HOSTILE_NUMBERS), line)
    if kind == 1:  # characters inserted, deleted, replaced
        chars = list(line)
        for _ in range(rng.randrange(1, 8)):
            at = rng.randrange(len(chars) + 1)
            op = rng.randrange(3)
            if op == 0:
                chars.insert(at, chr(rng.choice([rng.randrange(32, 127), rng.randrange(0, 0x3000), 0, 27, 13])))
            elif chars and at < len(chars):
                if op == 1:
                    del chars[at]
                else:
                    chars[at] = rng.choice(":|[]()=/.,-_ \t\"'{}\\")
        return "".join(chars)
    if kind == 2:  # a stack of carrier prefixes
        prefixes = list(PREFIXES.values())
        return "".join(rng.choice(prefixes)(rng.randrange(60)) for _ in range(rng.randrange(1, 5))) + line
    if kind == 3:  # glued to the next message, or cut anywhere
        other = rng.choice(_real_lines())
        return line[: rng.randrange(len(line) + 1)] + rng.choice(["", ")", "...", "\r", "\x00", " | "]) + other
    if kind == 4:  # wrapped the way structured carriers write it
        body = line.replace("\\", "\\\\").replace('"', '\\"')
        return rng.choice([f'{{"level":"ERROR","msg":"{body}"}}', f'time=x level=ERROR msg="{body}', f'{{"msg": "{body}',
                           f"time=2025-01-01T00:00:00Z level=INFO msg={body}", f' ERR [{body[:24]:>24}] {body} | tid="1"'])
    if kind == 5:  # a segment repeated many times
        if not line:
            return line
        a = rng.randrange(len(line))
        b = min(len(line), a + rng.randrange(1, 40))
        return line[:a] + line[a:b] * rng.randrange(2, 200) + line[b:]
    return line.upper() if rng.random() < 0.5 else line.replace(" ", "")


def _fuzz_inputs(count: int = 10_000) -> list[str | bytes]:
    rng = random.Random(20260609)
    real = _real_lines()
    inputs: list[str | bytes] = [
        # a few 1 MB lines: noise, digits, a JSON body, a line of one repeated message
        rng.randbytes(1 << 21).decode("utf-16-le", errors="replace").replace("\n", " ")[: 1 << 20],
        "llama_context: n_ctx = " + "9" * (1 << 20),
        '{"content":"' + "x" * (1 << 20) + '","timings":{"prompt_per_second":NaN,"predicted_per_second":1e400}}',
        "load_tensors: CUDA0 model buffer size = 12.00 MiB " * (1 << 20 // 48),
        rng.randbytes(1 << 20),
    ]
    while len(inputs) < count:
        kind = rng.randrange(4)
        if kind == 0:
            inputs.append(rng.randbytes(rng.randrange(300)))
        elif kind == 1:
            inputs.append(_mutate(rng.choice(real), rng))
        elif kind == 2:  # a small log: real lines, some mutated, any line ending
            lines = [rng.choice(real) for _ in range(rng.randrange(2, 30))]
            lines = [_mutate(line, rng) if rng.random() < 0.3 else line for line in lines]
            inputs.append(rng.choice(["\n", "\r\n", "\r", "\n\n"]).join(lines))
        else:
            inputs.append(rng.choice(real).replace(rng.choice("0123456789"), rng.choice(HOSTILE_NUMBERS)))
    return inputs


def _check_sane(report: LoadReport) -> None:
    """What a caller may rely on, whatever the input was."""
    assert isinstance(report, LoadReport)
    json.dumps(report.to_dict(), allow_nan=False)  # no NaN, no inf, nothing unserialisable
    format_report(report)  # formats every figure (a 400-digit one raised OverflowError here)
    for load in (report, *report.loads):
        for sizes in (load.model_buffers, load.kv_buffers, load.compute_buffers):
            assert all(isinstance(v, int) and 0 <= v <= _MAX_BYTES for v in sizes.values()), sizes
        assert load.kv_size is None or 0 <= load.kv_size <= _MAX_BYTES
        for count in (load.layers_offloaded, load.layers_total, load.n_ctx):
            assert count is None or 0 <= count < 10 ** 15
    assert all(0 <= v <= _MAX_BYTES for v in report.devices.values())
    for rate in (report.prompt_tps, report.eval_tps):
        assert rate is None or 0 <= rate <= 1e9


def test_fuzz_10000_inputs_never_raise_and_give_sane_reports() -> None:
    inputs = _fuzz_inputs()
    assert len(inputs) == 10_000
    for i, text in enumerate(inputs):
        try:
            _check_sane(parse_log(text))  # type: ignore[arg-type]
        except Exception as exc:  # pragma: no cover - the message says which input
            raise AssertionError(f"input {i} ({text[:200]!r}...): {type(exc).__name__}: {exc}") from exc


@pytest.mark.parametrize("line", [
    "llama_model_load_from_file_impl: using device CUDA0 (NVIDIA) - " + "9" * 400 + " MiB free",
    "load_tensors:        CUDA0 model buffer size = " + "9" * 400 + ".00 MiB",
    "load_tensors:        CUDA0 model buffer size = " + "9" * 300 + ".00 GiB",
    "load_tensors: offloaded " + "9" * 400 + "/33 layers to GPU",
    "llama_context: n_ctx         = " + "9" * 400,
    "llama_kv_cache: size = 1.00 MiB (" + "9" * 400 + " cells,  32 layers,  1/1 seqs), K (f16): 1 MiB, V (f16): 1 MiB",
    "llama_perf_context_print:        eval time =    0.00 ms / " + "9" * 400 + " runs   (    0.00 ms per token,      inf tokens per second)",
    "load_tensors:        CUDA0 model buffer size = -12.00 MiB",
    "build: " + "9" * 400 + " (abcdef12) with cc for x86_64",
])
def test_absurd_numbers_are_not_read(line: str) -> None:
    r = parse_log(line + "\n")
    _check_sane(r)
    assert r.model_buffers == {} and r.devices == {} and r.layers_offloaded is None and r.n_ctx is None
    assert r.eval_tps is None and r.build is None


def test_an_absurd_rate_is_worked_out_from_the_time_and_count() -> None:
    r = parse_log("llama_perf_context_print:        eval time =    2.00 ms /     1 runs   (    2.00 ms per token, "
                  + "9" * 400 + ".00 tokens per second)\n")
    assert r.eval_tps == 500.0  # 1 run in 2 ms


def test_parse_log_command_on_a_400_digit_number_prints_the_report(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from tuner.cli.main import cli

    log = tmp_path / "huge.log"
    log.write_text("llama_model_load_from_file_impl: using device CUDA0 (NVIDIA) - " + "9" * 400 + " MiB free\n"
                   "load_tensors: offloaded 20/33 layers to GPU\n", encoding="utf-8")
    for args in ([str(log)], [str(log), "--json"]):
        result = CliRunner().invoke(cli, ["parse-log", *args])
        assert result.exit_code == 0, result.output
        assert "20" in result.output and "9999" not in result.output


# Lines built to make a backtracking regex go quadratic (or worse) if one ever could: the same
# pattern start over and over in one 8 KB line, unclosed quotes, long runs of spaces or digits.
_W = 8000
PATHOLOGICAL = {
    "oom-phrase": "alloc_tensor_range: " + "failed to allocate " * (_W // 19),
    "using-device": "llama_model_load_from_file_impl: " + "using device CUDA0 (" * (_W // 20),
    "breakdown": "llama_memory_breakdown_print: | - CUDA0 (" * (_W // 40),
    "glue-word": "x)" + "llama_" * (_W // 6) + ": y",
    "glue-srv": "xsrv " * (_W // 5) + ": ",
    "build-spaces": "build" + " " * _W + "1 (abcd)",
    "build-digits": "build " + "9" * _W,
    "slog-msgs": "time=x level=INFO " + " msg=" * (_W // 5),
    "slog-unclosed": 'time=x level=INFO msg="' + "\\" * _W,
    "json-unclosed": '{"msg"' + ': "' * (_W // 3),
    "func-colons": "a: " * (_W // 3),
    "error-words": "a" * 80 + ": " + "error " * (_W // 6),
    "brackets": "[" * _W,
    "prefixes": "2026-06-09 08:10:09.538 | " * (_W // 26),
    "compose": "a " * (_W // 2) + "|",
    "ansi": "\x1b[" + "1" * _W,
    "kv-size": "llama_kv_cache: size = 1 MiB (1 cells, 1 layers, 1" + " " * _W,
    "syslog": "<1>1 " + "a " * (_W // 2),
    "loads": "llama_model_loader: loaded meta data with 1 key-value pairs\nload_tensors: offloaded 1/1 layers to GPU",
}


def test_pathological_lines_take_linear_time() -> None:
    # 50 copies of each (~7 MB in all). Linear code reads them in seconds even on a busy CI
    # machine; one quadratic regex would take minutes. The bound is generous on purpose: this
    # test catches a blow-up, benchmarks/logparse_speed.py measures speed.
    import time

    started = time.monotonic()
    for name, line in PATHOLOGICAL.items():
        r = parse_log((line + "\n") * 50)
        _check_sane(r)
    assert time.monotonic() - started < 120


# ---------------------------------------------------------------------------------------------
# Ollama's own engine (Go slog key=value lines), `ollama ps`, and other shapes people paste
# (tests/logs/written/README.md: these lines were written here from Ollama's and llama.cpp's sources)
# ---------------------------------------------------------------------------------------------

WRITTEN = LOGS / "written"
GiB = 1024 * MiB

# Ollama's prefixes: none, journald, docker compose, docker --timestamps
_OLLAMA_PREFIXES = ["", "Jun 12 09:14:02 box ollama[1843]: ", "ollama-1  | ", "2026-03-02T18:40:12.611412345Z "]


@pytest.mark.parametrize("prefix", _OLLAMA_PREFIXES)
@pytest.mark.parametrize("field, source", [("buffer", "ggml.go:405"), ("device", "device.go:240")])
@pytest.mark.parametrize("size, expected", [("11.9 GiB", round(11.9 * GiB)), ("457.0 MiB", 457 * MiB), ("2.2 MiB", round(2.2 * MiB)),
                                            ("512.0 KiB", 512 * 1024), ("512 B", 512)])
def test_ollama_memory_lines_every_form_unit_and_prefix(prefix, field, source, size, expected):
    head = f"{prefix}time=2026-03-02T18:40:12.611Z level=INFO source="
    text = (f'{head}ggml.go:502 msg="offloaded 41/41 layers to GPU"\n'
            f'{head}{source} msg="model weights" {field}=CUDA1 size="{size}"\n'
            f'{head}{source} msg="model weights" {field}=CPU size="3.3 GiB"\n')
    if field == "device":
        text += (f'{head}device.go:251 msg="kv cache" device=CUDA1 size="{size}"\n'
                 f'{head}device.go:262 msg="compute graph" device=CUDA1 size="{size}"\n'
                 f'{head}device.go:272 msg="total memory" size="4.7 GiB"\n')
    else:
        text += f'{head}ggml.go:801 msg="compute graph" backend=CUDA1 buffer_type=CUDA1 size="{size}"\n'
    text += (f'{head}sched.go:491 msg="gpu memory" id=GPU-5c0d library=CUDA available="3.3 GiB" free="{size}" '
             'minimum="457.0 MiB" overhead="0 B"\n')
    r = parse_log(text)
    assert r.model_buffers == {"CUDA1": expected, "CPU": round(3.3 * GiB)}
    assert r.compute_buffers == {"CUDA1": expected}
    assert r.kv_buffers == ({"CUDA1": expected} if field == "device" else {})
    assert r.devices == {"CUDA0": expected}  # the scheduler's first CUDA GPU
    assert (r.layers_offloaded, r.layers_total) == (41, 41) and r.cpu_only is False
    assert r.notes and "Ollama" in r.notes[0] and "rounded" in r.notes[0]
    assert "rounded" in format_report(r)


def test_ollama_written_logs():
    r = parse_log((WRITTEN / "ollama-2025-ggml-buffer-2xcuda-journald.log").read_text())
    assert r.device_weights == {"CUDA0": round(9.6 * GiB), "CUDA1": round(11.9 * GiB)}
    # the 2025 "gpu memory" line names no library: its GPUs take the buffers' backend
    assert r.devices == {"CUDA0": round(23.1 * GiB), "CUDA1": round(23.5 * GiB)}
    assert r.compute_buffers == {"CUDA0": round(1.1 * GiB), "CUDA1": round(1.1 * GiB), "CPU": round(2.2 * MiB)}
    assert r.cpu_only is False and r.partial_offload is False
    r = parse_log((WRITTEN / "ollama-2026-device-cuda-partial-docker.log").read_text())
    assert (r.layers_offloaded, r.layers_total, r.partial_offload) == (19, 37, True)
    assert r.kv_buffers == {"CUDA0": 608 * MiB, "CPU": round(1.1 * GiB)} and r.kv_size == 608 * MiB + round(1.1 * GiB)
    assert r.devices == {"CUDA0": round(4.3 * GiB)}


def test_ollama_ps_is_a_partial_offload():
    r = parse_log((WRITTEN / "ollama-ps.txt").read_text())
    assert r.processor_split == {"CPU": 48, "GPU": 52} and r.partial_offload is True and r.cpu_only is False
    assert parse_log("llama3:8b  365c0bd3c000  6.7 GB  100% GPU  4 minutes from now").partial_offload is False
    assert parse_log("llama3:8b  365c0bd3c000  6.7 GB  100% CPU  4 minutes from now").cpu_only is True
    assert "48% CPU / 52% GPU (partial offload!)" in format_report(r)


def test_cpu_only_is_one_fact_over_every_log():
    """A log that offloaded layers (or put anything on an accelerator) is never CPU-only."""
    logs = sorted(LOGS.glob("*.log")) + sorted(WRITTEN.glob("*"))
    seen = {True: 0, False: 0}
    for path in logs:
        if path.suffix == ".md":
            continue
        r = parse_log(path.read_bytes().decode("utf-8", errors="replace"))
        if r.effective_layers_offloaded or any(v > 0 for v in r.device_weights.values()):
            assert r.cpu_only is False, path.name
        if r.cpu_only is not None:
            seen[r.cpu_only] += 1
    assert seen[True] >= 1 and seen[False] >= 10, seen  # both answers occur among real logs


def test_early_2025_init_kv_size_keeps_n_ctx_when_a_second_load_follows():
    r = parse_log((WRITTEN / "early2025-metal-init-kv-size-then-second-load.log").read_text())
    assert r.n_ctx == 4096 and r.type_k == "f16" and r.layers_offloaded == 29
    assert [load.n_ctx for load in r.loads] == [4096, None]


def test_json_log_of_timings_only():
    r = parse_log((WRITTEN / "llama-server-2024-json-timings-only.log").read_text())
    assert (r.prompt_tps, r.eval_tps) == (126.04, 31.83) and r.layers_offloaded is None and not r.loads
