"""Validation of what clients send, and the shape of what they get back."""
from __future__ import annotations

import math

from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from engine.capacity import StepCost
from engine.config import PREEMPTION_MODES
from kvops import limits
from kvops.models import Engine, Job, OperatorAction, WhatIfRun
from kvops.what_if import MAX_POOL_TOKENS, SETTINGS
from kvops.what_if_trace import MAX_JOBS, MAX_MINUTES

QUEUED_HINT_S = 30  # a what-if run queued this long gets a note: is an ops worker up?

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "min_tokens", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "logit_bias", "n", "logprobs",
                   "prompt_logprobs")


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
    """A FloatField that refuses NaN and infinities (JSON parsers let them through)."""

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        if not math.isfinite(value):
            raise serializers.ValidationError("must be a finite number")
        return value


class ChatMessageSerializer(StrictMixin, serializers.Serializer):
    role = serializers.ChoiceField(choices=["system", "user", "assistant"])
    content = TextField(allow_blank=True, max_length=limits.MAX_PROMPT_CHARS,
                                    trim_whitespace=False)


class LimitsField(serializers.Field):
    """A field checked by one of kvops/limits.py's rules (`check`), so both APIs refuse
    the same values in the same words; the value is stored as the rule returns it."""

    def check(self, data):
        raise NotImplementedError

    def to_internal_value(self, data):
        try:
            return self.check(data)
        except limits.InvalidParam as e:
            raise serializers.ValidationError(str(e)) from None

    def to_representation(self, value):
        return value


@extend_schema_field({"oneOf": [{"type": "string", "maxLength": limits.MAX_STOP_CHARS},
                                {"type": "array", "maxItems": limits.MAX_STOP_STRINGS,
                                 "items": {"type": "string", "maxLength": limits.MAX_STOP_CHARS}}]})
class StopField(LimitsField):
    """A string or a list of non-empty strings (limits.stop_strings)."""

    def check(self, data):
        return limits.stop_strings(data)


@extend_schema_field({"type": "object", "additionalProperties": {
    "type": "number", "minimum": limits.LOGIT_BIAS[0], "maximum": limits.LOGIT_BIAS[1]},
    "maxProperties": limits.MAX_LOGIT_BIAS_ENTRIES})
class LogitBiasField(LimitsField):
    """Token id -> bias (limits.logit_bias)."""

    def check(self, data):
        return limits.logit_bias(data)


@extend_schema_field({"type": "object", "description": "one of json (a JSON schema), "
                      "json_object (true), regex, choice (a list of strings), grammar (EBNF)"})
class StructuredField(LimitsField):
    """A structured-output constraint (limits.structured), as vLLM's structured_outputs."""

    def check(self, data):
        return limits.structured(data, "structured_outputs")


class JobCreateSerializer(StrictMixin, serializers.Serializer):
    prompt = TextField(required=False, max_length=limits.MAX_PROMPT_CHARS,
                                   trim_whitespace=False)
    messages = ChatMessageSerializer(many=True, required=False, allow_empty=False)
    max_tokens = serializers.IntegerField(required=False, default=128, min_value=1,
                                          max_value=limits.MAX_TOKENS)
    temperature = FiniteFloatField(required=False, default=0.0, min_value=limits.TEMPERATURE[0],
                                   max_value=limits.TEMPERATURE[1])
    top_p = FiniteFloatField(required=False, default=1.0, min_value=limits.TOP_P[0],
                             max_value=limits.TOP_P[1])
    top_k = serializers.IntegerField(required=False, allow_null=True, default=None, min_value=1,
                                     max_value=limits.TOP_K_MAX)
    seed = serializers.IntegerField(required=False, allow_null=True, default=None,
                                    min_value=0, max_value=limits.SEED_MAX)
    stop = StopField(required=False, default=list)
    stop_token_ids = serializers.ListField(child=serializers.IntegerField(min_value=0,
                                                                          max_value=2**31 - 1),
                                           required=False, default=list,
                                           max_length=limits.MAX_STOP_TOKEN_IDS)
    ignore_eos = serializers.BooleanField(required=False, default=False)
    min_tokens = serializers.IntegerField(required=False, default=0, min_value=0,
                                          max_value=limits.MAX_TOKENS)
    min_p = FiniteFloatField(required=False, default=0.0, min_value=limits.MIN_P[0],
                             max_value=limits.MIN_P[1])
    presence_penalty = FiniteFloatField(required=False, default=0.0,
                                        min_value=limits.PENALTY[0], max_value=limits.PENALTY[1])
    frequency_penalty = FiniteFloatField(required=False, default=0.0,
                                         min_value=limits.PENALTY[0], max_value=limits.PENALTY[1])
    repetition_penalty = FiniteFloatField(required=False, default=1.0,
                                          min_value=limits.REPETITION_PENALTY[0],
                                          max_value=limits.REPETITION_PENALTY[1])
    logit_bias = LogitBiasField(required=False, default=None, allow_null=True)
    structured_outputs = StructuredField(required=False, default=None, allow_null=True)
    n = serializers.IntegerField(required=False, default=1, min_value=1, max_value=limits.MAX_N,
                                 help_text="samples of the prompt (the job's `samples`)")
    logprobs = serializers.IntegerField(
        required=False, default=None, allow_null=True, min_value=0, max_value=limits.MAX_LOGPROBS,
        help_text="the job's `output_logprobs`: each token's and the k most likely")
    prompt_logprobs = serializers.IntegerField(
        required=False, default=None, allow_null=True, min_value=0, max_value=limits.MAX_LOGPROBS,
        help_text="the job's `prompt_logprobs`: the same for each prompt token")
    priority = serializers.IntegerField(required=False, default=0, min_value=limits.PRIORITY[0],
                                        max_value=limits.PRIORITY[1])
    engine = TextField(required=False, default="", allow_blank=True, max_length=64)

    def validate_top_p(self, value):
        if value <= 0.0:
            raise serializers.ValidationError("must be greater than 0")
        return value

    def validate_repetition_penalty(self, value):
        if value <= 0.0:
            raise serializers.ValidationError("must be greater than 0")
        return value

    def validate(self, attrs):
        has_prompt = bool(attrs.get("prompt"))
        has_messages = bool(attrs.get("messages"))
        if has_prompt == has_messages:
            raise serializers.ValidationError(
                {"prompt": ["give exactly one of `prompt` (non-empty text) or `messages`"]})
        try:
            limits.sampling_params({k: attrs[k] for k in SAMPLING_FIELDS if k in attrs})
        except limits.InvalidParam as e:
            raise serializers.ValidationError({e.param: [str(e)]}) from None
        return attrs

    def job_kwargs(self) -> dict:
        data = self.validated_data
        return {
            "prompt": data.get("prompt", ""),
            "messages": [dict(m) for m in data["messages"]] if data.get("messages") else None,
            "params": {**{k: data[k] for k in SAMPLING_FIELDS},
                       "structured": data["structured_outputs"]},
            "priority": data["priority"],
            "engine": data["engine"],
        }


class JobSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)

    class Meta:
        model = Job
        fields = ["id", "status", "owner", "source", "engine", "requested_engine", "routing",
                  "request_id", "prompt", "messages", "params", "priority", "output_text",
                  "output_token_ids", "output_logprobs", "prompt_logprobs", "samples",
                  "finish_reason", "num_prompt_tokens",
                  "num_cached_tokens",
                  "num_output_tokens", "num_preemptions", "attempts", "error", "queued_at",
                  "started_at", "first_token_at", "finished_at"]
        read_only_fields = fields


class EngineSerializer(serializers.ModelSerializer):
    alive = serializers.SerializerMethodField()
    heartbeat_age_s = serializers.SerializerMethodField()
    state = serializers.SerializerMethodField()

    class Meta:
        model = Engine
        fields = ["name", "worker", "host", "status", "state", "alive", "heartbeat_age_s",
                  "config", "metrics", "started_at", "last_heartbeat"]
        read_only_fields = fields

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


class PrefixSerializer(StrictMixin, serializers.Serializer):
    prompt = TextField(required=False, max_length=limits.MAX_PROMPT_CHARS,
                                   trim_whitespace=False)
    token_ids = serializers.ListField(child=serializers.IntegerField(min_value=0,
                                                                     max_value=2**31 - 1),
                                      required=False, max_length=1_000_000)
    cache_salt = TextField(required=False, allow_null=True, default=None,
                                       max_length=256)

    def validate(self, attrs):
        if bool(attrs.get("prompt")) == bool(attrs.get("token_ids")):
            raise serializers.ValidationError(
                {"prompt": ["give exactly one of `prompt` (non-empty text) or `token_ids`"]})
        return attrs


class WhatIfSerializer(StrictMixin, serializers.Serializer):
    """A what-if replay of the engine's recent jobs: which jobs, the simulated step
    cost (the same for both replays), and the settings that differ from the engine's
    (each left out or null: the engine's own; a pool size left out keeps the pool's
    memory, in blocks of the new size)."""
    minutes = serializers.IntegerField(required=False, default=30, min_value=1,
                                       max_value=MAX_MINUTES)
    max_jobs = serializers.IntegerField(required=False, default=2000, min_value=1,
                                        max_value=MAX_JOBS)
    step_base_ms = FiniteFloatField(required=False, default=StepCost().base_ms,
                                    min_value=0.1, max_value=10_000)
    step_token_ms = FiniteFloatField(required=False, default=StepCost().per_token_ms,
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

    def changes(self) -> dict:
        """The settings the operator changed."""
        return {k: v for k, v in self.validated_data.items() if k in SETTINGS and v is not None}

    def step_cost(self) -> StepCost:
        return StepCost(self.validated_data["step_base_ms"], self.validated_data["step_token_ms"])


class WhatIfRunSerializer(serializers.ModelSerializer):
    user = serializers.CharField(source="user.username", default=None, read_only=True)
    note = serializers.SerializerMethodField()

    class Meta:
        model = WhatIfRun
        fields = ["id", "engine", "user", "status", "progress", "error", "note", "params",
                  "created_at", "started_at", "finished_at", "trace", "baseline", "alternative"]

    def get_note(self, run: WhatIfRun) -> str | None:
        """A hint while a run waits for a worker longer than it should."""
        waited = (timezone.now() - run.created_at).total_seconds()
        if run.status == WhatIfRun.Status.QUEUED and waited > QUEUED_HINT_S:
            return (f"queued for {waited:.0f} s: no ops worker has taken it; is one running "
                    f"(python manage.py ops_worker)?")
        return None
