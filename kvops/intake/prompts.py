"""Prompts as an engine will see them, from any process: tokenizers (the simulator's, or
a model folder's), chat templates, and the web side's inspection of a prompt (its token
ids and block hashes under an engine's registered config) for validation and routing."""
from __future__ import annotations

import json
import logging
from typing import Any

from engine import EngineError
from engine.block_hash import hash_blocks, root_hash, short
from engine.text.detokenizer import SimTokenizer

log = logging.getLogger(__name__)


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The tokenizer's chat template applied to messages (and `tools`, OpenAI's list, for
    templates that render them); a plain transcript for the simulator, which has no
    template. Without the generation prompt (the assistant's turn opened) the text is the
    start of every chat that goes on from these messages: what a pin of them holds."""
    if hasattr(tokenizer, "apply_chat_template"):
        if tools:
            return tokenizer.apply_chat_template(messages, tools=tools,
                                                 add_generation_prompt=add_generation_prompt)
        return tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=add_generation_prompt)
    transcript = "".join(f"{m['role']}: {m['content']}{_calls_text(m)}\n" for m in messages)
    return transcript + ("assistant: " if add_generation_prompt else "")


def _calls_text(message: dict) -> str:
    calls = message.get("tool_calls")
    return "".join(f" <tool_call>{json.dumps(c['function'])}</tool_call>"
                   for c in calls) if calls else ""


def prompt_ids(tokenizer, prompt: str, messages: list[dict] | None,
               tools: list[dict] | None = None, add_generation_prompt: bool = True) -> list[int]:
    """The token ids an engine runs for a job: its chat rendered (with its tools) and
    tokenized, or its prompt tokenized. The web does this once, at intake
    (kvops/intake/intake.py); the ids travel with the job to routing, the worker and the core.
    A pin of a chat's prefix renders it without the generation prompt."""
    if messages:
        return tokenizer.encode(render_chat(tokenizer, messages, tools, add_generation_prompt))
    return tokenizer.encode(prompt)


def job_prompt_ids(job, config: dict, tokenizer) -> list[int] | None:
    """A stored job's prompt as token ids for an engine described by `config` (its
    describe_config()): those the web rendered at intake (kvops/intake/intake.py) when
    they were made with that engine's tokenizer, else rendered here the same way with
    `tokenizer` (a job stored while no engine of its kind was registered, or whose
    tokenizer the web could not read); None if they must be rendered and `tokenizer` is
    None."""
    ids = ids_for(job.tokenizer, job.prompt_token_ids, config)
    if ids is not None:
        return ids
    if tokenizer is None:
        return None
    tools = ((job.params or {}).get("tool_call") or {}).get("tools")
    return prompt_ids(tokenizer, job.prompt, job.messages, tools)


# Job.tokenizer of a prompt its client sent as token ids: those ids run on any engine
# serving its model (the model's vocabulary made them).
GIVEN_IDS = "given"


def ids_for(job_tokenizer: str, token_ids: list[int] | None, config: dict) -> list[int] | None:
    """A job's stored token ids if they are this engine's (sent as ids, or rendered with
    its tokenizer), else None (render them again)."""
    if token_ids is not None and job_tokenizer in (GIVEN_IDS, tokenizer_id(config)):
        return token_ids
    return None


def tokenizer_id(config: dict) -> str:
    """Which tokenizer an engine described by describe_config() uses: token ids made for
    one id are valid on every engine with that id."""
    path = _tokenizer_path(config)
    return "sim" if config.get("simulate") and not path else f"path:{path or ''}"


def _tokenizer_path(config: dict) -> str | None:
    """The tokenizer's folder in describe_config() (model_path for engines registered
    before tokenizer_path was)."""
    if "tokenizer_path" in config:
        return config["tokenizer_path"]
    return None if config.get("simulate") else config.get("model_path")


def load_tokenizer(config: dict):
    """The tokenizer of an engine described by describe_config(): the simulator's, or the
    tokenizer folder's (None if that folder is not readable from this process)."""
    path = _tokenizer_path(config)
    if not path:
        return SimTokenizer() if config.get("simulate") else None
    from engine.text.tokenizer import HFTokenizer
    try:
        return HFTokenizer.from_folder(path)
    except (OSError, EngineError) as e:
        log.warning("tokenizer of %s not readable here: %s", path, e)
        return None


def tokenizer_for(config) -> object | None:
    """The tokenizer an engine with this EngineConfig will use, read here (the worker
    detokenises and renders chats with it): the simulator's (simulate_tokenizer), or the
    model folder's (EngineConfig.model, else the converted default model)."""
    if config.simulate:
        from engine.model.build import simulated_tokenizer, simulated_tokenizer_path
        return simulated_tokenizer(simulated_tokenizer_path(config))
    from engine.model.default_model import default_model_dir
    return load_tokenizer({"model_path": str(config.model or default_model_dir())})


class PromptInspector:
    """The web side's view of a prompt as a given engine will see it: its token ids (the
    engine's tokenizer and chat template) and its block hashes (block size and model
    identity), without running the engine. Engines are described by their registered
    config (LLMEngine.describe_config)."""

    def __init__(self) -> None:
        self._tokenizers: dict[tuple, Any] = {}

    @staticmethod
    def tokenizer_key(config: dict) -> str:
        """Engines with equal keys have the same tokenizer."""
        return tokenizer_id(config)

    def tokenizer(self, config: dict):
        """The engine's tokenizer (cached), or None if its model folder is not readable
        from this process."""
        key = self.tokenizer_key(config)
        if key not in self._tokenizers:
            self._tokenizers[key] = load_tokenizer(config)
        return self._tokenizers[key]

    def has_chat_template(self, config: dict) -> bool | None:
        """Whether the engine's tokenizer has a chat template (an instruct model's: the
        pages' forms default to chat for it); None if its tokenizer is not readable here."""
        tokenizer = self.tokenizer(config)
        return None if tokenizer is None else bool(getattr(tokenizer, "chat_template", None))

    def token_ids(self, config: dict, prompt: str, messages: list[dict] | None,
                  tools: list[dict] | None = None,
                  add_generation_prompt: bool = True) -> list[int] | None:
        """The prompt's token ids on this engine (prompt_ids), or None if its tokenizer is
        not readable from here (its model folder is on another machine)."""
        tokenizer = self.tokenizer(config)
        if tokenizer is None:
            return None
        return prompt_ids(tokenizer, prompt, messages, tools, add_generation_prompt)

    def job_token_ids(self, config: dict, job) -> list[int] | None:
        """A stored job's token ids on this engine: those rendered at intake when they were
        made with its tokenizer, else rendered now (None if not readable here)."""
        ids = ids_for(job.tokenizer, job.prompt_token_ids, config)
        if ids is not None:  # (the tokenizer is not loaded for them)
            return ids
        return job_prompt_ids(job, config, self.tokenizer(config))

    def short_hashes(self, config: dict, token_ids: list[int] | None,
                     cache_salt: str | None = None) -> list[str]:
        """Short hashes of the full blocks of token_ids under this engine (and salt)."""
        if not token_ids or not config.get("block_size") or not config.get("model"):
            return []
        root = root_hash(config["model"], cache_salt)
        return [short(h) for h in hash_blocks(root, token_ids, int(config["block_size"]))]


inspector = PromptInspector()  # this process's, shared by validation and routing
