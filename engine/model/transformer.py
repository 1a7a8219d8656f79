"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over the paged KV cache.

gpt-fast style, top-down: Transformer -> Block -> Attention / FeedForward -> RMSNorm,
rotary helpers. The batch is "varlen": the new tokens of every scheduled request are
concatenated into one [num_tokens] row (prefill chunks and decodes together, no
padding). Each layer writes its new K/V through the slot mapping and attends through
the block tables; that is the attention backend's job (engine/model/ops/attention.py).

The layers hold weights and say what is computed; how is the ops object's
(engine/model/ops/torch_ops.py: plain torch by default, the C++ CPU kernels of engine/model/ops/cpu_ops.py
where the runner picks them). There is one forward path whatever the ops.

Weights follow HF names through engine/model/loader.py, with q/k/v fused into one matrix
and gate/up into another, so a layer is five matmuls. The loader also reorders the
rows of q and k inside each head from HF's two rotary halves to interleaved pairs, so
RoPE is one complex multiplication (q.k is unchanged: both get the same order; the
KV cache holds K in this order; a per-head q/k norm's weight is reordered alike).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.ops.attention import AttentionBackend
from engine.model.ops.torch_ops import ACTIVATIONS, TORCH_OPS, TorchOps, rms_norm, soft_cap

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    vocab_size: int
    dim: int  # hidden size
    intermediate_size: int
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA when < n_heads)
    head_dim: int
    norm_eps: float
    rope_theta: float
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    rope_params: tuple[tuple[str, float], ...]  # the scaling fields of that rope type
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama with attention_bias
    o_bias: bool  # Llama with attention_bias (Qwen2 has none on o_proj)
    mlp_bias: bool
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm on each q and k head before RoPE
    activation: str = "silu"  # the MLP's gate activation (one of engine.ops.ACTIVATIONS)
    # Gemma: norms scale by 1 + weight, each sublayer's output is normed too
    # ("sandwich"), the embeddings are scaled by sqrt(dim)
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    attn_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    # Per layer: its sliding window in tokens (a query sees itself and window - 1
    # tokens back), 0 for a global layer; () when every layer is global.
    layer_windows: tuple[int, ...] = ()
    # Gemma 3: the sliding layers' own RoPE (theta, type, params); None: the same as
    # the global layers'
    local_rope: tuple | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE): n_experts > 0; each token goes to the
    # top n_experts_per_tok experts by router softmax, their weights renormalised to
    # sum to 1 when moe_renormalize. moe_layers: per layer, whether its MLP is the
    # experts (() : every layer's is)
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True
    moe_layers: tuple[bool, ...] = ()

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_experts > 0 and (not self.moe_layers or self.moe_layers[layer_idx])

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for rope_type in {self.rope_type, (self.local_rope or (0, "default"))[1]}:
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope type {rope_type!r} "
                                 f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        if self.layer_windows and len(self.layer_windows) != self.n_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.n_layers} layers")
        if self.n_experts and not 0 < self.n_experts_per_tok <= self.n_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.n_experts}], "
                             f"got {self.n_experts_per_tok}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r} "
                             f"(supported: {', '.join(ACTIVATIONS)})")


