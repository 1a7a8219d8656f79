"""What a job may ask for: the one set of rules that both the REST API's serializer
(kvops/api/serializers.py) and the OpenAI-compatible API (kvops/openai_api.py) apply,
so a request one refuses the other refuses too, with the same words."""
import os
import re

# Characters, not tokens: the engine checks the token count against its model's limit.
MAX_PROMPT_CHARS = int(os.environ.get("KVOPS_MAX_PROMPT_CHARS", 200_000))
MAX_TOKENS = int(os.environ.get("KVOPS_MAX_TOKENS", 8192))
MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 256
MAX_STOP_TOKEN_IDS = 64
TEMPERATURE = (0.0, 2.0)
TOP_P = (0.0, 1.0)  # 0 excluded
TOP_K_MAX = 1_000_000
SEED_MAX = 2**63 - 1
PRIORITY = (-1000, 1000)  # lower runs first under the priority policy; below 0: staff only
PENALTY = (-2.0, 2.0)  # presence_penalty, frequency_penalty (OpenAI's range)
REPETITION_PENALTY = (0.0, 10.0)  # 0 excluded; 1 is off
MIN_P = (0.0, 1.0)
LOGIT_BIAS = (-100.0, 100.0)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGPROBS = 20  # as engine.sampling_params.MAX_LOGPROBS
MAX_N = 16  # as engine.sampling_params.MAX_N


class InvalidParam(ValueError):
    """A field's value breaks a rule (HTTP 400); param names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class NotAllowed(InvalidParam):
    """The value is valid but this user may not ask for it (HTTP 403)."""


def stop_strings(value) -> list[str]:
    """A string or a list of up to MAX_STOP_STRINGS non-empty strings of at most
    MAX_STOP_CHARS characters each; returns the list."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise InvalidParam("stop", "`stop` must be a string or a list of non-empty strings")
    if len(value) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in value):
        raise InvalidParam("stop", f"`stop`: at most {MAX_STOP_STRINGS} strings of at most "
                                   f"{MAX_STOP_CHARS} characters each")
    return value


def priority(value, is_staff: bool) -> int:
    """An integer in PRIORITY; below 0 (ahead of everyone's default) only for staff."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) \
            or not PRIORITY[0] <= value <= PRIORITY[1]:
        raise InvalidParam("priority", f"`priority` must be an integer in "
                                       f"[{PRIORITY[0]}, {PRIORITY[1]}]")
    if value < 0 and not is_staff:
        raise NotAllowed("priority", "only staff may set a priority below 0 (it runs ahead "
                                     "of everyone's jobs); use 0 or more")
    return value


def sampling_params(params: dict) -> dict:
    """The job's sampling parameters as the engine will take them, or InvalidParam naming
    the field the engine refuses (min_tokens above max_tokens, a bad logit_bias key...):
    both APIs answer 400 before the job exists rather than failing it on the engine."""
    from engine.errors import InvalidRequestError
    from engine.sampling_params import SamplingParams
    try:
        SamplingParams(**params)
    except InvalidRequestError as e:
        message = str(e)
        raise InvalidParam(message.split(" ", 1)[0], message) from None
    return params


_TOKEN_ID_DIGITS = 10  # token ids are below 2**31
_TOKEN_ID = re.compile(rf"[0-9]{{1,{_TOKEN_ID_DIGITS}}}")  # ASCII digits: "²".isdigit() is True


def logit_bias(value) -> dict | None:
    """A map of token id (a string of digits, as JSON has it, or an integer) to a bias in
    LOGIT_BIAS, at most MAX_LOGIT_BIAS_ENTRIES of them; keys come back as strings."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidParam("logit_bias", "`logit_bias` must be an object mapping token ids "
                                         "to biases")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParam("logit_bias", f"`logit_bias`: at most {MAX_LOGIT_BIAS_ENTRIES} "
                                         "entries")
    out = {}
    for key, bias in value.items():
        if not _TOKEN_ID.fullmatch(str(key)):
            shown = repr(key) if len(str(key)) <= 20 else repr(str(key)[:20]) + "…"
            raise InvalidParam("logit_bias", f"`logit_bias` keys must be token ids (at most "
                                             f"{_TOKEN_ID_DIGITS} digits 0-9), not {shown}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not LOGIT_BIAS[0] <= bias <= LOGIT_BIAS[1]:
            raise InvalidParam("logit_bias", f"`logit_bias` values must be numbers in "
                                             f"[{LOGIT_BIAS[0]:g}, {LOGIT_BIAS[1]:g}]")
        out[str(int(key))] = float(bias)
    return out or None


def structured(value, param: str) -> dict | None:
    """A structured-output constraint (engine/structured.py: json, json_object, regex,
    choice or grammar) of the right shape and within the bounds on what one may be.
    Whether it compiles is checked apart (kvops/grammar_check.py: it can take seconds),
    still before the job exists."""
    if value is None:
        return None
    from engine.errors import InvalidRequestError
    from engine.structured import check_spec
    try:
        check_spec(value)
    except InvalidRequestError as e:
        raise InvalidParam(param, f"`{param}`: {e}") from None
    return value
