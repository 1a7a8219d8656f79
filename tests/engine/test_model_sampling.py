"""Random sampling through the engine: a seed fixes the output, even when the request
is preempted and recomputed or batched with others."""
from __future__ import annotations

from engine import SamplingParams
from tests.engine.test_model_parity import make_engine
from tests.models.fixtures import tiny_model, tiny_root  # noqa: F401 (fixtures)
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
