"""Training data sources for the trainer (synthetic for now; megatron datasets later)."""

from megatron.trainer.data.mock import MockGPTData

__all__ = ["MockGPTData"]
