"""InputBatch at its own boundary: a SchedulerOutput in, the forward pass's inputs out
(engine/model/input_batch.py), with no runner and no model."""
from __future__ import annotations

import torch

from engine.block_hash import root_hash
from engine.model.input_batch import InputBatch
from engine.model.sampler import request_seed
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.sched.output import ScheduledRequest, SchedulerOutput

BS = 4
CPU = torch.device("cpu")


def request(rid: str, prompt: list[int], index: int, **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(**{"max_tokens": 8, **params}),
                   arrival_time=0.0, index=index, root_hash=root_hash("test"),
                   block_size=BS, eos_token_ids=(2,))


def test_a_prefill_chunk_and_a_decode_become_one_varlen_batch():
    """Token ids and positions in batch order; each new token's slot is its block's
    first slot plus its offset in the block, through the request's own table (not in
    block order); only the sampling request gets a logits row, its last token's."""
    a = request("a", list(range(100, 110)), 1)
    b = request("b", [50, 51, 52, 53, 54], 2, seed=7)
    b.output_token_ids.append(60)
    b.all_token_ids.append(60)
    out = SchedulerOutput(scheduled=[
        ScheduledRequest(a, num_new_tokens=6, start=0, block_ids=[7, 3], samples=False),
        ScheduledRequest(b, num_new_tokens=1, start=5, block_ids=[2, 9], samples=True)])

    batch = InputBatch(BS, CPU, seed=123, num_groups=1).prepare(out)

    assert batch.input_ids.tolist() == [100, 101, 102, 103, 104, 105, 60]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 5, 5]
    # a: positions 0-3 in block 7 (slots 28-31), 4-5 in block 3 (12, 13); b: position 5
    # is offset 1 of its second block, 9
    assert batch.attention.slot_mapping.tolist() == [28, 29, 30, 31, 12, 13, 37]
    assert batch.attention.block_tables == [[7, 3], [2, 9]]
    assert batch.attention.seq_lens == [6, 6]
    assert batch.attention.query_start_loc == [0, 6, 7]
    assert batch.logits_indices.tolist() == [6]
    assert batch.sampling_ids == ["b"] and batch.sampling_requests == [b]
    row = InputBatch(BS, CPU, seed=123, num_groups=1).sampling_row(b)
    assert row.seed == request_seed(b.sampling_params, 123, "b") == 7
    assert row.num_output_tokens == 1 and row.output_token_ids is b.output_token_ids
    assert batch.prompt_rows == [] and batch.groups is None
    assert batch.input_ids.dtype == batch.positions.dtype == torch.int64


def test_prompt_logprob_rows_follow_the_sampling_rows_and_skip_what_was_scored():
    """A request asking for prompt logprobs gets a logits row for each position whose
    next token is a prompt token not scored yet, after the sampling rows."""
    r = request("r", [10, 11, 12, 13, 14], 1, prompt_logprobs=2)
    first = InputBatch(BS, CPU, seed=0, num_groups=1).prepare(SchedulerOutput(scheduled=[
        ScheduledRequest(r, num_new_tokens=3, start=0, block_ids=[5, 6], samples=False)]))
    assert first.logits_indices.tolist() == [0, 1, 2]
    assert first.prompt_rows == [("r", 0, 11, 2), ("r", 1, 12, 2), ("r", 2, 13, 2)]

    # preempted after those, and recomputed from the start in one chunk: only position 3
    # (token 14) is still to score
    r.prompt_logprobs.extend([[10], [11, -1.0], [12, -1.0], [13, -1.0]])
    again = InputBatch(BS, CPU, seed=0, num_groups=1).prepare(SchedulerOutput(scheduled=[
        ScheduledRequest(r, num_new_tokens=5, start=0, block_ids=[5, 6], samples=True)]))
    # the sampling row (the chunk's last token), then position 3's
    assert again.logits_indices.tolist() == [4, 3]
    assert again.prompt_rows == [("r", 3, 14, 2)]
    assert again.sampling_ids == ["r"]


def test_a_hybrid_models_groups_each_get_their_tables_and_slots():
    """With a block table per layer group, group 0's batch is the request's own and each
    other group's slots go through that group's table, for the same sequences."""
    r = request("r", list(range(20, 26)), 1)
    out = SchedulerOutput(
        scheduled=[ScheduledRequest(r, num_new_tokens=6, start=0, block_ids=[1, 2],
                                    samples=True)],
        group_block_ids={"r": [[1, 2], [8, 4]]})
    batch = InputBatch(BS, CPU, seed=0, num_groups=2).prepare(out)
    first, second = batch.groups
    assert first is batch.attention
    assert first.slot_mapping.tolist() == [4, 5, 6, 7, 8, 9]
    assert second.block_tables == [[8, 4]]
    assert second.slot_mapping.tolist() == [32, 33, 34, 35, 16, 17]
    assert second.seq_lens == first.seq_lens and second.query_start_loc == first.query_start_loc


def test_a_requests_sampling_row_is_kept_and_follows_its_output():
    """The row a request samples with is made once and brought up to date (its output
    count, its grammar); a new request under the same id gets a row of its own."""
    batch = InputBatch(BS, CPU, seed=5, num_groups=1)
    r = request("r", [10, 11, 12], 1, temperature=0.7)
    row = batch.sampling_row(r)
    assert row.num_output_tokens == 0 and row.seed == request_seed(r.sampling_params, 5, "r")
    r.append_output_token(40)
    r.grammar = object()
    again = batch.sampling_row(r)
    assert again is row and again.num_output_tokens == 1 and again.grammar is r.grammar
    assert again.output_token_ids == [40]
    other = request("r", [10, 11, 12], 1, temperature=0.7, seed=9)  # the id used again
    fresh = batch.sampling_row(other)
    assert fresh is not row and fresh.num_output_tokens == 0 and fresh.seed == 9
