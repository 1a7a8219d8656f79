"""One step's forward inputs, from the scheduler's SchedulerOutput (engine/sched/output.py):
one varlen batch of every scheduled request's new tokens, in batch order (token ids,
positions, slot mapping, block tables, sequence lengths, query start locations), the
rows whose logits are needed, and the requests that sample from them.

The tensors are views of buffers kept across steps (engine/model/step_buffers.py): a
step writes its rows into the host buffer and crosses to the device in one copy. Where
the attention backend reads block tables on the device (Triton), each request's table
is a row kept across steps, rewritten only when it changed."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.model.ops.attention import AttentionBatch, DeviceTables
from engine.model.sampler import SamplingRow, request_seed
from engine.model.step_buffers import BlockTables, StepBuffers
from engine.request import Request
from engine.sched.output import SchedulerOutput


class InputBatch:
    """Turns a SchedulerOutput into a StepBatch: host lists built in Python, written into
    the step buffers, and copied to the device once."""

    def __init__(self, block_size: int, device: torch.device, seed: int,
                 num_groups: int, *, max_tokens: int = 256, max_seqs: int = 64,
                 max_blocks: int = 64, device_tables: bool = False) -> None:
        """seed: the engine's (EngineConfig.seed), mixed with a request's id where the
        request sets no seed of its own; num_groups: the model's layer groups
        (engine/kv/layout.py), 1 for one block table for every layer; max_tokens,
        max_seqs: a step's most tokens and sequences (the buffers grow past them if a
        step needs it); max_blocks: the longest block table (max_model_len's);
        device_tables: keep the block tables on the device (the Triton backend reads
        them there; the torch backend plans from the host lists)."""
        self.block_size = block_size
        self.device = device
        self.seed = seed
        self.num_groups = num_groups
        self.max_blocks = max_blocks
        self.buffers = StepBuffers(max_tokens, max_seqs, max_blocks, device)
        self.tables = BlockTables(max_seqs, max_blocks) if device_tables else None
        self.steps = 0
        # request id -> its sampling row (sampling_row), at most _most_rows of them
        self._rows: dict[str, SamplingRow] = {}
        self._most_rows = 4 * max_seqs

    def prepare(self, out: SchedulerOutput, buffers: StepBuffers | None = None,
                pad_to: int | None = None, plan_seq_len: int | None = None) -> StepBatch:
        """The step's batch. buffers, pad_to: a decode step padded to pad_to sequences in
        these buffers (a CUDA graph's, engine/model/cuda_graphs.py): each padding row is
        a sequence of token 0 at position 0, slot -1 (nothing stored), reading block 0
        for a context of one, with a logits row;
        plan_seq_len: the context bound the attention plan is made for (a graph's:
        max_model_len), instead of the step's longest."""
        bs = self.block_size
        self.steps += 1
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables, seq_lens, query_start_loc = [], [], [0]
        logits_rows, sampling_ids, sampling_requests = [], [], []
        prompt_rows, prompt_logits_rows = [], []  # SamplingParams.prompt_logprobs
        keep, table_rows, step = self.tables, [], self.steps
        pending: list[tuple[int, str]] = []  # (row, request id) of inputs not yet read
        for s in out.scheduled:
            request, start, n = s.request, s.start, s.num_new_tokens
            if n == 1:  # a decode: plain ints (numpy's per-call cost is most of a row's)
                ids = request.all_token_ids
                if start < len(ids):
                    input_ids.append(ids[start])
                else:  # sampled last step, still on the device (async scheduling)
                    pending.append((len(input_ids), request.request_id))
                    input_ids.append(0)
                positions.append(start)
                slots.append(s.block_ids[start // bs] * bs + start % bs)
            else:
                input_ids.extend(request.all_token_ids[start:start + n])
                pos = np.arange(start, start + n)
                table = np.asarray(s.block_ids, dtype=np.int64)
                positions.extend(range(start, start + n))
                slots.extend((table[pos // bs] * bs + pos % bs).tolist())
            tables.append(s.block_ids)
            if keep is not None:
                table_rows.append(keep.row_of(request.request_id, s.block_ids, step))
            seq_lens.append(start + n)
            query_start_loc.append(query_start_loc[-1] + n)
            k = request.sampling_params.prompt_logprobs
            if k is not None:
                # Positions p whose next token is a prompt token not scored yet.
                first = max(start, len(request.prompt_logprobs) - 1, 0)
                last = min(start + n, len(request.prompt_token_ids) - 1)
                for p in range(first, last):
                    prompt_logits_rows.append(query_start_loc[-2] + p - start)
                    prompt_rows.append((request.request_id, p,
                                        request.prompt_token_ids[p + 1], k))
            if s.samples:
                logits_rows.append(query_start_loc[-1] - 1)
                sampling_ids.append(request.request_id)
                sampling_requests.append(request)
        num_tokens, num_seqs = len(input_ids), len(out.scheduled)
        buf = buffers or self._buffers_for(num_tokens, num_seqs)
        buf.wait_copied()
        rows = logits_rows + prompt_logits_rows
        v = buf.np
        v["input_ids"][:num_tokens] = input_ids
        v["positions"][:num_tokens] = positions
        v["slot_mapping"][:num_tokens] = slots
        v["seq_lens"][:num_seqs] = seq_lens
        v["query_start_loc"][:num_seqs + 1] = query_start_loc
        if pad_to is not None:
            # the padding rows: a sequence each, of one token at position 0 that is not
            # stored (slot -1) and reads block 0's first slot, so every row of the pass
            # stays finite (garbage rows would only cost time, but are kept out)
            v["input_ids"][num_tokens:pad_to] = 0
            v["positions"][num_tokens:pad_to] = 0
            v["slot_mapping"][num_tokens:pad_to] = -1
            v["seq_lens"][num_seqs:pad_to] = 1
            v["query_start_loc"][num_seqs + 1:pad_to + 1] = np.arange(num_tokens + 1,
                                                                      pad_to + 1)
            v["block_tables"][num_seqs:pad_to, 0] = 0
            v["logits_indices"][:pad_to] = np.arange(pad_to)
            num_tokens = num_seqs = num_logits = pad_to
        else:
            v["logits_indices"][:len(rows)] = rows
            num_logits = len(rows)
        if keep is not None:
            keep.gather(table_rows, v["block_tables"])
        buf.commit(num_seqs, with_tables=keep is not None)
        t = buf.t
        on_device = None
        if keep is not None:
            on_device = DeviceTables(
                t["block_tables"][:num_seqs], t["seq_lens"][:num_seqs],
                t["query_start_loc"][:num_seqs + 1],
                max_seq_len=plan_seq_len or max(seq_lens),
                max_query_len=max((b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
                                  default=1))
        attention = AttentionBatch(bs, tables, seq_lens, query_start_loc,
                                   t["slot_mapping"][:num_tokens], on_device)
        groups = None
        if out.group_block_ids is not None:  # a block table per layer group (0: the above)
            groups = [attention] + [self._group_batch(out, g, seq_lens, query_start_loc)
                                    for g in range(1, self.num_groups)]
        return StepBatch(
            input_ids=t["input_ids"][:num_tokens], positions=t["positions"][:num_tokens],
            logits_indices=t["logits_indices"][:num_logits],
            attention=attention, sampling_ids=sampling_ids,
            sampling_requests=sampling_requests, prompt_rows=prompt_rows, groups=groups,
            pending=pending)

    def sampling_row(self, request: Request) -> SamplingRow:
        """How the request's next token is chosen, from its state now (its output so
        far, which the penalties and the token's seed read, and its grammar). A
        request's row is kept across steps and brought up to date: the same request
        (its own output list) changes only its count and its grammar."""
        row = self._rows.get(request.request_id)
        if row is not None and row.output_token_ids is request.output_token_ids:
            row.num_output_tokens = len(request.output_token_ids)
            row.grammar = request.grammar
            return row
        if len(self._rows) >= self._most_rows:  # (ended requests' rows: made again if needed)
            self._rows.clear()
        params = request.sampling_params
        row = self._rows[request.request_id] = SamplingRow(
            params, request_seed(params, self.seed, request.request_id),
            request.num_output_tokens, request.prompt_token_ids, request.output_token_ids,
            request.eos_token_ids, request.grammar)
        return row

    def _buffers_for(self, num_tokens: int, num_seqs: int) -> StepBuffers:
        """The step buffers, grown first if this step does not fit (max_num_seqs or
        max_num_batched_tokens raised live)."""
        b = self.buffers
        if not b.fits(num_tokens, num_seqs):
            self.buffers = b = StepBuffers(max(num_tokens, b.max_tokens),
                                           max(num_seqs, b.max_seqs), self.max_blocks,
                                           self.device)
        return b

    def _group_batch(self, out: SchedulerOutput, group: int, seq_lens: list[int],
                     query_start_loc: list[int]) -> AttentionBatch:
        """Layer group `group`'s tables and slots for the step (the same sequences)."""
        bs, tables, slots = self.block_size, [], []
        for s in out.scheduled:
            ids = out.group_block_ids[s.request.request_id][group]
            tables.append(ids)
            pos = np.arange(s.start, s.start + s.num_new_tokens)
            slots.extend((np.asarray(ids, dtype=np.int64)[pos // bs] * bs + pos % bs).tolist())
        return AttentionBatch(bs, tables, seq_lens, query_start_loc,
                              torch.tensor(slots, dtype=torch.int64, device=self.device))


@dataclass(slots=True)
class StepBatch:
    """The tensors of one step (see InputBatch.prepare)."""
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [num_sampled] int64: the last row of each sampling request
    attention: AttentionBatch
    sampling_ids: list[str]  # request ids, one per logits row
    # the requests, in the same order: their sampling rows are made when they sample
    # (InputBatch.sampling_row), from their state then
    sampling_requests: list[Request]
    # after the sampling rows in logits_indices: (request id, position, next prompt
    # token, k) per prompt position scored (SamplingParams.prompt_logprobs)
    prompt_rows: list[tuple] = field(default_factory=list)
    # a hybrid model's: each layer group's batch (its tables and slots); None: one table
    groups: list[AttentionBatch] | None = None
    # (row, request id): decode inputs sampled by the step before and not read to the
    # host yet (async scheduling), to be filled on the device from that step's tokens
    pending: list[tuple[int, str]] = field(default_factory=list)

    def for_ranks(self) -> RankBatch:
        """What the other tensor-parallel ranks need to run the same forward pass (its
        tensors on the host: each rank moves them to its own device)."""
        # (copies: the step buffers are written again next step)
        return RankBatch(self.input_ids.to("cpu", copy=True),
                         self.positions.to("cpu", copy=True),
                         self.logits_indices.to("cpu", copy=True),
                         _moved(self.attention, torch.device("cpu")),
                         [_moved(a, torch.device("cpu")) for a in self.groups]
                         if self.groups else None)


@dataclass(slots=True)
class RankBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    attention: AttentionBatch
    groups: list[AttentionBatch] | None = None

    def to(self, device: torch.device) -> RankBatch:
        if device.type == "cpu":
            return self
        return RankBatch(self.input_ids.to(device), self.positions.to(device),
                         self.logits_indices.to(device), _moved(self.attention, device),
                         [_moved(a, device) for a in self.groups] if self.groups else None)


def _moved(a: AttentionBatch, device: torch.device) -> AttentionBatch:
    """a's host lists and its slots on `device` (a copy); its device tables stay
    behind: another rank plans from the lists."""
    return AttentionBatch(a.block_size, a.block_tables, a.seq_lens, a.query_start_loc,
                          a.slot_mapping.to(device, copy=True))
