"""The service with a real model: an engine worker on a tiny random Llama, its greedy
output over REST and the OpenAI API equal to transformers' on the same weights."""
import json
import re
from pathlib import Path

import openai
import pytest

from engine.text.tokenizer import HFTokenizer
from tests.support.stack import Stack
from tests.models.tiny import SPECS, build_tiny_model, hf_greedy


def client_of(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.tokens["alice"],
                         max_retries=0, timeout=300)


def hf_logprobs(folder, token_ids: list[int]):
    """transformers' log-softmax at every position of token_ids (row p scores p + 1)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].log_softmax(-1)


@pytest.fixture(scope="module")
def tiny_stack(tmp_path_factory):
    folder = build_tiny_model(SPECS["gqa16"], Path(tmp_path_factory.mktemp("models")))
    # Its chat template renders OpenAI tools (their names, ahead of the chat), an agent's
    # calls and their results, and writes calls the Hermes way, as Qwen's does; a chat
    # without tools it renders as before.
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{# a call is written <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> #}"
        "{% if tools %}{{ '<s>tools ' }}{% for t in tools %}{{ t['function']['name'] + ' ' }}"
        "{% endfor %}{{ '</s> ' }}{% endif %}"
        "{% for m in messages %}{{ '<s>' + m['role'] + ' ' + (m['content'] or '') }}"
        "{% for c in m.tool_calls or [] %}{{ ' <tool_call> ' + c['function']['name'] + ' ' }}"
        "{% for k, v in c['function']['arguments'].items() %}{{ k + ' ' + v + ' ' }}"
        "{% endfor %}{{ '</tool_call>' }}{% endfor %}{{ ' </s> ' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<s>assistant ' }}{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    s = Stack(Path(tmp_path_factory.mktemp("tiny-stack")))
    try:
        s.start_web()
        s.start_engine("tiny", model=str(folder), device="cpu", dtype="float32",
                       attention_backend="torch", num_gpu_blocks=128, block_size=8,
                       max_num_seqs=8)
        s.model_folder = folder
        yield s
    finally:
        s.stop()


def test_rest_job_matches_transformers(tiny_stack):
    prompt = "w5 w17 w33 w101 w7 w64 w12 w99 w3 w150 w42"
    ids = HFTokenizer.from_folder(tiny_stack.model_folder).encode(prompt)
    want = hf_greedy(tiny_stack.model_folder, [ids], 12)[0]
    r = tiny_stack.api("POST", "/api/jobs/", json={"prompt": prompt, "max_tokens": 12,
                                                   "temperature": 0, "ignore_eos": True})
    assert r.status_code == 201, r.text
    job = tiny_stack.wait_job(r.json()["id"], timeout_s=120)
    assert job["status"] == "finished", job["error"]
    assert job["output_token_ids"] == want
    assert job["num_prompt_tokens"] == len(ids)
    # Same prompt again: the prefix cache serves its full blocks.
    again = tiny_stack.wait_job(tiny_stack.api("POST", "/api/jobs/", json={
        "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}).json()["id"])
    assert again["output_token_ids"] == want and again["num_cached_tokens"] >= 8


def test_a_chat_with_tools_is_rendered_once_the_same_on_both_apis(tiny_stack):
    """The web renders a chat with its tools and tokenizes it once: REST and /v1 store
    the same token ids (transformers' rendering, tokenized), the engine runs exactly
    those (its prompt length, and the second job's prefix-cache hit on the first's
    blocks), and routing hashes them as the engine does (the second job is routed by
    the first one's blocks)."""
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "w44", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "w5 w17 w33 w101 w7 w64 w12 w99 w3 w150 w42 w8"}]
    text = AutoTokenizer.from_pretrained(tiny_stack.model_folder).apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False)
    want = HFTokenizer.from_folder(tiny_stack.model_folder).encode(text)
    assert 44 in want  # the tool's name is in the prompt
    r = tiny_stack.api("POST", "/api/jobs/", user="alice", json={
        "model": "gqa16", "messages": messages, "tools": tools, "max_tokens": 2,
        "ignore_eos": True})
    assert r.status_code == 201, r.text
    rest = tiny_stack.wait_job(r.json()["id"], timeout_s=120, user="alice")
    answer = client_of(tiny_stack).chat.completions.create(
        model="gqa16", messages=messages, tools=tools, max_tokens=2,
        extra_body={"ignore_eos": True})
    v1 = tiny_stack.wait_job(int(answer.id.split("-")[1]), timeout_s=120, user="alice")
    assert rest["status"] == v1["status"] == "finished", (rest["error"], v1["error"])
    assert rest["prompt_token_ids"] == v1["prompt_token_ids"] == want
    assert rest["num_prompt_tokens"] == v1["num_prompt_tokens"] == len(want)
    block = 8
    assert v1["num_cached_tokens"] == (len(want) - 1) // block * block
    assert v1["routing"]["engine"] == "tiny"
    assert v1["routing"]["cached_blocks"]["tiny"] == len(want) // block


