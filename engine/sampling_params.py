"""Per-request sampling settings."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


MAX_LOGPROBS = 20  # most likely tokens reported per sampled token, at most
MAX_N = 16  # parallel samples of one prompt, at most


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k filtering
    seed: int | None = None  # same seed, same output
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Applied to the logits before temperature, in this order (as vLLM does): min_tokens
    # and logit_bias, then the repetition, frequency and presence penalties; min_p after
    # temperature, with top-k and top-p.
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output
    frequency_penalty: float = 0.0  # minus this times each token's count in the output
    presence_penalty: float = 0.0  # minus this for each token present in the output
    min_p: float = 0.0  # drops tokens below min_p times the best token's probability
    # Log-probabilities of each sampled token and of the `logprobs` most likely tokens at
    # its place (None: none), from the model's raw logits (vLLM's default logprobs_mode,
    # raw_logprobs: before penalties, bias and temperature).
    logprobs: int | None = None
    # The same for each prompt token (vLLM's prompt_logprobs): the request then computes
    # its whole prompt, without the prefix cache's help.
    prompt_logprobs: int | None = None
    # A constraint on the output (engine/text/structured.py): {"json": schema},
    # {"json_object": true}, {"regex": ...}, {"choice": [...]} or {"grammar": EBNF}.
    structured: dict | None = None
    # Parallel sampling: n sequences from one prompt. The prompt is computed once; then
    # the request forks into n samples that share its blocks (the partly filled last one
    # copied on its first write). With a seed, sample i uses seed + i.
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
               f"temperature must be a number in [0, 100], got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0,
               f"top_p must be a number in (0, 1], got {self.top_p!r}")
        _check(self.top_k is None or (_is_int(self.top_k) and self.top_k >= 1),
               f"top_k must be None or an integer >= 1, got {self.top_k!r}")
        _check(self.seed is None or _is_int(self.seed),
               f"seed must be None or an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop must be a list of non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be a list of non-negative integers")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias must be a map of token id "
                                                      "to bias")
            bias = {}
            for token, value in self.logit_bias.items():
                # JSON (and so a stored job) has string keys: "50256" is token 50256
                if isinstance(token, str) and token.isascii() and token.isdigit():
                    token = int(token)
                _check(_is_int(token) and token >= 0,
                       f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                _check(_is_number(value) and -100.0 <= value <= 100.0,
                       f"logit_bias values must be numbers in [-100, 100], got {value!r}")
                bias[token] = float(value)
            self.logit_bias = bias or None
        _check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               f"repetition_penalty must be a number in (0, 10], got "
               f"{self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0,
                   f"{name} must be a number in [-2, 2], got {value!r}")
        _check(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got "
               f"{self.prompt_logprobs!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got "
               f"{self.logprobs!r}")
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N,
               f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.structured is not None:
            from engine.text.structured import check_spec
            check_spec(self.structured)
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0,
               f"min_p must be a number in [0, 1], got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Does any penalty change this request's logits?"""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    def token_ids_used(self) -> list[int]:
        """Token ids this request names (stop_token_ids, logit_bias): each must be in the
        model's vocabulary."""
        return [*self.stop_token_ids, *(self.logit_bias or ())]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
