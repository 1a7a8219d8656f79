"""Blocks moved in and out of the KV pools: swaps between the device and the host pool,
copies inside the device pool (copy-on-write), the CPU tier's copies ahead of need, a
request's blocks read and written for a move to another engine (and their frames for
the wire), and single blocks' bytes for the disk tier. Every block holds K and V of
every layer (or of one layer group's), this rank's heads: [slots, 2, block_size, kv
heads, head dim]."""
from __future__ import annotations

import warnings

import torch

import kernels
from engine.model.runner import block_count, frame_header
from kernels._checks import as_bits


class BlockIO:
    """The block copies of one rank's pools. The pools are the runner's (allocated once,
    never replaced); this object owns only the copy stream and its pending event."""

    def __init__(self, kv_cache: torch.Tensor, cpu_cache: torch.Tensor, device: torch.device,
                 triton_copies: bool) -> None:
        """triton_copies: copy-on-write through the Triton kernel (the Triton attention
        backend on CUDA) where no block is both read and written."""
        self.kv_cache = kv_cache  # the device pool
        self.cpu_cache = cpu_cache  # the host pool (pinned on CUDA)
        self.device = device
        self.triton_copies = triton_copies
        self.copy_stream = None  # CUDA: the CPU tier's copies ahead of need (copy_ahead)
        self._copy_ahead_done = None  # an event the next step's work waits for

    # --- swaps and copies ---------------------------------------------------------------
    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block) pairs, device pool -> host pool."""
        if mapping:
            kernels.swap_blocks(self.kv_cache, self.cpu_cache, torch.tensor(mapping))

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block) pairs, host pool -> device pool."""
        if mapping:
            kernels.swap_blocks(self.cpu_cache, self.kv_cache, torch.tensor(mapping))

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """(src, dst) pairs inside the device pool."""
        if not mapping:
            return
        sources, dests = {a for a, _ in mapping}, {b for _, b in mapping}
        # The Triton kernel needs CUDA and no block both read and written.
        if self.triton_copies and not sources & dests:
            kernels.copy_blocks(self.kv_cache, torch.tensor(mapping))
        else:
            _copy_blocks(self.kv_cache, self.kv_cache, mapping)

    def copy_ahead(self, mapping: list[tuple[int, int]]) -> None:
        """On CUDA, on a copy stream of its own, beside the forward pass: it starts once
        this step's copies are done (a swap-in may read a CPU block it overwrites), and
        the next step, or an operator's copy between steps, waits for it (they may reuse
        its GPU blocks or CPU blocks): wait_copy_ahead. Elsewhere, now."""
        if not mapping:
            return
        if self.device.type != "cuda":
            self.swap_out(mapping)
            return
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(self.device)
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            kernels.swap_blocks(self.kv_cache, self.cpu_cache, torch.tensor(mapping))
            self._copy_ahead_done = torch.cuda.Event()
            self._copy_ahead_done.record(self.copy_stream)

    def wait_copy_ahead(self) -> None:
        """The device's work from now on waits for the copies ahead under way."""
        if self._copy_ahead_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copy_ahead_done)
            self._copy_ahead_done = None

    # --- a request's blocks, for a move to another engine -------------------------------
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[layers, 2, n, block_size, kv heads, head dim] on the host (from a GPU, through
        a pinned buffer: the copy runs at the link's full speed, and its pages are not
        moved under the network send that reads them)."""
        self.wait_copy_ahead()
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        picked = self.kv_cache.index_select(2, index)
        if picked.device.type != "cuda":
            return picked
        host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
        host.copy_(picked, non_blocking=True)
        torch.cuda.current_stream(picked.device).synchronize()
        return host

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """read_blocks' data (of another engine) into these device blocks, in order
        (ValueError if its layout or dtype is not this cache's)."""
        self.wait_copy_ahead()
        if data.shape[2] != len(block_ids) or data.shape[:2] != self.kv_cache.shape[:2] or \
                data.shape[3:] != self.kv_cache.shape[3:]:
            raise ValueError(f"blocks of shape {tuple(data.shape)} do not fit this engine's "
                             f"cache {tuple(self.kv_cache.shape)}")
        if data.dtype != self.kv_cache.dtype:
            raise ValueError(f"blocks of {data.dtype} do not fit this engine's "
                             f"{self.kv_cache.dtype} cache")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        as_bits(self.kv_cache).index_copy_(2, index, as_bits(data).to(self.kv_cache.device))

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

    # --- single blocks' bytes, for the disk tier ----------------------------------------
    def read_pool_block(self, pool: str, block_id: int) -> bytes:
        """[layers, 2, block_size, kv heads, head dim] of a block of the CPU or the GPU
        pool, as bytes (after every copy into the pool under way has landed)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        block = self._pool(pool)[:, :, block_id].contiguous()
        return block.view(torch.uint8).cpu().numpy().tobytes()

    def write_pool_block(self, pool: str, block_id: int, data: bytes) -> None:
        """read_pool_block's bytes back into a block of pool "cpu" or "gpu" (ValueError
        if they are not one block's)."""
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


def _copy_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: list[tuple[int, int]]) -> None:
    """Block src of `src` -> block dst of `dst`, every layer's K and V, in two batched
    ops (gather, then scatter: every source is read before any destination is written)."""
    src_ids = torch.tensor([a for a, _ in mapping], dtype=torch.int64, device=src.device)
    dst_ids = torch.tensor([b for _, b in mapping], dtype=torch.int64, device=dst.device)
    src, dst = as_bits(src), as_bits(dst)  # (bytes: index_copy_ has no fp8 kernel on CPU)
    dst.index_copy_(2, dst_ids, src.index_select(2, src_ids))  # blocks: [L, 2, n, bs, Hkv, D]
