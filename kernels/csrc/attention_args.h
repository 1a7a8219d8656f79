// The argument checks both paged attention kernels make: q and out
// [num_tokens, num_heads, head_dim], the caches [num_blocks, block_size, num_kv_heads,
// head_dim], all float32 on the CPU with a contiguous head_dim axis.
#pragma once

#include <ATen/ATen.h>

namespace kvops {

inline void check_q_and_caches(const char* op, const at::Tensor& out, const at::Tensor& q,
                               const at::Tensor& key_cache, const at::Tensor& value_cache) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3, "q and out must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4,
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  for (const at::Tensor* t : {&out, &q, &key_cache, &value_cache}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat, op, " takes float32 tensors");
    TORCH_CHECK(t->device().is_cpu(), op, " is a CPU kernel");
    TORCH_CHECK(t->stride(-1) == 1, "the head_dim axis must be contiguous");
  }
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(key_cache.size(3) == q.size(2), "head_dim differs between q and the caches");
  TORCH_CHECK(q.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
}

}  // namespace kvops
