"""The error every flag check raises: one line for the user, before any rank starts.

It lives apart from :mod:`~megatron.trainer.config.arguments` so feature modules and schedule
checks can raise it without importing the parser (which imports them: an import cycle).
"""
from __future__ import annotations


class ArgumentError(ValueError):
    """A bad flag combination; the message is one line for the user."""


class CompatArgumentError(ValueError):
    """A bad Megatron-LM compatibility flag (or rampup); one line for the user."""
