"""An fp8 K/V cache's scales ([n_layers, 2, n_kv_heads] float32, kernels/fp8.py): 1
("unit", as vLLM without scales in the checkpoint), or calibrated once at start-up on
a fixed text (kernels/fp8.CALIBRATION_TEXT, and seeded tokens spread over the
vocabulary): the largest |K| and |V| each layer writes, per layer ("tensor") or per KV
head ("head"), fitted into the format with 2x headroom, as powers of two. The same
model and dtype get the same scales at every start (a disk tier written before a
restart reads back alike)."""
from __future__ import annotations

import zlib
from collections.abc import Callable

import torch

from engine.model.ops.attention import AttentionBatch
from kernels.fp8 import CALIBRATION_TEXT, scales_for

# runs token sequences through the model against a scratch cache of a dtype, through
# an attention backend (the runner's scratch forward pass)
ScratchForward = Callable[[list[list[int]], object, torch.dtype], None]


def unit_scales(n_layers: int, n_kv_heads: int, device: torch.device) -> torch.Tensor:
    """Scales of 1 for every layer's K and V, per KV head (this rank's)."""
    return torch.ones(n_layers, 2, n_kv_heads, device=device)


def calibration_sequences(tokenizer, vocab_size: int, max_model_len: int) -> list[list[int]]:
    """The text, and tokens spread over the vocabulary (a model whose tokenizer reads
    the text as unknown words still sees its real embeddings)."""
    text = tokenizer.encode(CALIBRATION_TEXT)[:max_model_len]
    spread = torch.randint(vocab_size, (min(256, max_model_len),),
                           generator=torch.Generator().manual_seed(0)).tolist()
    return [text, spread]


def calibrate(granularity: str, sequences: list[list[int]], attention: object,
              forward: ScratchForward, model_dtype: torch.dtype,
              kv_dtype: torch.dtype) -> torch.Tensor:
    """The scales ("tensor" or "head" granularity) of the largest |K| and |V| each layer
    writes while `forward` runs `sequences` through `attention`."""
    recorder = _AmaxRecorder(attention)
    # through a cache of the model's dtype: each layer sees the K/V the model makes,
    # not what an fp8 cache at scale 1 would have clamped or flushed
    forward(sequences, recorder, model_dtype)
    amax = torch.stack(recorder.amax)  # [n_layers, 2, n_kv_heads]
    if granularity == "tensor":
        amax = amax.amax(dim=-1, keepdim=True).expand_as(amax)
    return scales_for(amax, kv_dtype).contiguous()


def kv_format_of(kv_dtype: torch.dtype, granularity: str, scales: torch.Tensor | None) -> str:
    """The dtype's name; for fp8, with its scales' granularity and a digest of their
    values: fp8 blocks read alike only under the same scales."""
    name = str(kv_dtype).removeprefix("torch.")
    if scales is None:
        return name
    digest = zlib.crc32(scales.detach().cpu().numpy().tobytes())
    return f"{name}/{granularity}:{digest:08x}"


class _AmaxRecorder:
    """An attention backend that notes the largest |K| and |V| (per KV head) of each
    layer it stores, in call order (layer 0 first), and leaves the rest to `inner`."""

    def __init__(self, inner: object) -> None:
        self.inner, self.name = inner, inner.name
        self.amax: list[torch.Tensor] = []

    def plan(self, batch: AttentionBatch) -> object:
        return self.inner.plan(batch)

    def forward(self, q, k, v, kv_layer, plan, scale, window=None, softcap=None, kv_scale=None):
        self.amax.append(torch.stack((k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2)))).float())
        return self.inner.forward(q, k, v, kv_layer, plan, scale, window=window,
                                  softcap=softcap, kv_scale=kv_scale)
