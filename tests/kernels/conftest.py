"""Kernel tests run the Triton kernels in Triton's CPU interpreter when there is no GPU.

TRITON_INTERPRET must be set before the first kernel launch (kernels compile lazily,
so importing `kernels` earlier is fine). On a CUDA machine the kernels run compiled
and the tests marked `cuda` run too.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None and not HAS_CUDA:
        pytest.skip("needs a CUDA device")


@pytest.fixture
def device() -> str:
    """Where the interpreter-sized tests run: the GPU when there is one, else the CPU."""
    return "cuda" if HAS_CUDA else "cpu"