def test_an_agents_second_turn_runs_as_transformers_renders_it(tiny_stack):
    """A tool loop's second turn through the official client: the assistant's call
    (content null, arguments as JSON text) and the tool's result, rendered by the model's
    chat template as transformers renders it; the answer is transformers' greedy one."""
    from transformers import AutoTokenizer

    tools = [{"type": "function", "function": {"name": "w44", "parameters": {
        "type": "object", "properties": {"w7": {"type": "string"}}}}}]
    messages = [{"role": "developer", "content": "w3 w4"},
                {"role": "user", "content": "w5 w17 w33"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_9", "type": "function",
                     "function": {"name": "w44", "arguments": "{\"w7\": \"w64\"}"}}]},
                {"role": "tool", "tool_call_id": "call_9", "content": "w12 w99"}]
    answer = client_of(tiny_stack).chat.completions.create(
        model="gqa16", messages=messages, tools=tools, max_tokens=4,
        temperature=0, extra_body={"ignore_eos": True})
    as_hf = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    as_hf[2] = {**as_hf[2], "tool_calls": [{**as_hf[2]["tool_calls"][0], "function": {
        "name": "w44", "arguments": {"w7": "w64"}}}]}  # transformers takes them decoded
    text = AutoTokenizer.from_pretrained(tiny_stack.model_folder).apply_chat_template(
        as_hf, tools=tools, add_generation_prompt=True, tokenize=False)
    assert "<tool_call> w44 w7 w64 </tool_call>" in text and "<s>tool w12 w99" in text
    want = HFTokenizer.from_folder(tiny_stack.model_folder).encode(text)
    job = tiny_stack.wait_job(int(answer.id.split("-")[1]), timeout_s=120, user="alice")
    assert job["prompt_token_ids"] == want
    tok = HFTokenizer.from_folder(tiny_stack.model_folder)
    assert answer.choices[0].message.content == tok.decode(hf_greedy(
        tiny_stack.model_folder, [want], 4)[0])


def test_openai_chat_on_the_model(tiny_stack):
    client = client_of(tiny_stack)
    (model,) = [m.id for m in client.models.list()]
    assert model == "gqa16"
    messages = [{"role": "user", "content": "w9 w8 w7"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                       temperature=0)
    tok = HFTokenizer.from_folder(tiny_stack.model_folder)
    ids = tok.encode(tok.apply_chat_template(messages))
    want = hf_greedy(tiny_stack.model_folder, [ids], 6)[0]
    cut = want.index(2) if 2 in want else len(want)  # EOS ends a chat turn
    assert r.choices[0].message.content == tok.decode(want[:cut])
    assert r.usage.prompt_tokens == len(ids)


def test_penalties_through_both_apis_match_transformers(tiny_stack):
    """repetition_penalty and logit_bias reach the model's sampler from /v1 and from the
    REST API: greedy output equals transformers' generate with the same processors."""
    prompt = "w5 w17 w33 w101 w7 w64 w12 w99 w3 w150 w42"
    ids = HFTokenizer.from_folder(tiny_stack.model_folder).encode(prompt)
    plain = hf_greedy(tiny_stack.model_folder, [ids], 10)[0]
    banned = plain[0]
    want = hf_greedy(tiny_stack.model_folder, [ids], 10, repetition_penalty=1.6,
                     sequence_bias={(banned,): -100.0})[0]
    assert want != plain
    client = client_of(tiny_stack)
    r = client.completions.create(model="gqa16", prompt=prompt, max_tokens=10, temperature=0,
                                  logit_bias={str(banned): -100},
                                  extra_body={"repetition_penalty": 1.6, "ignore_eos": True})
    job = tiny_stack.wait_job(int(r.id.split("-")[1]))
    assert job["output_token_ids"] == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="gqa16", prompt=prompt, max_tokens=10, temperature=0, stream=True,
        logit_bias={str(banned): -100}, extra_body={"repetition_penalty": 1.6,
                                                    "ignore_eos": True}))
    assert streamed == r.choices[0].text
    rest = tiny_stack.wait_job(tiny_stack.api("POST", "/api/jobs/", json={
        "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
        "repetition_penalty": 1.6, "logit_bias": {str(banned): -100}}).json()["id"],
        timeout_s=120)
    assert rest["output_token_ids"] == want


