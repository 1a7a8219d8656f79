"""What the engine needs from whatever computes tokens: the real model runner
(engine/model/model_runner.py) or the stand-in used by the simulator."""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from engine.sched.output import SchedulerOutput


@dataclass(slots=True)
class StepResult:
    """What a step's forward pass produced, handed back to the engine."""
    # request id -> its sampled token, for every scheduled request that samples
    tokens: dict[str, int] = field(default_factory=dict)
    # request id -> [sampled token's logprob, top ids, top logprobs], for the requests
    # that asked (SamplingParams.logprobs)
    logprobs: dict[str, list] = field(default_factory=dict)
    # request id -> [(position, logprob, top ids, top logprobs), ...] of the prompt tokens
    # whose logprobs this step computed (SamplingParams.prompt_logprobs)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Flight:
    """A step issued and not yet read back (async scheduling, engine/llm_engine.py): its
    batch and logits, then (Runner.sample) its tokens on the device and on their way to
    the host."""
    batch: Any
    logits: Any
    graphed: bool = False  # logits in a CUDA graph's output, written again by its next replay
    rows: list = field(default_factory=list)  # its sampling rows, made when it sampled
    tokens: Any = None  # [num_sampled] on the device
    host: Any = None  # the same on the host, once `ready` has passed
    ready: Any = None  # a CUDA event after the copy to the host (None: already there)
    index: dict[str, int] = field(default_factory=dict)  # request id -> its row in tokens


