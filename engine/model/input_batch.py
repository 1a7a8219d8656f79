"""One step's forward inputs, from the scheduler's SchedulerOutput (engine/sched/output.py):
one varlen batch of every scheduled request's new tokens, in batch order (token ids,
positions, slot mapping, block tables, sequence lengths, query start locations), the
rows whose logits are needed, and each sampling request's sampling row."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.model.ops.attention import AttentionBatch
from engine.model.sampler import SamplingRow, request_seed
from engine.sched.output import SchedulerOutput


class InputBatch:
    """Turns a SchedulerOutput into a StepBatch: host lists built in numpy and Python,
    then each tensor copied to the device once."""

    def __init__(self, block_size: int, device: torch.device, seed: int,
                 num_groups: int) -> None:
        """seed: the engine's (EngineConfig.seed), mixed with a request's id where the
        request sets no seed of its own; num_groups: the model's layer groups (engine/kv/layout.py), 1 for one
        block table for every layer."""
        self.block_size = block_size
        self.device = device
        self.seed = seed
        self.num_groups = num_groups

    def prepare(self, out: SchedulerOutput) -> StepBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables, seq_lens, query_start_loc = [], [], [0]
        logits_rows, sampling_ids, sampling_rows = [], [], []
        prompt_rows, prompt_logits_rows = [], []  # SamplingParams.prompt_logprobs
        for s in out.scheduled:
            request, start, n = s.request, s.start, s.num_new_tokens
            if n == 1:  # a decode: plain ints (numpy's per-call cost is most of a row's)
                input_ids.append(request.all_token_ids[start])
                positions.append(start)
                slots.append(s.block_ids[start // bs] * bs + start % bs)
            else:
                input_ids.extend(request.all_token_ids[start:start + n])
                pos = np.arange(start, start + n)
                table = np.asarray(s.block_ids, dtype=np.int64)
                positions.extend(range(start, start + n))
                slots.extend((table[pos // bs] * bs + pos % bs).tolist())
            tables.append(s.block_ids)
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
                sampling_rows.append(SamplingRow(
                    request.sampling_params,
                    request_seed(request.sampling_params, self.seed, request.request_id),
                    request.num_output_tokens, request.prompt_token_ids,
                    request.output_token_ids, request.eos_token_ids, request.grammar))
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.int64, device=dev)
        attention = AttentionBatch(bs, tables, seq_lens, query_start_loc, slot_mapping)
        groups = None
        if out.group_block_ids is not None:  # a block table per layer group (0: the above)
            groups = [attention] + [self._group_batch(out, g, seq_lens, query_start_loc)
                                    for g in range(1, self.num_groups)]
        return StepBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(logits_rows + prompt_logits_rows, dtype=torch.int64,
                                        device=dev),
            attention=attention, sampling_ids=sampling_ids, sampling_rows=sampling_rows,
            prompt_rows=prompt_rows, groups=groups)

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
    sampling_rows: list[SamplingRow]
    # after the sampling rows in logits_indices: (request id, position, next prompt
    # token, k) per prompt position scored (SamplingParams.prompt_logprobs)
    prompt_rows: list[tuple] = field(default_factory=list)
    # a hybrid model's: each layer group's batch (its tables and slots); None: one table
    groups: list[AttentionBatch] | None = None

    def for_ranks(self) -> RankBatch:
        """What the other tensor-parallel ranks need to run the same forward pass (its
        tensors on the host: each rank moves them to its own device)."""
        return RankBatch(self.input_ids.cpu(), self.positions.cpu(), self.logits_indices.cpu(),
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
    return AttentionBatch(a.block_size, a.block_tables, a.seq_lens, a.query_start_loc,
                          a.slot_mapping.to(device))
