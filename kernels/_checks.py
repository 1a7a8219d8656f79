"""Argument checks shared by the kernel launchers.

Every failure is a ValueError that names the op, the argument, what was expected and
what was passed, so a caller can fix the call without reading the kernel.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kernels._triton import interpreting

ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_ndim(op: str, name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{op}: {name} must have dtype in ({names}), got {t.dtype}")


def check_same_dtype(op: str, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        got = ", ".join(f"{n}={t.dtype}" for n, t in zip(names, tensors))
        raise ValueError(f"{op}: {' and '.join(names)} must have the same dtype, got {got}")


def check_dim_size(op: str, name: str, t: torch.Tensor, dim: int, size: int, what: str) -> None:
    if t.shape[dim] != size:
        raise ValueError(
            f"{op}: {name}.shape[{dim}] must equal {what} ({size}), got shape {tuple(t.shape)}"
        )


def check_contiguous(op: str, name: str, t: torch.Tensor, layout: str) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} must be contiguous {layout} (got strides {t.stride()}); "
            f"pass {name}.contiguous() or a per-layer view kv_cache[layer, 0|1]"
        )


def check_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} must have a contiguous last dimension (stride 1), got strides {t.stride()}"
        )


def check_same_device(op: str, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        got = ", ".join(f"{n} on {t.device}" for n, t in zip(names, tensors))
        raise ValueError(f"{op}: all tensors must be on one device, got {got}")


def check_triton_device(op: str, t: torch.Tensor) -> None:
    """Triton kernels need CUDA tensors, except in the CPU interpreter."""
    if t.device.type == "cuda":
        return
    if interpreting() and t.device.type == "cpu":
        return
    raise ValueError(
        f"{op}: Triton kernels need CUDA tensors, got tensors on {t.device}. On CPU use "
        "the torch attention path (or set TRITON_INTERPRET=1 before the first launch to "
        "run the kernels in Triton's interpreter, for tests)."
    )


def check_power_of_two(op: str, name: str, value: int) -> None:
    if value < 1 or value & (value - 1):
        raise ValueError(f"{op}: {name} must be a power of two >= 1, got {value}")


def check_block_mapping(op: str, block_mapping: torch.Tensor, num_src_blocks: int,
                        num_dst_blocks: int) -> torch.Tensor:
    """Validate an [n, 2] (src, dst) block mapping on the host: ids in range, no
    destination twice (the copies run in parallel). Returns the mapping on the CPU."""
    check_ndim(op, "block_mapping", block_mapping, 2, "[n, 2] of (src, dst) block ids")
    check_dim_size(op, "block_mapping", block_mapping, 1, 2, "2 (src, dst)")
    check_dtype(op, "block_mapping", block_mapping, INDEX_DTYPES)
    mapping = block_mapping.cpu()
    if mapping.shape[0] == 0:
        return mapping
    for column, name, limit in ((0, "src", num_src_blocks), (1, "dst", num_dst_blocks)):
        ids = mapping[:, column]
        if int(ids.min()) < 0 or int(ids.max()) >= limit:
            raise ValueError(f"{op}: {name} block ids must be in 0..{limit - 1}, got {ids.tolist()}")
    dests = mapping[:, 1].tolist()
    if len(set(dests)) != len(dests):
        raise ValueError(f"{op}: a destination block appears twice in block_mapping: {mapping.tolist()}")
    return mapping


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as integers of the same width, for pure data movement.

    Copy kernels move bits, not numbers: this keeps bf16 (and fp8) out of the Triton
    interpreter, which cannot do arithmetic on them, and copies NaN payloads exactly.
    """
    bits = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(bits[t.element_size()])
