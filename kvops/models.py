"""Jobs, engines and the operator log."""
from django.conf import settings
from django.db import models

from kvops.text_fields import StoredJSONField, StoredTextField


class Engine(models.Model):
    class Status(models.TextChoices):
        STARTING = "starting"
        READY = "ready"
        STOPPED = "stopped"  # shut down cleanly
        DEAD = "dead"  # heartbeat stopped

    name = models.CharField(max_length=64, unique=True)
    worker = models.CharField(max_length=255, help_text="Celery hostname, e.g. engine-a@host")
    stack = models.CharField(max_length=64, blank=True,
                             help_text="the deployment its worker belongs to "
                                       "(kvops/engines/stack_id.py)")
    instance = models.CharField(max_length=64, blank=True,
                                help_text="id of the running worker process; new at each start")
    host = models.CharField(max_length=255, blank=True)
    config = StoredJSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.STARTING)
    metrics = StoredJSONField(default=dict, blank=True, help_text="latest engine metrics")
    started_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Deployment(models.Model):
    """This deployment's one row: its stack id, made on first use (kvops/engines/stack_id.py).
    Every process of a deployment shares its database, so they all read the same id;
    two deployments (two databases) differ."""
    stack_id = models.CharField(max_length=64)

    def __str__(self) -> str:
        return f"deployment {self.stack_id}"


class Job(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        FINISHED = "finished"
        FAILED = "failed"
        CANCELLED = "cancelled"

    TERMINAL = (Status.FINISHED, Status.FAILED, Status.CANCELLED)

    class Source(models.TextChoices):
        API = "api"
        OPENAI = "openai"
        WEB = "web"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                              related_name="jobs")
    source = models.CharField(max_length=8, choices=Source.choices, default=Source.API)
    prompt = StoredTextField(blank=True)
    messages = StoredJSONField(null=True, blank=True, help_text="chat messages, if a chat job")
    params = StoredJSONField(default=dict, help_text="sampling parameters")
    prompt_token_ids = models.JSONField(
        null=True, blank=True, help_text="the prompt as the engine runs it (its chat rendered "
                                         "and tokenized once, at intake); null: not rendered")
    tokenizer = models.CharField(max_length=512, blank=True,
                                 help_text="the tokenizer that made prompt_token_ids")
    model = models.CharField(max_length=255, blank=True,
                             help_text="the model the job asked for (/v1), if any")
    priority = models.IntegerField(default=0)
    requested_engine = models.CharField(max_length=64, blank=True)
    engine = models.CharField(max_length=64, blank=True, help_text="engine that ran it")
    engine_instance = models.CharField(max_length=64, blank=True,
                                       help_text="worker process that runs it (Engine.instance)")
    routing = StoredJSONField(default=dict, blank=True, help_text="why it went where it went")
    engines = StoredJSONField(
        default=list, blank=True,
        help_text="each engine it ran on when it moved while running (migration): "
                  "[{engine, at, reason}], oldest first; empty if it ran on one")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED,
                              db_index=True)
    request_id = models.CharField(max_length=64, blank=True)
    celery_task_id = models.CharField(max_length=64, blank=True)
    idempotency_key = models.CharField(
        max_length=128, blank=True, default="",
        help_text="the client's Idempotency-Key: a retried submission returns this job")
    dispatched_at = models.DateTimeField(
        null=True, blank=True, help_text="when its task reached the broker (null: not yet; "
                                         "the reaper sends it)")
    attempts = models.PositiveIntegerField(default=0)
    cancel_requested = models.BooleanField(default=False)
    output_text = StoredTextField(blank=True)
    output_token_ids = models.JSONField(default=list, blank=True)
    output_logprobs = StoredJSONField(
        default=list, blank=True,
        help_text="with logprobs: per output token [token, logprob, [[token, logprob], ...]]")
    prompt_logprobs = StoredJSONField(
        default=list, blank=True,
        help_text="with prompt_logprobs: the same per prompt token (the first's logprob null)")
    samples = StoredJSONField(
        default=list, blank=True,
        help_text="with n > 1: every sample's {text, token_ids, finish_reason}, in order "
                  "(output_text and output_token_ids hold sample 0's)")
    finish_reason = models.CharField(max_length=16, blank=True)
    kv_story = StoredJSONField(
        null=True, blank=True,
        help_text="its KV story as its engine told it (engine/observe/story.py): where its "
                  "prompt's blocks came from, why the first miss missed, its preemptions; "
                  "GET /api/jobs/<id>/kv/ shows it")
    error = StoredTextField(blank=True)
    num_prompt_tokens = models.PositiveIntegerField(default=0)
    num_cached_tokens = models.PositiveIntegerField(default=0)
    num_output_tokens = models.PositiveIntegerField(default=0)
    num_preemptions = models.PositiveIntegerField(default=0)
    queued_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    first_token_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True, db_index=True)  # (the bill filters on it)

    class Meta:
        ordering = ["-id"]
        constraints = [models.UniqueConstraint(
            fields=["owner", "idempotency_key"], condition=~models.Q(idempotency_key=""),
            name="job_idempotency_key_per_owner")]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL


