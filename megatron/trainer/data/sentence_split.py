"""Sentence splitting for ``tools/preprocess_data.py --split-sentences``: nltk's Punkt, offline.

Megatron-LM splits with nltk's pretrained English Punkt model, which nltk downloads on
demand. Here nothing is downloaded at run time: the installed ``punkt_tab`` English model is
used when nltk finds one; otherwise Punkt is trained (unsupervised, :class:`PunktTrainer`)
on a bounded sample of the input itself, which is what the pretrained model was made by
anyway, just on another corpus. With no sample text, the untrained
:class:`PunktSentenceTokenizer` still splits at sentence-final punctuation before a new
sentence; it only lacks the learned abbreviations.
"""
from __future__ import annotations

from collections.abc import Iterable

from nltk.tokenize.punkt import PunktSentenceTokenizer, PunktTokenizer, PunktTrainer

# Punkt's statistics settle long before this; the bound keeps huge corpora cheap to start.
TRAINING_SAMPLE_CHARS = 2_000_000


def installed_punkt() -> PunktSentenceTokenizer | None:
    """nltk's pretrained English Punkt, if its data is installed (never downloads)."""
    try:
        return PunktTokenizer("english")
    except LookupError:
        return None


def train_punkt(texts: Iterable[str], max_chars: int = TRAINING_SAMPLE_CHARS) -> PunktSentenceTokenizer:
    """Punkt trained on the first ``max_chars`` characters of ``texts`` (untrained if empty)."""
    sample, size = [], 0
    for text in texts:
        sample.append(text)
        size += len(text)
        if size >= max_chars:
            break
    if not sample:
        return PunktSentenceTokenizer()
    trainer = PunktTrainer()
    trainer.INCLUDE_ALL_COLLOCS = True  # as Megatron-LM's pretrained model was built: learn collocations too
    trainer.train("\n\n".join(sample), finalize=True)
    return PunktSentenceTokenizer(trainer.get_params())


def build_splitter(texts: Iterable[str]) -> tuple[PunktSentenceTokenizer, str]:
    """The splitter and a line saying which one (installed model, or trained on the input)."""
    splitter = installed_punkt()
    if splitter is not None:
        return splitter, "nltk Punkt, installed English model (punkt_tab)"
    return train_punkt(texts), "nltk Punkt trained on the input (no punkt data installed; nothing downloaded)"


def split_sentences(splitter: PunktSentenceTokenizer, text: str, keep_whitespace: bool = False) -> list[str]:
    """Sentences of ``text``. Without ``keep_whitespace`` each is stripped (Megatron-LM);
    with it each keeps the whitespace after it, so the pieces concatenate back to ``text``."""
    spans = list(splitter.span_tokenize(text))
    if not keep_whitespace:
        return [text[a:b].strip() for a, b in spans if text[a:b].strip()]
    if not spans:
        return [text] if text else []
    cuts = [0] + [a for a, _ in spans[1:]] + [len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:]) if a < b]
