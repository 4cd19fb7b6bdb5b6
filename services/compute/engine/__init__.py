"""The engine: continuous batching over a paged KV pool, sequences and caches."""
