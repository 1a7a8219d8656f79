"""ModelRunner: a real Llama-family model behind the Runner interface.

Start-up: resolve device and dtype, load the HF folder (weights, tokenizer), size the
KV pools, allocate them. Each step: turn the SchedulerOutput into one varlen batch
(input_ids, positions, slot_mapping, block tables, seq_lens, query_start_loc), run the
model with logits only for the rows that sample, and sample.
"""
from __future__ import annotations

import os
import sys
import warnings
import zlib
from pathlib import Path

import torch

import kernels

from engine.model.attention import AttentionBatch, make_attention_backend
from engine.config import EngineConfig
from engine.text.tokenizer import HFTokenizer
from engine.kv.layout import block_bytes, kv_layout
from engine.errors import ModelLoadError
from engine.model.loader import (ModelFolder, load_model, model_identity,
                           read_model_folder)
from engine.model.runner import Runner, StepResult, block_count, frame_header
from engine.model.sampler import logprobs_of, sample, token_logprobs
from engine.sched.output import SchedulerOutput
from engine.model import parallel
from engine.model.input_batch import InputBatch, RankBatch, StepBatch
from engine.model.ops import TorchOps
from engine.model.ops_cpu import cpu_kernel_ops, tune_process
from engine.model.ops_triton import TritonOps
from kernels import cpu_ext
from kernels._checks import as_bits
from kernels.fp8 import cache_dtype, is_fp8

