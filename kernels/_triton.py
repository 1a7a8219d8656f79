"""Optional Triton.

The package imports on a machine without Triton (the engine then uses its torch
path); only launching a Triton kernel needs it. Kernels are compiled on their first
launch rather than at import, so `TRITON_INTERPRET=1` may be set after `kernels`
was imported (tests set it in their conftest; other test packages may have
imported the engine, and with it `kernels`, before that).
"""

from __future__ import annotations

import os
from typing import Any, Callable

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path still works; launchers raise a clear error
    triton = None
    tl = None

__all__ = ["triton", "tl", "lazy_jit", "LazyKernel", "interpreting", "require_triton",
           "next_power_of_2", "cdiv"]


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    if triton is not None:
        # Triton's own reading of the variable, so we agree with triton.jit
        return bool(triton.knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def require_triton(op: str) -> None:
    if triton is None:
        raise RuntimeError(
            f"{op}: Triton is not installed. Install triton (Linux x86_64 with CUDA) or "
            "use the torch attention backend (attention_backend='torch')."
        )


class LazyKernel:
    """A Triton kernel compiled on first launch, once per interpreter mode.

    `kernel[grid](*args)` works as with `triton.jit`. Kernels built this way must not
    call other jitted helpers (the helpers would not be JIT functions).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        # interpret mode -> triton.jit(fn) built under that mode
        self._jitted: dict[bool, Any] = {}

    def jitted(self) -> Any:
        require_triton(self.fn.__name__)
        mode = interpreting()
        if mode not in self._jitted:
            self._jitted[mode] = triton.jit(self.fn)
        return self._jitted[mode]

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]


def lazy_jit(fn: Callable[..., Any]) -> LazyKernel:
    return LazyKernel(fn)


def next_power_of_2(n: int) -> int:
    if n < 1:
        raise ValueError(f"next_power_of_2 needs n >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
