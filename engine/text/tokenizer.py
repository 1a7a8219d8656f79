"""The tokenizer of an HF folder: tokenizer.json through the `tokenizers` library, and
the chat template (tokenizer_config.json's chat_template or chat_template.jinja)
rendered with jinja2 in a sandbox, as transformers renders it."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from engine.errors import ModelLoadError


class HFTokenizer:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], bos_token: str | None,
                 eos_token: str | None, chat_template: str | None) -> None:
        self._tok = tokenizer  # tokenizers.Tokenizer
        self.eos_token_ids = eos_token_ids  # a request stops on any of them
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self._compiled = None  # the jinja2 template, compiled on first use

    @classmethod
    def from_folder(cls, folder: str | Path,
                    eos_token_id: int | tuple[int, ...] | None = None) -> "HFTokenizer":
        """eos_token_id: the model's EOS id or ids (generation_config.json); None or ()
        falls back to the tokenizer's eos_token."""
        from tokenizers import Tokenizer

        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{folder}: missing tokenizer.json (kvops needs the fast "
                                 "tokenizer file; save one with transformers' save_pretrained)")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on a bad file
            raise ModelLoadError(f"{path}: cannot load it: {e}") from None
        config = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id or ())
        if not ids and eos is not None and tok.token_to_id(eos) is not None:
            ids = (tok.token_to_id(eos),)
        return cls(tok, ids, bos, eos, _chat_template(folder, config))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        """Token ids of text. add_special_tokens=None adds the tokenizer's specials (e.g.
        BOS) unless the text already starts with the BOS token, as a rendered chat
        template does, so the BOS is never doubled."""
        if add_special_tokens is None:
            add_special_tokens = not (self.bos_token and text.startswith(self.bos_token))
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The prompt text for a chat: messages is a list of {"role", "content"}."""
        if self.chat_template is None:
            raise ModelLoadError("this model has no chat template (tokenizer_config.json "
                                 "chat_template or chat_template.jinja); send a plain prompt")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        return self._compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


def _token_text(token: str | dict | None) -> str | None:
    if isinstance(token, dict):  # older tokenizer_config.json: {"content": ..., ...}
        return token.get("content")
    return token


def _chat_template(folder: Path, config: dict) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template


def _compile(template: str):
    """Compile as transformers does: sandboxed, trim_blocks/lstrip_blocks, with its
    tojson filter and raise_exception / strftime_now helpers."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelLoadError(f"the chat template does not compile: {e}") from None
