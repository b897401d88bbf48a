"""An offline English text corpus: the documentation topics that ship with CPython.

``pydoc_data.topics.topics`` maps ~80 help topics ("assignment", "if", "types", ...) to
their reference-manual text: about half a megabyte of English prose and code, present in
every CPython installation, so tokenizers and small models can be trained without a
download.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator

GRANULARITIES = ("topic", "paragraph")


def pydoc_corpus(granularity: str = "topic") -> list[str]:
    """The corpus as documents: one per help topic, or one per blank-line separated paragraph.

    Topics come in sorted order so the corpus is the same on every run.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    from pydoc_data.topics import topics

    texts = [topics[name].strip() for name in sorted(topics)]
    if granularity == "topic":
        return [t for t in texts if t]
    paragraphs = (p.strip() for t in texts for p in re.split(r"\n\s*\n", t))
    return [p for p in paragraphs if p]


def write_jsonl(documents: Iterable[str], path: str | os.PathLike, key: str = "text") -> int:
    """Write one ``{key: document}`` JSON object per line; return the number written."""
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in documents:
            f.write(json.dumps({key: doc}, ensure_ascii=False) + "\n")
            count += 1
    return count


class EncodingError(ValueError):
    """A line that is not UTF-8; the message names the file, the line and the byte offset."""


def utf8_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of every line, decoded as UTF-8; a bad byte is an
    :class:`EncodingError` saying where (line, and byte offset in the file), not a traceback."""
    name, offset = os.fspath(path), 0
    with open(name, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise EncodingError(f"{name}:{number}: not UTF-8 ({exc.reason} at byte offset "
                                    f"{offset + exc.start} of the file, column {exc.start + 1} of the line)") from None
            offset += len(raw)


def json_record(line: str, where: str) -> dict:
    """One JSONL line as a JSON object; ValueError "``where``: not a JSON object (why)"."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not a JSON object ({exc.msg})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a JSON object")
    return record


def read_texts(paths: Iterable[str | os.PathLike], json_keys: Iterable[str] = ("text",)) -> Iterator[str]:
    """Texts from ``.jsonl``/``.json`` files (the given keys of each line) or plain text files.
    Malformed lines raise ValueError naming file and line (:class:`EncodingError` for bad UTF-8)."""
    keys = list(json_keys)
    for path in paths:
        name = os.fspath(path)
        if not name.endswith((".jsonl", ".json")):
            yield from (line for _, line in utf8_lines(name))
            continue
        for line_number, line in utf8_lines(name):
            if not line.strip():
                continue
            record = json_record(line, f"{name}:{line_number}")
            for key in keys:
                if key in record:
                    yield str(record[key])
