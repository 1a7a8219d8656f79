"""Decode steps padded to graph sizes (engine/model/cuda_graphs.py) and the step buffers
they run from (engine/model/step_buffers.py). Without a GPU the padded inputs run
eagerly through the Triton kernels in the interpreter: the path a CUDA graph replays,
whose tokens must equal the unpadded path's (enforce_eager) in every KV situation."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is first imported)

from engine import SamplingParams
from engine.model.cuda_graphs import decode_sizes
from engine.model.step_buffers import BlockTables, StepBuffers
from tests.engine.test_model_parity import (SITUATIONS, _under_pressure, greedy, make_engine,
                                            outputs, same_memory)
from tests.models.tiny import SPECS, hf_greedy, random_prompts

pytest.importorskip("triton", reason="the triton package is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_engine(folder, **kw):
    return make_engine(folder, attention_backend="triton", device=DEVICE, **kw)


def test_decode_sizes_cover_every_batch_up_to_max_num_seqs():
    assert decode_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert decode_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_sizes(3) == [1, 2, 3]


@pytest.mark.parametrize("situation", sorted(SITUATIONS))
@pytest.mark.parametrize("name", ["gqa16", "mistral-window"])
def test_padded_decode_steps_give_the_unpadded_tokens(tiny_model, name, situation):
    """Greedy tokens through padded decode steps equal transformers', in every KV
    situation (prefix hits, chunked prefill, preemption by recompute and by swap, the
    CPU tier), and padded steps did run (5 sequences -> 8, then fewer)."""
    folder = tiny_model(name)
    vocab = SPECS[name].vocab_size
    prompts = random_prompts(vocab, [20, 23, 18, 25, 21], seed=5)
    engine = triton_engine(folder, **same_memory(folder, SITUATIONS[situation]))
    graphs = engine.runner.decode_graphs
    assert engine.runner.eager_reason is None and graphs is not None
    if situation == "prefix-hit":
        first = engine.generate(prompts[:1], greedy())
        rest = engine.generate([prompts[0] + p[:3] for p in prompts[1:]], greedy())
        assert all(o.num_cached_tokens >= 16 for o in rest)
        got, prompts = outputs(first + rest), prompts[:1] + [prompts[0] + p[:3] for p in prompts[1:]]
    elif situation in ("recompute", "swap"):
        got = _under_pressure(engine, prompts, situation)
    else:
        got = outputs(engine.generate(prompts, greedy()))
    assert got == hf_greedy(folder, prompts, len(got[0]))
    assert sum(graphs.steps.values()) > 0
    assert engine.kv.gpu.num_free == engine.kv.gpu.num_blocks


def test_seeded_sampling_forks_and_stops_are_the_same_padded_and_eager(tiny_model):
    """Sampled tokens (seeded, with penalties) and n > 1 forks come out the same from
    padded steps as from eager ones, with async scheduling too."""
    folder = tiny_model("gqa16")
    prompts = random_prompts(SPECS["gqa16"].vocab_size, [9, 14, 5], seed=3)
    params = [SamplingParams(max_tokens=7, temperature=0.9, top_p=0.9, seed=11,
                             presence_penalty=0.5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.7, frequency_penalty=0.3,
                             ignore_eos=True)]

    def run(**kw):
        engine = triton_engine(folder, **kw)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:  # (each fork of r1 under its own id)
                    done[o.request_id] = o.output_token_ids
        return engine, done

    padded, got = run(async_scheduling=False)
    eager, expected = run(enforce_eager=True, async_scheduling=False)
    assert eager.runner.decode_graphs is None and eager.runner.eager_reason == "enforce_eager"
    assert got == expected and len(got) == 5
    assert padded.runner.decode_graphs.steps  # decode steps did run padded
    # and with async scheduling: the inputs sampled a step before are copied into the
    # graphs' buffers on the device
    ahead, again = run(async_scheduling=True)
    assert ahead.async_scheduling and ahead.runner.decode_graphs.steps
    assert again == expected


def test_a_graph_is_captured_on_a_batch_of_padding_rows(tiny_model):
    """What a graph of size 4 is captured on: four sequences of one token at position 0,
    each reading block 0 for a context of one and storing nothing, in the graphs' own
    buffers, with a logits row each and the attention planned for max_model_len."""
    engine = triton_engine(tiny_model("gqa16"))
    graphs = engine.runner.decode_graphs
    batch = graphs.static_batch(4)
    tables = batch.attention.device
    assert batch.input_ids.tolist() == [0, 0, 0, 0] and batch.positions.tolist() == [0] * 4
    assert batch.attention.slot_mapping.tolist() == [-1] * 4
    assert batch.logits_indices.tolist() == [0, 1, 2, 3]
    assert tables.seq_lens.tolist() == [1] * 4
    assert tables.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert tables.block_tables[:, 0].tolist() == [0] * 4
    assert tables.max_seq_len == engine.runner.max_model_len and tables.max_query_len == 1
    assert batch.input_ids.data_ptr() == graphs.buffers.t["input_ids"].data_ptr()


def test_experts_and_the_torch_backend_run_eagerly_and_say_why(tiny_model):
    moe = triton_engine(tiny_model("qwen3moe"))
    assert moe.runner.decode_graphs is None
    assert "routing" in moe.runner.eager_reason
    plain = make_engine(tiny_model("gqa16"))
    assert plain.runner.decode_graphs is None and "torch" in plain.runner.eager_reason


def test_a_block_table_row_is_written_only_when_its_table_changed():
    tables = BlockTables(max_seqs=2, max_blocks=6)
    a = [4, 9]
    row = tables.row_of("a", a, step=1)
    assert tables.rows[row, :2].tolist() == [4, 9] and tables.rows_written == 1
    assert tables.row_of("a", a, step=2) == row and tables.rows_written == 1  # unchanged
    a.append(7)  # the table grew: its tail is written
    tables.row_of("a", a, step=3)
    assert tables.rows[row, :3].tolist() == [4, 9, 7] and tables.rows_written == 2
    # copy-on-write: a new list (engine/kv/group.py) with the last block replaced
    tables.row_of("a", [4, 9, 11], step=4)
    assert tables.rows[row, :3].tolist() == [4, 9, 11] and tables.rows_written == 3
    with pytest.raises(ValueError, match="at most 6"):
        tables.row_of("a", list(range(7)), step=5)

    # more live tables than rows: those not in this step give theirs back, then it grows
    rows = {tables.row_of(r, [i], step=6) for i, r in enumerate("bcd")}
    assert len(rows | {row}) == 4
    many = {tables.row_of(f"x{i}", [i], step=7) for i in range(5)}
    assert len(many) == 5 and len(tables.rows) >= 5
    into = np.full((5, 6), -7, dtype=np.int32)
    tables.gather(sorted(many), into)
    assert sorted(into[:, 0].tolist()) == list(range(5))


def test_step_buffers_on_a_cpu_are_the_host_memory_the_forward_pass_reads():
    b = StepBuffers(max_tokens=8, max_seqs=3, max_blocks=4, device=torch.device("cpu"))
    b.np["input_ids"][:3] = [5, 6, 7]
    b.np["block_tables"][1, :2] = [3, 2]
    b.commit(2, with_tables=True)
    assert b.t["input_ids"][:3].tolist() == [5, 6, 7]
    assert b.t["block_tables"][1, :2].tolist() == [3, 2]
    assert b.t["input_ids"].dtype == torch.int64 and b.t["seq_lens"].dtype == torch.int32
    assert b.t["block_tables"].shape == (3, 4)
