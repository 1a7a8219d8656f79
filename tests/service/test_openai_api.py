"""The official openai client, unchanged, against /v1."""
import openai
import pytest

from tests.service.test_jobs_api import expected_text


@pytest.fixture()
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.tokens["alice"],
                         max_retries=0, timeout=60)


def test_models(client):
    models = [m.id for m in client.models.list()]
    assert "simulated-v1" in models


def test_completion(client, stack):
    r = client.completions.create(model="simulated-v1", prompt="hello kvops", max_tokens=7,
                                  temperature=0)
    assert r.choices[0].text == expected_text("hello kvops", 7)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7 and r.usage.prompt_tokens == len("hello kvops")
    job_id = int(r.id.split("-")[1])
    job = stack.api("GET", f"/api/jobs/{job_id}/").json()
    assert job["source"] == "openai" and job["owner"] == "alice"


def test_streaming_completion(client):
    chunks = list(client.completions.create(model="simulated-v1", prompt="stream me",
                                            max_tokens=40, stream=True))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == expected_text("stream me", 40)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) >= 3  # it streamed, not one blob


def test_chat_and_streaming_chat(client):
    r = client.chat.completions.create(model="simulated-v1", max_tokens=5,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    stream = client.chat.completions.create(model="simulated-v1", max_tokens=5, stream=True,
                                            messages=[{"role": "user", "content": "hi"}])
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert text == r.choices[0].message.content


def test_errors_are_openai_shaped(client, stack):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x")
    assert "gpt-9" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="simulated-v1", prompt="x", max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="simulated-v1", prompt="x", n=30)
    bad = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_metrics_and_healthz(stack, client):
    import requests
    client.completions.create(model="simulated-v1", prompt="for the metrics", max_tokens=3)
    text = stack.api("GET", "/metrics").text  # (staff's token: /metrics is staff's)
    for name in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "kvops:num_swaps_out_total", "vllm:num_requests_running",
                 "vllm:time_to_first_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "kvops:engine_steps_total",
                 "kvops:engine_step_seconds_total"):
        assert name in text, name
    line = next(l for l in text.splitlines()
                if l.startswith('vllm:e2e_request_latency_seconds_count{engine="sim",'
                                 'model_name="simulated-v1"}'))
    assert float(line.split()[-1]) >= 1
    health = stack.api("GET", "/healthz").json()  # signed in: the checks and the engines
    assert health["ok"] and health["checks"] == {"database": "ok", "redis": "ok"}
    assert any(e["name"] == "sim" and e["alive"] for e in health["engines"])
    anonymous = requests.get(f"{stack.url}/healthz", timeout=10).json()  # status only
    assert set(anonymous) == {"ok", "checks", "engines_alive"} and anonymous["ok"]
    assert anonymous["engines_alive"] >= 1


def test_rest_and_v1_apply_the_same_rules(stack):
    """One set of rules (kvops/intake/limits.py): the same request is refused by both APIs, in
    the same words; a priority below 0 is for staff only, on both."""
    import requests

    def v1(body: dict, user: str = "admin") -> requests.Response:
        return requests.post(f"{stack.url}/v1/completions", timeout=30, json={
            "model": "simulated-v1", "prompt": "rules", "max_tokens": 2, **body},
            headers={"Authorization": f"Bearer {stack.tokens[user]}"})

    def rest(body: dict, user: str = "admin") -> requests.Response:
        return stack.api("POST", "/api/jobs/", json={"prompt": "rules", "max_tokens": 2,
                                                     **body}, user=user)

    for body, words in [({"stop": ["x" * 257]}, "at most 256 characters"),
                        ({"min_tokens": 3}, "min_tokens must be an integer in [0, max_tokens]"),
                        ({"logit_bias": {"5": 200}}, "values must be numbers in [-100, 100]"),
                        ({"presence_penalty": 2.5}, "presence_penalty")]:
        a, b = v1(body), rest(body)
        assert a.status_code == b.status_code == 400, (body, a.text, b.text)
        assert words in a.json()["error"]["message"] and words in b.text, (a.text, b.text)
    ok = {"min_tokens": 1, "logit_bias": {"5": -2}, "frequency_penalty": 0.3,
          "repetition_penalty": 1.1, "min_p": 0.05}
    assert v1(ok).status_code == 200 and rest(ok).status_code == 201
    long_stop = {"stop": ["x" * 257]}
    a, b = v1(long_stop), rest(long_stop)
    assert a.status_code == b.status_code == 400, (a.text, b.text)
    assert "at most 256 characters" in a.json()["error"]["message"]
    assert "at most 256 characters" in b.text
    for call, created in ((v1, 200), (rest, 201)):  # (a /v1 answer, a REST job created)
        refused = call({"priority": -5}, user="alice")
        assert refused.status_code == 403 and "only staff" in refused.text, refused.text
        assert call({"priority": 5}, user="alice").status_code == created
        assert call({"priority": -5}, user="admin").status_code == created
        assert call({"priority": 5000}).status_code == 400


