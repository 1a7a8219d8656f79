"""Validation of what operators send, and the shape of what clients get back. (A job's
fields are parsed by kvops/intake/intake.py, the one parser per job schema.)"""
from __future__ import annotations

import json
import math

from django.conf import settings
from django.contrib.auth import get_user_model
from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from engine.observe.step_cost import DEFAULT_COST, StepCost
from engine.config import (EVICTION_POLICIES, FAIRNESS_POLICIES, KV_CACHE_DTYPES,
                           PREEMPTION_MODES)
from kvops.intake import limits
from kvops.jobs import job_store
from kvops.models import Engine, Job, OperatorAction, WhatIfRun
from kvops.what_if.what_if import MAX_POOL_TOKENS, MAX_SWEEP_VALUES, SETTINGS
from kvops.what_if.what_if_trace import MAX_JOBS, MAX_MINUTES

QUEUED_HINT_S = 30  # a what-if run queued this long gets a note: is an ops worker up?


class StrictMixin:
    """Unknown fields are an error, not silently ignored (a typo must not pass)."""

    def to_internal_value(self, data):
        if not isinstance(data, dict):
            raise serializers.ValidationError({"non_field_errors": ["expected a JSON object"]})
        unknown = sorted(set(data) - set(self.fields))
        if unknown:
            raise serializers.ValidationError(
                {name: ["unknown field"] for name in unknown})
        return super().to_internal_value(data)


class TextField(serializers.CharField):
    """A CharField that refuses numbers and booleans instead of turning them into text."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            raise serializers.ValidationError("must be a string")
        return super().to_internal_value(data)


class FiniteFloatField(serializers.FloatField):
    """A FloatField that takes JSON numbers only (DRF's takes `true` as 1 and "0.5" as
    0.5) and refuses NaN and infinities (JSON parsers let them through): the operator
    API's one reader of numbers that may have a fraction."""

    def to_internal_value(self, data):
        if not limits.is_number(data):
            raise serializers.ValidationError("must be a number")
        value = super().to_internal_value(data)
        if not math.isfinite(value):
            raise serializers.ValidationError("must be a finite number")
        return value


def more_than_zero(value) -> None:
    """A share that must leave something: (0, 1] (a quota of 1: none)."""
    if value is not None and value <= 0:
        raise serializers.ValidationError("must be more than 0 (1: no quota)")


class JobSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    # each engine it ran on, with when and why (it moved while it ran: "migration")
    engines = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = ["id", "status", "owner", "source", "model", "engine", "requested_engine",
                  "routing", "request_id", "prompt", "messages", "prompt_token_ids", "params",
                  "priority", "output_text", "output_token_ids", "output_logprobs",
                  "prompt_logprobs", "samples", "finish_reason", "num_prompt_tokens",
                  "num_cached_tokens", "num_output_tokens", "num_preemptions", "attempts",
                  "error", "queued_at", "started_at", "first_token_at", "finished_at",
                  "engines"]
        read_only_fields = fields

    @extend_schema_field(serializers.ListField(child=serializers.DictField()))
    def get_engines(self, job: Job) -> list[dict]:
        return job_store.engines_of(job)


class EngineSerializer(serializers.ModelSerializer):
    alive = serializers.SerializerMethodField()
    heartbeat_age_s = serializers.SerializerMethodField()
    state = serializers.SerializerMethodField()

    class Meta:
        model = Engine
        fields = ["name", "worker", "host", "status", "state", "alive", "heartbeat_age_s",
                  "config", "metrics", "started_at", "last_heartbeat"]
        read_only_fields = fields

    def to_representation(self, instance):
        from kvops.dashboard.visibility import config_for, metrics_for
        data = super().to_representation(instance)
        request = self.context.get("request")
        data["config"] = config_for(instance.config, getattr(request, "user", None))
        data["metrics"] = metrics_for(instance.metrics, getattr(request, "user", None))
        return data

    def get_state(self, engine: Engine) -> str:
        """The status, or `paused` while an operator holds a ready engine's steps."""
        from kvops.selectors import engine_state
        return engine_state(engine)

    def get_alive(self, engine: Engine) -> bool:
        from kvops.selectors import engine_alive
        return engine_alive(engine)

    def get_heartbeat_age_s(self, engine: Engine) -> float | None:
        from kvops.selectors import heartbeat_age_s
        return heartbeat_age_s(engine)


