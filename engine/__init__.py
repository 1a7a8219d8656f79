"""kvops inference engine: paged KV cache, scheduler, model runner (see docs/design.md)."""
from engine.config import EngineConfig
from engine.errors import (EngineError, InvalidRequestError, InvalidStateError,
                           NotEnoughBlocksError, PrefixNotCachedError, UnknownRequestError)
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "EngineConfig", "LLMEngine", "SamplingParams", "RequestOutput", "EngineError",
    "UnknownRequestError", "InvalidStateError", "NotEnoughBlocksError", "InvalidRequestError",
    "PrefixNotCachedError",
]
