"""OpenAI's Responses API through the official client, unchanged (the simulated engine:
its text is a function of the prompt's tokens, so what the engine ran is checked by
what it answered)."""
import openai
import pytest

from kvops.intake.prompts import render_chat
from engine.text.detokenizer import SimTokenizer
from tests.service.test_jobs_api import expected_text


@pytest.fixture()
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.tokens["alice"],
                         max_retries=0, timeout=60)


def sim_answer(messages: list[dict], n: int) -> str:
    """The simulator's answer to a chat: its transcript (kvops/prompts.render_chat)."""
    return expected_text(render_chat(SimTokenizer(), messages), n)


def test_a_response_is_a_job_whose_text_is_the_chats(client, stack):
    r = client.responses.create(model="simulated-v1", input="hello responses",
                                instructions="be brief", max_output_tokens=6)
    want = sim_answer([{"role": "system", "content": "be brief"},
                       {"role": "user", "content": "hello responses"}], 6)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == want and r.output[0].type == "message"
    assert r.usage.output_tokens == 6 and r.usage.input_tokens > 0
    job = stack.api("GET", f"/api/jobs/{r.id.removeprefix('resp_')}/", user="alice").json()
    assert job["source"] == "openai" and job["output_text"] == want
    assert client.responses.retrieve(r.id).output_text == want


def test_streamed_as_the_responses_events(client):
    events = list(client.responses.create(model="simulated-v1", input="stream it",
                                          max_output_tokens=20, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == sim_answer([{"role": "user", "content": "stream it"}], 20)
    assert kinds.count("response.output_text.delta") >= 2  # it streamed
    assert events[-1].response.output_text == deltas


def test_previous_response_id_continues_the_conversation(client, stack):
    first = client.responses.create(model="simulated-v1", input="first turn",
                                    instructions="only the first's", max_output_tokens=4)
    second = client.responses.create(model="simulated-v1", input="second turn",
                                     previous_response_id=first.id, max_output_tokens=5)
    # the earlier conversation and answer, without the earlier instructions
    assert second.output_text == sim_answer([
        {"role": "user", "content": "first turn"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "second turn"}], 5)
    assert second.previous_response_id == first.id
    unstored = client.responses.create(model="simulated-v1", input="x", store=False,
                                       max_output_tokens=2)
    for missing in (unstored.id, "resp_999999999"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model="simulated-v1", input="y", max_output_tokens=2,
                                    previous_response_id=missing)
        assert e.value.body["param"] == "previous_response_id"
    bob = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.tokens["admin"],
                        max_retries=0)
    with pytest.raises(openai.NotFoundError):  # another user's response
        bob.responses.create(model="simulated-v1", input="y", previous_response_id=first.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(first.id)


def test_refusals_name_the_responses_fields(client):
    for kwargs, param in [({"max_output_tokens": 0}, "max_output_tokens"),
                          ({"text": {"format": {"type": "json_schema", "name": "x",
                                                "schema": {"type": "object"}}}},
                           "text.format"),  # the simulator has no logits to constrain
                          ({"input": []}, "input"),
                          ({"input": [{"type": "web_search_call"}]}, "input"),
                          ({"tools": [{"type": "web_search"}]}, "tools"),
                          # a tool call and its output must name the call they belong to
                          ({"input": [{"type": "function_call", "name": "f",
                                       "arguments": "{}"}]}, "input"),
                          ({"input": [{"type": "function_call_output", "output": "1"}]},
                           "input"),
                          ({"extra_body": {"frobnicate": 1}}, "frobnicate")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": "simulated-v1", "input": "x", **kwargs})
        assert e.value.body["param"] == param, (kwargs, e.value.body)


def test_what_the_agents_sdk_sends_is_taken_and_repeated(client):
    """The OpenAI Agents SDK sends `tools: []` and `include` for logprobs; a Response
    repeats its request's tool settings and marks a cut-off message incomplete."""
    r = client.responses.create(model="simulated-v1", input="agents", tools=[],
                                tool_choice="auto", max_output_tokens=3,
                                include=["message.output_text.logprobs"], top_logprobs=2,
                                parallel_tool_calls=False)
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is False
    [message] = r.output
    assert message.status == "incomplete" and r.status == "incomplete"
    logprobs = message.content[0].logprobs
    assert len(logprobs) == 3 and all(lp.top_logprobs for lp in logprobs)
    assert "".join(lp.token for lp in logprobs) == r.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="simulated-v1", input="x",
                                include=["reasoning.encrypted_content"])
    assert e.value.body["param"] == "include"
