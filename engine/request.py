"""A request's life inside the engine: tokens, progress, and status."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.block_hash import BlockHash, hash_blocks
from engine.sampling_params import SamplingParams


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    index: int  # small engine-wide number; snapshots use it as the block owner id (>= 1)
    root_hash: BlockHash  # parent hash of block 0 (model identity + cache salt)
    block_size: int
    priority: int = 0  # lower runs first under the priority policy
    job_id: str | None = None  # the service's job, for the dashboard
    # who asked, as an opaque label (the service's user; None: exempt from the batch
    # share, e.g. staff): the scheduler's fair share counts by it, viewers tell their
    # own requests from others' by it
    tenant: str | None = None
    eos_token_ids: tuple[int, ...] = ()  # the model's EOS ids (several for some chat models)
    # With a cache salt: the unsalted chain's root. Pinned blocks are published by an
    # operator on purpose, so a salted request may share those (and only those).
    pinned_root: BlockHash | None = None
    # Parallel sampling: a request with n > 1 holds back its last prompt token (computes
    # all but it, never samples) and then forks into its samples, "<id>/<i>", each of
    # which computes that token in blocks shared with the others and samples on its own.
    fork_pending: bool = False  # it will fork once all but its last prompt token is computed
    parent_id: str | None = None  # a sample's: the request it forked from
    sample_index: int = 0  # a sample's place among its siblings
    # Everything below is owned by the Scheduler (the engine's output path appends tokens).
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # [sampled logprob, top ids, top logprobs] per output token, if its params ask
    output_logprobs: list[list] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: per prompt token [token id, logprob, top ids, top
    # logprobs] (the first token's logprob None), filled as its prefill chunks run
    prompt_logprobs: list[list] = field(default_factory=list)
    grammar: Any = field(default=None, repr=False)  # its structured-output matcher, if any
    # its constraint compiled (engine/text/structured.py): its fork's samples make their
    # matchers from it; None until the compile thread has made it
    compiled_grammar: Any = field(default=None, repr=False)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output, kept in step
    num_computed_tokens: int = 0  # tokens whose K/V is in the cache
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    # (what the counts mean: engine/sched/scheduler.py, above SchedulerCounters)
    num_preemptions: int = 0  # times it lost its GPU blocks to recompute them
    num_swaps_out: int = 0  # times its GPU blocks were swapped out to the CPU pool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # finish_reason "error": why the engine could not serve it
    parked: bool = False  # swapped out by an operator: waits for swap_in/abort
    # tokens sampled on the device and not yet appended (async scheduling: the step
    # after is scheduled before they are read; Scheduler.advance / apply_tokens)
    num_pending: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)  # of the full blocks

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.block_hashes = hash_blocks(self.root_hash, self.all_token_ids, self.block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_held_back(self) -> int:
        """Tokens it does not compute yet: its last prompt token while a fork is pending."""
        return 1 if self.fork_pending else 0

    @property
    def num_seqs(self) -> int:
        """Sequences it stands for in the batch: its n samples while a fork is pending."""
        return self.sampling_params.n if self.fork_pending else 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        num_tokens = len(self.all_token_ids)
        if num_tokens % self.block_size == 0:
            parent = self.block_hashes[-1] if self.block_hashes else self.root_hash
            start = num_tokens // self.block_size - 1
            self.block_hashes.extend(hash_blocks(
                self.root_hash, self.all_token_ids, self.block_size, start=start, parent=parent))
