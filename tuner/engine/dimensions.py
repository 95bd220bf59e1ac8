"""Each setting declared once: what it is, how every tool spells it, and when the search asks for it.

One ``Dimension`` per ``tuner.engine.settings.Settings`` field, named like the field, in the order
the command lines write them. Everything that reads or writes a setting loops over ``DIMENSIONS``:

==========================  =============================================================================
reader                      what it takes from a dimension
==========================  =============================================================================
``Settings``                the field's kind, default and checks (validation, dotted-path messages);
                            ``model_level`` (``model_key``); ``llama_kwarg`` (``llama_kwargs()``);
                            ``flags`` (``cli_args()`` for llama-server, llama-cli, llama-bench)
the trial worker            ``c_api``: the ``llama_model_params`` / ``llama_context_params`` field it sets
``offload-tuner bench``,    ``option``: the command-line option(s) (llama.cpp's names where they exist)
``estimate``
``profile args --for env``  ``env``: the ``LLAMA_ARG_*`` variable llama-server reads instead of the flag
``profile args --for        ``ollama``: the Modelfile ``PARAMETER``, or the note saying it cannot be said
ollama``
the search space            ``search``: when the dimension can matter (``applies``, a predicate on the
                            model, the machine and the values chosen before it) and how it is asked
the memory arithmetic       ``Settings`` itself (``tuner.model.estimate.estimate`` takes one)
==========================  =============================================================================

Spellings were read from llama.cpp's sources as vendored by llama-cpp-python 0.3.36:
``include/llama.h`` (``llama_model_params``, ``llama_context_params`` and their defaults in
``src/llama-model.cpp`` / ``src/llama-context.cpp``), ``common/arg.cpp`` (flags, ``set_env`` names,
which tools take a flag), ``tools/llama-bench/llama-bench.cpp`` (its flags and value syntax), and
ollama's ``api/types.go`` ``Runner`` options (2026).

The special values have one helper each (in ``tuner.model.special``, re-exported here): "every
layer" (``ALL_LAYERS``, ``offloaded_layers``, ``gpu_layers_arg``), "the model's training context"
(``TRAINING_CONTEXT``, ``context_tokens``) and flash attention's forms (``flash_attn_forms``).

Light on purpose, like ``settings``: apps import it through profiles.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

# The special values (every layer, the training context, flash attention's forms): one helper each,
# in tuner.model.special, because the memory arithmetic below this stage reads them too.
from ..model.special import (
    ALL_LAYERS,
    FLASH_ATTN,
    TRAINING_CONTEXT,
    FlashAttnForms,
    context_tokens,
    first_offloaded_layer,
    flash_attn_forms,
    gpu_layers_arg,
    offloaded_layers,
    offloaded_repeating_layers,
)

# llama.cpp's KV cache types (common/arg.cpp ``kv_cache_types``), by the name -ctk/-ctv take,
# with the ggml_type enum value llama_context_params.type_k/type_v take.
KV_CACHE_TYPES: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}
# V cache types that need no flash attention (llama-context.cpp: ggml_is_quantized(type_v) needs it)
UNQUANTIZED_KV = ("f32", "f16", "bf16")
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
CLI_TOOLS = ("llama-server", "llama-cli", "llama-bench")


def load_mode(use_mmap: bool, use_mlock: bool) -> str:
    """llama.cpp's ``--load-mode`` name (common/arg.cpp, 2026), mirroring llama-cpp-python's mapping."""
    if use_mmap and use_mlock:
        return "mmap+mlock"
    if use_mlock:
        return "mlock"
    return "mmap" if use_mmap else "none"


# enum llama_load_mode (include/llama.h)
LOAD_MODES = {"none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3}

# llama.cpp's --n-cpu-moe: one override per layer, common/common.h LLM_FFN_EXPS_REGEX through
# llm_ffn_block_regex ("blk\\.%d%s"); llama-bench builds the same list.
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def n_cpu_moe_patterns(n_cpu_moe: int) -> tuple[str, ...]:
    """The tensor overrides ``--n-cpu-moe N`` stands for: the experts of layers 0..N-1 on the CPU."""
    return tuple(rf"blk\.{i}{FFN_EXPS_REGEX}" for i in range(max(0, n_cpu_moe)))


# -- how a dimension is spelled -----------------------------------------------------------------------


@dataclass(frozen=True)
class Export:
    """What a writer knows besides the settings: the tool, the profile's layer count, the app's model path."""

    tool: str = "llama-server"
    layers_total: int | None = None
    model_path: str | None = None
    sliding_window: int = 0  # the model's window (tokens; 0: none), where an app's setting depends on it


Writer = Callable[[Any, Export], list[str]]  # (settings, export) -> argv words, [] when nothing to say


def _llama_patterns(s: Any, e: Export) -> tuple[str, ...]:
    """The tensor overrides a llama.cpp tool is given: where the model file is at hand, the tensor
    names the patterns match in it, as escaped literals (tuner.engine.tensor_match: std::regex, which
    backtracks, never sees a shared profile's pattern); else the patterns as written."""
    import os

    path = e.model_path or getattr(s, "model_path", None)
    if path and os.path.isfile(path):
        from .tensor_match import resolved_patterns, tensor_names

        try:
            return resolved_patterns(s.tensor_overrides, tensor_names(path))
        except Exception:  # noqa: BLE001 - not a readable GGUF here: the patterns as written
            pass
    return tuple(s.tensor_overrides)


def _ot_flag(s: Any, e: Export, separator: str) -> list[str]:
    patterns = _llama_patterns(s, e) if s.tensor_overrides else ()
    return ["-ot", separator.join(f"{p}=CPU" for p in patterns)] if patterns else []


@dataclass(frozen=True)
class Option:
    """The option(s) of ``offload-tuner bench`` and ``estimate`` that set a dimension."""

    names: tuple[str, ...]
    help: str = ""
    switch: Any = None  # a switch without a value: the setting's value when it is given
    parse: Callable[[Any], Any] | None = None  # the option's text -> the setting's value
    bare: Any = None  # the value when the option is given without one (``--flash-attn`` alone: on)
    multiple: bool = False


@dataclass(frozen=True)
class CField:
    """The llama.cpp C API field the trial worker sets (``struct`` is ``model`` or ``context``).

    ``value`` maps the settings to the field's value; ``None`` leaves llama.cpp's default."""

    struct: str
    field: str
    value: Callable[[Any], Any]


@dataclass(frozen=True)
class Env:
    """The environment variable llama-server reads instead of the flag (common/arg.cpp ``set_env``).

    ``value``: the text for a switch; ``None`` takes the flag's own value."""

    name: str
    value: str | None = None


@dataclass(frozen=True)
class Ollama:
    """A Modelfile's view of a dimension: a ``PARAMETER`` line, or a note that it cannot be said.

    ``order`` places lines and notes where Modelfiles from this tool have always put them."""

    order: int
    line: Callable[[Any, Export], str | None] | None = None
    note: Callable[[Any, Export], str | None] | None = None


@dataclass(frozen=True)
class Foreign:
    """Another app's settings file's view of a dimension: LM Studio's per-model load config
    (``lmstudio``: ``llm.load.*`` keys of lmstudio-js ``packages/lms-kv-config/src/schema.ts``, 2025)
    or koboldcpp's ``.kcpps`` (``kcpps``: the ``dest`` names of koboldcpp.py's argparse options,
    which ``--config`` loads, 2026).

    ``write(settings, export)`` gives the fields (``{}`` when the app's default already says it);
    ``note(settings, export)`` says what cannot be said there (``None`` when everything can)."""

    write: Callable[[Any, Export], dict[str, Any]] | None = None
    note: Callable[[Any, Export], str | None] | None = None


@dataclass(frozen=True)
class Facts:
    """What the search knows when it asks: the model, the devices, each dimension's candidate values
    (``domains``, built by ``tuner.search.space.build_space``) and the settings the engine can set."""

    n_layer: int
    devices: tuple[str, ...] = ()
    is_moe: bool = False
    has_swa: bool = False
    users: int = 1  # the workload's concurrent sequences (tuner.engine.base.BenchSpec.users)
    domains: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    supported: frozenset[str] | None = None  # None: every setting

    def domain(self, name: str) -> tuple:
        return tuple(self.domains.get(name, ()))


class Asker:
    """What ``Search.ask`` talks to: an Optuna trial, or anything with these two methods."""

    def suggest_int(self, name: str, low: int, high: int) -> int: ...  # pragma: no cover

    def suggest_categorical(self, name: str, choices: Sequence[Any]) -> Any: ...  # pragma: no cover


@dataclass(frozen=True)
class Search:
    """When and how the search asks for a dimension.

    ``applies(facts, chosen)``: whether it can matter, given the model, the machine and the values
    of the dimensions before it (``chosen``, by name); when it cannot, it is not asked at all (a
    conditional space: no proposal is invalid by construction) and takes ``fixed(facts, chosen)``.
    ``ask(asker, facts, chosen)`` asks the Optuna parameters and returns the setting's value;
    ``params(value, facts, chosen)`` is its inverse (to enqueue a known candidate). The default
    ask is a categorical parameter named like the dimension over ``facts.domains[name]``, asked
    only when there is more than one value. ``why_not`` says why it is left out when it can never
    apply on this machine and model; ``depends_on`` names the dimensions ``applies``/``ask`` read.
    """

    applies: Callable[[Facts, Mapping[str, Any]], bool] = lambda facts, chosen: True
    why_not: Callable[[Facts], str] | None = None
    ask: Callable[[Asker, Facts, Mapping[str, Any]], Any] | None = None
    params: Callable[[Any, Facts, Mapping[str, Any]], dict[str, Any]] | None = None
    fixed: Callable[[Facts, Mapping[str, Any]], Any] | None = None
    depends_on: tuple[str, ...] = ()
    when: str = ""  # ``applies`` in words, for the space's description ("flash attention is on")


@dataclass(frozen=True)
class Dimension:
    """One setting, declared once. See the module docstring for who reads what."""

    name: str
    kind: str  # path | int | count | bool | choice | proportions | patterns | endpoints | devices
    default: Any
    check: Callable[[Any], str | None] | None = None  # a value of the right kind -> why it is wrong
    choices: tuple[str, ...] = ()
    model_level: bool = False  # part of what decides the loaded model (Settings.model_key)
    option: Option | None = None
    llama_kwarg: str | None = None  # the llama_cpp.Llama keyword
    to_kwarg: Callable[[Any], Any] | None = None  # the settings -> that keyword's value (None: left out)
    no_kwarg: str = ""  # why there is no keyword, and who applies it instead
    c_api: CField | None = None
    c_api_by_worker: str = ""  # set by the worker's own code (a pointer, a registration): why
    flags: Mapping[str, Writer] = dataclasses.field(default_factory=dict)  # tool -> writer
    no_flag: Mapping[str, str] = dataclasses.field(default_factory=dict)  # tool -> why it has no flag for this
    spelled_by: str = ""  # another dimension's flag carries this one's value (use_mlock: -lm)
    host_patterns: Callable[[Any], tuple[str, ...]] | None = None  # tensors it keeps on the CPU (regexes)
    env: Env | None = None
    ollama: Ollama | None = None
    lmstudio: Foreign | None = None  # LM Studio's per-model load config (profile args --for lmstudio)
    kcpps: Foreign | None = None  # koboldcpp's .kcpps settings file (profile args --for kcpps)
    search: Search | None = None  # None: never searched
    not_searched: str = ""  # why not


# -- writers ------------------------------------------------------------------------------------------


def _value(flag: str, *, unless: Any = dataclasses.MISSING, fmt: Callable[[Any], str] = str, name: str = "") -> Writer:
    """``[flag, value]``; nothing when the value is ``unless`` (llama.cpp's default) or None."""

    def write(s: Any, e: Export) -> list[str]:
        value = getattr(s, name)
        if value is None or (unless is not dataclasses.MISSING and value == unless):
            return []
        return [flag, fmt(value)]

    return write


def _switch(words: Sequence[str], when: Any, name: str) -> Writer:
    """``words`` when the setting equals ``when`` (a switch such as ``-nkvo``), else nothing."""

    def write(s: Any, e: Export) -> list[str]:
        return list(words) if getattr(s, name) == when else []

    return write


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _all_tools(writer: Writer) -> dict[str, Writer]:
    return {tool: writer for tool in CLI_TOOLS}


def _server_cli(writer: Writer) -> dict[str, Writer]:
    return {"llama-server": writer, "llama-cli": writer}


# -- checks -------------------------------------------------------------------------------------------


def _at_least(minimum: int, message: str) -> Callable[[Any], str | None]:
    return lambda v: None if v >= minimum else f"{message}, got {v}"


def _floats(text: Any) -> tuple[float, ...] | None:
    """``3,1`` (or llama-bench's ``3/1``) -> proportions; empty -> None."""
    if text is None or text == "":
        return None
    if isinstance(text, (tuple, list)):
        return tuple(float(x) for x in text)
    try:
        return tuple(float(x) for x in str(text).replace("/", ",").split(","))
    except ValueError:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from None


def _override_patterns(values: Sequence[str]) -> tuple[str, ...]:
    # -ot takes PATTERN=BUFFER; only the CPU is a target here, so a trailing =CPU is accepted
    return tuple(p[:-4] if p.upper().endswith("=CPU") else p for p in values)


def _device_names(text: Any) -> tuple[str, ...]:
    """``CUDA0,CUDA1`` (or llama-bench's ``CUDA0/CUDA1``) -> names; empty -> ()."""
    if not text:
        return ()
    if isinstance(text, (tuple, list)):
        return tuple(text)
    return tuple(n.strip() for n in str(text).replace("/", ",").split(",") if n.strip())


def _endpoints(text: Any) -> tuple[str, ...]:
    if not text:
        return ()
    if isinstance(text, (tuple, list)):
        return tuple(text)
    return tuple(s for s in str(text).split(",") if s)


# -- the search's structured questions ------------------------------------------------------------------

# Tensor placement strategies (llama.cpp's -ot PATTERN=CPU): which tensors of the first offloaded
# layers stay on the host while the rest of each layer is offloaded.
PLACEMENTS = {
    "none": None,
    "ffn_cpu": r"ffn_(gate|up|down)(_exps)?\.weight",  # the FFN (dense or experts)
    "experts_cpu": r"ffn_(gate|up|down)_exps\.weight",  # only the MoE experts (where n_cpu_moe cannot be set)
    "attn_cpu": r"attn_(q|k|v|output|qkv)\.weight",  # the attention
}


def placement_patterns(strategy: str, k: int, start: int = 0) -> tuple[str, ...]:
    """``-ot`` regexes for a strategy over layers ``start..start+k-1``."""
    suffix = PLACEMENTS.get(strategy)
    if not suffix or k <= 0:
        return ()
    layers = "|".join(str(i) for i in range(start, start + k))
    return (rf"^blk\.({layers})\.{suffix}$",)


def parse_placement(patterns: Sequence[str]) -> tuple[str, int, int] | None:
    """``(strategy, start, k)`` of overrides ``placement_patterns`` wrote, or None."""
    if not patterns:
        return ("none", 0, 0)
    if len(patterns) != 1:
        return None
    for strategy, suffix in PLACEMENTS.items():
        if not suffix:
            continue
        m = re.fullmatch(r"\^blk\\\.\(([\d|]+)\)\\\.(.*)\$", patterns[0])
        if m and m.group(2) == suffix:
            layers = [int(x) for x in m.group(1).split("|")]
            if layers == list(range(layers[0], layers[0] + len(layers))):
                return (strategy, layers[0], len(layers))
    return None


def _offloaded(facts: Facts, chosen: Mapping[str, Any]) -> int:
    """Repeating layers on the accelerators for the n_gpu_layers chosen."""
    return offloaded_repeating_layers(int(chosen.get("n_gpu_layers", 0)), facts.n_layer)


def _ask_split(asker: Asker, facts: Facts, chosen: Mapping[str, Any]) -> tuple[float, ...] | None:
    """Layers per device for all devices but the last, which takes the rest; each count is bounded
    by what the devices before it left, so every answer is a valid split."""
    ngl = offloaded_layers(int(chosen["n_gpu_layers"]), facts.n_layer)
    left = ngl
    counts = []
    for device in facts.devices[:-1]:
        count = asker.suggest_int(f"layers_on[{device}]", 0, left)
        counts.append(count)
        left -= count
    return split_from_counts(ngl, counts)


def split_from_counts(ngl: int, counts: Sequence[int]) -> tuple[float, ...] | None:
    """Layer counts per device (all but the last) -> llama.cpp's tensor split (the last takes the rest).

    With proportions equal to the counts, llama.cpp's cumulative rule puts exactly that many layers
    on each device. Raises ValueError when the counts exceed the offloaded layers."""
    used = sum(counts)
    if used > ngl:
        raise ValueError(f"layer counts {list(counts)} add up to more than n_gpu_layers {ngl}")
    return tuple(float(c) for c in counts) + (float(ngl - used),) if ngl else None


def counts_from_split(n_layer: int, ngl: int, split: Sequence[float] | None, n_devices: int) -> list[int]:
    """Offloaded layers (output included) per device under llama.cpp's cumulative split rule, for all
    devices but the last (src/llama-model.cpp: std::upper_bound over the cumulative shares)."""
    total_layers = offloaded_layers(ngl, n_layer)
    start = n_layer + 1 - total_layers
    shares = list(split) if split else [1.0] * n_devices
    shares = (shares + [0.0] * n_devices)[:n_devices]
    if sum(shares) <= 0:
        shares = [1.0] * n_devices
    total = float(sum(shares))
    cumulative, acc = [], 0.0
    for part in shares:
        acc += part
        cumulative.append(acc / total)
    counts = [0] * n_devices
    for il in range(start, n_layer + 1):
        x = float(il - start) / total_layers
        index = next((i for i, c in enumerate(cumulative) if c > x), n_devices - 1)
        counts[min(index, n_devices - 1)] += 1
    return counts[:-1]


def _split_params(value: Any, facts: Facts, chosen: Mapping[str, Any]) -> dict[str, Any]:
    ngl = int(chosen["n_gpu_layers"])
    counts = counts_from_split(facts.n_layer, ngl, value, len(facts.devices))
    return {f"layers_on[{d}]": c for d, c in zip(facts.devices[:-1], counts)}


def _placement_strategies(facts: Facts) -> tuple[str, ...]:
    return tuple(facts.domain("tensor_overrides")) or ("none",)


def _ask_placement(asker: Asker, facts: Facts, chosen: Mapping[str, Any]) -> tuple[str, ...]:
    """A strategy, then how many of the offloaded layers (from the first one) it applies to: counting
    from the first offloaded layer keeps every answer meaningful (an override on a layer already on
    the CPU changes nothing)."""
    strategies = _placement_strategies(facts)
    strategy = asker.suggest_categorical("placement", list(strategies)) if len(strategies) > 1 else strategies[0]
    if strategy == "none":
        return ()
    k = asker.suggest_int("placement_layers", 1, _offloaded(facts, chosen))
    start = first_offloaded_layer(int(chosen["n_gpu_layers"]), facts.n_layer)
    return placement_patterns(strategy, k, start)


def _placement_params(value: Any, facts: Facts, chosen: Mapping[str, Any]) -> dict[str, Any]:
    parsed = parse_placement(tuple(value))
    if parsed is None:
        raise ValueError(f"tensor overrides {list(value)} are not a placement strategy the search spells")
    strategy, start, k = parsed
    params: dict[str, Any] = {}
    if len(_placement_strategies(facts)) > 1:
        params["placement"] = strategy
    if strategy != "none":
        first = first_offloaded_layer(int(chosen["n_gpu_layers"]), facts.n_layer)
        params["placement_layers"] = start + k - first
    return params


def _ask_n_cpu_moe(asker: Asker, facts: Facts, chosen: Mapping[str, Any]) -> int:
    """How many of the offloaded layers (from the first one) keep their experts on the CPU; the
    setting counts from layer 0 (--n-cpu-moe N: layers 0..N-1), so 0 offloaded layers is 0."""
    k = asker.suggest_int("n_cpu_moe", 0, _offloaded(facts, chosen))
    return first_offloaded_layer(int(chosen["n_gpu_layers"]), facts.n_layer) + k if k else 0


def _n_cpu_moe_params(value: Any, facts: Facts, chosen: Mapping[str, Any]) -> dict[str, Any]:
    first = first_offloaded_layer(int(chosen["n_gpu_layers"]), facts.n_layer)
    return {"n_cpu_moe": max(0, min(int(value) - first, _offloaded(facts, chosen)))}


def _cpu_holds_weights(facts: Facts, chosen: Mapping[str, Any]) -> bool:
    """Whether the CPU holds repeating-layer or output weights: every layer without a device, some
    layers when not all are offloaded, or tensors kept there by overrides (n_cpu_moe included)."""
    ngl = offloaded_layers(int(chosen.get("n_gpu_layers", 0)), facts.n_layer)
    return (not facts.devices or ngl < facts.n_layer + 1 or bool(chosen.get("tensor_overrides"))
            or bool(chosen.get("n_cpu_moe")))


def _supported(name: str) -> Callable[[Facts], bool]:
    return lambda facts: facts.supported is None or name in facts.supported


def _no_device(facts: Facts) -> str:
    return "no GPU or RPC device: every layer runs on the CPU"


# -- other apps' settings files (LM Studio, koboldcpp) ------------------------------------------------

_LMS = "llm.load."


def _cannot(app: str, what: Callable[[Any], str | None]) -> Callable[[Any, Export], str | None]:
    """A note for a setting ``app`` has no field for: ``what(settings)`` describes the value, None when
    the value is the app's default anyway."""
    def note(s: Any, e: Export) -> str | None:
        value = what(s)
        return f"{value}: {app} has no setting for it" if value else None
    return note


def _lms_offload(s: Any, e: Export) -> dict[str, Any]:
    # LM Studio takes a proportion of the layers ("max": every layer), not a count
    if s.n_gpu_layers < 0 or (e.layers_total and s.n_gpu_layers >= e.layers_total):
        return {_LMS + "llama.acceleration.offloadRatio": "max"}
    if s.n_gpu_layers == 0:
        return {_LMS + "llama.acceleration.offloadRatio": 0}
    if not e.layers_total:
        return {}
    return {_LMS + "llama.acceleration.offloadRatio": round(s.n_gpu_layers / e.layers_total, 6)}


def _lms_offload_note(s: Any, e: Export) -> str | None:
    if 0 < s.n_gpu_layers and not e.layers_total:
        return f"n_gpu_layers {s.n_gpu_layers}: LM Studio takes a proportion of the layers, and the profile has no layer count"
    if 0 < s.n_gpu_layers and e.layers_total and s.n_gpu_layers < e.layers_total:
        return (f"n_gpu_layers {s.n_gpu_layers} of {e.layers_total}: written as the proportion "
                f"{round(s.n_gpu_layers / e.layers_total, 6)}, which LM Studio turns back into a layer count")
    return None


def _lms_kv(name: str) -> Callable[[Any, Export], dict[str, Any]]:
    key = _LMS + ("llama.kCacheQuantizationType" if name == "type_k" else "llama.vCacheQuantizationType")
    return lambda s, e: {key: {"checked": True, "value": getattr(s, name)}} if getattr(s, name) != "f16" else {}


# koboldcpp --batchsize choices (koboldcpp.py, 2026) and --quantkv's names
KCPPS_BATCH_SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
KCPPS_KV_TYPES = ("f16", "bf16", "q8_0", "q5_1", "q4_0")


def _kcpps_kv_note(s: Any, e: Export) -> str | None:
    if s.type_k != s.type_v:
        return f"type_k {s.type_k}, type_v {s.type_v}: koboldcpp has one KV cache type (--quantkv) for K and V"
    if s.type_k not in KCPPS_KV_TYPES:
        return f"type_k and type_v {s.type_k}: koboldcpp's --quantkv takes {', '.join(KCPPS_KV_TYPES)}"
    return None


def _kcpps_gpu_layers(s: Any, e: Export) -> dict[str, Any]:
    # koboldcpp reads -1 as "autodetect": every layer is written as the count
    if s.n_gpu_layers < 0:
        return {"gpulayers": e.layers_total if e.layers_total else 999}
    return {"gpulayers": s.n_gpu_layers}


# -- the table ------------------------------------------------------------------------------------------


def _kv_kwarg(name: str) -> Callable[[Any], int]:
    return lambda s: KV_CACHE_TYPES[getattr(s, name)]


DIMENSIONS: tuple[Dimension, ...] = (
    Dimension(
        "model_path", "path", None,
        lmstudio=Foreign(),  # LM Studio keys its per-model config by the file (where the JSON goes), not a field
        kcpps=Foreign(write=lambda s, e: {"model_param": e.model_path or s.model_path}),
        model_level=True,
        llama_kwarg="model_path", to_kwarg=lambda s: s.model_path,
        c_api_by_worker="the file llama_model_load_from_file opens",
        flags=_all_tools(lambda s, e: ["-m", e.model_path or s.model_path]),
        env=Env("LLAMA_ARG_MODEL"),
        ollama=Ollama(0, line=lambda s, e: f"FROM {e.model_path or s.model_path}"),
        # the variants: the same model in other quantizations (build_space lists them)
        search=Search(ask=lambda a, f, c: _ask_variant(a, f), params=lambda v, f, c: _variant_params(v, f),
                      fixed=lambda f, c: f.domain("model_path")[0]),
    ),
    Dimension(
        "n_gpu_layers", "int", 0,
        lmstudio=Foreign(write=_lms_offload, note=_lms_offload_note),
        kcpps=Foreign(write=_kcpps_gpu_layers),
        check=_at_least(ALL_LAYERS, "expected -1 (all) or a count >= 0"),
        model_level=True,
        option=Option(("--n-gpu-layers", "-ngl"), "Layers to offload (-1: all)."),
        llama_kwarg="n_gpu_layers", to_kwarg=lambda s: s.n_gpu_layers,  # Llama maps -1 to every layer itself
        c_api=CField("model", "n_gpu_layers", lambda s: s.n_gpu_layers),  # negative: every layer
        flags=_all_tools(lambda s, e: ["-ngl", gpu_layers_arg(e.tool, s.n_gpu_layers, e.layers_total)]),
        env=Env("LLAMA_ARG_N_GPU_LAYERS"),
        ollama=Ollama(10, line=lambda s, e: f"PARAMETER num_gpu {e.layers_total if s.n_gpu_layers < 0 and e.layers_total else s.n_gpu_layers}"),
        search=Search(applies=lambda f, c: bool(f.devices), why_not=_no_device,
                      ask=lambda a, f, c: a.suggest_int("n_gpu_layers", 0, f.n_layer + 1),
                      params=lambda v, f, c: {"n_gpu_layers": offloaded_layers(int(v), f.n_layer)},
                      fixed=lambda f, c: 0),
    ),
    Dimension(
        "split_mode", "choice", "layer", choices=tuple(SPLIT_MODES),
        lmstudio=Foreign(note=_cannot("LM Studio", lambda s: f"split_mode {s.split_mode}" if s.split_mode != "layer" else None)),
        kcpps=Foreign(note=lambda s, e: f"split_mode {s.split_mode}: set koboldcpp's --splitmode by hand" if s.split_mode != "layer" else None),
        model_level=True,
        option=Option(("--split-mode", "-sm")),
        llama_kwarg="split_mode", to_kwarg=lambda s: SPLIT_MODES[s.split_mode],
        c_api=CField("model", "split_mode", lambda s: SPLIT_MODES[s.split_mode]),
        flags=_all_tools(_value("-sm", unless="layer", name="split_mode")),
        env=Env("LLAMA_ARG_SPLIT_MODE"),
        ollama=Ollama(70, note=lambda s, e: f"split_mode {s.split_mode}: ollama always splits by layer" if s.split_mode != "layer" else None),
        not_searched="layer split is llama.cpp's default, and the memory arithmetic models it alone",
    ),
    Dimension(
        "main_gpu", "int", 0,
        lmstudio=Foreign(note=_cannot("LM Studio", lambda s: f"main_gpu {s.main_gpu}" if s.main_gpu else None)),
        kcpps=Foreign(write=lambda s, e: {"maingpu": s.main_gpu} if s.main_gpu else {}),
        check=_at_least(0, "expected a device index >= 0"),
        model_level=True,
        option=Option(("--main-gpu", "-mg")),
        llama_kwarg="main_gpu", to_kwarg=lambda s: s.main_gpu,
        c_api=CField("model", "main_gpu", lambda s: s.main_gpu),
        flags=_all_tools(_value("-mg", unless=0, name="main_gpu")),
        env=Env("LLAMA_ARG_MAIN_GPU"),
        ollama=Ollama(50, line=lambda s, e: f"PARAMETER main_gpu {s.main_gpu}" if s.main_gpu else None),
        not_searched="it only matters with split_mode none or row, which are not searched",
    ),
    Dimension(
        "tensor_split", "proportions", None,
        lmstudio=Foreign(note=lambda s, e: (f"tensor_split {','.join(_num(x) for x in s.tensor_split)}: LM Studio's GPU split "
                                          "takes a strategy, not proportions") if s.tensor_split else None),
        kcpps=Foreign(write=lambda s, e: {"tensor_split": [float(x) for x in s.tensor_split]} if s.tensor_split else {}),
        model_level=True,
        option=Option(("--tensor-split", "-ts"), "Proportions per device, e.g. 3,1.", parse=_floats),
        llama_kwarg="tensor_split", to_kwarg=lambda s: list(s.tensor_split) if s.tensor_split is not None else None,
        c_api_by_worker="a float array llama_model_params.tensor_split points at",
        flags={
            **_server_cli(lambda s, e: ["-ts", ",".join(_num(p) for p in s.tensor_split)] if s.tensor_split is not None else []),
            # llama-bench splits list arguments on ',' (one value per run): its devices are '/'-separated
            "llama-bench": lambda s, e: ["-ts", "/".join(_num(p) for p in s.tensor_split)] if s.tensor_split is not None else [],
        },
        env=Env("LLAMA_ARG_TENSOR_SPLIT"),
        ollama=Ollama(80, note=lambda s, e: (
            f"tensor_split {','.join(f'{p:g}' for p in s.tensor_split)}: ollama places layers on GPUs itself "
            "(OLLAMA_SCHED_SPREAD=1 spreads one model over all GPUs)") if s.tensor_split is not None else None),
        # as layer counts per device: asked only when there are layers for two or more devices
        search=Search(applies=lambda f, c: len(f.devices) > 1 and offloaded_layers(int(c.get("n_gpu_layers", 0)), f.n_layer) >= 2,
                      why_not=lambda f: "one device: nothing to split" if f.devices else "no GPU or RPC device",
                      ask=_ask_split, params=_split_params, fixed=lambda f, c: None, depends_on=("n_gpu_layers",),
                      when="two or more devices can get layers (n_gpu_layers >= 2)"),
    ),
    Dimension(
        "n_ctx", "int", 4096,
        lmstudio=Foreign(write=lambda s, e: {_LMS + "contextLength": s.n_ctx} if s.n_ctx > TRAINING_CONTEXT else {}),
        kcpps=Foreign(write=lambda s, e: {"contextsize": s.n_ctx} if s.n_ctx > TRAINING_CONTEXT else {},
                      note=lambda s, e: "n_ctx 0 (the training context): koboldcpp needs a number" if s.n_ctx <= TRAINING_CONTEXT else None),
        check=_at_least(TRAINING_CONTEXT, "expected 0 (the model's training context) or more"),
        option=Option(("--ctx", "-c"), "Context size."),
        llama_kwarg="n_ctx", to_kwarg=lambda s: s.n_ctx,
        c_api=CField("context", "n_ctx", lambda s: s.n_ctx),
        flags=_server_cli(_value("-c", name="n_ctx")),
        no_flag={"llama-bench": "llama-bench sizes its context from -p/-n/-d; it has no -c"},
        env=Env("LLAMA_ARG_CTX_SIZE"),
        # per request: ollama starts llama-server with num_ctx x OLLAMA_NUM_PARALLEL (llm/llama_server.go)
        ollama=Ollama(20, line=lambda s, e: f"PARAMETER num_ctx {s.n_ctx // max(1, s.n_parallel)}" if s.n_ctx else None,
                      note=lambda s, e: None if s.n_ctx else "n_ctx 0 (the model's training context): set num_ctx to that number"),
        search=Search(),
    ),
    Dimension(
        "n_batch", "int", 2048,
        lmstudio=Foreign(write=lambda s, e: {_LMS + "llama.evalBatchSize": s.n_batch}),
        kcpps=Foreign(write=lambda s, e: {"batchsize": s.n_batch} if s.n_batch in KCPPS_BATCH_SIZES else {},
                      note=lambda s, e: None if s.n_batch in KCPPS_BATCH_SIZES else
                      f"n_batch {s.n_batch}: koboldcpp's --batchsize takes {', '.join(map(str, KCPPS_BATCH_SIZES))}"),
        check=_at_least(1, "expected at least 1"),
        option=Option(("--batch", "-b")),
        llama_kwarg="n_batch", to_kwarg=lambda s: s.n_batch,
        c_api=CField("context", "n_batch", lambda s: s.n_batch),
        flags=_all_tools(_value("-b", name="n_batch")),
        env=Env("LLAMA_ARG_BATCH"),
        # ollama passes num_batch as both -b and -ub (llm/llama_server.go): num_batch is the profile's
        # n_ubatch, which sizes the compute buffers the profile measured
        ollama=Ollama(30, note=lambda s, e: (
            f"n_batch {s.n_batch}: ollama's num_batch sets llama.cpp's batch and ubatch together; "
            f"num_batch above is the profile's n_ubatch ({s.n_ubatch})") if s.n_batch != s.n_ubatch else None),
        search=Search(),
    ),
    Dimension(
        "n_ubatch", "int", 512,
        lmstudio=Foreign(note=_cannot("LM Studio", lambda s: f"n_ubatch {s.n_ubatch}" if s.n_ubatch != 512 else None)),
        kcpps=Foreign(note=_cannot("koboldcpp", lambda s: f"n_ubatch {s.n_ubatch}" if s.n_ubatch != 512 else None)),
        check=_at_least(1, "expected at least 1"),
        option=Option(("--ubatch", "-ub")),
        llama_kwarg="n_ubatch", to_kwarg=lambda s: s.n_ubatch,
        c_api=CField("context", "n_ubatch", lambda s: s.n_ubatch),
        flags=_all_tools(_value("-ub", name="n_ubatch")),
        env=Env("LLAMA_ARG_UBATCH"),
        ollama=Ollama(30, line=lambda s, e: f"PARAMETER num_batch {s.n_ubatch}"),
        search=Search(),
    ),
    Dimension(
        "n_threads", "count", None,
        lmstudio=Foreign(write=lambda s, e: {_LMS + "llama.cpuThreadPoolSize": s.n_threads} if s.n_threads else {}),
        kcpps=Foreign(write=lambda s, e: {"threads": s.n_threads} if s.n_threads else {}),
        option=Option(("--threads", "-t"), "Generation threads (default: llama.cpp's)."),
        llama_kwarg="n_threads", to_kwarg=lambda s: s.n_threads,
        c_api=CField("context", "n_threads", lambda s: s.n_threads),
        flags=_all_tools(_value("-t", name="n_threads")),
        env=Env("LLAMA_ARG_THREADS"),
        ollama=Ollama(40, line=lambda s, e: f"PARAMETER num_thread {s.n_threads}" if s.n_threads is not None else None),
        search=Search(),
    ),
    Dimension(
        "n_threads_batch", "count", None,
        lmstudio=Foreign(note=_cannot("LM Studio", lambda s: f"n_threads_batch {s.n_threads_batch}"
                                          if s.n_threads_batch and s.n_threads_batch != s.n_threads else None)),
        kcpps=Foreign(write=lambda s, e: {"blasthreads": s.n_threads_batch} if s.n_threads_batch else {}),
        option=Option(("--threads-batch", "-tb")),
        llama_kwarg="n_threads_batch", to_kwarg=lambda s: s.n_threads_batch,
        # llama.cpp's own default for the batch threads is its generation default; ours follows n_threads
        c_api=CField("context", "n_threads_batch", lambda s: s.n_threads_batch or s.n_threads),
        flags=_server_cli(_value("-tb", name="n_threads_batch")),
        no_flag={"llama-bench": "llama-bench's -t sets both thread counts"},
        env=None,  # arg.cpp gives -tb no set_env()
        ollama=Ollama(45, note=lambda s, e: f"n_threads_batch {s.n_threads_batch}: ollama uses num_thread for prompt processing too"
                      if s.n_threads_batch is not None else None),
        search=Search(applies=lambda f, c: False, fixed=lambda f, c: c.get("n_threads"), depends_on=("n_threads",)),
    ),
    Dimension(
        "flash_attn", "choice", "auto", choices=tuple(FLASH_ATTN),
        lmstudio=Foreign(write=lambda s, e: {_LMS + "llama.flashAttention": s.flash_attn == "on"} if s.flash_attn != "auto" else {}),
        # koboldcpp 2026 turns it on by default (--noflashattention); older ones took --flashattention
        kcpps=Foreign(write=lambda s, e: {"flashattention": s.flash_attn == "on", "noflashattention": s.flash_attn == "off"}
                      if s.flash_attn != "auto" else {}),
        option=Option(("--flash-attn", "-fa"), bare="on"),
        llama_kwarg="flash_attn", to_kwarg=lambda s: flash_attn_forms(s.flash_attn).high_level,
        no_kwarg="llama_cpp.Llama takes on or off only: auto is off there",
        c_api=CField("context", "flash_attn_type", lambda s: flash_attn_forms(s.flash_attn).c_api),
        flags={**_server_cli(_value("-fa", name="flash_attn")),
               "llama-bench": lambda s, e: ["-fa", flash_attn_forms(s.flash_attn).bench] if flash_attn_forms(s.flash_attn).bench else []},
        env=Env("LLAMA_ARG_FLASH_ATTN"),
        ollama=Ollama(100, note=lambda s, e: (
            f"flash_attn {s.flash_attn}: server-wide in ollama: OLLAMA_FLASH_ATTENTION={flash_attn_forms(s.flash_attn).bench} "
            "where `ollama serve` runs") if s.flash_attn != "auto" else None),
        search=Search(),
    ),
    Dimension(
        "type_k", "choice", "f16", choices=tuple(KV_CACHE_TYPES),
        lmstudio=Foreign(write=_lms_kv("type_k")),
        kcpps=Foreign(write=lambda s, e: {"quantkv": s.type_k} if _kcpps_kv_note(s, e) is None and s.type_k != "f16" else {},
                      note=_kcpps_kv_note),
        option=Option(("--cache-type-k", "-ctk")),
        llama_kwarg="type_k", to_kwarg=_kv_kwarg("type_k"),
        c_api=CField("context", "type_k", _kv_kwarg("type_k")),
        flags=_all_tools(_value("-ctk", name="type_k")),
        env=Env("LLAMA_ARG_CACHE_TYPE_K"),
        ollama=Ollama(90, note=lambda s, e: _ollama_kv_note(s)),
        # The KV cache type (K and V together): a quantized cache only with flash attention on, since
        # llama.cpp refuses a quantized V cache without it. (A quantized K alone without flash
        # attention is valid; the search keeps K and V together, as -ctk/-ctv are usually set.)
        search=Search(applies=lambda f, c: c.get("flash_attn") != "off", fixed=lambda f, c: "f16",
                      depends_on=("flash_attn",), when="flash attention is on (K and V together)"),
    ),
    Dimension(
        "type_v", "choice", "f16", choices=tuple(KV_CACHE_TYPES),
        lmstudio=Foreign(write=_lms_kv("type_v")),
        kcpps=Foreign(),  # said with type_k: one --quantkv
        option=Option(("--cache-type-v", "-ctv")),
        llama_kwarg="type_v", to_kwarg=_kv_kwarg("type_v"),
        c_api=CField("context", "type_v", _kv_kwarg("type_v")),
        flags=_all_tools(_value("-ctv", name="type_v")),
        env=Env("LLAMA_ARG_CACHE_TYPE_V"),
        ollama=Ollama(90),  # said with type_k: ollama has one type for both
        search=Search(applies=lambda f, c: False, fixed=lambda f, c: c.get("type_k", "f16"), depends_on=("type_k",)),
    ),
    Dimension(
        "offload_kqv", "bool", True,
        lmstudio=Foreign(write=lambda s, e: {_LMS + "offloadKVCacheToGpu": s.offload_kqv} if not s.offload_kqv else {}),
        kcpps=Foreign(write=lambda s, e: {"lowvram": True} if not s.offload_kqv else {}),
        option=Option(("--no-kv-offload", "-nkvo"), "Keep the KV cache on the host.", switch=False),
        llama_kwarg="offload_kqv", to_kwarg=lambda s: s.offload_kqv,
        c_api=CField("context", "offload_kqv", lambda s: s.offload_kqv),
        flags={**_server_cli(_switch(["-nkvo"], False, "offload_kqv")), "llama-bench": _switch(["-nkvo", "1"], False, "offload_kqv")},
        # --no-kv-offload is the negative of "-kvo, --kv-offload", whose variable is LLAMA_ARG_KV_OFFLOAD
        # (a boolean: 0 turns it off; arg.cpp also reads LLAMA_ARG_NO_KV_OFFLOAD)
        env=Env("LLAMA_ARG_KV_OFFLOAD", "0"),
        ollama=Ollama(110, note=lambda s, e: None if s.offload_kqv else "offload_kqv false (KV cache in host memory): ollama keeps the KV cache with its layers"),
        # the KV cache lives with the repeating layers: it only moves when one of them is offloaded
        search=Search(applies=lambda f, c: _offloaded(f, c) >= 1, why_not=_no_device, fixed=lambda f, c: True,
                      depends_on=("n_gpu_layers",), when="repeating layers are offloaded"),
    ),
    Dimension(
        "swa_full", "bool", False,
        lmstudio=Foreign(note=_cannot("LM Studio", lambda s: "swa_full true (a full-size sliding-window cache)" if s.swa_full else None)),
        # koboldcpp keeps a full-size window cache unless --useswa (which also turns context shifting off):
        # said only for a sliding-window model measured with the window-sized cache
        kcpps=Foreign(write=lambda s, e: {"useswa": True} if e.sliding_window and not s.swa_full else {}),
        option=Option(("--swa-full",), "Full-size KV cache on sliding-window layers (llama.cpp's C API default; "
                      "llama-server's is a window-sized one).", switch=True),
        llama_kwarg="swa_full", to_kwarg=lambda s: s.swa_full,
        # llama_context_default_params() has swa_full = true (src/llama-context.cpp); the worker always
        # sets it, so the python engine runs what the settings say, as llama-server does
        c_api=CField("context", "swa_full", lambda s: s.swa_full),
        flags=_server_cli(_switch(["--swa-full"], True, "swa_full")),
        no_flag={"llama-bench": "llama-bench always runs swa_full false (llama-bench.cpp, to_llama_cparams)"},
        env=Env("LLAMA_ARG_SWA_FULL", "1"),  # a switch: arg.cpp reads any truthy value
        ollama=Ollama(170, note=lambda s, e: "swa_full true (a full-size sliding-window cache): no ollama equivalent"
                      if s.swa_full else None),
        # a full-size window cache costs memory and buys prompt-cache reuse in llama-server; for a
        # sliding-window model it also changes speed at depth (attention over more cells)
        search=Search(applies=lambda f, c: f.has_swa,
                      why_not=lambda f: "the model has no sliding-window layers: there is no window cache to size"),
    ),
    Dimension(
        "kv_unified", "bool", False,
        lmstudio=Foreign(note=_cannot("LM Studio", lambda s: "kv_unified true" if s.kv_unified else None)),
        kcpps=Foreign(note=_cannot("koboldcpp", lambda s: "kv_unified true" if s.kv_unified else None)),
        option=Option(("--kv-unified", "-kvu"), "One KV buffer shared by all sequences (llama-server's slots).", switch=True),
        no_kwarg="llama_cpp.Llama sets it only for embeddings; an app decoding one sequence gets the same cache either way",
        c_api=CField("context", "kv_unified", lambda s: s.kv_unified),  # llama_context_default_params(): false
        flags={"llama-server": _switch(["-kvu"], True, "kv_unified")},
        no_flag={"llama-cli": "llama-cli takes no -kvu (common/arg.cpp sets it for server, perplexity, batched, bench, parallel)",
                 "llama-bench": "llama-bench has no kv_unified option"},
        env=Env("LLAMA_ARG_KV_UNIFIED", "1"),
        ollama=Ollama(180, note=lambda s, e: "kv_unified true: ollama decides its KV layout itself" if s.kv_unified else None),
        # One sequence gets the same cache either way (llama-kv-cache.cpp: n_stream = unified ? 1 :
        # n_seq_max). With several users it is one stream of n_ctx cells that every sequence shares
        # (a sliding-window cache then holds n_swa * n_seq_max + n_ubatch cells) or one stream per
        # sequence of n_ctx / n_seq_max cells each; speed and memory differ, so it is searched.
        search=Search(applies=lambda f, c: f.users > 1,
                      why_not=lambda f: "one user: llama.cpp builds the same cache either way (n_stream = 1)"),
    ),
    Dimension(
        "n_parallel", "int", 1,
        check=_at_least(1, "expected a count of sequences >= 1"),
        option=Option(("--parallel", "-np"), "Sequences decoded together: llama-server's slots (the workload's users)."),
        no_kwarg="llama_cpp.Llama decodes one sequence at a time",
        # llama_context_params.n_seq_max: the KV cache is sized for this many sequences
        c_api=CField("context", "n_seq_max", lambda s: s.n_parallel),
        # always written for llama-server: its default (-np -1, auto) starts 4 slots with a unified
        # cache, which is not what a profile tuned for one user measured
        flags={"llama-server": lambda s, e: ["-np", str(s.n_parallel)]},
        no_flag={"llama-cli": "llama-cli serves one conversation",
                 "llama-bench": "llama-bench decodes one sequence; llama-batched-bench's -npl measures several"},
        env=Env("LLAMA_ARG_N_PARALLEL"),
        ollama=Ollama(185, note=lambda s, e: f"n_parallel {s.n_parallel}: server-wide in ollama: OLLAMA_NUM_PARALLEL={s.n_parallel} "
                      "where `ollama serve` runs (ollama multiplies num_ctx by it)"),
        # the workload's users, not a choice: the space passes them through (as rpc_servers)
        search=Search(applies=lambda f, c: False, fixed=lambda f, c: f.users),
    ),
    Dimension(
        "use_mmap", "bool", True,
        lmstudio=Foreign(write=lambda s, e: {_LMS + "llama.tryMmap": s.use_mmap}),
        kcpps=Foreign(write=lambda s, e: {"usemmap": s.use_mmap, "nommap": not s.use_mmap}),
        model_level=True,
        option=Option(("--no-mmap",), switch=False),
        llama_kwarg="use_mmap", to_kwarg=lambda s: s.use_mmap,
        c_api=CField("model", "load_mode", lambda s: LOAD_MODES[load_mode(s.use_mmap, s.use_mlock)]),
        flags=_all_tools(lambda s, e: ["-lm", load_mode(s.use_mmap, s.use_mlock)] if load_mode(s.use_mmap, s.use_mlock) != "mmap" else []),
        env=Env("LLAMA_ARG_LOAD_MODE"),
        ollama=Ollama(60, line=lambda s, e: f"PARAMETER use_mmap {'true' if s.use_mmap else 'false'}"),
        not_searched=("it changes how the weights are read at load and whether their pages can be evicted; "
                      "measured side by side, tokens/sec moved by no more than this machine's noise "
                      "(benchmarks/load_mode.py)"),
    ),
    Dimension(
        "use_mlock", "bool", False,
        lmstudio=Foreign(write=lambda s, e: {_LMS + "llama.keepModelInMemory": s.use_mlock} if s.use_mlock else {}),
        kcpps=Foreign(write=lambda s, e: {"usemlock": s.use_mlock}),
        model_level=True,
        option=Option(("--mlock",), switch=True),
        llama_kwarg="use_mlock", to_kwarg=lambda s: s.use_mlock,
        c_api_by_worker="written with use_mmap into llama_model_params.load_mode",
        spelled_by="use_mmap",  # -lm / LLAMA_ARG_LOAD_MODE carries both
        ollama=Ollama(120, note=lambda s, e: "use_mlock true: ollama's use_mlock parameter is deprecated and ignored" if s.use_mlock else None),
        not_searched="it keeps pages from being swapped out under memory pressure; a trial cannot measure that",
    ),
    Dimension(
        "op_offload", "bool", True,
        lmstudio=Foreign(note=_cannot("LM Studio", lambda s: "op_offload false" if not s.op_offload else None)),
        kcpps=Foreign(note=_cannot("koboldcpp", lambda s: "op_offload false" if not s.op_offload else None)),
        option=Option(("--no-op-offload",), switch=False),
        llama_kwarg="op_offload", to_kwarg=lambda s: s.op_offload,
        c_api=CField("context", "op_offload", lambda s: s.op_offload),
        flags={**_server_cli(_switch(["--no-op-offload"], False, "op_offload")), "llama-bench": _switch(["-nopo", "1"], False, "op_offload")},
        env=None,  # arg.cpp gives --no-op-offload no set_env()
        ollama=Ollama(130, note=lambda s, e: None if s.op_offload else "op_offload false: no ollama equivalent"),
        not_searched="not searched yet: it moves host-weight operations of large batches to the GPU, so it can "
                     "change prompt speed with a partial offload",
    ),
    Dimension(
        "tensor_overrides", "patterns", (),
        lmstudio=Foreign(note=_cannot("LM Studio", lambda s: f"tensor_overrides {', '.join(s.tensor_overrides)} (kept on the CPU)"
                                          if s.tensor_overrides else None)),
        kcpps=Foreign(write=lambda s, e: {"overridetensors": ",".join(f"{p}=CPU" for p in s.tensor_overrides)} if s.tensor_overrides else {}),
        model_level=True,
        option=Option(("--override-tensor", "-ot"),
                      "Regex of tensors kept on the CPU (repeatable), e.g. 'blk\\.[0-3]\\.ffn_.*'. A trailing =CPU is accepted.",
                      parse=_override_patterns, multiple=True),
        no_kwarg="llama_cpp.Llama has no keyword: tuner.Llama sets llama_model_params.tensor_buft_overrides around the load",
        c_api_by_worker="an override array llama_model_params.tensor_buft_overrides points at",
        host_patterns=lambda s: tuple(s.tensor_overrides),
        flags={
            **_server_cli(lambda s, e: _ot_flag(s, e, ",")),
            # llama-bench uses ',' between runs and ';' between the overrides of one run
            "llama-bench": lambda s, e: _ot_flag(s, e, ";"),
        },
        env=Env("LLAMA_ARG_OVERRIDE_TENSOR"),
        ollama=Ollama(140, note=lambda s, e: (
            f"tensor_overrides {', '.join(s.tensor_overrides)} (kept on the CPU): ollama has no tensor placement option")
            if s.tensor_overrides else None),
        # as a placement strategy and a layer count: only when repeating layers are offloaded
        search=Search(applies=lambda f, c: _offloaded(f, c) >= 1 and len(_placement_strategies(f)) > 1,
                      why_not=lambda f: "no GPU or RPC device: no tensor can be kept off one" if not f.devices else "one strategy only",
                      ask=_ask_placement, params=_placement_params, fixed=lambda f, c: (), depends_on=("n_gpu_layers",),
                      when="repeating layers are offloaded; placement_layers counts them from the first"),
    ),
    Dimension(
        "n_cpu_moe", "int", 0,
        lmstudio=Foreign(write=lambda s, e: {_LMS + "numCpuExpertLayersRatio": round(s.n_cpu_moe / max(1, e.layers_total - 1), 6)}
                          if s.n_cpu_moe and e.layers_total else {},
                          note=lambda s, e: f"n_cpu_moe {s.n_cpu_moe}: LM Studio takes a proportion, and the profile has no layer count"
                          if s.n_cpu_moe and not e.layers_total else None),
        kcpps=Foreign(write=lambda s, e: {"moecpu": s.n_cpu_moe} if s.n_cpu_moe else {}),
        check=_at_least(0, "expected a count of layers >= 0"),
        model_level=True,
        option=Option(("--n-cpu-moe", "-ncmoe"), "Keep the MoE experts of the first N layers on the CPU."),
        no_kwarg="llama_cpp.Llama has no keyword: tuner.Llama applies it as tensor overrides around the load",
        # no llama_model_params field: --n-cpu-moe is tensor overrides built by the tools (common.h
        # llm_add_n_cpu_ffn_overrides, llama-bench's to_llama_mparams); the python engine builds the same
        c_api_by_worker="the override array of tensor_overrides, one pattern per layer (n_cpu_moe_patterns)",
        host_patterns=lambda s: n_cpu_moe_patterns(s.n_cpu_moe),
        # after -ot, as llama-bench merges them (the user's overrides first)
        flags=_all_tools(_value("--n-cpu-moe", unless=0, name="n_cpu_moe")),
        env=Env("LLAMA_ARG_N_CPU_MOE"),
        ollama=Ollama(160, note=lambda s, e: f"n_cpu_moe {s.n_cpu_moe} (experts of the first {s.n_cpu_moe} layers on the CPU): "
                      "ollama has no tensor placement option" if s.n_cpu_moe else None),
        # MoE only, and only when repeating layers are offloaded: counted from the first offloaded one
        search=Search(applies=lambda f, c: f.is_moe and _offloaded(f, c) >= 1 and _supported("n_cpu_moe")(f),
                      why_not=lambda f: ("a dense model has no expert tensors" if not f.is_moe
                                         else _no_device(f) if not f.devices
                                         else "the engine cannot set it: the experts_cpu placement stands in"),
                      ask=_ask_n_cpu_moe, params=_n_cpu_moe_params, fixed=lambda f, c: 0, depends_on=("n_gpu_layers",),
                      when="repeating layers are offloaded; counted from the first of them"),
    ),
    Dimension(
        "repack", "bool", True,
        model_level=True,
        option=Option(("--no-repack",), "Load without weight repacking (llama.cpp's extra CPU buffers: AMX, CPU_REPACK).",
                      switch=False),
        no_kwarg="llama_cpp.Llama has no keyword: tuner.Llama sets llama_model_params.use_extra_bufts around the load",
        # include/llama.h: "bool use_extra_bufts; // use extra buffer types (used for weight repacking)",
        # true in llama_model_default_params()
        c_api=CField("model", "use_extra_bufts", lambda s: s.repack),
        # common/arg.cpp: {"--repack"}, {"-nr", "--no-repack"}, set_env("LLAMA_ARG_REPACK");
        # llama-bench.cpp: "--repack <0|1>"
        flags={**_server_cli(_switch(["--no-repack"], False, "repack")), "llama-bench": _switch(["--repack", "0"], False, "repack")},
        env=Env("LLAMA_ARG_REPACK", "0"),
        ollama=Ollama(165, note=lambda s, e: "repack false (no weight repacking): no ollama parameter; "
                      "ollama's own llama.cpp decides its CPU buffers" if not s.repack else None),
        # only where it changes what llama.cpp loads: weights of a type this CPU repacks, held by the CPU
        search=Search(applies=lambda f, c: (len(f.domain("repack")) > 1 and _cpu_holds_weights(f, c)
                                            and c.get("model_path") in f.domain("repack_variants")),
                      why_not=lambda f: "no weight of this model is of a type this CPU repacks",
                      fixed=lambda f, c: f.domain("repack")[0] if f.domain("repack") else True,
                      depends_on=("model_path", "n_gpu_layers", "tensor_overrides", "n_cpu_moe"),
                      when="layers or tensors of a variant this CPU repacks are on the CPU"),
    ),
    Dimension(
        "rpc_servers", "endpoints", (),
        lmstudio=Foreign(note=_cannot("LM Studio", lambda s: f"rpc_servers {', '.join(s.rpc_servers)}" if s.rpc_servers else None)),
        kcpps=Foreign(note=_cannot("koboldcpp", lambda s: f"rpc_servers {', '.join(s.rpc_servers)}" if s.rpc_servers else None)),
        model_level=True,
        option=Option(("--rpc",), "RPC servers host:port,... used as devices.", parse=_endpoints),
        no_kwarg="registered as devices before the load (tuner.engine.rpc.register_servers)",
        c_api_by_worker="registered with ggml's RPC backend before the load",
        flags=_all_tools(lambda s, e: ["--rpc", ",".join(s.rpc_servers)] if s.rpc_servers else []),
        env=Env("LLAMA_ARG_RPC"),
        ollama=Ollama(150, note=lambda s, e: f"rpc_servers {', '.join(s.rpc_servers)}: ollama does not use llama.cpp RPC servers"
                      if s.rpc_servers else None),
        # the devices of the machine, not a choice: the space passes them through
        search=Search(applies=lambda f, c: False, fixed=lambda f, c: f.domain("rpc_servers")),
    ),
    Dimension(
        # after rpc_servers: llama.cpp resolves -dev names while parsing, and RPC devices exist once --rpc
        # (LLAMA_ARG_RPC, defined before LLAMA_ARG_DEVICE in common/arg.cpp) has registered them
        "devices", "devices", (),
        model_level=True,
        option=Option(("--device", "-dev"), "Devices to offload to, by llama.cpp's names (CUDA0,CUDA1; as --list-devices prints them).",
                      parse=_device_names),
        no_kwarg=("llama-cpp-python's Llama takes no device list (its llama_model_params.devices is unused): llama.cpp's "
                  "default selection picks the same devices on the machine that tuned (tuner.machine.devices.used_devices), "
                  "and tuner.Llama warns where it would not"),
        c_api_by_worker="a NULL-terminated ggml_backend_dev_t array llama_model_params.devices points at (ggml_backend_dev_by_name)",
        flags={
            **_server_cli(lambda s, e: ["-dev", ",".join(s.devices)] if s.devices else []),
            # llama-bench splits list arguments on ',' (one value per run): its devices are '/'-separated
            "llama-bench": lambda s, e: ["-dev", "/".join(s.devices)] if s.devices else [],
        },
        env=Env("LLAMA_ARG_DEVICE"),
        ollama=Ollama(155, note=lambda s, e: (
            f"devices {','.join(s.devices)}: ollama cannot be told which devices to use per model; it picks its GPUs "
            "itself (limit them with CUDA_VISIBLE_DEVICES, ROCR_VISIBLE_DEVICES or GGML_VK_VISIBLE_DEVICES where "
            "`ollama serve` runs)") if s.devices else None),
        # the devices llama.cpp will use on the machine (the space's), not a choice: passed through and recorded
        search=Search(applies=lambda f, c: False, fixed=lambda f, c: f.domain("devices")),
    ),
)

_BY_NAME = {d.name: d for d in DIMENSIONS}


def dimension(name: str) -> Dimension:
    return _BY_NAME[name]


def _ask_variant(asker: Asker, facts: Facts) -> str:
    from pathlib import Path

    variants = facts.domain("model_path")
    if len(variants) == 1:
        return variants[0]
    name = asker.suggest_categorical("variant", [Path(v).name for v in variants])
    return next(v for v in variants if Path(v).name == name)


def _variant_params(value: str, facts: Facts) -> dict[str, Any]:
    from pathlib import Path

    return {"variant": Path(value).name} if len(facts.domain("model_path")) > 1 else {}


def _ollama_kv_note(s: Any) -> str | None:
    if s.type_k == "f16" and s.type_v == "f16":
        return None
    if s.type_k != s.type_v:
        note = (f"type_k {s.type_k}, type_v {s.type_v}: ollama has one KV cache type for K and V, set server-wide "
                f"with OLLAMA_KV_CACHE_TYPE where `ollama serve` runs")
    else:
        note = f"type_k and type_v {s.type_k}: the KV cache type is server-wide in ollama: OLLAMA_KV_CACHE_TYPE={s.type_k} where `ollama serve` runs"
    if any(t not in OLLAMA_KV_TYPES for t in (s.type_k, s.type_v)):
        note += f" (it takes {', '.join(OLLAMA_KV_TYPES)})"
    return note


# ollama's OLLAMA_KV_CACHE_TYPE takes these (fs/ggml/ggml.go, 2026); f16 is its default.
OLLAMA_KV_TYPES = ("f16", "q8_0", "q4_0")

__all__ = [
    "DIMENSIONS", "Dimension", "Option", "CField", "Env", "Ollama", "Foreign", "Search", "Facts", "Export",
    "KV_CACHE_TYPES", "SPLIT_MODES", "FLASH_ATTN", "CLI_TOOLS", "UNQUANTIZED_KV", "OLLAMA_KV_TYPES",
    "ALL_LAYERS", "TRAINING_CONTEXT", "offloaded_layers", "offloaded_repeating_layers", "first_offloaded_layer",
    "gpu_layers_arg", "context_tokens", "flash_attn_forms", "FlashAttnForms", "load_mode", "LOAD_MODES",
    "n_cpu_moe_patterns", "FFN_EXPS_REGEX", "PLACEMENTS", "placement_patterns", "parse_placement", "split_from_counts",
    "counts_from_split", "dimension", "KCPPS_BATCH_SIZES", "KCPPS_KV_TYPES",
]
