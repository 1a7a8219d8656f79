"""A stand-in model that keeps its state in the KV cache.

Slot p of a request holds digest(slot p-1, token p); the next token is a function of
the last slot, read back through the block table. So the output depends on every block
the request's table points at: a wrong table, a stale prefix hit, or a swap or
copy-on-write that copies nothing all change the tokens, which is what the tests of the
KV core need. It never emits EOS and ignores sampling settings.
"""
from __future__ import annotations

import array

import time

from engine.model.runner import Runner, StepResult
from engine.sched.output import SchedulerOutput

_MASK = (1 << 64) - 1
_SEED = 0x9E3779B97F4A7C15


def digest(prev: int, token: int) -> int:
    """splitmix64 of (prev, token): 64 well-mixed bits."""
    z = (prev ^ (token * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB)) & _MASK
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def next_token(slot_value: int, vocab_size: int, avoid: frozenset[int] = frozenset()) -> int:
    """The token after a slot: its value mod the vocabulary, stepping past `avoid` (the
    tokenizer's EOS ids: the stand-in never ends a request early)."""
    token = slot_value % vocab_size
    while token in avoid:
        token = (token + 1) % vocab_size
    return token


def reference_generate(token_ids: list[int], max_tokens: int, vocab_size: int,
                       avoid: frozenset[int] = frozenset()) -> list[int]:
    """What the stand-in model must produce, computed without any cache."""
    state = _SEED
    for t in token_ids:
        state = digest(state, t)
    out = []
    for _ in range(max_tokens):
        t = next_token(state, vocab_size, avoid)
        out.append(t)
        state = digest(state, t)
    return out


