"""One intake: a field one API refuses the others refuse too, with the same message
naming the same field (REST's {"error": {"message", "fields"}}, OpenAI's {"error": {"message",
"param"}}); /v1 honours Idempotency-Key as REST does; REST refuses what the engines
that would run it cannot do, as /v1 does. In this process, against the database."""
import pytest
from django.contrib.auth.models import User
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from kvops import selectors
from kvops.models import Engine, Job

pytestmark = pytest.mark.django_db(transaction=True)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture()
def erin():
    user = User.objects.create_user("intake-erin", password="mauve-tractor-41-lake")
    Token.objects.create(user=user)
    return user


@pytest.fixture()
def sim_engine():
    """A live engine row serving `sim-model` with the simulator."""
    engine = Engine.objects.create(
        name="intake-sim", worker="engine-intake-sim@here", status=Engine.Status.READY,
        last_heartbeat=timezone.now(),
        config={"model": "sim-model", "simulate": True, "block_size": 16, "vocab_size": 1000,
                "max_model_len": 4096})
    selectors.forget_recent_engines()
    yield engine
    selectors.forget_recent_engines()


def rest(user, body: dict, headers: dict | None = None):
    client = APIClient()
    client.force_authenticate(user)
    return client.post("/api/jobs/", body, format="json", headers=headers or {})


def v1(client, user, path: str, body: dict, headers: dict | None = None):
    key = Token.objects.get(user=user).key
    return client.post(path, body, content_type="application/json",
                       headers={"Authorization": f"Bearer {key}", **(headers or {})})


def refusals(client, user, fields: dict) -> list[tuple[int, str, str]]:
    """(status, param, message) from REST, /v1/completions and /v1/chat/completions."""
    out = []
    answer = rest(user, {"prompt": "x", **fields})
    body = answer.json()
    [(param, [message])] = body["error"]["fields"].items() if answer.status_code == 400 else [("", [""])]
    out.append((answer.status_code, param, message))
    for path, base in (("/v1/completions", {"model": "sim-model", "prompt": "x"}),
                       ("/v1/chat/completions", {"model": "sim-model", "messages": CHAT})):
        answer = v1(client, user, path, {**base, **fields})
        error = answer.json()["error"]
        out.append((answer.status_code, error["param"], error["message"]))
    return out


@pytest.mark.parametrize("fields, param", [
    ({"temperature": "0.5"}, "temperature"),  # REST took the string once
    ({"top_k": False}, "top_k"),  # /v1 took `false` as "no limit" once
    ({"top_k": -2}, "top_k"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 30}, "n"),
    ({"seed": -1}, "seed"),
    ({"stop": [1]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"priority": "1"}, "priority"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),  # the engine's own rule
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"bogus": 1}, "bogus"),
])
def test_a_field_refused_on_one_api_is_refused_alike_on_the_others(erin, sim_engine, client,
                                                                 fields, param):
    answers = refusals(client, erin, fields)
    assert [status for status, _, _ in answers] == [400, 400, 400], answers
    assert {p for _, p, _ in answers} == {param}, answers
    assert len({message for _, _, message in answers}) == 1, answers
    assert Job.objects.count() == 0


def test_chat_fields_are_refused_alike_on_rest_and_chat(erin, sim_engine, client):
    for messages in ("hi", [{"role": "wizard", "content": "y"}],
                     [{"role": "user", "content": 5}]):
        answer = rest(erin, {"messages": messages})
        chat = v1(client, erin, "/v1/chat/completions", {"model": "sim-model",
                                                         "messages": messages})
        assert answer.status_code == chat.status_code == 400
        assert answer.json()["error"]["fields"]["messages"] == [chat.json()["error"]["message"]]
    tools = [{"type": "x"}]
    answer = rest(erin, {"messages": CHAT, "tools": tools})
    chat = v1(client, erin, "/v1/chat/completions", {"model": "sim-model", "messages": CHAT,
                                                     "tools": tools})
    assert answer.json()["error"]["fields"]["tools"] == [chat.json()["error"]["message"]]


def test_what_the_engines_cannot_do_is_refused_on_rest_as_on_v1(erin, sim_engine, client):
    """A simulator has no logits: structured output and the prompt's logprobs are refused
    before the job exists on both APIs (REST stored the job and failed it once)."""
    spec = {"structured_outputs": {"regex": "a+"}}
    answer = rest(erin, {"prompt": "x", "model": "sim-model", **spec})
    completion = v1(client, erin, "/v1/completions", {"model": "sim-model", "prompt": "x",
                                                      **spec})
    assert answer.status_code == completion.status_code == 400
    assert answer.json()["error"]["fields"]["structured_outputs"] == \
        [completion.json()["error"]["message"]]
    assert "simulate" in completion.json()["error"]["message"]
    answer = rest(erin, {"prompt": "x", "model": "sim-model", "prompt_logprobs": 1})
    assert answer.status_code == 400 and "simulate" in answer.json()["error"]["fields"]["prompt_logprobs"][0]
    echo = v1(client, erin, "/v1/completions", {"model": "sim-model", "prompt": "x",
                                                "echo": True, "logprobs": 1})
    assert echo.status_code == 400 and echo.json()["error"]["param"] == "echo"
    missing = rest(erin, {"prompt": "x", "model": "no-such-model"})
    assert missing.status_code == 404 and "no-such-model" in missing.json()["error"]["message"]
    assert Job.objects.count() == 0


