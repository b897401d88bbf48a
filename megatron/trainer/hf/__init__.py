"""Hugging Face ``transformers`` interop (the ``[hf]`` extra): export a checkpoint's model,
import a transformers model as a checkpoint."""
from __future__ import annotations

import sys


def require_transformers(tool: str) -> bool:
    """Whether transformers imports; if not, one line on stderr saying how to install it.
    Quietens its progress bars, so a tool's stderr holds only its own lines."""
    try:
        import transformers
    except ImportError:
        print(f'error: {tool} needs transformers: pip install -e ".[hf]"', file=sys.stderr)
        return False
    transformers.utils.logging.disable_progress_bar()
    return True
