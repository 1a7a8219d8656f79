"""Decode steps at padded batch sizes, replayed as CUDA graphs.

A pure decode step (every scheduled request computes one token and none asks for
prompt logprobs) of n sequences runs at the smallest size >= n: its inputs go into
the graphs' own step buffers (engine/model/step_buffers.py), padded
(InputBatch.prepare's pad_to), and the graph captured at start-up for that size
replays the whole forward pass: one launch from the host instead of a few hundred.
Prefill and mixed steps, and decodes of more sequences than the largest size, run
eagerly.

Sizes: 1, 2, 4, 8, then every 16 up to max_num_seqs (and max_num_seqs itself), as vLLM
and nano-vllm pick them. They are captured largest first into one memory pool, so a
smaller graph's activations reuse the largest's memory, which the KV pool's sizing
counted before the pool was allocated (kv_pools.device_blocks, decode_graphs).

A graph's attention is planned for max_model_len (its KV splits are fixed at capture;
a split past a sequence's context is empty and costs little: kernels/paged_attention.py)
from the buffers' fixed views, so nothing in it depends on the step but the buffers'
contents.

Where no graph can be captured (a CPU, with the Triton interpreter), the same padded
inputs run eagerly (capture=False): the path a graph replays, testable without a GPU.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable

import torch

from engine.model.input_batch import InputBatch, StepBatch
from engine.model.step_buffers import StepBuffers
from engine.sched.output import SchedulerOutput

# the forward pass: a step's batch -> float32 logits of its logits rows
Forward = Callable[[StepBatch], torch.Tensor]


def decode_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes a decode step may run at, ascending."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += range(16, max_num_seqs + 1, 16)
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def why_eager(attention: str, ops: str, tensor_parallel: bool,
              num_groups: int, moe: bool, enforce_eager: bool) -> str | None:
    """Why this engine's decode steps run without graphs (None: they use them)."""
    if enforce_eager:
        return "enforce_eager"
    if attention != "triton" or ops != "triton":
        return "the torch backend plans attention on the host"
    if tensor_parallel:
        return "a model split over ranks"
    if num_groups > 1:
        return "a block table per layer group"
    if moe:
        return "the experts' kernel reads the routing on the host"
    return None  # (on a CPU: the padded path, run eagerly; see the module's docstring)


class DecodeGraphs:
    def __init__(self, input_batch: InputBatch, sizes: list[int], max_model_len: int,
                 device: torch.device, capture: bool) -> None:
        """capture: record a CUDA graph per size (capture_all); False: run the padded
        inputs eagerly."""
        self.input_batch = input_batch
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.capture = capture
        largest = sizes[-1]
        self.buffers = StepBuffers(largest, largest, input_batch.max_blocks, device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps: Counter[int] = Counter()  # padded size -> decode steps run at it
        self.capture_s = 0.0
        self.pool_bytes = 0

    def size_for(self, out: SchedulerOutput) -> int | None:
        """The padded size this step runs at; None: eagerly, as it is."""
        n = len(out.scheduled)
        if not n or n > self.sizes[-1]:
            return None
        for s in out.scheduled:  # (a one-token prompt chunk that does not sample: eager)
            if s.num_new_tokens != 1 or not s.samples \
                    or s.request.sampling_params.prompt_logprobs is not None:
                return None
        for size in self.sizes:
            if size >= n:
                return size
        return None

    def prepare(self, out: SchedulerOutput, size: int) -> StepBatch:
        return self.input_batch.prepare(out, self.buffers, pad_to=size,
                                        plan_seq_len=self.max_model_len)

    def run(self, batch: StepBatch, size: int, forward: Forward) -> torch.Tensor:
        """The logits of a padded step's real rows: the graph of its size replayed (its
        inputs are already in the buffers), or the forward pass run on them."""
        self.steps[size] += 1
        n = len(batch.sampling_ids)
        if not self.capture:
            return forward(batch)[:n]
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:n]

    @torch.inference_mode()
    def capture_all(self, forward: Forward) -> None:
        """One graph per size, largest first, into one memory pool; a progress line and
        the time and memory it took on stderr."""
        if not self.capture:
            return
        device = self.buffers.dev.device
        _log(f"kvops: capturing CUDA graphs for decode steps at {len(self.sizes)} batch "
             f"sizes ({self.sizes[0]}..{self.sizes[-1]})")
        began, before = time.monotonic(), torch.cuda.memory_reserved(device)
        pool = None
        torch.cuda.synchronize(device)
        for size in reversed(self.sizes):
            batch = self.static_batch(size)
            forward(batch)  # warm-up: every kernel compiled and its plan cached
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward(batch)
            pool = graph.pool() if pool is None else pool
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(device)
        self.capture_s = time.monotonic() - began
        self.pool_bytes = torch.cuda.memory_reserved(device) - before
        _log(f"kvops: captured {len(self._graphs)} decode graphs in {self.capture_s:.1f} s "
             f"({self.pool_bytes / 1024 ** 2:.0f} MiB)")

    def static_batch(self, size: int) -> StepBatch:
        """A decode batch of `size` sequences over the buffers' fixed views, all of them
        padding (InputBatch.prepare's: a step that stores nothing and reads block 0 for
        a context of one): what a graph is captured on."""
        return self.prepare(SchedulerOutput(), size)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