class OperatorAction(models.Model):
    """One row of the operator log, chained once final (kvops/operators/audit_chain.py): nobody
    changes it after. Its user cannot be deleted (the MAC covers who acted): deactivate
    them instead."""
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.PROTECT)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    engine = models.CharField(max_length=64)
    action = models.CharField(max_length=32)
    target = models.CharField(max_length=128, blank=True, help_text="request id, if any")
    params = StoredJSONField(default=dict, blank=True)
    ok = models.BooleanField(default=False)
    status_code = models.PositiveSmallIntegerField(default=0, help_text="HTTP status answered "
                                                   "(0: not answered yet)")
    result = StoredJSONField(default=dict, blank=True, help_text="the engine's answer")
    idempotency_key = models.CharField(
        max_length=128, blank=True, default="",
        help_text="the client's Idempotency-Key: a retried action returns this answer")
    # owned by audit_chain.seal(): the row's position in the chain (None: not final yet)
    # and the MAC over the previous row's MAC and this row's content
    seq = models.PositiveBigIntegerField(null=True, blank=True, unique=True, editable=False)
    mac = models.CharField(max_length=64, blank=True, default="", editable=False)

    class Meta:
        ordering = ["-id"]
        constraints = [models.UniqueConstraint(
            fields=["user", "idempotency_key"], condition=~models.Q(idempotency_key=""),
            name="action_idempotency_key_per_user")]

    def __str__(self) -> str:
        return f"{self.action} {self.target} on {self.engine}"


class WhatIfRun(models.Model):
    """A capacity replay of an engine's recent jobs under its own configuration and an
    operator's alternative (kvops/what_if/what_if.py). Stored in the database, not Redis: an
    operator sizes hardware from these figures, so they outlive a Redis restart and stay
    linked from the operator log; a few kilobytes each, the newest per engine kept."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        FINISHED = "finished"
        FAILED = "failed"

    engine = models.CharField(max_length=64, db_index=True)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    params = StoredJSONField(default=dict, help_text="minutes, max_jobs, step cost and the "
                                                      "alternative's settings, as asked")
    progress = models.FloatField(default=0.0, help_text="0-1, both replays together")
    # written every KVOPS_HEARTBEAT_S by the ops worker while it runs the replay: a run
    # whose beat stopped lost its worker (what_if.settle)
    beat_at = models.DateTimeField(null=True, blank=True)
    error = StoredTextField(blank=True)
    trace = StoredJSONField(default=dict, blank=True, help_text="what was replayed")
    baseline = StoredJSONField(default=dict, blank=True,
                                help_text="the replay under the engine's configuration")
    alternative = StoredJSONField(default=dict, blank=True,
                                   help_text="the replay under the operator's configuration")
    sweep = StoredJSONField(default=dict, blank=True,
                             help_text="a sweep's replays: {lever, results: [{value, ...}]}")

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"what-if {self.pk} on {self.engine} ({self.status})"
