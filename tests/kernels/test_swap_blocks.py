"""swap_blocks (batched torch copies between pools) against the per-block reference."""

import pytest
import torch

from kernels import swap_blocks, swap_blocks_ref


def make_pool(num_blocks: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
              seed: int = 0, pin: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(3, 2, num_blocks, 4, 2, 16, generator=gen).to(dtype)
    return pool.pin_memory() if pin else pool.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_cpu_to_cpu(dtype: torch.dtype) -> None:
    src, dst = make_pool(8, dtype, seed=1), make_pool(5, dtype, seed=2)
    mapping = torch.tensor([[6, 0], [1, 4], [3, 2]])
    expected = dst.clone()
    swap_blocks_ref(src, expected, mapping)
    swap_blocks(src, dst, mapping)
    assert torch.equal(dst, expected)
    assert torch.equal(dst[:, :, 4], src[:, :, 1])  # independent of the reference
    assert torch.equal(dst[:, :, [1, 3]], make_pool(5, dtype, seed=2)[:, :, [1, 3]])


def random_bits_pool(num_blocks: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A pool of random bytes: every bit pattern of the dtype, NaN payloads included."""
    gen = torch.Generator().manual_seed(seed)
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (3, 2, num_blocks, 4, 2, 16 * width), generator=gen,
                        dtype=torch.uint8)
    return raw.view(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_many_blocks_out_of_order_land_where_mapped_bit_for_bit(dtype: torch.dtype) -> None:
    """17 blocks in one call, out of order, between pools of 40 and 25 blocks, the mapping
    int32: each destination block holds its source block's bytes exactly (NaN payloads,
    fp8), every other destination block and the whole source are as they were."""
    src, dst = random_bits_pool(40, dtype, seed=8), random_bits_pool(25, dtype, seed=9)
    src_before, dst_before = src.view(torch.uint8).clone(), dst.view(torch.uint8).clone()
    gen = torch.Generator().manual_seed(10)
    src_ids = torch.randperm(40, generator=gen)[:17].tolist()
    dst_ids = torch.randperm(25, generator=gen)[:17].tolist()
    swap_blocks(src, dst, torch.tensor(list(zip(src_ids, dst_ids)), dtype=torch.int32))
    moved = dst.view(torch.uint8)
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(moved[:, :, d], src_before[:, :, s]), (s, d)
    untouched = sorted(set(range(25)) - set(dst_ids))
    assert torch.equal(moved[:, :, untouched], dst_before[:, :, untouched])
    assert torch.equal(src.view(torch.uint8), src_before)


def test_empty_mapping_is_a_no_op() -> None:
    src, dst = make_pool(4), make_pool(4, seed=5)
    before = dst.clone()
    swap_blocks(src, dst, torch.empty(0, 2, dtype=torch.int64))
    assert torch.equal(dst, before)


@pytest.mark.parametrize("make_args,message", [
    (lambda: (make_pool(4), make_pool(4), torch.tensor([[4, 0]])), r"src block ids must be in 0..3"),
    (lambda: (make_pool(4), make_pool(2), torch.tensor([[0, 2]])), r"dst block ids must be in 0..1"),
    (lambda: (make_pool(4), make_pool(4), torch.tensor([[0, 1], [2, 1]])), "destination block appears twice"),
    (lambda: (make_pool(4), make_pool(4, torch.float16), torch.tensor([[0, 1]])), "same dtype"),
    (lambda: (make_pool(4), make_pool(4)[:, :, :, :2], torch.tensor([[0, 1]])), "must match in every dimension"),
    (lambda: (make_pool(4)[0], make_pool(4), torch.tensor([[0, 1]])), "src_cache must be 6-D"),
])
def test_rejects_bad_arguments(make_args, message: str) -> None:
    src, dst, mapping = make_args()
    with pytest.raises(ValueError, match=message):
        swap_blocks(src, dst, mapping)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_to_pinned_host_and_back(dtype: torch.dtype) -> None:
    gpu = make_pool(64, dtype, device="cuda", seed=6)
    host = make_pool(32, dtype, seed=7, pin=True)
    out_mapping = torch.tensor([[10, 3], [40, 0], [63, 31]])
    expected_host = host.clone()
    swap_blocks_ref(gpu, expected_host, out_mapping)
    swap_blocks(gpu, host, out_mapping)
    assert torch.equal(host, expected_host)

    in_mapping = torch.tensor([[3, 1], [0, 2], [31, 50]])
    expected_gpu = gpu.clone()
    swap_blocks_ref(host, expected_gpu, in_mapping)
    swap_blocks(host, gpu, in_mapping)
    torch.cuda.synchronize()
    assert torch.equal(gpu, expected_gpu)
