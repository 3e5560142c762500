"""Batching and scheduling: a file of requests (moejax.requests) planned into batches and run on an Engine, static
(batch, runner) or continuous (continuous, block_pool), with the prefix cache and the batch and KV-pool sizes."""