class OperatorActionSerializer(serializers.ModelSerializer):
    user = serializers.CharField(source="user.username", read_only=True, default=None)

    class Meta:
        model = OperatorAction
        fields = ["id", "created_at", "user", "engine", "action", "target", "params", "ok",
                  "status_code", "result"]
        read_only_fields = fields

    def to_representation(self, instance):
        from kvops.selectors import action_params_for
        data = super().to_representation(instance)
        request = self.context.get("request")
        data["params"] = action_params_for(instance, getattr(request, "user", None))
        return data


class EvictSerializer(StrictMixin, serializers.Serializer):
    num_blocks = serializers.IntegerField(required=False, allow_null=True, default=None,
                                          min_value=0, max_value=1 << 31)


class EmptySerializer(StrictMixin, serializers.Serializer):
    pass


class MigrateSerializer(StrictMixin, serializers.Serializer):
    to = TextField(max_length=64, help_text="the engine to move the request to")
    staged = serializers.BooleanField(
        required=False, default=True,
        help_text="copy its full blocks while it keeps running, then stop it for the last "
                  "few (false: stop it and copy everything at once)")


class DrainSerializer(StrictMixin, serializers.Serializer):
    mode = serializers.ChoiceField(
        ["wait", "migrate", "abort"], required=False, default="wait",
        help_text="wait: its requests finish here; migrate: they move to the other engines "
                  "of its model; abort: they end now")
    to = TextField(max_length=64, required=False, allow_null=True, default=None,
                   help_text="migrate: the one engine to move them to")

    def validate(self, data):
        if data.get("to") and data.get("mode") != "migrate":
            raise serializers.ValidationError({"to": "only with mode migrate"})
        return data


class RetentionSerializer(StrictMixin, serializers.Serializer):
    pin_budget = FiniteFloatField(
        min_value=0.0, max_value=1.0, required=False,
        help_text="the most of the GPU pool pinned prefixes may hold (a share, 0-1); pins "
                  "above a lowered budget stay, new ones are refused")
    eviction_policy = serializers.ChoiceField(
        choices=list(EVICTION_POLICIES), required=False,
        help_text="what the GPU pool's prefix cache evicts first: lru, slru (blocks never "
                  "hit before those hit), lfu (the least hit), priority (the prefixes of "
                  "the least important requests)")
    tenant_cache_quota = FiniteFloatField(
        min_value=0.0, max_value=1.0, required=False, validators=[more_than_zero],
        help_text="each tenant's share of the GPU pool's cached blocks (0-1, 1: no quota): "
                  "a tenant over it has its cached blocks evicted first")

    def validate(self, data):
        if not data:
            raise serializers.ValidationError(
                "give pin_budget, eviction_policy or tenant_cache_quota")
        return data


class TenantLimitsSerializer(StrictMixin, serializers.Serializer):
    """One tenant's limits on one engine: the user is named; the engine knows the user's
    tenant label only (kvops/routing/tenancy.py)."""
    LIMITS = ("cache_quota", "weight")
    user = serializers.CharField(max_length=150, help_text="the tenant's user (username)")
    cache_quota = FiniteFloatField(
        min_value=0.0, max_value=1.0, required=False, allow_null=True, default=None,
        validators=[more_than_zero],
        help_text="this tenant's own share of the GPU pool's cached blocks (0-1]")
    weight = FiniteFloatField(
        min_value=0.0, max_value=1000.0, required=False, allow_null=True, default=None,
        help_text="this tenant's weight under fairness vtc (its served tokens count "
                  "1/weight)")
    clear = serializers.ListField(
        child=serializers.ChoiceField(choices=list(LIMITS)), required=False, default=list,
        max_length=len(LIMITS), help_text="limits going back to everyone's")

    def validate_weight(self, value):
        if value is not None and value <= 0:
            raise serializers.ValidationError("must be more than 0")
        return value

    def validate_user(self, value):
        user = get_user_model().objects.filter(username=value).first()
        if user is None:
            raise serializers.ValidationError(f"no user named {value!r}")
        if user.is_staff:
            raise serializers.ValidationError(
                f"{value!r} is staff: staff have no tenant (no quota, no weight)")
        return user

    def validate(self, data):
        if data.get("cache_quota") is None and data.get("weight") is None \
                and not data.get("clear"):
            raise serializers.ValidationError("give cache_quota, weight or clear")
        both = [k for k in self.LIMITS if data.get(k) is not None and k in data.get("clear")]
        if both:
            raise serializers.ValidationError(f"{both[0]} is both set and cleared")
        return data


