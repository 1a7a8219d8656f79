"""Soak: `python -m benchmarks.soak --minutes 60`.

A throwaway deployment (web server, two simulated engines at GPU pace, the ops worker, a
Redis of its own) under mixed traffic for N minutes: chat and raw completions through
/v1, streams read to the end, n > 1, a structured-output call (refused by the simulator:
its refusal path), REST jobs and cancels, an operator action every few seconds (pin and
unpin, evict, preempt, swap), a request moved between the engines every minute and a
what-if every few minutes. Then it lets everything end and reports:

* jobs lost (accepted, never ended; a /v1 call answered 2xx whose answer was cut short),
  jobs failed by cause, client errors by kind;
* blocks leaked: every engine's pool once idle holds no used block and only what the
  soak pinned (unpinned at the end: none);
* memory (RSS) of the web process, the engine workers and their cores, and Redis' keys
  and memory, sampled over time, with the growth over the last half of the run;
* latency (TTFT and end to end, p50 and p99) per quarter of the run.

Everything talks to 127.0.0.1; the run is bounded by --minutes plus a drain deadline.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from datetime import datetime
from pathlib import Path

import redis
import requests

from engine.observe.snapshot import decode_array
from engine.sim.capacity import format_table
from tests.session_redis import free_port, start_redis
from tests.support.stack import Stack

ENGINE = dict(simulate=1, vocab_size=32000, num_gpu_blocks=1024, num_cpu_blocks=256,
              block_size=16, max_num_seqs=64, max_num_batched_tokens=2048,
              preemption_mode="swap")
MODEL = "simulated-v1"
ENGINES = ("soak-a", "soak-b")
SYSTEMS = [f"System prompt {i}: you are assistant number {i} of the soak. " * 6
           for i in range(4)]
SAMPLE_S = 10.0  # memory and Redis are sampled this often


def _ts(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp() if iso else None


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def rss_mib(pid: int) -> float:
    """A process's resident memory, MiB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def process_tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


