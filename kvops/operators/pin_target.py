"""What a pin or unpin names, made into the engine's `pin`/`unpin` arguments
(engine/serve/commands.py: `prompt` text or `token_ids`, and `cache_salt`). A prefix
lookup (prefix_lookup.py) makes a job or a chat into token ids here too.

An operator names a prefix one of four ways (kvops/api/serializers.py PrefixSerializer):
* `job`: the token ids that job ran, as the worker sends them (intake/prompts.py
  job_prompt_ids: rendered once at intake, or again with the engine's tokenizer), under
  the job's cache salt, so a salted job's blocks are pinned in its own chain;
* `messages`: a chat rendered by intake's path with the engine's chat template, without
  the generation prompt, so the ids are the start of every chat job that goes on from
  these messages;
* `token_ids`, as given;
* `text` (or `prompt`): tokenized raw by the engine, no chat template. A chat job's
  cached blocks are its rendered chat's, so a chat's system prompt pasted as text finds
  none of them.

The arguments keep what the operator named (`job`, `messages`) beside the token ids: the
operator log records them as the action's parameters, and the what-if replay reads the
ids and the salt there (kvops/what_if/what_if_log.py). The engine reads
only `prompt`, `token_ids`, `cache_salt` and the soft-pin fields.
"""
from __future__ import annotations

from kvops import selectors
from kvops.intake.prompts import inspector
from kvops.models import Engine, Job
from kvops.routing.tenancy import cache_salt

SOFT_FIELDS = ("soft", "priority", "ttl_s")


class Refused(ValueError):
    """The prefix cannot be made into token ids here; `field` names the body's field and
    `status` is the HTTP answer (400: a wrong value, 409: not possible from this process)."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.status = status


def engine_arguments(engine: Engine, data: dict) -> dict:
    """The engine's pin/unpin arguments for a validated PrefixSerializer body (exactly one
    of job, messages, token_ids, text or prompt), nulls left out. Raises Refused."""
    soft = {k: data[k] for k in SOFT_FIELDS if data.get(k) is not None}
    if data.get("job"):
        return {**_job_arguments(engine, data["job"]), **soft}
    salt = {"cache_salt": data["cache_salt"]} if data.get("cache_salt") is not None else {}
    if data.get("messages"):
        return {"messages": data["messages"],
                "token_ids": chat_ids(engine, data["messages"]), **salt, **soft}
    if data.get("token_ids"):
        return {"token_ids": data["token_ids"], **salt, **soft}
    return {"prompt": data.get("text") or data["prompt"], **salt, **soft}


def _job_arguments(engine: Engine, job_id: int) -> dict:
    job = Job.objects.filter(pk=job_id).select_related("owner").first()
    if job is None:
        raise Refused("job", f"there is no job {job_id}")
    salt = cache_salt(job.owner)
    return {"job": job_id, "token_ids": job_ids(engine, job),
            **({"cache_salt": salt} if salt else {})}


def job_ids(engine: Engine, job: Job) -> list[int]:
    """The token ids the job ran, as the engine saw them (its chat rendered with the
    engine's template); Refused (409) if they must be rendered with a tokenizer this
    process cannot read. Its blocks are cached under its owner's salt (cache_salt)."""
    try:
        ids = inspector.job_token_ids(engine.config, job)
    except Exception as e:  # noqa: BLE001  (its chat, which this model's template refuses)
        raise Refused("job", f"job {job.pk}'s chat cannot be rendered with "
                             f"{selectors.model_name(engine)!r}'s chat template: {e}") from None
    if not ids:
        raise Refused("job", f"job {job.pk}'s prompt must be rendered with engine "
                             f"{engine.name}'s tokenizer, which this web process cannot "
                             "read; give its `token_ids` instead", 409)
    return ids


def chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    """A chat rendered with the engine's chat template without the generation prompt, as
    token ids: the start of every chat job that goes on from these messages."""
    model = selectors.model_name(engine)
    try:
        ids = inspector.token_ids(engine.config, "", messages, add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001  (the model's template refuses this chat)
        raise Refused("messages", f"the chat cannot be rendered with {model!r}'s chat "
                                  f"template: {e}") from None
    if ids is None:
        raise Refused("messages", f"engine {engine.name}'s tokenizer is not readable from "
                                  "this web process; give a `job` or `token_ids` instead", 409)
    return ids
