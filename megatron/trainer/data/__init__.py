"""Training data sources: synthetic (mock) sequences, or megatron-core GPT datasets on files
written by ``tools/preprocess_data.py``."""

from megatron.trainer.data.gpt_dataset import DataError, GPTDataSource, build_gpt_datasets
from megatron.trainer.data.mock import MockGPTData

__all__ = ["DataError", "GPTDataSource", "MockGPTData", "build_gpt_datasets"]
