"""The one error of a run's configuration: one line for the user, before any rank starts.

Every check of a flag, a combination of flags, the data, the tokenizer, the memory estimate
or the schedule raises :class:`ConfigError`; the entry point prints ``error: <message>`` and
exits with status 2. It lives apart from :mod:`~megatron.trainer.config.arguments` so feature
modules and schedule checks can raise it without importing the parser (which imports them:
an import cycle).
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration this run cannot use; the message is one line for the user."""

