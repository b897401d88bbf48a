"""``--split-sentences``: nltk Punkt offline (installed model, or trained on the input).

Reference: nltk's untrained Punkt on the same text; training on the pydoc corpus must learn
its abbreviations (no sentence may end at "e.g." or "i.e."), which the untrained model splits at.
"""
from __future__ import annotations

import pytest

from megatron.trainer.data.corpus import pydoc_corpus
from megatron.trainer.data.sentence_split import PunktSentenceTokenizer, split_sentences, train_punkt


def _ends_at_abbreviation(splitter, docs: list[str]) -> int:
    return sum(s.endswith(("e.g.", "i.e.")) for d in docs for s in split_sentences(splitter, d))


def test_punkt_trained_on_the_input_learns_abbreviations() -> None:
    docs = pydoc_corpus("topic")
    assert _ends_at_abbreviation(PunktSentenceTokenizer(), docs) > 10
    assert _ends_at_abbreviation(train_punkt(docs), docs) == 0


@pytest.mark.parametrize("splitter", [PunktSentenceTokenizer(), train_punkt(["One. Two? Three!"])])
def test_keep_whitespace_round_trip(splitter) -> None:
    text = '  First sentence. Second one, "quoted." Third!\n\nA new paragraph? Yes.\n'
    kept = split_sentences(splitter, text, keep_whitespace=True)
    assert "".join(kept) == text
    assert split_sentences(splitter, text) == [k.strip() for k in kept] == [
        "First sentence.", 'Second one, "quoted."', "Third!", "A new paragraph?", "Yes."]
    assert split_sentences(splitter, "") == split_sentences(splitter, "", keep_whitespace=True) == []
