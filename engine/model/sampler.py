"""Next-token sampling: logits processors (min_tokens, logit_bias, repetition, frequency
and presence penalties), then greedy, or temperature, min-p, top-k, top-p and a draw
with per-request seeds. Every step is a tensor op over the batch's rows (penalties
count tokens with one scatter over the batch, not a Python loop over the vocabulary).

Randomness is stateless: a request's k-th output token is drawn by the inverse CDF at
one uniform number made from token_seed(request seed, k). A request preempted and
recomputed (or swapped, or batched differently) therefore draws with the same number
for the same token, and a seeded request reproduces its output. Stop conditions are not handled
here (the scheduler and the detokenizer own them).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    seed: int  # the request's base seed (see request_seed)
    num_output_tokens: int  # tokens the request has generated so far
    # For the logits processors (the request's own lists, not copies):
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: tuple[int, ...] = ()
    grammar: Any = None  # the request's structured-output matcher (engine/text/structured.py)


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
    """logits: [num_rows, vocab] float32. Returns one token id per row. Rows with a
    grammar draw only tokens it allows, and it is told the token drawn."""
    tokens = sample_tokens(logits, rows).tolist()
    accept_tokens(rows, tokens)
    return tokens


def sample_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """sample's tokens as a tensor on the logits' device [num_rows] int64, without
    waiting for the device (async scheduling reads them a step later); the rows'
    grammars are told the tokens by accept_tokens once they are read."""
    grammars = [r.grammar for r in rows]
    if any(g is not None for g in grammars):
        from engine.text.structured import apply_grammars
        logits = logits.clone()  # the raw logits stay as they are, for logprobs
        apply_grammars(logits, grammars)
    return _choose(process_logits(logits, rows), rows)


def accept_tokens(rows: list[SamplingRow], tokens: list[int]) -> None:
    """Tell each row's grammar the token drawn for it."""
    for row, token in zip(rows, tokens):
        grammar = row.grammar
        if grammar is not None and not grammar.is_terminated():
            grammar.accept_token(token)


