"""What if: replay an engine's recent jobs (kvops/what_if/what_if_trace.py) through the capacity
simulator (engine/sim/replay_stats.py: the real scheduler and KV manager, a stand-in model)
under the engine's own configuration and under an operator's alternative, or under
each value of one setting (a sweep), and keep the results side by side (WhatIfRun).

The replays run as a Celery task on the `ops` queue, which only the ops worker
(`manage.py ops_worker`) consumes: never an engine worker, whose process serves jobs.
Every replay uses the same trace and the same simulated step cost, so what differs
between them comes from the configuration alone; each is replay_one, one after the
other.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from celery.exceptions import SoftTimeLimitExceeded
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Q
from django.utils import timezone

from engine.observe.step_cost import DEFAULT_COST, StepCost
from engine.config import ConfigError, EngineConfig
from engine.errors import EngineError
from engine.sim.capacity import WarmUp
from engine.sim.replay_actions import ReplayAction
from engine.sim.replay_stats import replay_stats
from kvops.operators import audit_chain
from kvops.jobs.idempotency import HEADER, KeyReused
from kvops.models import Engine, OperatorAction, WhatIfRun
from kvops.what_if.what_if_trace import JobTrace, build_trace, window

log = logging.getLogger(__name__)

OPS_QUEUE = "ops"
KEEP_RUNS = 20  # runs kept per engine (older finished ones are deleted)
MAX_UNFINISHED = 2  # queued or running at once per engine
# Slots per simulated pool: the stand-in model keeps one value per token slot.
MAX_POOL_TOKENS = 1 << 23
PROGRESS_EVERY_S = 0.5
MAX_SWEEP_VALUES = 8  # configurations a sweep replays beside the engine's, at most
# The settings an operator may change (cpu_prefix_cache: the CPU pool as a second
# prefix-cache tier, num_cpu_blocks its size).
SETTINGS = ("num_gpu_blocks", "block_size", "num_cpu_blocks", "preemption_mode",
            "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
            "cpu_prefix_cache", "disk_cache_bytes", "eviction_policy", "kv_cache_dtype",
            "pin_budget", "tenant_cache_quota", "fairness")
# (disk_cache_bytes: a disk tier of that many bytes of the engine's blocks, below the CPU
# tier or the GPU pool without one, 0 for none; the replay keeps it in a folder of its own, empty at its start.
# kv_cache_dtype: how a real model's engine stores K/V; the same memory holds as many
# more blocks as a value takes fewer bytes, on every tier)
# pin_budget: the most of the GPU pool the engine's pinned prefixes (the operator log's,
# kvops/what_if/what_if_log.active_pins, and those pinned in the replayed period at their
# times) may hold; those past the budget refused)
# bytes of one K/V value, by the engine's dtype or kv_cache_dtype
KV_VALUE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}


class Refused(Exception):
    """A what-if that cannot run as asked; the message says why and what to change."""


class Busy(Exception):
    """Too many what-if runs of this engine are queued or running."""


class Unavailable(Exception):
    """The task could not be queued (the broker is away)."""


# --- configurations ------------------------------------------------------------------
def baseline_config(engine_config: dict) -> EngineConfig:
    """The engine's configuration, as it registered it, for the simulator."""
    needed = ("block_size", "num_gpu_blocks", "num_cpu_blocks", "max_model_len",
              "max_num_seqs", "max_num_batched_tokens", "preemption_mode", "vocab_size")
    missing = [k for k in needed if engine_config.get(k) is None]
    if missing:
        raise Refused(f"the engine registered no {', '.join(missing)}: restart its worker "
                      f"so that it records its configuration")
    fields = {k: engine_config[k] for k in needed}
    fields.update(scheduling_policy=engine_config.get("scheduling_policy") or "fcfs",
                  enable_prefix_caching=bool(engine_config.get("enable_prefix_caching", True)),
                  cpu_prefix_cache=bool(engine_config.get("cpu_prefix_cache", False)),
                  disk_cache_bytes=int(engine_config.get("disk_cache_bytes") or 0),
                  eviction_policy=engine_config.get("eviction_policy") or "lru",
                  pin_budget=float(engine_config.get("pin_budget", 0.5)),
                  # (the trace's requests carry their tenants: these act as they did)
                  max_batch_share=float(engine_config.get("max_batch_share", 1.0)),
                  tenant_cache_quota=float(engine_config.get("tenant_cache_quota", 1.0)),
                  fairness=engine_config.get("fairness") or "share",
                  simulate_sliding_window=engine_config.get("sliding_window"))
    groups = engine_config.get("kv_group_windows")
    if groups:  # a table per layer group: the stand-in's global and sliding groups
        # (one of each: a model with more sliding groups than global ones is modelled
        # as holding its window's blocks once, not once per sliding group)
        fields.update(simulate_sliding_window=max(w for w in groups if w),
                      simulate_hybrid=True)
    # token ids from a trace: the byte tokenizer keeps the registered vocabulary
    return _checked(EngineConfig, simulate=True, simulate_tokenizer="bytes",
                    max_pending_events=0, **fields)


