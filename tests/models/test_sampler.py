"""engine/model/sampler.py: greedy, temperature, top-k, top-p, stateless per-token seeds."""
from __future__ import annotations

import torch

from engine.model.sampler import SamplingRow, _filtered_probs, request_seed, sample, token_seed
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


# --- logits processors: the batched tensor ops against a per-row, per-token reference ---

def reference_logits(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """One row, one token at a time, straight from the definitions (vLLM's order)."""
    out = logits.clone()
    p = row.params
    if row.num_output_tokens < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(row.eos_token_ids)):
            out[t] = float("-inf")
    for t, bias in (p.logit_bias or {}).items():
        out[t] += bias
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    for t in range(out.shape[0]):
        if t in seen:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = row.output_token_ids.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_penalties_bias_and_min_tokens_match_a_per_token_reference():
    from engine.model.sampler import process_logits
    torch.manual_seed(0)
    vocab = 40
    logits = torch.randn(5, vocab) * 3
    cases = [
        (SamplingParams(temperature=0.0), [1, 2], [3]),  # nothing applies
        (SamplingParams(repetition_penalty=1.7), [1, 2, 2, 9], [9, 30]),
        (SamplingParams(frequency_penalty=0.6, presence_penalty=-0.4), [5], [7, 7, 7, 8, 5]),
        (SamplingParams(logit_bias={"3": 100, 4: -100.0, 39: 2.5}, repetition_penalty=0.5,
                        frequency_penalty=2.0), [3, 4], [4, 4, 11]),
        (SamplingParams(min_tokens=4, max_tokens=9, stop_token_ids=[17, 18],
                        presence_penalty=1.0), [0], [17, 6]),
    ]
    rows_ = [SamplingRow(p, 1, len(out), prompt, out, (0, 1)) for p, prompt, out in cases]
    got = process_logits(logits, rows_)
    for i, row in enumerate(rows_):
        torch.testing.assert_close(got[i], reference_logits(logits[i], row))
    assert got[4, 0] == float("-inf") and got[4, 17] == float("-inf")  # EOS and stop ids
    assert process_logits(logits, rows_[:1]) is logits  # untouched: no copy, no work
    # Greedy sees the processed logits: token 3's +100 wins, token 4's -100 never does.
    assert sample(logits, rows_)[3] == 3


def test_min_tokens_masks_eos_only_until_reached_and_respects_ignore_eos():
    from engine.model.sampler import process_logits
    logits = torch.zeros(3, 10)
    p = SamplingParams(min_tokens=2, max_tokens=5)
    masked = process_logits(logits, [SamplingRow(p, 1, 1, [5], [6], (9,)),
                                     SamplingRow(p, 1, 2, [5], [6, 7], (9,)),
                                     SamplingRow(SamplingParams(min_tokens=2, ignore_eos=True),
                                                 1, 0, [5], [], (9,))])
    assert masked[0, 9] == float("-inf") and masked[1, 9] == 0 and masked[2, 9] == 0


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = _filtered_probs(logits, [SamplingParams(temperature=1.0, min_p=0.35)])
    # 0.15 and 0.05 are below 0.35 * 0.5: the rest renormalised.
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_bad_processor_params_are_refused_with_the_field_named():
    import pytest

    from engine.errors import InvalidRequestError
    for kwargs, name in [({"presence_penalty": 2.5}, "presence_penalty"),
                         ({"frequency_penalty": -3}, "frequency_penalty"),
                         ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"min_p": 1.5}, "min_p"),
                         ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
                         ({"logit_bias": {"x": 1}}, "logit_bias"),
                         ({"logit_bias": {5: 101}}, "logit_bias")]:
        with pytest.raises(InvalidRequestError, match=name):
            SamplingParams(**kwargs)


def test_a_batch_of_draws_equals_each_row_drawn_alone():
    """Rows that draw in one batch (with greedy rows between them) get the tokens they
    get alone: one uniform per row from its own seed and position, nothing shared."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300)
    params = [SamplingParams(temperature=t, top_p=p) for t, p in
              [(1.0, 1.0), (0.0, 1.0), (0.7, 0.9), (1.3, 1.0), (0.0, 1.0), (1.0, 0.5)]]
    batch = [SamplingRow(p, 40 + i, 3 * i) for i, p in enumerate(params)]
    together = sample(logits, batch)
    alone = [sample(logits[i:i + 1], [row])[0] for i, row in enumerate(batch)]
    assert together == alone
    assert together[1] == logits[1].argmax() and together[4] == logits[4].argmax()


def test_a_token_of_probability_zero_is_never_drawn():
    logits = torch.full((1, 50), float("-inf"))
    logits[0, [3, 17, 49]] = torch.tensor([0.0, 1.0, 0.5])
    p = SamplingParams(temperature=1.0)
    drawn = {sample(logits, rows(p, 1, seed=2, step=s))[0] for s in range(300)}
    assert drawn == {3, 17, 49}
