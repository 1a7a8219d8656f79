"""Structured output: grammar-constrained decoding with xgrammar, as vLLM integrates it.

A request's `SamplingParams.structured` names one constraint: `json` (a JSON schema),
`json_object` (any JSON object), `regex`, `choice` (one of a list of strings) or
`grammar` (EBNF). The engine compiles it once per distinct constraint for its tokenizer
(compiled grammars are cached) and gives the request a matcher. Each step the sampler
asks every constrained request's matcher for the tokens it allows next (one bitmask for
the batch, applied to the logits in one op) and tells it the token drawn; a matcher
that has accepted the end of its grammar (and the EOS after it) ends the request.

JSON is generated without free whitespace (xgrammar's any_whitespace off: items are
separated by ", " and ": "), so a small model cannot wander off in spaces and newlines.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

from engine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 100_000  # a schema, regex or grammar, as JSON text
CACHE_SIZE = 256  # compiled grammars kept per engine


def check_spec(spec: Any) -> dict:
    """The constraint's shape (no tokenizer needed): exactly one of KINDS, with a value of
    the right type. Raises InvalidRequestError naming what is wrong."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise InvalidRequestError(f"structured must be an object with exactly one of "
                                  f"{', '.join(KINDS)}")
    kind, value = next(iter(spec.items()))
    ok = {"json": isinstance(value, (dict, bool)) and value is not False,
          "json_object": value is True,
          "regex": isinstance(value, str) and value != "",
          "choice": isinstance(value, list) and bool(value)
          and all(isinstance(c, str) and c for c in value),
          "grammar": isinstance(value, str) and value != ""}[kind]
    if not ok:
        raise InvalidRequestError(f"structured {kind}: a bad value (json: a schema object; "
                                  "json_object: true; regex and grammar: a non-empty "
                                  "string; choice: a list of non-empty strings)")
    if len(json.dumps(value)) > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"structured {kind}: longer than {MAX_SPEC_CHARS} "
                                  "characters")
    return spec


def grammar_of(spec: dict):
    """The xgrammar Grammar of a constraint (no tokenizer needed: the web checks a
    request with this before it is queued). Raises InvalidRequestError for a schema,
    regex or grammar that xgrammar refuses."""
    import xgrammar as xgr

    kind, value = next(iter(check_spec(spec).items()))
    try:
        if kind == "json_object" or (kind == "json" and value is True):
            value = {"type": "object"}  # any object, without free whitespace as below
        if kind in ("json", "json_object"):
            return xgr.Grammar.from_json_schema(json.dumps(value), any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_regex("|".join(f"({re.escape(c)})" for c in value))
        return xgr.Grammar.from_ebnf(value)
    except Exception as e:  # noqa: BLE001  (xgrammar raises RuntimeError/ValueError kinds)
        raise InvalidRequestError(f"structured {kind}: {xgrammar_message(e)}") from None


# xgrammar's messages start with a time and the C++ source line that raised them
_XGRAMMAR_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?(\S+\.(cc|cpp|h|hpp):\d+:\s*)?")


def xgrammar_message(error: BaseException) -> str:
    """What an xgrammar error says, on one line, without where in its sources it was
    raised (a client has no use for the build's paths)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return _XGRAMMAR_PREFIX.sub("", lines[0]) or type(error).__name__


class StructuredOutputs:
    """One engine's grammar compiler (built on first use from its tokenizer) and its cache
    of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def matcher(self, spec: dict):
        """A fresh matcher for one request. InvalidRequestError if the constraint is bad
        or this engine's tokenizer cannot be constrained (the simulator's)."""
        import xgrammar as xgr

        key = json.dumps(spec, sort_keys=True)  # (checked by SamplingParams and grammar_of)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is None:
                compiled = self._compiler_for().compile_grammar(grammar_of(spec))
                self._compiled[key] = compiled
                if len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
        return xgr.GrammarMatcher(compiled)

    def _compiler_for(self):
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            inner = getattr(self.tokenizer, "_tok", None)  # engine.hf_tokenizer.HFTokenizer
            if inner is None:
                raise InvalidRequestError("structured output needs a model with a tokenizer "
                                          "and logits; the simulated engine has neither")
            info = xgr.TokenizerInfo.from_huggingface(
                PreTrainedTokenizerFast(tokenizer_object=inner), vocab_size=self.vocab_size,
                stop_token_ids=list(self.tokenizer.eos_token_ids) or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler


def apply_grammars(logits, matchers: list) -> None:
    """Mask, in place, every token a row's matcher does not allow next (rows without a
    matcher: None, untouched). One bitmask for the batch, one masking op."""
    import xgrammar as xgr

    rows = [i for i, m in enumerate(matchers) if m is not None]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for i in rows:
        matchers[i].fill_next_token_bitmask(bitmask, i)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    indices=rows)
