"""A step's input tensors in buffers kept across steps, and the block tables' rows kept
per request.

StepBuffers: one flat byte buffer on the host (pinned on CUDA) and its twin on the
device, each carved into typed views at fixed offsets: token ids, positions, slots and
logits rows (int64, one per token), sequence lengths and query starts (int32, one per
sequence) and the block tables (int32, a row of `max_blocks` per sequence). A step
fills the host views and crosses in one copy of the bytes it used (the tables come
last, so a step of S sequences copies their S rows and no more). On a CPU the device
views are the host's: nothing is copied. Views never move, so a captured CUDA graph
(engine/model/cuda_graphs.py) reads a step's inputs where the copy put them.

BlockTables: each request's table as a row of a host array, written when the table
grew or changed and gathered into a step's rows in one numpy take.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# (name, element type, elements per token / per sequence): the int64 fields first so
# every view is aligned to its element size
_PER_TOKEN = ("input_ids", "positions", "slot_mapping", "logits_indices")
_PER_SEQ = ("seq_lens", "query_start_loc")


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int,
                 device: torch.device) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.device = device
        offsets, at = {}, 0
        for name in _PER_TOKEN:
            offsets[name] = (at, max_tokens, np.int64)
            at += 8 * max_tokens
        for name in _PER_SEQ:
            n = max_seqs + (name == "query_start_loc")
            offsets[name] = (at, n, np.int32)
            at += 4 * n
        at += -at % 8
        self._tables_at = at
        offsets["block_tables"] = (at, max_seqs * max_blocks, np.int32)
        self.nbytes = at + 4 * max_seqs * max_blocks
        on_gpu = device.type == "cuda"
        self.host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=on_gpu)
        self.dev = torch.zeros(self.nbytes, dtype=torch.uint8, device=device) if on_gpu \
            else self.host
        raw = self.host.numpy()
        # numpy views of the host buffer (what a step fills) and torch views of the
        # device buffer (what the forward pass reads), by name
        self.np = {name: raw[a:a + n * np.dtype(t).itemsize].view(t)
                   for name, (a, n, t) in offsets.items()}
        self.np["block_tables"] = self.np["block_tables"].reshape(max_seqs, max_blocks)
        self.t = {name: self.dev[a:a + n * np.dtype(t).itemsize].view(
                      torch.int64 if t is np.int64 else torch.int32)
                  for name, (a, n, t) in offsets.items()}
        self.t["block_tables"] = self.t["block_tables"].view(max_seqs, max_blocks)
        self._copied: torch.cuda.Event | None = None  # the last commit's copy, on CUDA

    def wait_copied(self) -> None:
        """Before the host views are written: the last commit's copy has read them (a
        step that samples nothing never waits for the device otherwise)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs

    def commit(self, num_seqs: int, with_tables: bool) -> None:
        """The host views' contents to the device: one copy, of everything before the
        tables and the first num_seqs rows of the tables (with_tables), asynchronous
        from pinned memory. The host views must not be written again until the copy has
        run (wait_copied)."""
        if self.dev is self.host:
            return
        end = self._tables_at + (4 * num_seqs * self.max_blocks if with_tables else 0)
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()


class BlockTables:
    """Each request's block table as a row of one host array [rows, max_blocks] int32.

    A row is rewritten only when its request's table changed: the scheduler hands the
    same list object step after step while the table only grows (engine/kv/group.py,
    step_block_ids), and a new list when it changed otherwise (copy-on-write, blocks a
    window gave back, a preemption), so a row is known current by the list's identity
    and length. Rows of requests not seen in a step are reclaimed when the array fills."""

    def __init__(self, max_seqs: int, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.rows = np.zeros((2 * max_seqs, max_blocks), dtype=np.int32)
        self._free = list(range(len(self.rows) - 1, -1, -1))
        # request id -> its row, the list it was written from, how much of it is written
        self._held: dict[str, _Row] = {}
        self.rows_written = 0  # rows written or extended (what tests and benchmarks read)

    def row_of(self, request_id: str, block_ids: list[int], step: int) -> int:
        """The row of this table (block_ids as the scheduler gave it for `step`)."""
        held = self._held.get(request_id)
        if held is None:
            held = self._held[request_id] = _Row(self._take_row(step), None, 0, step)
        held.step = step
        n = len(block_ids)
        if held.ids is block_ids and held.written == n:
            return held.row
        if n > self.max_blocks:
            raise ValueError(f"a block table of {n} blocks where at most "
                             f"{self.max_blocks} fit (max_model_len / block_size)")
        start = held.written if held.ids is block_ids else 0
        self.rows[held.row, start:n] = block_ids[start:n]
        held.ids, held.written = block_ids, n
        self.rows_written += 1
        return held.row

    def gather(self, rows: list[int], into: np.ndarray) -> None:
        """The rows, in this order, into the first len(rows) rows of `into`."""
        if rows:
            np.take(self.rows, rows, axis=0, out=into[:len(rows)])

    def _take_row(self, step: int) -> int:
        if not self._free:  # reclaim the rows of requests not in this step
            for rid in [r for r, h in self._held.items() if h.step != step]:
                self._free.append(self._held.pop(rid).row)
            if not self._free:  # more sequences in one step than rows (max_num_seqs grew)
                grown = len(self.rows)
                self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
                self._free = list(range(len(self.rows) - 1, grown - 1, -1))
        return self._free.pop()


@dataclass(slots=True)
class _Row:
    row: int
    ids: list[int] | None
    written: int
    step: int
