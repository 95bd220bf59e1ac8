"""Real GGUF models made on the spot: random weights, any shape, a tokenizer llama.cpp accepts.

Speed on random weights equals speed on trained weights of the same shape and quantization
(llama.cpp does the same arithmetic either way), so these are honest models to tune on. Tests
and the demo use them; nothing is downloaded.

    path = make_model("/tmp/m.gguf", ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=2))
    q8 = quantize(path, "/tmp/m-q8_0.gguf", "Q8_0")       # llama.cpp's own quantizer

Quantization runs llama.cpp's ``llama_model_quantize`` in a child process (``tuner.model.quantize``),
so the caller never imports llama_cpp.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import TunerError
from .quantize import FTYPES, quantize_file


ARCHITECTURES = ("llama", "gemma3")


@dataclass(frozen=True)
class ModelShape:
    """The shape of a model. ``n_expert > 0`` makes a mixture of experts (llama architecture).

    ``architecture="gemma3"`` makes a Gemma-3-style model (src/models/gemma3.cpp: Q/K norms, norms
    after attention and FFN, the output tied to the token embedding); with ``sliding_window > 0``
    its layers attend to a window of that many tokens, except every ``swa_period``-th layer, which
    attends to the whole context (llama.cpp's ``set_swa_pattern``: layer il slides when
    ``il % swa_period < swa_period - 1``; Gemma 3's period is 6).
    """

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 512
    n_vocab: int = 512
    n_ctx_train: int = 4096
    n_expert: int = 0
    n_expert_used: int = 0
    name: str = "offload-tuner test model"
    architecture: str = "llama"
    sliding_window: int = 0
    swa_period: int = 6

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture must be one of {', '.join(ARCHITECTURES)}, got {self.architecture!r}")
        if self.sliding_window and self.architecture != "gemma3":
            raise ValueError("a sliding window needs architecture='gemma3' (llama has none)")
        if self.n_expert and self.architecture != "llama":
            raise ValueError("experts are made for architecture='llama' only")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})")
        if self.n_vocab < 300:
            raise ValueError(f"n_vocab ({self.n_vocab}) must be at least 300 (3 special + 256 byte tokens + some words)")
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError("an MoE model needs 0 < n_expert_used <= n_expert")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError("the head size (n_embd / n_head) must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# The demo model: big enough that offload and thread choices show up in tokens/sec on 2 cores,
# small enough that a tune over two quantizations finishes in minutes. Widths are multiples of
# 256 so the k-quants (Q4_K_M...) apply to every matrix.
DEMO_SHAPE = ModelShape(
    n_layer=8, n_embd=1024, n_head=16, n_head_kv=4, n_ff=2816, n_vocab=8192, n_ctx_train=8192, name="offload-tuner demo"
)


def _vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style ("llama") vocabulary: specials, the 256 byte tokens, then words."""
    # gguf token types (gguf-py/gguf/constants.py TokenType): NORMAL=1, UNKNOWN=2, CONTROL=3, BYTE=6
    tokens = ["<unk>", "<s>", "</s>"]
    types = [2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    words: list[str] = ["\u2581"] + [f"\u2581{c}" for c in letters] + list(letters)
    i = 0
    while len(tokens) + len(words) < n_vocab:
        a, b = divmod(i, 26 * 26)
        words.append("\u2581" + letters[b // 26] + letters[b % 26] + (letters[a % 26] * (1 + a // 26) if a else ""))
        i += 1
    tokens += words[: n_vocab - len(tokens)]
    types += [1] * (n_vocab - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(n_vocab - 259)]
    return tokens, scores, types


def make_model(
    path: str | os.PathLike[str],
    shape: ModelShape = ModelShape(),
    *,
    seed: int = 0,
    dtype: str = "F16",
    split_max_tensors: int = 0,
    output_std: float = 0.02,
) -> Path:
    """Write a GGUF of ``shape`` (llama or gemma3) with random weights that llama.cpp loads and runs.

    ``split_max_tensors > 0`` writes a split model (``NAME-00001-of-0000N.gguf`` beside ``path``)
    and returns its first part.

    ``output_std`` is the spread of the output head's weights. At the default the logits are
    nearly flat (every next token about equally likely), which is all a speed test needs; a
    quality test wants peaked distributions, as a trained model has: about ``4 / sqrt(n_embd)``
    gives a few likely tokens per position.
    """
    import gguf
    import numpy as np

    if dtype not in ("F16", "F32"):
        raise ValueError("dtype must be F16 or F32 (quantize() makes the rest)")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    np_dtype = np.float16 if dtype == "F16" else np.float32
    s = shape
    arch = s.architecture
    gemma = arch == "gemma3"
    # Written under a temporary name and renamed, so a half-written model is never mistaken
    # for a whole one (a split model is written in place: its part names are fixed).
    tmp = out if split_max_tensors else out.with_name(out.name + ".part")
    writer = gguf.GGUFWriter(str(tmp), arch, split_max_tensors=split_max_tensors)
    writer.add_name(s.name)
    writer.add_block_count(s.n_layer)
    writer.add_context_length(s.n_ctx_train)
    writer.add_embedding_length(s.n_embd)
    writer.add_feed_forward_length(s.n_ff)
    writer.add_head_count(s.n_head)
    writer.add_head_count_kv(s.n_head_kv)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if gemma:
        writer.add_key_length(s.head_dim)
        writer.add_value_length(s.head_dim)
        if s.sliding_window:
            writer.add_sliding_window(s.sliding_window)
            writer.add_sliding_window_pattern(s.swa_period)
            writer.add_rope_freq_base_swa(10000.0)
    else:
        writer.add_vocab_size(s.n_vocab)
    writer.add_file_type(FTYPES[dtype])
    if s.n_expert:
        writer.add_expert_count(s.n_expert)
        writer.add_expert_used_count(s.n_expert_used)
    tokens, scores, types = _vocab(s.n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)

    def weight(*shape_: int, std: float = 0.02) -> "np.ndarray":
        # numpy shape is (rows, cols) = ggml's ne reversed; std 0.02 keeps activations finite.
        return (rng.standard_normal(shape_, dtype=np.float32) * std).astype(np_dtype)

    def norm(n: int) -> "np.ndarray":
        return np.ones(n, dtype=np.float32)  # 1-d tensors stay F32, as converters write them

    q_dim, kv_dim = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
    writer.add_tensor("token_embd.weight", weight(s.n_vocab, s.n_embd))
    for i in range(s.n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm(s.n_embd))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(q_dim, s.n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(kv_dim, s.n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(kv_dim, s.n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(s.n_embd, q_dim))
        if gemma:
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", norm(s.head_dim))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", norm(s.head_dim))
            writer.add_tensor(f"blk.{i}.post_attention_norm.weight", norm(s.n_embd))
            writer.add_tensor(f"blk.{i}.post_ffw_norm.weight", norm(s.n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm(s.n_embd))
        if s.n_expert:
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", (rng.standard_normal((s.n_expert, s.n_embd), dtype=np.float32) * 0.02))
            writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", weight(s.n_expert, s.n_ff, s.n_embd))
            writer.add_tensor(f"blk.{i}.ffn_up_exps.weight", weight(s.n_expert, s.n_ff, s.n_embd))
            writer.add_tensor(f"blk.{i}.ffn_down_exps.weight", weight(s.n_expert, s.n_embd, s.n_ff))
        else:
            writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(s.n_ff, s.n_embd))
            writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(s.n_ff, s.n_embd))
            writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(s.n_embd, s.n_ff))
    writer.add_tensor("output_norm.weight", norm(s.n_embd))
    if not gemma:  # Gemma ties the output head to the token embedding
        writer.add_tensor("output.weight", weight(s.n_vocab, s.n_embd, std=output_std))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        from .gguf import split_parts

        count = len(writer.tensors)
        first = out.with_name(f"{out.stem}-00001-of-{count:05d}.gguf") if count > 1 else out
        return split_parts(first)[0]
    os.replace(tmp, out)
    return out


def quantize(src: str | os.PathLike[str], dst: str | os.PathLike[str], qtype: str = "Q8_0", *, nthread: int = 0) -> Path:
    """Quantize ``src`` into ``dst`` with llama.cpp's own quantizer (``llama_model_quantize``, in a
    child process; ``tuner.model.quantize`` has the cached variants, imatrix and progress)."""
    return quantize_file(src, dst, qtype, nthread=nthread)


def demo_models(folder: str | os.PathLike[str] | None = None, quants: tuple[str, ...] = ("Q8_0", "Q4_K_M")) -> list[Path]:
    """The demo model in each of ``quants``, made once and kept in the data folder."""
    from ..paths import models_dir

    base = Path(folder) if folder else models_dir() / "demo"
    base.mkdir(parents=True, exist_ok=True)
    stamp = base / "shape.json"
    wanted = json.dumps(dataclasses.asdict(DEMO_SHAPE), sort_keys=True)
    if not stamp.exists() or stamp.read_text() != wanted:
        for old in base.glob("*.gguf"):
            old.unlink()
    f16 = base / "demo-F16.gguf"
    if not f16.exists():
        make_model(f16, DEMO_SHAPE)
    out = []
    for q in quants:
        target = base / f"demo-{q}.gguf"
        if not target.exists():
            quantize(f16, target, q)
        out.append(target)
    stamp.write_text(wanted)
    return out


def llama_cpp_source() -> Path | None:
    """The llama.cpp sources matching the installed llama-cpp-python: ``LLAMA_CPP_SOURCE``, or an
    unpacked llama-cpp-python sdist in the temp folder. None if neither is there."""
    import glob
    import tempfile

    candidates = [os.environ.get("LLAMA_CPP_SOURCE", "")]
    candidates += sorted(glob.glob(os.path.join(tempfile.gettempdir(), "llama_cpp_python-*", "vendor", "llama.cpp")))
    for candidate in candidates:
        if candidate and (Path(candidate) / "common" / "arg.h").is_file():
            return Path(candidate)
    return None


def _installed_libdir() -> Path:
    """Where llama-cpp-python installed llama.cpp's shared libraries."""
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"]) / "lib"


def _toolchain() -> tuple[str, Path]:
    """(the C++ compiler, llama-cpp-python's library folder) for a program built against its llama.cpp;
    ``TunerError`` saying which is missing."""
    import shutil

    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise TunerError("no C++ compiler (g++ or c++) on PATH")
    libdir = _installed_libdir()
    if not (libdir / "libllama-common.so").exists():
        raise TunerError(f"{libdir / 'libllama-common.so'} is missing (llama-cpp-python installs it with llama.cpp's common library)")
    return compiler, libdir


def _link_args(libdir: Path, *extra: str) -> list[str]:
    """Linker arguments for llama-cpp-python's libraries (and ``extra`` ones), found without LD_LIBRARY_PATH."""
    # DT_RPATH (not RUNPATH): it applies to libllama-common's own dependencies too.
    rpath = [f"-Wl,-rpath,{libdir}"] + (["-Wl,--disable-new-dtags"] if sys.platform.startswith("linux") else [])
    return [f"-L{libdir}", "-lllama-common", "-lllama", "-lggml", "-lggml-base", *extra, *rpath]


def _require_source(source: Path | None) -> Path:
    """``source`` or the sources found by ``llama_cpp_source``; ``TunerError`` when there are none."""
    source = source or llama_cpp_source()
    if source is None:
        raise TunerError("llama.cpp sources not found: set LLAMA_CPP_SOURCE to an unpacked llama-cpp-python sdist's "
                         "vendor/llama.cpp")
    return source


def build_against_llama_cpp(target: str, sources: list[Path], out_dir: Path, *, source: Path, optimize: str = "-O2",
                            defines: tuple[str, ...] = ()) -> Path:
    """Compile a C++ program (llama-bench, a test harness) against the llama.cpp libraries that
    llama-cpp-python installed (``libllama``, ``libggml*``, ``libllama-common``).

    The binary finds those libraries by itself (an RPATH that also serves the libraries' own
    dependencies), so it runs like a user's installed llama.cpp, without LD_LIBRARY_PATH.
    Raises ``TunerError`` saying what is missing when a compiler or a library is not there."""
    compiler, libdir = _toolchain()
    out_dir.mkdir(parents=True, exist_ok=True)
    include = [f"-I{source / d}" for d in ("common", "include", "ggml/include", "vendor")]
    link = _link_args(libdir)
    binary = out_dir / target
    extra = sorted({f"-I{p.parent}" for p in sources})
    flags = [f"-D{d}" for d in defines]
    proc = subprocess.run([compiler, "-std=c++17", optimize, *flags, *include, *extra, *map(str, sources), "-o", str(binary), *link],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise TunerError(f"could not build {target} against {source}: {proc.stderr[-2000:]}")
    return binary


# The llama.cpp tools the llama-cpp engine uses, by the sources they are built from.
LLAMA_CPP_TOOLS = {
    "llama-bench": ("tools/llama-bench/llama-bench.cpp", "tools/llama-bench/main.cpp"),
    "llama-fit-params": ("tools/fit-params/fit-params.cpp", "tools/fit-params/main.cpp"),
    # N sequences decoded together (-npl): what the python engine's --users measurement is compared with
    "llama-batched-bench": ("tools/batched-bench/batched-bench.cpp", "tools/batched-bench/main.cpp"),
}


def build_llama_cpp_tools(out_dir: str | os.PathLike[str], *, source: Path | None = None) -> Path:
    """Build llama-bench, llama-fit-params and llama-batched-bench from the llama.cpp sources that match the installed
    llama-cpp-python, into ``out_dir``: a folder of real llama.cpp binaries for ``--llama-bin`` (what
    tests and CI give the llama-cpp engine). Optimized and without asserts, like a release build.

    A tool already there and newer than its sources is kept (one build per CI run: ``.ci/run``
    empties the folder first). Raises ``TunerError`` when the sources or a compiler are missing."""
    source = _require_source(source)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for tool, files in LLAMA_CPP_TOOLS.items():
        sources = [source / f for f in files]
        binary = out / tool
        if binary.exists() and binary.stat().st_mtime >= max(p.stat().st_mtime for p in sources):
            continue
        # built under a temporary name and renamed: a half-built tool never looks finished
        built = build_against_llama_cpp(f".{tool}.part", sources, out, source=source, optimize="-O2", defines=("NDEBUG",))
        os.replace(built, binary)
    return out


# llama-server's translation units, as tools/server, tools/mtmd and vendor/cpp-httplib's CMakeLists.txt
# list them: the server (its three targets), llama.cpp's multimodal library that it links (text
# models never call it), the HTTP library. Globs where the CMakeLists names a whole folder's files.
_SERVER_SOURCES = ("tools/server/*.cpp",)
_MTMD_SOURCES = ("tools/mtmd/mtmd.cpp", "tools/mtmd/mtmd-audio.cpp", "tools/mtmd/mtmd-image.cpp", "tools/mtmd/mtmd-helper.cpp",
                 "tools/mtmd/mtmd-helper-gen.cpp", "tools/mtmd/clip.cpp", "tools/mtmd/models/*.cpp")
# vendor/hash (mtmd's hashes): C, except sha1.c, which its CMakeLists compiles as C++ (a namespace)
_HASH_SOURCES = ("vendor/hash/hash.cpp", "vendor/hash/xxhash/xxhash.c", "vendor/hash/sha1/sha1.c", "vendor/hash/sha256/sha256.c")
# vendor/cpp-httplib/CMakeLists.txt's definitions (the backlog matters: llama-server takes many connections)
_HTTPLIB_DEFINES = ("CPPHTTPLIB_FORM_URL_ENCODED_PAYLOAD_MAX_LENGTH=1048576", "CPPHTTPLIB_LISTEN_BACKLOG=512",
                    "CPPHTTPLIB_REQUEST_URI_MAX_LENGTH=32768", "CPPHTTPLIB_TCP_NODELAY=1")


def build_llama_server(out_dir: str | os.PathLike[str], *, source: Path | None = None, jobs: int | None = None) -> Path:
    """Build llama-server from the llama.cpp sources that match the installed llama-cpp-python, against
    the libraries llama-cpp-python installed (the same llama.cpp the python engine runs), into
    ``out_dir``; returns the binary's path.

    What llama.cpp's cmake build does for the target, without building llama.cpp a second time:
    the web UI's asset table is generated by llama.cpp's own ``scripts/ui-assets.cmake`` with
    downloads off (no assets: the HTTP API serves, the browser UI is not there), the HTTP library
    is compiled with its CMakeLists' definitions (and OpenSSL support when libllama-common was
    built with it: the two must agree on its classes), the multimodal library (mtmd) because the
    server links it. Objects are compiled ``jobs`` at a time (default: every core) and kept in
    ``out_dir/.llama-server-obj``: a second call rebuilds only what changed. Optimized, without
    asserts, like a release build. Raises ``TunerError`` saying what is missing (sources, cmake, a
    compiler, a library)."""
    import glob
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    source = _require_source(source)
    if not (source / "tools" / "server" / "server.cpp").is_file():
        raise TunerError(f"{source} has no tools/server/server.cpp: not a llama.cpp source tree with llama-server")
    compiler, libdir = _toolchain()
    cmake = shutil.which("cmake")
    if cmake is None:
        raise TunerError("llama-server's web UI table is generated by cmake (scripts/ui-assets.cmake), and cmake is not on PATH")
    common = libdir / "libllama-common.so"
    out = Path(out_dir)
    objdir = out / ".llama-server-obj"
    ui = objdir / "ui"
    ui.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([cmake, f"-DUI_SOURCE_DIR={source / 'tools' / 'ui'}", f"-DUI_BINARY_DIR={ui}",
                           f"-DLLAMA_SOURCE_DIR={source}", "-DHF_ENABLED=OFF", "-DBUILD_UI=OFF", "-DLLAMA_UI_GZIP=ON",
                           "-P", str(source / "scripts" / "ui-assets.cmake")], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not (ui / "ui.cpp").is_file():
        raise TunerError(f"llama.cpp's scripts/ui-assets.cmake failed: {(proc.stderr or proc.stdout)[-1500:]}")
    needed = subprocess.run(["readelf", "-d", str(common)], capture_output=True, text=True).stdout if shutil.which("readelf") else ""
    openssl = "libssl" in needed
    include = [f"-I{source / d}" for d in ("common", "include", "ggml/include", "vendor", "tools/mtmd", "tools/server", ".")]
    include += [f"-I{ui}", f"-I{source / 'vendor' / 'hash'}"]
    defines = ["-DNDEBUG", *(f"-D{d}" for d in _HTTPLIB_DEFINES)] + (["-DCPPHTTPLIB_OPENSSL_SUPPORT"] if openssl else [])
    units = sorted({Path(f) for pattern in (*_SERVER_SOURCES, *_MTMD_SOURCES) for f in glob.glob(str(source / pattern))})
    units += [source / "vendor" / "cpp-httplib" / "httplib.cpp", ui / "ui.cpp", *(source / f for f in _HASH_SOURCES)]
    missing = [u for u in units if not u.is_file()]
    if missing or len(units) < 20:
        raise TunerError(f"llama-server's sources are incomplete in {source}: {', '.join(map(str, missing)) or 'too few files'}")
    headers = [Path(f) for d in ("tools/server", "tools/mtmd", "common") for f in glob.glob(str(source / d / "*.h"))]
    newest_header = max((h.stat().st_mtime for h in headers), default=0.0)

    def compile_one(unit: Path) -> Path:
        rel = unit.relative_to(source) if unit.is_relative_to(source) else Path(unit.name)
        obj = objdir / (str(rel).replace(os.sep, "__") + ".o")
        if obj.exists() and obj.stat().st_mtime >= max(unit.stat().st_mtime, newest_header):
            return obj
        part = obj.with_suffix(".o.part")
        language = ["-x", "c", "-std=gnu11"] if unit.suffix == ".c" and unit.name != "sha1.c" else ["-x", "c++", "-std=c++17"]
        cmd = [compiler, *language, "-O2", "-fPIC", "-w", *defines, *include, "-c", str(unit), "-o", str(part)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise TunerError(f"could not compile {rel} for llama-server: {done.stderr[-2000:]}")
        os.replace(part, obj)
        return obj

    # the largest first (httplib, the server's context): a big one left for last compiles on one core alone
    order = sorted(units, key=lambda u: u.stat().st_size, reverse=True)
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, order))
    binary = out / "llama-server"
    link = _link_args(libdir, *(["-lssl", "-lcrypto"] if openssl else []), "-pthread")
    part = out / ".llama-server.part"
    done = subprocess.run([compiler, *map(str, objects), "-o", str(part), *link], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise TunerError(f"could not link llama-server: {done.stderr[-2000:]}")
    os.replace(part, binary)  # a half-built server never looks finished
    return binary


def llama_cpp_env() -> dict[str, str]:
    """Environment for programs built by ``build_against_llama_cpp``: libllama-common's own
    dependencies are found through the library path, not its rpath."""
    libdir = _installed_libdir()
    # (no empty entry: the dynamic loader reads one as the current folder, and llama-batched-bench
    # started that way printed nothing and exited 0)
    paths = [str(libdir)] + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(paths)}
    return {k: v for k, v in env.items() if not k.startswith("LLAMA_ARG_")}
