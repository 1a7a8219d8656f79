"""reshape_and_cache (Triton) against the torch reference. A copy is exact, so the
caches must be bit-identical (NaN payloads included: the kernel moves bits)."""

import pytest
import torch

pytest.importorskip("triton")

from kernels import reshape_and_cache, reshape_and_cache_ref  # noqa: E402


def make_case(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
              dtype: torch.dtype, slot_dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    # key and value as non-contiguous views into a fused [k | v] projection
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    # distinct shuffled slots, with every third token a padding slot (-1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1
    return key, value, key_cache, value_cache, slots.to(slot_dtype).to(device)


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (3, 80), (8, 128)])
@pytest.mark.parametrize("block_size", [1, 16, 32, 128])
def test_matches_reference(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                           slot_dtype: torch.dtype, device: str) -> None:
    num_blocks = max(3, 40 // block_size + 2)
    key, value, key_cache, value_cache, slots = make_case(
        min(37, num_blocks * block_size), num_kv_heads, head_dim, block_size, num_blocks, dtype, slot_dtype, device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, expected_k, expected_v, slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_padding_slots_write_nothing(device: str) -> None:
    key, value, key_cache, value_cache, slots = make_case(5, 2, 16, 4, 3, torch.float32, torch.int64, device)
    slots[:] = -1
    before_k, before_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


def test_writes_each_token_where_the_slot_says(device: str) -> None:
    """Independent of the reference: token i lands at [slot // block_size, slot % block_size]."""
    key, value, key_cache, value_cache, _ = make_case(3, 2, 16, 4, 3, torch.float32, torch.int64, device)
    slots = torch.tensor([9, -1, 2], device=device)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[2, 1], key[0]) and torch.equal(value_cache[2, 1], value[0])
    assert torch.equal(key_cache[0, 2], key[2]) and torch.equal(value_cache[0, 2], value[2])


def test_slot_past_the_cache_is_not_written(device: str) -> None:
    key, value, key_cache, value_cache, _ = make_case(2, 2, 16, 4, 3, torch.float32, torch.int64, device)
    slots = torch.tensor([12, 1], device=device)  # 12 == num_blocks * block_size
    with pytest.raises(ValueError, match="past the cache"):
        reshape_and_cache_ref(key, value, key_cache.clone(), value_cache.clone(), slots)
    before = key_cache.clone()
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[0, 1], key[1])
    before[0, 1] = key[1]
    assert torch.equal(key_cache, before)


def test_empty_batch_is_a_no_op(device: str) -> None:
    key, value, key_cache, value_cache, slots = make_case(0, 2, 16, 4, 3, torch.float32, torch.int64, device)
    before = key_cache.clone()
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, before)


def valid_args(device: str = "cpu") -> dict[str, torch.Tensor]:
    key, value, key_cache, value_cache, slots = make_case(4, 2, 16, 4, 3, torch.float32, torch.int64, device)
    return {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache,
            "slot_mapping": slots}


def wrong_heads(args: dict[str, torch.Tensor]) -> None:
    args["key_cache"] = torch.zeros(3, 4, 3, 16)
    args["value_cache"] = torch.zeros(3, 4, 3, 16)


@pytest.mark.parametrize("mutate,message", [
    (lambda a: a.update(key=a["key"][0]), "key must be 3-D"),
    (lambda a: a.update(key_cache=a["key_cache"][0]), "key_cache must be 4-D"),
    (lambda a: a.update(value=a["value"][:, :1]), "value shape"),
    (wrong_heads, r"key_cache.shape\[2\] must equal"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"][:3]), r"slot_mapping.shape\[0\] must equal"),
    (lambda a: a.update(slot_mapping=a["slot_mapping"].float()), "slot_mapping must have dtype"),
    (lambda a: a.update(key=a["key"].half()), "must have the same dtype"),
    (lambda a: a.update(key=a["key"].transpose(1, 2).contiguous().transpose(1, 2)), "contiguous last dimension"),
    (lambda a: a.update(key_cache=a["key_cache"].transpose(0, 1).contiguous().transpose(0, 1)),
     "must be contiguous"),
])
def test_launcher_rejects_bad_arguments(mutate, message: str) -> None:
    args = valid_args()
    mutate(args)
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**args)


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        reshape_and_cache(**valid_args("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_realistic_sizes_on_gpu(dtype: torch.dtype) -> None:
    key, value, key_cache, value_cache, slots = make_case(
        4096, 8, 128, 16, 1024, dtype, torch.int64, "cuda")
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, expected_k, expected_v, slots)
    reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
