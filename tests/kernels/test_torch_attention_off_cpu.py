"""The torch attention path off the CPU (on a GPU when that backend is chosen): the
plain-algebra attention it uses there equals aten's CPU flash kernel, log-sum-exp too."""
import pytest
import torch

from kernels.cpu_attention import _attention_with_lse, _cpu_flash_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_off_cpu_attention_equals_the_cpu_flash_kernel(dtype):
    torch.manual_seed(0)
    q = torch.randn(3, 8, 5, 16, dtype=dtype)  # 8 query heads over 2 kv heads (GQA)
    k, v = torch.randn(3, 2, 20, 16, dtype=dtype), torch.randn(3, 2, 20, 16, dtype=dtype)
    mask = torch.zeros(3, 1, 1, 20)
    mask[0, ..., 17:] = float("-inf")  # a padded sequence
    want_o, want_lse = _cpu_flash_attention(q, k, v, attn_mask=mask.to(dtype), scale=0.25)
    o, lse = _attention_with_lse(q, k, v, mask, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert o.dtype == dtype and o.shape == want_o.shape
    torch.testing.assert_close(o, want_o, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.float(), want_lse.float(), atol=tol, rtol=tol)
