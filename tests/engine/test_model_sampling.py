"""Random sampling through the engine: a seed fixes the output, even when the request
is preempted and recomputed or batched with others."""
from __future__ import annotations

from engine import SamplingParams
from tests.engine.test_model_parity import make_engine
from tests.models.tiny import SPECS, random_prompts

PROMPTS = random_prompts(SPECS["gqa64"].vocab_size, [20, 23, 18, 25, 21], seed=8)


def sampled(seed: int | None = 123) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=seed,
                          ignore_eos=True)


def test_seed_fixes_the_output_across_preemption(tiny_model):
    folder = tiny_model("gqa64")
    alone = [make_engine(folder).generate([p], sampled())[0].output_token_ids for p in PROMPTS]
    engine = make_engine(folder, num_gpu_blocks=16, enable_prefix_caching=False)
    together = [o.output_token_ids for o in engine.generate(PROMPTS, sampled())]
    assert engine.metrics()["num_preemptions"] > 0
    assert together == alone
    other_seed = make_engine(folder).generate(PROMPTS[:1], sampled(seed=124))[0].output_token_ids
    assert other_seed != alone[0]


def test_unseeded_requests_use_the_engine_seed(tiny_model):
    folder = tiny_model("gqa64")
    a = make_engine(folder, seed=1).generate(PROMPTS[:2], sampled(None))
    b = make_engine(folder, seed=1).generate(PROMPTS[:2], sampled(None))
    c = make_engine(folder, seed=2).generate(PROMPTS[:2], sampled(None))
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert [o.output_token_ids for o in a] != [o.output_token_ids for o in c]


def test_repetition_penalty_and_logit_bias_match_transformers(tiny_model):
    """Greedy with a repetition penalty and a logit bias equals transformers' generate
    with its RepetitionPenalty and SequenceBias processors, also through preemption."""
    from tests.models.tiny import hf_greedy
    folder = tiny_model("gqa64")
    plain = [o.output_token_ids for o in make_engine(folder).generate(
        PROMPTS, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    banned = plain[0][1]  # a token greedy picks: the bias must steer away from it
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            repetition_penalty=1.8, logit_bias={banned: -100.0})
    expected = hf_greedy(folder, PROMPTS, 12, repetition_penalty=1.8,
                         sequence_bias={(banned,): -100.0})
    assert expected != plain
    assert all(banned not in e for e in expected)
    assert [o.output_token_ids for o in make_engine(folder).generate(PROMPTS, params)] \
        == expected
    engine = make_engine(folder, num_gpu_blocks=16, enable_prefix_caching=False)
    assert [o.output_token_ids for o in engine.generate(PROMPTS, params)] == expected
    assert engine.metrics()["num_preemptions"] > 0


def test_min_tokens_holds_off_stop_tokens(tiny_model):
    folder = tiny_model("gqa64")
    plain = make_engine(folder).generate(
        PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    stop = plain.output_token_ids[1]
    early = make_engine(folder).generate(PROMPTS[:1], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))[0]
    assert early.output_token_ids == plain.output_token_ids[:2] and early.finish_reason == "stop"
    held = make_engine(folder).generate(PROMPTS[:1], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop],
        min_tokens=5))[0]
    assert stop not in held.output_token_ids[:5] and len(held.output_token_ids) > 5


def test_token_ids_beyond_the_vocabulary_are_refused(tiny_model):
    import pytest

    from engine.errors import InvalidRequestError
    engine = make_engine(tiny_model("gqa64"))
    vocab = SPECS["gqa64"].vocab_size
    for params in (SamplingParams(stop_token_ids=[vocab]), SamplingParams(logit_bias={vocab: 1})):
        with pytest.raises(InvalidRequestError, match="beyond the vocabulary"):
            engine.add_request("r", PROMPTS[0], params)


