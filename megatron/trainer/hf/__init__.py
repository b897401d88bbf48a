"""Hugging Face ``transformers`` interop (the ``[hf]`` extra): export a checkpoint's model."""