def test_tokenize_matches_the_engines_tokenizer(tiny_stack):
    import requests
    prompt = "w5 w17 w33"
    want = HFTokenizer.from_folder(tiny_stack.model_folder).encode(prompt)
    r = requests.post(f"{tiny_stack.url}/tokenize", json={"model": "gqa16", "prompt": prompt},
                      headers={"Authorization": f"Bearer {tiny_stack.tokens['alice']}"},
                      timeout=30)
    assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    back = requests.post(f"{tiny_stack.url}/detokenize", json={"model": "gqa16", "tokens": want},
                         headers={"Authorization": f"Bearer {tiny_stack.tokens['alice']}"},
                         timeout=30)
    assert back.json()["prompt"].strip() == prompt


def test_logprobs_through_v1_match_transformers(tiny_stack):
    prompt = "w5 w17 w33 w101 w7"
    tokenizer = HFTokenizer.from_folder(tiny_stack.model_folder)
    ids = tokenizer.encode(prompt)
    client = client_of(tiny_stack)
    r = client.completions.create(model="gqa16", prompt=prompt, max_tokens=5, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    out = tiny_stack.wait_job(int(r.id.split("-")[1]))["output_token_ids"]
    reference = hf_logprobs(tiny_stack.model_folder, ids + out)[len(ids) - 1:-1]
    lp = r.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in out]
    for row, token, got, top in zip(reference, out, lp.token_logprobs, lp.top_logprobs):
        assert abs(got - row[token].item()) < 1e-4
        assert abs(max(top.values()) - row.max().item()) < 1e-4 and len(top) <= 2


@pytest.fixture(scope="module")
def default_stack(tmp_path_factory):
    """The service on the real default model (SmolLM2-135M-Instruct, float32, CPU)."""
    from engine.model.default_model import default_model_dir
    if not (default_model_dir() / "config.json").is_file():
        pytest.skip("default model not converted (run `make setup`)")
    s = Stack(Path(tmp_path_factory.mktemp("default-stack")))
    try:
        s.start_web()
        s.start_engine("smol", model=str(default_model_dir()), device="cpu", dtype="float32",
                       attention_backend="torch", num_gpu_blocks=256, max_num_seqs=8)
        yield s
    finally:
        s.stop()


def test_structured_output_on_the_default_model(default_stack):
    """response_format json_schema (chat, streamed and not), json_object, vLLM's
    structured_outputs choice (completions) and the REST API: every answer parses and
    validates."""

    import jsonschema
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "sunny"],
              "properties": {"city": {"type": "string", "maxLength": 24},
                             "sunny": {"type": "boolean"}}}
    client = openai.OpenAI(base_url=f"{default_stack.url}/v1",
                           api_key=default_stack.tokens["alice"], max_retries=0, timeout=300)
    (model,) = [m.id for m in client.models.list()]
    messages = [{"role": "user", "content": "The weather in Paris, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema,
                                                  "strict": True}}
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=60,
                                       temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=60, temperature=0.8, seed=2, stream=True,
        response_format=fmt))
    jsonschema.validate(json.loads(streamed), schema)
    any_object = client.chat.completions.create(  # (the weather prompt makes it loop)
        model=model, max_tokens=100, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give a JSON object with a name and an age."}]
    ).choices[0]
    assert any_object.finish_reason == "stop"
    assert isinstance(json.loads(any_object.message.content), dict)
    choice = client.completions.create(model=model, prompt="Is the sky blue? Answer:",
                                       max_tokens=5, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    job = default_stack.wait_job(default_stack.api("POST", "/api/jobs/", json={
        "messages": messages, "max_tokens": 60, "structured_outputs": {"json": schema}})
        .json()["id"], timeout_s=300)
    jsonschema.validate(json.loads(job["output_text"]), schema)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False,
                                       "required": ["zone"],
                                       "properties": {"zone": {"type": "string",
                                                               "maxLength": 12}}}}}