def hf_log_softmax(folder, prompt: list[int], output: list[int]):
    """transformers' log-softmax over the vocabulary at each output position."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1:len(prompt) - 1 + len(output)]


def test_logprobs_match_transformers_log_softmax(tiny_model):
    """Raw logprobs (before penalties and temperature, vLLM's default): the sampled
    token's and the k most likely, equal to transformers' log-softmax at each position;
    greedy's token is the most likely; a preempted and recomputed request reports the
    same values."""
    import torch
    folder = tiny_model("gqa64")
    greedy_params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    sampled_params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True,
                                    logprobs=0, repetition_penalty=1.3)
    outs = make_engine(folder).generate(PROMPTS[:2], greedy_params)
    sampled = make_engine(folder).generate(PROMPTS[2:3], sampled_params)[0]
    for prompt, out in zip(PROMPTS[:2], outs):
        reference = hf_log_softmax(folder, prompt, out.output_token_ids)
        assert len(out.logprobs) == len(out.output_token_ids) == 6
        for row, token, (logprob, top_ids, top_values) in zip(
                reference, out.output_token_ids, out.logprobs):
            want_values, want_ids = row.topk(3)
            assert top_ids[0] == token and top_ids == want_ids.tolist()
            torch.testing.assert_close(torch.tensor(top_values), want_values, atol=1e-4,
                                       rtol=1e-4)
            assert abs(logprob - row[token].item()) < 1e-4
    reference = hf_log_softmax(folder, PROMPTS[2], sampled.output_token_ids)
    for row, token, (logprob, top_ids, _top_values) in zip(
            reference, sampled.output_token_ids, sampled.logprobs):
        assert top_ids == [] and abs(logprob - row[token].item()) < 1e-4
    engine = make_engine(folder, num_gpu_blocks=16, enable_prefix_caching=False)
    again = engine.generate(PROMPTS, greedy_params)
    assert engine.metrics()["num_preemptions"] > 0
    for alone, together in zip(outs, again[:2]):
        assert together.output_token_ids == alone.output_token_ids
        for a, b in zip(alone.logprobs, together.logprobs):
            assert a[1] == b[1] and abs(a[0] - b[0]) < 1e-4
    assert make_engine(folder).generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0] \
        .logprobs is None


def test_forked_samples_on_the_model(tiny_model):
    """n > 1 on real logits: greedy samples equal one greedy request; with a seed, sample
    i equals a single request seeded seed + i; without one, samples differ; through
    preemption the same."""
    folder = tiny_model("gqa64")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (alone,) = make_engine(folder).generate(PROMPTS[:1], greedy)
    (forked,) = make_engine(folder).generate(
        PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=3))
    assert [s.output_token_ids for s in forked.samples] == [alone.output_token_ids] * 3

    def seeded(seed, n=1):
        return SamplingParams(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True, n=n)
    (fork,) = make_engine(folder).generate(PROMPTS[1:2], seeded(40, n=3))
    singles = [make_engine(folder).generate(PROMPTS[1:2], seeded(40 + i))[0].output_token_ids
               for i in range(3)]
    assert [s.output_token_ids for s in fork.samples] == singles
    (free,) = make_engine(folder).generate(PROMPTS[1:2], SamplingParams(
        max_tokens=10, temperature=1.0, ignore_eos=True, n=3))
    assert len({tuple(s.output_token_ids) for s in free.samples}) > 1
    engine = make_engine(folder, num_gpu_blocks=16, enable_prefix_caching=False)
    others = PROMPTS[:1] + PROMPTS[2:]
    outs = engine.generate(PROMPTS[1:2] + others, [seeded(40, n=3)] + [greedy] * len(others))
    assert engine.metrics()["num_preemptions"] > 0
    assert [s.output_token_ids for s in outs[0].samples] == singles


def test_prompt_logprobs_match_transformers(tiny_model):
    """Every prompt token's logprob (and the k most likely at its place), as transformers
    scores the prompt; computed in chunks, never skipped by a prefix-cache hit, and
    handed to a fork's samples."""
    import torch
    folder = tiny_model("gqa64")
    prompt = PROMPTS[3]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    engine = make_engine(folder, max_num_batched_tokens=8)  # the prompt in several chunks
    (first,) = engine.generate([prompt], params)
    reference = hf_log_softmax(folder, prompt[:1], prompt[1:])  # position p scores p + 1
    entries = first.prompt_logprobs
    assert [e[0] for e in entries] == prompt and entries[0][1:] == [None, [], []]
    for row, token, (_, logprob, top_ids, top_values) in zip(reference, prompt[1:],
                                                             entries[1:]):
        assert abs(logprob - row[token].item()) < 1e-4
        want_values, want_ids = row.topk(2)
        assert top_ids == want_ids.tolist()
        torch.testing.assert_close(torch.tensor(top_values), want_values, atol=1e-4, rtol=1e-4)
    (again,) = engine.generate([prompt], params)  # its blocks are cached now: not used
    assert again.num_cached_tokens == 0 and again.prompt_logprobs == entries
    (forked,) = make_engine(folder).generate(
        [prompt], SamplingParams(max_tokens=2, temperature=0.0, n=2, prompt_logprobs=2))
    for sample in forked.samples:
        assert [e[0] for e in sample.prompt_logprobs] == prompt
        assert all(abs(a[1] - b[1]) < 1e-4 for a, b in zip(sample.prompt_logprobs[1:],
                                                            entries[1:]))
