"""Tokenizers (GPT-2 BPE, Hugging Face JSON, BERT WordPiece, null) behind one interface."""

from megatron.trainer.tokenizer.tokenizer import (
    TOKENIZER_TYPES,
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    NullTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    tokenizer_from_args,
    vocab_size_with_padding,
)

__all__ = [
    "TOKENIZER_TYPES",
    "BertWordPieceTokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer",
    "tokenizer_from_args",
    "vocab_size_with_padding",
]