def alternative_config(base: EngineConfig, changes: dict,
                       engine_config: dict | None = None) -> EngineConfig:
    """The base configuration with the operator's changes. A pool size left out keeps
    the base pool's memory: the same tokens, in blocks of the new size, and with
    kv_cache_dtype, as many more tokens as its values are smaller (engine_config: the
    engine's as registered, whose dtype says how big they are now)."""
    unknown = set(changes) - set(SETTINGS)
    if unknown:
        raise Refused(f"cannot change {', '.join(sorted(unknown))}; one of {', '.join(SETTINGS)}")
    fields = {k: v for k, v in changes.items() if v is not None}
    base_kv, alt_kv = kv_dtypes(engine_config or {}, fields.pop("kv_cache_dtype", None))
    grow = KV_VALUE_BYTES[base_kv] / KV_VALUE_BYTES[alt_kv] if base_kv else 1.0
    block_size = fields.get("block_size", base.block_size)
    fields.setdefault("num_gpu_blocks",
                      max(1, int(base.num_gpu_blocks * base.block_size * grow) // block_size))
    fields.setdefault("num_cpu_blocks",
                      int(base.num_cpu_blocks * base.block_size * grow) // block_size)
    return _checked(dataclasses.replace, base, **fields)


def kv_dtypes(engine_config: dict, wanted: str | None) -> tuple[str | None, str | None]:
    """(how the engine stores K/V now, how the alternative would): names of
    KV_VALUE_BYTES; (None, None) when neither is asked and the engine does not say (the
    simulator). Refused: another dtype for a simulated engine."""
    current = engine_config.get("kv_cache_dtype") or "auto"
    if current == "auto":
        current = engine_config.get("dtype")
    if current not in KV_VALUE_BYTES:
        if wanted is None:
            return None, None
        raise Refused(f"kv_cache_dtype is a real model's: engine K/V of dtype {current!r} "
                      f"cannot be compared with {wanted!r} (the simulator's stand-in has "
                      f"none; change num_gpu_blocks instead)")
    if wanted == "auto":
        wanted = engine_config.get("dtype")
    return current, wanted or current


def _checked(make, *args, **fields) -> EngineConfig:
    try:
        config = make(*args, **fields)
    except ConfigError as e:
        raise Refused(str(e)) from None
    if config.disk_cache_bytes and not config.cpu_prefix_cache and config.simulate_hybrid:
        raise Refused("a disk tier straight below the GPU pool of a model with layer groups "
                      "is not supported: set cpu_prefix_cache too")
    for pool, blocks in (("num_gpu_blocks", config.num_gpu_blocks),
                         ("num_cpu_blocks", config.num_cpu_blocks)):
        if blocks * config.block_size > MAX_POOL_TOKENS:
            raise Refused(f"{pool} x block_size is {blocks * config.block_size} token slots; "
                          f"the simulator takes at most {MAX_POOL_TOKENS}")
    return config


def with_disk(config: EngineConfig, folder: str, block_bytes: int) -> EngineConfig:
    """The configuration the replay runs: with a disk tier (disk_cache_bytes), in
    `folder`, holding as many of the simulator's blocks as the budget holds of the
    engine's (`block_bytes` each; the simulator's weigh less)."""
    if not config.disk_cache_bytes:
        return dataclasses.replace(config, disk_cache_dir=None)
    from engine.kv.tiers.disk_seal import file_bytes
    blocks = config.disk_cache_bytes // max(block_bytes, 1) if block_bytes else \
        config.disk_cache_bytes // file_bytes(config.block_size * 8)
    return dataclasses.replace(config, disk_cache_dir=folder,
                               disk_cache_bytes=blocks * file_bytes(config.block_size * 8))


def alternatives(base: EngineConfig, changes: dict, sweep: dict | None,
                 engine_config: dict | None = None) -> list[tuple[dict, EngineConfig]]:
    """The configurations a run replays beside the engine's, each with the settings it
    changes: the operator's alternative, or with a sweep ({lever, values}: one setting
    over several values), one for each value, the alternative's other changes in all.
    Refused, naming the value, for one that cannot run."""
    if not sweep:
        return [(changes, alternative_config(base, changes, engine_config))]
    lever, values, out = sweep["lever"], list(sweep["values"]), []
    if not 2 <= len(values) <= MAX_SWEEP_VALUES:
        raise Refused(f"sweep: give 2 to {MAX_SWEEP_VALUES} values of {lever}, not {len(values)}")
    if lever in changes:
        raise Refused(f"sweep: {lever} is swept; leave it out of the alternative's settings")
    for value in values:
        swept = {**changes, lever: value}
        try:
            out.append((swept, alternative_config(base, swept, engine_config)))
        except Refused as e:
            raise Refused(f"sweep: {lever} = {value!r}: {e}") from None
    return out


def describe(config: EngineConfig, kv_cache_dtype: str | None = None) -> dict:
    """The settings a what-if compares, as shown next to its results (kv_cache_dtype:
    how the engine would store K/V, None when the engine does not say)."""
    out = {k: getattr(config, k) for k in SETTINGS}
    out["kv_cache_dtype"] = kv_cache_dtype
    out["pool_tokens"] = config.num_gpu_blocks * config.block_size
    return out


def check_fits(config: EngineConfig, lengths: list[tuple[int, int]], which: str) -> None:
    """Refused if the pool cannot hold the longest job (prompt, output) whole, as the
    engine requires of every request. (A sliding window needs less: the replay checks.)"""
    if config.simulate_sliding_window is not None or not lengths:
        return
    longest = max(min(p + o, config.max_model_len) for p, o in lengths)
    need = -(-longest // config.block_size)
    if need > config.num_gpu_blocks:
        raise Refused(f"the {which} pool of {config.num_gpu_blocks} blocks of "
                      f"{config.block_size} tokens cannot hold the longest job of the window "
                      f"({longest} tokens, {need} blocks): give it at least {need} blocks")


# --- starting a run ------------------------------------------------------------------
def engine_step_cost(engine: Engine) -> tuple[StepCost, str]:
    """The step cost a replay of this engine uses unless told another: the fit of its
    own steps (engine/observe/step_cost.py, in its metrics), or the default before it
    has one; and which it is ("engine" or "default")."""
    fitted = (engine.metrics or {}).get("step_cost")
    if fitted:
        return StepCost.from_dict(fitted), "engine"
    return DEFAULT_COST, "default"


def start(user, engine: Engine, minutes: int, max_jobs: int, changes: dict,
          step_cost: StepCost | None, idempotency_key: str = "",
          sweep: dict | None = None) -> WhatIfRun:
    """Check the request, store the run and its audit row, and queue the task.
    step_cost: None for the engine's (engine_step_cost); sweep: {lever, values}, one
    setting over several values, each replayed beside the engine's (alternatives).
    Refused (the request cannot run), Busy, Unavailable. With an idempotency key (kept
    on the audit row), a retry of the same request gets the first call's run, marked
    `replayed`, and nothing is queued twice; KeyReused if the key belongs to another
    request."""
    base = baseline_config(engine.config or {})
    others = alternatives(base, changes, sweep, engine.config or {})
    lengths = list(window(engine.name, minutes).values_list(
        "num_prompt_tokens", "num_output_tokens")[:max_jobs])
    if not lengths:
        raise Refused(f"engine {engine.name} ran no jobs queued in the last {minutes} "
                      f"minutes: there is nothing to replay; choose more minutes")
    check_fits(base, lengths, "engine's")
    for swept, config in others:
        check_fits(config, lengths, f"sweep's {sweep['lever']} = {swept[sweep['lever']]!r}"
                   if sweep else "alternative")
    # (the operator's step cost as asked, None: the engine's, resolved below; a retry
    # under the same key is the same request even if the engine's fit moved since)
    params = {"minutes": minutes, "max_jobs": max_jobs, "alternative": changes,
              "step_cost": step_cost.as_dict() if step_cost is not None else None}
    if sweep:
        params["sweep"] = {"lever": sweep["lever"], "values": list(sweep["values"])}
    if idempotency_key:
        prior = _earlier_call(user, engine, params, idempotency_key)
        if prior is not None:
            return prior
    try:
        with transaction.atomic():
            busy = _unfinished(engine.name).count()
            if busy >= MAX_UNFINISHED:
                raise Busy(f"{busy} what-if runs of engine {engine.name} are queued or "
                           f"running; wait for one to end")
            cost, source = (step_cost, "operator") if step_cost is not None \
                else engine_step_cost(engine)
            run = WhatIfRun.objects.create(engine=engine.name, user=user, params={
                **params, "step_cost": cost.as_dict(), "step_cost_source": source})
            # stored now (its idempotency key taken), sealed once its answer is known
            audit = OperatorAction.objects.create(
                user=user, engine=engine.name, action="what-if", target=str(run.pk),
                params=params, ok=True, status_code=202, result={"run": run.pk},
                idempotency_key=idempotency_key)
    except IntegrityError:  # the same key stored meanwhile by a concurrent retry
        prior = _earlier_call(user, engine, params, idempotency_key)
        if prior is None:
            raise
        return prior
    try:
        from kvops.celery import app

        app.send_task("kvops.what_if", args=[run.pk], queue=OPS_QUEUE)  # (kvops/tasks.py)
    except Exception as e:  # noqa: BLE001  (the broker is away: say so, keep nothing queued)
        error = f"could not be queued: {type(e).__name__}: {e}"
        _fail(run.pk, error)
        audit.ok, audit.status_code, audit.result = False, 503, {"run": run.pk, "error": error}
        audit_chain.seal(audit)
        raise Unavailable(f"the what-if task could not be queued: {e}") from None
    audit_chain.seal(audit)
    _prune(engine.name)
    return run


def _earlier_call(user, engine: Engine, params: dict, key: str) -> WhatIfRun | None:
    """The run an earlier call with this key started (marked replayed), None if the key
    is new; KeyReused if it was used for another request."""
    prior = OperatorAction.objects.filter(user=user, idempotency_key=key).first()
    if prior is None:
        return None
    if (prior.action, prior.engine, prior.params) != ("what-if", engine.name, params):
        raise KeyReused(f"{HEADER} {key!r} was used for another action "
                        f"({prior.action} on {prior.engine})")
    run = WhatIfRun.objects.filter(pk=(prior.result or {}).get("run")).first()
    if run is None:  # pruned since: the key's answer is gone with it
        raise KeyReused(f"{HEADER} {key!r} was used for a what-if run that is no longer kept")
    run.replayed = True
    return run


def _unfinished(engine_name: str):
    # Runs older than twice the time limit are not counted: their worker died with them.
    recent = timezone.now() - timedelta(seconds=2 * settings.KVOPS_WHAT_IF_TIME_LIMIT_S)
    return WhatIfRun.objects.filter(engine=engine_name, created_at__gt=recent, status__in=(
        WhatIfRun.Status.QUEUED, WhatIfRun.Status.RUNNING)).exclude(_lost())


def _lost() -> Q:
    """Running runs whose ops worker gave no sign of life (the beat) for
    KVOPS_ENGINE_DEAD_AFTER_S: it was killed, or its machine went away."""
    cutoff = timezone.now() - timedelta(seconds=settings.KVOPS_ENGINE_DEAD_AFTER_S)
    return Q(status=WhatIfRun.Status.RUNNING) & (
        Q(beat_at__lt=cutoff) | Q(beat_at__isnull=True, started_at__lt=cutoff))


def _prune(engine_name: str) -> None:
    keep = WhatIfRun.objects.filter(engine=engine_name).values_list("pk", flat=True)[:KEEP_RUNS]
    WhatIfRun.objects.filter(engine=engine_name).exclude(pk__in=list(keep)).exclude(
        status__in=(WhatIfRun.Status.QUEUED, WhatIfRun.Status.RUNNING)).delete()


def settle(run: WhatIfRun) -> WhatIfRun:
    """A run still marked running whose ops worker stopped beating, or long past the
    time limit, lost its worker: say so."""
    if run.status != WhatIfRun.Status.RUNNING:
        return run
    limit = timedelta(seconds=settings.KVOPS_WHAT_IF_TIME_LIMIT_S + 120)
    if WhatIfRun.objects.filter(_lost(), pk=run.pk).exists():
        _fail(run.pk, f"the ops worker stopped while running it (no sign of it for "
                      f"{settings.KVOPS_ENGINE_DEAD_AFTER_S:g} s): start the run again, once "
                      f"an ops worker runs (manage.py ops_worker)")
        run.refresh_from_db()
    elif run.started_at and timezone.now() - run.started_at > limit:
        _fail(run.pk, "the ops worker stopped while running it; start it again")
        run.refresh_from_db()
    return run


# --- running it (the ops worker) -----------------------------------------------------
def run(run_id: int) -> str:
    """Build the trace, replay it under both configurations, store the results."""
    claimed = WhatIfRun.objects.filter(pk=run_id, status=WhatIfRun.Status.QUEUED).update(
        status=WhatIfRun.Status.RUNNING, started_at=timezone.now())
    if not claimed:  # deleted, or a second delivery of a run that already ran
        return "skipped"
    row = WhatIfRun.objects.get(pk=run_id)
    with _beating(run_id):
        return _run(row)


def _run(row: WhatIfRun) -> str:
    run_id = row.pk
    try:
        engine = Engine.objects.get(name=row.engine)
        params = row.params
        base = baseline_config(engine.config or {})
        changes = params.get("alternative") or {}
        sweep = params.get("sweep")
        configurations = [({}, base), *alternatives(base, changes, sweep, engine.config or {})]
        trace = build_trace(engine, params["minutes"], params["max_jobs"], until=row.created_at)
        cost = StepCost.from_dict(params["step_cost"])
        results = [replay_one(trace, config, kept, engine.config or {}, cost,
                              _progress_writer(run_id, i, len(configurations)))
                   for i, (kept, config) in enumerate(configurations)]
        results[0]["fidelity"] = fidelity(trace.summary["recorded"], results[0],
                                          bool((engine.config or {}).get("simulate")))
    except SoftTimeLimitExceeded:
        _fail(run_id, f"the replay ran past {settings.KVOPS_WHAT_IF_TIME_LIMIT_S:g} s: "
                      f"choose fewer minutes or jobs" + (", or fewer values to sweep"
                                                         if row.params.get("sweep") else ""))
        return "failed"
    except (Refused, ValueError, EngineError, Engine.DoesNotExist) as e:
        _fail(run_id, str(e))
        return "failed"
    except Exception as e:  # noqa: BLE001  (anything else: the run must not stay running)
        log.exception("what-if run %s failed", run_id)
        _fail(run_id, f"{type(e).__name__}: {e}")
        return "failed"
    outcome = {"alternative": results[1]} if not sweep else {
        "alternative": {}, "sweep": {"lever": sweep["lever"], "results": [
            {"value": kept[sweep["lever"]], **result}
            for (kept, _), result in zip(configurations[1:], results[1:])]}}
    WhatIfRun.objects.filter(pk=run_id).update(
        status=WhatIfRun.Status.FINISHED, finished_at=timezone.now(), progress=1.0,
        trace={**trace.summary, "step_cost": {**params["step_cost"],
                                              "source": params.get("step_cost_source")}},
        baseline=results[0], **outcome)
    return "finished"


def replay_one(trace: JobTrace, config: EngineConfig, changes: dict, engine_config: dict,
               cost: StepCost, on_progress: Callable[[float], None] | None = None) -> dict:
    """One configuration's replay of the trace, as a report shows it: `changes`, the
    settings it changes from the engine's ({} for the engine's own), keeps them through
    the engine's own retention and limits changes; its times as a user sees them."""
    # a block of another K/V dtype weighs as much less on disk
    current, own = kv_dtypes(engine_config, changes.get("kv_cache_dtype"))
    block_bytes = int(engine_config.get("kv_bytes_per_block") or 0)
    weight = block_bytes * KV_VALUE_BYTES[own] // KV_VALUE_BYTES[current] if current \
        else block_bytes
    with tempfile.TemporaryDirectory(prefix="kvops-what-if-disk-") as folder:
        stats = replay_stats(trace.requests, with_disk(config, folder, weight), cost,
                             trace.prompts, on_progress=on_progress, pins=trace.pins,
                             actions=actions_for(trace.actions, changes),
                             warmup=warmup_for(trace.warmup, changes))
    return as_seen({"config": describe(config, own), **stats},
                   trace.summary["recorded"]["service_delay_s"])


def actions_for(actions: list[ReplayAction], changes: dict) -> list[ReplayAction]:
    """The operator actions a replay applies: an alternative that changes a setting keeps
    it, so the engine's own changes of it (retention, limits) are not applied there."""
    out = []
    for action in actions:
        if action.kind in ("retention", "set-limits"):
            arguments = {k: v for k, v in action.arguments.items() if changes.get(k) is None}
            if not arguments:
                continue
            action = dataclasses.replace(action, arguments=arguments)
        out.append(action)
    return out


def warmup_for(warmup: WarmUp | None, changes: dict) -> WarmUp | None:
    if warmup is None:
        return None
    return dataclasses.replace(warmup, actions=actions_for(warmup.actions, changes))


# How far the replay of the engine's own configuration may be from what the engine
# recorded for the same jobs before its report says it misses: points of prefix hit
# rate, a fraction of TTFT p50, of preemptions (or a count, whichever is larger). A
# simulated engine is held closer (its steps are paced, its model a stand-in of itself).
TOLERANCE = {"simulated": {"prefix_hit_rate": 0.02, "ttft_p50": 0.15, "preemptions": 0.25},
             "model": {"prefix_hit_rate": 0.05, "ttft_p50": 0.25, "preemptions": 0.25}}
PREEMPTIONS_SLACK = 2


def as_seen(result: dict, service_delay_s: float) -> dict:
    """A replay's times as a user sees them: the service's own delay (the jobs' median
    wait to be claimed by a worker, which the replay does not run) added to its queue
    waits and TTFTs."""
    for key in ("queue_wait_p50", "queue_wait_p99", "queue_wait_mean", "ttft_p50", "ttft_p99"):
        if result.get(key) is not None:
            result[key] += service_delay_s
    result["service_delay_s"] = service_delay_s
    return result


def fidelity(recorded: dict, baseline: dict, simulated: bool) -> dict:
    """The replay of the engine's own configuration against what it recorded for the
    same jobs: each figure's both values and difference, and those that miss by more
    than the tolerance (the report says so first)."""
    tolerance = TOLERANCE["simulated" if simulated else "model"]
    figures, misses = {}, []
    for key in ("prefix_hit_rate", "prompt_tokens_computed", "preemptions", "ttft_p50",
                "ttft_p99", "queue_wait_p50", "queue_wait_p99"):
        was, now = recorded.get(key), baseline.get(key)
        if was is None or now is None:
            continue
        figures[key] = {"recorded": was, "replayed": now, "difference": now - was}
    hit = figures.get("prefix_hit_rate")
    if hit and abs(hit["difference"]) > tolerance["prefix_hit_rate"]:
        misses.append("prefix_hit_rate")
    ttft = figures.get("ttft_p50")
    if ttft and ttft["recorded"] > 0 and \
            abs(ttft["difference"]) > tolerance["ttft_p50"] * ttft["recorded"]:
        misses.append("ttft_p50")
    pre = figures.get("preemptions")
    if pre and abs(pre["difference"]) > max(PREEMPTIONS_SLACK,
                                            tolerance["preemptions"] * pre["recorded"]):
        misses.append("preemptions")
    return {"figures": figures, "misses": misses, "tolerance": tolerance}


@contextlib.contextmanager
def _beating(run_id: int):
    """While the body runs, a thread writes the run's beat every KVOPS_HEARTBEAT_S (a
    replay writes its progress only now and then): a run whose beat stops lost its
    worker (settle)."""
    done = threading.Event()

    def beat() -> None:
        try:
            while True:
                WhatIfRun.objects.filter(pk=run_id, status=WhatIfRun.Status.RUNNING) \
                    .update(beat_at=timezone.now())
                if done.wait(settings.KVOPS_HEARTBEAT_S):
                    return
        except Exception:  # noqa: BLE001  (the database away: the run goes on unbeaten)
            log.exception("what-if run %s: its beat stopped", run_id)
        finally:
            connection.close()  # (this thread's own)

    thread = threading.Thread(target=beat, name=f"what-if-beat-{run_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _progress_writer(run_id: int, replay: int, replays: int):
    """on_progress for replay `replay` of `replays` (0: the engine's configuration): the
    run's progress, written at most every PROGRESS_EVERY_S."""
    last = [0.0]

    def write(fraction: float) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            WhatIfRun.objects.filter(pk=run_id).update(progress=(replay + fraction) / replays)

    return write


def _fail(run_id: int, error: str) -> None:
    WhatIfRun.objects.filter(pk=run_id).update(status=WhatIfRun.Status.FAILED, error=error,
                                               finished_at=timezone.now())