@dataclass(slots=True)
class StepContext:
    """What every layer of one forward pass shares."""
    rope: list  # per rotation table, ops.rope_rows of it at this step's positions
    # [slots, 2, num_blocks, block_size, n_kv_heads, head_dim]: a layer's K/V at its slot
    # (Attention.kv_slot: the layer's index, or its place in its layer group)
    kv_cache: torch.Tensor
    attention: AttentionBackend  # stores each layer's new K/V and attends through the tables
    # the backend's per-step plan (gather indices, masks, ...) of each layer group's
    # block tables (Attention.kv_group; one for a model with one table)
    plans: list
    ops: TorchOps  # how each layer's arithmetic runs (engine/model/ops/torch_ops.py)
    tp: object | None = None  # engine.parallel.TensorParallel when split across ranks
    # an fp8 cache's scales (kernels/fp8.py): [n_layers, 2 (K, V), n_kv_heads] float32
    kv_scales: torch.Tensor | None = None

    def kv_scale(self, layer_idx: int) -> torch.Tensor | None:
        """Layer layer_idx's [2, n_kv_heads] K and V scales; None: not an fp8 cache."""
        return None if self.kv_scales is None else self.kv_scales[layer_idx]


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, tp: object | None = None) -> None:
        """args: this rank's share when tp (engine.parallel.TensorParallel) is given;
        the embedding and the LM head then hold this rank's slice of the vocabulary."""
        super().__init__()
        self.args, self.tp = args, tp
        # rows of the embedding and the LM head here (tp: a slice of the padded vocabulary)
        self.vocab_rows = -(-args.vocab_size // tp.size) if tp else args.vocab_size
        self.embed_tokens = nn.Embedding(self.vocab_rows, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.lm_head = nn.Linear(args.dim, self.vocab_rows, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Rotation tables, [max_positions, head_dim // 2] complex64 each: the global
        # layers', then the sliding layers' where theirs differ (Attention.rope_index)
        self.ropes: list[torch.Tensor] = []

    def setup_rope(self, max_positions: int) -> None:
        """Precompute the rotations of positions [0, max_positions) on the weights' device."""
        device = self.embed_tokens.weight.device
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        a = self.args
        self.ropes = []
        for theta, rope_type, params in [(a.rope_theta, a.rope_type, a.rope_params)] + (
                [a.local_rope] if a.local_rope else []):
            self.ropes.append(rope_table(pos, a.head_dim, theta, rope_type, params))

    def set_kv_layout(self, layout: object) -> None:
        """Where each layer's K/V lives (engine/kv/layout.py's KVLayout): its group's
        block table, at its slot of the group's blocks."""
        for layer, group, slot in zip(self.layers, layout.layer_group, layout.layer_slot):
            layer.attention.kv_group, layer.attention.kv_slot = group, slot

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attention: AttentionBackend, plan: object, logits_indices: torch.Tensor,
                ops: TorchOps = TORCH_OPS, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; logits_indices: [num_sampled] rows whose
        next-token logits are wanted; plan: the attention backend's plan, or a list of
        them, one per layer group; kv_scales: an fp8 cache's (StepContext). Returns
        float32 logits [num_sampled, vocab_size].

        Each residual add is fused with the norm after it (ops.add_rms_norm: the MLP's
        input norm, or the next layer's); the last layer's MLP output is added alone,
        and the final norm and the LM head see only the rows that sample."""
        ctx = StepContext(rope=[ops.rope_rows(t, positions) for t in self.ropes],
                          kv_cache=kv_cache, attention=attention,
                          plans=plan if isinstance(plan, list) else [plan], ops=ops, tp=self.tp,
                          kv_scales=kv_scales)
        h = self._embed(input_ids)  # [num_tokens, dim]: the residual stream
        if self.args.scale_embeddings:  # Gemma: by sqrt(dim), rounded to the dtype first
            h.mul_(torch.tensor(self.args.dim ** 0.5, dtype=h.dtype))
        x = ops.rms_norm(h, self.layers[0].attention_norm)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(h, x, ctx, i, self.layers[i + 1].attention_norm if i < last else None)
        x = ops.rms_norm(h[logits_indices], self.norm)  # [num_sampled, dim]
        logits = ops.lm_head(x, self)
        if self.tp is not None:  # each rank has its slice of the vocabulary
            logits = self.tp.all_gather_last(logits)[:, :self.args.vocab_size]
        return soft_cap(logits, self.args.final_softcap)  # [num_sampled, vocab]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.embed_tokens(input_ids)
        local = input_ids - self.tp.rank * self.vocab_rows  # rows of this rank's slice
        outside = (local < 0) | (local >= self.vocab_rows)
        h = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0.0))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int) -> None:
        super().__init__()
        norm = lambda: RMSNorm(args.dim, args.norm_eps, args.norm_offset)  # noqa: E731
        self.attention_norm = norm()
        self.attention = Attention(args, layer_idx)
        self.ffn_norm = norm()
        self.feed_forward = MoE(args) if args.is_moe_layer(layer_idx) else FeedForward(args)
        # Gemma: the attention's and the MLP's outputs are normed before the residual add
        self.post_attention_norm = norm() if args.sandwich_norms else None
        self.post_ffn_norm = norm() if args.sandwich_norms else None

    def forward(self, h: torch.Tensor, x: torch.Tensor, ctx: StepContext, layer_idx: int,
                next_norm: "RMSNorm | None") -> torch.Tensor:
        """h: the residual stream (updated in place); x: this layer's normed input.
        Returns next_norm(h) after this layer, or h itself when next_norm is None."""
        ops, tp = ctx.ops, ctx.tp
        delta = self.attention(x, ctx, layer_idx)
        if tp is not None:  # each rank's heads' part of o_proj: summed
            tp.all_reduce(delta)
        if self.post_attention_norm is not None:
            delta = ops.rms_norm(delta, self.post_attention_norm)
        x = ops.add_rms_norm(h, delta, self.ffn_norm)
        delta = self.feed_forward(x, ops)
        if tp is not None:
            tp.all_reduce(delta)
        if self.post_ffn_norm is not None:
            delta = ops.rms_norm(delta, self.post_ffn_norm)
        if next_norm is None:
            return h.add_(delta)
        return ops.add_rms_norm(h, delta, next_norm)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_size, kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv = Linear(args.dim, q_size + 2 * kv_size, bias=args.qkv_bias)
        self.wo = Linear(q_size, args.dim, bias=args.o_bias)
        self.scale = args.attn_scale or args.head_dim ** -0.5
        self.softcap = args.attn_softcap
        self.window = (args.layer_windows[layer_idx] if args.layer_windows else 0) or None
        self.kv_group, self.kv_slot = 0, layer_idx  # (Transformer.set_kv_layout)
        # the sliding layers of a model with a local RoPE use the second table
        self.rope_index = int(self.window is not None and args.local_rope is not None)
        # Qwen3, Gemma 3: RMSNorm over each q and k head before RoPE
        head_norm = lambda: RMSNorm(args.head_dim, args.norm_eps, args.norm_offset)  # noqa: E731
        self.q_norm = head_norm() if args.qk_norm else None
        self.k_norm = head_norm() if args.qk_norm else None

    def forward(self, x: torch.Tensor, ctx: StepContext, layer_idx: int) -> torch.Tensor:
        ops = ctx.ops
        qkv = ops.linear(x, self.wqkv)  # [T, (H + 2 * Hkv) * D]
        if self.q_norm is not None:
            ops.head_norm(qkv, self)
        return ops.linear(ops.attention(qkv, self, ctx, layer_idx), self.wo)


class FeedForward(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.activation = args.activation
        self.w_gate_up = Linear(args.dim, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.w_down = Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return ops.linear(ops.gate_up_act(x, self), self.w_down)


class MoE(nn.Module):
    """Mixture of experts: a router picks each token's top-k experts, each a gated
    MLP; their outputs are summed with the routing weights (ops.moe runs them grouped
    by expert). Expert weights are stacked and stored transposed, as Linear's."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_experts, self.top_k = args.n_experts, args.n_experts_per_tok
        self.renormalize = args.moe_renormalize
        self.intermediate_size = inter = args.moe_intermediate_size
        self.activation = args.activation
        self.router = Linear(args.dim, args.n_experts, bias=False)
        self.experts_gate_up = nn.Parameter(torch.empty(args.n_experts, args.dim, 2 * inter))
        self.experts_down = nn.Parameter(torch.empty(args.n_experts, inter, args.dim))

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        return ops.moe(x, self)


class Linear(nn.Module):
    """A weight stored transposed, [in, out] (+ bias): MKL's GEMM is up to twice as fast
    that way for the few-row matmuls of decoding (and no slower for prefill). The
    loader transposes HF's [out, in] weights once; ops.linear multiplies."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def drop_plain_weight(self) -> None:
        """Free weight_t once no ops read it (an ops object that keeps its own copy, as
        CpuKernelOps does): the weights then take their size in memory once, not twice."""
        self.weight_t = nn.Parameter(self.weight_t.new_empty(self.in_features, 0),
                                     requires_grad=False)


class RMSNorm(nn.Module):
    """A norm's weight and eps; ops.rms_norm computes it. offset: Gemma stores w - 1 and
    scales by 1 + w."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)


def interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q or k projection (weight [heads * D, in] or bias
    [heads * D]) from HF's halves (i, i + D/2) to interleaved pairs (2i, 2i + 1)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2) \
        .reshape(w.shape)


def rope_table(pos: torch.Tensor, dim: int, theta: float, rope_type: str,
               rope_params: tuple[tuple[str, object], ...]) -> torch.Tensor:
    """e^(i * position * freq) for positions `pos` (float32): [len(pos), dim // 2]
    complex64, as HF computes cos and sin.

    longrope (Phi-3 128k, Phi-3.5): positions before original_max_position_embeddings
    rotate by the short factors, later ones by the long factors, all scaled by
    attention_factor. transformers switches every position of a sequence to the long
    factors once it passes that length (re-rotating keys already used); here each
    position keeps one rotation, so a cached key never changes. Below that length the
    two agree exactly."""
    if rope_type == "longrope":
        p = dict(rope_params)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
        short, long = (1.0 / (torch.tensor(p[f], dtype=torch.float32) * theta ** exponents)
                       for f in ("short_factor", "long_factor"))
        before = (pos < p["original_max_position_embeddings"])[:, None]
        freqs = pos[:, None] * torch.where(before, short.to(pos.device), long.to(pos.device))
        return torch.polar(torch.full_like(freqs, p["attention_factor"]), freqs)
    inv_freq = rope_inv_freq(dim, theta, rope_type, rope_params).to(pos.device)
    freqs = pos[:, None] * inv_freq[None, :]  # [len(pos), dim // 2], as HF
    return torch.polar(torch.ones_like(freqs), freqs)


def rope_inv_freq(dim: int, theta: float, rope_type: str,
                  rope_params: tuple[tuple[str, float], ...]) -> torch.Tensor:
    """[dim // 2] float32 inverse frequencies, computed as HF does for each type."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (theta ** exponents)
    params = dict(rope_params)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, float]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by `factor`,
    short ones kept, the band between interpolated smoothly."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
