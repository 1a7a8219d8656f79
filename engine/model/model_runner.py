"""ModelRunner: a real Llama-family model behind the Runner interface, composed of one
part per job.

Start-up: resolve device and dtypes (engine/model/device.py), load the HF folder
(weights, tokenizer), size the KV pools and allocate them (kv_pools.py), calibrate an
fp8 cache's scales (fp8_scales.py). Each step: turn the SchedulerOutput into one varlen
batch (input_batch.py: input_ids, positions, slot_mapping, block tables, seq_lens,
query_start_loc), run the model with logits only for the rows that sample, and sample.
Block swaps, copies and moves go through block_io.py. A model split over ranks
(parallel.py): rank 0 sends each step's block copies and batch to the others.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from engine.model.ops.attention import make_attention_backend
from engine.config import EngineConfig
from engine.text.tokenizer import HFTokenizer
from engine.kv.layout import block_bytes, kv_layout
from engine.errors import ModelLoadError
from engine.model.loader import (ModelFolder, load_model, model_identity,
                           read_model_folder)
from engine.model.runner import Flight, Runner, StepResult
from engine.model.sampler import (SamplingRow, accept_tokens, logprobs_of, on_device,
                                  sample_tokens, token_logprobs)
from engine.sampling_params import SamplingParams
from engine.sched.output import SchedulerOutput
from engine.model import kv_pools, parallel
from engine.model.block_io import BlockIO
from engine.model.cuda_graphs import DecodeGraphs, decode_sizes, why_eager
from engine.model.device import choose_ops, resolve_device, resolve_dtype, resolve_kv_dtype
from engine.model.fp8_scales import calibrate, calibration_sequences, kv_format_of, unit_scales
from engine.model.input_batch import InputBatch, RankBatch, StepBatch
from engine.model.ops.cpu_ops import tune_process
from engine.model.scratch_pass import ScratchPass
from kernels import cpu_ext
from kernels.fp8 import is_fp8


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
        slots = self.kv_layout.slots
        self.block_bytes = block_bytes(self.kv_layout, self.block_size, args.n_kv_heads,
                                       args.head_dim, self._kv_dtype.itemsize)
        # a forward pass outside the pools: the sizing's profile, an fp8 cache's calibration
        scratch = ScratchPass(self.model, self.ops, self.kv_layout, self.block_size,
                              self._device, self._kv_dtype)
        # decode steps as CUDA graphs, or why not (engine/model/cuda_graphs.py)
        self.eager_reason = why_eager(self.attention.name, self.ops.name,
                                      config.tensor_parallel_size > 1, self.kv_layout.num_groups,
                                      args.n_experts > 0, config.enforce_eager)
        captures = self.eager_reason is None and self._device.type == "cuda"
        self.num_gpu_blocks = config.num_gpu_blocks or kv_pools.device_blocks(
            config, self._device, self.block_bytes, self.max_model_len,
            lambda sequences: scratch(sequences, self.attention), decode_graphs=captures)
        self.num_cpu_blocks = (
            kv_pools.host_blocks(self.num_gpu_blocks, self._device, self.block_bytes)
            if config.num_cpu_blocks is None else config.num_cpu_blocks)
        if self.tp is not None:  # every rank takes rank 0's pool sizes: one block table
            self.num_gpu_blocks, self.num_cpu_blocks = self.tp.broadcast(
                (self.num_gpu_blocks, self.num_cpu_blocks))
        # the device and the host pool, allocated once and never replaced
        self.kv_cache, self.cpu_cache = kv_pools.allocate(
            (slots, 2, self.block_size, args.n_kv_heads, args.head_dim),
            self.num_gpu_blocks, self.num_cpu_blocks, self._kv_dtype, self._device)
        # their blocks' swaps, copies and moves
        self.block_io = BlockIO(self.kv_cache, self.cpu_cache, self._device,
                                triton_copies=self.attention.name == "triton"
                                and self._device.type == "cuda")
        # each step's forward inputs, from the scheduler's output
        self.input_batch = InputBatch(
            self.block_size, self._device, config.seed, self.kv_layout.num_groups,
            max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            max_seqs=config.max_num_seqs,
            max_blocks=-(-self.max_model_len // self.block_size) + 1,
            device_tables=self.attention.name == "triton")
        self.decode_graphs = None if self.eager_reason else DecodeGraphs(
            self.input_batch, decode_sizes(config.max_num_seqs), self.max_model_len,
            self._device, capture=captures)
        # an fp8 cache's scales, [n_layers, 2, n_kv_heads] (None: the model's dtype)
        self.kv_scales = self._kv_scales(scratch) if is_fp8(self._kv_dtype) else None
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
                  + (f"; tensor-parallel rank {self.tp.rank} of {self.tp.size}" if self.tp else "")
                  + "; decode steps " + (f"eager ({self.eager_reason})" if self.eager_reason
                                          else "as CUDA graphs" if captures
                                          else "padded to graph sizes, eager (no CUDA)"))
        if self.decode_graphs is not None:
            self.decode_graphs.capture_all(self._run_model)
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
            self.block_io.wait_copy_ahead()
            return super().execute(out)
        batch = self.input_batch.prepare(out) if out.scheduled else None
        swap_out = out.swap_out + out.copy_ahead  # (a split model copies ahead in line)
        self.tp.broadcast(parallel.RankStep(swap_out, out.swap_in, out.copies,
                                            batch.for_ranks() if batch else None))
        self.block_io.swap_out(swap_out)
        self.block_io.swap_in(out.swap_in)
        self.block_io.copy_blocks(out.copies)
        return self._forward_batch(batch) if batch else StepResult()

    def serve_rank(self) -> None:
        """A rank other than 0: run what rank 0 broadcasts until it says stop."""
        parallel.serve(self.tp, self._run_rank_step)

    def _run_rank_step(self, step: parallel.RankStep) -> None:
        self.block_io.swap_out(step.swap_out)
        self.block_io.swap_in(step.swap_in)
        self.block_io.copy_blocks(step.copies)
        if step.batch is not None:
            self._run_model(step.batch.to(self._device))

    def close(self) -> None:
        """Stop the other ranks (a split model); nothing to do otherwise."""
        if self.tp is not None and self.tp.rank == 0:
            parallel.shutdown(self.tp, self._rank_procs)
            self.tp, self._rank_procs = None, []

    # --- one step ---------------------------------------------------------------------
    def forward(self, out: SchedulerOutput) -> StepResult:
        flight = self._forward(out, None)
        self.sample(flight)
        return self.collect(flight)

    # --- a step in three parts (async scheduling: engine/llm_engine.py) ------------------
    @property
    def supports_async(self) -> bool:
        return self.tp is None

    def launch(self, out: SchedulerOutput, feed: Flight | None) -> Flight | None:
        self.block_io.wait_copy_ahead()
        self.copy_for(out)
        return self._forward(out, feed) if out.scheduled else None

    def _forward(self, out: SchedulerOutput, feed: Flight | None) -> Flight:
        """The step's inputs and forward pass: padded and replayed as a CUDA graph when
        it is a decode step of a captured size (cuda_graphs.py), eager otherwise."""
        graphs = self.decode_graphs
        size = graphs.size_for(out) if graphs is not None else None
        batch = self.input_batch.prepare(out) if size is None else graphs.prepare(out, size)
        if batch.pending:
            self._take_pending(batch, feed)
        if size is None:
            return Flight(batch, self._run_model(batch))
        return Flight(batch, graphs.run(batch, size, self._run_model), graphed=graphs.capture)

    @staticmethod
    def _take_pending(batch: StepBatch, feed: Flight | None) -> None:
        """The decode inputs sampled by the step before, copied on the device from its
        tokens into the batch's token ids (the host has not read them yet)."""
        if feed is None or feed.tokens is None:
            raise RuntimeError("a decode's input was sampled by a step that is not in flight")
        device = batch.input_ids.device
        rows = on_device([row for row, _ in batch.pending], device)
        index = on_device([feed.index[rid] for _, rid in batch.pending], device)
        batch.input_ids.index_copy_(0, rows, feed.tokens.index_select(0, index))

    @torch.inference_mode()
    def sample(self, flight: Flight) -> None:
        batch = flight.batch
        n = len(batch.sampling_ids)
        row_of = self.input_batch.sampling_row
        # (a request that ended since it was scheduled: any token, dropped)
        flight.rows = rows = [_DROPPED if r.status.is_finished else row_of(r)
                              for r in batch.sampling_requests]
        flight.index = {rid: i for i, rid in enumerate(batch.sampling_ids)}
        if flight.graphed and any(r.params.logprobs is not None for r in rows):
            flight.logits = flight.logits.clone()  # (the graph's output is written again)
        flight.tokens = tokens = sample_tokens(flight.logits[:n], rows)
        if tokens.device.type == "cuda":
            flight.host = torch.empty(n, dtype=tokens.dtype, pin_memory=True)
            flight.host.copy_(tokens, non_blocking=True)
            flight.ready = torch.cuda.Event()
            flight.ready.record()
        else:
            flight.host = tokens

    @torch.inference_mode()
    def collect(self, flight: Flight) -> StepResult:
        if flight.ready is not None:
            flight.ready.synchronize()
        batch, rows, logits = flight.batch, flight.rows, flight.logits
        n = len(batch.sampling_ids)
        tokens = flight.host.tolist()
        accept_tokens(rows, tokens)
        result = StepResult()
        if batch.prompt_rows:
            result.prompt_logprobs = self._prompt_logprobs(logits[n:], batch.prompt_rows)
        for i, entry in token_logprobs(logits[:n], rows, tokens).items():
            result.logprobs[batch.sampling_ids[i]] = entry
        result.tokens = dict(zip(batch.sampling_ids, tokens))
        return result

    @torch.inference_mode()
    def _run_model(self, batch: "StepBatch | RankBatch") -> torch.Tensor:
        plan = self.attention.plan
        plans = ([plan(a) for a in batch.groups] if batch.groups
                 else plan(batch.attention))
        return self.model(batch.input_ids, batch.positions, self.kv_cache, self.attention,
                          plans, batch.logits_indices, self.ops, kv_scales=self.kv_scales)

    def _forward_batch(self, batch: "StepBatch") -> StepResult:
        flight = Flight(batch, self._run_model(batch))
        self.sample(flight)
        return self.collect(flight)

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, rows: list[tuple]) -> dict[str, list]:
        """Log-probabilities of prompt tokens: each row (request id, position, the next
        prompt token, k) scores the token that follows its position."""
        entries = logprobs_of(logits, [r[2] for r in rows], [r[3] for r in rows])
        out: dict[str, list] = {}
        for (request_id, position, _, _), entry in zip(rows, entries):
            out.setdefault(request_id, []).append((position, *entry))
        return out

    # --- block copies (engine/model/block_io.py) ---------------------------------------
    # (An operator's swap between steps comes here directly: a split model's other ranks
    # are told first. Within a step, execute sends them the copies with the batch.)
    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        self.block_io.wait_copy_ahead()
        self._tell_ranks(mapping, [], [])
        self.block_io.swap_out(mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        self.block_io.wait_copy_ahead()
        self._tell_ranks([], mapping, [])
        self.block_io.swap_in(mapping)

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        self.block_io.wait_copy_ahead()
        self._tell_ranks([], [], mapping)
        self.block_io.copy_blocks(mapping)

    def copy_ahead(self, mapping: list[tuple[int, int]]) -> None:
        """On CUDA, beside the forward pass (BlockIO.copy_ahead); elsewhere, now."""
        self.block_io.copy_ahead(mapping)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        self._single_rank("move a request's blocks")
        return self.block_io.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self._single_rank("move a request's blocks")
        self.block_io.write_blocks(block_ids, data)

    # (read_blocks' data is one tensor, [layers, 2, n, block_size, kv heads, head dim])
    num_blocks_in = staticmethod(BlockIO.num_blocks_in)
    blocks_between = staticmethod(BlockIO.blocks_between)
    blocks_to_frames = staticmethod(BlockIO.blocks_to_frames)

    def blocks_from_frames(self, header: object, frames: list, most: int) -> torch.Tensor:
        return self.block_io.blocks_from_frames(header, frames, most)

    def read_pool_block(self, pool: str, block_id: int) -> bytes:
        self._single_rank("keep a disk tier")
        return self.block_io.read_pool_block(pool, block_id)

    def write_pool_block(self, pool: str, block_id: int, data: bytes) -> None:
        self._single_rank("keep a disk tier")
        self.block_io.write_pool_block(pool, block_id, data)

    def _single_rank(self, what: str) -> None:
        if getattr(self, "tensor_parallel_size", 1) > 1:
            raise NotImplementedError(f"cannot {what} of a model split over ranks yet")

    def _tell_ranks(self, swap_out: list, swap_in: list, copies: list) -> None:
        if self.tp is not None and self.tp.rank == 0 and (swap_out or swap_in or copies):
            self.tp.broadcast(parallel.RankStep(swap_out, swap_in, copies))

    @torch.inference_mode()
    def _kv_scales(self, scratch: ScratchPass) -> torch.Tensor:
        """An fp8 cache's scales ([n_layers, 2, n_kv_heads] float32, this rank's heads):
        1, or calibrated once at start-up through `scratch` (engine/model/fp8_scales.py)."""
        if self.config.kv_cache_scales == "unit":
            return unit_scales(self.model.args.n_layers, self.model.args.n_kv_heads,
                               self._device)
        sequences = calibration_sequences(self.tokenizer, self.vocab_size, self.max_model_len)
        return calibrate(self.config.kv_cache_scales, sequences, self.attention, scratch,
                         self._dtype, self._kv_dtype)

    @staticmethod
    def _log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)


# the row of a request that ended after it was scheduled: its token is dropped
_DROPPED = SamplingRow(SamplingParams(temperature=0.0), 0, 0)


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


def serve_rank(config: EngineConfig, rank: int, size: int, address: str) -> None:
    """A tensor-parallel rank other than 0 (its process's main, engine/model/parallel.py): its
    share of the model, serving rank 0's steps until rank 0 stops."""
    ModelRunner(config, rank=rank, tp_address=address).serve_rank()