DEFAULT_CPU_KV_BYTES = 512 * 1024 ** 2
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner(Runner):
    def __init__(self, config: EngineConfig, rank: int = 0, tp_address: str | None = None) -> None:
        """rank, tp_address: a tensor-parallel rank other than 0 (engine/model/parallel.py
        starts them); rank 0 is the engine's own runner and starts the others."""
        self.config = config
        self.block_size = config.block_size
        self._device = resolve_device(config.device)
        self._dtype = resolve_dtype(config.dtype, self._device)
        # the K/V cache's: the model's, or fp8 (kernels/fp8.py)
        self._kv_dtype = resolve_kv_dtype(config, self._device, self._dtype)
        if self._device.type == "cpu":
            tune_process()
        self.device, self.dtype = self._device.type, str(self._dtype).removeprefix("torch.")

        folder = read_model_folder(resolve_model_path(config.model))
        self.tp, self._rank_procs = None, []
        if config.tensor_parallel_size > 1:
            parallel.check_divisible(folder.args, config.tensor_parallel_size)
            if rank == 0:
                self._rank_procs, tp_address = parallel.start_ranks(
                    config, config.tensor_parallel_size, serve_rank)
            if self._device.type == "cuda":
                self._device = torch.device("cuda", rank)
            self.tp = parallel.init(rank, config.tensor_parallel_size, tp_address, self._device)
        self.folder = folder
        self.model_path = str(folder.path)  # where the tokenizer is read from (describe_config)
        self.model_id = model_identity(folder, self._dtype)
        self.tokenizer = HFTokenizer.from_folder(folder.path, folder.eos_token_ids)
        self.vocab_size = folder.args.vocab_size
        self.max_model_len = _max_model_len(config, folder)
        # Which layers' K/V a block holds: all, or a layer group's (engine/kv/layout.py)
        self.kv_layout = kv_layout(folder.args.layer_windows, folder.args.n_layers,
                                   hybrid=config.hybrid_kv_cache and not config.cpu_prefix_cache
                                   and not config.disk_cache_dir)
        hybrid = self.kv_layout.num_groups > 1
        self.kv_group_windows = self.kv_layout.windows if hybrid else None
        # every layer slides: blocks older than the widest window can go back to the pool
        self.sliding_window = None if hybrid else self.kv_layout.windows[0]
        self.model = load_model(folder, self._dtype, self._device, self.tp)
        self.model.set_kv_layout(self.kv_layout)
        self.model.setup_rope(self.max_model_len)
        self.attention = make_attention_backend(config.attention_backend, self._device,
                                                self._kv_dtype,
                                                cpu_kernels=cpu_ext.wanted(config.cpu_kernels))
        # how the model's arithmetic runs: the C++ CPU kernels or plain torch
        self.ops = choose_ops(config, self._device, self._dtype, self.attention)
        self.ops.prepare(self.model)
        self.cpu_kernels = self.ops.name == "cpu-kernels"

        args = self.model.args  # (this rank's share of the heads)
        # One block: K and V of every layer, or of one layer group's (this rank's heads).
        self._copy_stream = None  # CUDA: the CPU tier's copies ahead of need (copy_ahead)
        self._copy_ahead_done = None  # an event the next step's work waits for
        slots = self.kv_layout.slots
        self.block_bytes = block_bytes(self.kv_layout, self.block_size, args.n_kv_heads,
                                       args.head_dim, self._kv_dtype.itemsize)
        self.num_gpu_blocks = config.num_gpu_blocks or self._blocks_from_memory()
        self.num_cpu_blocks = (self._default_cpu_blocks() if config.num_cpu_blocks is None
                               else config.num_cpu_blocks)
        if self.tp is not None:  # every rank takes rank 0's pool sizes: one block table
            self.num_gpu_blocks, self.num_cpu_blocks = self.tp.broadcast(
                (self.num_gpu_blocks, self.num_cpu_blocks))
        shape = (slots, 2, self.block_size, args.n_kv_heads, args.head_dim)
        self.kv_cache = torch.zeros(_with_blocks(shape, self.num_gpu_blocks), dtype=self._kv_dtype,
                                    device=self._device)
        self.cpu_cache = torch.zeros(_with_blocks(shape, self.num_cpu_blocks), dtype=self._kv_dtype,
                                     pin_memory=self._device.type == "cuda")
        # each step's forward inputs, from the scheduler's output
        self.input_batch = InputBatch(self.block_size, self._device, config.seed,
                                      self.kv_layout.num_groups)
        # an fp8 cache's scales, [n_layers, 2, n_kv_heads] (None: the model's dtype)
        self.kv_scales = self._kv_scales() if is_fp8(self._kv_dtype) else None
        # how a block's bytes read: blocks move (disk tier, migration) only between
        # engines whose K/V reads alike (dtype, and an fp8 cache's scales)
        self.kv_format = kv_format_of(self._kv_dtype, config.kv_cache_scales, self.kv_scales)
        self._log(f"kvops: {folder.path.name} on {self.device} ({self.dtype}), attention "
                  f"{self.attention.name}; KV block = {slots} layers x 2 x "
                  f"{self.block_size} tokens x {args.n_kv_heads} kv heads x {args.head_dim} x "
                  f"{self._kv_dtype.itemsize} B ({self.kv_format}) = "
                  f"{self.block_bytes / 1024:.0f} KiB; "
                  f"{self.num_gpu_blocks} device blocks "
                  f"({self.num_gpu_blocks * self.block_bytes / 1024 ** 2:.0f} MiB, "
                  f"{self.num_gpu_blocks * self.block_size} tokens), "
                  f"{self.num_cpu_blocks} host swap blocks; max_model_len {self.max_model_len}; "
                  f"ops {self.ops.name}; C++ CPU kernels "
                  f"{self.ops.describe() if self.cpu_kernels else 'off'}"
                  + (f"; layer groups (sliding window per group) {list(self.kv_group_windows)}"
                     if hybrid else "")
                  + (f"; tensor-parallel rank {self.tp.rank} of {self.tp.size}" if self.tp else ""))
        weight_bytes = self.ops.own_bytes() + sum(  # (tied weights once)
            t.numel() * t.element_size()
            for t in {id(t): t for t in self.model.state_dict().values()}.values())
        mine = {"rank": rank, "device": str(self._device), "weight_bytes": weight_bytes,
                "kv_bytes": self.kv_cache.numel() * self.kv_cache.element_size(),
                "swap_bytes": self.cpu_cache.numel() * self.cpu_cache.element_size()}
        # each rank's memory, for the dashboard (describe_config)
        self.rank_memory = self.tp.all_gather_object(mine) if self.tp else [mine]

    @property
    def tensor_parallel_size(self) -> int:
        return self.tp.size if self.tp else 1

    # --- tensor parallelism -------------------------------------------------------------
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Rank 0 of a split model: the step's block copies and batch go to every rank
        first, then all run them together."""
        if self.tp is None:
            self._wait_copy_ahead()
            return super().execute(out)
        batch = self.input_batch.prepare(out) if out.scheduled else None
        swap_out = out.swap_out + out.copy_ahead  # (a split model copies ahead in line)
        self.tp.broadcast(("step", swap_out, out.swap_in, out.copies,
                           batch.for_ranks() if batch else None))
        self._swap_out(swap_out)
        self._swap_in(out.swap_in)
        self._copy_blocks(out.copies)
        return self._forward_batch(batch) if batch else StepResult()

    def serve_rank(self) -> None:
        """A rank other than 0: run what rank 0 broadcasts until it says stop."""
        while True:
            message = self.tp.broadcast()
            if message[0] == "stop":
                break
            _, swap_out, swap_in, copies, batch = message
            self._swap_out(swap_out)
            self._swap_in(swap_in)
            self._copy_blocks(copies)
            if batch is not None:
                self._run_model(batch.to(self._device))
        parallel.shutdown(self.tp, [])

    def close(self) -> None:
        """Stop the other ranks (a split model); nothing to do otherwise."""
        if self.tp is not None and self.tp.rank == 0:
            parallel.shutdown(self.tp, self._rank_procs)
            self.tp, self._rank_procs = None, []

    # --- one step ---------------------------------------------------------------------
    def forward(self, out: SchedulerOutput) -> StepResult:
        return self._forward_batch(self.input_batch.prepare(out))

    @torch.inference_mode()
    def _run_model(self, batch: "StepBatch | RankBatch") -> torch.Tensor:
        plan = self.attention.plan
        plans = ([plan(a) for a in batch.groups] if batch.groups
                 else plan(batch.attention))
        return self.model(batch.input_ids, batch.positions, self.kv_cache, self.attention,
                          plans, batch.logits_indices, self.ops, kv_scales=self.kv_scales)

    @torch.inference_mode()
    def _forward_batch(self, batch: "StepBatch") -> StepResult:
        logits = self._run_model(batch)
        num_sampled = len(batch.sampling_rows)
        result = StepResult()
        if batch.prompt_rows:
            result.prompt_logprobs = self._prompt_logprobs(logits[num_sampled:],
                                                           batch.prompt_rows)
            logits = logits[:num_sampled]
        tokens = sample(logits, batch.sampling_rows)
        for i, entry in token_logprobs(logits, batch.sampling_rows, tokens).items():
            result.logprobs[batch.sampling_ids[i]] = entry
        result.tokens = dict(zip(batch.sampling_ids, tokens))
        return result

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, rows: list[tuple]) -> dict[str, list]:
        """Log-probabilities of prompt tokens: each row (request id, position, the next
        prompt token, k) scores the token that follows its position."""
        entries = logprobs_of(logits, [r[2] for r in rows], [r[3] for r in rows])
        out: dict[str, list] = {}
        for (request_id, position, _, _), entry in zip(rows, entries):
            out.setdefault(request_id, []).append((position, *entry))
        return out

    # --- block copies -------------------------------------------------------------------
    # (An operator's swap between steps comes here directly: a split model's other ranks
    # are told first. Within a step, execute sends them the copies with the batch.)
    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        self._wait_copy_ahead()
        self._tell_ranks(mapping, [], [])
        self._swap_out(mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        self._wait_copy_ahead()
        self._tell_ranks([], mapping, [])
        self._swap_in(mapping)

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        self._wait_copy_ahead()
        self._tell_ranks([], [], mapping)
        self._copy_blocks(mapping)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[layers, 2, n, block_size, kv heads, head dim] on the host (from a GPU, through
        a pinned buffer: the copy runs at the link's full speed, and its pages are not
        moved under the network send that reads them)."""
        self._single_rank("move a request's blocks")
        self._wait_copy_ahead()
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        picked = self.kv_cache.index_select(2, index)
        if picked.device.type != "cuda":
            return picked
        host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
        host.copy_(picked, non_blocking=True)
        torch.cuda.current_stream(picked.device).synchronize()
        return host

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self._single_rank("move a request's blocks")
        self._wait_copy_ahead()
        if data.shape[2] != len(block_ids) or data.shape[:2] != self.kv_cache.shape[:2] or \
                data.shape[3:] != self.kv_cache.shape[3:]:
            raise ValueError(f"blocks of shape {tuple(data.shape)} do not fit this engine's "
                             f"cache {tuple(self.kv_cache.shape)}")
        if data.dtype != self.kv_cache.dtype:
            raise ValueError(f"blocks of {data.dtype} do not fit this engine's "
                             f"{self.kv_cache.dtype} cache")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        as_bits(self.kv_cache).index_copy_(2, index, as_bits(data).to(self.kv_cache.device))

    def read_pool_block(self, pool: str, block_id: int) -> bytes:
        """[layers, 2, block_size, kv heads, head dim] of a block of the CPU or the GPU
        pool, as bytes (after every copy into the pool under way has landed)."""
        self._single_rank("keep a disk tier")
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        block = self._pool(pool)[:, :, block_id].contiguous()
        return block.view(torch.uint8).cpu().numpy().tobytes()

    def write_pool_block(self, pool: str, block_id: int, data: bytes) -> None:
        self._single_rank("keep a disk tier")
        target = self._pool(pool)[:, :, block_id]
        if len(data) != target.numel() * target.element_size():
            raise ValueError(f"a block of {len(data)} bytes; this engine's hold "
                             f"{target.numel() * target.element_size()}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            source = torch.frombuffer(data, dtype=torch.uint8)
        as_bits(target).copy_(source.view(as_bits(target).dtype).view(target.shape)
                              .to(target.device))

    def _pool(self, pool: str) -> torch.Tensor:
        return {"gpu": self.kv_cache, "cpu": self.cpu_cache}[pool]

    @staticmethod
    def num_blocks_in(data: torch.Tensor) -> int:
        return data.shape[2]

    @staticmethod
    def blocks_between(data: torch.Tensor, start: int, end: int) -> torch.Tensor:
        return data[:, :, start:end]

    @staticmethod
    def blocks_to_frames(data: torch.Tensor) -> tuple[dict, list]:
        """The tensor's bytes as one frame (its own memory, no copy), its shape and dtype
        in the header."""
        data = data.contiguous()
        return ({"kind": "tensor", "shape": list(data.shape),
                 "dtype": str(data.dtype).removeprefix("torch.")},
                [data.view(torch.uint8).numpy().data if data.numel() else b""])

    def blocks_from_frames(self, header: object, frames: list, most: int) -> torch.Tensor:
        """At most `most` blocks of this cache's layout and dtype; the header and the
        frame's size are checked against them before anything is decoded (ValueError)."""
        expected = list(self.kv_cache.shape)
        shape = frame_header(header, "tensor").get("shape")
        if not isinstance(shape, list) or len(shape) != len(expected):
            raise ValueError(f"blocks of shape {shape!r} do not fit this engine's cache "
                             f"{tuple(expected)}")
        n = block_count(shape[2], most)
        if shape[:2] != expected[:2] or shape[3:] != expected[3:]:
            raise ValueError(f"blocks of shape {shape} do not fit this engine's cache "
                             f"{tuple(expected)}")
        dtype = self.kv_cache.dtype
        if header.get("dtype") != str(dtype).removeprefix("torch."):
            raise ValueError(f"blocks of {header.get('dtype')!r} do not fit this engine's "
                             f"{dtype} cache")
        size = n * self.kv_cache[:, :, :1].numel() * self.kv_cache.element_size()
        if len(frames) != 1 or memoryview(frames[0]).nbytes != size:
            raise ValueError(f"{n} blocks declared, not the bytes of {n} blocks")
        if not size:
            return torch.empty(shape, dtype=dtype)
        # A view of the received frame (no copy), which lives as long as the tensor; it is
        # only read (write_blocks copies it into the cache), so that it is read-only
        # does not matter.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(frames[0], dtype=torch.uint8)
        return flat.view(dtype).view(shape)

    def _single_rank(self, what: str) -> None:
        if getattr(self, "tensor_parallel_size", 1) > 1:
            raise NotImplementedError(f"cannot {what} of a model split over ranks yet")

    def copy_ahead(self, mapping: list[tuple[int, int]]) -> None:
        """On CUDA, on a copy stream of its own, beside the forward pass: it starts once
        this step's copies are done (a swap-in may read a CPU block it overwrites), and
        the next step, or an operator's copy between steps, waits for it (they may reuse
        its GPU blocks or CPU blocks). Elsewhere, now."""
        if not mapping:
            return
        if self._device.type != "cuda":
            self._swap_out(mapping)
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self._device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._copy_stream):
            kernels.swap_blocks(self.kv_cache, self.cpu_cache, torch.tensor(mapping))
            self._copy_ahead_done = torch.cuda.Event()
            self._copy_ahead_done.record(self._copy_stream)

    def _wait_copy_ahead(self) -> None:
        if self._copy_ahead_done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._copy_ahead_done)
            self._copy_ahead_done = None

    def _tell_ranks(self, swap_out: list, swap_in: list, copies: list) -> None:
        if self.tp is not None and self.tp.rank == 0 and (swap_out or swap_in or copies):
            self.tp.broadcast(("step", swap_out, swap_in, copies, None))

    def _swap_out(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            kernels.swap_blocks(self.kv_cache, self.cpu_cache, torch.tensor(mapping))

    def _swap_in(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            kernels.swap_blocks(self.cpu_cache, self.kv_cache, torch.tensor(mapping))

    def _copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        if not mapping:
            return
        sources, dests = {a for a, _ in mapping}, {b for _, b in mapping}
        # The Triton kernel needs CUDA and no block both read and written.
        if self.attention.name == "triton" and self._device.type == "cuda" and not sources & dests:
            kernels.copy_blocks(self.kv_cache, torch.tensor(mapping))
        else:
            _copy_blocks(self.kv_cache, self.kv_cache, mapping)

    # --- sizing -----------------------------------------------------------------------
    def _blocks_from_memory(self) -> int:
        if self._device.type == "cuda":
            budget = self._cuda_kv_budget()
            source = f"gpu_memory_utilization={self.config.gpu_memory_utilization}"
        else:
            budget = self.config.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
            source = ("kv_cache_memory_bytes" if self.config.kv_cache_memory_bytes
                      else "the CPU default")
        num_blocks = budget // self.block_bytes
        self._log(f"kvops: KV pool from {source}: {budget / 1024 ** 2:.0f} MiB / "
                  f"{self.block_bytes} B per block = {num_blocks} blocks")
        if num_blocks < 1:
            raise ModelLoadError(
                f"no memory left for the KV cache ({budget} B for {self.block_bytes} B blocks); "
                "lower max_num_batched_tokens, raise gpu_memory_utilization or set num_gpu_blocks")
        return int(num_blocks)

    def _default_cpu_blocks(self) -> int:
        """Half the device pool, but on a GPU no more than a quarter of the host's free
        memory: the swap pool is pinned, and a big GPU's half would not fit."""
        blocks = self.num_gpu_blocks // 2
        if self._device.type == "cuda":
            free_host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            blocks = min(blocks, free_host // 4 // self.block_bytes)
        return int(blocks)

    def _cuda_kv_budget(self) -> int:
        """Device memory the KV pool may take: gpu_memory_utilization of the device,
        minus what the weights and the activations of a full-budget step use (measured
        with one forward pass over max_num_batched_tokens tokens)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self._device)
        self._profile_forward()
        peak = torch.cuda.max_memory_allocated(self._device)
        total = torch.cuda.get_device_properties(self._device).total_memory
        free, _ = torch.cuda.mem_get_info(self._device)
        other = total - free - torch.cuda.memory_reserved(self._device)  # other processes
        budget = int(total * self.config.gpu_memory_utilization) - peak - max(other, 0)
        self._log(f"kvops: device memory {total / 1024 ** 3:.1f} GiB x "
                  f"{self.config.gpu_memory_utilization} - peak {peak / 1024 ** 3:.2f} GiB "
                  f"(weights + activations) - {max(other, 0) / 1024 ** 3:.2f} GiB used elsewhere "
                  f"= {budget / 1024 ** 3:.2f} GiB for KV")
        return budget

    @torch.inference_mode()
    def _profile_forward(self) -> None:
        """One forward pass of max_num_batched_tokens tokens in sequences of at most
        max_model_len, against a scratch cache just big enough."""
        num_tokens = min(self.config.max_num_batched_tokens, self.max_model_len * self.config.max_num_seqs)
        seq_len = min(num_tokens, self.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
        self._scratch_forward([[0] * n for n in lens], self.attention)
        torch.cuda.synchronize(self._device)

    @torch.inference_mode()
    def _kv_scales(self) -> torch.Tensor:
        """An fp8 cache's scales ([n_layers, 2, n_kv_heads] float32): 1 ("unit", as vLLM
        without scales in the checkpoint), or calibrated once at start-up on a fixed text
        (kernels/fp8.CALIBRATION_TEXT, and seeded tokens spread over the vocabulary):
        the largest |K| and |V| each layer writes, per
        layer ("tensor") or per KV head ("head"), fitted into the format with 2x
        headroom, as powers of two. The same model and dtype get the same scales at
        every start (a disk tier written before a restart reads back alike)."""
        from kernels.fp8 import CALIBRATION_TEXT, scales_for

        if self.config.kv_cache_scales == "unit":
            return self._unit_scales()
        # the text, and tokens spread over the vocabulary (a model whose tokenizer reads
        # the text as unknown words still sees its real embeddings)
        text = self.tokenizer.encode(CALIBRATION_TEXT)[:self.max_model_len]
        spread = torch.randint(self.vocab_size, (min(256, self.max_model_len),),
                               generator=torch.Generator().manual_seed(0)).tolist()
        recorder = _AmaxRecorder(self.attention)
        # through a cache of the model's dtype: each layer sees the K/V the model makes,
        # not what an fp8 cache at scale 1 would have clamped or flushed
        self._scratch_forward([text, spread], recorder, cache_dtype=self._dtype)
        amax = torch.stack(recorder.amax)  # [n_layers, 2, n_kv_heads]
        if self.config.kv_cache_scales == "tensor":
            amax = amax.amax(dim=-1, keepdim=True).expand_as(amax)
        return scales_for(amax, self._kv_dtype).contiguous()

    def _unit_scales(self) -> torch.Tensor:
        """Scales of 1 for every layer's K and V, per KV head (this rank's)."""
        args = self.model.args
        return torch.ones(args.n_layers, 2, args.n_kv_heads, device=self._device)

    def _scratch_forward(self, sequences: list[list[int]], backend: object,
                         cache_dtype: torch.dtype | None = None) -> None:
        """A forward pass of fresh sequences (token ids) against a scratch cache just big
        enough (of cache_dtype: the K/V cache's by default), through `backend` (this
        rank's share of the heads, a split model's)."""
        args, bs, dev = self.model.args, self.block_size, self._device
        tables, slots, positions, qsl, next_block = [], [], [], [0], 0
        for seq in sequences:
            n = len(seq)
            nb = -(-n // bs)
            tables.append(list(range(next_block, next_block + nb)))
            slots.extend(range(next_block * bs, next_block * bs + n))
            positions.extend(range(n))
            qsl.append(qsl[-1] + n)
            next_block += nb
        cache_dtype = cache_dtype or self._kv_dtype
        cache = torch.zeros(_with_blocks((self.kv_layout.slots, 2, bs, args.n_kv_heads,
                                          args.head_dim), next_block),
                            dtype=cache_dtype, device=dev)
        kv_scales = self._unit_scales() if is_fp8(cache_dtype) else None
        lens = [len(seq) for seq in sequences]
        batch = AttentionBatch(bs, tables, lens, qsl, torch.tensor(slots, device=dev))
        plan = backend.plan(batch)  # (every layer group in the same blocks)
        self.model(torch.tensor([t for seq in sequences for t in seq], dtype=torch.int64, device=dev),
                   torch.tensor(positions, device=dev), cache, backend,
                   [plan] * self.kv_layout.num_groups,
                   torch.tensor([q - 1 for q in qsl[1:]], device=dev), self.ops,
                   kv_scales=kv_scales)
        del cache

    @staticmethod
    def _log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)


def _copy_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: list[tuple[int, int]]) -> None:
    """Block src of `src` -> block dst of `dst`, every layer's K and V, in two batched
    ops (gather, then scatter: every source is read before any destination is written)."""
    src_ids = torch.tensor([a for a, _ in mapping], dtype=torch.int64, device=src.device)
    dst_ids = torch.tensor([b for _, b in mapping], dtype=torch.int64, device=dst.device)
    src, dst = as_bits(src), as_bits(dst)  # (bytes: index_copy_ has no fp8 kernel on CPU)
    dst.index_copy_(2, dst_ids, src.index_select(2, src_ids))  # blocks: [L, 2, n, bs, Hkv, D]


def _with_blocks(shape: tuple[int, ...], num_blocks: int) -> tuple[int, ...]:
    """(L, 2, bs, Hkv, D) -> (L, 2, num_blocks, bs, Hkv, D)."""
    return shape[:2] + (num_blocks,) + shape[2:]


def _max_model_len(config: EngineConfig, folder: ModelFolder) -> int:
    limit = folder.args.max_position_embeddings
    if folder.sliding_window is not None:
        limit = min(limit, folder.sliding_window)  # beyond the window we would attend too far
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ModelLoadError(
            f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} "
            "tokens (max_position_embeddings / sliding_window in config.json)")
    return config.max_model_len


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device='cuda' but torch sees no CUDA device; use device='cpu'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA (float16 on GPUs without bf16), float32 on CPU.
    float16 on CPU is refused: CPUs have few fast float16 kernels, so it is slower than
    float32 and less accurate than bfloat16."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if name == "float16" and device.type == "cpu":
        raise ModelLoadError("dtype='float16' is not supported on CPU (slow float16 kernels); "
                             "use 'float32' or 'bfloat16'")
    if name == "bfloat16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ModelLoadError("this GPU has no bfloat16 support; use dtype='float16'")
    return _DTYPES[name]


def resolve_kv_dtype(config: EngineConfig, device: torch.device,
                     model_dtype: torch.dtype) -> torch.dtype:
    """EngineConfig.kv_cache_dtype on this device: "auto" is the model's dtype. fp8 with
    the Triton kernels needs a GPU of compute capability 8.9 or later (Ada, Hopper),
    where Triton has fp8 types."""
    kv_dtype = cache_dtype(config.kv_cache_dtype, model_dtype)
    if is_fp8(kv_dtype) and device.type == "cuda" and config.attention_backend != "torch" \
            and torch.cuda.get_device_capability(device) < (8, 9):
        raise ModelLoadError(
            f"kv_cache_dtype={config.kv_cache_dtype!r} on the Triton kernels needs a GPU of "
            "compute capability 8.9 or later; use attention_backend='torch' (slower) or "
            "kv_cache_dtype='auto'")
    return kv_dtype


def kv_format_of(kv_dtype: torch.dtype, granularity: str, scales: torch.Tensor | None) -> str:
    """The dtype's name; for fp8, with its scales' granularity and a digest of their
    values: fp8 blocks read alike only under the same scales."""
    name = str(kv_dtype).removeprefix("torch.")
    if scales is None:
        return name
    digest = zlib.crc32(scales.detach().cpu().numpy().tobytes())
    return f"{name}/{granularity}:{digest:08x}"


class _AmaxRecorder:
    """An attention backend that notes the largest |K| and |V| (per KV head) of each
    layer it stores, in call order (layer 0 first), and leaves the rest to `inner`."""

    def __init__(self, inner: object) -> None:
        self.inner, self.name = inner, inner.name
        self.amax: list[torch.Tensor] = []

    def plan(self, batch: AttentionBatch) -> object:
        return self.inner.plan(batch)

    def forward(self, q, k, v, kv_layer, plan, scale, window=None, softcap=None, kv_scale=None):
        self.amax.append(torch.stack((k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2)))).float())
        return self.inner.forward(q, k, v, kv_layer, plan, scale, window=window,
                                  softcap=softcap, kv_scale=kv_scale)


def resolve_model_path(model: str | None) -> str | Path:
    """model=None -> the converted default model (make setup creates it)."""
    if model is not None:
        return model
    from engine.model.default_model import default_model_dir

    path = default_model_dir()
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"the default model is not at {path}: run `make setup` (it converts "
            "SmolLM2-135M-Instruct there), or pass EngineConfig(model='path/to/hf-folder')")
    return path


def choose_ops(config, device: torch.device, dtype: torch.dtype, backend) -> TorchOps:
    """The runner's pick, once at start-up: with the Triton attention backend, Triton's
    ops (its fused MoE kernel); for float32 on a CPU, the C++ kernels where they build
    and config.cpu_kernels asks; plain torch otherwise."""
    if backend.name == "triton":
        return TritonOps()
    return cpu_kernel_ops(config, device, dtype, backend) or TorchOps()


def serve_rank(config: EngineConfig, rank: int, size: int, address: str) -> None:
    """A tensor-parallel rank other than 0 (its process's main, engine/model/parallel.py): its
    share of the model, serving rank 0's steps until rank 0 stops."""
    ModelRunner(config, rank=rank, tp_address=address).serve_rank()
