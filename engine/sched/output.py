"""What the scheduler hands the runner for one step: the batch, in order, and the block
copies and swaps to make around its forward pass. The runners (engine/model/) read it and
nothing else of the scheduler."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed for it this step
    start: int  # position of its first new token (= num_computed_tokens before the step)
    block_ids: list[int]  # its GPU block table for this step
    samples: bool  # the chunk reaches its last known token, so a next token is sampled

    @property
    def is_decode(self) -> bool:
        """One generated token computed; anything else is prompt tokens (a chunk, or a
        recompute of a preempted request's outputs)."""
        return self.num_new_tokens == 1 and self.start >= self.request.num_prompt_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu), before the step
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu), after swap_out
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) GPU, after swap_in
    # A hybrid model's (engine/kv/layout.py): request id -> each layer group's block table
    # for the step; None: the ScheduledRequest's table is every layer's
    group_block_ids: dict[str, list[list[int]]] | None = None
    # (gpu, cpu) CPU-tier copies of free cached blocks, after copies: the forward pass
    # neither reads nor writes them, so they may run beside it (KVCacheCoordinator.copy_ahead)
    copy_ahead: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduled or self.swap_out or self.swap_in or self.copies)