def test_stream_options_usage_last_chunk_and_continuous(client):
    chunks = list(client.completions.create(
        model="simulated-v1", prompt="count me", max_tokens=9, stream=True,
        stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 9
    assert last.usage.prompt_tokens == len("count me")
    assert last.usage.prompt_tokens_details.cached_tokens == 0  # (no full block of 16)
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].text for c in body) == expected_text("count me", 9)
    chunks = list(client.chat.completions.create(
        model="simulated-v1", max_tokens=6, stream=True,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6  # grows to the total
    assert all(c.usage.prompt_tokens > 0 for c in chunks[1:])
    assert chunks[-1].choices == []


def test_every_field_is_honoured_or_refused_by_name(client):
    """vLLM's sampling fields are taken; fields not served yet, unknown fields, and bad
    values get a 400 that names the field; none is ignored."""
    r = client.completions.create(
        model="simulated-v1", prompt="fields", max_tokens=6, temperature=0.5, seed=3,
        presence_penalty=0.5, frequency_penalty=-0.5, logit_bias={"7": 3}, user="u-1",
        extra_body={"repetition_penalty": 1.2, "min_tokens": 2, "min_p": 0.1, "top_k": 20,
                    "stop_token_ids": [5], "ignore_eos": True})
    assert r.usage.completion_tokens >= 2
    refused = [({"echo": True, "logprobs": 1}, "echo"),
               ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"),
               ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
               ({"extra_body": {"min_tokens": 9}}, "min_tokens"),  # above max_tokens
               ({"presence_penalty": 3}, "presence_penalty"),
               ({"logit_bias": {"x": 1}}, "logit_bias"),
               ({"stream_options": {"include_usage": True}}, "stream_options"),  # no stream
               ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty")]
    for kwargs, name in refused:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="simulated-v1", prompt="x", max_tokens=4, **kwargs)
        assert e.value.body["param"] == name, (kwargs, e.value.body)
        assert name in e.value.body["message"]
    for kwargs, name in [({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                          "tool_choice")]:  # "auto", the default with tools
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="simulated-v1", max_tokens=4,
                                           messages=[{"role": "user", "content": "x"}],
                                           **kwargs)
        assert e.value.body["param"] == name


def test_tokenize_and_detokenize_as_vllm_serves_them(stack):
    import requests

    def call(path: str, body: dict) -> requests.Response:
        return requests.post(f"{stack.url}/{path}", json=body, timeout=30,
                             headers={"Authorization": f"Bearer {stack.tokens['alice']}"})

    r = call("tokenize", {"model": "simulated-v1", "prompt": "héllo", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == list("héllo".encode()) and body["count"] == 6
    assert body["max_model_len"] > 6 and len(body["token_strs"]) == 6
    chat = call("tokenize", {"model": "simulated-v1",
                             "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == list("user: hi\nassistant: ".encode())
    back = call("detokenize", {"model": "simulated-v1", "tokens": [1, 2, 3]})
    assert back.status_code == 200 and back.json()["prompt"]
    for path, bad, param in [("tokenize", {"model": "simulated-v1"}, "prompt"),
                             ("tokenize", {"model": "simulated-v1", "prompt": "x", "foo": 1},
                              "foo"),
                             ("detokenize", {"model": "simulated-v1", "tokens": [-1]}, "tokens"),
                             ("detokenize", {"model": "simulated-v1", "tokens": "12"}, "tokens"),
                             ("tokenize", {"model": "simulated-v1", "prompt": "x",
                                           "add_special_tokens": "yes"}, "add_special_tokens")]:
        r = call(path, bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert call("tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    assert requests.post(f"{stack.url}/tokenize", json={"model": "simulated-v1", "prompt": "x"},
                         timeout=30).status_code == 401


def test_logprobs_streamed_and_unstreamed_in_openai_shape(client):
    """The simulated model is deterministic: each token's logprob is 0 and the only
    likely token is itself; the shapes are OpenAI's, one entry per token."""
    r = client.completions.create(model="simulated-v1", prompt="lp", max_tokens=5,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.token_logprobs == [0.0] * 5 and "".join(lp.tokens) == r.choices[0].text
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    chunks = list(client.completions.create(model="simulated-v1", prompt="lp", max_tokens=5,
                                            logprobs=0, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens
    chat = client.chat.completions.create(model="simulated-v1", max_tokens=4, logprobs=True,
                                          top_logprobs=1,
                                          messages=[{"role": "user", "content": "hi"}])
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(c.logprob == 0.0 and c.top_logprobs[0].token == c.token
                                     for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert content[0].bytes == list(content[0].token.encode())
    stream = client.chat.completions.create(model="simulated-v1", max_tokens=4, logprobs=True,
                                            stream=True,
                                            messages=[{"role": "user", "content": "hi"}])
    streamed = [c.token for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for c in chunk.choices[0].logprobs.content]
    assert streamed == [c.token for c in content]
    plain = client.completions.create(model="simulated-v1", prompt="lp", max_tokens=2)
    assert plain.choices[0].logprobs is None
    for kwargs, name in [({"logprobs": 21}, "logprobs"), ({"echo": True, "logprobs": 0}, "echo")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="simulated-v1", prompt="x", max_tokens=2, **kwargs)
        assert e.value.body["param"] == name
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="simulated-v1", max_tokens=2, top_logprobs=2,
                                       messages=[{"role": "user", "content": "x"}])
    assert e.value.body["param"] == "top_logprobs"


def test_structured_output_is_refused_on_a_simulated_engine_and_checked(client, stack):
    """The simulator has no logits to constrain: a 400 naming the field, before any job
    exists; a bad schema is a 400 too (compiled at admission), on both APIs."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="simulated-v1", max_tokens=4,
                                       messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format" and "logits" in e.value.body["message"]
    bad_schema = {"type": "json_schema",
                  "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="simulated-v1", max_tokens=4,
                                       messages=[{"role": "user", "content": "x"}],
                                       response_format=bad_schema)
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="simulated-v1", prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "(unclosed"}})
    assert e.value.body["param"] == "structured_outputs"
    r = stack.api("POST", "/api/jobs/", json={"prompt": "x", "structured_outputs": {"choice": []}})
    assert r.status_code == 400 and "structured_outputs" in r.text


def test_n_samples_through_both_apis(client, stack):
    """n > 1: the engine forks the request; every sample comes back (the simulated model
    is deterministic, so each equals the single answer), as n choices, streamed with
    their index, and as the REST job's `samples`; usage counts every sample's tokens."""
    one = expected_text("fork me", 6)
    r = client.completions.create(model="simulated-v1", prompt="fork me", max_tokens=6, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [one] * 3
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 18
    texts: dict[int, str] = {}
    finishes = {}
    for chunk in client.completions.create(model="simulated-v1", prompt="fork me",
                                           max_tokens=6, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {0: one, 1: one} and finishes == {0: "length", 1: "length"}
    chat = client.chat.completions.create(model="simulated-v1", max_tokens=4, n=2,
                                          messages=[{"role": "user", "content": "hi"}])
    assert len(chat.choices) == 2 and chat.choices[0].message.content \
        == chat.choices[1].message.content
    job = stack.wait_job(stack.api("POST", "/api/jobs/", json={
        "prompt": "fork me", "max_tokens": 6, "n": 2, "temperature": 0}).json()["id"])
    assert job["status"] == "finished" and [s["text"] for s in job["samples"]] == [one] * 2
    assert job["output_text"] == one
    r = client.completions.create(model="simulated-v1", prompt="fork me", max_tokens=6, n=2,
                                  logprobs=1)
    for c in r.choices:  # each sample its own logprobs
        assert "".join(c.logprobs.tokens) == c.text and c.logprobs.token_logprobs == [0.0] * 6
    tokens: dict[int, list] = {}
    for chunk in client.completions.create(model="simulated-v1", prompt="fork me",
                                           max_tokens=6, n=2, logprobs=0, stream=True):
        for c in chunk.choices:
            if c.logprobs:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
    assert tokens == {0: r.choices[0].logprobs.tokens, 1: r.choices[1].logprobs.tokens}
    for kwargs, name in [({"n": 17}, "n"), ({"best_of": 3}, "best_of")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="simulated-v1", prompt="x", max_tokens=2, **kwargs)
        assert e.value.body["param"] == name


def test_echo_puts_the_prompt_before_the_completion(client):
    r = client.completions.create(model="simulated-v1", prompt="echo me", max_tokens=5,
                                  echo=True, n=2)
    assert [c.text for c in r.choices] == ["echo me" + expected_text("echo me", 5)] * 2
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="simulated-v1", prompt="echo me", max_tokens=5, echo=True, stream=True))
    assert streamed == "echo me" + expected_text("echo me", 5)


def test_tools_refusals_name_the_field(client):
    messages = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for kwargs, name in [({"tools": [tool]}, "tool_choice"),  # "auto", the default
                         ({"tools": [tool], "tool_choice": "auto"}, "tool_choice"),
                         ({"tools": [tool], "tool_choice": {"type": "function",
                                                            "function": {"name": "g"}}},
                          "tool_choice"),
                         ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
                         ({"tools": [tool], "tool_choice": "required"}, "tools"),  # simulator
                         ({"tool_choice": "required"}, "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="simulated-v1", max_tokens=2,
                                           messages=messages, **kwargs)
        assert e.value.body["param"] == name, (kwargs, e.value.body)
    r = client.chat.completions.create(model="simulated-v1", max_tokens=2, messages=messages,
                                       tools=[tool], tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_a_retry_with_the_same_idempotency_key_gets_the_first_job(client, stack):
    """A client that retries a call (its connection dropped) with the same
    Idempotency-Key gets the first call's job and answer; nothing runs twice."""
    headers = {"Idempotency-Key": "v1-retry-once"}
    first = client.completions.create(model="simulated-v1", prompt="only once", max_tokens=4,
                                      temperature=0, extra_headers=headers)
    again = client.completions.create(model="simulated-v1", prompt="only once", max_tokens=4,
                                      temperature=0, extra_headers=headers)
    assert again.id == first.id and again.choices[0].text == first.choices[0].text
    jobs = stack.api("GET", "/api/jobs/?mine=1&limit=200", user="alice").json()["results"]
    assert sum(j["prompt"] == "only once" for j in jobs) == 1


def test_batched_and_token_id_prompts_as_lm_eval_sends_them(client, stack):
    """/v1/completions takes OpenAI's batch forms: a list of prompts, a prompt of token
    ids, a list of those; each prompt is a job, its choices numbered after the prompts
    before it (n each), the usage summed; streamed, the chunks of every prompt come in
    one stream."""
    prompts = ["alpha", "beta gamma", "delta"]
    r = client.completions.create(model="simulated-v1", prompt=prompts, max_tokens=5,
                                  temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [expected_text(p, 5) for p in prompts]
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert r.usage.completion_tokens == 15
    ids = [list(p.encode()) for p in prompts]  # the simulator's tokens are UTF-8 bytes
    one = client.completions.create(model="simulated-v1", prompt=ids[0], max_tokens=5,
                                    temperature=0)
    assert one.choices[0].text == expected_text("alpha", 5)
    assert one.usage.prompt_tokens == len(ids[0])
    many = client.completions.create(model="simulated-v1", prompt=ids[1:], max_tokens=4,
                                     temperature=0, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices] == [expected_text(p, 4) for p in prompts[1:]
                                              for _ in range(2)]
    job_ids = many.model_extra["kvops_job_ids"]
    assert len(job_ids) == 2
    assert stack.api("GET", f"/api/jobs/{job_ids[1]}/").json()["prompt_token_ids"] == ids[2]
    texts: dict[int, str] = {}
    chunks = list(client.completions.create(model="simulated-v1", prompt=prompts,
                                            max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i: expected_text(p, 6) for i, p in enumerate(prompts)}
    assert chunks[-1].usage.completion_tokens == 18 and not chunks[-1].choices


@pytest.mark.parametrize("prompt, says", [
    ([1, -2], "non-negative"), (["a", [1]], "only strings"), ([[]], "non-empty"),
    ([True, 3], "only strings"), ([40000, 1], "token id 40000")])
def test_a_bad_batch_is_refused_whole_naming_the_prompt(client, prompt, says):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="simulated-v1", prompt=prompt, max_tokens=2)
    assert e.value.body["param"] == "prompt" and says in e.value.body["message"]