class LimitsSerializer(StrictMixin, serializers.Serializer):
    """The engine checks each against its value at start."""
    max_num_seqs = serializers.IntegerField(required=False, allow_null=True, default=None,
                                            min_value=1, max_value=1 << 20)
    max_num_batched_tokens = serializers.IntegerField(required=False, allow_null=True,
                                                      default=None, min_value=16,
                                                      max_value=1 << 24)

    def validate(self, data):
        if data.get("max_num_seqs") is None and data.get("max_num_batched_tokens") is None:
            raise serializers.ValidationError("give max_num_seqs or max_num_batched_tokens")
        return data


class PrefixNameSerializer(StrictMixin, serializers.Serializer):
    """A prefix named one way of several (MODES, exactly one of them): `job` (what that
    job ran), `messages` (a chat rendered as a chat job's, without the generation
    prompt), `token_ids`, or `text` (tokenized raw, no chat template)."""
    job = serializers.IntegerField(required=False, min_value=1, max_value=2**63 - 1)
    messages = serializers.JSONField(required=False)
    token_ids = serializers.ListField(child=serializers.IntegerField(min_value=0,
                                                                     max_value=2**31 - 1),
                                      required=False, max_length=1_000_000)
    text = TextField(required=False, max_length=settings.KVOPS_MAX_PROMPT_CHARS,
                     trim_whitespace=False)

    MODES = ("job", "messages", "token_ids", "text")
    HINT = ""  # what to say after "give exactly one of ..."

    def validate_messages(self, value):
        try:
            return limits.messages(value)
        except limits.InvalidParam as e:
            raise serializers.ValidationError(str(e)) from None

    def validate(self, attrs):
        given = [mode for mode in self.MODES if attrs.get(mode)]
        if len(given) != 1:
            said = f"got {', '.join(f'`{m}`' for m in given)}" if given else "got none"
            raise serializers.ValidationError({
                (given[1] if given else "non_field_errors"): [
                    "give exactly one of `job` (what a job ran), `messages` (a chat, "
                    "rendered as a chat job's), `token_ids` or `text` (raw, no chat "
                    f"template; non-empty); {said}{self.HINT}"]})
        return attrs

    def mode(self, attrs: dict) -> str:
        """Which way a validated body names its prefix."""
        return next(mode for mode in self.MODES if attrs.get(mode))


class PrefixSerializer(PrefixNameSerializer):
    """A pin's or unpin's prefix, named one way of four (kvops/operators/pin_target.py
    makes it the engine's arguments): `job` (what that job ran, under its cache salt),
    `messages` (a chat rendered as a chat job's, without the generation prompt),
    `token_ids`, or `text` (tokenized raw, no chat template; `prompt` is its older name)."""
    prompt = TextField(required=False, max_length=settings.KVOPS_MAX_PROMPT_CHARS,
                       trim_whitespace=False)
    cache_salt = TextField(required=False, allow_null=True, default=None,
                                       max_length=256)
    # a soft pin: kept over the other cached blocks for ttl_s (renewed by each hit), by
    # priority among soft pins, still evicted when nothing else is left
    soft = serializers.BooleanField(required=False, default=None, allow_null=True)
    priority = serializers.IntegerField(required=False, allow_null=True, default=None,
                                        min_value=-1000, max_value=1000)
    ttl_s = FiniteFloatField(required=False, allow_null=True, default=None, min_value=1.0,
                             max_value=30 * 86400.0)

    MODES = ("job", "messages", "token_ids", "text", "prompt")
    HINT = ". To pin what chat jobs cached, pin by job or by messages"

    def validate(self, attrs):
        if not attrs.get("soft") and (attrs.get("priority") is not None
                                      or attrs.get("ttl_s") is not None):
            raise serializers.ValidationError(
                {"soft": ["priority and ttl_s are a soft pin's: give soft: true"]})
        attrs = super().validate(attrs)
        if self.mode(attrs) == "job" and attrs.get("cache_salt") is not None:
            raise serializers.ValidationError({"cache_salt": [
                "a job's prefix is pinned under the job's own cache salt: leave out "
                "`cache_salt`"]})
        return attrs


