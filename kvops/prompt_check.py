"""Refuse, before queueing, a job no engine that may run it can take: a prompt longer
than the model's limit, or a token id (stop_token_ids, logit_bias) outside its
vocabulary. The engine would refuse it too, but only after the job was stored."""
from __future__ import annotations

from kvops import selectors
from kvops.models import Engine
from kvops.prompts import inspector


class DoesNotFit(ValueError):
    """No engine that may run the job can take it (HTTP 400); param names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_fits(prompt: str, messages: list[dict] | None, params: dict,
               engine_name: str = "", model: str | None = None) -> None:
    """Raise DoesNotFit if every engine that could run the job refuses it: the named
    one, else the live engines serving `model` (any live engine if None). Engines
    whose tokenizer is not readable from this process are given the benefit of the
    doubt on the prompt's length: the engine checks again."""
    candidates = selectors.candidate_engines(engine_name, model)
    refusals: list[tuple[str, str]] = []
    for engine in candidates:
        refusal = _refusal(engine, prompt, messages, params)
        if refusal is None:
            return
        refusals.append(refusal)
    if refusals:
        param = refusals[0][0]
        raise DoesNotFit(param, "; ".join(message for _, message in refusals))


def _refusal(engine: Engine, prompt: str, messages: list[dict] | None,
             params: dict) -> tuple[str, str] | None:
    """(field, why) if this engine cannot take the job, else None."""
    vocab = engine.config.get("vocab_size")
    if vocab:
        for field in ("stop_token_ids", "logit_bias"):
            ids = [int(t) for t in params.get(field) or ()]
            if ids and max(ids) >= vocab:
                return field, (f"`{field}` names token id {max(ids)}; engine {engine.name}'s "
                               f"model has {vocab} tokens (ids below {vocab})")
    limit = engine.config.get("max_model_len")
    token_ids = inspector.token_ids(engine.config, prompt, messages)
    if token_ids is not None and limit and len(token_ids) >= limit:
        return ("messages" if messages else "prompt",
                f"the prompt is too long: {len(token_ids)} tokens on engine {engine.name}, "
                f"whose model takes at most {limit - 1} prompt tokens")
    return None
