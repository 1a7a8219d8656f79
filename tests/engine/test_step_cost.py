"""The step-cost model (engine/observe/step_cost.py): a step's shape, the least-squares
fit of the steps' times (each cost at least 0), and a simulated engine's pacing
recovered from its own steps."""
import random

import pytest

from engine import SamplingParams
from engine.observe.step_cost import MIN_STEPS, StepCost, StepCostModel, StepShape
from tests.engine.sim import sim_engine


def test_the_fit_recovers_a_linear_cost_and_drops_what_costs_nothing():
    truth = StepCost(base_ms=7.0, per_token_ms=0.03, decode_seq_ms=0.4,
                     context_token_ms=0.001, block_moved_ms=0.0)
    rng = random.Random(0)
    model = StepCostModel()
    assert model.fit() is None
    for i in range(MIN_STEPS * 4):
        shape = StepShape(rng.randrange(0, 512), rng.randrange(0, 64),
                          rng.randrange(0, 20000), rng.randrange(0, 8))
        model.record(shape, truth.seconds(shape) - 0.0002 * shape.blocks_moved * (i % 2))
    fit = model.fit()
    # (a block moved costs nothing, or less: its free fit is negative, so it goes)
    assert fit.cost.block_moved_ms == 0.0
    assert fit.cost.base_ms == pytest.approx(7.0, rel=0.05)
    assert fit.cost.per_token_ms == pytest.approx(0.03, rel=0.05)
    assert fit.cost.decode_seq_ms == pytest.approx(0.4, rel=0.05)
    assert fit.cost.context_token_ms == pytest.approx(0.001, rel=0.1)
    assert fit.steps == MIN_STEPS * 4 and fit.rms_ms < 0.2 * fit.mean_ms
    shape = StepShape(100, 10, 5000, 0)
    assert fit.cost.seconds(shape) == pytest.approx(truth.seconds(shape), rel=0.02)


def test_a_busy_step_lasts_until_the_next_one_starts():
    model = StepCostModel()
    a, b = StepShape(prefill_tokens=10), StepShape(decode_seqs=3)
    model.step_started(0.0)
    model.step_ended(a, 0.0, 0.004, busy=True)  # work waits: it lasts until the next
    model.step_started(0.010)
    model.step_ended(b, 0.010, 0.013, busy=False)  # idle after: its own time
    assert model._n == 2
    assert list(model._y[:2]) == pytest.approx([10.0, 3.0])


def test_a_shape_counts_prefill_tokens_decode_sequences_context_and_moves():
    engine = sim_engine(max_num_batched_tokens=64)
    engine.add_request("long", list(range(40)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert engine.last_step_shape == StepShape(prefill_tokens=40, decode_seqs=0,
                                               context_tokens=40, blocks_moved=0)
    engine.add_request("short", list(range(100, 108)), SamplingParams(max_tokens=4,
                                                                      ignore_eos=True))
    engine.step()  # long decodes its second token; short's prompt runs
    assert engine.last_step_shape == StepShape(prefill_tokens=8, decode_seqs=1,
                                               context_tokens=41 + 8, blocks_moved=0)


def test_a_simulated_engines_pacing_is_recovered_from_its_steps():
    """5 ms a step and 1 ms a batched token, learnt from the steps it ran: the cost per
    prompt token and per decode sequence within a quarter, the fixed part at least the
    configured 5 ms (the loop's own host work comes on top)."""
    engine = sim_engine(simulate_step_ms=5.0, simulate_token_us=1000.0, num_gpu_blocks=512,
                        max_num_batched_tokens=48, block_size=16)
    rng = random.Random(1)
    for i in range(50):  # prompts of every length, and batches of 1 to ~20 decodes
        engine.add_request(f"r{i}", [rng.randrange(1, 200) for _ in range(rng.randint(4, 60))],
                           SamplingParams(max_tokens=rng.randint(2, 30), ignore_eos=True))
        for _ in range(rng.randint(0, 4)):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    fit = engine.step_costs.fit()
    assert fit is not None and fit.steps >= MIN_STEPS
    assert fit.cost.per_token_ms == pytest.approx(1.0, rel=0.25)
    assert fit.cost.decode_seq_ms == pytest.approx(1.0, rel=0.25)
    assert 5.0 <= fit.cost.base_ms < 15.0
    assert engine.metrics()["step_cost"]["step_token_ms"] == fit.cost.per_token_ms
