"""Tensor parallelism: one engine's model split across `tensor_parallel_size` ranks.

Megatron's split, as vLLM does it:
* attention: each rank owns n_heads / tp query heads and n_kv_heads / tp KV heads
  (q/k/v column-parallel), and its rows of o_proj (row-parallel); an all-reduce sums
  the ranks' outputs;
* MLP: each rank owns intermediate / tp columns of gate and up and the same rows of
  down, then an all-reduce (MoE: every expert split so, the router on every rank);
* embedding and LM head: vocab-parallel, each rank a contiguous slice of the
  vocabulary; the embedding's lookups are summed, the logits gathered;
* row-parallel biases are added once (rank 0 holds them, the others zeros).

Every rank holds its heads' share of every KV block: the block tables are the same on
all ranks, and the scheduler runs once, on rank 0 (the engine's process). Rank 0's
runner starts the other ranks as processes (`start_ranks`), and each step broadcasts
the step's block copies and batch to them (a `RankStep`); they run the same forward
pass, joining its collectives, and drop the logits (`serve`). torch.distributed
carries it: gloo on CPU, NCCL on GPUs (rank r on cuda:r).
"""
from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import EngineError
from engine.model.input_batch import RankBatch

_PR_SET_PDEATHSIG = 1


class TensorParallelError(EngineError):
    """The model cannot be split this way, or a rank could not start."""


@dataclass(slots=True)
class TensorParallel:
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        import torch.distributed as dist

        dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' x along the last dimension (rank order)."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, obj=None):
        """Rank 0's obj, on every rank (pickled)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather_object(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out


@dataclass(slots=True)
class RankStep:
    """What rank 0 of a split model sends the other ranks before it runs the same
    itself: a step's block copies, in this order, then its forward pass."""
    swap_out: list[tuple[int, int]]  # (gpu, cpu)
    swap_in: list[tuple[int, int]]  # (cpu, gpu)
    copies: list[tuple[int, int]]  # (src, dst) in the device pool
    # the forward pass's inputs, on the host; None: copies only (an operator's, between
    # steps)
    batch: RankBatch | None = None


_STOP = "stop"  # what rank 0 sends last (shutdown)


def check_divisible(args, size: int) -> None:
    """Raise TensorParallelError unless heads, KV heads and MLP widths split evenly."""
    for name, value in (("num_attention_heads", args.n_heads),
                        ("num_key_value_heads", args.n_kv_heads),
                        ("intermediate_size", args.intermediate_size),
                        ("moe_intermediate_size", args.moe_intermediate_size)):
        if value % size:
            raise TensorParallelError(
                f"tensor_parallel_size={size} must divide the model's {name} ({value})")


