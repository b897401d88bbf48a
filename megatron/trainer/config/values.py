"""The types a flag's value may have: what JSON holds.

Every flag parses to ``None``, a bool, a number, a string or a list of them, and a decision the
config records (``auto``'s, kept in checkpoints) is a JSON object; naming the type lets a
section say so instead of ``Any``, and a config that holds only these can be written to a file
and read back.
"""
from __future__ import annotations

import argparse
from typing import Union

#: a JSON value (recursive)
JsonValue = Union[None, bool, int, float, str, list["JsonValue"], dict[str, "JsonValue"]]
#: a flag's parsed value (``argparse`` gives lists for ``nargs``)
FlagValue = JsonValue


def with_values(args: argparse.Namespace, **values: FlagValue | object) -> argparse.Namespace:
    """A copy of the flags ``args`` with ``values`` set: how a default that depends on other
    flags is filled in (Megatron-LM's ``validate_args`` writes them into its namespace; here the
    parsed flags stay as the user gave them, and each resolution step returns a new namespace)."""
    return argparse.Namespace(**{**vars(args), **values})
