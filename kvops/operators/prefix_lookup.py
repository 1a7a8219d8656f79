"""Which engine holds this prefix: POST /api/prefix-lookup/ (docs/api.md, "Looking up a
prefix"), LMCache's lookup and Dynamo's /query for this service.

The prefix is named as a pin names it and made into token ids per engine the same way
(pin_target.py): a job's prompt as the engine saw it, a chat rendered with the engine's
template without the generation prompt, token ids as given, or text tokenized as a
completion's prompt is. It is looked up under one cache salt (kvops/routing/tenancy.py):
the caller's own (what their jobs cached), a job's owner's, or, for staff, a user's they
name. Two views per live engine serving the model, each in leading tokens per level:
* `router`: the routing index in Redis (prefix_index.leading_blocks, the figures routing
  weighs): `gpu` its leading run on the GPU, `cpu` the rest of the run (on the CPU
  tier), `disk` null (the index has none);
* `engine_cache`: the engine's own answer to the read-only `prefix-lookup` command
  (LLMEngine.lookup_prefix), sent as operator actions are (control.send_engine_command)
  but not logged: it changes nothing.
They differ while the index lags its engine (it follows the KV feed, and is rewritten
every 30 s), and where the engine finds what routing does not index (the disk tier, a
pinned prefix a salted prompt shares).
"""
from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model

from kvops import live, selectors
from kvops.engines import control
from kvops.intake.prompts import inspector
from kvops.models import Engine, Job
from kvops.operators import pin_target
from kvops.operators.pin_target import Refused
from kvops.routing import prefix_index
from kvops.routing.tenancy import cache_salt


def look_up(user, data: dict) -> dict:
    """The answer to a validated PrefixLookupSerializer body asked by `user`. Raises
    Refused (its field, and 400 or 403)."""
    engines = _engines(data.get("model"))
    job = _job(user, data["job"]) if data.get("job") else None
    under = job.owner if job is not None else _salt_owner(user, data.get("user"))
    salt = cache_salt(under)
    ids = {e.name: _token_ids(e, data, job) for e in engines}
    router, router_error = _router_views(engines, ids, salt)
    rows = []
    for engine in engines:
        token_ids = ids[engine.name]
        row = {"engine": engine.name, "model": selectors.model_name(engine),
               "block_size": engine.config.get("block_size"),
               "num_prompt_tokens": None, "router": None, "engine_cache": None, "errors": []}
        if isinstance(token_ids, Refused):  # (not renderable in this process)
            row["errors"].append(str(token_ids))
        else:
            row["num_prompt_tokens"] = len(token_ids)
            row["router"] = router.get(engine.name)
            if row["router"] is None:
                row["errors"].append(f"router: {router_error}")
            row["engine_cache"] = _ask(engine, token_ids, salt, row["errors"])
        rows.append(row)
    return {"model": data.get("model") or None, "user": under.username,
            "salted": salt is not None, "engines": rows}


def _engines(model: str | None) -> list[Engine]:
    if not model:
        return selectors.candidate_engines()
    engines = selectors.engines_serving(model)
    if not engines:
        served = ", ".join(sorted(selectors.served_models())) or "none"
        raise Refused("model", f"no live engine serves {model!r} (served now: {served}; "
                               "GET /v1/models lists them)")
    return engines


def _job(user, job_id: int) -> Job:
    job = selectors.jobs_visible_to(user).filter(pk=job_id).first()
    if job is None:
        raise Refused("job", f"no job {job_id} among the jobs you may see (GET /api/jobs/ "
                             "lists them)")
    return job


def _salt_owner(user, username: str | None):
    """Whose cache salt the lookup is under: the caller's, or (staff) the named user's."""
    if not username or username == user.username:
        return user
    if not user.is_staff:
        raise Refused("user", "only staff may look up under another user's cache salt; "
                              "leave out `user` to look up under yours", 403)
    other = get_user_model().objects.filter(username=username).first()
    if other is None:
        raise Refused("user", f"there is no user {username!r}")
    return other


def _token_ids(engine: Engine, data: dict, job: Job | None) -> list[int] | Refused:
    """The prefix as this engine's token ids, or the 409 Refused saying why they cannot be
    made here (its tokenizer is not readable from this process); raises a 400 Refused
    for a prefix the engine cannot take."""
    try:
        if job is not None:
            ids, field = pin_target.job_ids(engine, job), "job"
        elif data.get("messages"):
            ids, field = pin_target.chat_ids(engine, data["messages"]), "messages"
        elif data.get("token_ids"):
            ids, field = data["token_ids"], "token_ids"
        else:
            ids, field = inspector.token_ids(engine.config, data["text"], None), "text"
            if ids is None:
                raise Refused("text", f"engine {engine.name}'s tokenizer is not readable "
                                      "from this web process; give `token_ids` instead", 409)
    except Refused as e:
        if e.status == 409:
            return e
        raise
    _check_fits(engine, field, ids)
    return ids


def _check_fits(engine: Engine, field: str, ids: list[int]) -> None:
    if not ids:
        raise Refused(field, f"the prefix has no tokens on engine {engine.name}")
    vocab = engine.config.get("vocab_size")
    if vocab and max(ids) >= vocab:
        raise Refused(field, f"token id {max(ids)} is beyond engine {engine.name}'s "
                             f"vocabulary (ids below {vocab})")
    limit = engine.config.get("max_model_len")
    if limit and len(ids) >= limit:
        raise Refused(field, f"the prefix is too long: {len(ids)} tokens on engine "
                             f"{engine.name}, whose model takes at most {limit - 1}")


def _router_views(engines: list[Engine], ids: dict,
                  salt: str | None) -> tuple[dict[str, dict], str | None]:
    """Per engine, the routing index's view of its prefix (leading tokens per level);
    none, and why, if Redis did not answer."""
    chains = {e.name: inspector.short_hashes(e.config, ids[e.name], salt)
              for e in engines if not isinstance(ids[e.name], Refused)}
    try:
        pipe = live.redis_client().pipeline(transaction=False)
        for name, chain in chains.items():
            prefix_index.look_up(pipe, name, chain)
        replies = iter(pipe.execute())
    except Exception as e:  # noqa: BLE001  (Redis away: the engines still answer)
        return {}, f"the routing index is unreachable ({type(e).__name__}: {e})"
    views = {}
    for engine in engines:
        chain = chains.get(engine.name)
        if chain is None:
            continue
        on_gpu, on_cpu = (next(replies), next(replies)) if chain else ([], [])
        held, gpu = prefix_index.leading_blocks(chain, on_gpu, on_cpu)
        bs = int(engine.config.get("block_size") or 1)
        views[engine.name] = {"gpu": gpu * bs, "cpu": (held - gpu) * bs, "disk": None,
                              "total": held * bs}
    return views, None


def _ask(engine: Engine, token_ids: list[int], salt: str | None, errors: list[str]) -> dict | None:
    """The engine's own answer (leading tokens per level), or None with the reason added
    to errors."""
    reply = control.send_engine_command(engine.worker, "prefix-lookup",
                                        {"token_ids": token_ids, "cache_salt": salt})
    if reply is None:
        errors.append(f"engine: {engine.name} did not answer within "
                      f"{settings.KVOPS_CONTROL_TIMEOUT_S:g} s")
        return None
    if not reply.get("ok"):
        errors.append(f"engine: {reply.get('error')}: {reply.get('message')}")
        return None
    result = reply["result"]
    return {**result["tiers"], "total": result["cached_tokens"]}
