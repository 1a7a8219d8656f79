"""What a job may ask for: the one set of rules that both the REST API's serializer
(kvops/api/serializers.py) and the OpenAI-compatible API (kvops/openai_api.py) apply,
so a request one refuses the other refuses too, with the same words."""
import os

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
