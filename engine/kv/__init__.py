"""The paged KV cache: block hashes, the block pool, layer groups, the coordinator and its tiers."""