def test_v1_honours_the_idempotency_key(erin, sim_engine, client):
    long_key = {"Idempotency-Key": "k" * 1000}
    answer = v1(client, erin, "/v1/completions", {"model": "sim-model", "prompt": "x"},
                long_key)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "Idempotency-Key"
    assert rest(erin, {"prompt": "x"}, long_key).status_code == 400
    assert Job.objects.count() == 0
    # a key a REST job was stored under: the same request on /v1 is another request
    first = rest(erin, {"prompt": "x", "model": "sim-model"}, {"Idempotency-Key": "once"})
    assert first.status_code == 201
    reused = v1(client, erin, "/v1/completions", {"model": "sim-model", "prompt": "y"},
                {"Idempotency-Key": "once"})
    assert reused.status_code == 409 and reused.json()["error"]["param"] == "Idempotency-Key"
    assert Job.objects.count() == 1


def test_an_agent_loops_messages_are_kept_as_chat_templates_expect_them():
    """An agent's second turn: its call (content null, arguments as JSON text), the tool's
    result, a developer message (a system one); kept as transformers passes them."""
    from kvops.intake import limits
    kept = limits.messages([
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert kept == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.mark.parametrize("message, says", [
    ({"role": "tool", "content": "sunny"}, "tool_call_id"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
     "not JSON"),
    ({"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}, "JSON object"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}, "`name`"),
    ({"role": "assistant", "content": None}, "must be a string"),
    ({"role": "critic", "content": "x"}, "developer"),
])
def test_a_malformed_tool_turn_is_refused_alike_on_rest_and_chat(erin, sim_engine, client,
                                                                  message, says):
    messages = [{"role": "user", "content": "hi"}, message]
    answer = rest(erin, {"messages": messages})
    assert answer.status_code == 400 and says in answer.json()["error"]["fields"]["messages"][0]
    chat = v1(client, erin, "/v1/chat/completions", {"model": "sim-model",
                                                     "messages": messages})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    assert answer.json()["error"]["fields"]["messages"][0] == chat.json()["error"]["message"]


@pytest.fixture()
def smol_engine():
    """A live engine row serving the default model, whose chat template (SmolLM2's)
    writes no tool calls."""
    from engine.model.model_runner import resolve_model_path
    path = resolve_model_path(None)
    engine = Engine.objects.create(
        name="intake-smol", worker="engine-intake-smol@here", status=Engine.Status.READY,
        last_heartbeat=timezone.now(),
        config={"model": "SmolLM2-135M-Instruct", "model_path": str(path), "block_size": 16,
                "vocab_size": 49152, "max_model_len": 8192})
    selectors.forget_recent_engines()
    yield engine
    selectors.forget_recent_engines()


def test_a_tool_turn_a_template_cannot_render_is_a_400_that_says_so(erin, smol_engine,
                                                                       client):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    answer = v1(client, erin, "/v1/chat/completions", {"model": "SmolLM2-135M-Instruct",
                                                       "messages": messages})
    assert answer.status_code == 400, answer.content
    assert "does not render tool calls" in answer.json()["error"]["message"]
    # the same chat without the tool turns is taken (the template is otherwise fine)
    plain = v1(client, erin, "/v1/chat/completions", {
        "model": "SmolLM2-135M-Instruct", "messages": messages[:1], "max_tokens": 1,
        "stream": True})
    assert plain.status_code == 200


@pytest.mark.parametrize("path, base", [
    ("/v1/completions", {"model": "sim-model", "prompt": "x"}),
    ("/v1/chat/completions", {"model": "sim-model", "messages": CHAT})])
def test_openais_bookkeeping_fields_are_checked_then_ignored_on_both_apis(erin, sim_engine,
                                                                            client, path,
                                                                            base):
    fine = {"store": True, "metadata": {"run": "nightly"}, "reasoning_effort": "low",
            "service_tier": "auto", "user": "end-user-7", "max_tokens": 2, "stream": True}
    assert v1(client, erin, path, {**base, **fine}).status_code == 200
    for field, bad in [("store", "yes"), ("metadata", {"run": 1}), ("reasoning_effort", "max"),
                       ("service_tier", "fastest"), ("user", 7)]:
        answer = v1(client, erin, path, {**base, field: bad})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == field, field


def test_a_simulated_engine_with_the_default_tokenizer_counts_as_the_default_model():
    """The web side reads a simulated engine's tokenizer from its registered config:
    the default model's folder (tokenizer_path), or bytes for one registered without it."""
    from engine.model.default_model import default_model_dir
    from engine.text.detokenizer import SimTokenizer
    from engine.text.tokenizer import HFTokenizer
    from kvops.intake.prompts import PromptInspector, tokenizer_id

    folder = str(default_model_dir())
    sim = {"simulate": True, "tokenizer_path": folder, "model_path": None}
    real = {"simulate": False, "model_path": folder, "tokenizer_path": folder}
    old_sim = {"simulate": True, "model_path": None}  # registered before tokenizer_path
    inspector = PromptInspector()
    text = "Count me as SmolLM2 would, please."
    assert inspector.token_ids(sim, text, None) == HFTokenizer.from_folder(folder).encode(text)
    assert tokenizer_id(sim) == tokenizer_id(real) != tokenizer_id(old_sim) == "sim"
    assert isinstance(inspector.tokenizer(old_sim), SimTokenizer)
