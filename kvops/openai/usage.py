"""OpenAI's usage object: a job's tokens, a batch's total."""
from __future__ import annotations

from kvops.jobs.usage import output_tokens


def usage(state: dict) -> dict:
    """OpenAI's usage object from a job's state (every sample's tokens, with n > 1)."""
    output = output_tokens(state.get("samples"), state.get("num_output_tokens", 0))
    return usage_of(state.get("num_prompt_tokens", 0), output,
                    state.get("num_cached_tokens", 0), state.get("cached_tokens_by_tier"))


def usage_of(prompt: int, output: int, cached: int, by_tier: dict | None = None) -> dict:
    """by_tier: the cached tokens by tier, a kvops extension beside OpenAI's cached_tokens
    (docs/api.md)."""
    details = {"cached_tokens": cached}
    if by_tier:
        details["cached_tokens_by_tier"] = by_tier
    return {"prompt_tokens": prompt, "completion_tokens": output,
            "total_tokens": prompt + output, "prompt_tokens_details": details}


def total_usage(usages: list[dict]) -> dict:
    """Several prompts' usage as one (a completion of a list of prompts)."""
    tiers = [u["prompt_tokens_details"].get("cached_tokens_by_tier") for u in usages]
    by_tier = {k: sum(t.get(k, 0) for t in tiers) for k in tiers[0]} \
        if tiers and all(tiers) else None
    return usage_of(sum(u["prompt_tokens"] for u in usages),
                    sum(u["completion_tokens"] for u in usages),
                    sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages), by_tier)
