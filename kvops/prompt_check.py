"""Refuse, before queueing, a prompt no engine that may run it can take."""
from __future__ import annotations

from kvops import selectors
from kvops.prompts import inspector


class PromptTooLong(ValueError):
    pass


def check_prompt_fits(prompt: str, messages: list[dict] | None, engine_name: str = "") -> None:
    """Raise PromptTooLong if the prompt is too long for every engine that could run it
    (the named one, else every live engine). Engines whose tokenizer is not readable
    from this process are given the benefit of the doubt: the engine checks again."""
    engines = [e for e in selectors.recent_engines()
               if (e.name == engine_name if engine_name else selectors.engine_alive(e))]
    reasons = []
    for engine in engines:
        limit = engine.config.get("max_model_len")
        token_ids = inspector.token_ids(engine.config, prompt, messages)
        if token_ids is None or not limit or len(token_ids) < limit:
            return
        reasons.append(f"{len(token_ids)} tokens on engine {engine.name}, whose model takes at "
                       f"most {limit - 1} prompt tokens")
    if reasons:
        raise PromptTooLong("the prompt is too long: " + "; ".join(reasons))
