"""The KV snapshot's vocabulary (format in docs/design.md): block states and the encoding of
per-block arrays. One builder makes the document (engine/observe/view.py's KVMirror.snapshot),
for engine.snapshot(), the live view and the timeline's keyframes."""
from __future__ import annotations

import base64

import numpy as np

# Per-block state codes, in the order the snapshot's "block_states" lists them.
BLOCK_STATES = ("free", "used", "cached", "pinned")
FREE, USED, CACHED, PINNED = range(4)
EVICTION_ORDER_LEN = 64  # how many upcoming victims the snapshot lists


def encode_array(values: np.ndarray, compact: bool) -> list[int] | dict:
    """A per-block array: a JSON list, or base64 of its little-endian bytes."""
    if not compact:
        return values.tolist()
    values = np.ascontiguousarray(values, dtype=values.dtype.newbyteorder("<"))
    return {"dtype": values.dtype.str, "data": base64.b64encode(values.tobytes()).decode()}


def decode_array(obj: list[int] | dict) -> np.ndarray:
    """Inverse of encode_array (for tests and Python clients)."""
    if isinstance(obj, list):
        return np.asarray(obj, dtype=np.int64)
    return np.frombuffer(base64.b64decode(obj["data"]), dtype=np.dtype(obj["dtype"]))
