"""Per-request sampling settings."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
