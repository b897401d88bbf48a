"""The names a flag may take, where the flags are declared (``choices=``).

The parser sits on the config floor, below the packages that implement the choices (tokenizers,
optimizers, learning-rate schedules, recompute, host set-up); each of those imports its names
from here, so a name is written once and the parser never imports what it names.
``tests/test_import_graph.py`` keeps the order; ``tests/test_flag_choices.py`` checks that
every name has its implementation.
"""
from __future__ import annotations

from typing import Literal

#: ``--tokenizer-type`` (:mod:`megatron.trainer.tokenizer`)
TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
)

#: ``--optimizer`` (:data:`megatron.trainer.optim.registry.OPTIMIZERS`); "adam" is Megatron-LM's
#: name for AdamW (decoupled weight decay)
OPTIMIZER_NAMES = ("adamw", "adam", "basis-rotation")

#: ``--lr-decay-style`` and ``--lr-wsd-decay-style`` (:mod:`megatron.trainer.optim.lr_schedule`)
DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")

#: ``--recompute-granularity``, ``--recompute-method``, ``--recompute-modules``
#: (:mod:`megatron.trainer.models.recompute`)
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
SELECTIVE_MODULES = ("core_attn",)  # what selective recompute covers here (Megatron's default)

#: ``--host-malloc`` (:mod:`megatron.trainer.launch.host_allocator`)
HostMalloc = Literal["retain", "system"]
HOST_MALLOC_CHOICES: tuple[HostMalloc, ...] = ("retain", "system")

#: ``--bind-cores`` (:mod:`megatron.trainer.launch.core_binding`)
BindCores = Literal["auto", "none"]
BIND_CORES_CHOICES: tuple[BindCores, ...] = ("auto", "none")
