"""Where and in what the model runs, chosen once at start-up: the device, the model's
dtype, the K/V cache's dtype, and the ops implementation (engine/model/ops/torch_ops.py)."""
from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.model.ops.torch_ops import TorchOps
from engine.model.ops.cpu_ops import cpu_kernel_ops
from engine.model.ops.triton_ops import TritonOps
from kernels.fp8 import cache_dtype, is_fp8

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def choose_ops(config, device: torch.device, dtype: torch.dtype, backend) -> TorchOps:
    """The runner's pick, once at start-up: with the Triton attention backend, Triton's
    ops (its fused MoE kernel); for float32 on a CPU, the C++ kernels where they build
    and config.cpu_kernels asks; plain torch otherwise."""
    if backend.name == "triton":
        return TritonOps()
    return cpu_kernel_ops(config, device, dtype, backend) or TorchOps()
