"""The OpenAI-compatible routes (/v1, /tokenize, /detokenize) in the OpenAPI schema of
/api/schema/: they are plain async Django views, which drf-spectacular does not see, so
their description is kept here by hand and merged into the generated schema by
add_openai_paths (SPECTACULAR_SETTINGS' POSTPROCESSING_HOOKS). A test checks that every
route kvops/urls.py serves under /v1 and at the root is described."""
from __future__ import annotations

TAG = "openai"
ERROR_REF = {"$ref": "#/components/schemas/OpenAIError"}

OPENAI_ERROR = {
    "type": "object",
    "description": "every /v1 answer that is not a success, in OpenAI's shape",
    "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"},
        "type": {"type": "string", "example": "invalid_request_error"},
        "param": {"type": "string", "nullable": True, "description": "the field at fault"},
        "code": {"type": "string", "nullable": True}}}}}

MESSAGES = {"type": "array", "items": {"type": "object", "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
    "content": {"type": "string"}}}}
SAMPLING = {
    "model": {"type": "string", "description": "a served model's name (GET /v1/models)"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number"},
    "n": {"type": "integer", "minimum": 1},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "seed": {"type": "integer"},
    "stream": {"type": "boolean", "description": "answer as server-sent events"},
}
ANY_OBJECT = {"type": "object", "additionalProperties": True}


def _operation(operation_id: str, summary: str, description: str, body: dict | None = None,
               parameters: list | None = None) -> dict:
    operation = {
        "operationId": operation_id, "tags": [TAG], "summary": summary, "description": description,
        "security": [{"tokenAuth": []}],
        "responses": {
            "200": {"description": "OpenAI's answer object (or its event stream)",
                    "content": {"application/json": {"schema": ANY_OBJECT}}},
            **{str(status): {"description": what,
                             "content": {"application/json": {"schema": ERROR_REF}}}
               for status, what in ((400, "a field is wrong (`param` names it)"),
                                    (401, "no key or an unknown one"),
                                    (404, "no such model or object"),
                                    (429, "over a limit"), (503, "no engine serves it"))}}}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"type": "object", "additionalProperties": True, **body}}}}
    if parameters:
        operation["parameters"] = parameters
    return operation


def _path_param(name: str, description: str) -> dict:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"},
            "description": description}


PATHS = {
    "/v1/completions": {"post": _operation(
        "v1_completions",
        "Completions (OpenAI)", "A prompt (or a list of them: a job each) completed by an "
        "engine serving the model.",
        {"required": ["model", "prompt"], "properties": {
            **SAMPLING, "prompt": {"oneOf": [{"type": "string"},
                                             {"type": "array", "items": {"type": "string"}}]},
            "logprobs": {"type": "integer", "nullable": True},
            "echo": {"type": "boolean"}}})},
    "/v1/chat/completions": {"post": _operation(
        "v1_chat_completions",
        "Chat completions (OpenAI)", "The model's next message after `messages`, rendered "
        "with its chat template; tools and structured outputs as OpenAI takes them.",
        {"required": ["model", "messages"], "properties": {
            **SAMPLING, "messages": MESSAGES, "tools": {"type": "array", "items": ANY_OBJECT},
            "tool_choice": {"oneOf": [{"type": "string"}, ANY_OBJECT]},
            "response_format": ANY_OBJECT, "logprobs": {"type": "boolean"},
            "top_logprobs": {"type": "integer"}}})},
    "/v1/models": {"get": _operation(
        "v1_models_list",
        "Models (OpenAI)", "The models the live engines serve.")},
    "/v1/models/{model}": {"get": _operation(
        "v1_models_retrieve",
        "One model (OpenAI)", "One served model; 404 if no live engine serves it.",
        parameters=[_path_param("model", "the model's name")])},
    "/v1/responses": {"post": _operation(
        "v1_responses_create",
        "Responses (OpenAI)", "OpenAI's Responses API: `input` (and `instructions`), "
        "going on from `previous_response_id` if given.",
        {"required": ["model", "input"], "properties": {
            "model": SAMPLING["model"],
            "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": ANY_OBJECT}]},
            "instructions": {"type": "string"},
            "previous_response_id": {"type": "string"},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "temperature": SAMPLING["temperature"], "top_p": SAMPLING["top_p"],
            "stream": SAMPLING["stream"], "tools": {"type": "array", "items": ANY_OBJECT}}})},
    "/v1/responses/{response_id}": {"get": _operation(
        "v1_responses_retrieve",
        "One response (OpenAI)", "A response stored by POST /v1/responses.",
        parameters=[_path_param("response_id", "its `id` (resp_...)")])},
    "/tokenize": {"post": _operation(
        "tokenize",
        "Tokenize (vLLM)", "The token ids the engine will see for `prompt`, or for "
        "`messages` rendered with the chat template: {count, max_model_len, tokens} "
        "(and token_strs with return_token_strs).",
        {"required": ["model"], "properties": {
            "model": SAMPLING["model"], "prompt": {"type": "string"}, "messages": MESSAGES,
            "add_special_tokens": {"type": "boolean", "default": True},
            "add_generation_prompt": {"type": "boolean", "default": True},
            "return_token_strs": {"type": "boolean"}}})},
    "/detokenize": {"post": _operation(
        "detokenize",
        "Detokenize (vLLM)", "The text of `tokens`: {prompt}.",
        {"required": ["model", "tokens"], "properties": {
            "model": SAMPLING["model"],
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}})},
}


def add_openai_paths(result: dict, generator, request, public: bool) -> dict:
    """drf-spectacular's postprocessing hook: the routes above added to the schema."""
    result.setdefault("paths", {}).update(PATHS)
    result.setdefault("components", {}).setdefault("schemas", {})["OpenAIError"] = OPENAI_ERROR
    tags = result.setdefault("tags", [])
    if not any(tag.get("name") == TAG for tag in tags):
        tags.append({"name": TAG, "description": "OpenAI- and vLLM-compatible routes: "
                     "errors in OpenAI's shape, not /api's"})
    return result
