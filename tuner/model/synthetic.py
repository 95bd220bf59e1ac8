"""A ``ModelInfo`` from hyperparameters alone, for when there is no GGUF file to read.

A pasted llama.cpp log states a model's shape (``print_info: n_layer = 32``, ``n_embd``, ``n_head``,
``n_head_kv``, ``n_ff``, ``n_expert``, ``n_vocab``...) but not its tensor table. This builds the
tensor table of a llama-family transformer of that shape (the layout ``model/make.py`` writes and
llama.cpp's ``llama``/``qwen``/``mistral`` architectures load: attention Q/K/V/O, gated FFN or
stacked experts, RMS norms, token embedding and output head), so the memory arithmetic and the
quantization table can work from a log. For other architectures it is an approximation of the same
size, which callers must say.
"""

from __future__ import annotations

from .inspect import KV_TYPE_BLOCKS, ModelInfo, TensorInfo, _row_size
from .quant import tensor_bytes, with_tensors


def llama_like(
    *,
    n_layer: int,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    n_ff: int,
    n_vocab: int,
    n_expert: int = 0,
    n_expert_used: int = 0,
    n_ff_exp: int | None = None,
    n_expert_shared: int = 0,
    head_dim: int | None = None,
    n_ctx_train: int = 4096,
    tied_embeddings: bool = False,
    weight_type: str = "F16",
    architecture: str = "llama",
    name: str | None = None,
) -> ModelInfo:
    """A model of this shape with every 2-d weight in ``weight_type`` and 1-d tensors in F32.

    A mixture of experts has ``n_expert`` experts of ``n_ff_exp`` (default ``n_ff``) per layer, and
    ``n_expert_shared`` shared experts of that size beside them (``ffn_*_shexp``)."""
    if min(n_layer, n_embd, n_head, n_vocab) <= 0 or n_head_kv < 0 or n_ff < 0:
        raise ValueError("n_layer, n_embd, n_head and n_vocab must be positive")
    hd = head_dim or n_embd // n_head
    q_dim, kv_dim = n_head * hd, n_head_kv * hd
    tensors: list[TensorInfo] = []

    def add(tensor_name: str, *shape: int, ggml_type: str | None = None) -> None:
        kind = ggml_type or ("F32" if len(shape) == 1 else weight_type)
        n = 1
        for d in shape:
            n *= d
        tensors.append(TensorInfo(tensor_name, kind, tuple(shape), tensor_bytes(kind, shape), n))

    add("token_embd.weight", n_embd, n_vocab)
    for i in range(n_layer):
        add(f"blk.{i}.attn_norm.weight", n_embd)
        add(f"blk.{i}.attn_q.weight", n_embd, q_dim)
        add(f"blk.{i}.attn_k.weight", n_embd, kv_dim)
        add(f"blk.{i}.attn_v.weight", n_embd, kv_dim)
        add(f"blk.{i}.attn_output.weight", q_dim, n_embd)
        add(f"blk.{i}.ffn_norm.weight", n_embd)
        if n_expert:
            ff = n_ff_exp or n_ff
            add(f"blk.{i}.ffn_gate_inp.weight", n_embd, n_expert, ggml_type="F32")
            add(f"blk.{i}.ffn_gate_exps.weight", n_embd, ff, n_expert)
            add(f"blk.{i}.ffn_up_exps.weight", n_embd, ff, n_expert)
            add(f"blk.{i}.ffn_down_exps.weight", ff, n_embd, n_expert)
            if n_expert_shared:
                add(f"blk.{i}.ffn_gate_shexp.weight", n_embd, ff * n_expert_shared)
                add(f"blk.{i}.ffn_up_shexp.weight", n_embd, ff * n_expert_shared)
                add(f"blk.{i}.ffn_down_shexp.weight", ff * n_expert_shared, n_embd)
        else:
            add(f"blk.{i}.ffn_gate.weight", n_embd, n_ff)
            add(f"blk.{i}.ffn_up.weight", n_embd, n_ff)
            add(f"blk.{i}.ffn_down.weight", n_ff, n_embd)
    add("output_norm.weight", n_embd)
    if not tied_embeddings:
        add("output.weight", n_embd, n_vocab)

    kv_layers = tuple(range(n_layer)) if n_head_kv else ()
    base = ModelInfo(
        path=name or f"{architecture}-{n_layer}x{n_embd}", architecture=architecture, name=name, n_layer=n_layer,
        n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, n_head_kv_per_layer=(n_head_kv,) * n_layer,
        head_size_k=hd, head_size_v=hd, n_ctx_train=n_ctx_train, n_vocab=n_vocab, n_ff=n_ff,
        expert_count=n_expert, expert_used_count=n_expert_used, file_type=None, quantization=weight_type,
        n_params=sum(t.n_elements for t in tensors), file_size=0, n_tensors=len(tensors), split_count=1,
        layer_bytes=(), nonrepeating_bytes={}, kv_bytes_per_token={}, kv_layers=kv_layers, sliding_window=None,
        swa_layers=(), header_hash="", tensors=(),
    )
    info = with_tensors(base, tensors, weight_type, file_size=sum(t.n_bytes for t in tensors))
    kv = {kind: n_layer * (_row_size(kind, kv_dim) * 2)
          for kind in KV_TYPE_BLOCKS if kv_dim and kv_dim % KV_TYPE_BLOCKS[kind][0] == 0}
    object.__setattr__(info, "kv_bytes_per_token", kv)
    return info
