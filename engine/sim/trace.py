"""Workload traces for the simulator: when requests arrive and how long they are."""
from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the start of the trace
    prompt_len: int  # tokens, including the shared prefix
    output_len: int  # tokens the request generates
    prefix_group: int | None = None  # requests of one group share their first prefix_len tokens
    prefix_len: int = 0
    tenant: str | None = None  # who asked (Request.tenant: quotas, fairness)

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1 or self.arrival_s < 0:
            raise ValueError(f"bad trace row: {self}")
        if self.prefix_len > self.prompt_len:
            raise ValueError(f"prefix_len > prompt_len in {self}")


def load_trace(path: str | Path) -> list[TraceRequest]:
    """CSV with a header, or JSON lines; columns: arrival_s, prompt_len, output_len,
    and optionally prefix_group, prefix_len, tenant."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = list(csv.DictReader(text.splitlines()))
    out = []
    for row in rows:
        group = row.get("prefix_group")
        out.append(TraceRequest(
            arrival_s=float(row["arrival_s"]), prompt_len=int(row["prompt_len"]),
            output_len=int(row["output_len"]),
            prefix_group=None if group in (None, "") else int(group),
            prefix_len=int(row.get("prefix_len") or 0), tenant=row.get("tenant") or None))
    return sorted(out, key=lambda r: r.arrival_s)


def synthetic_trace(n: int, seed: int = 0, rate_per_s: float = 20.0,
                    prompt_range: tuple[int, int] = (16, 1024),
                    output_range: tuple[int, int] = (16, 512),
                    num_prefix_groups: int = 4, prefix_len: int = 256,
                    shared_fraction: float = 0.5) -> list[TraceRequest]:
    """Poisson arrivals, mixed lengths; a fraction share one of a few system prompts."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate_per_s)
        prompt = rng.randint(*prompt_range)
        group, plen = None, 0
        if num_prefix_groups and rng.random() < shared_fraction:
            group = rng.randrange(num_prefix_groups)
            plen = prefix_len
            prompt = max(prompt, plen + 1)
        out.append(TraceRequest(t, prompt, rng.randint(*output_range), group, plen))
    return out


def prompt_tokens(req: TraceRequest, index: int, vocab_size: int) -> list[int]:
    """Token ids for a trace request: the group's shared prefix, then tokens unique to it."""
    rng = random.Random(index * 7919 + 1)
    prefix = []
    if req.prefix_group is not None:
        grng = random.Random(1_000_003 * (req.prefix_group + 1))
        prefix = [grng.randrange(vocab_size) for _ in range(req.prefix_len)]
    return prefix + [rng.randrange(vocab_size) for _ in range(req.prompt_len - len(prefix))]
