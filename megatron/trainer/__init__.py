"""Megatron-Async trainer: megatron-core models as pipeline stages, data, and training glue."""

from megatron.trainer.optional_packages import quiet_imports as _quiet_imports

_quiet_imports()  # before any megatron.core import: its optional-package notices, once per run instead
