"""Tokenizers (GPT-2 BPE, Hugging Face JSON, BERT WordPiece; megatron-core's null, SentencePiece,
TikToken) behind one interface."""

from megatron.trainer.config.choices import TOKENIZER_TYPES
from megatron.trainer.tokenizer.tokenizer import (
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    Tokenizer,
    TokenizerError,
    vocab_size_with_padding,
)
from megatron.trainer.tokenizer.core_backed import CoreTokenizer, NullTokenizer
from megatron.trainer.tokenizer.factory import build_tokenizer, tokenizer_from_args

__all__ = [
    "TOKENIZER_TYPES",
    "BertWordPieceTokenizer",
    "CoreTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer",
    "tokenizer_from_args",
    "vocab_size_with_padding",
]
