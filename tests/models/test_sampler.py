"""engine/sampler.py: greedy, temperature, top-k, top-p, stateless per-token seeds."""
from __future__ import annotations

import torch

from engine.sampler import SamplingRow, _filtered_probs, request_seed, sample, token_seed
from engine.sampling_params import SamplingParams


def rows(params: SamplingParams, n: int, seed: int = 5, step: int = 0) -> list[SamplingRow]:
    return [SamplingRow(params, seed, step) for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(4, 37)
    assert sample(logits, rows(SamplingParams(temperature=0.0), 4)) == logits.argmax(-1).tolist()


def test_top_k_1_is_greedy_whatever_the_temperature():
    logits = torch.randn(3, 50)
    got = sample(logits, rows(SamplingParams(temperature=2.0, top_k=1), 3))
    assert got == logits.argmax(-1).tolist()


def test_same_seed_and_step_same_token_different_step_differs():
    logits = torch.zeros(1, 1000)  # uniform: any token is as likely
    p = SamplingParams(temperature=1.0)
    draws = [sample(logits, rows(p, 1, seed=9, step=s))[0] for s in range(20)]
    assert draws == [sample(logits, rows(p, 1, seed=9, step=s))[0] for s in range(20)]
    assert len(set(draws)) > 10
    assert draws != [sample(logits, rows(p, 1, seed=10, step=s))[0] for s in range(20)]


def test_mixed_greedy_and_random_rows():
    logits = torch.randn(3, 20)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.0)]
    got = sample(logits, [SamplingRow(p, 1, 0) for p in params])
    assert got == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = _filtered_probs(probs.log(), [SamplingParams(temperature=1.0, top_p=0.8)])
    torch.testing.assert_close(out, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    out = _filtered_probs(probs.log(), [SamplingParams(temperature=1.0, top_p=0.81)])
    assert (out[0, :3] > 0).all() and out[0, 3] == 0


def test_top_k_then_temperature():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]])
    out = _filtered_probs(logits, [SamplingParams(temperature=0.5, top_k=2)])
    expected = torch.softmax(torch.tensor([8.0, 6.0]), -1)
    torch.testing.assert_close(out[0, :2], expected)
    assert (out[0, 2:] == 0).all()


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    p = SamplingParams(temperature=1.0)
    counts = torch.zeros(3)
    for step in range(3000):
        counts[sample(logits, rows(p, 1, seed=3, step=step))[0]] += 1
    torch.testing.assert_close(counts / 3000, torch.softmax(logits[0], -1), atol=0.03, rtol=0)


def test_request_seed():
    assert request_seed(SamplingParams(seed=7), 0, "a") == 7
    unseeded = SamplingParams()
    assert request_seed(unseeded, 0, "a") == request_seed(unseeded, 0, "a")
    assert request_seed(unseeded, 0, "a") != request_seed(unseeded, 0, "b")
    assert request_seed(unseeded, 0, "a") != request_seed(unseeded, 1, "a")
    assert 0 <= token_seed(2 ** 64 - 1, 3) < 2 ** 63
