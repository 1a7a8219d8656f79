"""Next-token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Randomness is stateless: the noise for a request's k-th output token comes from a
generator seeded with token_seed(request seed, k). A request preempted and recomputed
(or swapped, or batched differently) therefore draws the same noise for the same
token, and a seeded request reproduces its output. Stop conditions are not handled
here (the scheduler and the detokenizer own them).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    seed: int  # the request's base seed (see request_seed)
    num_output_tokens: int  # tokens the request has generated so far


def request_seed(params: SamplingParams, engine_seed: int, request_id: str) -> int:
    """The request's own seed, else the engine seed mixed with its id (stable across
    runs, unlike hash())."""
    if params.seed is not None:
        return params.seed & _MASK64
    digest = hashlib.sha256(request_id.encode()).digest()
    return _splitmix64(engine_seed ^ int.from_bytes(digest[:8], "little"))


def token_seed(seed: int, num_output_tokens: int) -> int:
    """A well-mixed 63-bit seed for one token (torch seeds must fit an int64)."""
    return _splitmix64(_splitmix64(seed) ^ num_output_tokens) >> 1


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """logits: [num_rows, vocab] float32. Returns one token id per row."""
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()
    tokens = logits.argmax(dim=-1).tolist()
    random_idx = [i for i, g in enumerate(greedy) if not g]
    probs = _filtered_probs(logits[random_idx], [rows[i].params for i in random_idx])
    for j, i in enumerate(random_idx):
        tokens[i] = _draw(probs[j], token_seed(rows[i].seed, rows[i].num_output_tokens))
    return tokens


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p (HF's order), vectorised over rows."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype,
                         device=logits.device)
    logits = logits / temps[:, None]
    vocab = logits.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k is not None else vocab for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) < vocab or min(top_p) < 1.0:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.tensor(top_k, device=logits.device)[:, None]
        remove = ranks >= k  # beyond the k best
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the best
        # one is always kept).
        before = probs.cumsum(dim=-1) - probs
        p = torch.tensor(top_p, dtype=probs.dtype, device=logits.device)[:, None]
        remove |= before >= p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, sorted_idx, sorted_logits)
    return logits.softmax(dim=-1)


def _draw(probs: torch.Tensor, seed: int) -> int:
    """One draw from probs [vocab] with its own generator: argmax(p / E), E ~ Exp(1),
    picks token i with probability p_i."""
    generator = torch.Generator(device=probs.device).manual_seed(seed)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax())


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
