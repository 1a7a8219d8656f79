"""Optional Triton.

`kernels` imports without Triton, and without importing it: the Triton kernels live
in the `*_kernel.py` modules, which the launchers import on their first launch
(`load_kernels`). Triton decides between compiling and its CPU interpreter when it is
first imported (its own library functions are decorated then), so deferring the
import lets tests set TRITON_INTERPRET=1 even after `kernels` was imported.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["interpreting", "load_kernels", "next_power_of_2", "cdiv"]


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def load_kernels(module: str) -> ModuleType:
    """Import a module of Triton kernels, with a clear error when Triton is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is None or not e.name.startswith("triton"):
            raise
        raise RuntimeError(
            f"{module}: Triton is not installed (import failed: {e}). Install triton "
            "(Linux x86_64 with CUDA) or use the torch attention backend "
            "(attention_backend='torch')."
        ) from e


def next_power_of_2(n: int) -> int:
    if n < 1:
        raise ValueError(f"next_power_of_2 needs n >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
