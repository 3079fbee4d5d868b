"""The KV cache: the pools (`memory_pool`: a request's row of slots, every layer's K and V by slot, their
`KVPoolLayout`), the page allocator, the radix prefix tree and its hierarchical form over a host-memory tier
and a storage tier (`hiradix_cache`, `cache_controller`, `hicache_*`)."""
