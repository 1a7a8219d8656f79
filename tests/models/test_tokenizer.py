"""engine/text/tokenizer.py: encode/decode, EOS, and chat templates rendered as
transformers renders them."""
from __future__ import annotations

import json
import shutil

import pytest

from engine.model.default_model import default_model_dir
from engine.text.tokenizer import HFTokenizer
from engine.errors import ModelLoadError

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 2+2?"}]


def test_encode_decode_and_eos(tiny_model):
    tok = HFTokenizer.from_folder(tiny_model("gqa16"))
    ids = tok.encode("w5 w17 w200")
    assert ids == [5, 17, 200]
    assert tok.decode(ids) == "w5 w17 w200"
    assert tok.decode([5, 2, 6]) == "w5 w6"  # special tokens are skipped
    assert tok.eos_token_id == 2  # from tokenizer_config.json's eos_token
    assert HFTokenizer.from_folder(tiny_model("gqa16"), eos_token_id=7).eos_token_id == 7


def test_chat_template_matches_transformers(tiny_model):
    from transformers import AutoTokenizer

    folder = tiny_model("gqa16")
    ours = HFTokenizer.from_folder(folder).apply_chat_template(MESSAGES)
    theirs = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False)
    assert ours == theirs


@pytest.mark.skipif(not (default_model_dir() / "tokenizer.json").is_file(),
                    reason="default model not converted (run `make setup`)")
def test_default_model_tokenizer_matches_transformers():
    from transformers import AutoTokenizer

    folder = default_model_dir()
    ours, theirs = HFTokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    for messages in (MESSAGES, MESSAGES[1:]):
        text = ours.apply_chat_template(messages)
        assert text == theirs.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=False)
    text = "Déjà vu: 12345 apples, naïve café 🙂\n\tdef f(x): return x**2<|im_end|>"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_bos_is_not_doubled(tmp_path, tiny_model):
    from tokenizers import Tokenizer, processors

    folder = tmp_path / "bos"
    shutil.copytree(tiny_model("gqa16"), folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    hf = HFTokenizer.from_folder(folder)
    assert hf.encode("w5 w6") == [1, 5, 6]
    assert hf.encode("<s> w5 w6") == [1, 5, 6]  # e.g. a rendered chat template
    assert hf.encode("w5", add_special_tokens=False) == [5]


def test_chat_template_file_and_missing_template(tmp_path, tiny_model):
    folder = tmp_path / "tpl"
    shutil.copytree(tiny_model("gqa16"), folder)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert HFTokenizer.from_folder(folder).apply_chat_template(MESSAGES[:2]) == "[Be brief.][Hi there]"
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="no chat template"):
        HFTokenizer.from_folder(folder).apply_chat_template(MESSAGES)


def test_template_errors_surface(tmp_path, tiny_model):
    folder = tmp_path / "bad"
    shutil.copytree(tiny_model("gqa16"), folder)
    (folder / "chat_template.jinja").write_text("{{ raise_exception('only user turns') }}")
    with pytest.raises(Exception, match="only user turns"):
        HFTokenizer.from_folder(folder).apply_chat_template(MESSAGES)


def test_tools_reach_a_template_that_renders_them(tmp_path, tiny_model):
    """A chat with `tools` (the /v1 tool calls) is rendered with them where the model's
    template uses them, as transformers renders it; a template without them ignores them."""
    from transformers import AutoTokenizer

    from kvops.intake.prompts import render_chat
    folder = tmp_path / "tools"
    shutil.copytree(tiny_model("gqa16"), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}"
        "</tools>{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    tok = HFTokenizer.from_folder(folder)
    rendered = render_chat(tok, MESSAGES[1:2], tools)
    assert rendered.startswith("<tools>get_weather;</tools>user: Hi there")
    assert rendered == AutoTokenizer.from_pretrained(folder).apply_chat_template(
        MESSAGES[1:2], tools=tools, add_generation_prompt=True, tokenize=False)
    plain = HFTokenizer.from_folder(tiny_model("gqa16"))
    assert render_chat(plain, MESSAGES[1:2], tools) == render_chat(plain, MESSAGES[1:2])
