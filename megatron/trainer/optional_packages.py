"""Silence megatron-core's per-import notices about optional packages; say it once instead.

megatron-core warns at import time, module by module, that Apex and Transformer Engine are
missing (six ``UserWarning`` lines per process, so 24 interleaved lines for four ranks on a
CPU machine) and logs INFO lines about Megatron-FSDP. None of it is actionable per rank:
the fallbacks are the PyTorch implementations this project uses anyway. :func:`quiet_imports`
drops exactly those notices (by message and by the warning's module, so a user's own
warnings still show) and :func:`missing_optional_packages` lets the logging rank print one
line naming what is missing (the start banner does).
"""
from __future__ import annotations

import importlib.util
import logging
import warnings

# Packages megatron-core uses when present; each import-time notice names one of them.
OPTIONAL_PACKAGES = ("apex", "transformer_engine")

_NOTICE = r".*(Transformer Engine|Apex)\b.*not installed"


def quiet_imports() -> None:
    """Filter megatron-core's optional-package warnings and its INFO import chatter.

    Installed before megatron-core is first imported (``megatron.trainer``'s package import),
    so forked ranks inherit the filters and spawned ranks install them again.
    """
    warnings.filterwarnings("ignore", message=_NOTICE, category=UserWarning, module=r"megatron\.core")
    core = logging.getLogger("megatron.core")
    if core.level == logging.NOTSET:  # an explicit user setting wins
        core.setLevel(logging.WARNING)


def missing_optional_packages() -> list[str]:
    """The optional packages megatron-core would use but cannot import here."""
    return [name for name in OPTIONAL_PACKAGES if importlib.util.find_spec(name) is None]


def optional_packages_line() -> str | None:
    """One line for the start banner, or None when every optional package is installed."""
    missing = missing_optional_packages()
    if not missing:
        return None
    return (f"optional packages not installed: {', '.join(missing)} "
            f"(megatron-core falls back to its PyTorch implementations)")