class Runner(abc.ABC):
    model_id: str  # identity for prefix-cache hashing
    num_gpu_blocks: int  # size of the device KV pool, fixed at start-up
    num_cpu_blocks: int  # size of the host swap pool
    max_model_len: int
    block_bytes: int = 0  # bytes of one KV block (all layers), for copy-byte metrics
    vocab_size: int
    device: str  # "cpu" | "cuda" | "simulated"
    dtype: str
    # How a block's bytes read (the K/V dtype; an fp8 cache's scales; the simulator's
    # stand-in size): blocks move between engines, or come back from disk, only where
    # this is the same
    kv_format: str = ""
    # Every layer attends only to this many last tokens (None: some or all see the whole
    # context): blocks out of reach are given back (engine/kv/group.py)
    sliding_window: int | None = None
    # A hybrid model's layer groups (engine/kv/layout.py): each group's window (None:
    # global), group 0 global; None: one block table for every layer
    kv_group_windows: tuple[int | None, ...] | None = None

    # Whether launch / sample / collect issue a step without waiting for the device, so
    # the engine can schedule the next one meanwhile (async scheduling)
    supports_async: bool = False

    def launch(self, out: SchedulerOutput, feed: Flight | None) -> Flight | None:
        """A step's block copies and forward pass, issued; None when nothing is
        scheduled. feed: the step before, whose tokens (still on the device) are the
        inputs of this step's decodes that sampled there. Only where supports_async."""
        raise NotImplementedError(f"{type(self).__name__} runs steps one at a time")

    def sample(self, flight: Flight) -> None:
        """Sample a launched step's tokens from its requests' state now (their output
        so far, their grammars), on the device, and start their copy to the host."""
        raise NotImplementedError(f"{type(self).__name__} runs steps one at a time")

    def collect(self, flight: Flight) -> StepResult:
        """A sampled step's tokens (waiting for them) and the logprobs asked for."""
        raise NotImplementedError(f"{type(self).__name__} runs steps one at a time")

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step: block copies in order (swap out, swap in, copy-on-write), then the
        forward pass. Returns its sampled tokens and the logprobs asked for."""
        self.copy_for(out)
        if not out.scheduled:
            return StepResult()
        return self.forward(out)

    def copy_for(self, out: SchedulerOutput) -> None:
        """The step's block copies, in order: swap out, swap in, copy-on-write, then the
        CPU tier's copies ahead."""
        self.swap_out(out.swap_out)
        self.swap_in(out.swap_in)
        self.copy_blocks(out.copies)
        self.copy_ahead(out.copy_ahead)

    def copy_ahead(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (gpu block, cpu block) pairs that this step's forward pass neither reads
        nor writes (free cached blocks, for the CPU tier of the prefix cache). A runner
        may overlap them with the forward pass, if every later copy and step waits for
        them; this one copies now."""
        self.swap_out(mapping)

    @abc.abstractmethod
    def forward(self, out: SchedulerOutput) -> StepResult:
        """Write the new tokens' K/V through the block tables and sample."""

    @abc.abstractmethod
    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (gpu block, cpu block) pairs from the device pool to the host pool."""

    @abc.abstractmethod
    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (cpu block, gpu block) pairs from the host pool to the device pool."""

    @abc.abstractmethod
    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (src, dst) pairs inside the device pool (copy-on-write)."""

    def read_blocks(self, block_ids: list[int]):
        """These device blocks' K/V (every layer), in host memory, for another engine of
        the same model and block size (a request that moves: engine/transfer/migration.py)."""
        raise NotImplementedError(f"{type(self).__name__} cannot move a request's blocks")

    def write_blocks(self, block_ids: list[int], data) -> None:
        """read_blocks' data (of another engine) into these device blocks, in order."""
        raise NotImplementedError(f"{type(self).__name__} cannot move a request's blocks")

    @staticmethod
    def num_blocks_in(data) -> int:
        """How many blocks read_blocks' data holds."""
        return len(data)

    @staticmethod
    def blocks_between(data, start: int, end: int):
        """The blocks start..end-1 of read_blocks' data."""
        return data[start:end]

    def read_pool_block(self, pool: str, block_id: int) -> bytes:
        """A block's bytes (every layer) in pool "cpu" or "gpu", for the disk tier
        (engine/kv/tiers/disk.py), after every copy into the pool under way has landed."""
        raise NotImplementedError(f"{type(self).__name__} keeps no disk tier")

    def write_pool_block(self, pool: str, block_id: int, data: bytes) -> None:
        """read_pool_block's bytes back into a block of pool "cpu" or "gpu"."""
        raise NotImplementedError(f"{type(self).__name__} keeps no disk tier")

    @staticmethod
    def blocks_to_frames(data) -> tuple[dict, list]:
        """read_blocks' data as a header and buffers, for another process (ZMQ frames,
        sent without a copy where the buffers allow: engine/transfer/link.py)."""
        import array
        n = len(data)
        # (the simulator's blocks hold 64-bit unsigned hashes)
        flat = array.array("Q", [token for block in data for token in block])
        return {"kind": "ints", "n": n}, [flat]

    def blocks_from_frames(self, header: object, frames: list, most: int):
        """blocks_to_frames' data back, as read_blocks gives it: at most `most` blocks of
        this engine's layout. Frames from another process are an input: the header and
        every frame's size are checked against the blocks it declares before anything is
        decoded (ValueError)."""
        import array
        n = block_count(frame_header(header, "ints").get("n"), most)
        slots = getattr(self, "block_size", 0)
        if len(frames) < 1 or memoryview(frames[0]).nbytes != n * slots * 8:
            raise ValueError(f"{n} blocks declared, not the bytes of {n} blocks")
        flat = array.array("Q")
        flat.frombytes(frames[0])
        return [list(flat[i * slots:(i + 1) * slots]) for i in range(n)]


def frame_header(header: object, kind: str) -> dict:
    """A frame header of `kind` (ValueError for anything else)."""
    if not isinstance(header, dict) or header.get("kind") != kind:
        raise ValueError("blocks of another kind do not fit this engine")
    return header


def block_count(n: object, most: int) -> int:
    """A header's declared block count, if it is an integer in [0, most] (ValueError)."""
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= most:
        raise ValueError(f"a move of {n!r} blocks where at most {most} may come")
    return n
