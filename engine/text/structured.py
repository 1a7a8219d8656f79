"""Structured output: grammar-constrained decoding with xgrammar, as vLLM integrates it.

A request's `SamplingParams.structured` names one constraint: `json` (a JSON schema),
`json_object` (any JSON object), `regex`, `choice` (one of a list of strings) or
`grammar` (EBNF). The engine compiles it once per distinct constraint for its tokenizer
(compiled grammars are cached), on a thread beside the step loop: the request waits,
live but not queued, until its grammar is ready, and one whose constraint xgrammar
refuses ends alone with the reason. Each step the sampler asks every constrained
request's matcher for the tokens it allows next (one bitmask for the batch, applied to
the logits in one op) and tells it the token drawn; a matcher that has accepted the end
of its grammar (and the EOS after it) ends the request.

What a constraint may be is bounded (check_spec): compile time grows with nesting
(cubically: a schema nested 400 deep took 20 s), with optional properties (2,000 took
10 s with the default tokenizer) and with counted repetitions, and a service compiles
what its users send. The web also compiles a constraint before it stores the job, in a
process it can stop (kvops/intake/grammar_check.py).

JSON is generated without free whitespace (xgrammar's any_whitespace off: items are
separated by ", " and ": "), so a small model cannot wander off in spaces and newlines.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from engine.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 100_000  # a schema, regex or grammar, as JSON text
MAX_SPEC_DEPTH = 64  # nesting of a constraint's JSON: a schema's objects within objects
MAX_OBJECT_PROPERTIES = 256  # properties one object of a schema names
MAX_SCHEMA_PROPERTIES = 2_048  # and all of its objects together
MAX_ALTERNATIVES = 4_096  # anyOf/oneOf/allOf members, enum values and choices, in all
MAX_REPEAT = 10_000  # a length or count bound (maxLength, minItems...) or a {m,n}
CACHE_SIZE = 256  # compiled grammars kept per engine
_LENGTH_KEYS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                "maxProperties", "minContains", "maxContains")
_ALTERNATIVE_KEYS = ("anyOf", "oneOf", "allOf", "enum", "prefixItems")
_COUNTED = re.compile(r"\{\s*([0-9]+)\s*(?:,\s*([0-9]*)\s*)?\}")  # {m}, {m,}, {m,n}


class ConstraintTooComplex(InvalidRequestError):
    """A constraint over one of the bounds above (its message names the bound)."""


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
    _check_size(kind, value)
    return spec


def _check_size(kind: str, value: Any) -> None:
    """ConstraintTooComplex if the constraint is over a bound. Iterative: the value may
    be nested as deep as a JSON decoder allows."""
    def too(what: str) -> ConstraintTooComplex:
        return ConstraintTooComplex(f"structured {kind}: {what}; simplify the constraint")

    properties = alternatives = chars = 0
    stack: list[tuple[Any, int, str | None]] = [(value, 1, None)]
    while stack:
        item, depth, key = stack.pop()
        if depth > MAX_SPEC_DEPTH:
            raise too(f"nested more than {MAX_SPEC_DEPTH} levels deep (the most allowed)")
        if isinstance(item, dict):
            chars += 2
            if kind in ("json", "json_object"):
                named = item.get("properties")
                if isinstance(named, dict) and key != "properties":
                    if len(named) > MAX_OBJECT_PROPERTIES:
                        raise too(f"an object with {len(named)} properties (at most "
                                  f"{MAX_OBJECT_PROPERTIES} in one object)")
                    properties += len(named)
                for name in _ALTERNATIVE_KEYS:
                    if isinstance(item.get(name), list):
                        alternatives += len(item[name])
                for name in _LENGTH_KEYS:
                    bound = item.get(name)
                    if isinstance(bound, int) and bound > MAX_REPEAT:
                        raise too(f"`{name}` is {bound} (at most {MAX_REPEAT})")
            for child_key, child in item.items():
                chars += len(str(child_key)) + 4
                stack.append((child, depth + 1, str(child_key)))
        elif isinstance(item, list):
            chars += 2
            stack.extend((child, depth + 1, None) for child in item)
        elif isinstance(item, str):
            chars += len(item) + 2
            if kind in ("regex", "grammar") or key == "pattern":
                for counted in _COUNTED.finditer(item):
                    bounds = [counted[1], counted[2] or "0"]
                    if any(len(b) > 9 for b in bounds) or max(map(int, bounds)) > MAX_REPEAT:
                        shown = counted[0] if len(counted[0]) <= 24 else counted[0][:20] + "…}"
                        raise too(f"a counted repetition {shown} (at most {MAX_REPEAT} "
                                  "times)")
        else:
            chars += len(str(item)) + 1
        if chars > MAX_SPEC_CHARS:
            raise too(f"longer than {MAX_SPEC_CHARS} characters of JSON")
    if properties > MAX_SCHEMA_PROPERTIES:
        raise too(f"{properties} properties in all (at most {MAX_SCHEMA_PROPERTIES} in a "
                  "schema)")
    if kind == "choice":
        alternatives = len(value)
    if alternatives > MAX_ALTERNATIVES:
        raise too(f"{alternatives} alternatives: anyOf, oneOf, allOf, enum or choice "
                  f"members (at most {MAX_ALTERNATIVES} in all)")


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
    """One engine's grammar compiler (built on first use from its tokenizer), the thread
    that compiles beside the step loop, and the cache of compiled grammars (a repeat of
    a constraint costs nothing)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler = None  # owned by the compile thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        # key -> compiled grammar (done) or its compile under way; owned by the caller's
        # thread (the step loop), which alone calls compile()
        self._compiled: OrderedDict[str, Future] = OrderedDict()

    def compile(self, spec: dict) -> Future:
        """The constraint's compiled grammar, as a future: done at once if it was
        compiled before, else done once the compile thread has made it. Its exception
        is an InvalidRequestError saying why xgrammar refused the constraint (or why
        this engine cannot constrain: the simulator's tokenizer)."""
        key = json.dumps(spec, sort_keys=True)  # (checked by SamplingParams)
        future = self._compiled.get(key)
        # (a refusal is not kept: the next request with that constraint compiles it again)
        if future is not None and not (future.done() and future.exception() is not None):
            self._compiled.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, spec)
        self._compiled[key] = future
        while len(self._compiled) > CACHE_SIZE:
            self._compiled.popitem(last=False)
        return future

    def _compile(self, spec: dict):
        grammar = grammar_of(spec)
        try:
            return self._compiler_for().compile_grammar(grammar)
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001  (xgrammar's RuntimeError/ValueError kinds)
            kind = next(iter(spec))
            raise InvalidRequestError(f"structured {kind}: {xgrammar_message(e)}") from None

    @staticmethod
    def matcher(compiled):
        """A fresh matcher of a compiled grammar, for one request."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

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