def test_tool_calls_on_the_default_model(default_stack):
    """A named tool_choice and `required`, streamed and not: tool_calls in OpenAI's shape
    whose arguments validate against the tool's parameters."""

    import jsonschema
    client = openai.OpenAI(base_url=f"{default_stack.url}/v1",
                           api_key=default_stack.tokens["alice"], max_retries=0, timeout=300)
    (model,) = [m.id for m in client.models.list()]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=60,
                                       temperature=0, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert r.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER_TOOL["function"]["parameters"])
    name, arguments = None, ""
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=60,
                                                temperature=0, tools=[WEATHER_TOOL],
                                                tool_choice=named, stream=True):
        for delta in chunk.choices[0].delta.tool_calls or ():
            name = delta.function.name or name
            arguments += delta.function.arguments or ""
    assert name == "get_weather" and json.loads(arguments) == json.loads(call.function.arguments)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=120,
                                       temperature=0, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    streamed = [d for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=120, temperature=0,
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", stream=True)
        for d in chunk.choices[0].delta.tool_calls or ()]
    assert streamed and streamed[0].function.name in ("get_weather", "get_time")


def test_echo_with_logprobs_scores_the_prompt(tiny_stack):
    """echo + logprobs (what evaluation harnesses send): the prompt's tokens come first,
    the first with no logprob, the rest as transformers scores them; then the answer's;
    streamed the same way."""
    prompt = "w5 w17 w33 w101 w7 w64"
    tokenizer = HFTokenizer.from_folder(tiny_stack.model_folder)
    ids = tokenizer.encode(prompt)
    client = client_of(tiny_stack)
    r = client.completions.create(model="gqa16", prompt=prompt, max_tokens=3, temperature=0,
                                  logprobs=1, echo=True, extra_body={"ignore_eos": True})
    out = tiny_stack.wait_job(int(r.id.split("-")[1]))["output_token_ids"]
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert lp.tokens == [tokenizer.decode([t]) for t in ids + out]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = hf_logprobs(tiny_stack.model_folder, ids + out)
    for position, (token, got) in enumerate(zip((ids + out)[1:], lp.token_logprobs[1:])):
        assert abs(got - reference[position][token].item()) < 1e-4
    streamed = [t for c in client.completions.create(
        model="gqa16", prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True,
        stream=True, extra_body={"ignore_eos": True}) if c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>"
    "{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>\nAnswer a call as "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hermes_stack(tmp_path_factory):
    """The default model with a chat template that writes tool calls the Hermes way."""
    import shutil

    from engine.model.default_model import default_model_dir
    source = default_model_dir()
    if not (source / "config.json").is_file():
        pytest.skip("default model not converted (run `make setup`)")
    folder = tmp_path_factory.mktemp("hermes") / "SmolLM2-hermes"
    folder.mkdir()
    for item in source.iterdir():
        if item.name == "tokenizer_config.json":
            config = json.loads(item.read_text())
            config["chat_template"] = HERMES_TEMPLATE
            (folder / item.name).write_text(json.dumps(config))
        elif item.suffix == ".safetensors":
            (folder / item.name).symlink_to(item)
        else:
            shutil.copy(item, folder / item.name)
    s = Stack(Path(tmp_path_factory.mktemp("hermes-stack")))
    try:
        s.start_web()
        s.start_engine("hermes", model=str(folder), device="cpu", dtype="float32",
                       attention_backend="torch", num_gpu_blocks=256, max_num_seqs=8)
        yield s
    finally:
        s.stop()


def test_auto_tool_calls_are_parsed_from_a_hermes_template(hermes_stack):
    """tool_choice auto on a template that writes <tool_call> blocks: the tools reach the
    prompt, and a call in the answer comes back as tool_calls (the model is steered into
    one with a regex, as a 135M model rarely calls on its own), streamed and not; an
    answer without a call is plain content."""
    client = openai.OpenAI(base_url=f"{hermes_stack.url}/v1",
                           api_key=hermes_stack.tokens["alice"], max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    steer = {"structured_outputs": {"regex": re.escape(call)}}
    r = client.chat.completions.create(model="SmolLM2-hermes", messages=messages,
                                       max_tokens=60, temperature=0, tools=[WEATHER_TOOL],
                                       extra_body=steer)
    assert r.choices[0].finish_reason == "tool_calls"
    (made,) = r.choices[0].message.tool_calls
    assert made.function.name == "get_weather"
    assert json.loads(made.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(
        model="SmolLM2-hermes", messages=messages, max_tokens=60, temperature=0,
        tools=[WEATHER_TOOL], stream=True, extra_body=steer))
    streamed = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert [d.function.name for d in streamed] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    plain = client.chat.completions.create(model="SmolLM2-hermes", messages=messages,
                                           max_tokens=8, temperature=0, tools=[WEATHER_TOOL])
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_rest_jobs_keep_their_logprobs(tiny_stack):
    """logprobs and prompt_logprobs on the REST API: stored on the job, in the same shape
    as /v1 shows them, with transformers' values."""
    prompt = "w5 w17 w33 w101"
    tokenizer = HFTokenizer.from_folder(tiny_stack.model_folder)
    ids = tokenizer.encode(prompt)
    job = tiny_stack.wait_job(tiny_stack.api("POST", "/api/jobs/", json={
        "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
        "logprobs": 2, "prompt_logprobs": 1}).json()["id"], timeout_s=120)
    out = job["output_token_ids"]
    reference = hf_logprobs(tiny_stack.model_folder, ids + out)
    assert [e[0] for e in job["prompt_logprobs"]] == [tokenizer.decode([t]) for t in ids]
    assert job["prompt_logprobs"][0][1] is None
    scored = job["prompt_logprobs"][1:] + job["output_logprobs"]
    for position, (token, entry) in enumerate(zip((ids + out)[1:], scored)):
        assert abs(entry[1] - reference[position][token].item()) < 1e-4
    assert all(len(e[2]) == 2 for e in job["output_logprobs"])


def test_responses_function_tool_and_json_schema_on_the_default_model(default_stack):
    """The Responses API through the official client: a required function call comes
    back as a function_call item whose arguments validate (streamed too), and
    text.format json_schema constrains the message's text."""
    import jsonschema

    client = client_of(default_stack)
    tool = {"type": "function", "name": "get_weather",
            "description": WEATHER_TOOL["function"]["description"],
            "parameters": WEATHER_TOOL["function"]["parameters"]}
    r = client.responses.create(model="SmolLM2-135M-Instruct", input="Weather in Paris?",
                                tools=[tool], tool_choice="required", max_output_tokens=60,
                                temperature=0)
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    events = list(client.responses.create(
        model="SmolLM2-135M-Instruct", input="Weather in Paris?", tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
        temperature=0, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1
    jsonschema.validate(json.loads(done[0].arguments), tool["parameters"])
    schema = {"type": "object", "additionalProperties": False, "required": ["answer"],
              "properties": {"answer": {"type": "string", "maxLength": 20}}}
    r = client.responses.create(model="SmolLM2-135M-Instruct", input="Say yes.",
                                max_output_tokens=40, temperature=0, text={"format": {
                                    "type": "json_schema", "name": "a", "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_a_responses_tool_round_trip_renders_as_transformers(tiny_stack):
    """The second turn of a function tool round trip on the Responses API: the model's
    call and its output as input items after previous_response_id's conversation,
    rendered by the chat template as transformers renders that chat."""
    from transformers import AutoTokenizer

    client = client_of(tiny_stack)
    tools = [{"type": "function", "name": "w44", "parameters": {
        "type": "object", "properties": {"w7": {"type": "string"}}}}]
    first = client.responses.create(model="gqa16", input="w5 w17 w33", tools=tools,
                                    max_output_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
    second = client.responses.create(
        model="gqa16", previous_response_id=first.id, tools=tools, max_output_tokens=3,
        temperature=0, extra_body={"ignore_eos": True}, input=[
            {"type": "function_call", "call_id": "call_5", "name": "w44",
             "arguments": "{\"w7\": \"w64\"}"},
            {"type": "function_call_output", "call_id": "call_5", "output": "w12 w99"}])
    chat = [{"role": "user", "content": "w5 w17 w33"},
            {"role": "assistant", "content": first.output_text},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_5", "type": "function",
                 "function": {"name": "w44", "arguments": {"w7": "w64"}}}]},
            {"role": "tool", "tool_call_id": "call_5", "content": "w12 w99"}]
    text = AutoTokenizer.from_pretrained(tiny_stack.model_folder).apply_chat_template(
        chat, tools=[{"type": "function", "function": {k: v for k, v in tools[0].items()
                                                       if k != "type"}}],
        add_generation_prompt=True, tokenize=False)
    job = tiny_stack.wait_job(second.model_extra["kvops_job_id"], timeout_s=120, user="alice")
    assert job["prompt_token_ids"] == HFTokenizer.from_folder(tiny_stack.model_folder).encode(text)
    assert second.output_text == job["output_text"]
