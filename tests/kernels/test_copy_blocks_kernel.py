"""copy_blocks (Triton) against the torch reference; exact (bitwise) comparisons."""

import pytest
import torch

pytest.importorskip("triton")

from kernels import copy_blocks, copy_blocks_ref  # noqa: E402


def make_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(1, 1, 16), (16, 3, 24), (32, 2, 64)])
def test_matches_reference(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                           device: str) -> None:
    cache = make_kv_cache(3, 10, block_size, num_kv_heads, head_dim, dtype, device)
    mapping = torch.tensor([[7, 2], [0, 5], [7, 9], [3, 1]], dtype=torch.int64)
    expected = cache.clone()
    copy_blocks_ref(expected, mapping)
    copy_blocks(cache, mapping.to(device))
    assert torch.equal(cache, expected)
    # independent of the reference: every layer's K and V were copied
    assert torch.equal(cache[:, :, 9], cache[:, :, 7]) and torch.equal(cache[:, :, 5], cache[:, :, 0])


def test_blocks_not_in_the_mapping_are_untouched(device: str) -> None:
    cache = make_kv_cache(2, 6, 4, 2, 16, torch.float32, device)
    before = cache.clone()
    copy_blocks(cache, torch.tensor([[1, 4]]))
    untouched = [0, 1, 2, 3, 5]
    assert torch.equal(cache[:, :, untouched], before[:, :, untouched])
    assert torch.equal(cache[:, :, 4], before[:, :, 1])


def test_empty_mapping_is_a_no_op(device: str) -> None:
    cache = make_kv_cache(2, 6, 4, 2, 16, torch.float32, device)
    before = cache.clone()
    copy_blocks(cache, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("mapping,message", [
    (torch.tensor([[0, 6]]), r"dst block ids must be in 0..5"),
    (torch.tensor([[-1, 2]]), r"src block ids must be in 0..5"),
    (torch.tensor([[0, 2], [1, 2]]), "destination block appears twice"),
    (torch.tensor([[0, 2], [2, 3]]), "both a source and a destination"),
    (torch.tensor([0, 2]), "block_mapping must be 2-D"),
    (torch.tensor([[0, 2, 3]]), r"block_mapping.shape\[1\] must equal 2"),
    (torch.tensor([[0.0, 2.0]]), "block_mapping must have dtype"),
])
def test_rejects_bad_mappings(mapping: torch.Tensor, message: str) -> None:
    cache = make_kv_cache(1, 6, 4, 1, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match=message):
        copy_blocks(cache, mapping)


def test_rejects_bad_caches() -> None:
    cache = make_kv_cache(1, 6, 4, 1, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="kv_cache must be 6-D"):
        copy_blocks(cache[0], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="must be contiguous"):
        copy_blocks(cache.transpose(2, 3), torch.tensor([[0, 1]]))


@pytest.mark.cuda
def test_realistic_sizes_on_gpu() -> None:
    cache = make_kv_cache(8, 512, 16, 8, 128, torch.bfloat16, "cuda")
    mapping = torch.stack([torch.arange(0, 64), torch.arange(256, 320)], dim=1)
    expected = cache.clone()
    copy_blocks_ref(expected, mapping)
    copy_blocks(cache, mapping.cuda())
    assert torch.equal(cache, expected)