class SimulatedRunner(Runner):
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 vocab_size: int, max_model_len: int, step_ms: float = 0.0,
                 token_us: float = 0.0, sliding_window: int | None = None,
                 hybrid: bool = False, avoid: frozenset[int] = frozenset(),
                 kv_bytes_per_token: int = 0) -> None:
        # Pacing: a step takes at least step_s + token_s per computed token, like a GPU
        # whose prefill cost grows with the tokens (so prefix-cache hits save time).
        self.step_s = step_ms / 1000.0
        self.token_s = token_us / 1e6
        # What a real model's K/V weighs per token (2 x layers x KV heads x head size x
        # dtype bytes): a request that moves to another engine carries this many bytes
        # per token more (engine/transfer/link.py), so that moves cost what a model's do
        self.kv_bytes_per_token = kv_bytes_per_token
        self.model_id = f"simulated-v1:vocab={vocab_size}"
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size
        self.block_bytes = block_size * 8  # one 64-bit state per slot
        self.vocab_size = vocab_size
        self.avoid = avoid  # tokens it never samples (next_token)
        self.max_model_len = max_model_len
        self.device = "simulated"
        self.dtype = "uint64"
        self.kv_format = f"uint64+{kv_bytes_per_token}"
        # The stand-in reads only the slot before a request's first new token, so any
        # window of 2 or more gives the same tokens; it makes the KV manager free blocks
        # as a sliding-window model's would (capacity planning, tests)
        self.sliding_window = sliding_window
        if hybrid:  # global layers too: a table per layer group (engine/kv/layout.py)
            self.kv_group_windows, self.sliding_window = (None, sliding_window), None
        # One 64-bit state per token slot: [num_blocks * block_size]. Python lists, not
        # numpy arrays: the step reads and writes single slots, which a list does several
        # times faster (this loop is part of every simulated step's time).
        self.gpu_cache = [0] * (num_gpu_blocks * block_size)
        self.cpu_cache = [0] * (num_cpu_blocks * block_size)

    def forward(self, out: SchedulerOutput) -> StepResult:
        started = time.monotonic()
        result = self._forward(out)
        if self.step_s or self.token_s:
            budget = self.step_s + self.token_s * out.num_batched_tokens
            time.sleep(max(0.0, budget - (time.monotonic() - started)))
        return result

    def _forward(self, out: SchedulerOutput) -> StepResult:
        cache, bs, vocab, avoid = self.gpu_cache, self.block_size, self.vocab_size, self.avoid
        result = StepResult()
        sampled = result.tokens
        # Batch order matters: a request may hit blocks another one fills in this step,
        # and it was scheduled after it (as a layer writes all K/V before attending).
        if out.group_block_ids is not None:
            return self._forward_groups(out)
        for s in out.scheduled:
            tokens, ids, start = s.request.all_token_ids, s.block_ids, s.start
            if start == 0:
                prev = _SEED
            else:
                before = start - 1
                prev = cache[ids[before // bs] * bs + before % bs]
            for p in range(start, start + s.num_new_tokens):
                prev = digest(prev, tokens[p])
                cache[ids[p // bs] * bs + p % bs] = prev
            if s.samples:  # `prev` is the last slot's value, as just written
                token = prev % vocab  # next_token, inlined: this loop is the step's time
                if avoid and token in avoid:
                    token = next_token(prev, vocab, avoid)
                sampled[s.request.request_id] = token
                if s.request.sampling_params.logprobs is not None:
                    self._logprobs(result, s.request, token)
        return result

    @staticmethod
    def _logprobs(result: StepResult, request, token: int) -> None:
        """The stand-in model is deterministic: its token has probability 1."""
        top = request.sampling_params.logprobs
        result.logprobs[request.request_id] = [0.0, [token] if top else [],
                                               [0.0] if top else []]

    def _forward_groups(self, out: SchedulerOutput) -> StepResult:
        """_forward with a block table per layer group: each group's slots hold the
        states too, and the slot before a request's new tokens must hold the same state
        in every group's table (else a group's K/V was lost or mixed up)."""
        cache, bs, vocab, avoid = self.gpu_cache, self.block_size, self.vocab_size, self.avoid
        result = StepResult()
        sampled = result.tokens
        for s in out.scheduled:
            tokens, start, rid = s.request.all_token_ids, s.start, s.request.request_id
            tables = out.group_block_ids[rid]
            if start == 0:
                prev = _SEED
            else:
                before = start - 1
                seen = {cache[ids[before // bs] * bs + before % bs] for ids in tables}
                if len(seen) != 1:
                    raise RuntimeError(f"invariant: the layer groups of {rid} hold different "
                                       f"states at position {before}")
                prev = seen.pop()
            for p in range(start, start + s.num_new_tokens):
                prev = digest(prev, tokens[p])
                for ids in tables:
                    cache[ids[p // bs] * bs + p % bs] = prev
            if s.samples:
                token = prev % vocab
                if avoid and token in avoid:
                    token = next_token(prev, vocab, avoid)
                sampled[rid] = token
                if s.request.sampling_params.logprobs is not None:
                    self._logprobs(result, s.request, token)
        return result

    def _copy(self, src: list[int], dst: list[int], mapping: list[tuple[int, int]]) -> None:
        bs = self.block_size
        # Every source is read before any destination is written (a copy may chain).
        blocks = [src[a * bs:(a + 1) * bs] for a, _ in mapping]
        for (_, b), block in zip(mapping, blocks):
            dst[b * bs:(b + 1) * bs] = block

    def read_blocks(self, block_ids: list[int]) -> list[list[int]]:
        bs, cache = self.block_size, self.gpu_cache
        return [cache[b * bs:(b + 1) * bs] for b in block_ids]

    def write_blocks(self, block_ids: list[int], data: list[list[int]]) -> None:
        bs, cache = self.block_size, self.gpu_cache
        for b, block in zip(block_ids, data, strict=True):
            cache[b * bs:(b + 1) * bs] = block

    def blocks_to_frames(self, data: list[list[int]]) -> tuple[dict, list]:
        header, frames = Runner.blocks_to_frames(data)
        if self.kv_bytes_per_token:  # (a model's weight of K/V, written as a copy would)
            frames.append(bytearray(len(data) * self.block_size * self.kv_bytes_per_token))
        return header, frames

    def blocks_from_frames(self, header: object, frames: list, most: int) -> list[list[int]]:
        data = Runner.blocks_from_frames(self, header, frames, most)
        weight = memoryview(frames[1]).nbytes if len(frames) > 1 else 0
        if weight != len(data) * self.block_size * self.kv_bytes_per_token:
            raise ValueError("blocks of another K/V size per token do not fit this engine")
        return data

    def read_pool_block(self, pool: str, block_id: int) -> bytes:
        bs, cache = self.block_size, self._pool(pool)
        return array.array("Q", cache[block_id * bs:(block_id + 1) * bs]).tobytes()

    def write_pool_block(self, pool: str, block_id: int, data: bytes) -> None:
        bs = self.block_size
        states = array.array("Q")
        states.frombytes(data)
        if len(states) != bs:
            raise ValueError(f"a block of {len(states)} states; this engine's hold {bs}")
        self._pool(pool)[block_id * bs:(block_id + 1) * bs] = states.tolist()

    def _pool(self, pool: str) -> list[int]:
        return {"gpu": self.gpu_cache, "cpu": self.cpu_cache}[pool]

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        self._copy(self.gpu_cache, self.cpu_cache, mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        self._copy(self.cpu_cache, self.gpu_cache, mapping)

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        # Fancy indexing reads every source before writing any destination.
        self._copy(self.gpu_cache, self.gpu_cache, mapping)
