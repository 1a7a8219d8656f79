"""Incremental detokenisation: text that grows token by token without breaking a
multi-byte character in two (a byte-level BPE token can end mid-character)."""
from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    eos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # a request stops on any of them

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    """Decodes a window of recent tokens instead of the whole output each time: the
    text of ids[prefix:read] is stable, and ids[prefix:] adds the new text after it."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._min_tokens = min_tokens  # stop strings count once this many tokens are out
        self._stop_from = 0  # stop strings are looked for from here in self.text
        self._max_stop_len = max((len(s) for s in stop), default=0)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""  # text so far (stop string and what follows it cut off)
        self.stopped = False  # a stop string was found
        self._emitted = 0  # characters of self.text already handed out

    def add(self, token_ids: list[int]) -> None:
        """Feed new tokens; self.text grows when they complete characters."""
        if self.stopped:
            return
        self._ids.extend(token_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._tokenizer.decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        start = len(self.text)
        self.text += new_text[len(prefix_text):]
        if len(self._ids) <= self._min_tokens:  # too early: this text cannot stop it
            self._stop_from = len(self.text)
        elif self._stop:
            # A stop string may straddle the old text and the new.
            search_from = max(self._stop_from, start - self._max_stop_len + 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                self.stopped = True
                self.text = self.text[:min(hits)]

    def take_delta(self, final: bool) -> str:
        """Text not handed out yet. Until the end, the last len(longest stop) - 1
        characters are held back: they may turn out to start a stop string."""
        if final or self.stopped:
            end = len(self.text)
        else:
            end = max(self._emitted, len(self.text) - max(self._max_stop_len - 1, 0))
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta


class SimTokenizer:
    """Tokenizer of the simulator: UTF-8 bytes in; ids as bytes or short words out."""

    eos_token_id = None
    eos_token_ids: tuple[int, ...] = ()
    _SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi",
                  "be", "du", "fo", "ga", "hi", "jo", "pu", "ze"]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # no special tokens here: add_special_tokens changes nothing
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        parts = []
        for t in token_ids:
            s = self._SYLLABLES
            parts.append(s[t % 16] + s[(t // 16) % 16] + " ")
        return "".join(parts)
