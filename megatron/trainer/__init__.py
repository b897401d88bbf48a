"""Megatron-Async trainer: megatron-core models as pipeline stages, data, and training glue."""
