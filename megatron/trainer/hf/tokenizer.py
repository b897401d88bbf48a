"""The run's tokenizer as transformers tokenizer files, and back.

Checkpoints record the run's tokenizer flags (``signature["tokenizer"]``,
:func:`megatron.trainer.tokenizer.factory.tokenizer_record`). Two of our tokenizers have an
exact transformers equivalent, so an exported model directory carries them and
``AutoTokenizer.from_pretrained(DIR)`` encodes text to the ids the model was trained on:

* ``GPT2BPETokenizer`` (vocab.json + merges.txt): byte-level BPE without a prefix space and
  ``<|endoftext|>`` as a special token, which is ``GPT2TokenizerFast`` on the same two files;
* ``HuggingFaceTokenizer`` (a ``tokenizers`` JSON): ``PreTrainedTokenizerFast`` on that file,
  with the special tokens of a ``tokenizer_config.json`` beside it.

The others (NullTokenizer, SentencePiece, TikToken, BERT WordPiece for a GPT) are not exported;
:func:`export_tokenizer` says why in one line and the model directory is written without them.
An imported model's tokenizer files are copied into the checkpoint (:func:`import_tokenizer`)
and recorded as a ``HuggingFaceTokenizer``, so generation and a later export find them.
"""
from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any

# Files ``save_pretrained`` of a fast tokenizer writes (and an imported directory may hold).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json")
IMPORTED_TOKENIZER = "hf_tokenizer"  # the checkpoint's copy of an imported model's tokenizer


def export_tokenizer(record: dict[str, Any] | None, output: str | Path) -> str:
    """Write the transformers equivalent of ``record``'s tokenizer into ``output``; return one
    line saying what was written (or why nothing)."""
    import transformers

    if record is None:
        return "no tokenizer files: the run had no tokenizer (mock data) or its checkpoint did not record one"
    kind = record.get("tokenizer_type")
    missing = [record[f] for f in ("vocab_file", "merge_file", "tokenizer_model") if record.get(f)
               and not Path(record[f]).exists()]
    if missing:
        return f"no tokenizer files: the run's {kind} file {missing[0]} is gone"
    if kind == "GPT2BPETokenizer":
        tokenizer = gpt2_tokenizer(record["vocab_file"], record["merge_file"])
    elif kind == "HuggingFaceTokenizer":
        file = Path(record["tokenizer_model"])
        file = file / "tokenizer.json" if file.is_dir() else file
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(file), **_special_tokens(file.parent))
    else:
        return f"no tokenizer files: {kind} has no transformers equivalent here"
    tokenizer.save_pretrained(str(output))
    return f"tokenizer: {kind} as transformers {type(tokenizer).__name__}"


def gpt2_tokenizer(vocab_file: str, merge_file: str) -> Any:
    """transformers' GPT-2 BPE tokenizer on a vocab.json and merges.txt, ``<|endoftext|>`` its
    special tokens (transformers 5 names the fast class ``GPT2Tokenizer`` and takes ``vocab``/``merges``)."""
    import transformers

    cls = transformers.GPT2TokenizerFast
    files = {"vocab": vocab_file, "merges": merge_file} if "vocab" in inspect.signature(cls.__init__).parameters \
        else {"vocab_file": vocab_file, "merges_file": merge_file}
    eod = "<|endoftext|>"
    return cls(**files, unk_token=eod, bos_token=eod, eos_token=eod, add_prefix_space=False)


def _special_tokens(directory: Path) -> dict[str, str]:
    """The special tokens a ``tokenizer_config.json`` beside a tokenizer JSON names."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return {}
    data = json.loads(config.read_text())
    tokens = {}
    for kind in ("bos", "eos", "unk", "pad", "cls", "sep", "mask"):
        value = data.get(f"{kind}_token")
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[f"{kind}_token"] = value
    return tokens


def import_tokenizer(source: str | Path, checkpoint: str | Path) -> dict[str, Any] | None:
    """Copy a model directory's tokenizer files into ``checkpoint`` and return the tokenizer
    record naming them (None when the directory has no ``tokenizer.json``: ids only)."""
    source = Path(source)
    if not (source / "tokenizer.json").is_file():
        return None
    target = Path(checkpoint) / IMPORTED_TOKENIZER
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    return {"tokenizer_type": "HuggingFaceTokenizer", "vocab_file": None, "merge_file": None,
            "tokenizer_model": str(target.resolve()), "null_vocab_size": None}