class Soak:
    def __init__(self, stack: Stack, minutes: float, seed: int, step_ms: int) -> None:
        self.stack, self.rng = stack, random.Random(seed)
        self.end_at = time.monotonic() + minutes * 60
        self.t0 = time.monotonic()
        self.step_ms = step_ms
        self.lock = threading.Lock()
        self.job_ids: set[int] = set()  # every job the service accepted (REST and /v1)
        self.client_errors: Counter = Counter()
        self.cut_short = 0  # /v1 answers that ended without their finish
        self.calls: Counter = Counter()
        self.actions: Counter = Counter()
        self.samples: list[dict] = []
        self.pinned: list[dict] = []
        self.parked: list[tuple[str, str]] = []  # (engine, request) swapped out by the soak

    # --- traffic -------------------------------------------------------------------
    def running(self) -> bool:
        return time.monotonic() < self.end_at

    def _headers(self, user: str = "alice") -> dict:
        return {"Authorization": f"Bearer {self.stack.tokens[user]}"}

    def _v1(self, path: str, body: dict, user: str = "alice") -> None:
        url = f"{self.stack.url}/v1/{path}"
        stream = bool(body.get("stream"))
        with requests.post(url, json=body, headers=self._headers(user), stream=stream,
                           timeout=300) as r:
            self._count(path + (" stream" if stream else ""), r.status_code)
            if r.status_code >= 300:
                return
            if stream:
                done, finished, error = False, False, False
                for line in r.iter_lines():
                    if line == b"data: [DONE]":
                        done = True
                    elif line.startswith(b"data: {"):
                        chunk = json.loads(line[6:])
                        error = error or "error" in chunk
                        finished = finished or any(
                            c.get("finish_reason") for c in chunk.get("choices", ()))
                        self._note_job(chunk.get("id"))
                if not (done and finished) or error:
                    with self.lock:
                        self.cut_short += 1
            else:
                answer = r.json()
                self._note_job(answer.get("id"))
                if not all(c.get("finish_reason") for c in answer["choices"]):
                    with self.lock:
                        self.cut_short += 1

    def _note_job(self, ident: str | None) -> None:
        """A /v1 answer's id names its job ("cmpl-<job id>" and the like)."""
        if ident:
            tail = ident.rsplit("-", 1)[-1]
            if tail.isdigit():
                with self.lock:
                    self.job_ids.add(int(tail))

    def _count(self, what: str, status: int) -> None:
        with self.lock:
            self.calls[what] += 1
            if status >= 300 and not (what.startswith("structured") and status == 400):
                self.client_errors[f"{what}: {status}"] += 1

    def client(self, number: int) -> None:
        rng = random.Random(number)
        turns: list[dict] = []
        system = SYSTEMS[number % len(SYSTEMS)]
        while self.running():
            kind = rng.choices(["chat", "stream", "n2", "rest", "cancel", "structured"],
                               [30, 30, 10, 15, 10, 5])[0]
            try:
                if kind == "chat":  # multi-turn: each turn's prefix is the last's
                    turns.append({"role": "user", "content": f"turn {len(turns)}: "
                                  + "tell me more " * rng.randint(1, 8)})
                    self._v1("chat/completions", {
                        "model": MODEL, "max_tokens": rng.randint(8, 64),
                        "messages": [{"role": "system", "content": system}, *turns]})
                    turns.append({"role": "assistant", "content": "ok " * 4})
                    if len(turns) > 12:
                        turns = []
                elif kind == "stream":
                    self._v1("completions", {"model": MODEL, "prompt": system + "stream "
                                             * rng.randint(1, 30), "stream": True,
                                             "max_tokens": rng.randint(16, 160)})
                elif kind == "n2":
                    self._v1("completions", {"model": MODEL, "prompt": system + "twice",
                                             "n": 2, "temperature": 0.8,
                                             "max_tokens": rng.randint(8, 48)})
                elif kind == "structured":
                    with requests.post(f"{self.stack.url}/v1/chat/completions", json={
                            "model": MODEL, "max_tokens": 8,
                            "response_format": {"type": "json_object"},
                            "messages": [{"role": "user", "content": "json"}]},
                            headers=self._headers(), timeout=60) as r:
                        self._count("structured", r.status_code)
                else:
                    r = self.stack.api("POST", "/api/jobs/", user="alice", json={
                        "prompt": system + "rest " * rng.randint(1, 40),
                        "max_tokens": rng.randint(8, 200 if kind == "cancel" else 64)})
                    self._count("rest", r.status_code)
                    if r.status_code == 201:
                        job_id = r.json()["id"]
                        with self.lock:
                            self.job_ids.add(job_id)
                        if kind == "cancel":
                            time.sleep(rng.uniform(0.05, 1.0))
                            r = self.stack.api("POST", f"/api/jobs/{job_id}/cancel/",
                                               user="alice")
                            self._count("cancel", r.status_code if r.status_code != 409
                                        else 200)  # (it ended first)
            except requests.RequestException as e:
                with self.lock:
                    self.client_errors[f"{kind}: {type(e).__name__}"] += 1

    # --- operators -----------------------------------------------------------------
    def _running_request(self, engine: str) -> str | None:
        snap = self.stack.api("GET", f"/api/engines/{engine}/").json().get("snapshot") or {}
        running = [r["request_id"] for r in snap.get("requests", ())
                   if r["status"] == "running"]
        return self.rng.choice(running) if running else None

    def _act(self, what: str, method: str, path: str, body: dict | None = None) -> dict:
        r = self.stack.api(method, path, json=body or {},
                           headers={"Idempotency-Key": uuid.uuid4().hex})
        with self.lock:
            self.actions[f"{what} {r.status_code}"] += 1
        return r.json() if r.headers.get("content-type", "").startswith("application/json") \
            else {}

    def swap_in_parked(self) -> None:
        """An operator's swap-out parks the request in CPU memory until swapped in."""
        while self.parked:
            engine, rid = self.parked.pop()
            self._act("swap-in", "POST", f"/api/engines/{engine}/requests/{rid}/swap-in/")

    def operator(self) -> None:
        last_move = last_what_if = time.monotonic()
        while self.running():
            time.sleep(5)
            engine = self.rng.choice(ENGINES)
            try:
                now = time.monotonic()
                if now - last_move >= 60:  # a move every minute
                    last_move = now
                    rid = self._running_request(engine)
                    if rid:
                        other = ENGINES[1 - ENGINES.index(engine)]
                        self._act("migrate", "POST",
                                  f"/api/engines/{engine}/requests/{rid}/migrate/", {"to": other})
                    continue
                if now - last_what_if >= 180:  # a what-if every three minutes
                    last_what_if = now
                    self._act("what-if", "POST", f"/api/engines/{engine}/what-if/",
                              {"minutes": 5, "num_gpu_blocks": 512})
                    continue
                action = self.rng.choice(["pin", "unpin", "evict", "preempt", "swap-out"])
                if action == "pin":
                    system = self.rng.choice(SYSTEMS)
                    self._act("pin", "POST", f"/api/engines/{engine}/prefix-cache/pin/",
                              {"text": system})
                    self.pinned.append({"engine": engine, "text": system})
                elif action == "unpin" and self.pinned:
                    pin = self.pinned.pop(0)
                    self._act("unpin", "POST",
                              f"/api/engines/{pin['engine']}/prefix-cache/unpin/",
                              {"text": pin["text"]})
                elif action == "evict":
                    self._act("evict", "POST", f"/api/engines/{engine}/prefix-cache/evict/",
                              {"num_blocks": 64})
                elif action in ("preempt", "swap-out"):
                    rid = self._running_request(engine)
                    if rid:
                        answer = self._act(action, "POST",
                                           f"/api/engines/{engine}/requests/{rid}/{action}/")
                        if action == "swap-out" and answer.get("ok"):
                            self.parked.append((engine, rid))  # in again on the next tick
                            continue
                self.swap_in_parked()
            except (requests.RequestException, ValueError) as e:
                with self.lock:
                    self.actions[f"{type(e).__name__}"] += 1

    # --- sampling ------------------------------------------------------------------
    def sampler(self, redis_client: redis.Redis, redis_pid: int) -> None:
        while True:
            procs = self.stack.procs
            sample = {"t": time.monotonic() - self.t0,
                      "web": sum(rss_mib(p) for p in process_tree(procs["web"].pid))}
            for name in ENGINES:
                worker = procs[f"engine-{name}"].pid
                tree = process_tree(worker)
                sample[f"{name} worker"] = rss_mib(worker)
                sample[f"{name} core"] = sum(rss_mib(p) for p in tree[1:])
            if "ops" in procs:
                sample["ops"] = sum(rss_mib(p) for p in process_tree(procs["ops"].pid))
            info = redis_client.info("memory")
            sample["redis MiB"] = info["used_memory"] / 2 ** 20
            sample["redis keys"] = redis_client.dbsize()
            sample["redis rss"] = rss_mib(redis_pid)
            self.samples.append(sample)
            if not self.running():
                return
            time.sleep(min(SAMPLE_S, max(0.0, self.end_at - time.monotonic())) or SAMPLE_S)

    # --- the end -------------------------------------------------------------------
    def settle(self, deadline_s: float) -> dict:
        """Unpin what is pinned, wait for every accepted job to end and every engine to
        run nothing; what each pool holds then."""
        self.swap_in_parked()
        for pin in self.pinned:
            self._act("unpin", "POST", f"/api/engines/{pin['engine']}/prefix-cache/unpin/",
                      {"text": pin["text"]})
        self.pinned = []
        until = time.monotonic() + deadline_s
        jobs: dict[int, dict] = {}
        while time.monotonic() < until:
            jobs = self.all_jobs()
            if all(j["status"] in ("finished", "failed", "cancelled") for j in jobs.values()):
                break
            time.sleep(2)
        pools = {}
        for name in ENGINES:
            snap: dict = {}

            def idle(name: str = name, snap: dict = snap) -> bool:
                snap.update(self.stack.api("GET", f"/api/engines/{name}/").json()["snapshot"])
                return not [r for r in snap["requests"]
                            if r["status"] in ("waiting", "running", "swapped")]

            self.stack.wait(idle, f"engine {name} idle", max(5.0, until - time.monotonic()))
            states = decode_array(snap["gpu"]["state"])
            pools[name] = {s: int((states == i).sum()) for i, s in enumerate(snap["block_states"])}
        return {"jobs": jobs, "pools": pools}

    def all_jobs(self) -> dict[int, dict]:
        jobs, offset = {}, 0
        while True:
            page = self.stack.api("GET", f"/api/jobs/?limit=500&offset={offset}").json()
            for job in page["results"]:
                jobs[job["id"]] = job
            if not page["next"]:
                return jobs
            offset += 500