def shard_args(args, size: int):
    """The ModelArgs of one rank's share (heads and MLP widths divided by size; the
    vocabulary stays whole: the model pads and slices it)."""
    check_divisible(args, size)
    return dataclasses.replace(
        args, n_heads=args.n_heads // size, n_kv_heads=args.n_kv_heads // size,
        intermediate_size=args.intermediate_size // size,
        moe_intermediate_size=args.moe_intermediate_size // size)


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding and the LM head on each rank (the vocabulary padded)."""
    return -(-vocab_size // size)


def shard_state(state: dict[str, torch.Tensor], args, rank: int,
                size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of a fused state dict (engine/model/loader.py's names, HF's
    [out, in] orientation for Linear weights, the experts' stacked [E, in, out])."""
    H, Hkv, D = args.n_heads, args.n_kv_heads, args.head_dim
    h, hkv = H // size, Hkv // size
    rows = vocab_rows(args.vocab_size, size)
    out: dict[str, torch.Tensor] = {}
    vocab_slices: dict[int, torch.Tensor] = {}  # a tied head is the embedding's slice

    def vocab_slice(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in vocab_slices:
            padded = torch.cat([t, t.new_zeros(rows * size - t.shape[0], t.shape[1])])
            vocab_slices[id(t)] = padded[rank * rows:(rank + 1) * rows].clone()
        return vocab_slices[id(t)]

    def cols(t: torch.Tensor, n: int) -> torch.Tensor:  # [out, n * size] -> this rank's n
        return t[..., rank * n:(rank + 1) * n].contiguous()

    def once(t: torch.Tensor) -> torch.Tensor:  # a row-parallel bias: added by rank 0 only
        return t.clone() if rank == 0 else torch.zeros_like(t)

    for name, t in state.items():
        if name in ("embed_tokens.weight", "lm_head.weight"):
            out[name] = vocab_slice(t)
        elif name.endswith(("attention.wqkv.weight", "attention.wqkv.bias")):
            q, k, v = t.split([H * D, Hkv * D, Hkv * D])
            out[name] = torch.cat([q[rank * h * D:(rank + 1) * h * D],
                                   k[rank * hkv * D:(rank + 1) * hkv * D],
                                   v[rank * hkv * D:(rank + 1) * hkv * D]])
        elif name.endswith("attention.wo.weight"):
            out[name] = cols(t, h * D)
        elif name.endswith(("feed_forward.w_gate_up.weight", "feed_forward.w_gate_up.bias")):
            n = args.intermediate_size // size
            gate, up = t.split(args.intermediate_size)
            out[name] = torch.cat([gate[rank * n:(rank + 1) * n], up[rank * n:(rank + 1) * n]])
        elif name.endswith("feed_forward.w_down.weight"):
            out[name] = cols(t, args.intermediate_size // size)
        elif name.endswith(("attention.wo.bias", "feed_forward.w_down.bias")):
            out[name] = once(t)
        elif name.endswith("experts_gate_up"):  # [E, dim, 2 * I]
            n = args.moe_intermediate_size // size
            gate, up = t.split(args.moe_intermediate_size, dim=-1)
            out[name] = torch.cat([gate[..., rank * n:(rank + 1) * n],
                                   up[..., rank * n:(rank + 1) * n]], dim=-1).contiguous()
        elif name.endswith("experts_down"):  # [E, I, dim]
            n = args.moe_intermediate_size // size
            out[name] = t[:, rank * n:(rank + 1) * n].contiguous()
        else:  # norms, the router, q/k norms: every rank the whole
            out[name] = t
    return out


# --- the rank processes -----------------------------------------------------------------

def start_ranks(config, size: int, rank_main) -> tuple[list, str]:
    """Start ranks 1 .. size - 1, each a process running rank_main(config, rank, size,
    address) (a module-level function: it builds the rank's runner and serves rank 0's
    steps); returns the processes and the rendezvous address rank 0 joins with init()."""
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, size):
        p = ctx.Process(target=_rank_process, args=(rank_main, config, rank, size, address),
                        daemon=True,
                        name=f"kvops-tp-rank{rank}")
        p.start()
        procs.append(p)
    return procs, address


def init(rank: int, size: int, address: str, device: torch.device) -> TensorParallel:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size)
    if device.type == "cpu":  # the ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return TensorParallel(rank, size)


def serve(tp: TensorParallel, run: Callable[[RankStep], None]) -> None:
    """A rank other than 0: run each RankStep rank 0 sends until it says stop, then
    leave the process group."""
    while True:
        message = tp.broadcast()
        if message == _STOP:
            break
        run(message)
    shutdown(tp, [])


def shutdown(tp: TensorParallel | None, procs: list) -> None:
    """Tell the ranks to stop (rank 0), wait for them, leave the process group."""
    import torch.distributed as dist

    if tp is not None and tp.rank == 0 and dist.is_initialized():
        try:
            tp.broadcast(_STOP)
        except RuntimeError:
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_process(rank_main, config, rank: int, size: int, address: str) -> None:
    _die_with_parent()
    rank_main(config, rank, size, address)


def _die_with_parent() -> None:
    """A rank whose engine died (even by SIGKILL) must not wait for it for ever."""
    try:
        ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
