"""Helpers for tests that drive the engine with the simulated model."""
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.model.simulated_runner import reference_generate

VOCAB = 1000


def sim_engine(**kw) -> LLMEngine:
    cfg = dict(simulate=True, simulate_tokenizer="bytes", vocab_size=VOCAB, block_size=4,
               num_gpu_blocks=64,
               num_cpu_blocks=64, max_num_batched_tokens=64)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    return reference_generate(prompt, max_tokens, VOCAB)


def run_all(engine: LLMEngine, check: bool = True) -> dict:
    """Step until idle; return final outputs by request id. Checks invariants each step."""
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        if check:
            engine.kv.check_invariants()
    return final


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)