def growth(samples: list[dict], key: str) -> float | None:
    """Percent change of `key` over the last half of the run (its first sample there to
    the mean of its last three)."""
    half = [s[key] for s in samples[len(samples) // 2:] if key in s]
    if len(half) < 2 or not half[0]:
        return None
    return 100.0 * (statistics.mean(half[-3:]) - half[0]) / half[0]


def run(minutes: float, clients: int, step_ms: int, seed: int = 0,
        drain_s: float = 180.0, keep: str | None = None) -> dict:
    """keep: a folder to leave the stack's logs in (else a temporary one, removed)."""
    with (tempfile.TemporaryDirectory(prefix="kvops-soak-") if keep is None
          else _kept(keep)) as tmp:
        port = free_port()
        redis_proc = start_redis(port, tmp)
        url = f"redis://127.0.0.1:{port}/0"
        stack = Stack(Path(tmp), env={"REDIS_URL": url, "KVOPS_ROUTING": "prefix"})
        try:
            stack.start_web()
            for name in ENGINES:
                stack.start_engine(name, simulate_step_ms=step_ms, **ENGINE)
            stack.start_ops_worker()
            soak = Soak(stack, minutes, seed, step_ms)
            threads = [threading.Thread(target=soak.client, args=(i,), daemon=True)
                       for i in range(clients)]
            threads.append(threading.Thread(target=soak.operator, daemon=True))
            sampler = threading.Thread(target=soak.sampler,
                                       args=(redis.Redis.from_url(url), redis_proc.pid),
                                       daemon=True)
            for t in [*threads, sampler]:
                t.start()
            for t in threads:
                t.join(minutes * 60 + 300)
            sampler.join(SAMPLE_S + 30)
            ran_s = time.monotonic() - soak.t0
            end = soak.settle(drain_s)
            redis_keys = Counter(_pattern(k) for k in redis.Redis.from_url(url).scan_iter())
        finally:
            stack.stop()
            redis_proc.kill()
    jobs = end["jobs"]
    lost = sorted(i for i in soak.job_ids | set(jobs)
                  if jobs.get(i, {}).get("status") not in ("finished", "failed", "cancelled"))
    failed = Counter((j["error"] or "?")[:80] for j in jobs.values() if j["status"] == "failed")
    leaked = {n: p.get("used", 0) + p.get("pinned", 0) for n, p in end["pools"].items()}
    quarters = []
    span = max(ran_s, 1e-9)
    t_start = min((_ts(j["queued_at"]) for j in jobs.values()), default=0.0)
    for q in range(4):
        ttft, e2e = [], []
        for j in jobs.values():
            queued = _ts(j["queued_at"])
            if queued is None or int(4 * (queued - t_start) / span) != q:
                continue
            if j.get("first_token_at"):
                ttft.append(_ts(j["first_token_at"]) - queued)
            if j["status"] == "finished" and j.get("finished_at"):
                e2e.append(_ts(j["finished_at"]) - queued)
        quarters.append({"quarter": q + 1, "jobs": len(e2e), "ttft_p50": _pct(ttft, 0.5),
                         "ttft_p99": _pct(ttft, 0.99), "e2e_p50": _pct(e2e, 0.5),
                         "e2e_p99": _pct(e2e, 0.99)})
    keys = [k for k in soak.samples[0] if k != "t"] if soak.samples else []
    return {"minutes": minutes, "clients": clients, "step_ms": step_ms, "ran_s": ran_s,
            "jobs": len(jobs), "by_status": Counter(j["status"] for j in jobs.values()),
            "lost": lost, "cut_short": soak.cut_short, "failed": failed,
            "client_errors": soak.client_errors, "calls": soak.calls, "actions": soak.actions,
            "pools": end["pools"], "leaked": leaked, "quarters": quarters,
            "samples": soak.samples, "redis_keys": redis_keys,
            "growth": {k: growth(soak.samples, k) for k in keys}}


class _kept:
    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> str:
        Path(self.path).mkdir(parents=True, exist_ok=True)
        Path(self.path).chmod(0o700)  # (it holds the stack's database and secret key)
        return self.path

    def __exit__(self, *exc) -> None:
        pass


def _pattern(key: bytes) -> str:
    """A Redis key with its numbers and ids folded: kvops:job:12 -> kvops:job:#."""
    parts = key.decode(errors="replace").split(":")
    return ":".join("#" if any(c.isdigit() for c in p) and len(p) > 2 else p for p in parts)


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report(r: dict) -> str:
    lines = [f"soak: {r['minutes']:g} min ({r['ran_s']:.0f} s) of mixed traffic from "
             f"{r['clients']} clients, 2 simulated engines at {r['step_ms']} ms a step",
             f"jobs {r['jobs']}: {dict(r['by_status'])}; calls {dict(r['calls'])}",
             f"operator actions: {dict(r['actions'])}",
             f"jobs lost: {len(r['lost'])}{' ' + str(r['lost'][:10]) if r['lost'] else ''}; "
             f"answers cut short: {r['cut_short']}",
             f"blocks leaked (used or pinned once idle): {r['leaked']}",
             f"jobs failed by cause: {dict(r['failed']) or 'none'}",
             f"client errors: {dict(r['client_errors']) or 'none'}",
             f"Redis keys at the end by pattern: {dict(r['redis_keys'].most_common(12))}", ""]
    lines.append(format_table(
        ["quarter", "jobs", "TTFT p50 s", "TTFT p99 s", "e2e p50 s", "e2e p99 s"],
        [[str(q["quarter"]), str(q["jobs"]), _f(q["ttft_p50"], 3), _f(q["ttft_p99"], 3),
          _f(q["e2e_p50"]), _f(q["e2e_p99"])] for q in r["quarters"]]))
    samples = r["samples"]
    if samples:
        keys = [k for k in samples[0] if k != "t"]
        picks = [samples[min(len(samples) - 1, round(i * (len(samples) - 1) / 4))]
                 for i in range(5)]
        lines += ["", "memory (MiB, RSS) and Redis over the run; growth over its last half:"]
        lines.append(format_table(
            ["", *[f"{s['t'] / 60:.1f} min" for s in picks], "last half"],
            [[k, *[_f(s.get(k), 0 if k == "redis keys" else 1) for s in picks],
              _f(r["growth"][k], 1) + " %" if r["growth"][k] is not None else "-"]
             for k in keys]))
    return "\n".join(lines)


def ok(r: dict) -> bool:
    return not r["lost"] and not r["cut_short"] and not any(r["leaked"].values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--step-ms", type=int, default=10, help="the simulated step (GPU pace)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the whole result here")
    p.add_argument("--keep", help="leave the stack's folder (its logs) here")
    args = p.parse_args(argv)
    r = run(args.minutes, args.clients, args.step_ms, args.seed, keep=args.keep)
    print(report(r))
    if args.json:
        Path(args.json).write_text(json.dumps(r, default=str, indent=1))
    print("OK: nothing lost, nothing leaked" if ok(r) else "NOT OK")
    return 0 if ok(r) else 1


if __name__ == "__main__":
    sys.exit(main())
