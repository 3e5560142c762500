"""Batch scheduling: request parsing, batching and crash-safe result output."""
