"""Rounding float32 to a kernel's output dtype, the same on a GPU and in the interpreter.

A GPU rounds float32 -> bfloat16 to nearest even; Triton's CPU interpreter truncates.
Rounding the float32 value onto the bfloat16 grid first (to nearest even, by integer
arithmetic on its bits) makes the final cast exact on both, so interpreter tests can
compare bit for bit with torch. Other dtypes are cast as they are (float16 rounds to
nearest even in both). Imported by the `*_kernel.py` modules only.
"""

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 x -> DTYPE, rounded to nearest even."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # NaN and inf stay so
        return bits.to(tl.float32, bitcast=True).to(DTYPE)
    return x.to(DTYPE)