class PrefixLookupSerializer(PrefixNameSerializer):
    """A prefix lookup (POST /api/prefix-lookup/, kvops/operators/prefix_lookup.py): the
    prefix, named one way of four, on the engines serving `model` (all live ones without
    it), under the caller's cache salt, or (staff) under `user`'s."""
    model = TextField(required=False, max_length=256)
    user = TextField(required=False, max_length=150,
                     help_text="staff: look up under this user's cache salt (their jobs' "
                               "cached blocks); a job's lookup is under its owner's")

    HINT = ". Chat jobs cached their rendered chat: look those up by job or by messages"

    def validate(self, attrs):
        attrs = super().validate(attrs)
        if self.mode(attrs) == "job" and attrs.get("user"):
            raise serializers.ValidationError({"user": [
                "a job is looked up under its owner's cache salt: leave out `user`"]})
        return attrs


def _shown(value) -> str:
    """A JSON value as an error message quotes it, cut short."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


class SweepSerializer(StrictMixin, serializers.Serializer):
    """One setting over several values, each replayed beside the engine's configuration
    (with the alternative's other settings); each value is read as the setting's own
    field of WhatIfSerializer reads it."""
    lever = serializers.ChoiceField(choices=list(SETTINGS),
                                    help_text="the setting swept, one of the alternative's")
    values = serializers.ListField(child=serializers.JSONField(), min_length=2,
                                   max_length=MAX_SWEEP_VALUES,
                                   help_text="its values, in the order to show them")


class WhatIfSerializer(StrictMixin, serializers.Serializer):
    """A what-if replay of the engine's recent jobs: which jobs, the simulated step
    cost (the same for both replays), and the settings that differ from the engine's
    (each left out or null: the engine's own; a pool size left out keeps the pool's
    memory, in blocks of the new size)."""
    minutes = serializers.IntegerField(required=False, default=30, min_value=1,
                                       max_value=MAX_MINUTES)
    max_jobs = serializers.IntegerField(required=False, default=2000, min_value=1,
                                        max_value=MAX_JOBS)
    # The simulated step cost: left out (or null), the engine's own, fitted to its steps
    # (its metrics' step_cost); given, a step of this many ms plus this many per token
    step_base_ms = FiniteFloatField(required=False, allow_null=True, default=None,
                                    min_value=0.1, max_value=10_000)
    step_token_ms = FiniteFloatField(required=False, allow_null=True, default=None,
                                     min_value=0.0, max_value=1_000)
    num_gpu_blocks = serializers.IntegerField(required=False, allow_null=True, default=None,
                                              min_value=1, max_value=MAX_POOL_TOKENS)
    block_size = serializers.ChoiceField(choices=[2 ** i for i in range(8)], required=False,
                                         allow_null=True, default=None)
    num_cpu_blocks = serializers.IntegerField(required=False, allow_null=True, default=None,
                                              min_value=0, max_value=MAX_POOL_TOKENS)
    preemption_mode = serializers.ChoiceField(choices=list(PREEMPTION_MODES), required=False,
                                              allow_null=True, default=None)
    max_num_seqs = serializers.IntegerField(required=False, allow_null=True, default=None,
                                            min_value=1, max_value=4096)
    max_num_batched_tokens = serializers.IntegerField(required=False, allow_null=True,
                                                      default=None, min_value=1,
                                                      max_value=1 << 20)
    enable_prefix_caching = serializers.BooleanField(required=False, allow_null=True,
                                                     default=None)
    cpu_prefix_cache = serializers.BooleanField(
        required=False, allow_null=True, default=None,
        help_text="the CPU pool (num_cpu_blocks) as a second prefix-cache tier")
    disk_cache_bytes = serializers.IntegerField(
        required=False, allow_null=True, default=None, min_value=0, max_value=1 << 50,
        help_text="a disk tier of this many bytes below the CPU tier, or the GPU pool "
                  "without one (0: none)")
    eviction_policy = serializers.ChoiceField(
        choices=list(EVICTION_POLICIES), required=False, allow_null=True, default=None,
        help_text="what the prefix cache evicts first")
    pin_budget = FiniteFloatField(
        required=False, allow_null=True, default=None, min_value=0.0, max_value=1.0,
        help_text="the most of the GPU pool the engine's pinned prefixes may hold (0-1); "
                  "they are pinned before the replay, those past it refused")
    kv_cache_dtype = serializers.ChoiceField(
        choices=list(KV_CACHE_DTYPES), required=False, allow_null=True, default=None,
        help_text="how K/V would be stored (a real model's engine): fp8 holds twice "
                  "bf16's blocks in the same memory")
    tenant_cache_quota = FiniteFloatField(
        required=False, allow_null=True, default=None, min_value=0.0, max_value=1.0,
        validators=[more_than_zero],
        help_text="each tenant's share of the GPU pool's cached blocks (0-1, 1: no quota); "
                  "the replayed jobs' owners are the tenants")
    fairness = serializers.ChoiceField(
        choices=list(FAIRNESS_POLICIES), required=False, allow_null=True, default=None,
        help_text="who of the waiting goes first: share (arrival order) or vtc (the tenant "
                  "served the fewest weighted tokens)")
    sweep = SweepSerializer(required=False, allow_null=True, default=None,
                            help_text="instead of one alternative, one setting over several "
                                      "values (the other settings given apply to each)")

    def validate(self, attrs):
        sweep = attrs.get("sweep")
        if not sweep:
            return attrs
        lever = sweep["lever"]
        if attrs.get(lever) is not None:
            raise serializers.ValidationError({"sweep": {"lever": [
                f"{lever} is swept: leave it out of the alternative's settings"]}})
        values = []
        for value in sweep["values"]:
            try:
                if value is None:
                    raise serializers.ValidationError("a value, not null")
                values.append(self.fields[lever].run_validation(value))
            except serializers.ValidationError as e:
                raise serializers.ValidationError({"sweep": {"values": [
                    f"{_shown(value)}: {'; '.join(map(str, e.detail))}"]}}) from None
        repeated = sorted({_shown(v) for v in values if values.count(v) > 1})
        if repeated:
            raise serializers.ValidationError({"sweep": {"values": [
                f"{', '.join(repeated)} given more than once"]}})
        attrs["sweep"] = {"lever": lever, "values": values}
        return attrs

    def changes(self) -> dict:
        """The settings the operator changed."""
        return {k: v for k, v in self.validated_data.items() if k in SETTINGS and v is not None}

    def step_cost(self) -> StepCost | None:
        """The operator's step cost, or None for the engine's (either number left out
        keeps the default's for it)."""
        base, token = self.validated_data["step_base_ms"], self.validated_data["step_token_ms"]
        if base is None and token is None:
            return None
        return StepCost(DEFAULT_COST.base_ms if base is None else base,
                        DEFAULT_COST.per_token_ms if token is None else token)


class WhatIfRunSerializer(serializers.ModelSerializer):
    user = serializers.CharField(source="user.username", default=None, read_only=True)
    note = serializers.SerializerMethodField()

    class Meta:
        model = WhatIfRun
        fields = ["id", "engine", "user", "status", "progress", "error", "note", "params",
                  "created_at", "started_at", "finished_at", "trace", "baseline", "alternative",
                  "sweep"]

    def get_note(self, run: WhatIfRun) -> str | None:
        """A hint while a run waits for a worker longer than it should."""
        waited = (timezone.now() - run.created_at).total_seconds()
        if run.status == WhatIfRun.Status.QUEUED and waited > QUEUED_HINT_S:
            return (f"queued for {waited:.0f} s: no ops worker has taken it; is one running "
                    f"(python manage.py ops_worker)?")
        return None