def _choose(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's token: the argmax, or for a row that samples a draw by the inverse of
    its filtered distribution's CDF at one uniform number from the row's token seed.
    One set of batched ops, however many rows draw, and nothing read back to the host
    (a GPU waits for the device once a step, when the ids are read, not once a row)."""
    greedy = [r.params.greedy for r in rows]
    tokens = logits.argmax(dim=-1)
    if not all(greedy):
        random_idx = [i for i, g in enumerate(greedy) if not g]
        probs = _filtered_probs(logits[random_idx], [rows[i].params for i in random_idx])
        uniforms = [uniform(token_seed(rows[i].seed, rows[i].num_output_tokens))
                    for i in random_idx]
        drawn = _inverse_cdf(probs, on_device(uniforms, probs.device, probs.dtype))
        tokens[on_device(random_idx, tokens.device)] = drawn
    return tokens


def uniform(seed: int) -> float:
    """A number in [0, 1) from a token seed (token_seed's 63 bits, the top 53 used)."""
    return (seed >> 10) * 2.0 ** -53


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of probs [rows, vocab]: the first token whose cumulative probability
    passes the row's uniform times the row's total (so rounding in the sum never runs
    past the last token; a token of probability 0 is never picked)."""
    cdf = probs.cumsum(dim=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]
    return picked.clamp_(max=probs.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, rows: list[SamplingRow],
                   tokens: list[int]) -> dict[int, list]:
    """For the rows whose request asked for logprobs: row index -> [the sampled token's
    log-probability, the ids of the `logprobs` most likely tokens, their
    log-probabilities], from the raw logits (log_softmax before any processor)."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return {}
    entries = logprobs_of(logits[wanted], [tokens[i] for i in wanted],
                          [rows[i].params.logprobs for i in wanted])
    return dict(zip(wanted, entries))


def logprobs_of(logits: torch.Tensor, targets: list[int], ks: list[int]) -> list[list]:
    """Per row of logits [rows, vocab]: [log-probability of its target token, the ids of
    its ks[row] most likely tokens, their log-probabilities], in one log_softmax, one
    gather and one topk for all rows."""
    logprobs = logits.float().log_softmax(dim=-1)
    index = on_device(targets, logits.device)
    chosen = logprobs.gather(1, index[:, None])[:, 0].tolist()
    k = max(ks)
    if k:
        top_values, top_ids = (t.tolist() for t in logprobs.topk(k, dim=-1))
    return [[chosen[j], top_ids[j][:n] if n else [], top_values[j][:n] if n else []]
            for j, n in enumerate(ks)]


def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The logits every way of choosing the token sees (greedy included), as vLLM orders
    them: min_tokens masks EOS and stop_token_ids, logit_bias adds its biases, then the
    repetition penalty (divides a positive logit, multiplies a negative one, for tokens of
    the prompt or the output), the frequency penalty (times the token's count in the
    output) and the presence penalty (once per token in the output). Returns logits
    itself when no row asks for any of these."""
    too_short = [i for i, r in enumerate(rows) if r.num_output_tokens < r.params.min_tokens]
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    penalised = [i for i, r in enumerate(rows) if r.params.penalised]
    if not (too_short or biased or penalised):
        return logits
    logits = logits.clone()
    device = logits.device
    if too_short:
        row_idx, token_idx = [], []
        for i in too_short:
            params = rows[i].params
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops.update(rows[i].eos_token_ids)
            row_idx += [i] * len(stops)
            token_idx += sorted(stops)
        logits[on_device(row_idx, device), on_device(token_idx, device)] = float("-inf")
    if biased:
        row_idx, token_idx, values = [], [], []
        for i in biased:
            bias = rows[i].params.logit_bias
            row_idx += [i] * len(bias)
            token_idx += list(bias)
            values += list(bias.values())
        index = (on_device(row_idx, device), on_device(token_idx, device))
        logits.index_put_(index, on_device(values, device, logits.dtype),
                          accumulate=True)
    if penalised:
        logits[penalised] = apply_penalties(logits[penalised], [rows[i] for i in penalised])
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties for every row at once."""
    num_rows, vocab = logits.shape
    device = logits.device
    output_counts = _token_counts([r.output_token_ids for r in rows], vocab, device)
    in_prompt = _token_counts([r.prompt_token_ids for r in rows], vocab, device) > 0
    in_output = output_counts > 0

    def column(values: list[float]) -> torch.Tensor:
        return on_device(values, device, logits.dtype)[:, None]

    repetition = column([r.params.repetition_penalty for r in rows]).expand(num_rows, vocab)
    repetition = torch.where(in_prompt | in_output, repetition, torch.ones_like(repetition))
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - column([r.params.frequency_penalty for r in rows]) * output_counts
    return logits - column([r.params.presence_penalty for r in rows]) * in_output


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[rows, vocab]: how often each token occurs in each row's list (one scatter_add
    over the lists padded with an extra column that is then dropped)."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        padded[i, :len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    padded = _moved_to(padded, device)
    counts = torch.zeros((len(token_lists), vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, then top-k, then top-p (vLLM's order), vectorised over
    rows."""
    temps = on_device([p.temperature for p in params], logits.device, logits.dtype)
    logits = logits / temps[:, None]
    min_p = [p.min_p for p in params]
    if max(min_p) > 0.0:
        probs = logits.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * on_device(
            min_p, logits.device, probs.dtype)[:, None]
        logits = logits.masked_fill(probs < floor, float("-inf"))
    vocab = logits.shape[-1]
    top_k = [min(p.top_k, vocab) if p.top_k is not None else vocab for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) < vocab or min(top_p) < 1.0:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = on_device(top_k, logits.device)[:, None]
        remove = ranks >= k  # beyond the k best
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the best
        # one is always kept).
        before = probs.cumsum(dim=-1) - probs
        p = on_device(top_p, logits.device, probs.dtype)[:, None]
        remove |= before >= p
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(1, sorted_idx, sorted_logits)
    return logits.softmax(dim=-1)


def on_device(values: list, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A list as a tensor on `device`. On CUDA through pinned memory, asynchronously: a
    copy from pageable memory would wait for everything the device has queued (with
    async scheduling, the next step's forward pass)."""
    return _moved_to(torch.tensor(values, dtype=dtype), device)


def _moved_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
