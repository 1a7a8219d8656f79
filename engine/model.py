"""A Llama-family decoder (Llama, Mistral, Qwen2) over the paged KV cache.

gpt-fast style, top-down: Transformer -> Block -> Attention / FeedForward -> RMSNorm,
rotary helpers. The batch is "varlen": the new tokens of every scheduled request are
concatenated into one [num_tokens] row (prefill chunks and decodes together, no
padding). Each layer writes its new K/V through the slot mapping and attends through
the block tables; that is the attention backend's job (engine/attention.py), the
model only computes q/k/v and hands them over.

Weights follow HF names through engine/loader.py, with q/k/v fused into one matrix
and gate/up into another, so a layer is five matmuls. The loader also reorders the
rows of q and k inside each head from HF's two rotary halves to interleaved pairs, so
RoPE is one complex multiplication (q.k is unchanged: both get the same order; the
KV cache holds K in this order).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionBackend

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Up to this many rows, kernels/csrc/small_gemm.cpp beats MKL on any x86 CPU (on Intel:
# 1.4x at 64 rows, 0.9x at 128: python -m kernels.bench_cpu gemm); above it, matmuls go
# to MKL unless the packed kernel measured faster at many rows too (on AMD: ~2x).
PACKED_MAX_ROWS = 96


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

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of "
                             f"n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r} "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


@dataclass(slots=True)
class StepContext:
    """What every layer of one forward pass shares."""
    rope: torch.Tensor  # [num_tokens, 1, head_dim // 2] complex64: e^(i * position * freq)
    kv_cache: torch.Tensor  # [n_layers, 2, num_blocks, block_size, n_kv_heads, head_dim]
    attention: AttentionBackend  # stores each layer's new K/V and attends through the tables
    plan: object  # the backend's per-step plan (gather indices, masks, ...)
    fused: object | None = None  # torch.ops.kvops when the fused CPU ops are on
    # [num_tokens, head_dim // 2, 2] float32 (cos, sin): set when RoPE and the K/V store
    # run as one fused op and the attention backend reads K/V back from the cache
    rope_pairs: torch.Tensor | None = None


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope: torch.Tensor | None = None  # [max_positions, head_dim // 2] complex64
        # torch.ops.kvops (kernels/cpu_ext.py) once use_cpu_kernels() turned them on
        self.fused_ops: object | None = None
        self.lm_head_packed: torch.Tensor | None = None  # lm_head's weight for packed_linear

    def use_cpu_kernels(self, ops: object, large_matmuls_packed: bool = False) -> None:
        """Run RMSNorm, residual adds and SwiGLU's gating as the fused float32 CPU ops
        of kernels/csrc/fused_ops.cpp, and few-row matmuls (decode steps, the LM head)
        with kernels/csrc/small_gemm.cpp on a packed copy of each weight (the runner
        calls this where they built). Many-row matmuls (prefill) go to the packed
        kernel too when large_matmuls_packed (the runner measures which is faster on
        this CPU: kernels.cpu_ext.matmul_choice), else to MKL on the plain layout. The
        plain copy of a weight that only the packed kernels read is freed (with
        large_matmuls_packed, all of them; the LM head's in any case, unless tied)."""
        self.fused_ops = ops
        max_rows = None if large_matmuls_packed else PACKED_MAX_ROWS
        for layer in self.layers:
            layer.attention.wqkv.use_packed(ops, max_rows)
            layer.attention.wo.use_packed(ops, max_rows)
            layer.feed_forward.use_packed(ops, max_rows)
        self.lm_head_packed = ops.pack_weight(self.lm_head.weight.detach().t().contiguous())
        if not self.args.tie_word_embeddings:  # (tied, it is the embedding table too)
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.new_empty(0, self.args.dim),
                                               requires_grad=False)

    def setup_rope(self, max_positions: int) -> None:
        """Precompute the rotations of positions [0, max_positions) on the weights' device."""
        device = self.embed_tokens.weight.device
        inv_freq = rope_inv_freq(self.args).to(device)  # [head_dim // 2]
        pos = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2], as HF
        self.rope = torch.polar(torch.ones_like(freqs), freqs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attention: AttentionBackend, plan: object,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens]; logits_indices: [num_sampled] rows whose
        next-token logits are wanted. Returns float32 logits [num_sampled, vocab_size]."""
        rope = self.rope[positions]  # [num_tokens, head_dim // 2] complex64
        ctx = StepContext(rope=rope[:, None, :], kv_cache=kv_cache, attention=attention,
                          plan=plan, fused=self.fused_ops)
        if ctx.fused is not None and getattr(attention, "native", False):
            ctx.rope_pairs = torch.view_as_real(rope).contiguous()
        h = self.embed_tokens(input_ids)  # [num_tokens, dim]
        if ctx.fused is not None:
            h = self._fused_layers(h, ctx)[logits_indices]  # [num_sampled, dim]
            return ctx.fused.packed_linear(h, self.lm_head_packed, self.args.vocab_size, None)
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, i)
        h = self.norm(h[logits_indices])  # [num_sampled, dim]: the other rows need no logits
        return self.lm_head(h).float()  # [num_sampled, vocab_size]

    def _fused_layers(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The layers with each residual add fused into the RMSNorm after it (the next
        layer's, and the final norm after the last). Returns the final-normed rows."""
        ops, eps = ctx.fused, self.args.norm_eps
        x = ops.rms_norm(h, self.layers[0].attention_norm.weight, eps)
        for i, layer in enumerate(self.layers):
            x = ops.add_rms_norm(h, layer.attention(x, ctx, i), layer.ffn_norm.weight, eps)
            after = self.layers[i + 1].attention_norm if i + 1 < len(self.layers) else self.norm
            x = ops.add_rms_norm(h, layer.feed_forward(x, ops), after.weight, eps)
        return x


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, h: torch.Tensor, ctx: StepContext, layer_idx: int) -> torch.Tensor:
        # In place: h is this forward pass's own residual stream.
        h.add_(self.attention(self.attention_norm(h), ctx, layer_idx))
        return h.add_(self.feed_forward(self.ffn_norm(h)))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        q_size, kv_size = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.wqkv = Linear(args.dim, q_size + 2 * kv_size, bias=args.qkv_bias)
        self.wo = Linear(q_size, args.dim, bias=args.o_bias)
        self.scale = args.head_dim ** -0.5

    def forward(self, x: torch.Tensor, ctx: StepContext, layer_idx: int) -> torch.Tensor:
        T, H, Hkv, D = x.shape[0], self.n_heads, self.n_kv_heads, self.head_dim
        qkv = self.wqkv(x)  # [T, (H + 2 * Hkv) * D]
        if ctx.rope_pairs is not None:  # RoPE, and k/v into the cache, in one fused op
            kv_layer = ctx.kv_cache[layer_idx]
            q = ctx.fused.rope_store_kv(qkv, ctx.rope_pairs, kv_layer, ctx.plan.slot_mapping,
                                        H, Hkv)  # [T, H, D]
            o = ctx.attention.attend(q, kv_layer, ctx.plan, self.scale)
            return self.wo(o.reshape(T, H * D))
        # RoPE on q and k together: they are adjacent in qkv.
        qk = apply_rope(qkv[:, :(H + Hkv) * D].view(T, H + Hkv, D), ctx.rope)
        q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, Hkv, D]
        v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)  # [T, Hkv, D]
        o = ctx.attention.forward(q, k, v, ctx.kv_cache[layer_idx], ctx.plan, self.scale)
        return self.wo(o.reshape(T, H * D))  # o: [T, H, D]


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.w_gate_up = Linear(args.dim, 2 * args.intermediate_size, bias=args.mlp_bias)
        self.w_down = Linear(args.intermediate_size, args.dim, bias=args.mlp_bias)
        # With the CPU kernels (use_packed): gate_up's weight packed for
        # kvops::packed_swiglu, which applies silu(gate) * up as it goes, so the
        # [T, 2 * intermediate] product is never written out; for up to
        # swiglu_max_rows rows (all, when None), MKL and silu_mul above that.
        self.packed_gate_up: torch.Tensor | None = None
        self.swiglu_max_rows: int | None = None

    def use_packed(self, ops: object, max_rows: int | None) -> None:
        self.packed_gate_up = ops.pack_gate_up(self.w_gate_up.weight_t.detach(),
                                               self.intermediate_size)
        self.swiglu_max_rows = max_rows
        if max_rows is None:  # packed_swiglu takes every row: w_gate_up is never called
            self.w_gate_up.drop_plain_weight()
        self.w_down.use_packed(ops, max_rows)

    def forward(self, x: torch.Tensor, fused: object | None = None) -> torch.Tensor:
        if fused is not None and self.packed_gate_up is not None and (
                self.swiglu_max_rows is None or x.shape[0] <= self.swiglu_max_rows):
            return self.w_down(fused.packed_swiglu(x, self.packed_gate_up,
                                                   self.intermediate_size, self.w_gate_up.bias))
        gate_up = self.w_gate_up(x)  # [T, 2 * intermediate]
        if fused is not None:
            return self.w_down(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.w_down(F.silu(gate).mul_(up))


class Linear(nn.Module):
    """x @ weight_t (+ bias) with the weight stored transposed, [in, out]: MKL's GEMM
    is up to twice as fast that way for the few-row matmuls of decoding (and no slower
    for prefill). The loader transposes HF's [out, in] weights once. With the CPU
    kernels on, inputs of up to packed_max_rows rows (all, when None) go to
    kvops::packed_linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.out_features = out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # weight_t in small_gemm's panel layout
        self.ops: object | None = None  # torch.ops.kvops, with packed
        self.packed_max_rows: int | None = PACKED_MAX_ROWS

    def use_packed(self, ops: object, max_rows: int | None = PACKED_MAX_ROWS) -> None:
        self.ops, self.packed = ops, ops.pack_weight(self.weight_t.detach())
        self.packed_max_rows = max_rows
        if max_rows is None:  # the packed kernel takes every matmul
            self.drop_plain_weight()

    def drop_plain_weight(self) -> None:
        """Free weight_t once nothing reads it: the packed copy is then the only one, and
        the weights take their size in memory once, not twice."""
        self.weight_t = nn.Parameter(self.weight_t.new_empty(self.weight_t.shape[0], 0),
                                     requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in]
        if self.packed is not None and (self.packed_max_rows is None
                                        or x.shape[0] <= self.packed_max_rows):
            return self.ops.packed_linear(x, self.packed, self.out_features, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As HF: normalise in float32, cast back, then scale. The norm is taken with
        # vector_norm (one pass, no temporary) rather than x.pow(2).mean().
        xf = x.float()
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        inv_rms = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(self.eps))
        return (xf * inv_rms).to(x.dtype).mul_(self.weight)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D] with rotary pairs interleaved (d = 2i, 2i + 1); rope:
    [T, 1, D // 2] complex. Returns a new [T, heads, D] tensor in x's dtype."""
    T, heads, D = x.shape
    pairs = torch.view_as_complex(x.float().reshape(T, heads, D // 2, 2))
    return torch.view_as_real(pairs * rope).view(T, heads, D).to(x.dtype)


def interleave_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the output rows of a q or k projection (weight [heads * D, in] or bias
    [heads * D]) from HF's halves (i, i + D/2) to interleaved pairs (2i, 2i + 1)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2) \
        .reshape(w.shape)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, computed as HF does for each type."""
    dim = args.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (args.rope_theta ** exponents)
    params = dict(args.rope_params)
    if args.rope_type == "linear":
        return inv_freq / params["factor"]
    if args.rope_type == "llama3":
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
